"""relattn.integrations.transformers.patch on tiny random transformers-5 models: the patched model's outputs and
gradients equal the unpatched model's (padding masks, eval and train mode), state_dict and save/reload intact.

Equal means the one tolerance policy (``helpers.assert_close``) at the models' dtype, the unpatched model (or
transformers 4's forward, written out) as the reference."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

from helpers import assert_close  # noqa: E402
from relattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:  # for the checks that two results must differ
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ tiny models


def _w2v_bert(impl="eager", dropout=0.0, position="relative_key"):
    cfg = transformers.Wav2Vec2BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        feature_projection_input_dim=12, position_embeddings_type=position, left_max_position_embeddings=5,
        right_max_position_embeddings=2, conv_depthwise_kernel_size=3, add_adapter=True, num_adapter_layers=1,
        output_hidden_size=32, hidden_dropout=0.0, attention_dropout=dropout, activation_dropout=0.0,
        feat_proj_dropout=0.0, conformer_conv_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, attn_implementation=impl)
    return transformers.Wav2Vec2BertModel(cfg)


def _w2v_inputs(dtype):
    x = torch.randn(2, 11, 12, dtype=dtype)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    return dict(input_features=x, attention_mask=mask)


def _seamless(impl="sdpa", dropout=0.0):
    from transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2 import SeamlessM4Tv2SpeechEncoder

    cfg = transformers.SeamlessM4Tv2Config(
        hidden_size=32, speech_encoder_layers=2, speech_encoder_attention_heads=4,
        speech_encoder_intermediate_size=40, feature_projection_input_dim=12, conv_depthwise_kernel_size=3,
        left_max_position_embeddings=5, right_max_position_embeddings=2, add_adapter=False,
        speech_encoder_layerdrop=0.0, speech_encoder_dropout=dropout, speech_encoder_chunk_size=4,
        speech_encoder_left_chunk_num=1, attn_implementation=impl)
    return SeamlessM4Tv2SpeechEncoder(cfg)


def _speecht5(dropout=0.0):
    cfg = transformers.SpeechT5Config(
        hidden_size=24, encoder_layers=2, encoder_attention_heads=3, encoder_ffn_dim=30, decoder_layers=1,
        decoder_attention_heads=3, decoder_ffn_dim=30, encoder_max_relative_position=4, hidden_dropout=0.0,
        attention_dropout=dropout, activation_dropout=0.0, positional_dropout=0.0, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0)
    return transformers.SpeechT5Model(cfg)


def _speecht5_inputs(dtype):
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, 9:] = 0
    return dict(input_values=torch.randn(2, 13, 24, dtype=dtype), attention_mask=mask,
                decoder_input_values=torch.randn(2, 5, 24, dtype=dtype))


def _vits(dropout=0.0, window=4):
    cfg = transformers.VitsConfig(
        vocab_size=20, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, window_size=window,
        ffn_dim=30, ffn_kernel_size=3, flow_size=8, spectrogram_bins=9, upsample_initial_channel=16,
        upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3]], prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=1,
        posterior_encoder_num_wavenet_layers=1, duration_predictor_num_flows=1, duration_predictor_filter_channels=8,
        depth_separable_num_layers=1, hidden_dropout=0.0, attention_dropout=dropout, activation_dropout=0.0,
        layerdrop=0.0)
    return transformers.VitsModel(cfg)


def _vits_inputs(dtype):
    ids = torch.randint(1, 20, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 8:] = 0
    return dict(input_ids=ids, padding_mask=mask.unsqueeze(-1).to(dtype), attention_mask=mask)


def _last_hidden(model, inputs):
    return model(**inputs).last_hidden_state


def _speecht5_out(model, inputs):
    out = model(**inputs)
    return torch.cat([out.encoder_last_hidden_state.flatten(), out.last_hidden_state.flatten()])


def _vits_text(model, inputs):
    return model.text_encoder(**inputs).last_hidden_state


# name: (builder, inputs, output, patched module count)
MODELS = {
    "w2v-bert-eager": (lambda d=0.0: _w2v_bert("eager", d), _w2v_inputs, _last_hidden, 2),
    "w2v-bert-sdpa": (lambda d=0.0: _w2v_bert("sdpa", d), _w2v_inputs, _last_hidden, 2),
    "seamless-m4t-v2": (lambda d=0.0: _seamless("sdpa", d), _w2v_inputs, _last_hidden, 2),
    "speecht5": (_speecht5, _speecht5_inputs, _speecht5_out, 3),  # 2 encoder layers + embed_positions
    "vits": (_vits, _vits_inputs, _vits_text, 2),
}


def _pair(name, dtype, dropout=0.0):
    build = MODELS[name][0]
    torch.manual_seed(0)
    plain = build(dropout).to(dtype)
    patched = copy.deepcopy(plain)
    report = patch(patched)
    assert len(report.patched) == MODELS[name][3], report
    return plain, patched


def _run(model, name, inputs, cotangent=None):
    out = MODELS[name][2](model, inputs)
    if cotangent is None:
        return out, None
    model.zero_grad(set_to_none=True)
    (out * cotangent).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("train", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_matches_unpatched(name, train, dtype):
    plain, patched = _pair(name, dtype)
    torch.manual_seed(1)
    inputs = MODELS[name][1](dtype)
    plain.train(train)
    patched.train(train)
    want, _ = _run(plain, name, inputs)
    cotangent = torch.randn_like(want)
    want, want_grads = _run(plain, name, inputs, cotangent)
    got, got_grads = _run(patched, name, inputs, cotangent)
    assert_close(got, want, dtype, "out")
    assert got_grads.keys() == want_grads.keys()
    rel_keys = [n for n in want_grads if "distance_embedding" in n or "emb_rel" in n or "pe_k" in n]
    assert rel_keys, "the relative tables must receive gradients"
    for n in want_grads:
        assert_close(got_grads[n], want_grads[n], dtype, n)


def test_gradient_checkpointing_still_matches():
    """SpeechT5's patched encoder hands the table through checkpointed layers; outputs and gradients unchanged."""
    plain, patched = _pair("speecht5", torch.float64)
    for model in (plain, patched):
        model.gradient_checkpointing_enable()
        model.train()
    inputs = dict(_speecht5_inputs(torch.float64), use_cache=False)
    cotangent = torch.randn(2 * 13 * 24 + 2 * 5 * 24, dtype=torch.float64)
    want, want_grads = _run(plain, "speecht5", inputs, cotangent)
    got, got_grads = _run(patched, "speecht5", inputs, cotangent)
    assert_close(got, want, torch.float64, "out")
    for n in ("encoder.wrapped_encoder.embed_positions.pe_k.weight",
              "encoder.wrapped_encoder.layers.0.attention.q_proj.weight"):
        assert_close(got_grads[n], want_grads[n], torch.float64, n)


def test_padding_is_masked():
    """Changing the padded frames of a sequence does not change its unpadded outputs (the mask reached the op)."""
    _, patched = _pair("w2v-bert-eager", torch.float64)
    patched.eval()
    inputs = _w2v_inputs(torch.float64)
    before = _last_hidden(patched, inputs)[1, :7]
    inputs["input_features"][1, 7:] += 5.0
    after = _last_hidden(patched, inputs)[1, :7]
    assert_close(after, before, torch.float64, "unpadded frames")


@pytest.mark.parametrize("name", ["w2v-bert-eager", "speecht5", "vits"])
def test_dropout_still_trains(name):
    """attention dropout > 0: in train mode two passes differ and gradients are finite; in eval the patched model
    still equals the unpatched one (dropout off)."""
    plain, patched = _pair(name, torch.float32, dropout=0.5)
    inputs = MODELS[name][1](torch.float32)
    patched.train()
    first, grads = _run(patched, name, inputs, torch.ones(()))
    second, _ = _run(patched, name, inputs)
    assert _rel(first, second) > 1e-3
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any("emb_rel" in n or "distance_embedding" in n or "pe_k" in n for n in grads)
    plain.eval()
    patched.eval()
    assert_close(_run(patched, name, inputs)[0], _run(plain, name, inputs)[0], torch.float32, "eval out")


@pytest.mark.slow
def test_seamless_patched_masks_as_sdpa_whatever_the_implementation():
    """SeamlessM4T-v2's speech encoder gives its attention a bool chunk-and-padding mask; HF's eager path adds it
    as 0/1, SDPA masks. Patched, the eager-configured model equals the unpatched SDPA one."""
    plain, patched = _pair("seamless-m4t-v2", torch.float64)
    patched.set_attn_implementation("eager")
    inputs = _w2v_inputs(torch.float64)
    want = _last_hidden(plain.eval(), inputs)
    assert_close(_last_hidden(patched.eval(), inputs), want, torch.float64, "eager patched")
    unpatch(patched)
    assert _rel(_last_hidden(patched, inputs), want) > 1e-3  # HF's eager path does not mask


def test_state_dict_unchanged_and_round_trips():
    plain, patched = _pair("vits", torch.float32)
    assert list(patched.state_dict()) == list(plain.state_dict())
    for layer in patched.text_encoder.encoder.layers:
        assert is_patched(layer.attention)
    other = _vits()
    patch(other)
    other.load_state_dict(plain.state_dict(), strict=True)
    inputs = _vits_inputs(torch.float32)
    assert_close(_vits_text(other.eval(), inputs), _vits_text(plain.eval(), inputs), torch.float32, "loaded")
    clone = copy.deepcopy(other)  # the patched forward is bound to the copy, not to the original
    attention = clone.text_encoder.encoder.layers[0].attention
    assert is_patched(attention) and attention.forward.__self__ is attention
    with torch.no_grad():
        attention.emb_rel_v.mul_(2.0)
    assert_close(_vits_text(other, inputs), _vits_text(plain, inputs), torch.float32, "original after the copy")
    assert _rel(_vits_text(clone.eval(), inputs), _vits_text(plain, inputs)) > 1e-4


@pytest.mark.parametrize("name", ["w2v-bert-eager", "speecht5"])
def test_save_pretrained_then_from_pretrained_and_patch(name, tmp_path):
    plain, patched = _pair(name, torch.float32)
    patched.eval().save_pretrained(tmp_path)
    reloaded = type(plain).from_pretrained(tmp_path).eval()
    assert not any(is_patched(m) for m in reloaded.modules())
    patch(reloaded)
    inputs = MODELS[name][1](torch.float32)
    assert_close(MODELS[name][2](reloaded, inputs), MODELS[name][2](plain.eval(), inputs), torch.float32, "reloaded")


def test_output_attentions_are_the_unpatched_weights():
    plain, patched = _pair("vits", torch.float64)
    inputs = dict(_vits_inputs(torch.float64), output_attentions=True)
    want = plain.eval().text_encoder(**inputs).attentions
    got = patched.eval().text_encoder(**inputs).attentions
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float64, "attention weights")


def test_speecht5_decoder_left_alone_with_reason():
    report = patch(_speecht5())
    assert report.patched == ["encoder.wrapped_encoder.embed_positions", "encoder.wrapped_encoder.layers.0.attention",
                              "encoder.wrapped_encoder.layers.1.attention"]
    assert "decoder.wrapped_decoder.layers.0.self_attn" in report.skipped
    assert "encoder only" in report.skipped["decoder.wrapped_decoder.layers.0.encoder_attn"]


@pytest.mark.parametrize("position", ["rotary", "relative"])
def test_unsupported_position_types_are_left_untouched(position):
    torch.manual_seed(0)
    model = _w2v_bert(position=position).eval()
    inputs = _w2v_inputs(torch.float32)
    before = _last_hidden(model, inputs)
    with pytest.warns(UserWarning) as caught:
        report = patch(model)
    messages = " | ".join(str(w.message) for w in caught)
    assert f"position_embeddings_type='{position}' is not Shaw attention" in messages
    assert "found no supported attention in Wav2Vec2BertModel" in messages
    assert report.patched == []
    assert "not Shaw attention" in report.skipped["encoder.layers.0.self_attn"]
    assert "adapter" in report.skipped["adapter.layers.0.self_attn"]
    assert not any(is_patched(m) for m in model.modules())
    assert torch.equal(_last_hidden(model, inputs), before)


def test_vits_without_window_and_other_models_warn():
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(_vits(window=0))
    assert "window_size=0" in report.skipped["text_encoder.encoder.layers.0.attention"]
    cfg = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20)
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(transformers.BertModel(cfg))
    assert "not a supported" in report.skipped["encoder.layer.0.attention.self"]


def test_adapter_attention_left_alone_and_unpatch_restores():
    model = _w2v_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = patch(model)
    assert report.patched == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert "adapter" in report.skipped["adapter.layers.0.self_attn"]
    assert unpatch(model) == report.patched
    assert not any(is_patched(m) for m in model.modules())


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        patch(_vits(), backend="fast")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch("model")


# ------------------------------------------------------------------------------------------ BERT relative_key (v4)

V4 = dict(vocab_size=23, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
          max_position_embeddings=12, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu",
          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02, pad_token_id=0)


def _v4_checkpoint(directory, kind, arch, seed=0):
    """A transformers-4 checkpoint directory: config.json as v4 wrote it, weights under v4's key names (tied
    decoder weight and bias left out, as v4's save_pretrained leaves them out)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, i, p = V4["hidden_size"], V4["intermediate_size"], V4["max_position_embeddings"]
    d = h // V4["num_attention_heads"]
    shapes = {"embeddings.word_embeddings.weight": (V4["vocab_size"], h),
              "embeddings.position_embeddings.weight": (p, h),
              "embeddings.token_type_embeddings.weight": (V4["type_vocab_size"], h),
              "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    for n in range(V4["num_hidden_layers"]):
        layer = f"encoder.layer.{n}."
        for proj in ("query", "key", "value"):
            shapes |= {f"{layer}attention.self.{proj}.weight": (h, h), f"{layer}attention.self.{proj}.bias": (h,)}
        shapes |= {f"{layer}attention.self.distance_embedding.weight": (2 * p - 1, d),
                   f"{layer}attention.output.dense.weight": (h, h), f"{layer}attention.output.dense.bias": (h,),
                   f"{layer}attention.output.LayerNorm.weight": (h,), f"{layer}attention.output.LayerNorm.bias": (h,),
                   f"{layer}intermediate.dense.weight": (i, h), f"{layer}intermediate.dense.bias": (i,),
                   f"{layer}output.dense.weight": (h, i), f"{layer}output.dense.bias": (h,),
                   f"{layer}output.LayerNorm.weight": (h,), f"{layer}output.LayerNorm.bias": (h,)}
    if arch == "BertModel":
        shapes |= {"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,)}
    else:
        shapes = {f"bert.{k}": s for k, s in shapes.items()}
        shapes |= {"cls.predictions.bias": (V4["vocab_size"],), "cls.predictions.transform.dense.weight": (h, h),
                   "cls.predictions.transform.dense.bias": (h,), "cls.predictions.transform.LayerNorm.weight": (h,),
                   "cls.predictions.transform.LayerNorm.bias": (h,)}
    state = {k: torch.randn(s, generator=g) * (0.3 if len(s) == 2 else 0.1) + (1.0 if "LayerNorm.weight" in k else 0)
             for k, s in shapes.items()}
    directory.mkdir(exist_ok=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = dict(V4, architectures=[arch], model_type="bert", position_embedding_type=kind,
                  transformers_version="4.44.2", use_cache=True, classifier_dropout=None)
    (directory / "config.json").write_text(json.dumps(config))
    return {k: v.double().requires_grad_() for k, v in state.items()}


def _v4_reference(state, kind, arch, ids, token_types, mask):
    """transformers 4's BertModel / BertForMaskedLM forward, written from its code, float64."""
    f = torch.nn.functional
    pre = "" if arch == "BertModel" else "bert."
    p, heads = V4["max_position_embeddings"], V4["num_attention_heads"]

    def w(name):
        return state[name if name.startswith("cls.") else pre + name]

    def ln(x, name):
        return f.layer_norm(x, x.shape[-1:], w(name + ".weight"), w(name + ".bias"), eps=1e-12)

    def lin(x, name):
        return x @ w(name + ".weight").T + w(name + ".bias")

    x = ln(w("embeddings.word_embeddings.weight")[ids] + w("embeddings.token_type_embeddings.weight")[token_types],
           "embeddings.LayerNorm")  # relative_key: no absolute position embeddings
    b, n, hidden = x.shape
    extended = (1.0 - mask[:, None, None, :].double()) * torch.finfo(torch.float64).min
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    for layer in range(V4["num_hidden_layers"]):
        at = f"encoder.layer.{layer}."

        def split(t):
            return t.view(b, n, heads, -1).transpose(1, 2)

        q, k, v = (split(lin(x, f"{at}attention.self.{proj}")) for proj in ("query", "key", "value"))
        scores = q @ k.transpose(-1, -2)
        pos = w(f"{at}attention.self.distance_embedding.weight")[distance + p - 1]
        scores = scores + torch.einsum("bhld,lrd->bhlr", q, pos)
        if kind == "relative_key_query":
            scores = scores + torch.einsum("bhrd,lrd->bhlr", k, pos)
        scores = scores / (hidden // heads) ** 0.5 + extended
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, hidden)
        x = ln(lin(ctx, f"{at}attention.output.dense") + x, f"{at}attention.output.LayerNorm")
        inner = f.gelu(lin(x, f"{at}intermediate.dense"))
        x = ln(lin(inner, f"{at}output.dense") + x, f"{at}output.LayerNorm")
    if arch == "BertModel":
        return x
    t = ln(f.gelu(lin(x, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    return t @ w("embeddings.word_embeddings.weight").T + state["cls.predictions.bias"]


def _bert_inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V4["vocab_size"], (2, 11), generator=g)
    token_types = torch.randint(0, 2, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, token_types, mask


def _bert_out(model, arch, ids, token_types, mask):
    out = model(input_ids=ids, token_type_ids=token_types, attention_mask=mask)
    return out.last_hidden_state if arch == "BertModel" else out.logits


@pytest.mark.parametrize("arch", ["BertModel", "BertForMaskedLM"])
@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_load_bert_relative_key_gives_transformers4_outputs_and_gradients(kind, arch, tmp_path):
    from relattn.integrations.bert import load_bert_relative_key

    state = _v4_checkpoint(tmp_path / "v4", kind, arch)
    model = load_bert_relative_key(tmp_path / "v4").double().eval()
    assert type(model).__name__ == arch
    inputs = _bert_inputs()
    want = _v4_reference(state, kind, arch, *inputs)
    got = _bert_out(model, arch, *inputs)
    assert_close(got, want, torch.float64, "out")
    cotangent = torch.randn_like(want)
    (want * cotangent).sum().backward()
    (got * cotangent).sum().backward()
    params = dict(model.named_parameters())
    for name in ("encoder.layer.0.attention.self.distance_embedding.weight",
                 "encoder.layer.1.attention.self.key.weight", "encoder.layer.1.attention.self.query.weight"):
        key = name if arch == "BertModel" else f"bert.{name}"
        assert_close(params[key].grad, state[key].grad, torch.float64, key)


def test_load_bert_relative_key_saves_and_reloads(tmp_path):
    from relattn.integrations.bert import load_bert_relative_key

    _v4_checkpoint(tmp_path / "v4", "relative_key_query", "BertForMaskedLM")
    model = load_bert_relative_key(tmp_path / "v4").eval()
    assert "bert.encoder.layer.1.attention.self.distance_embedding.weight" in model.state_dict()
    model.save_pretrained(tmp_path / "v5")
    again = load_bert_relative_key(tmp_path / "v5").eval()
    inputs = _bert_inputs()
    assert_close(_bert_out(again, "BertForMaskedLM", *inputs), _bert_out(model, "BertForMaskedLM", *inputs),
                 torch.float32, "reloaded")


def test_load_bert_relative_key_refuses_pickles_and_other_types(tmp_path):
    import json

    from relattn.integrations.bert import load_bert_relative_key

    state = _v4_checkpoint(tmp_path, "relative_key", "BertModel")
    (tmp_path / "model.safetensors").unlink()
    torch.save({k: v.detach().float() for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle checkpoint \(pytorch_model.bin\).*save_file"):
        load_bert_relative_key(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(V4, architectures=["BertModel"],
                                                          position_embedding_type="absolute")))
    with pytest.raises(ValueError, match="position_embedding_type must be one of"):
        load_bert_relative_key(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_bert_relative_key(tmp_path / "missing")
