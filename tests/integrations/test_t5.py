"""``patch(model)`` for T5's relative attention bias (T5, mT5, umT5, Switch Transformers, Pop2Piano, Pix2Struct's text
decoder, UDOP's and LongT5's decoders) and MPNet, each built from a tiny config: the unpatched outputs and every
parameter's gradient (float64, padded batches, eval and train with dropout 0), the ``state_dict`` unchanged,
``unpatch``, the shared table one parameter fed by every layer, cross-attention and the layers that do not map left as
they are with the reason, ``generate()`` giving the unpatched tokens with a cache (greedy and beam), relattn's op
running in every patched layer, and a sentence-transformers ``SentenceTransformer`` around an MPNet (the ``st``
extra) encoding as before."""

from __future__ import annotations

import copy

import pytest
import torch

from relattn.integrations.transformers import is_patched, patch, unpatch

tf = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

T5_COMMON = dict(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=3,
                 relative_attention_num_buckets=8, relative_attention_max_distance=12, dropout_rate=0.0,
                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _ids(b=3, n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 40, (b, n), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding: the encoders run packed
    mask[2, 5:] = 0
    return ids, mask, torch.randint(2, 40, (b, 9), generator=g)


def _seq2seq(model, dtype):
    ids, mask, labels = _ids()
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _pop2piano_inputs(model, dtype):
    ids, mask, labels = _ids()
    features = torch.randn(3, 23, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return dict(input_features=features, attention_mask=mask, labels=labels)


def _udop_inputs(model, dtype):
    """UDOP's decoder (what is patched) on given encoder states: its encoder is left as it is."""
    from transformers.models.udop.modeling_udop import BaseModelOutputWithAttentionMask

    ids, mask, labels = _ids()
    states = torch.randn(3, 23, 16, generator=torch.Generator().manual_seed(2), dtype=dtype)
    return dict(encoder_outputs=BaseModelOutputWithAttentionMask(last_hidden_state=states, attention_mask=mask),
                labels=labels)


def _pix2struct_inputs(model, dtype):
    ids, mask, labels = _ids()
    g = torch.Generator().manual_seed(3)
    patches = torch.randn(3, 6, 2 + 16, generator=g, dtype=dtype)
    patches[..., :2] = torch.arange(6.0)[None, :, None]
    return dict(flattened_patches=patches, attention_mask=torch.ones(3, 6), decoder_input_ids=ids[:, :9],
                labels=labels)


def _encoder_inputs(model, dtype):
    ids, mask, _ = _ids()
    return dict(input_ids=ids, attention_mask=mask)


def _mpnet(cls="MPNetModel"):
    return getattr(tf, cls)(tf.MPNetConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=24, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0, num_labels=3))


# name -> (build, inputs, patched attention layers, generates)
MODELS = {
    "t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(**T5_COMMON)), _seq2seq, 4, True),
    "t5-model": (lambda: tf.T5Model(tf.T5Config(**T5_COMMON)),
                 lambda m, d: {**_encoder_inputs(m, d), "decoder_input_ids": _ids()[2]}, 4, False),
    "t5-encoder": (lambda: tf.T5EncoderModel(tf.T5Config(**T5_COMMON)), _encoder_inputs, 2, False),
    "mt5": (lambda: tf.MT5ForConditionalGeneration(tf.MT5Config(**T5_COMMON)), _seq2seq, 4, True),
    "umt5": (lambda: tf.UMT5ForConditionalGeneration(tf.UMT5Config(**T5_COMMON)), _seq2seq, 4, True),
    "switch": (lambda: tf.SwitchTransformersForConditionalGeneration(tf.SwitchTransformersConfig(
        **T5_COMMON, num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        router_jitter_noise=0.0)), _seq2seq, 4, True),
    "pop2piano": (lambda: tf.Pop2PianoForConditionalGeneration(tf.Pop2PianoConfig(**T5_COMMON)), _pop2piano_inputs,
                  4, False),
    "longt5": (lambda: tf.LongT5ForConditionalGeneration(tf.LongT5Config(**T5_COMMON, encoder_attention_type="local",
                                                                         local_radius=3)), _seq2seq, 2, True),
    "udop": (lambda: tf.UdopForConditionalGeneration(tf.UdopConfig(**T5_COMMON)), _udop_inputs, 2, False),
    "pix2struct": (lambda: tf.Pix2StructForConditionalGeneration(tf.Pix2StructConfig(
        text_config=dict(vocab_size=40, hidden_size=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, relative_attention_max_distance=12, dropout_rate=0.0,
                         decoder_start_token_id=0, pad_token_id=0),
        vision_config=dict(hidden_size=16, patch_embed_hidden_size=16, d_ff=24, d_kv=4, num_hidden_layers=1,
                           num_attention_heads=2, patch_size=4, dropout_rate=0.0, attention_dropout=0.0))),
        _pix2struct_inputs, 2, False),
    "mpnet": (_mpnet, _encoder_inputs, 2, False),
    "mpnet-masked-lm": (lambda: _mpnet("MPNetForMaskedLM"), _encoder_inputs, 2, False),
    "mpnet-classifier": (lambda: _mpnet("MPNetForSequenceClassification"),
                         lambda m, d: {**_encoder_inputs(m, d), "labels": torch.tensor([0, 2, 1])}, 2, False),
}


def _build(name, impl="eager"):
    torch.manual_seed(0)
    model = MODELS[name][0]().double()
    model.config._attn_implementation = impl
    for sub in ("text_config", "vision_config"):
        if hasattr(model.config, sub):
            getattr(model.config, sub)._attn_implementation = impl
    return model


def _outputs(model, inputs):
    """The outputs that must agree: logits (or the last hidden state at the real tokens), and a scalar to
    differentiate."""
    out = model(**inputs)
    main = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    mask = inputs.get("attention_mask")
    if mask is not None and main.dim() == 3 and main.shape[1] == mask.shape[1]:
        main = main * mask[..., None]  # an encoder's padded positions: zeros when packed
    loss = out.loss if getattr(out, "loss", None) is not None else (main * main.detach().cos()).sum()
    return main, loss


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_matches_unpatched(name, train):
    impl = "sdpa" if name in ("t5", "mt5") and train else "eager"
    model = _build(name, impl)
    reference = copy.deepcopy(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = patch(model)
    assert len(report.patched) == MODELS[name][2] + name.startswith("mpnet")  # MPNet: the encoder too
    for m in (model, reference):
        m.train(train)
    inputs = MODELS[name][1](model, torch.float64)
    want, want_loss = _outputs(reference, inputs)
    got, got_loss = _outputs(model, inputs)
    assert (got - want).abs().max() <= 1e-10
    want_loss.backward()
    got_loss.backward()
    for (n, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), n
            continue
        assert (p.grad - r.grad).abs().max() <= 1e-10, n
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert unpatch(model) and not is_patched(model)


def test_shared_table_is_one_parameter_fed_by_every_layer():
    """T5's table lives in each stack's first layer, one parameter; the second layer's gradient reaches it too (its
    gradient with the second layer reading it differs from the one without; that it equals the unpatched one is
    test_patched_model_matches_unpatched's)."""
    model = _build("t5-encoder")
    patch(model)
    tables = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert tables == ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    inputs = _encoder_inputs(model, torch.float64)
    out, loss = _outputs(model, inputs)
    table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    whole = torch.autograd.grad(loss, table)[0]
    model.encoder.block[1].layer[0].SelfAttention._relattn_owner = lambda: None  # the second layer without it
    _, loss_first_only = _outputs(model, inputs)
    first_only = torch.autograd.grad(loss_first_only, table)[0]
    assert (whole - first_only).abs().max() > 1e-6


@pytest.mark.parametrize("name", [n for n, spec in MODELS.items() if spec[3]])
@pytest.mark.parametrize("beams", [1, 3])
def test_generate_gives_the_unpatched_tokens(name, beams):
    model = _build(name, "sdpa").eval()
    reference = copy.deepcopy(model)
    patch(model)
    ids, mask, _ = _ids()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, num_beams=beams,
              min_new_tokens=12)
    assert torch.equal(model.generate(**kw), reference.generate(**kw))


class _OpCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the relattn custom ops' forwards dispatched (``relattn::{name}_fwd_{version}``)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.name().startswith("relattn::") and "_fwd_" in func.name()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["t5", "umt5", "longt5", "udop", "pix2struct", "mpnet"])
def test_the_op_runs_in_every_patched_layer_and_the_bias_matters(name):
    model = _build(name).eval()
    report = patch(model, backend="blocked")
    inputs = MODELS[name][1](model, torch.float64)
    if "attention_mask" in inputs:
        inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])  # one call per layer (no packing)
    inputs.pop("labels", None)
    if "decoder_input_ids" not in inputs and name not in ("mpnet",):
        inputs["decoder_input_ids"] = _ids()[2]
    with torch.no_grad(), _OpCalls() as calls:
        before = _outputs(model, inputs)[0]
    attention_layers = len(report.patched) - (name == "mpnet")
    assert calls.calls == attention_layers
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "relative_attention_bias" in n and "encoder" not in n or name.startswith("mpnet") and "relative" in n:
                p.normal_()
        assert (_outputs(model, inputs)[0] - before).abs().max() > 1e-3


def test_what_is_left_and_why():
    report = patch(_build("udop"))
    assert "2-D layout" in report.skipped["encoder.block.0.layer.0.SelfAttention"]
    assert "cross-attention" in report.skipped["decoder.block.0.layer.1.EncDecAttention"]
    report = patch(_build("longt5"))
    assert "local attention" in report.skipped["encoder.block.0.layer.0.LocalSelfAttention"]


# ------------------------------------------------------------------------------------------ sentence-transformers

WORDS = "the a cat dog sat on mat ran fast slow big small red blue green tree house car road sky sun moon".split()
SENTENCES = ["the cat sat on the mat", "a big red dog ran fast on the road under the blue sky by the green tree",
             "sun", "the small car", "moon sky sun tree house road car dog cat mat", "a dog"]


def _sentence_transformer(folder):
    """all-mpnet-base-v2's structure (an MPNet, mean pooling, normalisation) from a tiny config and a word-level
    vocabulary, saved to ``folder`` and loaded the way sentence-transformers loads a model (no hub)."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import modules

    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *WORDS])}
    tf.MPNetTokenizer(vocab=vocab, unk_token="<unk>").save_pretrained(folder)
    torch.manual_seed(0)
    mpnet = tf.MPNetModel(tf.MPNetConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=24, max_position_embeddings=64,
                                         pad_token_id=1), add_pooling_layer=False)
    with torch.no_grad():  # away from the tiny init, so that the attention (and its bias) shapes the embeddings
        for p in mpnet.parameters():
            p.normal_(std=0.3)
    mpnet.save_pretrained(folder)
    transformer = modules.Transformer(str(folder))
    pooling = modules.Pooling(transformer.get_embedding_dimension(), "mean")
    return st.SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu").double()


@pytest.mark.slow
def test_a_sentence_transformer_around_mpnet_is_patched_and_encodes_as_before(tmp_path):
    """The same ``patch`` call patches a ``SentenceTransformer`` around an MPNet; ``encode()`` of ragged sentences
    (padded per batch of 4 after sentence-transformers sorts them by length) gives the unpatched embeddings, with
    relattn's kernel in every layer of every batch, and the relative bias matters to them."""
    from relattn.bench.measure import BackendCalls

    model = _sentence_transformer(tmp_path)
    want = model.encode(SENTENCES, batch_size=4, convert_to_tensor=True)
    report = patch(model)
    assert report.patched == ["0.model.encoder", "0.model.encoder.layer.0.attention.attn",
                              "0.model.encoder.layer.1.attention.attn"]
    with BackendCalls() as calls:
        got = model.encode(SENTENCES, batch_size=4, convert_to_tensor=True)
    assert sum(calls.forward.values()) == 2 * 2  # two batches, two layers
    assert (got - want).abs().max() <= 1e-10
    unpatch(model)
    assert torch.equal(model.encode(SENTENCES, batch_size=4, convert_to_tensor=True), want)
    patch(model)
    with torch.no_grad():
        model[0].model.encoder.relative_attention_bias.weight.normal_()
    assert (model.encode(SENTENCES, batch_size=4, convert_to_tensor=True) - want).abs().max() > 1e-3
