"""relattn.integrations.transformers.patch on tiny random DeBERTa (v1) models (no hub): outputs and gradients equal
the unpatched model's at every real token, for each kind of config (c2p and/or p2c, spans shorter and longer than
the input, no relative attention), every head class, padding, dropout, output_attentions, state_dict and unpatch;
talking heads are left as they are."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

import relattn.integrations.deberta as deberta  # noqa: E402
import relattn.padding as padding  # noqa: E402
from helpers import grads_close  # noqa: E402
from helpers.deberta import TOL, N, assert_head_outputs_match, inputs  # noqa: E402
from helpers.hf import relative_error  # noqa: E402
from relattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = {
    "base": dict(pos_att_type=["c2p", "p2c"], max_relative_positions=-1),  # span = N (max_position_embeddings 64)
    "short-span": dict(pos_att_type=["c2p", "p2c"], max_relative_positions=6),  # span 6 < N: clipped
    "c2p": dict(pos_att_type=["c2p"], max_relative_positions=9),
    "p2c-string": dict(pos_att_type="p2c", max_relative_positions=9),
    "no-position-terms": dict(pos_att_type=[], max_relative_positions=9),
    "absolute-only": dict(relative_attention=False, pos_att_type=["c2p", "p2c"]),
}


def _config(kind, dropout=0.0, **more):
    kw = dict(relative_attention=True) | KINDS[kind] | more
    return transformers.DebertaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=dropout, **kw)


def _pair(kind, dtype, cls=None, dropout=0.0, **more):
    torch.manual_seed(0)
    plain = (cls or transformers.DebertaModel)(_config(kind, dropout, **more)).to(dtype)
    with torch.no_grad():  # q_bias and v_bias start at zero and the position terms near it: make them count
        for module in plain.modules():
            if hasattr(module, "q_bias"):
                module.q_bias.normal_()
                module.v_bias.normal_()
            for name in ("pos_proj", "pos_q_proj"):
                if hasattr(module, name):
                    getattr(module, name).weight.mul_(30)
        if plain.config.relative_attention:
            plain.base_model.encoder.rel_embeddings.weight.normal_()
    patched = copy.deepcopy(plain)
    report = patch(patched)
    assert len(report.patched) == plain.config.num_hidden_layers + 1, report  # every attention, and the encoder
    return plain, patched


def _run(model, ids, mask, cotangent):
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    model.zero_grad(set_to_none=True)
    (out * cotangent * mask[..., None]).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


CASES = [(kind, torch.float64) for kind in KINDS] + [("base", torch.float32), ("short-span", torch.float32)]


@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_patched_model_matches_unpatched(kind, dtype):
    plain, patched = _pair(kind, dtype)
    ids, mask = inputs()
    go = torch.randn(2, N, 16, dtype=dtype)
    want, want_g = _run(plain, ids, mask, go)
    got, got_g = _run(patched, ids, mask, go)
    real = mask.bool()
    assert relative_error(got[real], want[real]) <= TOL[dtype]
    assert set(got_g) == set(want_g)
    grads_close(got_g, want_g, dtype)


def test_the_position_terms_are_there():
    """Dropping p2c (or c2p) changes the output: the parity above is not two models without the terms."""
    ids, mask = inputs()
    _, both = _pair("short-span", torch.float64)
    out = both(input_ids=ids, attention_mask=mask).last_hidden_state
    for layer in both.encoder.layer:
        layer.attention.self.pos_att_type = ["c2p", "c2p"]  # same scale, no p2c
    real = mask.bool()  # (the padded positions are zeros in both)
    assert relative_error(both(input_ids=ids, attention_mask=mask).last_hidden_state[real], out[real]) > 1e-4


@pytest.mark.parametrize("cls", ["DebertaForSequenceClassification", "DebertaForMaskedLM",
                                 "DebertaForTokenClassification", "DebertaForQuestionAnswering"])
def test_every_head_class_matches_unpatched(cls):
    plain, patched = _pair("base", torch.float64, getattr(transformers, cls))
    assert_head_outputs_match(plain, patched)


def test_no_pairwise_mask_or_positions_reach_the_layers(monkeypatch):
    """Without padding each layer gets a (B, 1, 1, N) mask; with right-aligned padding the layers run packed, the
    window the longest sequence's."""
    _, patched = _pair("base", torch.float64)
    ids, mask = inputs()
    seen = []
    real, real_varlen = deberta.relative_attention, padding.relative_attention_varlen

    def spy(q, k, v, *args, **kwargs):
        seen.append((kwargs["attn_mask"].shape, kwargs["max_relative_position"]))
        return real(q, k, v, *args, **kwargs)

    def spy_varlen(q, k, v, *args, **kwargs):
        seen.append((tuple(q.shape), kwargs["cu_seqlens_q"].tolist(), kwargs["max_relative_position"]))
        return real_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(deberta, "relative_attention", spy)
    monkeypatch.setattr(padding, "relative_attention_varlen", spy_varlen)
    patched(input_ids=ids, attention_mask=torch.ones_like(mask))
    assert seen == [((2, 1, 1, N), deberta.LogBuckets(N))] * 2
    seen.clear()
    patched(input_ids=ids[:, :N - 1], attention_mask=mask[:, :N - 1])
    heads = patched.config.num_attention_heads
    assert seen == [((N - 1 + 15, heads, 16 // heads), [0, N - 1, N - 1 + 15], deberta.LogBuckets(N - 1))] * 2


def test_attention_dropout_is_applied_in_training():
    _, patched = _pair("base", torch.float64, dropout=0.5)
    ids, mask = inputs()
    patched.train()
    torch.manual_seed(3)
    a = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    b = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    patched.eval()
    c = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    assert relative_error(a, b) > 1e-3 and relative_error(a, c) > 1e-3


def test_output_attentions_state_dict_and_unpatch():
    plain, patched = _pair("short-span", torch.float64)
    ids, mask = inputs()
    want = plain(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    got = patched(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    real = mask.bool()
    for w, g in zip(want, got, strict=True):
        assert relative_error(g[0], w[0]) <= 1e-10  # the unpadded sequence; the padded one at its real tokens:
        assert relative_error(g[1][:, real[1]][..., real[1]], w[1][:, real[1]][..., real[1]]) <= 1e-10
    assert list(patched.state_dict()) == list(plain.state_dict())
    assert is_patched(patched)
    assert len(unpatch(patched)) == plain.config.num_hidden_layers + 1 and not is_patched(patched)


def test_talking_heads_are_left_as_they_are():
    torch.manual_seed(0)
    model = transformers.DebertaModel(_config("base", talking_head=True))
    with pytest.warns(UserWarning) as warned:
        report = patch(model)
    assert any("talking_head" in str(w.message) for w in warned)
    assert not report.patched and any("talking_head" in r for r in report.skipped.values())


def test_positions_other_than_the_standard_fall_back_to_transformers():
    """A layer called with relative positions other than ``i - j`` runs transformers' own forward."""
    plain, patched = _pair("short-span", torch.float64)
    from transformers.models.deberta.modeling_deberta import build_relative_position

    h = torch.randn(1, 7, 16, dtype=torch.float64)
    mask = torch.ones(1, 1, 7, 7, dtype=torch.bool)
    rel = patched.encoder.get_rel_embedding()
    for pos in (build_relative_position(h, h), build_relative_position(h, h) * 2):
        want = plain.encoder.layer[0].attention.self(h, mask, relative_pos=pos, rel_embeddings=rel)[0]
        got = patched.encoder.layer[0].attention.self(h, mask, relative_pos=pos, rel_embeddings=rel)[0]
        assert relative_error(got, want) <= 1e-12
