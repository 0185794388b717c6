"""The "blocked" backend's internals: the key-block tiling, dropout through both
sums and its backward, and a mask's gradient path. Its results against the reference are in
``test_conformance.py``."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close, grads, random_inputs
from relattn import functional as fn
from relattn.backends import blocked
from relattn.backends.blocked import DEFAULT_BLOCK, blocked_backward, blocked_forward

# ----------------------------------------------------------------------------------------- tiling


@pytest.mark.parametrize("block", [1, 4, 7, DEFAULT_BLOCK])
@pytest.mark.parametrize(("n", "m", "kk", "causal", "off"), [(9, 23, 3, False, 0), (9, 23, 3, True, 14),
                                                             (20, 13, 5, True, -4)])
def test_any_key_block_matches_dense_autograd(block, n, m, kk, causal, off):
    """Key blocks of 1, of sizes that do not divide M, and one block for everything: the same output,
    log-sum-exp and gradients (the online softmax's corrections across blocks are exact)."""
    inputs = random_inputs(2, 2, n, m, 4, 3, kk, tables="keys_per_head", requires_grad=True, seed=block)
    q, k, v, rk, rv = inputs
    mask = torch.randn(1, 2, n, m, dtype=torch.float64)
    mask[..., 1, :] = float("-inf")  # a row with nothing to attend to
    kw = dict(max_relative_position=kk, is_causal=causal, query_offset=off)
    go = torch.randn(2, 2, n, 3, dtype=torch.float64)
    want_out, want = grads("dense", inputs, go, attn_mask=mask, **kw)
    call = fn.validate(*inputs, attn_mask=mask, dropout_p=0.0, scale=None, **kw)
    args = (call.q, call.k, call.v, call.rel_k, call.rel_v, call.mask, torch.tensor(0))
    opts = dict(max_relative_position=kk, is_causal=causal, dropout_p=0.0, scale=call.scale, query_offset=off)
    out, lse = blocked_forward(*args, **opts, block=block)
    whole, lse_whole = blocked_forward(*args, **opts, block=m)
    assert_close(out, want_out, torch.float64, "out")
    empty = torch.isinf(lse)
    rows = torch.arange(n)
    no_key = (rows == 1) | ((rows + off < 0) if causal else False)  # masked out, or every key in the future
    assert torch.equal(empty, no_key.expand_as(empty)) and torch.equal(torch.isinf(lse_whole), empty)
    assert_close(lse[~empty], lse_whole[~empty], torch.float64, "lse")
    got = blocked_backward(go, *args, out, lse, **opts, block=block)
    d_rel_k = got[3][0] if rk.dim() == 2 else got[3]  # the op takes (Hr, 2K+1, D): Hr = 1 for a shared table
    d_rel_v = got[4][0] if rv.dim() == 2 else got[4]
    for name, a, w in zip("q k v rel_k rel_v".split(), (*got[:3], d_rel_k, d_rel_v), want, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")


# ----------------------------------------------------------------------------------------- dropout


def test_dropout_reproducible_from_torch_manual_seed():
    inputs = random_inputs(1, 2, 9, 9, 4, 4, 3, tables="keys_per_head")

    def run(s):
        torch.manual_seed(s)
        return fn.relative_attention(*inputs, max_relative_position=3, dropout_p=0.3, backend="blocked")

    assert torch.equal(run(7), run(7))
    assert not torch.allclose(run(7), run(8))


@pytest.mark.slow
def test_dropout_is_unbiased_over_seeds():
    """E[out] over seeds equals the no-dropout output: weights are dropped before both sums and rescaled."""
    inputs = random_inputs(1, 2, 6, 6, 4, 4, 2, tables="keys_per_head")
    clean = fn.relative_attention(*inputs, max_relative_position=2, backend="blocked")
    torch.manual_seed(0)
    outs = torch.stack([fn.relative_attention(*inputs, max_relative_position=2, dropout_p=0.4, backend="blocked")
                        for _ in range(2000)])
    stderr = outs.std(0) / math.sqrt(len(outs))
    assert ((outs.mean(0) - clean).abs() <= 5 * stderr + 1e-12).all()
    # the value term is dropped too: with a zero value-side content only the table term remains
    q, k, v, rk, rv = inputs
    zero_v = torch.zeros_like(v)
    torch.manual_seed(1)
    dropped = fn.relative_attention(q, k, zero_v, rk, rv, max_relative_position=2, dropout_p=0.4, backend="blocked")
    kept = fn.relative_attention(q, k, zero_v, rk, rv, max_relative_position=2, backend="blocked")
    assert not torch.allclose(dropped, kept)


def test_dropout_backward_regenerates_the_mask():
    q, k, v, rk, rv = random_inputs(1, 2, 6, 7, 3, 3, 2, tables="per_head", requires_grad=True)
    seed = torch.tensor(99)

    def f(*x):
        return blocked.OPS.fwd_op(*x, None, seed, 2, False, 0.3, 0.5, 0)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, rk, rv), fast_mode=True)


# ----------------------------------------------------------------------------------------- masks


def test_gradcheck_blocked_with_mask():
    q, k, v, rk, rv = random_inputs(1, 2, 6, 7, 3, 3, 2, tables="keys_per_head", requires_grad=True)
    mask = torch.randn(1, 2, 6, 7, dtype=torch.float64)
    mask[0, 0, 2] = float("-inf")  # one fully masked row
    assert torch.autograd.gradcheck(
        lambda *x: fn.relative_attention(*x, max_relative_position=2, attn_mask=mask, backend="blocked"),
        (q, k, v, rk, rv), fast_mode=True)
