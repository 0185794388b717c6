"""Padding that costs nothing in the patched Hugging Face models: a right-padded batch of different lengths runs
packed, and each sequence's real-token outputs equal the unpadded model's on that sequence alone (float64), as do the
gradients of a loss on the real tokens; the padded positions are zeros where the patched layer's output is read. With
their dropouts set, in eval mode, the patched models are still the unpatched ones."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

import relattn.padding as padding  # noqa: E402
from helpers import assert_close  # noqa: E402
from relattn.integrations.transformers import patch  # noqa: E402

LENGTHS = (9, 4, 1, 7)
N = max(LENGTHS)
pytestmark = pytest.mark.usefixtures("one_thread")


def _mask():
    return (torch.arange(N)[None, :] < torch.tensor(LENGTHS)[:, None]).long()


def _deberta_v3():
    cfg = transformers.DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=4, max_relative_positions=8,
        share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False)
    return transformers.DebertaV2Model(cfg)


def _deberta_v1():
    cfg = transformers.DebertaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=5)
    return transformers.DebertaModel(cfg)


def _ids(model, mask, b, n):
    ids = torch.randint(1, 40, (len(LENGTHS), N), generator=torch.Generator().manual_seed(2)) * mask
    if b is None:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state
    return model(input_ids=ids[b:b + 1, :n], attention_mask=mask[b:b + 1, :n]).last_hidden_state


def _w2v_bert():
    cfg = transformers.Wav2Vec2BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=20,
        feature_projection_input_dim=6, position_embeddings_type="relative_key", left_max_position_embeddings=3,
        right_max_position_embeddings=2, conv_depthwise_kernel_size=3, add_adapter=False, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, conformer_conv_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, attn_implementation="eager")
    return transformers.Wav2Vec2BertModel(cfg)


def _seamless_v1():
    from transformers.models.seamless_m4t.modeling_seamless_m4t import SeamlessM4TSpeechEncoder

    from helpers.hf import SEAMLESS_V1, with_biases

    cfg = transformers.SeamlessM4TConfig(**dict(SEAMLESS_V1, add_adapter=False), speech_encoder_dropout=0.0,
                                         attn_implementation="sdpa")
    return with_biases(SeamlessM4TSpeechEncoder(cfg))


def _features(model, mask, b, n, dim=6):
    x = torch.randn(len(LENGTHS), N, dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if b is None:
        return model(input_features=x, attention_mask=mask).last_hidden_state
    return model(input_features=x[b:b + 1, :n], attention_mask=mask[b:b + 1, :n]).last_hidden_state


def _seamless_features(model, mask, b, n):
    return _features(model, mask, b, n, dim=12)


def _speecht5():
    from transformers.models.speecht5.modeling_speecht5 import SpeechT5EncoderWithoutPrenet

    cfg = transformers.SpeechT5Config(hidden_size=12, encoder_layers=2, encoder_attention_heads=3, encoder_ffn_dim=20,
                                      encoder_max_relative_position=3, hidden_dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0, encoder_layerdrop=0.0)
    return SpeechT5EncoderWithoutPrenet(cfg)


def _hidden(model, mask, b, n):
    x = torch.randn(len(LENGTHS), N, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    if b is None:
        return model(input_values=x, attention_mask=mask).last_hidden_state
    return model(input_values=x[b:b + 1, :n], attention_mask=mask[b:b + 1, :n]).last_hidden_state


def _vits():
    from helpers.hf import vits as build

    return build(window=2)


def _vits_text(model, mask, b, n):
    ids = torch.randint(1, 20, (len(LENGTHS), N), generator=torch.Generator().manual_seed(5))
    if b is not None:
        ids, mask = ids[b:b + 1, :n], mask[b:b + 1, :n]
    return model.text_encoder(input_ids=ids, padding_mask=mask[..., None].double(),
                              attention_mask=mask).last_hidden_state


# name: (builder, output of the batch (b None) or of sequence b alone, the packed op's module, packed calls)
MODELS = {
    "deberta-v3": (_deberta_v3, _ids, padding, 2),
    "deberta-v1": (_deberta_v1, _ids, padding, 2),
    "w2v-bert": (_w2v_bert, _features, padding, 2),
    "seamless-m4t-v1": (_seamless_v1, _seamless_features, padding, 2),
    "speecht5-encoder": (_speecht5, _hidden, padding, 2),
    "vits-text-encoder": (_vits, _vits_text, padding, 2),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_padded_batch_runs_packed_and_each_sequence_is_the_unpadded_model(name, monkeypatch):
    build, output, where, calls = MODELS[name]
    torch.manual_seed(0)
    plain = build().double().eval()
    patched = copy.deepcopy(plain)
    patch(patched)
    mask = _mask()
    seen = []
    op = where.relative_attention_varlen
    monkeypatch.setattr(where, "relative_attention_varlen",
                        lambda *a, **k: seen.append(k["cu_seqlens_q"]) or op(*a, **k))
    got = output(patched, mask, None, None)
    assert len(seen) == calls and seen[0].tolist() == [0, 9, 13, 14, 21]
    cotangent = torch.randn(got.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    cotangent = cotangent * mask[..., None]  # a loss on the real tokens
    patched.zero_grad()
    (got * cotangent).sum().backward()
    plain.zero_grad()
    for b, n in enumerate(LENGTHS):
        alone = output(plain, mask, b, n)
        err = (got[b, :n] - alone[0]).abs().max() / alone.abs().max()
        assert err <= 1e-10, (b, err.item())
        (alone * cotangent[b:b + 1, :n]).sum().backward()
    grads = dict(patched.named_parameters())
    want = {pname: p.grad for pname, p in plain.named_parameters() if p.grad is not None}
    peak = max(w.abs().max() for w in want.values())  # (a key bias's gradient is zero but for rounding: held to it)
    for pname, w in want.items():
        err = (grads[pname].grad - w).abs().max() / w.abs().max().clamp_min(1e-6 * peak)
        assert err <= 1e-9, (pname, err.item())


def test_the_patched_deberta_encoder_gives_zeros_at_padding_and_the_padded_call_at_real_tokens():
    torch.manual_seed(0)
    plain = _deberta_v3().double().eval()
    patched = copy.deepcopy(plain)
    patch(patched)
    mask = _mask()
    got, want = _ids(patched, mask, None, None), _ids(plain, mask, None, None)
    real = mask.bool()
    assert torch.equal(got[~real], torch.zeros(int((~real).sum()), 16, dtype=torch.float64))
    assert ((got[real] - want[real]).abs().max() / want.abs().max()) <= 1e-10
    left = mask.flip(1)  # left padding: the masked call, every padded position computed
    got, want = _ids(patched, left, None, None), _ids(plain, left, None, None)
    assert got[~left.bool()].abs().min() > 0
    assert ((got[left.bool()] - want[left.bool()]).abs().max() / want.abs().max()) <= 1e-10


@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_a_padded_bert_relative_key_batch_runs_packed_and_each_sequence_is_itself(kind, tmp_path, monkeypatch):
    """load_bert_relative_key: each layer packs the padded batch (eager's additive (B, 1, N, N) mask), and every
    sequence's real tokens and a real-token loss's gradients are the model's on that sequence alone."""
    from helpers.hf import v4_checkpoint
    from relattn.integrations.bert import load_bert_relative_key

    v4_checkpoint(tmp_path, kind, "BertModel")
    model = load_bert_relative_key(tmp_path).double().eval()
    mask = _mask()
    ids = torch.randint(1, 23, (len(LENGTHS), N), generator=torch.Generator().manual_seed(7)) * mask
    seen = []
    op = padding.relative_attention_varlen
    monkeypatch.setattr(padding, "relative_attention_varlen",
                        lambda *a, **k: seen.append(k["cu_seqlens_q"].tolist()) or op(*a, **k))
    got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert seen == [[0, 9, 13, 14, 21]] * 2
    cotangent = torch.randn(got.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    cotangent = cotangent * mask[..., None]
    grads = torch.autograd.grad((got * cotangent).sum(), list(model.parameters()), allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, model.parameters(), strict=True)]
    want = [torch.zeros_like(p) for p in model.parameters()]
    for b, n in enumerate(LENGTHS):
        alone = model(input_ids=ids[b:b + 1, :n]).last_hidden_state
        assert ((got[b, :n] - alone[0]).abs().max() / alone.abs().max()) <= 1e-10, b
        parts = torch.autograd.grad((alone * cotangent[b:b + 1, :n]).sum(), list(model.parameters()),
                                    allow_unused=True)
        want = [w + (0 if p is None else p) for w, p in zip(want, parts, strict=True)]
    peak = max(w.abs().max() for w in want)
    for (pname, _), a, w in zip(model.named_parameters(), grads, want, strict=True):
        assert ((a - w).abs().max() / w.abs().max().clamp_min(1e-6 * peak)) <= 1e-9, pname


# ------------------------------------------------------------------ patched models in eval mode, with dropout


def _with_dropout(model, p=0.1):
    """``model`` with every attention and hidden dropout at ``p``: each ``nn.Dropout`` and each float dropout rate
    a module keeps (transformers' attention modules keep ``dropout`` or ``attention_dropout`` as a float)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
        for name in ("dropout", "attention_dropout", "dropout_p"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, p)
    return model


@pytest.mark.parametrize("name", ["deberta-v3", "deberta-v1", *(pytest.param(n, marks=pytest.mark.slow) for n in (
    "w2v-bert", "seamless-m4t-v1", "speecht5-encoder", "vits-text-encoder"))])
def test_every_patched_model_with_dropout_in_eval_mode_is_the_unpatched_model(name):
    """Each patched model with its dropouts at 0.1 (``attention_probs_dropout_prob`` and the like), in eval mode:
    a right-padded batch (run packed) gives each sequence's unpatched, unpadded output at its real tokens, and an
    unpadded batch (the masked call) the unpatched model's output; no dropout is drawn."""
    build, output, _, _ = MODELS[name]
    torch.manual_seed(0)
    plain = _with_dropout(build().double()).eval()
    patched = copy.deepcopy(plain)
    patch(patched)
    mask = _mask()
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in patched.modules())
    got = output(patched, mask, None, None)
    for b, n in enumerate(LENGTHS):
        alone = output(plain, mask, b, n)
        assert_close(got[b, :n], alone[0], torch.float64, f"{name} sequence {b}")
    full = torch.ones_like(mask)
    assert_close(output(patched, full, None, None), output(plain, full, None, None), torch.float64, f"{name} unpadded")
