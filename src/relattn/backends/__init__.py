"""Backends, picked by one checked string.

A backend is a function with the signature of :func:`relattn.backends.dense.dense_attention`
(validated, canonical inputs: tables as (Hr, 2K+1, D) with Hr in {1, H}; ``mask`` None or an additive
float tensor of 4 dims broadcastable to (B, H, N, M)) and a ``supports`` predicate that returns
``None`` when it can serve the inputs, else the reason it cannot. ``"auto"`` picks among them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dense import dense_attention


@dataclass(frozen=True)
class AttentionCall:
    """The validated inputs of one call, for ``supports`` predicates and ``choose``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rel_k: torch.Tensor | None
    rel_v: torch.Tensor | None
    max_relative_position: int
    mask: torch.Tensor | None
    is_causal: bool
    dropout_p: float
    scale: float
    query_offset: int


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., torch.Tensor]
    supports: Callable[[AttentionCall], str | None]
    doc: str


def _always(call: AttentionCall) -> str | None:
    return None


from . import fused as fused_kernels  # noqa: E402
from .ops import (  # noqa: E402
    blocked_attention,
    blocked_supports,
    fused_attention,
    fused_supports,
    native_attention,
    native_supports,
)

BACKENDS: dict[str, Backend] = {
    "dense": Backend("dense", dense_attention, _always,
                     "(B,H,N,M) scores, key term gathered from q@rel_k.T, value term by bucket sums"),
    "blocked": Backend("blocked", blocked_attention, blocked_supports,
                       "flash algorithm in plain torch: online softmax over key blocks, O(N(D+K)) memory, "
                       "any mask, dropout"),
    "native": Backend("native", native_attention, native_supports,
                      "C++ kernel, one flash pass: the key term added per row in three runs (left, band, right), "
                      "the value term as 2K+1 weights per row; CPU, masks, no dropout (16-bit in float32)"),
    "fused": Backend("fused", fused_attention, fused_supports,
                     "PyTorch's fused attention for |j-i| >= K (edge rows folded into k, v), a 2K-1 band per "
                     "row, merged by log-sum-exp; masks on the CPU, no dropout"),
}

# Crossover measured by benchmarks/crossover.py (fwd+bwd, float32, B=1, H=8, D=64, both tables; on the
# shared 2-core dev machine): "native" was fastest at every N from 16 to 384 (K = 16 and 64; 1.0-2.5x faster
# than dense; at N <= 32 by only ~0.1 ms, which short runs can invert), so "auto" takes it whenever it can serve
# the inputs. Without it (dropout, CUDA, no compiler):
# dense was fastest up to N = M = 256 at K = 16 and up to 384 at K = 64 (1 thread), "fused" from 384 / 512 on,
# and "blocked" beat "dense" from about the same N. So dense serves problems with N*M <= (256 + 3K)^2 scores
# per head; at N >= 2048 "auto" never builds an (N, M) tensor.


def dense_max_scores(max_relative_position: int) -> int:
    """Largest N*M per head for which "auto" picks "dense" (see the crossover note above)."""
    return (256 + 3 * max_relative_position) ** 2


def choose(call: AttentionCall) -> Backend:
    """The backend "auto" uses for these inputs: the fastest one that supports them.

    "native" first (CPU, no dropout, a mask that needs no grad, the kernel built); then small
    problems go to "dense"; otherwise "fused" when it can serve the inputs (no dropout; a mask only on the
    CPU and not one that requires grad), else "blocked" (O(N) memory, anything but a mask that requires
    grad), else "dense".
    """
    n, m = call.q.shape[-2], call.k.shape[-2]
    # symbolic sizes (torch.export with a dynamic length): no guard on N, take a size-independent backend
    small = isinstance(n, int) and isinstance(m, int) and n * m <= dense_max_scores(call.max_relative_position)
    order = ("native", "dense", "fused", "blocked") if small else ("native", "fused", "blocked", "dense")
    if call.q.is_cuda and not fused_kernels.CUDA_VERIFIED:
        order = tuple(name for name in order if name != "fused")
    for name in order:
        if BACKENDS[name].supports(call) is None:
            return BACKENDS[name]
    return BACKENDS["dense"]


def resolve(name: str, call: AttentionCall) -> Backend:
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        valid = ", ".join(repr(n) for n in ["auto", *BACKENDS])
        raise ValueError(f"backend must be one of {valid}; got {name!r}")
    if name == "auto":
        return choose(call)
    backend = BACKENDS[name]
    reason = backend.supports(call)
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot serve these inputs: {reason}")
    return backend
