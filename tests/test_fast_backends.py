"""The fast backends ("blocked", "native") against the numpy reference, the dense path's autograd,
gradcheck. "native" runs with tiny tiles here (``small_native_tiles``), so that every row meets several key
blocks and tiles end mid-sequence.

Tolerances come from the dtype: ``TOL_EPS * eps * (1 + |ref|)`` for outputs and gradients; bfloat16 must
stay within 2x of plain PyTorch attention's own bfloat16 error against a float64 reference.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from relattn import functional as fn
from relattn import reference
from relattn.backends import BACKENDS, choose, native, not_supported_reasons
from relattn.backends.blocked import dropout_keep

# The native kernel's tests are skipped, with the reason, only on a machine with no C++ compiler at all;
# anywhere else the kernel must build, so a compile error fails them.
NO_TOOLCHAIN = native.toolchain_missing()
needs_native = pytest.mark.skipif(NO_TOOLCHAIN is not None, reason=f"native kernel: {NO_TOOLCHAIN}")
NATIVE = pytest.param("native", marks=needs_native)
FAST = ("blocked", NATIVE)
FAST_RUNNABLE = ("blocked",) + (("native",) if NO_TOOLCHAIN is None else ())  # for loops in a test
TOL_EPS = 512


@pytest.fixture(autouse=True)
def small_native_tiles(monkeypatch):
    """3 queries per tile, 5 keys per block: the online softmax and the three runs cross block edges."""
    monkeypatch.setattr(native, "TILE_Q", 3)
    monkeypatch.setattr(native, "TILE_K", 5)


def tol(dtype: torch.dtype) -> float:
    return TOL_EPS * torch.finfo(dtype).eps


def make(b=2, h=3, n=9, m=None, d=5, dv=None, kk=3, *, tables="both", per_head=(True, False), dtype=torch.float64,
         seed=0, grad=False):
    """Random inputs; ``tables`` in {"both", "keys", "values", "none"}."""
    m = n if m is None else m
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)

    q, k, v = rnd(b, h, n, d), rnd(b, h, m, d), rnd(b, h, m, dv)
    rk = rnd(*((h,) if per_head[0] else ()), 2 * kk + 1, d) if tables in ("both", "keys") else None
    rv = rnd(*((h,) if per_head[1] else ()), 2 * kk + 1, dv) if tables in ("both", "values") else None
    return q, k, v, rk, rv


def np_(t):
    return None if t is None else t.detach().double().numpy()


def ref_out(q, k, v, rk, rv, kk, **kw):
    if "attn_mask" in kw and kw["attn_mask"] is not None:
        kw["attn_mask"] = np_(kw["attn_mask"]) if kw["attn_mask"].dtype != torch.bool else kw["attn_mask"].numpy()
    return torch.from_numpy(reference.relative_attention(np_(q), np_(k), np_(v), np_(rk), np_(rv),
                                                         max_relative_position=kk, **kw))


def assert_close(got, want, dtype, what=""):
    got, want = got.detach().double(), want.detach().double()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = tol(dtype) * (1.0 + want.abs().max().item() if want.numel() else 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def grads(backend, inputs, kk, go, **kw):
    x = [t for t in inputs if t is not None]
    out = fn.relative_attention(*inputs, max_relative_position=kk, backend=backend, **kw)
    return out, torch.autograd.grad(out, x, go, allow_unused=True)


# (b, h, n, m, d, dv, K, tables, per_head, is_causal, query_offset)
CASES = [
    (2, 3, 9, 9, 5, 5, 3, "both", (True, False), False, 0),
    (2, 3, 9, 9, 5, 5, 3, "both", (False, True), True, 0),
    (1, 2, 7, 12, 6, 4, 2, "both", (True, True), True, 5),  # decoding: N != M, offset M - N
    (1, 2, 12, 7, 4, 6, 2, "keys", (True, True), False, -3),
    (1, 2, 10, 10, 4, 4, 4, "values", (False, False), True, 0),
    (2, 1, 8, 8, 3, 3, 2, "none", (False, False), False, 0),
    (1, 2, 5, 5, 4, 4, 9, "both", (True, True), False, 0),  # K >= N
    (1, 2, 6, 6, 4, 4, 0, "both", (True, False), True, 0),  # K = 0
    (1, 1, 1, 1, 3, 3, 2, "both", (False, False), False, 0),  # N = 1
    (1, 2, 97, 97, 59, 59, 8, "both", (True, False), False, 0),  # awkward N, D
    (1, 2, 97, 97, 59, 59, 8, "both", (False, True), True, 0),
    (1, 2, 7, 30, 5, 5, 3, "both", (True, True), True, 23),
]
IDS = [f"n{c[2]}m{c[3]}d{c[4]}K{c[6]}-{c[7]}-{'causal' if c[9] else 'full'}-off{c[10]}" for c in CASES]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_reference(backend, dtype, case):
    b, h, n, m, d, dv, kk, tables, per_head, causal, off = case
    inputs = make(b, h, n, m, d, dv, kk, tables=tables, per_head=per_head, dtype=dtype)
    got = fn.relative_attention(*inputs, max_relative_position=kk, is_causal=causal, query_offset=off,
                                backend=backend)
    want = ref_out(*inputs, kk, is_causal=causal, query_offset=off)
    assert got.dtype == dtype and got.shape == (b, h, n, dv)
    assert_close(got, want, dtype, f"{backend} {dtype}")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_match_dense_autograd(backend, case):
    b, h, n, m, d, dv, kk, tables, per_head, causal, off = case
    inputs = make(b, h, n, m, d, dv, kk, tables=tables, per_head=per_head, grad=True)
    go = torch.randn(b, h, n, dv, dtype=torch.float64)
    want_out, want = grads("dense", inputs, kk, go, is_causal=causal, query_offset=off)
    got_out, got = grads(backend, inputs, kk, go, is_causal=causal, query_offset=off)
    assert_close(got_out, want_out, torch.float64, "out")
    names = [nm for nm, t in zip(("q", "k", "v", "rel_k", "rel_v"), inputs, strict=True) if t is not None]
    for name, a, w in zip(names, got, want, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")
        assert torch.count_nonzero(a) > 0 or torch.count_nonzero(w) == 0


GRADCHECK_CASES = [c for c in CASES if c[2] <= 12]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[IDS[CASES.index(c)] for c in GRADCHECK_CASES])
def test_gradcheck(backend, case):
    b, h, n, m, d, dv, kk, tables, per_head, causal, off = case
    inputs = make(1, min(h, 2), n, m, min(d, 4), min(dv, 4), kk, tables=tables, per_head=per_head, grad=True)
    x = [t for t in inputs if t is not None]

    def f(*x):
        it = iter(x)
        args = [next(it) if t is not None else None for t in inputs]
        return fn.relative_attention(*args, max_relative_position=kk, is_causal=causal, query_offset=off,
                                     backend=backend)

    assert torch.autograd.gradcheck(f, x, fast_mode=True)


@pytest.mark.parametrize("shape", [(2, 3, 9, 11), (1, 1, 9, 11), (2, 1, 1, 11), (1, 3, 1, 1), (9, 11), (11,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_blocked_and_auto(shape, kind):
    inputs = make(2, 3, 9, 11, 4, 4, 3, grad=True)
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        mask = torch.rand(*shape, generator=g) > 0.3
    else:
        mask = torch.randn(*shape, generator=g, dtype=torch.float64)
    want = ref_out(*inputs, 3, attn_mask=mask)
    go = torch.randn(2, 3, 9, 4, dtype=torch.float64)
    want_out, want_g = grads("dense", inputs, 3, go, attn_mask=mask)
    for backend in (*FAST_RUNNABLE, "auto"):
        out, got_g = grads(backend, inputs, 3, go, attn_mask=mask)
        assert_close(out, want, torch.float64, backend)
        for a, w in zip(got_g, want_g, strict=True):
            assert_close(a, w, torch.float64, f"{backend} grad")


def _masks(b, h, n, m, g):
    keypad = torch.ones(b, 1, 1, m, dtype=torch.bool)
    keypad[1:, ..., m - m // 3 :] = False  # padding at the end: rows near the start see no far-right key
    start = torch.ones(b, 1, 1, m, dtype=torch.bool)
    start[..., : m // 2] = False  # no key at the start: the far-left region of the first rows is empty
    rows = torch.rand(n, m, generator=g) > 0.4
    rows[3] = False  # a row with nothing to attend to: zeros, zero gradients
    per_head = torch.randn(1, h, n, m, generator=g, dtype=torch.float64)
    per_head[0, 1, :, ::3] = float("-inf")
    return {"keypad": keypad, "start": start, "rows": rows, "per_head": per_head}


@needs_native
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("kind", ["keypad", "start", "rows", "per_head"])
@pytest.mark.parametrize("shape", [(40, 40, 4, False, 0), (40, 40, 4, True, 0), (30, 45, 5, True, 15),
                                   (30, 45, 5, False, -6)], ids=["full", "causal", "decode", "offset"])
def test_masks_on_native_match_reference_and_dense_grads(monkeypatch, chunked, kind, shape):
    """``chunked``: native with 1-query tiles, 1-key blocks."""
    backend = "native"
    n, m, kk, causal, off = shape
    b, h = 2, 3
    inputs = make(b, h, n, m, 4, 4, kk, per_head=(True, False), grad=True, seed=5)
    mask = _masks(b, h, n, m, torch.Generator().manual_seed(6))[kind]
    kw = dict(attn_mask=mask, is_causal=causal, query_offset=off)
    go = torch.randn(b, h, n, 4, dtype=torch.float64)
    want_out, want = grads("dense", inputs, kk, go, **kw)
    if chunked:
        monkeypatch.setattr(native, "TILE_Q", 1)
        monkeypatch.setattr(native, "TILE_K", 1)
    got_out, got = grads(backend, inputs, kk, go, **kw)
    assert torch.isfinite(got_out).all()
    assert_close(got_out, ref_out(*inputs, kk, **kw), torch.float64, "out vs reference")
    assert_close(got_out, want_out, torch.float64, "out")
    for name, a, w in zip("q k v rel_k rel_v".split(), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close(a, w, torch.float64, f"d{name}")
    if kind == "rows":
        assert torch.equal(got_out[:, :, 3], torch.zeros_like(got_out[:, :, 3]))


def test_gradcheck_blocked_with_mask():
    q, k, v, rk, rv = make(1, 2, 6, 7, 3, 3, 2, grad=True)
    mask = torch.randn(1, 2, 6, 7, dtype=torch.float64)
    mask[0, 0, 2] = float("-inf")  # one fully masked row
    assert torch.autograd.gradcheck(
        lambda *x: fn.relative_attention(*x, max_relative_position=2, attn_mask=mask, backend="blocked"),
        (q, k, v, rk, rv), fast_mode=True)


@pytest.mark.parametrize("backend", FAST)
def test_fully_masked_rows_give_zeros_and_zero_grads(backend):
    # causal with a negative offset leaves rows 0..2 with no key; blocked: a mask as well
    q, k, v, rk, rv = make(1, 2, 8, 8, 4, 4, 2, grad=True)
    kw = dict(is_causal=True, query_offset=-3)
    if backend == "blocked":
        mask = torch.ones(8, 8, dtype=torch.bool)
        mask[5] = False
        kw["attn_mask"] = mask
    out = fn.relative_attention(q, k, v, rk, rv, max_relative_position=2, backend=backend, **kw)
    empty = [0, 1, 2] + ([5] if backend == "blocked" else [])
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert out[:, :, 3:5].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :, empty], torch.zeros_like(q.grad[:, :, empty]))
    assert_close(out, ref_out(q, k, v, rk, rv, 2, **kw), torch.float64)


def test_awkward_length_1025_fast_backends():
    inputs = make(1, 1, 1025, 1025, 8, 8, 16, per_head=(False, False), dtype=torch.float32, grad=True)
    go = torch.randn(1, 1, 1025, 8)
    want_out, want = grads("dense", inputs, 16, go, is_causal=False)
    for backend in FAST_RUNNABLE:
        out, got = grads(backend, inputs, 16, go, is_causal=False)
        assert_close(out, want_out, torch.float32, backend)
        for a, w in zip(got, want, strict=True):
            assert_close(a, w, torch.float32, f"{backend} grad")


# ----------------------------------------------------------------------------------------- dropout


def test_dropout_hash_is_tiling_independent_and_keeps_1_minus_p():
    seed = torch.tensor(1234)
    full = dropout_keep(seed, (2, 3, 40, 50), torch.arange(40), torch.arange(50), 0.25)
    part = dropout_keep(seed, (2, 3, 40, 50), torch.arange(10, 20), torch.arange(30, 50), 0.25)
    assert torch.equal(full[:, :, 10:20, 30:50], part)
    assert abs(full.float().mean().item() - 0.75) < 0.02
    other = dropout_keep(torch.tensor(1235), (2, 3, 40, 50), torch.arange(40), torch.arange(50), 0.25)
    assert (full != other).float().mean() > 0.3


def test_dropout_reproducible_from_torch_manual_seed():
    inputs = make(1, 2, 9, 9, 4, 4, 3)

    def run(s):
        torch.manual_seed(s)
        return fn.relative_attention(*inputs, max_relative_position=3, dropout_p=0.3, backend="blocked")

    assert torch.equal(run(7), run(7))
    assert not torch.allclose(run(7), run(8))


def test_dropout_is_unbiased_over_seeds():
    """E[out] over seeds equals the no-dropout output: weights are dropped before both sums and rescaled."""
    inputs = make(1, 2, 6, 6, 4, 4, 2, tables="both")
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
    q, k, v, rk, rv = make(1, 2, 6, 7, 3, 3, 2, per_head=(True, True), grad=True)
    seed = torch.tensor(99)

    def f(*x):
        return torch.ops.relattn.blocked_fwd(*x, None, seed, 2, False, 0.3, 0.5, 0)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, rk, rv), fast_mode=True)


# ----------------------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_error_within_2x_of_plain_pytorch(backend, causal):
    q, k, v, rk, rv = make(1, 4, 200, 200, 32, 32, 16, dtype=torch.float64)
    rk, rv = rk * 0.3, rv * 0.3
    want = ref_out(q, k, v, rk, rv, 16, is_causal=causal)
    bf = [t.to(torch.bfloat16) for t in (q, k, v, rk, rv)]
    got = fn.relative_attention(*bf, max_relative_position=16, is_causal=causal, backend=backend)
    err = (got.double() - want).abs().max().item()
    plain64 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    plain16 = F.scaled_dot_product_attention(*bf[:3], is_causal=causal)
    plain_err = (plain16.double() - plain64).abs().max().item()
    assert got.dtype == torch.bfloat16
    assert err <= 2 * plain_err, (err, plain_err)


@pytest.mark.parametrize("backend", FAST)
def test_softmax_statistics_are_float32_for_bfloat16(backend):
    bf = [t.to(torch.bfloat16) for t in make(1, 2, 9, 9, 4, 4, 2, per_head=(True, True))]  # ops take (Hr, 2K+1, D)
    if backend == "blocked":
        out, lse = torch.ops.relattn.blocked_fwd(*bf, None, torch.tensor(0), 2, False, 0.0, 0.5, 0)
    else:
        out, lse = torch.ops.relattn.native_fwd(*bf, None, 2, False, 0.5, 0)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


# ----------------------------------------------------------------------------------------- choose, ops


def _call(n=9, m=None, mask=None, dropout_p=0.0, mask_grad=False, **kw):
    q, k, v, rk, rv = make(1, 2, n, m, 4, 4, 2, dtype=torch.float32)
    if mask is not None and mask_grad:
        mask = mask.float().requires_grad_()
    return fn.validate(q, k, v, rk, rv, max_relative_position=2, attn_mask=mask, is_causal=kw.get("causal", False),
                       dropout_p=dropout_p, scale=None, query_offset=0)


def test_choose_never_picks_a_backend_that_cannot_serve():
    calls = [_call(), _call(mask=torch.ones(9, 9, dtype=torch.bool)), _call(dropout_p=0.2),
             _call(mask=torch.zeros(9, 9), mask_grad=True), _call(n=600), _call(n=600, dropout_p=0.1),
             _call(n=600, mask=torch.ones(600, 600, dtype=torch.bool)),
             _call(n=600, mask=torch.zeros(600, 600), mask_grad=True), _call(n=2048, causal=True)]
    for call in calls:
        chosen = choose(call)
        assert not not_supported_reasons(chosen, call), (chosen.name, not_supported_reasons(chosen, call))
    with_native = ["native", "native", "dense", "dense", "native", "blocked", "native", "dense", "native"]
    without = ["dense", "dense", "dense", "dense", "blocked", "blocked", "blocked", "dense", "blocked"]
    assert [choose(c).name for c in calls] == (with_native if NO_TOOLCHAIN is None else without)
    assert not not_supported_reasons(BACKENDS["blocked"], calls[2])  # dropout
    assert not_supported_reasons(BACKENDS["blocked"], calls[3]) == [
        "attn_mask requires grad (only 'dense' differentiates the mask)"]
    with pytest.raises(ValueError, match="cannot serve.*attn_mask requires grad"):
        fn.relative_attention(*make(1, 1, 3, 3, 2, 2, 1), max_relative_position=1,
                              attn_mask=torch.zeros(3, 3, dtype=torch.float64, requires_grad=True), backend="blocked")


@pytest.mark.parametrize("backend", FAST)
def test_backward_is_deterministic(backend):
    inputs = make(1, 2, 40, 40, 8, 8, 4, dtype=torch.float32, grad=True)
    go = torch.randn(1, 2, 40, 8)
    first = grads(backend, inputs, 4, go)[1]
    second = grads(backend, inputs, 4, go)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_custom_ops_opcheck():
    q, k, v, rk, rv = make(1, 2, 7, 9, 4, 4, 2, per_head=(True, False), dtype=torch.float32, grad=True)
    rv = rv.detach()[None].requires_grad_()  # the ops take canonical (Hr, 2K+1, D) tables
    torch.library.opcheck(torch.ops.relattn.blocked_fwd.default,
                          (q, k, v, None, rv, torch.zeros(1, 1, 7, 9), torch.tensor(3), 2, False, 0.0, 0.5, 0))


@needs_native
def test_native_op_opcheck():
    q, k, v, rk, rv = make(1, 2, 7, 9, 4, 4, 2, per_head=(True, False), dtype=torch.float32, grad=True)
    rv = rv.detach()[None].requires_grad_()  # the ops take canonical (Hr, 2K+1, D) tables
    torch.library.opcheck(torch.ops.relattn.native_fwd.default, (q, k, v, rk, rv, None, 2, True, 0.5, 2))
    mask = torch.randn(1, 2, 7, 9)  # per head
    torch.library.opcheck(torch.ops.relattn.native_fwd.default, (q, k, v, None, rv, mask, 2, False, 0.5, 0))


@pytest.mark.parametrize("backend", FAST)
def test_compile_fullgraph_smoke(backend):
    q, k, v, rk, rv = make(1, 2, 11, 11, 4, 4, 3, dtype=torch.float32, grad=True)

    def f(q, k, v, rk, rv):
        return fn.relative_attention(q, k, v, rk, rv, max_relative_position=3, is_causal=True, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, rk, rv), f(q, k, v, rk, rv)
    assert torch.equal(got, want)
    g1 = torch.autograd.grad(got.sum(), (q, k, v, rk, rv))
    g2 = torch.autograd.grad(want.sum(), (q, k, v, rk, rv))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


@pytest.mark.parametrize("backend", FAST)
def test_autocast_casts_the_inputs_as_for_sdpa_and_no_further(backend):
    """Under autocast the op's inputs are cast as autocast casts SDPA's (tables too, so float32 parameters meet
    bfloat16 activations); inside the ops autocast is off, so the result is the op on the cast inputs, with
    float32 statistics (see test_softmax_statistics_are_float32_for_bfloat16)."""
    inputs = make(1, 2, 40, 40, 8, 8, 4, dtype=torch.float32)
    q16 = inputs[0].bfloat16()  # an activation from an autocast nn.Linear; k, v and the tables stay float32
    plain = fn.relative_attention(*[t.bfloat16() for t in inputs], max_relative_position=4, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = fn.relative_attention(q16, *inputs[1:], max_relative_position=4, backend=backend)
    assert under.dtype == torch.bfloat16 and torch.equal(under, plain)
    with pytest.raises(TypeError, match="rel_k has dtype torch.float32 but q has dtype torch.bfloat16"):
        fn.relative_attention(q16, *[t.bfloat16() for t in inputs[1:3]], *inputs[3:], max_relative_position=4,
                              backend=backend)


@pytest.mark.parametrize("backend", FAST)
def test_gradcheck_full_mode_tiny(backend):
    """Every input element perturbed (not only random directions): per-head tables, causal, offset, N != M."""
    q, k, v, rk, rv = make(1, 2, 5, 6, 3, 3, 2, per_head=(True, False), grad=True)
    assert torch.autograd.gradcheck(
        lambda *x: fn.relative_attention(*x, max_relative_position=2, is_causal=True, query_offset=1,
                                         backend=backend), (q, k, v, rk, rv))


def test_choose_without_native_uses_the_other_backends(monkeypatch):
    """No compiler (or RELATTN_NATIVE=0): "native" refuses with the reason and "auto" picks as before."""
    monkeypatch.setitem(native._state, "error", "the native kernel could not be built (no compiler)")
    calls = [_call(), _call(n=600), _call(n=600, mask=torch.ones(600, 600, dtype=torch.bool)),
             _call(n=2048, causal=True)]
    assert [choose(c).name for c in calls] == ["dense", "blocked", "blocked", "blocked"]
    with pytest.raises(ValueError, match="no compiler"):
        fn.relative_attention(*make(1, 1, 3, 3, 2, 2, 1), max_relative_position=1, backend="native")


def test_native_build_failure_is_a_reason_not_an_error(monkeypatch):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setenv("CXX", sys.executable)  # some existing program: the toolchain check passes, the build fails
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", no_compiler)
    assert native.unavailable() == ("the native kernel could not be built (RuntimeError: Ninja is required to load "
                                    "C++ extensions)")
    def no_cxx():
        raise RuntimeError("Error building extension 'relattn_native_x': [1/2] c++ -O3 -c shaw_cpu.cpp\n"
                           "FAILED: [code=127] shaw_cpu.o\n/bin/sh: 1: c++: not found\n"
                           "ninja: build stopped: subcommand failed.\n")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", no_cxx)
    assert native.unavailable() == "the native kernel could not be built (RuntimeError: /bin/sh: 1: c++: not found)"
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native.unavailable() == ("the native kernel cannot be built: no C++ compiler ('/nonexistent/c++' not "
                                    "found; set CXX or install g++)")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("RELATTN_NATIVE", "0")
    assert native.unavailable() == "disabled by RELATTN_NATIVE=0"


@needs_native
def test_native_refuses_dropout():
    with pytest.raises(ValueError, match="native.*dropout"):
        fn.relative_attention(*make(1, 2, 9, 9, 4, 4, 2), max_relative_position=2, dropout_p=0.1, backend="native")


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_16_bit_is_float32_inside(dtype):
    """16-bit inputs are computed in float32: the output is the float32 computation on the same (rounded) inputs,
    rounded once. The backward is the float32 one, except that rowsum(dO * O) uses the saved 16-bit output (as
    PyTorch's own flash backward does), so gradients are within a few 16-bit roundings of the float32 ones."""
    lo = [t.to(dtype).requires_grad_() for t in make(1, 2, 30, 30, 8, 8, 3, per_head=(True, False))]
    hi = [t.detach().float().requires_grad_() for t in lo]
    go = torch.randn(1, 2, 30, 8).to(dtype)
    out_lo, g_lo = grads("native", lo, 3, go, is_causal=True)
    out_hi, g_hi = grads("native", hi, 3, go.float(), is_causal=True)
    assert out_lo.dtype == dtype and torch.equal(out_lo, out_hi.to(dtype))
    eps = torch.finfo(dtype).eps
    for a, b, x in zip(g_lo, g_hi, lo, strict=True):
        assert a.dtype == x.dtype
        err, bound = (a.float() - b).abs().max().item(), 4 * eps * (1 + b.abs().max().item())
        assert err <= bound, (err, bound)


def _case_runner(monkeypatch, case, *, tiles, splits=0, seed):
    """Set the native kernel's (queries, keys) tiles and backward key segments, make the inputs of a CASES entry,
    and return ``run(backend)`` -> (output, gradients) for one fixed output gradient."""
    monkeypatch.setattr(native, "TILE_Q", tiles[0])
    monkeypatch.setattr(native, "TILE_K", tiles[1])
    monkeypatch.setattr(native, "KV_SPLITS", splits)
    b, h, n, m, d, dv, kk, tables, per_head, causal, off = case
    inputs = make(b, h, n, m, d, dv, kk, tables=tables, per_head=per_head, grad=True, seed=seed)
    go = torch.randn(b, h, n, dv, dtype=torch.float64)
    return lambda backend: grads(backend, inputs, kk, go, is_causal=causal, query_offset=off)


@needs_native
@pytest.mark.parametrize("tiles", [(1, 1), (2, 3), (4, 7), (256, 512)])
@pytest.mark.parametrize("case", CASES[:5] + CASES[9:], ids=IDS[:5] + IDS[9:])
def test_native_any_tiling_matches_dense_autograd(monkeypatch, tiles, case):
    """The kernel's result does not depend on its tile sizes (tiles of 1, odd sizes, one tile for everything)."""
    run = _case_runner(monkeypatch, case, tiles=tiles, seed=3)
    want_out, want = run("dense")
    got_out, got = run("native")
    assert_close(got_out, want_out, torch.float64, "out")
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, torch.float64, "grad")


@needs_native
@pytest.mark.parametrize("splits", [0, 2, 5])
@pytest.mark.parametrize("case", CASES[:5] + CASES[9:] + [(1, 1, 40, 40, 4, 4, 3, "both", (True, True), False, 0)],
                         ids=IDS[:5] + IDS[9:] + ["one-head"])
def test_native_backward_key_segments(monkeypatch, splits, case):
    """The backward split into key segments per head (forced, or automatic when batch * heads < threads, as in
    the one-head case): the same gradients, and the same bits from one call to the next."""
    run = _case_runner(monkeypatch, case, tiles=(2, 3), splits=splits, seed=4)
    want = run("dense")[1]
    got = run("native")[1]
    again = run("native")[1]
    for a, w, a2 in zip(got, want, again, strict=True):
        assert_close(a, w, torch.float64, "grad")
        assert torch.equal(a, a2)
