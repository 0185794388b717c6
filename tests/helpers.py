"""What every test layer shares: one input factory, one reference adapter, dtype-derived tolerances, gradients,
and which backends can run here.

- :func:`random_inputs` draws ``q, k, v, rel_k, rel_v`` for a window (an int ``K`` or a pair ``(left, right)``),
  with the tables named by one word from :data:`TABLES`.
- :func:`reference_output` is the numpy reference (float64) applied to torch tensors, taking the op's keywords.
- :func:`assert_close` allows ``TOL_EPS * eps(dtype) * (1 + max|want|)``; :func:`grads` is the output of a backend
  and its gradients for one output gradient.
- :func:`unavailable_here` / :func:`require_backend`: a backend that cannot run on this machine at all is skipped
  with its reason; anything else a backend refuses, or a native kernel that fails to build, fails the test.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from relattn import BACKENDS, relative_attention
from relattn import reference as ref
from relattn.backends import AttentionCall, native, not_supported_reasons
from relattn.positions import check_window

TOL_EPS = 512

# Which tables a test gets: name -> ((rel_k drawn, one per head), (rel_v drawn, one per head)).
TABLES = {
    "shared": ((True, False), (True, False)),
    "per_head": ((True, True), (True, True)),
    "keys_per_head": ((True, True), (True, False)),
    "values_per_head": ((True, False), (True, True)),
    "keys_only": ((True, False), (False, False)),
    "keys_only_per_head": ((True, True), (False, False)),
    "values_only": ((False, False), (True, False)),
    "values_only_per_head": ((False, False), (True, True)),
    "none": ((False, False), (False, False)),
}


def random_inputs(b, h, n, m, d, dv, window, *, tables="shared", dtype=torch.float64, seed=0, requires_grad=False):
    """q (B,H,N,D), k (B,H,M,D), v (B,H,M,Dv) and the tables named by ``tables`` (see :data:`TABLES`):
    (R, D|Dv) shared or (H, R, D|Dv) per head, R = left + right + 1 rows for ``window`` (an int K: 2K + 1).

    Drawn in float64 from one seeded generator in the order q, k, v, rel_k, rel_v, then cast to ``dtype``: the
    same seed gives the same values at every dtype.
    """
    if tables not in TABLES:
        raise ValueError(f"tables must be one of {sorted(TABLES)}; got {tables!r}")
    left, right = check_window(window)
    rows = left + right + 1
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    q, key, v = rnd(b, h, n, d), rnd(b, h, m, d), rnd(b, h, m, dv)
    (has_k, k_heads), (has_v, v_heads) = TABLES[tables]
    rel_k = rnd(*((h,) if k_heads else ()), rows, d) if has_k else None
    rel_v = rnd(*((h,) if v_heads else ()), rows, dv) if has_v else None
    return q, key, v, rel_k, rel_v


def np64(t):
    """A tensor as a float64 numpy array (a bool tensor stays bool), None as None."""
    if t is None:
        return None
    t = t.detach().cpu()
    return t.numpy() if t.dtype == torch.bool else t.to(torch.float64).numpy()


def reference_output(q, k, v, rel_k=None, rel_v=None, **op_kwargs):
    """The numpy reference's (B, H, N, Dv) float64 output for the op's inputs and keywords
    (``max_relative_position``, ``beyond``, ``attn_mask``, ``is_causal``, ``scale``, ``query_offset``)."""
    op_kwargs["attn_mask"] = np64(op_kwargs.get("attn_mask"))
    out = ref.relative_attention(np64(q), np64(k), np64(v), np64(rel_k), np64(rel_v), **op_kwargs)
    return torch.from_numpy(np.ascontiguousarray(out))


def tol(dtype: torch.dtype) -> float:
    return TOL_EPS * torch.finfo(dtype).eps


def assert_close(got, want, dtype, what=""):
    """``max|got - want| <= TOL_EPS * eps(dtype) * (1 + max|want|)``."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = tol(dtype) * (1.0 + (want.abs().max().item() if want.numel() else 0.0))
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def grads(backend, inputs, go, **op_kwargs):
    """The op's output on ``inputs = (q, k, v, rel_k, rel_v)`` and the gradients of ``(out * go).sum()`` for the
    inputs that are not None, in order."""
    present = [t for t in inputs if t is not None]
    out = relative_attention(*inputs, backend=backend, **op_kwargs)
    return out, torch.autograd.grad(out, present, go, allow_unused=True)


# ------------------------------------------------------------------------------------ shared cases

# The shapes every fast backend is tested on: (b, h, n, m, d, dv, K, tables, is_causal, query_offset)
CASES = [
    (2, 3, 9, 9, 5, 5, 3, "keys_per_head", False, 0),
    (2, 3, 9, 9, 5, 5, 3, "values_per_head", True, 0),
    (1, 2, 7, 12, 6, 4, 2, "per_head", True, 5),  # decoding: N != M, offset M - N
    (1, 2, 12, 7, 4, 6, 2, "keys_only_per_head", False, -3),
    (1, 2, 10, 10, 4, 4, 4, "values_only", True, 0),
    (2, 1, 8, 8, 3, 3, 2, "none", False, 0),
    (1, 2, 5, 5, 4, 4, 9, "per_head", False, 0),  # K >= N
    (1, 2, 6, 6, 4, 4, 0, "keys_per_head", True, 0),  # K = 0
    (1, 1, 1, 1, 3, 3, 2, "shared", False, 0),  # N = 1
    (1, 2, 97, 97, 59, 59, 8, "keys_per_head", False, 0),  # awkward N, D
    (1, 2, 97, 97, 59, 59, 8, "values_per_head", True, 0),
    (1, 2, 7, 30, 5, 5, 3, "per_head", True, 23),
]
IDS = [f"n{c[2]}m{c[3]}d{c[4]}K{c[6]}-{c[7]}-{'causal' if c[8] else 'full'}-off{c[9]}" for c in CASES]


def case_inputs(case, **kw):
    """A CASES entry's inputs (``kw`` to :func:`random_inputs`) and its op keywords."""
    b, h, n, m, d, dv, kk, tables, causal, off = case
    return random_inputs(b, h, n, m, d, dv, kk, tables=tables, **kw), dict(max_relative_position=kk,
                                                                            is_causal=causal, query_offset=off)


# ------------------------------------------------------------------------------------ which backends run here


def _plain_call() -> AttentionCall:
    x = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    return AttentionCall(x, x, x, None, None, 1, None, False, 0.0, 1.0, 0)


def unavailable_here(name: str) -> str | None:
    """Why backend ``name`` cannot run in this test session at all, else None ("auto" always can).

    Unavailable: a backend that does not serve plain float64 CPU inputs by its declaration (a GPU kernel), or
    whose ``unavailable()`` says so (a missing package). For "native" only a missing C++ compiler or
    ``RELATTN_NATIVE=0`` count: a build that starts and fails is a bug, so its tests run and fail.
    """
    if name == "auto":
        return None
    backend = BACKENDS[name]
    declared = not_supported_reasons(dataclasses.replace(backend, unavailable=lambda: None), _plain_call())
    if declared:
        return f"backend {name!r} does not serve float64 CPU inputs: {'; '.join(declared)}"
    if name == "native":
        if os.environ.get("RELATTN_NATIVE", "1") == "0":
            return "native kernel: disabled by RELATTN_NATIVE=0"
        missing = native.toolchain_missing()
        return None if missing is None else f"native kernel: {missing}"
    why = backend.unavailable()
    return None if why is None else f"backend {name!r}: {why}"


def require_backend(name: str) -> None:
    """Skip the calling test, with the reason, when backend ``name`` cannot run here at all (see
    :func:`unavailable_here`). A backend that can must then serve the test's inputs: a refusal fails the test."""
    if (why := unavailable_here(name)) is not None:
        pytest.skip(f"unavailable here: {why}")


def backend_params(names) -> list:
    """``names`` as pytest params, each unavailable one marked skip with its reason (checked at collection)."""
    return [pytest.param(n, marks=pytest.mark.skipif(why is not None, reason=str(why)))
            for n in names for why in [unavailable_here(n)]]

