"""The entry point: :func:`context_parallel_attention`, the op over a sequence split across a process group, and
:class:`ContextParallel`, what a model passes its attention modules to run under context parallelism."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..arguments import AttentionArgs
from ..backends import call_seed, resolve
from ..functional import check_call, check_mask, relative_attention, validate
from .layouts import check_layout, positions, segments, shard
from .ring import Ring, RingAttention

# The op's keywords: what the ring takes (one signature: the op's).
_OP_KEYWORDS = frozenset(name for name, p in inspect.signature(relative_attention).parameters.items()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _agree(group, world: int, mine: list[int], error: Exception | None) -> None:
    """One small collective before any transfer: every rank's local shapes (and whether its own checks passed);
    a ValueError on every rank when they differ or a rank refused its inputs."""
    fields = torch.tensor([0 if error is None else 1, *mine], dtype=torch.int64)
    every = [torch.empty_like(fields) for _ in range(world)]
    dist.all_gather(every, fields, group=group)
    if error is not None:
        raise error
    refused = [r for r, f in enumerate(every) if f[0]]
    if refused:
        raise ValueError(f"context_parallel_attention: rank(s) {refused} of the group refused their inputs (see "
                         f"their error); every rank must call with valid inputs of the same shapes")
    shapes = [tuple(f[1:].tolist()) for f in every]
    if len(set(shapes)) > 1:
        names = "(positions n, batch B, heads H, key/value heads Hkv, D, Dv)"
        raise ValueError(f"context_parallel_attention needs the same local shapes on every rank; {names} per rank: "
                         + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)))


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None = None,
                               rel_v: Tensor | None = None, *, group=None, layout: str = "contiguous",
                               **op_arguments) -> Tensor:
    """:func:`relattn.relative_attention` over a sequence split across the ranks of ``group`` (default: the world).

    Every rank of the group calls it with its own part of the sequence, at the same shapes (checked by one small
    collective before any transfer: a ValueError on every rank when they differ).

    Args:
        q: (B, H, n, D) the local positions' queries (which positions: ``layout``; any leading dims, as the op).
        k: (B, H, n, D) their keys; (B, Hkv, n, D) with ``enable_gqa``.
        v: (B, H, n, Dv) their values; (B, Hkv, n, Dv) with ``enable_gqa``.
        rel_k, rel_v: the tables, as for the op, the same on every rank.
        group: the process group the sequence is split over.
        layout: ``"contiguous"`` (rank ``r`` holds ``[r n, (r + 1) n)``) or ``"zigzag"`` (rank ``r`` holds the
            half-chunks ``r`` and ``2P - 1 - r``; balanced for causal attention; ``n`` even).
        op_arguments: the keywords of :func:`relattn.relative_attention`, each as the op takes it, on the whole
            sequence of ``N = P n`` positions (``max_relative_position`` is required; a
            :class:`~relattn.positions.LogBuckets` window or zero-beyond table is expanded for the whole sequence's
            offsets), except:

            * ``attn_mask``: bool (True = may attend) or float, broadcastable to (B, H, n, N): the local queries'
              rows, every key's column in global position order; needs no gradient.
            * ``backend``: ``"auto"`` or a backend that serves context-parallel chunk pairs
              (``Serves(chunk_pairs=True)``: ``native``, ``triton``, ``blocked``); refused by its declaration
              otherwise.

    Returns:
        (B, H, n, Dv): the local positions' rows of ``relative_attention`` on the whole sequence. Differentiable
        once: q, k, v get their local gradients; each table gets this rank's share of its gradient (the sum over
        the group is the whole gradient).
    """
    unknown = sorted(set(op_arguments) - _OP_KEYWORDS)
    if unknown:
        refused = TypeError(f"context_parallel_attention got keywords the op does not take: {unknown}")
    elif "max_relative_position" not in op_arguments:
        refused = TypeError("context_parallel_attention needs max_relative_position (as the op)")
    else:
        return _ring_attention(AttentionArgs(q, k, v, rel_k, rel_v, **op_arguments), group, layout)
    return _ring_attention(None, group, layout, refused)


def _ring_attention(args: AttentionArgs | None, group, layout: str, refused: Exception | None = None) -> Tensor:
    """:func:`context_parallel_attention` of ``args`` (None: ``refused`` says why, raised on every rank after the
    shape check so that none hangs)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error, mine, seed = refused, [-1] * 6, None
    try:
        if refused is not None:
            raise refused
        q, k, v = args.q, args.k, args.v
        check_layout(layout)
        if not isinstance(q, Tensor) or not isinstance(k, Tensor) or not isinstance(v, Tensor) or q.dim() < 2 \
                or k.dim() < 2 or v.dim() < 2:
            validate(q, k, v, max_relative_position=0)  # raises, naming the argument
        n = q.shape[-2]
        mine = [n, *(q.shape[0] if q.dim() == 4 else 1, q.shape[-3] if q.dim() > 2 else 1),
                k.shape[-3] if k.dim() > 2 else 1, q.shape[-1], v.shape[-1]]
        if k.shape[-2] != n:
            raise ValueError(f"k and v must hold the same {n} local positions as q; got k {tuple(k.shape)}")
        total = world * n
        offset = args.query_offset
        call = check_call(args.replace(attn_mask=None),
                          offsets=(-(total - 1) - offset, total - 1 - offset) if isinstance(offset, int) else None)
        mask = check_mask(args.attn_mask, target=(*q.shape[:-2], n, total), like=call.q) \
            if args.attn_mask is not None else None
        if mask is not None and mask.requires_grad:
            raise ValueError("attn_mask must not require grad under context parallelism")
        call = dataclasses.replace(call, mask=mask)
        chosen = resolve(args.backend, call, chunk_pairs=True)
        seed = call_seed(call)  # drawn on every rank (the generators advance alike); rank 0's is broadcast below
        segs = tuple(segments(n, r, world, layout) for r in range(world))
    except Exception as exc:  # every rank reaches the collective below, so that every rank raises, none hangs
        error = exc
    _agree(group, world, mine, error)

    def peer(r: int) -> int:  # P2P operations name global ranks
        return r % world if group is None else dist.get_global_rank(group, r % world)

    if seed is not None:  # one mask for the whole call: every rank drops with the seed of the group's first rank
        dist.broadcast(seed, src=peer(0), group=group)
    groups = call.q.shape[1] // call.k.shape[1]
    ring = Ring(group, rank, world, peer(rank + 1), peer(rank - 1), segs, chosen.stats,
                groups=1 if chosen.serves.grouped_kv else groups, max_relative_position=call.max_relative_position,
                is_causal=call.is_causal, scale=call.scale, query_offset=call.query_offset,
                dropout_p=call.dropout_p, seed=seed)
    out = RingAttention.apply(call.q, call.k, call.v, call.rel_k, call.rel_v, call.mask, ring, call.rel_q, call.q_pos,
                              call.rel_bias)
    return out if q.dim() == 4 else out.reshape(*q.shape[:-2], *out.shape[-2:])


@dataclass(frozen=True)
class ContextParallel:
    """How a model splits its sequences: over ``group`` (None: the world) in ``layout``. A model passes it to its
    :class:`relattn.RelativeMultiheadAttention` modules (``forward(..., context_parallel=cp)``), which then run
    their own forward with :meth:`attention` in place of the op."""

    group: object = None
    layout: str = "contiguous"

    def __post_init__(self) -> None:
        check_layout(self.layout)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def shard(self, x: Tensor, *, dim: int) -> Tensor:
        """This rank's part of the full sequence ``x`` (along ``dim``)."""
        return shard(x, self.rank, self.world, dim=dim, layout=self.layout)

    def positions(self, n: int, device=None) -> Tensor:
        """The global positions of this rank's ``n`` local positions."""
        return positions(n, self.rank, self.world, self.layout, device=device)

    def key_length(self, n: int) -> int:
        """The keys a local query meets: the whole sequence's ``P n`` positions."""
        return n * self.world

    def attention(self, q, k, v, rel_k=None, rel_v=None, **op_arguments) -> Tensor:
        """:func:`context_parallel_attention` over this group and layout, with the op's arguments."""
        return context_parallel_attention(q, k, v, rel_k, rel_v, group=self.group, layout=self.layout,
                                          **op_arguments)

    def attend(self, args: AttentionArgs) -> Tensor:
        """:meth:`attention` of the op's arguments as one :class:`~relattn.arguments.AttentionArgs` (the module's)."""
        return _ring_attention(args, self.group, self.layout)
