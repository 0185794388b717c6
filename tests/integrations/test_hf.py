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

from helpers import assert_close, grads_close  # noqa: E402
from helpers.hf import (  # noqa: E402
    SEAMLESS_V1,
    V4,
    bert_inputs,
    bert_out,
    relative_error,
    v4_checkpoint,
    v4_reference,
    vits,
    with_biases,
)
from relattn.backends import blocked  # noqa: E402
from relattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402

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


def _vits_inputs(dtype):
    ids = torch.randint(1, 20, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 8:] = 0
    return dict(input_ids=ids, padding_mask=mask.unsqueeze(-1).to(dtype), attention_mask=mask)


def _parakeet_config(impl="sdpa", dropout=0.0, dropout_positions=0.0):
    return transformers.ParakeetEncoderConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, conv_kernel_size=3,
        subsampling_factor=4, subsampling_conv_channels=8, num_mel_bins=16, dropout=0.0, layerdrop=0.0,
        activation_dropout=0.0, attention_dropout=dropout, dropout_positions=dropout_positions,
        attn_implementation=impl)


def _parakeet(impl="sdpa", dropout=0.0, dropout_positions=0.0):
    return with_biases(transformers.ParakeetEncoder(_parakeet_config(impl, dropout, dropout_positions)))


def _parakeet_inputs(dtype):
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0  # 10 frames after subsampling, the last 4 of entry 1 padded (queries and keys)
    return dict(input_features=torch.randn(2, 40, 16, dtype=dtype), attention_mask=mask)


W2V_CONFORMER = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, conv_dim=(8, 8),
    conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
    position_embeddings_type="relative", conv_depthwise_kernel_size=3, hidden_dropout=0.0, activation_dropout=0.0,
    feat_proj_dropout=0.0, conformer_conv_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, do_stable_layer_norm=True,
    feat_extract_norm="layer",
    vocab_size=11, num_labels=3, classifier_proj_size=8, tdnn_dim=(8, 8), tdnn_kernel=(3, 1), tdnn_dilation=(1, 1),
    xvector_output_dim=8, proj_codevector_dim=8, codevector_dim=8, num_codevectors_per_group=4, num_codevector_groups=2)


def _w2v_conformer(impl="eager", dropout=0.0, cls="Wav2Vec2ConformerModel"):
    cfg = transformers.Wav2Vec2ConformerConfig(**W2V_CONFORMER, attention_dropout=dropout, attn_implementation=impl)
    return with_biases(getattr(transformers, cls)(cfg))


def _wav_inputs(dtype):
    mask = torch.ones(2, 400, dtype=torch.long)
    mask[1, 250:] = 0
    return dict(input_values=torch.randn(2, 400, dtype=dtype), attention_mask=mask)


def _seamless_v1(impl="sdpa", dropout=0.0, cls=None):
    cfg = transformers.SeamlessM4TConfig(**SEAMLESS_V1, speech_encoder_dropout=dropout, attn_implementation=impl)
    if cls is None:
        from transformers.models.seamless_m4t.modeling_seamless_m4t import SeamlessM4TSpeechEncoder

        return with_biases(SeamlessM4TSpeechEncoder(cfg))
    return with_biases(getattr(transformers, cls)(cfg))


FASTSPEECH2 = dict(
    hidden_size=16, vocab_size=20, num_mel_bins=8, encoder_num_attention_heads=2, encoder_layers=2,
    encoder_linear_units=24, decoder_layers=1, decoder_num_attention_heads=2, decoder_linear_units=24,
    speech_decoder_postnet_layers=1, speech_decoder_postnet_units=8, encoder_kernel_size=3, decoder_kernel_size=3,
    duration_predictor_channels=8, energy_predictor_channels=8, pitch_predictor_channels=8, pitch_predictor_layers=1,
    energy_predictor_layers=1, duration_predictor_layers=1, encoder_dropout_rate=0.0,
    encoder_positional_dropout_rate=0.0, decoder_dropout_rate=0.0, decoder_positional_dropout_rate=0.0,
    duration_predictor_dropout_rate=0.0, speech_decoder_postnet_dropout=0.0, energy_predictor_dropout=0.0,
    pitch_predictor_dropout=0.0)


def _fastspeech2(dropout=0.0):
    cfg = transformers.FastSpeech2ConformerConfig(**FASTSPEECH2, encoder_attention_dropout_rate=dropout,
                                                  decoder_attention_dropout_rate=dropout)
    return with_biases(transformers.FastSpeech2ConformerModel(cfg))


def _fastspeech2_inputs(dtype):
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return dict(input_ids=torch.randint(1, 20, (2, 9)), attention_mask=mask)


def _fastspeech2_stack(model, inputs):
    """The text encoder, then the spectrogram decoder on its output (the whole model, whose length regulator
    computes in float32, is checked in float32 below)."""
    mask = inputs["attention_mask"].unsqueeze(-2)
    hidden = model.encoder(inputs["input_ids"], mask, return_dict=True).last_hidden_state
    return model.decoder(hidden, mask, return_dict=True).last_hidden_state


def _last_hidden(model, inputs):
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def _speecht5_out(model, inputs):
    """The decoder's output and the encoder's at its real frames (the patched encoder runs a right-padded batch
    packed: zeros at its padded frames, which the decoder never reads)."""
    out = model(**inputs)
    encoder = out.encoder_last_hidden_state * inputs["attention_mask"][..., None]
    return torch.cat([encoder.flatten(), out.last_hidden_state.flatten()])


def _vits_text(model, inputs):
    return model.text_encoder(**inputs).last_hidden_state


# name: (builder, inputs, output, patched module count)
MODELS = {
    "w2v-bert-eager": (lambda d=0.0: _w2v_bert("eager", d), _w2v_inputs, _last_hidden, 2),
    "w2v-bert-sdpa": (lambda d=0.0: _w2v_bert("sdpa", d), _w2v_inputs, _last_hidden, 2),
    "seamless-m4t-v2": (lambda d=0.0: _seamless("sdpa", d), _w2v_inputs, _last_hidden, 2),
    "speecht5": (_speecht5, _speecht5_inputs, _speecht5_out, 3),  # 2 encoder layers + embed_positions
    "vits": (vits, _vits_inputs, _vits_text, 2),
    # Transformer-XL relative attention (integrations/conformer.py). Parakeet runs SDPA: its eager softmax is float32
    # (tested apart below); SeamlessM4T v1 runs SDPA's bool masks, Wav2Vec2-Conformer and w2v-BERT eager's additive
    "parakeet": (lambda d=0.0: _parakeet("sdpa", d), _parakeet_inputs, _last_hidden, 2),
    "w2v-conformer-eager": (lambda d=0.0: _w2v_conformer("eager", d), _wav_inputs, _last_hidden, 2),
    "seamless-m4t-v1": (lambda d=0.0: _seamless_v1("sdpa", d), _w2v_inputs, _last_hidden, 2),
    "w2v-bert-relative": (lambda d=0.0: with_biases(_w2v_bert("eager", d, "relative")), _w2v_inputs, _last_hidden, 2),
    "fastspeech2": (_fastspeech2, _fastspeech2_inputs, _fastspeech2_stack, 3),
}
POSITION_PARAMETERS = ("distance_embedding", "emb_rel", "pe_k", "linear_pos", "relative_k_proj", "pos_bias", "bias_u",
                       "bias_v")


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
    rel_keys = [n for n in want_grads if any(word in n for word in POSITION_PARAMETERS)]
    assert rel_keys, "the relative tables must receive gradients"
    grads_close(got_grads, want_grads, dtype)


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
    assert relative_error(first, second) > 1e-3
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
    assert relative_error(_last_hidden(patched, inputs), want) > 1e-3  # HF's eager path does not mask


def test_state_dict_unchanged_and_round_trips():
    plain, patched = _pair("vits", torch.float32)
    assert list(patched.state_dict()) == list(plain.state_dict())
    for layer in patched.text_encoder.encoder.layers:
        assert is_patched(layer.attention)
    other = vits()
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
    assert relative_error(_vits_text(clone.eval(), inputs), _vits_text(plain, inputs)) > 1e-4


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


@pytest.mark.parametrize("position", ["rotary"])
def test_unsupported_position_types_are_left_untouched(position):
    torch.manual_seed(0)
    model = _w2v_bert(position=position).eval()
    inputs = _w2v_inputs(torch.float32)
    before = _last_hidden(model, inputs)
    with pytest.warns(UserWarning) as caught:
        report = patch(model)
    messages = " | ".join(str(w.message) for w in caught)
    assert f"position_embeddings_type='{position}' is not a relative attention relattn serves" in messages
    assert "found no supported attention in Wav2Vec2BertModel" in messages
    assert report.patched == []
    assert "RoPE" in report.skipped["encoder.layers.0.self_attn"]
    assert "adapter" in report.skipped["adapter.layers.0.self_attn"]
    assert not any(is_patched(m) for m in model.modules())
    assert torch.equal(_last_hidden(model, inputs), before)


def test_vits_without_window_and_other_models_warn():
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(vits(window=0))
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
        patch(vits(), backend="fast")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch("model")


# ------------------------------------------------------------------------------------------ BERT relative_key (v4)

@pytest.mark.parametrize("arch", ["BertModel", "BertForMaskedLM"])
@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_load_bert_relative_key_gives_transformers4_outputs_and_gradients(kind, arch, tmp_path):
    from relattn.integrations.bert import load_bert_relative_key

    state = v4_checkpoint(tmp_path / "v4", kind, arch)
    model = load_bert_relative_key(tmp_path / "v4").double().eval()
    assert type(model).__name__ == arch
    inputs = bert_inputs()
    want = v4_reference(state, kind, arch, *inputs)
    got = bert_out(model, arch, *inputs)
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

    v4_checkpoint(tmp_path / "v4", "relative_key_query", "BertForMaskedLM")
    model = load_bert_relative_key(tmp_path / "v4").eval()
    assert "bert.encoder.layer.1.attention.self.distance_embedding.weight" in model.state_dict()
    model.save_pretrained(tmp_path / "v5")
    again = load_bert_relative_key(tmp_path / "v5").eval()
    inputs = bert_inputs()
    assert_close(bert_out(again, "BertForMaskedLM", *inputs), bert_out(model, "BertForMaskedLM", *inputs),
                 torch.float32, "reloaded")


def test_load_bert_relative_key_refuses_pickles_and_other_types(tmp_path):
    import json

    from relattn.integrations.bert import load_bert_relative_key

    state = v4_checkpoint(tmp_path, "relative_key", "BertModel")
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


# ------------------------------------------------------------------------------------------ Transformer-XL models

XL_MODELS = ["parakeet", "w2v-conformer-eager", "seamless-m4t-v1", "w2v-bert-relative", "fastspeech2"]


class _OpCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the relattn custom ops dispatched (the "blocked" backend's forward)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.name() == blocked.OPS.fwd_name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", XL_MODELS)
def test_the_op_runs_in_every_patched_layer_and_the_positions_matter(name):
    """Patched with backend="blocked", each patched layer calls relattn's op once; zeroing the position
    projections and the position biases changes the output (the position term is computed)."""
    build, inputs_of, output, count = MODELS[name]
    torch.manual_seed(0)
    model = build().double().eval()
    report = patch(model, backend="blocked")
    inputs = inputs_of(torch.float64)
    with torch.no_grad(), _OpCalls() as calls:
        before = output(model, inputs)
    assert calls.calls == count == len(report.patched)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(word in n for word in ("linear_pos", "relative_k_proj", "pos_bias_v", "bias_v")):
                p.zero_()
        assert relative_error(output(model, inputs), before) > 1e-3


def _parakeet_ctc(impl="sdpa"):
    cfg = transformers.ParakeetCTCConfig(encoder_config=_parakeet_config(impl).to_dict(), vocab_size=11,
                                         pad_token_id=10)
    return with_biases(transformers.ParakeetForCTC(cfg))


def _w2v_bert_head_config():
    config = _w2v_bert(position="relative").config
    config.vocab_size, config.add_adapter = 11, False  # the classification heads take no adapter
    return config


HEADS = {  # head class: (builder, patched layers)
    "ParakeetForCTC": (_parakeet_ctc, 2),
    "ParakeetForRNNT": (lambda: transformers.ParakeetForRNNT(transformers.ParakeetRNNTConfig(
        encoder_config=_parakeet_config().to_dict(), vocab_size=11, decoder_hidden_size=8, pad_token_id=10)), 2),
    "ParakeetForTDT": (lambda: transformers.ParakeetForTDT(transformers.ParakeetTDTConfig(
        encoder_config=_parakeet_config().to_dict(), vocab_size=11, decoder_hidden_size=8, pad_token_id=10)), 2),
    **{cls: (lambda cls=cls: _w2v_conformer(cls=cls), 2) for cls in (
        "Wav2Vec2ConformerForCTC", "Wav2Vec2ConformerForSequenceClassification",
        "Wav2Vec2ConformerForAudioFrameClassification", "Wav2Vec2ConformerForXVector",
        "Wav2Vec2ConformerForPreTraining")},
    **{cls: (lambda cls=cls: _seamless_v1(cls=cls), 2) for cls in (
        "SeamlessM4TModel", "SeamlessM4TForSpeechToText", "SeamlessM4TForSpeechToSpeech")},
    **{cls: (lambda cls=cls: getattr(transformers, cls)(_w2v_bert_head_config()), 2) for cls in (
        "Wav2Vec2BertForCTC", "Wav2Vec2BertForSequenceClassification", "Wav2Vec2BertForAudioFrameClassification",
        "Wav2Vec2BertForXVector")},
    "FastSpeech2ConformerWithHifiGan": (lambda: transformers.FastSpeech2ConformerWithHifiGan(
        transformers.FastSpeech2ConformerWithHifiGanConfig(
            model_config=transformers.FastSpeech2ConformerConfig(**FASTSPEECH2).to_dict(),
            vocoder_config=dict(model_in_dim=8, upsample_initial_channel=8, upsample_rates=[2],
                                upsample_kernel_sizes=[4], resblock_kernel_sizes=[3],
                                resblock_dilation_sizes=[[1]]))), 3),
}


@pytest.mark.parametrize("head", list(HEADS))
def test_every_head_class_has_its_conformer_attention_patched(head):
    build, count = HEADS[head]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own config warnings
        model = build()
    report = patch(model)
    assert len(report.patched) == count, report
    assert all(not any(word in n for word in ("adapter",)) for n in report.patched)


def test_parakeet_ctc_logits_and_gradients_match():
    torch.manual_seed(0)
    plain = _parakeet_ctc().double().eval()
    patched = copy.deepcopy(plain)
    patch(patched)
    inputs = _parakeet_inputs(torch.float64)
    want, got = plain(**inputs).logits, patched(**inputs).logits
    assert_close(got, want, torch.float64, "logits")
    cotangent = torch.randn_like(want)
    names = [n for n, _ in plain.named_parameters()]
    want_grads = torch.autograd.grad((want * cotangent).sum(), list(plain.parameters()), allow_unused=True)
    got_grads = torch.autograd.grad((got * cotangent).sum(), list(patched.parameters()), allow_unused=True)
    grads_close({n: g for n, g in zip(names, got_grads, strict=True) if g is not None},
                 {n: g for n, g in zip(names, want_grads, strict=True) if g is not None}, torch.float64)


def test_parakeet_eager_float32_matches_and_its_float64_padding_is_nan():
    """Parakeet's eager softmax runs in float32: patched equals it in float32. In float64 its padded query rows'
    ``finfo(float64).min`` scores become float32 -inf, and NaN spreads (transformers' bug, not relattn's): the
    patched model gives the SDPA path's float64 numbers there."""
    torch.manual_seed(0)
    plain = _parakeet("eager").eval()
    patched = copy.deepcopy(plain)
    patch(patched)
    inputs = _parakeet_inputs(torch.float32)
    assert_close(_last_hidden(patched, inputs), _last_hidden(plain, inputs), torch.float32, "eager float32")
    plain64 = plain.double()
    inputs = _parakeet_inputs(torch.float64)
    assert _last_hidden(plain64, inputs).isnan().any()
    sdpa = copy.deepcopy(plain64)
    sdpa.set_attn_implementation("sdpa")
    assert_close(_last_hidden(patched.double(), inputs), _last_hidden(sdpa, inputs), torch.float64, "float64")


def test_parakeet_per_batch_position_tables_in_training():
    """dropout_positions > 0 in training gives each batch element its own table: the patched layer runs the op
    once per element, and equals the unpatched model (the same dropout masks), outputs and gradients."""
    torch.manual_seed(0)
    plain = _parakeet("sdpa", dropout_positions=0.5).double().train()
    patched = copy.deepcopy(plain)
    patch(patched, backend="blocked")
    inputs = _parakeet_inputs(torch.float64)
    cotangent = torch.randn(2, 10, 32, dtype=torch.float64)
    torch.manual_seed(3)
    want, want_grads = _run(plain, "parakeet", inputs, cotangent)
    torch.manual_seed(3)
    with _OpCalls() as calls:
        got, got_grads = _run(patched, "parakeet", inputs, cotangent)
    assert calls.calls == 2 * 2  # two layers, two batch elements
    assert_close(got, want, torch.float64, "out")
    grads_close(got_grads, want_grads, torch.float64)


@pytest.mark.parametrize("name", ["w2v-conformer-eager", "w2v-bert-relative", "fastspeech2"])
def test_conformer_output_attentions_are_the_unpatched_weights(name):
    plain, patched = _pair(name, torch.float64)
    inputs = MODELS[name][1](torch.float64)
    if name == "fastspeech2":
        def attentions(model):
            mask = inputs["attention_mask"].unsqueeze(-2)
            return model.eval().encoder(inputs["input_ids"], mask, output_attentions=True, return_dict=True).attentions
    else:
        def attentions(model):
            return model.eval()(**inputs, output_attentions=True).attentions
    want, got = attentions(plain), attentions(patched)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, torch.float64, "attention weights")


def test_fastspeech2_whole_model_trains_as_unpatched():
    """The whole FastSpeech2-Conformer in training (its length regulator computes in float32): spectrogram, loss
    and gradients; encoder and decoder attention patched."""
    plain, patched = _pair("fastspeech2", torch.float32)
    inputs = _fastspeech2_inputs(torch.float32)
    g = torch.Generator().manual_seed(0)
    durations = torch.randint(1, 3, (2, 9), generator=g) * inputs["attention_mask"]
    spectrogram = torch.randn(2, int(durations.sum(1).max()), 8, generator=g)
    spectrogram[1, int(durations[1].sum()):] = -100
    labels = dict(spectrogram_labels=spectrogram, duration_labels=durations, pitch_labels=torch.randn(2, 9, 1),
                  energy_labels=torch.randn(2, 9, 1))
    results = []
    for model in (plain, patched):
        out = model.train()(**inputs, **labels, return_dict=True)
        model.zero_grad(set_to_none=True)
        out.loss.backward()
        results.append((out.spectrogram, out.loss, {n: p.grad for n, p in model.named_parameters()
                                                    if p.grad is not None}))
    (want, want_loss, want_grads), (got, got_loss, got_grads) = results
    assert_close(got, want, torch.float32, "spectrogram")
    assert_close(got_loss, want_loss, torch.float32, "loss")
    assert any("linear_pos" in n for n in want_grads)
    grads_close(got_grads, want_grads, torch.float32)


def test_conformer_state_dict_unchanged_unpatch_and_seamless_v2_relative_left_alone():
    plain, patched = _pair("parakeet", torch.float32)
    assert list(patched.state_dict()) == list(plain.state_dict())
    assert unpatch(patched) == ["layers.0.self_attn", "layers.1.self_attn"] and not is_patched(patched)
    torch.manual_seed(0)
    v2 = _seamless()
    v2.config.position_embeddings_type = "relative"
    for layer in v2.encoder.layers:
        layer.self_attn.position_embeddings_type = "relative"
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(v2)
    assert "computes no positions" in report.skipped["encoder.layers.0.self_attn"]
