"""What every backend must pass: its outputs and all its gradients against the oracle (``tests/helpers/__init__.py``),
within the one tolerance policy.

Every registered backend and "auto" runs every test here (the list is read from ``relattn.BACKENDS`` at
collection, so a backend added later is covered without edits; "triton" runs under Triton's interpreter on the
CPU); one that cannot run here at all is skipped with its reason (``helpers.unavailable_here``), and a refusal
of inputs it declares it serves fails. The kernels run with small tiles (the ``small_tiles`` fixture).

Outputs are compared with the specification (numpy, float64, :func:`helpers.reference_output`); gradients with
torch autograd through the float64 oracle (:func:`helpers.attention_ref`), whose own outputs and gradients are
checked against the specification first (its finite differences). The cases: arbitrary shapes, masks of every
broadcastable shape, causal, query offsets, the published variants (asymmetric windows, zero beyond the
window), per-head and shared tables, keys-only and values-only, D != Dv, a user scale, rows with no key to
attend to, no keys at all, NaN inputs, bfloat16 within twice plain PyTorch's error, gradcheck. The internals of
one backend are in ``tests/backends/test_<name>.py``; the hand-written backends' custom ops in
``test_fast_backends.py``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import (
    CASES,
    GRAD_KEYWORDS,
    IDS,
    assert_close,
    attention_ref,
    backend_params,
    case_inputs,
    grads,
    np64,
    oracle_grads,
    random_inputs,
    random_mask,
    reference_output,
    unavailable_here,
)
from relattn import BACKENDS, relative_attention
from relattn import reference as ref
from relattn.functional import validate

pytestmark = pytest.mark.usefixtures("small_tiles")

EVERY = backend_params(BACKENDS)
NAMES = backend_params(["auto", *BACKENDS])
FAST = backend_params([name for name in BACKENDS if name != "dense"])
RUNNABLE = [name for name in ["auto", *BACKENDS] if unavailable_here(name) is None]  # for loops inside a test
INPUT_NAMES = ("q", "k", "v", "rel_k", "rel_v")


def present(inputs, kw=None):
    """The names of the inputs that are given, then of the op's tensor keywords that get gradients."""
    return [n for n, t in zip(INPUT_NAMES, inputs, strict=True) if t is not None] + [
        n for n in GRAD_KEYWORDS if (kw or {}).get(n) is not None]


def assert_matches_oracle(backend, inputs, go, dtype=torch.float64, **kw):
    """The backend's output against the specification and each of its gradients (the inputs', then rel_q's and
    the biases' when given) against the float64 oracle's."""
    out, got = grads(backend, inputs, go, **kw)
    assert out.dtype == inputs[0].dtype and out.shape == go.shape
    assert_close(out, reference_output(*inputs, **kw), dtype, f"{backend} out")
    _, want = oracle_grads(inputs, go, **kw)
    for name, a, w in zip(present(inputs, kw), got, want, strict=True):
        assert a is not None and a.shape == w.shape, name
        assert_close(a, w, dtype, f"{backend} d{name}")
        assert torch.count_nonzero(a) > 0 or torch.count_nonzero(w) == 0, name
    return out, got


def output_grad(b, h, n, dv, seed=1, dtype=torch.float64):
    return torch.randn(b, h, n, dv, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------- arbitrary shapes


@st.composite
def draws(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n, m = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    k = draw(st.integers(0, 13))
    tables = draw(st.sampled_from(["shared", "per_head", "keys_only", "values_only", "none"]))
    offset = draw(st.sampled_from([0, m - n, draw(st.integers(-3, 12))]))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    mask_shape = draw(st.sampled_from([(n, m), (1, h, n, m), (b, 1, 1, m), (b, h, n, m), (m,)]))
    return dict(b=b, h=h, n=n, m=m, d=d, dv=dv, k=k, tables=tables, offset=offset, causal=causal,
                mask_kind=mask_kind, mask_shape=mask_shape, seed=draw(st.integers(0, 10**6)))


@pytest.mark.parametrize("backend", [p for p in NAMES if p.values[0] != "triton"])
@given(c=draws())
def test_any_shape_matches_reference(backend, c):
    _any_shape_matches_reference(backend, c)


@pytest.mark.parametrize("backend", [p for p in NAMES if p.values[0] == "triton"])
@settings(max_examples=min(15, settings().max_examples))  # interpreted: about half a second an example
@given(c=draws())
def test_any_shape_matches_reference_triton(backend, c):
    _any_shape_matches_reference(backend, c)


def _any_shape_matches_reference(backend, c):
    q, k, v, rk, rv = random_inputs(c["b"], c["h"], c["n"], c["m"], c["d"], c["dv"], c["k"], tables=c["tables"],
                                    seed=c["seed"])
    mask = random_mask(c["mask_kind"], c["mask_shape"], c["seed"])
    kw = dict(max_relative_position=c["k"], attn_mask=mask, is_causal=c["causal"], query_offset=c["offset"])
    out = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    assert out.shape == (c["b"], c["h"], c["n"], c["dv"]) and out.dtype == torch.float64
    assert_close(out, reference_output(q, k, v, rk, rv, **kw), torch.float64, backend)


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize(("n", "m", "k", "offset"), [(1, 1, 0, 0), (7, 7, 3, 0), (97, 97, 8, 0), (7, 7, 40, 0),
                                                     (5, 12, 4, 7), (12, 5, 2, -3)])
def test_awkward_sizes(backend, n, m, k, offset):
    q, key, v, rk, rv = random_inputs(2, 2, n, m, 59 if n == 7 else 8, 5, k, seed=n + k)
    kw = dict(max_relative_position=k, is_causal=offset > 0, query_offset=offset)
    out = relative_attention(q, key, v, rk, rv, backend=backend, **kw)
    assert_close(out, reference_output(q, key, v, rk, rv, **kw), torch.float64, backend)


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_reference(backend, dtype, case):
    inputs, kw = case_inputs(case, dtype=dtype)
    got = relative_attention(*inputs, backend=backend, **kw)
    b, h, n, dv = case[0], case[1], case[2], case[5]
    assert got.dtype == dtype and got.shape == (b, h, n, dv)
    assert_close(got, reference_output(*inputs, **kw), dtype, f"{backend} {dtype}")


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_match_oracle(backend, case):
    inputs, kw = case_inputs(case, requires_grad=True)
    assert_matches_oracle(backend, inputs, output_grad(case[0], case[1], case[2], case[5]), **kw)


@pytest.mark.slow
def test_awkward_length_1025():
    """N = M = 1025 in float32, every backend: output and gradients against the float64 oracle."""
    inputs = random_inputs(1, 1, 1025, 1025, 8, 8, 16, tables="shared", dtype=torch.float32, requires_grad=True)
    go = output_grad(1, 1, 1025, 8, dtype=torch.float32)
    want_out, want = oracle_grads(inputs, go, max_relative_position=16)
    for backend in [name for name in BACKENDS if name in RUNNABLE]:  # ("auto" is one of them at this size)
        out, got = grads(backend, inputs, go, max_relative_position=16)
        assert_close(out, want_out, torch.float32, backend)
        for name, a, w in zip(INPUT_NAMES, got, want, strict=False):
            assert_close(a, w, torch.float32, f"{backend} d{name}")


# ----------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("shape", [(2, 3, 9, 11), (1, 1, 9, 11), (2, 1, 1, 11), (1, 3, 1, 1), (9, 11), (11,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_of_every_shape(shape, kind):
    """Every backend that runs here, and "auto", on masks of every broadcastable shape."""
    inputs = random_inputs(2, 3, 9, 11, 4, 4, 3, tables="keys_per_head", requires_grad=True)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(*shape, generator=g) > 0.3 if kind == "bool" else torch.randn(*shape, generator=g,
                                                                                  dtype=torch.float64)
    for backend in RUNNABLE:
        assert_matches_oracle(backend, inputs, output_grad(2, 3, 9, 4), max_relative_position=3, attn_mask=mask)


@pytest.mark.parametrize("backend", NAMES)
def test_fully_masked_rows_give_zeros_and_zero_grads(backend):
    """Causal with a negative offset leaves rows 0..2 with no key; a backend that takes masks gets one that
    empties row 5 as well, and, in a second call, row 2 of a call that is not causal."""
    q, k, v, rk, rv = random_inputs(1, 2, 8, 8, 4, 4, 2, tables="keys_per_head", requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[5] = False
    calls = [(dict(is_causal=True, query_offset=-3, attn_mask=mask), [0, 1, 2, 5]), (dict(attn_mask=mask.roll(-3, 0)),
                                                                                      [2])]
    if backend != "auto" and not BACKENDS[backend].serves.mask:
        calls = [(dict(is_causal=True, query_offset=-3), [0, 1, 2])]
    for kw, empty in calls:
        out = relative_attention(q, k, v, rk, rv, max_relative_position=2, backend=backend, **kw)
        assert torch.isfinite(out).all()
        assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
        assert out[:, :, 3:5].abs().sum() > 0
        got = torch.autograd.grad(out.sum(), (q, k, v, rk, rv))
        assert all(torch.isfinite(g).all() for g in got)
        assert torch.equal(got[0][:, :, empty], torch.zeros_like(got[0][:, :, empty]))
        assert_close(out, reference_output(q, k, v, rk, rv, max_relative_position=2, **kw), torch.float64)
        want = oracle_grads((q, k, v, rk, rv), torch.ones_like(out), max_relative_position=2, **kw)[1]
        for name, a, w in zip(INPUT_NAMES, got, want, strict=True):
            assert_close(a, w, torch.float64, f"d{name}")


def test_causal_with_negative_offset_masks_whole_rows():
    q, k, v, rk, rv = random_inputs(1, 1, 4, 4, 3, 3, 1, seed=2)
    for backend in RUNNABLE:
        out = relative_attention(q, k, v, rk, rv, max_relative_position=1, is_causal=True, query_offset=-2,
                                 backend=backend)
        assert out[0, 0, :2].abs().max() == 0 and out[0, 0, 2:].abs().min() > 0, backend


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("n", [0, 5])
def test_zero_keys_give_zeros_and_zero_gradients(backend, n, causal):
    """M = 0 (an empty cache, a fully padded batch): zeros of shape (B, H, N, Dv) and zero gradients (empty ones
    for k and v); N = 0 too."""
    inputs = random_inputs(2, 3, n, 0, 4, 6, 2, tables="keys_per_head", requires_grad=True)
    go = torch.randn(2, 3, n, 6, dtype=torch.float64)
    out, got = grads(backend, inputs, go, max_relative_position=2, is_causal=causal)
    assert out.shape == (2, 3, n, 6) and out.dtype == torch.float64
    assert torch.equal(out, torch.zeros_like(out))
    for name, g, t in zip(INPUT_NAMES, got, inputs, strict=True):
        assert g is not None and g.shape == t.shape, name
        assert torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.parametrize("backend", EVERY)
def test_a_mask_that_needs_grad_is_served_or_refused_naming_it(backend):
    """A backend either differentiates the mask, against the oracle, or refuses the call with a reason naming it."""
    q, k, v, rk, rv = random_inputs(1, 2, 5, 6, 3, 2, 2, seed=13)
    mask = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    kw = dict(max_relative_position=2, attn_mask=mask, is_causal=True, query_offset=1)
    try:
        out = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    except ValueError as exc:
        assert f"backend {backend!r} cannot serve these inputs: " in str(exc) and "attn_mask" in str(exc)
        return
    assert_close(out, reference_output(q, k, v, rk, rv, **kw), torch.float64)
    (grad,) = torch.autograd.grad(out.sum(), mask)
    (want,) = torch.autograd.grad(attention_ref(q, k, v, rk, rv, **kw).sum(), mask)
    assert_close(grad, want, torch.float64, "d attn_mask")


# ----------------------------------------------------------------------------------------- variants

# (window, beyond, tables, (b, h, n, m, d, dv), is_causal, query_offset, mask): the published windows scaled
# down, Wav2Vec2-BERT's (64, 8) as (5, 1), and (0, 3), (3, 0), (2, 7); VITS's zero-beyond window 4 as K = 2 or 3.
VARIANTS = {
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


def _variant_mask(kind, b, h, n, m):
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


def variant(name, *, requires_grad=False, seed=0):
    """The inputs, the op's keywords and the output gradient of variant ``name``."""
    window, beyond, tables, (b, h, n, m, d, dv), causal, off, mask = VARIANTS[name]
    inputs = random_inputs(b, h, n, m, d, dv, window, tables=tables, requires_grad=requires_grad, seed=seed)
    kw = dict(max_relative_position=window, beyond=beyond, is_causal=causal, query_offset=off,
              attn_mask=_variant_mask(mask, b, h, n, m))
    return inputs, kw, output_grad(b, h, n, dv, seed=seed + 1)


@functools.cache
def reference_gradients(name):
    """d/dx sum(reference(x) * go) for every input that is not None, by central differences of the numpy
    specification (step 1e-6: truncation ~1e-12, rounding ~1e-10)."""
    inputs, kw, go = variant(name)
    arrays = [np64(t) for t in inputs]
    go = go.numpy()
    kw = {**kw, "attn_mask": np64(kw["attn_mask"])}

    def loss():
        return float((ref.relative_attention(*arrays, **kw) * go).sum())

    step, out = 1e-6, []
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


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_oracle_is_the_specification(name):
    """The oracle's output is the specification's, and its gradients the specification's finite differences
    (to their precision): the other tests may take it as the truth."""
    inputs, kw, go = variant(name)
    out, got = oracle_grads(inputs, go, **kw)
    assert_close(out, reference_output(*inputs, **kw), torch.float64, "out")
    for n, g, fd in zip(present(inputs), got, reference_gradients(name), strict=True):
        assert g.shape == fd.shape, n
        err, bound = (g - fd).abs().max().item(), 1e-7 * (1 + fd.abs().max().item())
        assert err <= bound, f"d{n}: {err:.3g} from the specification's finite differences (> {bound:.3g})"
        assert fd.abs().max() > 1e-3, n  # every gradient of these cases is worth comparing


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_oracle(backend, name):
    inputs, kw, go = variant(name, requires_grad=True)
    assert_matches_oracle(backend, inputs, go, **kw)


@pytest.mark.parametrize("name", [n for n, c in VARIANTS.items() if c[1] == "zero" and "wider" not in n])
def test_zero_beyond_changes_the_answer(name):
    """Guard: in each zero-beyond case (but the one whose window covers every offset) some offsets fall outside
    the window, so clipping them to the edge rows instead would give another output; the tests above can tell
    the two apart."""
    inputs, kw, _ = variant(name)
    assert (reference_output(*inputs, **kw) - reference_output(*inputs, **{**kw, "beyond": "clip"})).abs().max() > 1e-3


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


@pytest.mark.parametrize("backend", NAMES)
def test_zero_beyond_puts_no_relative_term_outside_the_window(backend):
    """By hand: values zero, a value table of ones, window (1, 0), uniform weights (q = 0). Row i then sums the
    weights of keys at offsets -1 and 0 only: 2 / M for an inner row, 1 / M for the first row."""
    b, h, n, d = 1, 1, 5, 2
    q = torch.zeros(b, h, n, d, dtype=torch.float64)
    v = torch.zeros(b, h, n, d, dtype=torch.float64)
    rel_v = torch.ones(2, d, dtype=torch.float64)
    want = torch.tensor([1.0, 2, 2, 2, 2], dtype=torch.float64)[:, None].expand(n, d) / n
    out = relative_attention(q, q, v, None, rel_v, max_relative_position=(1, 0), beyond="zero", backend=backend)
    assert_close(out[0, 0], want, torch.float64)
    clipped = relative_attention(q, q, v, None, rel_v, max_relative_position=(1, 0), backend=backend)
    assert_close(clipped[0, 0], torch.ones(n, d, dtype=torch.float64), torch.float64)


# ----------------------------------------------------------------------------------------- Transformer-XL

# Transformer-XL's biases (content_bias u, position_bias v) and windows at least as long as the sequence, each case
# combining them with other features: (b, h, hkv, n, m, d, dv, window, beyond, tables, biases, rel_q, causal,
# query_offset, mask). Hkv < H is grouped-query attention; "uv" both biases, "u" content only (the key table then
# reads q itself), "v" position only.
XL = {
    "K=N-1-shared-uv": (2, 3, 3, 9, 9, 5, 4, 8, "clip", "shared", "uv", False, False, 0, None),
    "K>>N-gqa-padding-uv": (2, 4, 2, 7, 7, 4, 3, 40, "clip", "per_head", "uv", False, False, 0, "padding"),
    "K>N-decode-causal-u": (1, 2, 2, 3, 10, 4, 4, 12, "clip", "keys_per_head", "u", False, True, 7, None),
    "K=N-rel_q-float-mask-v": (1, 2, 2, 6, 6, 3, 3, 6, "clip", "keys_only_per_head", "v", True, False, 0, "float"),
    "K=N-1-values-only-u": (2, 2, 2, 5, 5, 3, 4, 4, "clip", "values_only", "u", False, True, 0, None),
    "K>>N-no-bias-offset": (1, 2, 2, 6, 8, 3, 2, 30, "clip", "per_head", "", False, True, 2, None),
    "K>>N-N=1-decode-uv-gqa": (2, 4, 1, 1, 9, 4, 4, 100, "clip", "keys_per_head", "uv", True, True, 8, None),
    "20-3-zero-negative-offset-v": (1, 2, 2, 7, 5, 3, 2, (20, 3), "zero", "shared", "v", False, False, -2, "bool"),
}


def xl_case(name, *, requires_grad=True, dtype=torch.float64):
    """Inputs, op keywords and output gradient of Transformer-XL case ``name``."""
    b, h, hkv, n, m, d, dv, window, beyond, tables, biases, with_rel_q, causal, off, mask = XL[name]
    q, k, v, rk, rv = random_inputs(b, h, n, m, d, dv, window, tables=tables, seed=len(name), dtype=dtype)
    k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
    g = torch.Generator().manual_seed(3)
    kw = dict(max_relative_position=window, beyond=beyond, is_causal=causal, query_offset=off, enable_gqa=hkv < h)
    for letter, name_ in (("u", "content_bias"), ("v", "position_bias")):
        if letter in biases:
            kw[name_] = torch.randn(h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
    if with_rel_q:
        kw["rel_q"] = (torch.randn(h, rk.shape[-2], d, generator=g, dtype=torch.float64).to(dtype)
                       .requires_grad_(requires_grad))
    if mask == "padding":  # the last keys of batch entry 1 padded, as a speech batch
        kw["attn_mask"] = (torch.arange(m)[None, :] < torch.tensor([m, m - 3])[:, None])[:, None, None, :]
    elif mask is not None:
        kw["attn_mask"] = random_mask(mask, (1, h, n, m), 5)
    inputs = [None if t is None else t.requires_grad_(requires_grad) for t in (q, k, v, rk, rv)]
    return inputs, kw, output_grad(b, h, n, dv, seed=2, dtype=dtype)


def serves_biases(backend) -> bool:
    return backend == "auto" or BACKENDS[backend].serves.position_query


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("name", list(XL))
def test_transformer_xl_matches_oracle(backend, name):
    """Outputs against the specification, and the gradients of q, k, v, the tables, rel_q and both biases against
    the float64 oracle; a backend that does not take separate position queries refuses them by name (a content
    bias without a key table is only a shift of the queries: every backend serves it)."""
    inputs, kw, go = xl_case(name)
    position_queries = kw.get("position_bias") is not None or (kw.get("content_bias") is not None
                                                                and inputs[3] is not None)
    if position_queries and not serves_biases(backend):
        with pytest.raises(ValueError, match=rf"backend '{backend}' cannot serve these inputs: .*position query q_pos"):
            relative_attention(*inputs, backend=backend, **kw)
        return
    assert_matches_oracle(backend, inputs, go, **kw)


@pytest.mark.parametrize("name", list(XL))
def test_transformer_xl_cases_say_something(name):
    """Guard: in every case each bias changes the output, and the window is as long as the sequence (a window
    clipped shorter would give another answer): the comparisons above can tell a backend that drops one apart."""
    inputs, kw, _ = xl_case(name, requires_grad=False)
    out = reference_output(*inputs, **kw)
    for bias in ("content_bias", "position_bias"):
        if kw.get(bias) is not None:
            assert (out - reference_output(*inputs, **{**kw, bias: None})).abs().max() > 1e-3, bias
    window, n, m, off = kw["max_relative_position"], inputs[0].shape[2], inputs[1].shape[2], kw["query_offset"]
    reach = max(n - 1 + off, m - 1 - off)
    if isinstance(window, int) and inputs[3] is not None and reach > 2:
        def middle(t):  # the rows of offsets -2 .. 2
            return None if t is None else t[..., window - 2:window + 3, :]

        short = reference_output(*inputs[:3], middle(inputs[3]), middle(inputs[4]),
                                 **{**kw, "max_relative_position": 2, "rel_q": middle(kw.get("rel_q"))})
        assert (out - short).abs().max() > 1e-3


def test_a_window_wider_than_the_call_reads_only_the_offsets_it_reaches():
    """K = 4096 on 100 tokens: the call the backends receive has K = 99 and 199-row views of the tables (the
    rows of offsets -99 .. 99); decoding 1 query after 30 keys reaches offsets -30 .. 0, so K = 30."""
    q, k, v, rk, rv = random_inputs(1, 2, 100, 100, 4, 4, 4096, tables="keys_per_head")
    call = validate(q, k, v, rk, rv, max_relative_position=4096, attn_mask=None, is_causal=False, dropout_p=0.0,
                    scale=None, query_offset=0)
    assert call.max_relative_position == 99 and call.rel_k.shape == (2, 199, 4) and call.rel_v.shape == (1, 199, 4)
    assert call.rel_k.data_ptr() == rk[:, 4096 - 99].data_ptr()  # a view: no copy of the table
    assert torch.equal(call.rel_v[0], rv[4096 - 99:4096 + 100])
    decode = validate(q[:, :, :1], k[:, :, :31], v[:, :, :31], rk, rv, max_relative_position=4096, attn_mask=None,
                      is_causal=True, dropout_p=0.0, scale=None, query_offset=30)
    assert decode.max_relative_position == 30 and decode.rel_k.shape[-2] == 61
    narrow = validate(q, k, v, rk[:, 4096 - 50:4096 + 51], None, max_relative_position=50, attn_mask=None,
                      is_causal=False, dropout_p=0.0, scale=None, query_offset=0)
    assert narrow.max_relative_position == 50  # a window inside the reach is left as it is


@pytest.mark.parametrize("backend", [p for p in FAST if p.values[0] != "triton"])
def test_gradcheck_transformer_xl(backend):
    """Every element of q, k, v, both tables and both biases perturbed, a window wider than the sequence, GQA and
    a padding mask (triton: fast mode, interpreted, in its own file)."""
    if not serves_biases(backend):
        pytest.skip(f"{backend} does not take the biases yet")
    b, h, n, d = 1, 2, 4, 3
    g = torch.Generator().manual_seed(8)
    x = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
         for shape in ((b, h, n, d), (b, 1, n, d), (b, 1, n, 2), (h, 13, d), (13, 2), (h, d), (h, d))]
    mask = torch.tensor([True, True, True, False])
    kw = dict(max_relative_position=6, attn_mask=mask, enable_gqa=True, query_offset=1, is_causal=True)

    def f(q, k, v, rk, rv, u, pb):
        return relative_attention(q, k, v, rk, rv, content_bias=u, position_bias=pb, backend=backend, **kw)

    assert torch.autograd.gradcheck(f, x)


# ----------------------------------------------------------------------------------------- T5's scalar bias

# The scalar bias rel_bias (T5's and MPNet's: a scalar per table row, added unscaled) combined pairwise with the op's
# other options: (b, h, hkv, n, m, d, dv, window, beyond, tables, bias ("shared" (R,) or "per_head" (H, R)), rel_q,
# Transformer-XL biases, causal, query_offset, mask). T5's buckets (both directions, and the decoder's past only;
# offsets past max_distance in one) are windows as positions objects; the ints and pairs clip (or zero beyond).
T5 = {
    "t5-encoder-padding": (2, 3, 3, 9, 9, 4, 4, ("t5", 8, 12, True), "clip", "none", "per_head", False, "", False, 0,
                           "padding"),
    "t5-decoder-causal-gqa": (2, 4, 2, 10, 10, 4, 3, ("t5", 8, 12, False), "clip", "none", "per_head", False, "", True,
                              0, None),
    "t5-decode-offset-shared": (1, 2, 2, 3, 11, 4, 4, ("t5", 6, 9, False), "clip", "none", "shared", False, "", True, 8,
                                None),
    "tables-rel_q-float-mask": (1, 2, 2, 7, 7, 3, 3, 3, "clip", "per_head", "shared", True, "", False, 0, "float"),
    "zero-beyond-asym-gqa-bool": (1, 2, 1, 7, 5, 3, 2, (4, 2), "zero", "keys_only", "per_head", False, "", False, -2,
                                  "bool"),
    "xl-biases-gqa-causal": (2, 4, 2, 6, 6, 4, 4, 5, "clip", "keys_per_head", "per_head", False, "uv", True, 0, None),
    "t5-buckets-values-saturated": (1, 2, 2, 12, 12, 3, 4, ("t5", 8, 6, True), "clip", "values_per_head", "shared",
                                    False, "", False, 0, None),
}


def t5_case(name, *, requires_grad=True, dtype=torch.float64):
    """Inputs, op keywords (``rel_bias`` among them) and output gradient of scalar-bias case ``name``."""
    from helpers import TABLES
    from relattn.positions import T5Buckets, table_rows

    b, h, hkv, n, m, d, dv, window, beyond, tables, bias, with_rel_q, biases, causal, off, mask = T5[name]
    if isinstance(window, tuple) and window[0] == "t5":
        window = T5Buckets(*window[1:])
    rows = table_rows(window)
    g = torch.Generator().manual_seed(len(name))

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype).requires_grad_(requires_grad)

    (has_k, k_heads), (has_v, v_heads) = TABLES[tables]
    q, k, v = rnd(b, h, n, d), rnd(b, hkv, m, d), rnd(b, hkv, m, dv)
    rk = rnd(*((h,) if k_heads else ()), rows, d, std=0.5) if has_k else None
    rv = rnd(*((h,) if v_heads else ()), rows, dv, std=0.5) if has_v else None
    kw = dict(max_relative_position=window, beyond=beyond, is_causal=causal, query_offset=off, enable_gqa=hkv < h,
              rel_bias=rnd(*((h,) if bias == "per_head" else ()), rows, std=2.0),
              scale=1.0 if tables == "none" else None)
    for letter, name_ in (("u", "content_bias"), ("v", "position_bias")):
        if letter in biases:
            kw[name_] = rnd(h, d)
    if with_rel_q:
        kw["rel_q"] = rnd(h, rows, d, std=0.5)
    if mask == "padding":  # the last keys of batch entry 1 padded
        kw["attn_mask"] = (torch.arange(m)[None, :] < torch.tensor([m, m - 3])[:, None])[:, None, None, :]
    elif mask is not None:
        kw["attn_mask"] = random_mask(mask, (1, h, n, m), 5)
    return [q, k, v, rk, rv], kw, output_grad(b, h, n, dv, seed=2, dtype=dtype)


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("name", list(T5))
def test_scalar_bias_matches_oracle(backend, name):
    """Outputs against the specification, and every gradient (q, k, v, the tables, rel_q, the Transformer-XL biases
    and the bias table's) against the float64 oracle; a backend that does not serve the bias (or separate position
    queries) refuses it by name."""
    inputs, kw, go = t5_case(name)
    needs = {"rel_bias": True, "position_query": kw.get("position_bias") is not None}
    refused = [flag for flag, needed in needs.items() if needed and backend != "auto"
               and not getattr(BACKENDS[backend].serves, flag)]
    if refused:
        with pytest.raises(ValueError, match=rf"backend '{backend}' cannot serve these inputs"):
            relative_attention(*inputs, backend=backend, **kw)
        return
    assert_matches_oracle(backend, inputs, go, **kw)


@pytest.mark.parametrize("name", list(T5))
def test_scalar_bias_cases_say_something(name):
    """Guard: in every case the bias changes the output (a backend that drops it fails above), and so does its
    gather (the bias read at the wrong rows, reversed, gives another answer)."""
    inputs, kw, _ = t5_case(name, requires_grad=False)
    out = reference_output(*inputs, **kw)
    assert (out - reference_output(*inputs, **{**kw, "rel_bias": None})).abs().max() > 1e-3
    assert (out - reference_output(*inputs, **{**kw, "rel_bias": kw["rel_bias"].flip(-1)})).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------- scale


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("scale", [0.37, 2])
def test_user_scale(backend, scale):
    """A non-default ``scale`` reaches the scores and the backward of every backend: against the oracle, and
    against the default scale applied to queries multiplied by ``scale * sqrt(D)`` (both score terms are linear
    in q)."""
    q, k, v, rk, rv = random_inputs(2, 3, 7, 9, 5, 4, 3, tables="per_head", seed=15, requires_grad=True)
    mask = random_mask("float", (1, 3, 7, 9), 15)
    kw = dict(max_relative_position=3, attn_mask=mask, is_causal=True, query_offset=2)
    out, _ = assert_matches_oracle(backend, (q, k, v, rk, rv), output_grad(2, 3, 7, 4), scale=scale, **kw)
    rescaled = relative_attention(q * (scale * math.sqrt(5)), k, v, rk, rv, backend=backend, **kw)
    assert_close(out, rescaled, torch.float64)
    default = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    assert (out - default).abs().max() > 1e-2  # the scale changed the answer


# ----------------------------------------------------------------------------------------- NaN

# NaN in, NaN out: the outputs a NaN reaches are NaN exactly where the specification has NaN, gradients are NaN
# where autograd through the oracle has NaN, and a fully-masked row stays zeros with zero gradients. The cases
# attend without masks (a fully-masked row sits in another batch entry): a NaN in a key that a row may *not*
# attend to is unspecified (the specification's ``NaN + -inf`` and ``0 * NaN`` poison the row, a flash kernel
# never reads the key), as in PyTorch's own attention backends. For the same reason, how far a NaN in ``k`` or a
# table spreads through the gradients by ``0 * NaN`` products depends on how a backend factors its backward
# (``rowsum(dO * O)`` or the bucket gather): there the gradients must carry NaN, and agree where both are finite.

NB, NH, NN, ND, NK = 2, 2, 37, 4, 3
MASKED_ROW = 1  # in batch entry 0: no key allowed (a row i < K: it never meets offset -K)


def nan_inputs(where: str, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(NB, NH, NN, ND, generator=g, dtype=torch.float64) for _ in range(3))
    rk = torch.randn(NH, 2 * NK + 1, ND, generator=g, dtype=torch.float64)  # per head
    rv = torch.randn(2 * NK + 1, ND, generator=g, dtype=torch.float64)  # shared
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
        rv[2 * NK, 3] = nan  # offset +K
    mask = torch.ones(NB, 1, NN, NN, dtype=torch.bool)
    mask[0, 0, MASKED_ROW] = False
    return [t.to(dtype).requires_grad_() for t in (q, k, v, rk, rv)], mask


def test_expected_nan_patterns_by_hand():
    """What the specification says, spelled out, so the comparison below cannot pass on one that hides NaN."""
    def ref_nan(where):
        x, mask = nan_inputs(where, torch.float64)
        return reference_output(*x, max_relative_position=NK, attn_mask=mask).isnan().numpy()

    q = ref_nan("q")
    assert q[1, 0, 4].all() and q.sum() == ND  # the NaN query's row, nothing else
    k = ref_nan("k")
    assert k[1, 1].all() and k.sum() == NN * ND  # every row of that head sees the key
    v = ref_nan("v")
    assert v[1, 1, :, 0].all() and v.sum() == NN  # only the value's column
    rk = ref_nan("rel_k")
    assert rk[:, 1, NK:].all() and rk.sum() == NB * (NN - NK) * ND  # rows i >= K meet offset -K, in head 1 only
    rv = ref_nan("rel_v")
    assert rv[..., 3].all() and rv.sum() == NB * NH * NN  # a value-table entry: its column everywhere


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("where", ["q", "k", "v", "rel_k", "rel_v"])
def test_nan_reaches_exactly_the_reference_rows(backend, dtype, where, small_tiles):
    # 8 queries per tile, 20 keys per block: NaN rows and keys sit inside tiles and blocks, and float32 rows run
    # the native kernel's vectorized loops (8 or 16 lanes) as well as their scalar tails
    small_tiles(native=(8, 20))
    x, mask = nan_inputs(where, dtype)
    x64, _ = nan_inputs(where, torch.float64)
    kw = dict(max_relative_position=NK, attn_mask=mask)
    want = reference_output(*x64, **kw)
    go = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    oracle, want_grads = oracle_grads(x64, go, **kw)
    assert torch.equal(oracle.isnan(), want.isnan())  # the oracle is the specification, NaN for NaN
    out = relative_attention(*x, backend=backend, **kw)
    got_grads = torch.autograd.grad(out, x, go.to(dtype))

    assert want.isnan().any() and not want.isnan().all()  # the case says something
    assert_close(out, want, dtype, f"{backend} out")  # NaN exactly where the specification has NaN
    finite = ~want.isnan()
    zero = finite[0, :, MASKED_ROW]  # fully masked: zeros, except a NaN value-table entry's column (0 * NaN)
    assert zero.sum() >= NH * (ND - 1) and (out[0, :, MASKED_ROW].detach()[zero] == 0).all()
    for name, got, exp in zip(INPUT_NAMES, got_grads, want_grads, strict=True):
        if where in ("q", "v"):  # no 0 * NaN ambiguity: the exact pattern
            assert_close(got, exp, dtype, f"{backend} d{name}")
        else:
            assert got.isnan().any() == exp.isnan().any(), f"{backend}: d{name} hides or invents a NaN"
            ok = ~exp.isnan() & ~got.isnan()
            assert_close(got[ok], exp[ok], dtype, f"{backend} d{name} where finite")
    if where in ("q", "k", "v"):  # (a NaN table entry reaches the masked row's dq by 0 * NaN, as in the reference)
        assert torch.equal(got_grads[0][0, :, MASKED_ROW], torch.zeros(NH, ND, dtype=dtype))  # zero gradients


# ----------------------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_within_twice_plain_pytorch(backend, causal):
    """flash-attention's rule: the error against the float64 oracle is at most twice that of plain PyTorch on
    the same bfloat16 inputs (the oracle computed in bfloat16), outputs and gradients."""
    q, k, v, rk, rv = random_inputs(1, 2, 160, 160, 32, 32, 16, tables="keys_per_head")
    bf = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v, rk * 0.3, rv * 0.3)]
    kw = dict(max_relative_position=16, is_causal=causal)
    go = output_grad(1, 2, 160, 32, dtype=torch.bfloat16)
    want, want_grads = oracle_grads(bf, go, **kw)  # the truth for the rounded inputs
    plain = attention_ref(*bf, upcast=False, **kw)
    plain_grads = torch.autograd.grad(plain, bf, go)
    out = relative_attention(*bf, backend=backend, **kw)
    got_grads = torch.autograd.grad(out, bf, go)
    assert out.dtype == torch.bfloat16 and plain.dtype == torch.bfloat16
    assert_close(out, want, torch.bfloat16, f"{backend} out", yardstick=plain)
    for name, a, w, p in zip(INPUT_NAMES, got_grads, want_grads, plain_grads, strict=True):
        assert_close(a, w, torch.bfloat16, f"{backend} d{name}", yardstick=p)


# ----------------------------------------------------------------------------------------- gradcheck


GRADCHECK_CASES = [c for c in CASES if c[2] <= 12]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[IDS[CASES.index(c)] for c in GRADCHECK_CASES])
def test_gradcheck_fast_mode(backend, case):
    b, h, n, m, d, dv, kk, tables, causal, off = case
    inputs = random_inputs(1, min(h, 2), n, m, min(d, 4), min(dv, 4), kk, tables=tables, requires_grad=True)
    x = [t for t in inputs if t is not None]

    def f(*x):
        it = iter(x)
        args = [next(it) if t is not None else None for t in inputs]
        return relative_attention(*args, max_relative_position=kk, is_causal=causal, query_offset=off,
                                  backend=backend)

    assert torch.autograd.gradcheck(f, x, fast_mode=True)


# Full gradcheck perturbs every input element: under Triton's interpreter that is over a minute a case, so
# "triton" is checked in fast mode only (above, and with rel_q in test_triton.py); every conformance case
# also compares each of its gradients with the float64 oracle element by element.
GRADCHECK_FULL = [("shared", True), ("per_head", True), ("keys_per_head", False)]
GRADCHECK_FULL_PARAMS = [pytest.param(p.values[0], tables, masked, marks=p.marks, id=f"{tables}-{masked}-{p.values[0]}")
                         for p in NAMES for tables, masked in GRADCHECK_FULL if p.values[0] != "triton"]


@pytest.mark.parametrize(("backend", "tables", "masked"), GRADCHECK_FULL_PARAMS)
def test_gradcheck(backend, tables, masked):
    """Every input element perturbed (not only random directions): causal, an offset, N != M, D != Dv."""
    q, k, v, rk, rv = random_inputs(1, 2, 5, 6, 3, 2 if masked else 3, 2, tables=tables, seed=6 if masked else 0,
                                    requires_grad=True)
    mask = torch.randn(1, 1, 5, 6, dtype=torch.float64) if masked else None
    kw = dict(max_relative_position=2, attn_mask=mask, is_causal=True, query_offset=1)
    assert torch.autograd.gradcheck(lambda *x: relative_attention(*x, backend=backend, **kw), (q, k, v, rk, rv))


@pytest.mark.parametrize("backend", backend_params(["auto", "blocked"]))
def test_gradcheck_asymmetric_zero_beyond(backend):
    """Window (2, 1), zero beyond it, a per-head key table and a shared value table, causal with an offset."""
    q, k, v, rk, rv = random_inputs(1, 2, 4, 6, 2, 3, (2, 1), tables="keys_per_head", requires_grad=True, seed=9)
    kw = dict(max_relative_position=(2, 1), beyond="zero", is_causal=True, query_offset=1)
    assert torch.autograd.gradcheck(lambda *x: relative_attention(*x, backend=backend, **kw), (q, k, v, rk, rv))


# ----------------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("backend", EVERY)
def test_dropout_is_served_or_refused_naming_it(backend):
    """Either dropout is applied (v = 1, a^V = 0: each output is its row's sum of kept weights / (1 - p), which
    averages 1 but is not 1 everywhere) or the call is refused with a reason naming dropout."""
    q, k, _, rk, _ = random_inputs(4, 2, 16, 16, 4, 4, 3, seed=14)
    v, rv = torch.ones(4, 2, 16, 3, dtype=torch.float64), torch.zeros(7, 3, dtype=torch.float64)
    torch.manual_seed(0)
    try:
        out = relative_attention(q, k, v, rk, rv, max_relative_position=3, dropout_p=0.25, backend=backend)
    except ValueError as exc:
        assert f"backend {backend!r} cannot serve these inputs: " in str(exc) and "dropout" in str(exc)
        return
    assert (out - 1).abs().max() > 0.1
    assert abs(out.mean().item() - 1) < 0.1
    assert_close(out, out[..., :1].expand_as(out), torch.float64)  # one mask for all Dv columns
