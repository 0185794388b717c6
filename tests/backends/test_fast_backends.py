"""The hand-written backends' plumbing (every registered backend but "dense"): their custom ops (float32 softmax
statistics for bfloat16, torch.library.opcheck), deterministic backwards, torch.compile, autocast, and inference
calls that skip the op's wrappers. Their results against the oracle are in ``test_conformance.py``; each
backend's own internals in ``tests/backends/test_<name>.py``.

The backends are read from ``relattn.BACKENDS`` at collection time, so a backend added later is covered without
edits; one that cannot run here at all is skipped with its reason (``helpers.unavailable_here``). The kernels
run with small tiles (the ``small_tiles`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import backend_params, grads, random_inputs
from relattn import BACKENDS
from relattn import functional as fn

pytestmark = pytest.mark.usefixtures("small_tiles")
FAST = backend_params([name for name in BACKENDS if name != "dense"])


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
    decoding calls): the output is bitwise the one a differentiated call gives (through the custom op, or, for
    native in eager mode, its autograd Function: see test_native.py)."""
    q, k, v, rk, rv = random_inputs(1, 2, 7, 12, 4, 4, 3, tables="keys_per_head", dtype=torch.float32)
    kw = dict(max_relative_position=3, is_causal=True, query_offset=5, backend=backend)
    with torch.no_grad():
        direct = fn.relative_attention(q, k, v, rk, rv, **kw)
    through_op = fn.relative_attention(*[t.detach().requires_grad_() for t in (q, k, v, rk, rv)], **kw)
    assert torch.equal(direct, through_op.detach())
