"""Two cases a mutation run found untested: float64 inputs under autocast, and the exact NaN pattern a NaN key
gives in weights, outputs and gradients, on every backend."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import backend_params
from relattn import BACKENDS, reference, relative_attention, relative_attention_weights, relative_position_index

ALL = backend_params(list(BACKENDS))
B, H, N, D, K = 2, 2, 9, 4, 2


def _inputs(dtype=torch.float64, nan_key=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    rk, rv = torch.randn(H, 2 * K + 1, D, generator=g, dtype=torch.float64), torch.randn(2 * K + 1, D, generator=g,
                                                                                        dtype=torch.float64)
    if nan_key:
        k[1, 1, 3, 0] = float("nan")
    return [t.to(dtype).requires_grad_() for t in (q, k, v, rk, rv)]


@pytest.mark.parametrize("backend", ALL)
def test_float64_under_autocast_stays_float64(backend):
    """Autocast leaves float64 alone (as it does SDPA's): the result is the float64 call outside autocast."""
    x = _inputs()
    want = relative_attention(*x, max_relative_position=K, is_causal=True, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = relative_attention(*x, max_relative_position=K, is_causal=True, backend=backend)
        weights = relative_attention_weights(x[0], x[1], x[3], max_relative_position=K)
    assert got.dtype == torch.float64 and weights.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    go = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_grads = torch.autograd.grad(relative_attention(*x, max_relative_position=K, is_causal=True,
                                                           backend=backend), x, go)
    for g, w in zip(got_grads, torch.autograd.grad(want, x, go), strict=True):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _literal(q, k, v, rk, rv):
    """The reference's formula in float64 torch, for autograd."""
    idx = relative_position_index(N, N, K)
    s = (q @ k.transpose(-1, -2) + torch.gather(q @ rk.transpose(-1, -2), -1, idx.expand(B, H, N, N))) / math.sqrt(D)
    w = torch.softmax(s, -1)
    buckets = torch.zeros(B, H, N, 2 * K + 1, dtype=w.dtype).scatter_add(-1, idx.expand(B, H, N, N), w)
    return w @ v + buckets @ rv, w


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_nan_key_gives_exactly_the_reference_nan_pattern(backend, dtype):
    x64 = _inputs(nan_key=True)
    np_in = [t.detach().numpy() for t in x64]
    ref_out, ref_w = reference.relative_attention(*np_in, max_relative_position=K, return_weights=True)
    want_out, want_w = torch.from_numpy(ref_out), torch.from_numpy(ref_w)
    lit, lit_w = _literal(*x64)
    assert torch.equal(lit.isnan(), want_out.isnan()) and torch.equal(lit_w.isnan(), want_w.isnan())
    assert want_w[1, 1].isnan().all() and not want_w[0].isnan().any() and not want_w[1, 0].isnan().any()
    go = torch.randn(want_out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_grads = torch.autograd.grad(lit, x64, go)

    x = _inputs(dtype, nan_key=True)
    out = relative_attention(*x, max_relative_position=K, backend=backend)
    assert torch.equal(out.isnan(), want_out.isnan()), f"{backend}: output NaN at {out.isnan().nonzero().tolist()}"
    weights = relative_attention_weights(x[0], x[1], x[3], max_relative_position=K)
    assert torch.equal(weights.isnan(), want_w.isnan()), "weights: NaN pattern differs from the reference's"
    finite = ~want_w.isnan()
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(weights.detach().double()[finite], want_w[finite], rtol=tol, atol=tol)
    for name, g, w in zip(("q", "k", "v", "rel_k", "rel_v"), torch.autograd.grad(out, x, go.to(dtype)), want_grads,
                          strict=True):
        assert torch.equal(g.isnan(), w.isnan()), f"{backend}: d{name} NaN at {g.isnan().nonzero().tolist()}"
        ok = ~w.isnan()
        torch.testing.assert_close(g.double()[ok], w[ok], rtol=tol * 10, atol=tol * 10, msg=f"d{name}")
