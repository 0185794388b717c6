"""Every registered backend but "dense" against the numpy reference and the dense path's autograd: outputs,
gradients, gradcheck, masks, bfloat16, determinism, its custom ops (opcheck) and torch.compile.

The backends are read from ``relattn.BACKENDS`` at collection time, so a backend added later is covered without
edits; one that cannot run here at all is skipped with its reason (``helpers.unavailable_here``). "native" runs
with tiny tiles here (``small_native_tiles``), so that every row meets several key blocks and tiles end
mid-sequence. Each backend's own internals are tested in ``test_backend_<name>.py``.

Tolerances come from the dtype (``helpers.assert_close``); bfloat16 must stay within 2x of plain PyTorch
attention's own bfloat16 error against a float64 reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import (
    CASES,
    IDS,
    assert_close,
    backend_params,
    case_inputs,
    grads,
    random_inputs,
    reference_output,
    unavailable_here,
)
from relattn import BACKENDS
from relattn import functional as fn
from relattn.backends import native

FAST_NAMES = [name for name in BACKENDS if name != "dense"]
FAST = backend_params(FAST_NAMES)
FAST_RUNNABLE = [name for name in FAST_NAMES if unavailable_here(name) is None]  # for loops inside a test
EVERY = backend_params(BACKENDS)


@pytest.fixture(autouse=True)
def small_native_tiles(monkeypatch):
    """3 queries per tile, 5 keys per block: the online softmax and the three runs cross block edges."""
    monkeypatch.setattr(native, "TILE_Q", 3)
    monkeypatch.setattr(native, "TILE_K", 5)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_reference(backend, dtype, case):
    inputs, kw = case_inputs(case, dtype=dtype)
    got = fn.relative_attention(*inputs, backend=backend, **kw)
    want = reference_output(*inputs, **kw)
    b, h, n, dv = case[0], case[1], case[2], case[5]
    assert got.dtype == dtype and got.shape == (b, h, n, dv)
    assert_close(got, want, dtype, f"{backend} {dtype}")


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_match_dense_autograd(backend, case):
    inputs, kw = case_inputs(case, requires_grad=True)
    go = torch.randn(case[0], case[1], case[2], case[5], dtype=torch.float64)
    want_out, want = grads("dense", inputs, go, **kw)
    got_out, got = grads(backend, inputs, go, **kw)
    assert_close(got_out, want_out, torch.float64, "out")
    names = [nm for nm, t in zip(("q", "k", "v", "rel_k", "rel_v"), inputs, strict=True) if t is not None]
    for name, a, w in zip(names, got, want, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")
        assert torch.count_nonzero(a) > 0 or torch.count_nonzero(w) == 0


GRADCHECK_CASES = [c for c in CASES if c[2] <= 12]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[IDS[CASES.index(c)] for c in GRADCHECK_CASES])
def test_gradcheck(backend, case):
    b, h, n, m, d, dv, kk, tables, causal, off = case
    inputs = random_inputs(1, min(h, 2), n, m, min(d, 4), min(dv, 4), kk, tables=tables, requires_grad=True)
    x = [t for t in inputs if t is not None]

    def f(*x):
        it = iter(x)
        args = [next(it) if t is not None else None for t in inputs]
        return fn.relative_attention(*args, max_relative_position=kk, is_causal=causal, query_offset=off,
                                     backend=backend)

    assert torch.autograd.gradcheck(f, x, fast_mode=True)


@pytest.mark.parametrize("backend", FAST)
def test_gradcheck_full_mode_tiny(backend):
    """Every input element perturbed (not only random directions): per-head tables, causal, offset, N != M."""
    q, k, v, rk, rv = random_inputs(1, 2, 5, 6, 3, 3, 2, tables="keys_per_head", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *x: fn.relative_attention(*x, max_relative_position=2, is_causal=True, query_offset=1,
                                         backend=backend), (q, k, v, rk, rv))


@pytest.mark.parametrize("shape", [(2, 3, 9, 11), (1, 1, 9, 11), (2, 1, 1, 11), (1, 3, 1, 1), (9, 11), (11,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_match_reference_and_dense_grads(shape, kind):
    """Every fast backend that runs here, and "auto", on masks of every broadcastable shape."""
    inputs = random_inputs(2, 3, 9, 11, 4, 4, 3, tables="keys_per_head", requires_grad=True)
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        mask = torch.rand(*shape, generator=g) > 0.3
    else:
        mask = torch.randn(*shape, generator=g, dtype=torch.float64)
    want = reference_output(*inputs, max_relative_position=3, attn_mask=mask)
    go = torch.randn(2, 3, 9, 4, dtype=torch.float64)
    want_out, want_g = grads("dense", inputs, go, max_relative_position=3, attn_mask=mask)
    for backend in (*FAST_RUNNABLE, "auto"):
        out, got_g = grads(backend, inputs, go, max_relative_position=3, attn_mask=mask)
        assert_close(out, want, torch.float64, backend)
        for a, w in zip(got_g, want_g, strict=True):
            assert_close(a, w, torch.float64, f"{backend} grad")


@pytest.mark.parametrize("backend", FAST)
def test_fully_masked_rows_give_zeros_and_zero_grads(backend):
    """Causal with a negative offset leaves rows 0..2 with no key; a backend that takes masks gets one that
    empties row 5 as well."""
    q, k, v, rk, rv = random_inputs(1, 2, 8, 8, 4, 4, 2, tables="keys_per_head", requires_grad=True)
    kw = dict(is_causal=True, query_offset=-3)
    takes_masks = BACKENDS[backend].serves.mask
    if takes_masks:
        mask = torch.ones(8, 8, dtype=torch.bool)
        mask[5] = False
        kw["attn_mask"] = mask
    out = fn.relative_attention(q, k, v, rk, rv, max_relative_position=2, backend=backend, **kw)
    empty = [0, 1, 2] + ([5] if takes_masks else [])
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert out[:, :, 3:5].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[:, :, empty], torch.zeros_like(q.grad[:, :, empty]))
    assert_close(out, reference_output(q, k, v, rk, rv, max_relative_position=2, **kw), torch.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("n", [0, 5])
def test_zero_keys_give_zeros_and_zero_gradients(backend, n, causal):
    """M = 0 (an empty cache, a fully padded batch): every backend, "dense" included, returns zeros of shape
    (B, H, N, Dv) and zero gradients (empty ones for k and v); N = 0 too."""
    inputs = random_inputs(2, 3, n, 0, 4, 6, 2, tables="keys_per_head", requires_grad=True)
    go = torch.randn(2, 3, n, 6, dtype=torch.float64)
    out, got = grads(backend, inputs, go, max_relative_position=2, is_causal=causal)
    assert out.shape == (2, 3, n, 6) and out.dtype == torch.float64
    assert torch.equal(out, torch.zeros_like(out))
    for name, g, t in zip("q k v rel_k rel_v".split(), got, inputs, strict=True):
        assert g is not None and g.shape == t.shape, name
        assert torch.equal(g, torch.zeros_like(g)), name


def test_awkward_length_1025_fast_backends():
    inputs = random_inputs(1, 1, 1025, 1025, 8, 8, 16, tables="shared", dtype=torch.float32, requires_grad=True)
    go = torch.randn(1, 1, 1025, 8)
    want_out, want = grads("dense", inputs, go, max_relative_position=16)
    for backend in FAST_RUNNABLE:
        out, got = grads(backend, inputs, go, max_relative_position=16)
        assert_close(out, want_out, torch.float32, backend)
        for a, w in zip(got, want, strict=True):
            assert_close(a, w, torch.float32, f"{backend} grad")


# ----------------------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_error_within_2x_of_plain_pytorch(backend, causal):
    q, k, v, rk, rv = random_inputs(1, 4, 200, 200, 32, 32, 16, tables="keys_per_head")
    rk, rv = rk * 0.3, rv * 0.3
    want = reference_output(q, k, v, rk, rv, max_relative_position=16, is_causal=causal)
    bf = [t.to(torch.bfloat16) for t in (q, k, v, rk, rv)]
    got = fn.relative_attention(*bf, max_relative_position=16, is_causal=causal, backend=backend)
    err = (got.double() - want).abs().max().item()
    plain64 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    plain16 = F.scaled_dot_product_attention(*bf[:3], is_causal=causal)
    plain_err = (plain16.double() - plain64).abs().max().item()
    assert got.dtype == torch.bfloat16
    assert err <= 2 * plain_err, (err, plain_err)


class _RecordCustomOps(TorchDispatchMode):
    """Records each ``relattn::`` custom op a backend calls: (op, args, kwargs, outputs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "relattn":
            self.calls.append((func, args, kwargs or {}, out))
        return out


def _custom_op_calls(backend, *inputs, **kw):
    """The custom-op calls ``backend`` makes for the op on ``inputs``, for a call autograd will differentiate; a fast
    backend is at least one custom op there (opaque to torch.compile and torch.export, with fake kernels and
    registered autograd). Inference calls may skip the op's wrappers (see test_inference_calls_equal_the_op's)."""
    inputs = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    call = fn.validate(*inputs, attn_mask=kw.pop("attn_mask", None), is_causal=kw.pop("is_causal", False),
                       dropout_p=0.0, scale=kw.pop("scale", None), query_offset=kw.pop("query_offset", 0), **kw)
    with _RecordCustomOps() as rec:
        BACKENDS[backend].run(call)
    assert rec.calls, f"backend {backend!r} called no relattn:: custom op"
    return rec.calls


@pytest.mark.parametrize("backend", FAST)
def test_softmax_statistics_are_float32_for_bfloat16(backend):
    """The forward op returns (out, lse): out in the inputs' dtype, the log-sum-exp in float32."""
    bf = [t.to(torch.bfloat16) for t in random_inputs(1, 2, 9, 9, 4, 4, 2, tables="per_head")]
    (op, _, _, (out, lse)), *_ = _custom_op_calls(backend, *bf, max_relative_position=2, scale=0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("variant", ["causal-offset-no-mask", "per-head-mask-values-only", "head-shared-mask"])
def test_custom_ops_opcheck(backend, variant):
    """torch.library.opcheck on every custom op the backend calls, with the arguments it really passes: schema,
    fake kernel, autograd registration, and the AOT dispatch."""
    q, k, v, rk, rv = random_inputs(1, 2, 7, 9, 4, 4, 2, tables="keys_per_head", dtype=torch.float32,
                                    requires_grad=True)
    if variant == "causal-offset-no-mask":
        kw = dict(is_causal=True, query_offset=2)
    elif variant == "per-head-mask-values-only":
        rk, kw = None, dict(attn_mask=torch.randn(1, 2, 7, 9))
    else:
        kw = dict(attn_mask=torch.zeros(1, 1, 7, 9))
    for op, args, kwargs, _ in _custom_op_calls(backend, q, k, v, rk, rv, max_relative_position=2, **kw):
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("backend", FAST)
def test_backward_is_deterministic(backend):
    inputs = random_inputs(1, 2, 40, 40, 8, 8, 4, tables="keys_per_head", dtype=torch.float32, requires_grad=True)
    go = torch.randn(1, 2, 40, 8)
    first = grads(backend, inputs, go, max_relative_position=4)[1]
    second = grads(backend, inputs, go, max_relative_position=4)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("backend", FAST)
def test_compile_fullgraph_smoke(backend):
    q, k, v, rk, rv = random_inputs(1, 2, 11, 11, 4, 4, 3, tables="keys_per_head", dtype=torch.float32,
                                    requires_grad=True)

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
    inputs = random_inputs(1, 2, 40, 40, 8, 8, 4, tables="keys_per_head", dtype=torch.float32)
    q16 = inputs[0].bfloat16()  # an activation from an autocast nn.Linear; k, v and the tables stay float32
    plain = fn.relative_attention(*[t.bfloat16() for t in inputs], max_relative_position=4, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = fn.relative_attention(q16, *inputs[1:], max_relative_position=4, backend=backend)
    assert under.dtype == torch.bfloat16 and torch.equal(under, plain)
    with pytest.raises(TypeError, match="rel_k has dtype torch.float32 but q has dtype torch.bfloat16"):
        fn.relative_attention(q16, *[t.bfloat16() for t in inputs[1:3]], *inputs[3:], max_relative_position=4,
                              backend=backend)


@pytest.mark.parametrize("backend", FAST)
def test_inference_calls_equal_the_ops(backend):
    """Without autograd a backend may call its kernel directly (native does, to save the op's wrappers on small
    decoding calls): the output is bitwise the one the custom op gives."""
    q, k, v, rk, rv = random_inputs(1, 2, 7, 12, 4, 4, 3, tables="keys_per_head", dtype=torch.float32)
    kw = dict(max_relative_position=3, is_causal=True, query_offset=5, backend=backend)
    with torch.no_grad():
        direct = fn.relative_attention(q, k, v, rk, rv, **kw)
    through_op = fn.relative_attention(*[t.detach().requires_grad_() for t in (q, k, v, rk, rv)], **kw)
    assert torch.equal(direct, through_op.detach())
