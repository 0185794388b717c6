"""The variants the published models need, on every registered backend, against the numpy reference (float64):
asymmetric windows ``max_relative_position=(left, right)`` (offsets ``j - i`` clipped to ``[-left, right]``),
``beyond="zero"`` (no relative term outside the window) with an int ``K`` and with a pair, shared and per-head
tables, keys-only and values-only, causal, ``query_offset``, masks, and windows wider than the sequence.

Outputs are compared with the reference's; every gradient with the reference's own, by central finite
differences of the numpy reference (computed once per case), and with the dense path's autograd to float64
precision. The windows are the published ones scaled down: Wav2Vec2-BERT's (64, 8) as (5, 1), and
(0, 3), (3, 0), (2, 7); VITS's zero-beyond window 4 as K = 2 or 3.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from helpers import assert_close, backend_params, grads, np64, random_inputs, reference_output, require_backend
from relattn import BACKENDS, relative_attention
from relattn import reference as ref
from relattn.backends import native

NAMES = backend_params(["auto", *BACKENDS])


@pytest.fixture(autouse=True)
def small_native_tiles(monkeypatch):
    """3 queries per tile, 5 keys per block: the window's runs cross tile edges in the native kernel."""
    monkeypatch.setattr(native, "TILE_Q", 3)
    monkeypatch.setattr(native, "TILE_K", 5)

# (window, beyond, tables, (b, h, n, m, d, dv), is_causal, query_offset, mask)
CASES = {
    "5-1-clip-shared": ((5, 1), "clip", "shared", (1, 2, 7, 7, 3, 2), False, 0, None),
    # not causal: with left = 0, causal rows see only offsets <= 0, all at row 0, a constant that softmax drops
    "0-3-clip-per-head-decode": ((0, 3), "clip", "per_head", (1, 2, 7, 10, 3, 2), False, 3, None),
    "3-0-clip-keys-only-decode": ((3, 0), "clip", "keys_only", (1, 2, 3, 8, 3, 2), True, 5, None),
    "2-7-clip-values-only-mask": ((2, 7), "clip", "values_only", (1, 2, 6, 9, 3, 2), False, 0, "float"),
    "K2-zero-shared": (2, "zero", "shared", (2, 1, 7, 7, 3, 2), False, 0, None),
    "K3-zero-per-head-causal-mask": (3, "zero", "per_head", (1, 2, 9, 9, 3, 2), True, 0, "bool"),
    "5-1-zero-keys-per-head": ((5, 1), "zero", "keys_per_head", (1, 2, 8, 8, 3, 2), False, 0, None),
    "0-3-zero-values-only-per-head-offset": ((0, 3), "zero", "values_only_per_head", (1, 2, 7, 6, 3, 2), False, -2,
                                             None),
    "2-7-zero-keys-only-per-head-decode": ((2, 7), "zero", "keys_only_per_head", (1, 2, 4, 12, 3, 2), True, 8,
                                           None),
    "3-0-zero-values-per-head-mask": ((3, 0), "zero", "values_per_head", (1, 2, 7, 7, 3, 4), False, 0, "bool"),
    "K9-clip-wider-than-N": (9, "clip", "per_head", (1, 2, 5, 5, 3, 2), True, 0, None),
    "12-9-zero-wider-than-N": ((12, 9), "zero", "shared", (1, 2, 5, 6, 3, 2), False, 0, "float"),
}


def _mask(kind, b, h, n, m):
    g = torch.Generator().manual_seed(7)
    if kind == "float":
        mask = torch.randn(1, h, n, m, generator=g, dtype=torch.float64)
        mask[0, 0, :, 1] = float("-inf")
        return mask
    if kind == "bool":
        mask = torch.rand(n, m, generator=g) > 0.3
        mask[2] = False  # a row with nothing to attend to
        mask[3, 3] = True
        return mask
    return None


def case(name, *, requires_grad=False, seed=0):
    """The inputs, the op's keywords and the output gradient of case ``name``."""
    window, beyond, tables, (b, h, n, m, d, dv), causal, off, mask = CASES[name]
    inputs = random_inputs(b, h, n, m, d, dv, window, tables=tables, requires_grad=requires_grad, seed=seed)
    kw = dict(max_relative_position=window, beyond=beyond, is_causal=causal, query_offset=off,
              attn_mask=_mask(mask, b, h, n, m))
    go = torch.randn(b, h, n, dv, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return inputs, kw, go


@functools.cache
def reference_gradients(name):
    """d/dx sum(reference(x) * go) for every input that is not None, by central differences of the numpy
    reference (step 1e-6: truncation ~1e-12, rounding ~1e-10)."""
    inputs, kw, go = case(name)
    arrays = [np64(t) for t in inputs]
    go = go.numpy()
    kw = {**kw, "attn_mask": np64(kw["attn_mask"])}

    def loss():
        return float((ref.relative_attention(*arrays, **kw) * go).sum())

    step = 1e-6
    out = []
    for x in arrays:
        if x is None:
            continue
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + step
            up = loss()
            x[idx] = keep - step
            down = loss()
            x[idx] = keep
            g[idx] = (up - down) / (2 * step)
        out.append(torch.from_numpy(g))
    return out


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("name", list(CASES))
def test_variant_matches_reference(backend, name):
    inputs, kw, go = case(name, requires_grad=True)
    out, got = grads(backend, inputs, go, **kw)
    assert out.shape == go.shape and out.dtype == torch.float64
    assert_close(out, reference_output(*inputs, **kw), torch.float64, f"{backend} out")
    names = [n for n, t in zip(("q", "k", "v", "rel_k", "rel_v"), inputs, strict=True) if t is not None]
    _, dense = grads("dense", inputs, go, **kw)
    for n, g, want, fd in zip(names, got, dense, reference_gradients(name), strict=True):
        assert g.shape == fd.shape, n
        err, bound = (g - fd).abs().max().item(), 1e-7 * (1 + fd.abs().max().item())
        assert err <= bound, f"d{n}: {err:.3g} from the reference's finite differences (> {bound:.3g})"
        assert_close(g, want, torch.float64, f"{backend} d{n} against dense autograd")
        assert fd.abs().max() > 1e-3, n  # every gradient of these cases is worth comparing


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[1] == "zero" and "wider" not in n])
def test_zero_beyond_changes_the_answer(name):
    """Guard: in each zero-beyond case (but the one whose window covers every offset) some offsets fall outside
    the window, so clipping them to the edge rows instead would give another output; the tests above can tell
    the two apart."""
    inputs, kw, _ = case(name)
    zero = reference_output(*inputs, **kw)
    clip = reference_output(*inputs, **{**kw, "beyond": "clip"})
    assert (zero - clip).abs().max() > 1e-3


@pytest.mark.parametrize("backend", NAMES)
def test_zero_beyond_equals_clip_when_no_offset_leaves_the_window(backend):
    """N = M = 6, window (5, 5): every offset j - i is inside, so "zero" and "clip" are the same function."""
    inputs = random_inputs(2, 2, 6, 6, 3, 2, (5, 5), tables="per_head", seed=4)
    kw = dict(max_relative_position=(5, 5), is_causal=True)
    zero = relative_attention(*inputs, beyond="zero", backend=backend, **kw)
    assert_close(zero, relative_attention(*inputs, beyond="clip", backend=backend, **kw), torch.float64)
    assert_close(zero, reference_output(*inputs, beyond="zero", **kw), torch.float64)


@pytest.mark.parametrize("backend", NAMES)
def test_int_window_is_the_symmetric_pair(backend):
    """``max_relative_position=K`` is ``(K, K)``, for both ``beyond`` modes."""
    inputs = random_inputs(1, 2, 9, 9, 3, 2, 2, tables="keys_per_head", seed=5)
    for beyond in ("clip", "zero"):
        a = relative_attention(*inputs, max_relative_position=2, beyond=beyond, backend=backend)
        b = relative_attention(*inputs, max_relative_position=(2, 2), beyond=beyond, backend=backend)
        assert torch.equal(a, b)


def test_zero_beyond_puts_no_relative_term_outside_the_window():
    """By hand: values zero, a value table of ones, window (1, 0), uniform weights (q = 0). Row i then sums the
    weights of keys at offsets -1 and 0 only: 2 / M for an inner row, 1 / M for the first row."""
    b, h, n, d = 1, 1, 5, 2
    q = torch.zeros(b, h, n, d, dtype=torch.float64)
    v = torch.zeros(b, h, n, d, dtype=torch.float64)
    rel_v = torch.ones(2, d, dtype=torch.float64)
    want = torch.tensor([1.0, 2, 2, 2, 2], dtype=torch.float64)[:, None].expand(n, d) / n
    for backend in ["auto", *BACKENDS]:
        require_backend(backend)
        out = relative_attention(q, q, v, None, rel_v, max_relative_position=(1, 0), beyond="zero", backend=backend)
        torch.testing.assert_close(out[0, 0], want, rtol=1e-15, atol=1e-15)
        clipped = relative_attention(q, q, v, None, rel_v, max_relative_position=(1, 0), backend=backend)
        torch.testing.assert_close(clipped[0, 0], torch.ones(n, d, dtype=torch.float64), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("backend", backend_params(["auto", "blocked"]))
def test_gradcheck_asymmetric_zero_beyond(backend):
    """Every input element perturbed: window (2, 1), zero beyond it, a per-head key table and a shared value
    table, causal with an offset, N != M."""
    q, k, v, rk, rv = random_inputs(1, 2, 4, 6, 2, 3, (2, 1), tables="keys_per_head", requires_grad=True, seed=9)
    kw = dict(max_relative_position=(2, 1), beyond="zero", is_causal=True, query_offset=1)
    assert torch.autograd.gradcheck(lambda *x: relative_attention(*x, backend=backend, **kw), (q, k, v, rk, rv))
