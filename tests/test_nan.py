"""NaN in, NaN out, on every backend: the outputs a NaN reaches are NaN exactly where the numpy reference has
NaN, gradients are NaN where autograd through the reference's formula has NaN, and a fully-masked row stays
zeros with zero gradients.

The cases attend without masks (a fully-masked row sits in another batch entry): a NaN in a key that a row may
*not* attend to is unspecified (the reference's ``NaN + -inf`` and ``0 * NaN`` poison the row, a flash kernel
never reads the key), as in PyTorch's own attention backends. For the same reason, how far a NaN in ``k`` or a
table spreads through the gradients by ``0 * NaN`` products depends on how a backend factors its backward
(``rowsum(dO * O)`` or the bucket gather): there the gradients must carry NaN, and agree where both are finite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relattn import BACKENDS, reference, relative_attention, relative_position_index
from relattn.backends import native

B, H, N, D, K = 2, 2, 37, 4, 3
MASKED_ROW = 1  # in batch entry 0: no key allowed (a row i < K: it never meets offset -K)


@pytest.fixture(autouse=True)
def small_native_tiles(monkeypatch):
    """8 queries per tile, 20 keys per block: NaN rows and keys sit inside tiles and blocks, and float32 rows run
    the kernel's vectorized loops (8 or 16 lanes) as well as their scalar tails."""
    monkeypatch.setattr(native, "TILE_Q", 8)
    monkeypatch.setattr(native, "TILE_K", 20)


def inputs(where: str, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    rk = torch.randn(H, 2 * K + 1, D, generator=g, dtype=torch.float64)  # per head
    rv = torch.randn(2 * K + 1, D, generator=g, dtype=torch.float64)  # shared
    nan = float("nan")
    if where == "q":
        q[1, 0, 4, 2] = nan
    elif where == "k":
        k[1, 1, 3, 0] = nan
    elif where == "v":
        v[1, 1, 3, 0] = nan
    elif where == "rel_k":
        rk[1, 0, 1] = nan  # offset -K: only rows i >= K meet it
    elif where == "rel_v":
        rv[2 * K, 3] = nan  # offset +K
    mask = torch.ones(B, 1, N, N, dtype=torch.bool)
    mask[0, 0, MASKED_ROW] = False
    return [t.to(dtype).requires_grad_() for t in (q, k, v, rk, rv)], mask


def literal(q, k, v, rk, rv, mask):
    """The reference's formula in float64 torch, for autograd: gathered key term, bucket-summed value term, and
    the reference's softmax (a row of -inf gives zeros)."""
    idx = relative_position_index(N, N, K)
    s = q @ k.transpose(-1, -2) + torch.gather(q @ rk.transpose(-1, -2), -1, idx.expand(B, H, N, N))
    s = s / math.sqrt(D) + torch.zeros(mask.shape, dtype=s.dtype).masked_fill(~mask, -math.inf)
    peak = s.detach().amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)))
    total = e.sum(-1, keepdim=True)
    w = e / torch.where(total == 0, torch.ones_like(total), total)  # a NaN total stays NaN
    buckets = torch.zeros(B, H, N, 2 * K + 1, dtype=w.dtype).scatter_add(-1, idx.expand(B, H, N, N), w)
    return w @ v + buckets @ rv


def np_(t):
    return t.detach().double().numpy()


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("where", ["q", "k", "v", "rel_k", "rel_v"])
def test_nan_reaches_exactly_the_reference_rows(backend, dtype, where):
    x, mask = inputs(where, dtype)
    x64, _ = inputs(where, torch.float64)
    want = torch.from_numpy(reference.relative_attention(*map(np_, x64), max_relative_position=K,
                                                         attn_mask=mask.numpy()))
    lit = literal(*x64, mask)
    assert torch.equal(lit.isnan(), want.isnan())  # the literal formula is the reference's, NaN for NaN
    go = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_grads = torch.autograd.grad(lit, x64, go)
    try:
        out = relative_attention(*x, max_relative_position=K, attn_mask=mask, backend=backend)
    except (ValueError, TypeError, RuntimeError) as err:
        if "backend" in str(err) or "support" in str(err):
            pytest.skip(f"{backend} refuses these inputs: {err}")
        raise
    got_grads = torch.autograd.grad(out, x, go.to(dtype))

    assert want.isnan().any() and not want.isnan().all()  # the case says something
    assert torch.equal(out.isnan(), want.isnan()), f"{backend}: NaN at {out.isnan().nonzero().tolist()}"
    finite = ~want.isnan()
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out.detach().double()[finite], want[finite], rtol=tol, atol=tol)
    zero = finite[0, :, MASKED_ROW]  # fully masked: zeros, except a NaN value-table entry's column (0 * NaN)
    assert zero.sum() >= H * (D - 1) and (out[0, :, MASKED_ROW].detach()[zero] == 0).all()
    names = ("q", "k", "v", "rel_k", "rel_v")
    for name, got, exp in zip(names, got_grads, want_grads, strict=True):
        if where in ("q", "v"):  # no 0 * NaN ambiguity: the exact pattern
            assert torch.equal(got.isnan(), exp.isnan()), f"{backend}: d{name} NaN at {got.isnan().nonzero().tolist()}"
        else:
            assert got.isnan().any() == exp.isnan().any(), f"{backend}: d{name} hides or invents a NaN"
        ok = ~exp.isnan() & ~got.isnan()
        torch.testing.assert_close(got.double()[ok], exp[ok], rtol=tol, atol=tol, msg=f"d{name}")
    if where in ("q", "k", "v"):  # (a NaN table entry reaches the masked row's dq by 0 * NaN, as in the reference)
        assert torch.equal(got_grads[0][0, :, MASKED_ROW], torch.zeros(H, D, dtype=dtype))  # zero gradients


def test_expected_nan_patterns_by_hand():
    # What the reference says, spelled out, so the comparison above cannot pass on a reference that hides NaN.
    def ref_nan(where):
        x, mask = inputs(where, torch.float64)
        out = reference.relative_attention(*map(np_, x), max_relative_position=K, attn_mask=mask.numpy())
        return np.isnan(out)

    q = ref_nan("q")
    assert q[1, 0, 4].all() and q.sum() == D  # the NaN query's row, nothing else
    k = ref_nan("k")
    assert k[1, 1].all() and k.sum() == N * D  # every row of that head sees the key
    v = ref_nan("v")
    assert v[1, 1, :, 0].all() and v.sum() == N  # only the value's column
    rk = ref_nan("rel_k")
    assert rk[:, 1, K:].all() and rk.sum() == B * (N - K) * D  # rows i >= K meet offset -K, in head 1 only
    rv = ref_nan("rel_v")
    assert rv[..., 3].all() and rv.sum() == B * H * N  # a value-table entry: its column everywhere
