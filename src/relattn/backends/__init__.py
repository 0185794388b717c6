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


BACKENDS: dict[str, Backend] = {
    "dense": Backend("dense", dense_attention, _always,
                     "(B,H,N,M) scores, key term gathered from q@rel_k.T, value term by bucket sums"),
}


def choose(call: AttentionCall) -> Backend:
    """The backend "auto" uses for these inputs: the fastest one that supports them."""
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
