"""The module's surface as nn.MultiheadAttention users meet it: mask errors that name the argument passed, its
convention and its shape as passed; ``from_mha`` with the position options; the readable ``BACKENDS``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import relattn
from relattn import RelativeMultiheadAttention
from relattn.schemes import Shaw


@pytest.mark.parametrize(("kw", "exc", "match"), [
    (dict(key_padding_mask=torch.zeros(2, 20, dtype=torch.long)), TypeError,
     r"^key_padding_mask must be bool \(True = padding: the key is not attended\) or floating \(added to the "
     r"scores\); got torch.int64 of shape \(2, 20\)$"),
    (dict(attn_mask=torch.zeros(20, 20, dtype=torch.int32)), TypeError,
     r"^attn_mask must be bool \(True = not allowed to attend\) or floating .*got torch.int32 of shape \(20, 20\)$"),
    (dict(attn_mask=torch.zeros(20, 21, dtype=torch.bool)), ValueError,
     r"^attn_mask must be \(N, M\) = \(20, 20\), \(B\*num_heads, N, M\) = \(8, 20, 20\) or broadcast to "
     r"\(B, H, N, M\) = \(2, 4, 20, 20\); got \(20, 21\)$"),
    (dict(attn_mask=torch.zeros(2, 3, 20, 20)), ValueError, r"broadcast to \(B, H, N, M\) = .*got \(2, 3, 20, 20\)$"),
    (dict(key_padding_mask=[[True]]), TypeError, r"^key_padding_mask must be a Tensor or None, got list$"),
])
def test_mask_errors_name_the_argument_its_convention_and_its_shape(kw, exc, match):
    mod = RelativeMultiheadAttention(16, 4, 2)
    with pytest.raises(exc, match=match):
        mod(torch.randn(2, 20, 16), **kw)


def test_masks_of_both_kinds_still_combine():
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(8, 2, 2).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    want, _ = mod(x, key_padding_mask=pad, is_causal=True)  # packed: zeros at the padded positions
    assert torch.equal(want[0, 3:], torch.zeros(2, 8, dtype=torch.float64))
    added = torch.zeros(5, 5, dtype=torch.float64).masked_fill(causal, float("-inf"))
    for attn_mask in (causal, added, added[None, None].expand(2, 2, 5, 5)):
        got, _ = mod(x, key_padding_mask=pad, attn_mask=attn_mask)  # masked: a padded query attends the real keys
        torch.testing.assert_close(got[~pad], want[~pad], rtol=1e-12, atol=1e-12)
        assert got[0, 3:].abs().min() > 0


@pytest.mark.parametrize(("window", "beyond", "tie"), [((3, 1), "zero", True), (2, "clip", False)])
def test_from_mha_takes_the_position_options(window, beyond, tie):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    mod = RelativeMultiheadAttention.from_mha(mha, Shaw(window, beyond=beyond, tie=tie))
    assert mod.positions == Shaw(window, beyond=beyond, tie=tie)
    assert (mod.rel_v is mod.rel_k) == tie
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(mod(x)[0], mha(x, x, x, need_weights=False)[0], rtol=1e-12, atol=1e-12)


def test_backends_print_one_line_each():
    text = repr(relattn.BACKENDS)
    lines = text.splitlines()
    assert len(lines) == 1 + len(relattn.BACKENDS) and all(len(line) < 400 for line in lines)
    for name, line in zip(relattn.BACKENDS, lines[1:], strict=True):
        assert line.split()[0] == name
    assert "Serves(" not in text and "frozenset" not in text
    assert "any device, dropout, masks with gradients" in text  # dense, from its declaration
