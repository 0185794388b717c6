"""Shared test helpers: random inputs and the numpy reference applied to torch tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relattn import reference as ref
from relattn import relative_attention


def random_inputs(b, h, n, m, d, dv, k, *, dtype=torch.float64, tables="shared", seed=0, requires_grad=False):
    """q, k, v and tables; tables in {"shared", "per_head", "keys_only", "values_only", "none"}."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)

    q, key, v = rnd(b, h, n, d), rnd(b, h, m, d), rnd(b, h, m, dv)
    lead = (h,) if tables == "per_head" else ()
    rel_k = rnd(*lead, 2 * k + 1, d) if tables in ("shared", "per_head", "keys_only") else None
    rel_v = rnd(*lead, 2 * k + 1, dv) if tables in ("shared", "per_head", "values_only") else None
    return q, key, v, rel_k, rel_v


def np64(t):
    return None if t is None else t.detach().to(torch.float64).numpy()


def reference_output(q, k, v, rel_k, rel_v, **kwargs):
    mask = kwargs.pop("attn_mask", None)
    return torch.from_numpy(np.ascontiguousarray(
        ref.relative_attention(np64(q), np64(k), np64(v), np64(rel_k), np64(rel_v), attn_mask=np64(mask)
                               if mask is not None and mask.dtype != torch.bool else
                               (None if mask is None else mask.numpy()), **kwargs)))


def require_backend(name):
    """Skip the calling test, with the backend's own reason, when ``name`` serves nothing here at all.

    Probes the public op with the plainest inputs (float64 on the CPU, no mask, no dropout): a backend that
    refuses those is unavailable as a whole (e.g. "native" with ``RELATTN_NATIVE=0`` or without a compiler).
    A backend that serves them must serve every such input; tests then call it directly, so a refusal of
    a particular input is a failure, never a silent pass.
    """
    q, k, v, rel_k, rel_v = random_inputs(1, 1, 2, 2, 2, 2, 1)
    try:
        relative_attention(q, k, v, rel_k, rel_v, max_relative_position=1, backend=name)
    except ValueError as exc:
        if "cannot serve" not in str(exc):
            raise
        pytest.skip(f"unavailable here: {exc}")
