"""relattn.integrations.transformers.patch on tiny random DeBERTa-v2/v3 models (no hub): outputs and gradients equal
the unpatched model's at every real token, for each kind of config (c2p and/or p2c, share_att_key or not, log
buckets or not, norm_rel_ebd), every head class, padding, dropout, output_attentions, state_dict and unpatch."""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

import relattn.integrations.deberta as deberta  # noqa: E402
from helpers import grads_close  # noqa: E402
from helpers.deberta import TOL, N, assert_head_outputs_match, inputs  # noqa: E402
from helpers.hf import relative_error  # noqa: E402
from relattn.integrations.transformers import is_patched, patch, unpatch  # noqa: E402
from relattn.padding import Packing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# name: config keywords beyond the tiny shape
KINDS = {
    "v3": dict(pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=20, share_att_key=True,
               norm_rel_ebd="layer_norm", position_biased_input=False),
    "v2-conv": dict(pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=20, share_att_key=True,
                    norm_rel_ebd="layer_norm", conv_kernel_size=3, position_biased_input=False),
    "c2p-clipped": dict(pos_att_type=["c2p"], position_buckets=-1, max_relative_positions=6, share_att_key=False),
    "p2c-buckets": dict(pos_att_type=["p2c"], position_buckets=6, max_relative_positions=12, share_att_key=False),
    "both-unshared": dict(pos_att_type=["c2p", "p2c"], position_buckets=-1, max_relative_positions=-1,
                          share_att_key=False),
    "no-position-terms": dict(pos_att_type=[], position_buckets=8, max_relative_positions=20),
    "absolute-only": dict(relative_attention=False),
    # transformers divides by sqrt(3 D) here: it counts pos_att_type's terms without relative attention too
    "absolute-with-pos-att-type": dict(relative_attention=False, pos_att_type=["p2c", "c2p"],
                                       initializer_range=0.2),
    # a small config's buckets wider than its positions (max_relative_positions: max_position_embeddings = 64)
    "buckets-past-positions": dict(pos_att_type=["p2c", "c2p"], position_buckets=256, max_relative_positions=-1,
                                   share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False),
}


def _config(kind, dropout=0.0, **more):
    kw = dict(relative_attention=True) | KINDS[kind] | more
    return transformers.DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=dropout, **kw)


def _pair(kind, dtype, cls=None, dropout=0.0, **more):
    torch.manual_seed(0)
    plain = (cls or transformers.DebertaV2Model)(_config(kind, dropout, **more)).to(dtype)
    patched = copy.deepcopy(plain)
    report = patch(patched)
    layers = plain.config.num_hidden_layers
    assert len(report.patched) == layers + 1, report  # every layer's attention, and the encoder
    return plain, patched, report


def _run(model, ids, mask, cotangent=None):
    """The last hidden state and the gradients of ``(out * cotangent)`` summed over the real tokens."""
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if cotangent is None:
        return out, None
    model.zero_grad(set_to_none=True)
    (out * cotangent * mask[..., None]).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


CASES = [(kind, False, torch.float64) for kind in KINDS] + [
    ("v3", False, torch.float32), ("p2c-buckets", False, torch.float32), ("v3", True, torch.float64),
    ("c2p-clipped", True, torch.float32)]


@pytest.mark.parametrize(("kind", "train", "dtype"), CASES,
                         ids=[f"{k}-{'train' if t else 'eval'}-{str(d)[6:]}" for k, t, d in CASES])
def test_patched_model_matches_unpatched(kind, train, dtype):
    plain, patched, _ = _pair(kind, dtype)
    plain.train(train), patched.train(train)
    ids, mask = inputs()
    go = torch.randn(2, N, 16, dtype=dtype)
    want, want_g = _run(plain, ids, mask, go)
    got, got_g = _run(patched, ids, mask, go)
    real = mask.bool()
    assert relative_error(got[real], want[real]) <= TOL[dtype]
    assert set(got_g) == set(want_g)
    grads_close(got_g, want_g, dtype)


@pytest.mark.parametrize("cls", ["DebertaV2ForSequenceClassification", "DebertaV2ForMaskedLM",
                                 "DebertaV2ForTokenClassification", "DebertaV2ForQuestionAnswering"])
def test_every_head_class_matches_unpatched(cls):
    plain, patched, _ = _pair("v3", torch.float64, getattr(transformers, cls))
    assert_head_outputs_match(plain, patched)


def test_multiple_choice_matches_unpatched():
    plain, patched, _ = _pair("c2p-clipped", torch.float64, transformers.DebertaV2ForMultipleChoice)
    ids, mask = inputs()
    want = plain(input_ids=ids[None], attention_mask=mask[None]).logits
    got = patched(input_ids=ids[None], attention_mask=mask[None]).logits
    assert relative_error(got, want) <= 1e-10


def test_padding_is_masked_and_no_pairwise_mask_or_positions_reach_the_layers():
    """Without padding the layers get a (B, 1, 1, N) mask; with right-aligned padding the encoder runs packed: its
    layers get the real tokens as one (1, T, E) sequence and the lengths, and its outputs are zeros at padding."""
    _, patched, _ = _pair("v3", torch.float64)
    ids, mask = inputs()
    seen = []
    for layer in patched.encoder.layer:
        layer.attention.self.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((args[0].shape, args[1], kwargs.get("relative_pos"))),
            with_kwargs=True)
    patched(input_ids=ids, attention_mask=torch.ones_like(mask))
    assert seen and all(x == (2, N, 16) and m.shape == (2, 1, 1, N) and pos is None for x, m, pos in seen)
    seen.clear()
    out = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    assert seen and all(x == (1, N + 15, 16) and isinstance(m, Packing) and m.cu_seqlens.tolist() == [0, N, N + 15]
                        and pos is None for x, m, pos in seen)
    assert torch.equal(out[1, 15:], torch.zeros(N - 15, 16, dtype=torch.float64))
    other = ids.clone()
    other[1, 15:] = 3  # different padding tokens: the real tokens do not see them
    again = patched(input_ids=other, attention_mask=mask).last_hidden_state
    assert torch.equal(out[mask.bool()], again[mask.bool()])


def test_attention_dropout_is_applied_in_training_and_unbiased():
    torch.manual_seed(0)
    att = transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention(
        _config("v3", dropout=0.3)).double()
    patch(att)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    rel = torch.randn(16, 16, dtype=torch.float64)
    mask = torch.ones(1, 9, dtype=torch.bool)
    clean = att.eval()(x, mask, rel_embeddings=rel)[0]
    att.train()
    torch.manual_seed(1)
    outs = torch.stack([att(x, mask, rel_embeddings=rel)[0] for _ in range(600)])
    assert not torch.allclose(outs[0], outs[1])
    stderr = outs.std(0) / math.sqrt(len(outs))
    assert ((outs.mean(0) - clean).abs() <= 5 * stderr + 1e-12).all()


def test_state_dict_unchanged_and_unpatch_restores():
    plain, patched, report = _pair("v3", torch.float64)
    assert list(plain.state_dict()) == list(patched.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), patched.state_dict().values(),
                                                 strict=True))
    assert "encoder" in report.patched and "encoder.layer.1.attention.self" in report.patched
    assert report.skipped == {}  # the DebertaV2Attention wrappers around the patched modules are not "skipped"
    assert all(is_patched(patched.get_submodule(n)) for n in report.patched)
    assert sorted(unpatch(patched)) == sorted(report.patched)
    assert not any(is_patched(m) for m in patched.modules())
    ids, mask = inputs()
    assert torch.equal(plain(input_ids=ids, attention_mask=mask).last_hidden_state,
                       patched(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_output_attentions_are_the_unpatched_weights():
    plain, patched, _ = _pair("v3", torch.float64)
    ids, mask = inputs()
    want = plain(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    got = patched(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    real = mask.bool()
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        assert relative_error(g.transpose(1, 2)[real], w.transpose(1, 2)[real]) <= 1e-10  # real query rows


def test_relative_positions_handed_to_the_attention(monkeypatch):
    """The attention called directly with transformers' own relative_pos takes the fast path; with other positions
    it computes the unpatched forward (exactly what transformers computes)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, build_relative_position

    torch.manual_seed(0)
    att = DisentangledSelfAttention(_config("v3")).double().eval()
    plain = copy.deepcopy(att)
    patch(att)
    x = torch.randn(2, N, 16, dtype=torch.float64)
    rel = torch.randn(16, 16, dtype=torch.float64)
    mask = torch.ones(2, 1, N, N, dtype=torch.long)
    pos = build_relative_position(x, x, bucket_size=8, max_position=20)
    calls = []
    monkeypatch.setattr(deberta, "relative_attention", lambda *a, **k: calls.append(1) or _op(*a, **k))
    for relative_pos in (pos, pos.flip(-1)):
        want = plain(x, mask, relative_pos=relative_pos, rel_embeddings=rel)[0]
        got = att(x, mask, relative_pos=relative_pos, rel_embeddings=rel)[0]
        assert relative_error(got, want) <= 1e-10
    assert len(calls) == 1  # the flipped positions went the unpatched way


def _op(*args, **kwargs):
    from relattn import relative_attention

    return relative_attention(*args, **kwargs)


def test_positions_of_a_module_follow_its_config():
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    att = DisentangledSelfAttention(_config("v3"))
    assert deberta.positions(att) == deberta.LogBuckets(8, 8, 20)
    att = DisentangledSelfAttention(_config("both-unshared"))
    assert deberta.positions(att) == deberta.LogBuckets(64)  # max_relative_positions < 1: max_position_embeddings


def _attention_pair(**config):
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    torch.manual_seed(0)
    att = DisentangledSelfAttention(_config("v3", **config)).double().eval()
    return att, copy.deepcopy(att)


def test_buckets_past_the_positions_are_transformers_map_where_it_folds_back():
    """position_buckets=256, max_relative_positions=64: offsets past 128 take transformers' folded-back rows
    (N = 150 reaches them); patched, the module computes what transformers computes."""
    plain, att = _attention_pair(position_buckets=256, max_relative_positions=64)
    assert patch(att).patched == [""]
    n = 150
    x = torch.randn(1, n, 16, dtype=torch.float64)
    rel = torch.randn(512, 16, dtype=torch.float64)
    mask = torch.ones(1, 1, n, n, dtype=torch.bool)
    assert relative_error(att(x, mask[:, :, :1], rel_embeddings=rel)[0], plain(x, mask, rel_embeddings=rel)[0]) <= 1e-10


def test_buckets_without_finite_log_positions_are_refused_at_patch_naming_the_config():
    """max_relative_positions = position_buckets // 2 + 1: transformers' log buckets divide by log(1) = 0. patch()
    leaves the layers and the encoder as they are, with a reason naming the config fields."""
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(_config("v3", position_buckets=8, max_relative_positions=5))
    with pytest.warns(UserWarning, match="no supported attention"):
        report = patch(model)
    assert report.patched == [] and not is_patched(model)
    reason = report.skipped["encoder.layer.0.attention.self"]
    assert "position_buckets=8" in reason and "max_relative_positions=5" in reason
    assert "encoder" in report.skipped


@pytest.mark.slow
def test_patched_attention_compiles_without_a_graph_break():
    """fullgraph=True: the scale (transformers' float32 sqrt) is a constant to the compiler, not a graph break."""
    plain, att = _attention_pair()
    patch(att)
    x = torch.randn(2, N, 16, dtype=torch.float64)
    rel = torch.randn(16, 16, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, N, dtype=torch.bool)
    eager = att(x, mask, rel_embeddings=rel)[0]  # (the first call, eager: see test_toolchain for compile first)
    got = torch.compile(att, fullgraph=True, backend="eager")(x, mask, rel_embeddings=rel)[0]
    assert relative_error(got, plain(x, mask.expand(2, 1, N, N), rel_embeddings=rel)[0]) <= 1e-10
    assert relative_error(got, eager) <= 1e-12
