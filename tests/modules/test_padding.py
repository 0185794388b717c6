"""Padding that costs nothing: right-aligned padding found in a mask (relattn.padding), and the module running such a
batch packed. The oracle: each sequence alone, unpadded."""

import pytest
import torch

from helpers import assert_close
from relattn import RelativeMultiheadAttention
from relattn.padding import right_padding
from relattn.positions import LogBuckets
from relattn.schemes import Shaw, TransformerXL

LENGTHS = (9, 0, 1, 5)  # one sequence of the full length, an empty one, a single token, a window-crossing one
E, H = 16, 4


def _padding(lengths, n):
    return torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("batch_first", [True, False])
def test_right_padding_finds_the_real_rows_and_puts_them_back(batch_first):
    pad = _padding(LENGTHS, 9)
    packing = right_padding(pad, batch_first=batch_first)
    assert packing.padded and packing.total == sum(LENGTHS) and packing.max_seqlen == 9
    assert packing.cu_seqlens.tolist() == [0, 9, 9, 10, 15] and packing.cu_seqlens.dtype == torch.int32
    x = torch.randn(4, 9, 3, dtype=torch.float64)
    laid = x if batch_first else x.transpose(0, 1).contiguous()
    packed = packing.pack(laid)
    assert torch.equal(packed, torch.cat([x[b, :n] for b, n in enumerate(LENGTHS)]))
    back = packing.unpack(packed)
    back_bf = back if batch_first else back.transpose(0, 1)
    assert torch.equal(back_bf[~pad], x[~pad]) and torch.equal(back_bf[pad], torch.zeros(int(pad.sum()), 3,
                                                                                          dtype=torch.float64))
    with pytest.raises(ValueError, match=r"packed rows must be \(T, \.\.\.\) with T = 15; got \(14, 3\)"):
        packing.unpack(packed[1:])
    with pytest.raises(ValueError, match=r"must be \(B, N, \.\.\.\) = \(4, 9\) first; got \(9, 4, 3\)"):
        right_padding(pad).pack(x.transpose(0, 1))


def test_right_padding_refuses_other_padding_and_remembers_its_last_mask():
    left = _padding(LENGTHS, 9).flip(1)
    holes = torch.zeros(2, 5, dtype=torch.bool)
    holes[1, 2] = True
    assert right_padding(left) is None and right_padding(holes) is None
    none = right_padding(torch.zeros(3, 4, dtype=torch.bool))
    assert not none.padded and none.total == 12
    pad = _padding(LENGTHS, 9)
    first = right_padding(pad)
    assert right_padding(pad) is first  # the same mask: read once
    pad[0, 8] = True  # changed in place: read again
    again = right_padding(pad)
    assert again is not first and again.total == sum(LENGTHS) - 1
    with pytest.raises(TypeError, match=r"padding must be a \(B, N\) bool tensor \(True = padding\); got "
                                        r"torch.int64 of shape \(4, 9\)"):
        right_padding(pad.long())


CONFIGS = {
    "shared": dict(positions=3),
    "buckets per-head rel_q": dict(positions=Shaw(LogBuckets(3, 4, 12), position_to_content=True, share_heads=False)),
    "transformer-xl gqa": dict(positions=TransformerXL(), num_kv_heads=2),
    "window tied mqa zero": dict(positions=Shaw((2, 5), tie=True, beyond="zero"), num_kv_heads=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("batch_first", "causal", "float_mask"), [(True, False, False), (False, True, True)])
def test_the_module_with_right_padding_is_each_sequence_alone(name, batch_first, causal, float_mask):
    """Each sequence's real positions equal the module on that sequence alone (outputs, the gradients of every
    parameter and of the input); padded positions are zeros and get no gradient. Both mask kinds, both layouts."""
    torch.manual_seed(len(name))
    mod = RelativeMultiheadAttention(E, H, dtype=torch.float64, batch_first=batch_first, **CONFIGS[name])
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, E, generator=g, dtype=torch.float64)
    go = torch.randn(4, 9, E, generator=g, dtype=torch.float64)
    pad = _padding(LENGTHS, 9)
    mask = torch.zeros(pad.shape, dtype=torch.float64).masked_fill(pad, float("-inf")) if float_mask else pad
    layout = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    params = list(mod.parameters())
    xin = layout(x).clone().requires_grad_(True)
    got = layout(mod(xin, key_padding_mask=mask, is_causal=causal)[0])
    grads = torch.autograd.grad(got, [xin, *params], go)
    assert torch.equal(got[pad], torch.zeros(int(pad.sum()), E, dtype=torch.float64))
    assert torch.equal(layout(grads[0])[pad], torch.zeros(int(pad.sum()), E, dtype=torch.float64))
    want_grads = [torch.zeros_like(p) for p in params]
    for b, n in enumerate(LENGTHS):
        if n == 0:
            continue
        xb = x[b:b + 1, :n].clone().requires_grad_(True)
        one = layout(mod(layout(xb), is_causal=causal)[0])
        assert_close(got[b, :n], one[0], torch.float64, f"sequence {b}")
        parts = torch.autograd.grad(one, [xb, *params], go[b:b + 1, :n], allow_unused=True)
        assert_close(layout(grads[0])[b, :n], parts[0][0], torch.float64, f"d input {b}")
        want_grads = [w + (0 if p is None else p) for w, p in zip(want_grads, parts[1:], strict=True)]
    for (pname, _), a, w in zip(mod.named_parameters(), grads[1:], want_grads, strict=True):
        assert_close(a, w, torch.float64, f"d {pname}")


def test_the_module_keeps_the_masked_call_for_other_padding_and_masks():
    """Left-aligned padding, an attn_mask beside the padding, or weights asked for: the masked call, whose padded
    queries attend the real keys (nn.MultiheadAttention's answer), not zeros."""
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(E, H, 3, dtype=torch.float64)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    right = _padding((6, 3), 6)
    packed = mod(x, key_padding_mask=right)[0]
    assert torch.equal(packed[1, 3:], torch.zeros(3, E, dtype=torch.float64))
    masked, _ = mod(x, key_padding_mask=right, need_weights=True)
    also = mod(x, key_padding_mask=right, attn_mask=torch.zeros(6, 6, dtype=torch.bool))[0]
    for other in (masked, also):
        assert_close(other[~right], packed[~right], torch.float64)
        assert other[1, 3:].abs().min() > 0
    left = right.flip(1)
    assert mod(x, key_padding_mask=left)[0][1, :3].abs().min() > 0


def test_little_padding_runs_masked_and_gives_the_same_zeros(monkeypatch):
    """Below PACK_FROM padded positions the masked call runs (no packed op), and its output is zeroed at the padding:
    the same answer as the packed call's."""
    import relattn.padding as padding
    from relattn.padding import PACK_FROM

    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(E, H, Shaw(3, position_to_content=True), dtype=torch.float64)
    x = torch.randn(2, 20, E, dtype=torch.float64, requires_grad=True)
    pad = _padding((20, 19), 20)
    assert pad.float().mean() < PACK_FROM
    calls = []
    monkeypatch.setattr(padding, "relative_attention_varlen", lambda *a, **k: calls.append(1))
    out = mod(x, key_padding_mask=pad)[0]
    assert not calls and torch.equal(out[1, 19], torch.zeros(E, dtype=torch.float64))
    assert_close(out[1, :19], mod(x[1:, :19])[0][0], torch.float64)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    assert torch.equal(grad[1, 19], torch.zeros(E, dtype=torch.float64))


def test_each_mask_convention_has_one_rule_and_packs_only_padding_alone():
    """The named rules of relattn.padding: nn.MultiheadAttention's key_padding_mask (bool True = padding, or -inf
    added at padding only), DeBERTa's keep mask (nonzero = token, any dtype); each gives the same lengths for the
    same padding, and refuses what is more than padding (a finite score, left padding: no packing)."""
    from relattn.padding import MASK_RULES, packing_of

    lengths = torch.tensor([6, 3, 1])
    keep = torch.arange(6)[None, :] < lengths[:, None]
    packs = {"key_padding_mask": [~keep, torch.zeros(3, 6).masked_fill(~keep, -torch.inf)],
             "keep": [keep, keep.long(), keep.double()],
             "transformers": [keep.long(), keep[:, None, None]]}
    assert set(packs) == set(MASK_RULES)
    for rule, masks in packs.items():
        for mask in masks:
            packing = packing_of(mask, rule)
            assert packing is not None and packing.lengths.tolist() == [6, 3, 1], (rule, mask.dtype)
    biased = torch.zeros(3, 6).masked_fill(~keep, -torch.inf)
    biased[0, 0] = -1.0
    for rule, mask in (("key_padding_mask", biased), ("key_padding_mask", (~keep).flip(-1)), ("keep", keep.flip(-1)),
                       ("key_padding_mask", torch.zeros(3, 6, dtype=torch.bool))):  # the last: no padding at all
        assert packing_of(mask, rule) is None, rule
    with pytest.raises(ValueError, match="rule must be one of"):
        packing_of(keep, "hf")


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_heads_is_the_one_head_split(batch_first):
    """(B, L, H*D) (or (L, B, H*D)) -> (B, H, L, D) by heads or by head dim, a view; merge_heads undoes it."""
    from relattn.padding import merge_heads, split_heads

    x = torch.arange(2 * 5 * 12.0).view(2, 5, 12)
    seen = x if batch_first else x.transpose(0, 1)
    by_heads = split_heads(seen, heads=3, batch_first=batch_first)
    assert torch.equal(by_heads, split_heads(seen, head_dim=4, batch_first=batch_first))
    assert by_heads.shape == (2, 3, 5, 4) and by_heads._base is not None
    assert torch.equal(by_heads[1, 2, 3], x[1, 3, 8:12])
    assert torch.equal(merge_heads(by_heads), x)
