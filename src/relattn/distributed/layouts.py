"""Which positions of a sequence split over ``P`` ranks each rank holds: the layouts, and moving between a full
sequence and a rank's part.

Notation: ``P`` ranks, ``n`` positions per rank (``N = P n`` in all). ``"contiguous"``: rank ``r`` holds
``[r n, (r + 1) n)``; ``"zigzag"`` (for causal attention: every rank then does the same work): rank ``r`` holds the
half-chunks ``r`` and ``2P - 1 - r`` of ``n / 2`` positions each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def segments(n: int, rank: int, world: int, layout: str = "contiguous") -> tuple[tuple[int, int, int], ...]:
    """The positions rank ``rank`` of ``world`` holds, as ``(global start, length, local start)`` segments,
    for ``n`` positions per rank."""
    check_layout(layout)
    if layout == "contiguous":
        return ((rank * n, n, 0),)
    if n % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of positions per rank; got {n}")
    c = n // 2
    return ((rank * c, c, 0), ((2 * world - 1 - rank) * c, c, c))


def positions(n: int, rank: int, world: int, layout: str = "contiguous", device=None) -> Tensor:
    """LongTensor (n,): the global positions of rank ``rank``'s ``n`` local positions."""
    return torch.cat([torch.arange(s, s + length, device=device) for s, length, _ in segments(n, rank, world, layout)])


def shard(x: Tensor, rank: int, world: int, *, dim: int, layout: str = "contiguous") -> Tensor:
    """Rank ``rank``'s part of a full sequence ``x`` (``N`` positions along ``dim``, ``N`` a multiple of ``world``;
    of ``2 world`` for ``"zigzag"``)."""
    total = x.shape[dim]
    unit = world * (2 if check_layout(layout) == "zigzag" else 1)
    if total % unit:
        raise ValueError(f"the sequence length along dim {dim} ({total}) must be a multiple of {unit} for "
                         f"{world} ranks with layout {layout!r}")
    return x.index_select(dim, positions(total // world, rank, world, layout, device=x.device))


def gather(x: Tensor, *, dim: int, layout: str = "contiguous", group=None) -> Tensor:
    """The full sequence from every rank's part ``x`` (all-gather along ``dim``, put back in position order)."""
    world, n = dist.get_world_size(group), x.shape[dim]
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    order = torch.cat([positions(n, r, world, layout, device=x.device) for r in range(world)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))
