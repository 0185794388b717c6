"""Context parallelism: Shaw attention over a sequence split across the ranks of a ``torch.distributed`` group.

Notation: ``P`` ranks in the group, ``B`` batch, ``H`` heads, ``n`` positions per rank (``N = P * n`` in all),
``D``/``Dv`` head dims, ``K`` max relative position.

Each rank holds ``n`` positions of q, k and v (which ones: the *layout*), and :func:`context_parallel_attention`
gives it the output of those positions, exactly what :func:`relattn.relative_attention` gives on the whole
sequence. The keys and values travel around a ring: at step ``s`` rank ``r`` computes its queries against the
chunk of rank ``r - s`` while sending that chunk on to ``r + 1`` and receiving the next from ``r - 1``
(``batch_isend_irecv``), and the partial outputs are merged by their log-sum-exp in step order (deterministic).
A chunk's keys lie at known positions, so each (query segment, key segment) pair is one backend call with
``query_offset`` = the queries' start minus the keys' start: keys farther than ``K`` from every query meet only
the edge rows ``a^K[0]`` / ``a^K[2K]``, which every rank holds, so no table rows travel, only k and v.
Under ``is_causal`` a pair wholly in the future is skipped. The backward runs the ring again with the k/v chunk,
and the chunk's dK/dV accumulator follows it home; each pair's gradients come from the backend's own backward
called with the merged output and log-sum-exp, which makes them the exact contributions of that pair.

The chunk computations use a backend that returns its log-sum-exp: ``"native"`` (the C++ kernel, CPU),
``"triton"`` (CUDA) or ``"blocked"`` (plain torch, any device); ``"auto"`` takes them in that order.

Layouts (:data:`LAYOUTS`): ``"contiguous"``, rank ``r`` holds ``[r n, (r + 1) n)``; ``"zigzag"`` (for causal
attention: every rank then does the same work), rank ``r`` holds the half-chunks ``r`` and ``2P - 1 - r`` of
``n / 2`` positions each. :func:`shard` cuts a full sequence into a rank's part, :func:`positions` names its
positions, :func:`gather` puts the parts back together.

Gradients: q, k, v get the gradients of the local positions. A table's gradient on each rank is that rank's
share; their sum over the group is the single-process gradient, as for every parameter under context
parallelism (the projections' gradients are shares too). DistributedDataParallel or FSDP over all ranks
complete them: with each rank's loss the mean over its own positions, their average over the world is the
gradient of the global mean loss.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .backends import BACKENDS, not_supported_reasons
from .backends._common import stats_dtype
from .functional import additive_mask, validate

LAYOUTS = ("contiguous", "zigzag")
RING_BACKENDS = ("native", "triton", "blocked")  # those whose custom ops return (out, lse); "auto" in this order
_TAG_KV, _TAG_GRAD = 7301, 7302  # gloo matches messages by tag; NCCL by order (both kept the same on both sides)


# ------------------------------------------------------------------------------------------------------ layouts


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def segments(n: int, rank: int, world: int, layout: str = "contiguous") -> tuple[tuple[int, int, int], ...]:
    """The positions rank ``rank`` of ``world`` holds, as ``(global start, length, local start)`` segments,
    for ``n`` positions per rank."""
    _check_layout(layout)
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
    unit = world * (2 if _check_layout(layout) == "zigzag" else 1)
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


# ------------------------------------------------------------------------------------------------------ timeline

_timeline: list | None = None


@contextlib.contextmanager
def record_timeline():
    """Within the block, the ring appends ``(pass, step, event, time.perf_counter())`` to the yielded list for
    each event: ``"issue"`` (the step's sends and receives posted), ``"compute_start"``, ``"compute_end"`` and
    ``"wait_end"`` (the step's transfers complete). How the overlap of communication and compute is checked."""
    global _timeline
    previous, _timeline = _timeline, []
    try:
        yield _timeline
    finally:
        _timeline = previous


def _mark(phase: str, step: int, event: str) -> None:
    if _timeline is not None:
        _timeline.append((phase, step, event, time.perf_counter()))


# ------------------------------------------------------------------------------------------------------ chunks


def _chunk_forward(backend, q, k, v, rel_k, rel_v, mask, kk, is_causal, scale, offset):
    """(out, lse) of one (query segment, key segment) pair."""
    if backend == "blocked":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.relattn.blocked_fwd(q, k, v, rel_k, rel_v, mask, seed, kk, is_causal, 0.0, scale, offset)
    return getattr(torch.ops.relattn, f"{backend}_fwd")(q, k, v, rel_k, rel_v, mask, kk, is_causal, scale, offset)


def _chunk_backward(backend, grad_out, q, k, v, rel_k, rel_v, mask, out, lse, kk, is_causal, scale, offset):
    """(dq, dk, dv, d_rel_k, d_rel_v) of one pair, given the *merged* out and lse of the queries."""
    if backend == "blocked":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.relattn.blocked_bwd(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, kk, is_causal,
                                             0.0, scale, offset)[:5]  # the sixth, rel_q's, is empty here
    return getattr(torch.ops.relattn, f"{backend}_bwd")(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, kk,
                                                        is_causal, scale, offset)[:5]


def _merge(out: Tensor | None, lse: Tensor | None, o: Tensor, lo: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint keys as one: weights ``exp(lse_part - lse_both)``."""
    if out is None:
        return o, lo
    both = torch.logaddexp(lse, lo)
    ref = torch.where(torch.isneginf(both), torch.zeros_like(both), both)  # no key in either: stays zeros
    return out * torch.exp(lse - ref)[..., None] + o * torch.exp(lo - ref)[..., None], both


@dataclass(frozen=True)
class _Pair:
    """One backend call: a segment of this rank's queries against a segment of the chunk held."""

    qs: tuple  # (global start, length, local start)
    ks: tuple
    is_causal: bool
    query_offset: int
    rows: slice  # the table rows the pair meets: all of them, or the one edge row of a pair beyond the window


def _pairs(ring: _Ring, src: int):
    """The pairs rank ``ring.rank`` computes against the chunk of ``src``. Under causality pairs wholly in the
    future are left out and wholly past ones need no causal test. A pair whose offsets ``j - i`` all lie beyond
    ``-K`` (or all beyond ``K``) meets one table row only, ``a[0]`` (or ``a[2K]``), and runs with that row as a
    table of ``K = 0``: every key of the pair takes it, and the call costs no ``2K + 1`` dot products per query."""
    kk = ring.max_relative_position
    for qs in ring.segments[ring.rank]:
        for ks in ring.segments[src]:
            q0, q1, k0, k1 = qs[0], qs[0] + qs[1], ks[0], ks[0] + ks[1]
            if ring.is_causal and k0 > q1 - 1:
                continue
            rows = slice(0, 1) if k1 - 1 - q0 < -kk else slice(2 * kk, 2 * kk + 1) if k0 - (q1 - 1) > kk else None
            yield _Pair(qs, ks, ring.is_causal and k1 - 1 > q0, q0 - k0, rows)


def _tables(pair: _Pair, rel_k, rel_v, kk: int):
    """The tables and ``K`` a pair's call takes."""
    if pair.rows is None:
        return rel_k, rel_v, kk
    return (None if rel_k is None else rel_k[:, pair.rows], None if rel_v is None else rel_v[:, pair.rows], 0)


def _mask_for(mask: Tensor | None, qs, ks) -> Tensor | None:
    if mask is None:
        return None
    rows = slice(qs[2], qs[2] + qs[1]) if mask.shape[2] > 1 else slice(None)
    cols = slice(ks[0], ks[0] + ks[1]) if mask.shape[3] > 1 else slice(None)
    return mask[:, :, rows, cols]


def _rows(t: Tensor, seg) -> Tensor:
    return t.narrow(2, seg[2], seg[1])


# ------------------------------------------------------------------------------------------------------ the ring


@dataclass(frozen=True)
class _Ring:
    group: object
    rank: int
    world: int
    send_to: int  # global ranks of the neighbours
    recv_from: int
    segments: tuple  # per rank of the group: its (global start, length, local start) segments
    max_relative_position: int
    is_causal: bool
    scale: float
    backend: str

    def exchange(self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]):
        """Post the sends (to the next rank) and receives (from the previous), receives first; returns the works."""
        ops = [dist.P2POp(dist.irecv, t, self.recv_from, self.group, tag) for t, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, self.send_to, self.group, tag) for t, tag in sends]
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


def _ring_forward(ring: _Ring, q, k, v, rel_k, rel_v, mask):
    """(out (B,H,n,Dv) in q's dtype, lse (B,H,n)) of the local queries against the whole sequence."""
    d = k.shape[-1]
    stats = stats_dtype(q.dtype)
    kv = torch.cat([k, v], -1).contiguous()
    spare = torch.empty_like(kv) if ring.world > 1 else None
    acc = {qs: (None, None) for qs in ring.segments[ring.rank]}
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        works = ring.exchange([(kv, _TAG_KV)], [(spare, _TAG_KV)]) if step < ring.world - 1 else []
        _mark("forward", step, "issue")
        _mark("forward", step, "compute_start")
        for pair in _pairs(ring, src):
            qs, ks = pair.qs, pair.ks
            pair_k, pair_v, pair_kk = _tables(pair, rel_k, rel_v, ring.max_relative_position)
            o, lo = _chunk_forward(ring.backend, _rows(q, qs), _rows(kv[..., :d], ks), _rows(kv[..., d:], ks),
                                   pair_k, pair_v, _mask_for(mask, qs, ks), pair_kk, pair.is_causal, ring.scale,
                                   pair.query_offset)
            acc[qs] = _merge(*acc[qs], o.to(stats), lo)
        _mark("forward", step, "compute_end")
        _wait(works)
        _mark("forward", step, "wait_end")
        if works:
            kv, spare = spare, kv
    outs, lses = zip(*(acc[qs] for qs in ring.segments[ring.rank]), strict=True)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def _ring_backward(ring: _Ring, grad_out, q, k, v, rel_k, rel_v, mask, out, lse):
    """(dq, dk, dv, d_rel_k share, d_rel_v share) of the local positions."""
    d = k.shape[-1]
    acc_dtype = stats_dtype(q.dtype)
    grad_out = grad_out.contiguous()
    kv = torch.cat([k, v], -1).contiguous()
    spare = torch.empty_like(kv) if ring.world > 1 else None
    dq = torch.zeros_like(q, dtype=acc_dtype)
    d_rel_k = None if rel_k is None else torch.zeros_like(rel_k, dtype=acc_dtype)
    d_rel_v = None if rel_v is None else torch.zeros_like(rel_v, dtype=acc_dtype)
    arriving = torch.empty_like(kv, dtype=acc_dtype) if ring.world > 1 else None  # dK|dV of the chunk now held
    pending, sent = [], None  # the previous step's send of the gradient accumulator, and what it sends
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        recvs = ([(arriving, _TAG_GRAD)] if step > 0 else []) + ([(spare, _TAG_KV)] if step < ring.world - 1 else [])
        works = ring.exchange([(kv, _TAG_KV)] if step < ring.world - 1 else [], recvs)
        _mark("backward", step, "issue")
        _mark("backward", step, "compute_start")
        dkv = torch.zeros_like(kv, dtype=acc_dtype)
        for pair in _pairs(ring, src):
            qs, ks = pair.qs, pair.ks
            pair_k, pair_v, pair_kk = _tables(pair, rel_k, rel_v, ring.max_relative_position)
            gq, gk, gv, grk, grv = _chunk_backward(
                ring.backend, _rows(grad_out, qs), _rows(q, qs), _rows(kv[..., :d], ks), _rows(kv[..., d:], ks),
                pair_k, pair_v, _mask_for(mask, qs, ks), _rows(out, qs), _rows(lse, qs), pair_kk,
                pair.is_causal, ring.scale, pair.query_offset)
            _rows(dq, qs).add_(gq)
            _rows(dkv[..., :d], ks).add_(gk)
            _rows(dkv[..., d:], ks).add_(gv)
            rows = slice(None) if pair.rows is None else pair.rows
            if d_rel_k is not None:
                d_rel_k[:, rows].add_(grk)
            if d_rel_v is not None:
                d_rel_v[:, rows].add_(grv)
        _mark("backward", step, "compute_end")
        _wait(works)
        _wait(pending)
        _mark("backward", step, "wait_end")
        if step > 0:
            dkv.add_(arriving)  # a chunk's contributions summed in ring order: deterministic
        if ring.world > 1:
            pending, sent = ring.exchange([(dkv, _TAG_GRAD)], []), dkv
            if step < ring.world - 1:
                kv, spare = spare, kv
    if ring.world > 1:
        _wait(ring.exchange([], [(arriving, _TAG_GRAD)]))  # the accumulator of this rank's own chunk, complete
        _wait(pending)
        del sent
        dkv = arriving
    grads = (dq, dkv[..., :d], dkv[..., d:], d_rel_k, d_rel_v)
    return tuple(None if g is None else g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v, rel_k, rel_v),
                                                                                    strict=True))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rel_k, rel_v, mask, ring):
        out, lse = _ring_forward(ring, q, k, v, rel_k, rel_v, mask)
        ctx.save_for_backward(q, k, v, rel_k, rel_v, mask, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, rel_k, rel_v, mask, out, lse = ctx.saved_tensors
        return (*_ring_backward(ctx.ring, grad_out, q, k, v, rel_k, rel_v, mask, out, lse), None, None)


# ------------------------------------------------------------------------------------------------------ the op


def _ring_backend(name: object, call) -> str:
    if name == "auto":
        for candidate in RING_BACKENDS:
            if candidate != "triton" or call.q.device.type == "cuda":  # the interpreter serves CPU tensors slowly
                if not not_supported_reasons(BACKENDS[candidate], call):
                    return candidate
        raise ValueError("no backend with a log-sum-exp serves these inputs: "
                         + "; ".join(f"{b}: {', '.join(not_supported_reasons(BACKENDS[b], call))}"
                                     for b in RING_BACKENDS))
    if name not in RING_BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {RING_BACKENDS} (the backends that return the "
                         f"log-sum-exp the ring merges by); got {name!r}")
    if reasons := not_supported_reasons(BACKENDS[name], call):
        raise ValueError(f"backend {name!r} cannot serve these inputs: {'; '.join(reasons)}")
    return name


def _check_ring_mask(attn_mask, *, target, like) -> Tensor | None:
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added); got {attn_mask.dtype}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask must not require grad under context parallelism")
    if attn_mask.device != like.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {like.device}")
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False)):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (B, H, n, N) = {tuple(target)}: the "
                         f"local queries' rows, every key's column")
    return additive_mask(attn_mask.reshape((1,) * (4 - len(shape)) + shape), like.dtype)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None = None,
    rel_v: Tensor | None = None,
    *,
    max_relative_position: int | tuple[int, int],
    beyond: str = "clip",
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    group=None,
    layout: str = "contiguous",
    backend: str = "auto",
) -> Tensor:
    """Shaw self-attention over a sequence split across the ranks of ``group`` (default: the world).

    Every rank of the group calls it with its own part of the sequence, at the same shapes.

    Args:
        q: (B, H, n, D) the local positions' queries (which positions: ``layout``).
        k: (B, H, n, D) their keys.
        v: (B, H, n, Dv) their values.
        rel_k, rel_v: the tables as for :func:`relattn.relative_attention` ((R, D|Dv) shared or (H, R, D|Dv)
            per head, or None), the same on every rank.
        max_relative_position, beyond, is_causal, scale: as for :func:`relattn.relative_attention`.
        attn_mask: bool (True = may attend) or float, broadcastable to (B, H, n, N): the local queries' rows,
            every key's column in global position order; needs no gradient.
        group: the process group the sequence is split over.
        layout: ``"contiguous"`` (rank ``r`` holds ``[r n, (r + 1) n)``) or ``"zigzag"`` (rank ``r`` holds the
            half-chunks ``r`` and ``2P - 1 - r``; balanced for causal attention; ``n`` even).
        backend: ``"auto"`` or one of :data:`RING_BACKENDS`, for the chunk computations.

    Returns:
        (B, H, n, Dv): the local positions' rows of ``relative_attention`` on the whole sequence (``N = P n``).
        Differentiable once: q, k, v get their local gradients; each table gets this rank's share of its
        gradient (the sum over the group is the whole gradient).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    call = validate(q, k, v, rel_k, rel_v, max_relative_position=max_relative_position, attn_mask=None,
                    is_causal=is_causal, dropout_p=0.0, scale=scale, query_offset=0, beyond=beyond)
    b, h, n, _ = call.q.shape
    if call.k.shape[1] != h or call.k.shape[2] != n:
        raise ValueError(f"k and v must be (B, H, n, D|Dv) with q's heads and positions (H = {h}, n = {n}); got k "
                         f"{tuple(call.k.shape)}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mask = _check_ring_mask(attn_mask, target=(b, h, n, world * n), like=call.q)
    segs = tuple(segments(n, r, world, layout) for r in range(world))
    chunk_backend = _ring_backend(backend, call)
    def peer(r: int) -> int:  # P2P operations name global ranks
        return r % world if group is None else dist.get_global_rank(group, r % world)

    ring = _Ring(group, rank, world, peer(rank + 1), peer(rank - 1), segs, call.max_relative_position,
                 call.is_causal, call.scale, chunk_backend)
    return _RingAttention.apply(call.q, call.k, call.v, call.rel_k, call.rel_v, mask, ring)


def all_gather_attention(q, k, v, rel_k=None, rel_v=None, *, max_relative_position, beyond="clip", attn_mask=None,
                         is_causal=False, scale=None, group=None, layout="contiguous", backend="auto") -> Tensor:
    """The baseline the ring is measured against: all-gather every rank's k and v, then one
    :func:`relattn.relative_attention` call per local query segment (``query_offset`` placing it). Forward only
    (no gradient reaches other ranks' k and v); same arguments as :func:`context_parallel_attention`."""
    from .functional import relative_attention

    world, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
    full_k, full_v = gather(k, dim=2, layout=layout, group=group), gather(v, dim=2, layout=layout, group=group)
    outs = []
    for start, length, local in segments(n, rank, world, layout):
        mask = attn_mask if attn_mask is None or attn_mask.dim() < 2 or attn_mask.shape[-2] == 1 else \
            attn_mask[..., local:local + length, :]
        outs.append(relative_attention(q.narrow(2, local, length), full_k, full_v, rel_k, rel_v,
                                       max_relative_position=max_relative_position, beyond=beyond, attn_mask=mask,
                                       is_causal=is_causal, scale=scale, query_offset=start, backend=backend))
    return torch.cat(outs, 2)


# ------------------------------------------------------------------------------------------------------ modules


@dataclass(frozen=True)
class ContextParallel:
    """How a model splits its sequences: over ``group`` (None: the world) in ``layout``, the ring's chunks computed
    by ``backend``. What :func:`self_attention` and a model's ``context_parallel=`` argument take."""

    group: object = None
    layout: str = "contiguous"
    backend: str = "auto"

    def __post_init__(self) -> None:
        _check_layout(self.layout)

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


def self_attention(module, x: Tensor, *, is_causal: bool = False, context_parallel: ContextParallel) -> Tensor:
    """The self-attention of a :class:`relattn.RelativeMultiheadAttention` (batch first) over a sequence split as
    ``context_parallel`` says: ``x`` (B, n, E) is this rank's part, the result (B, n, E) its part of the module's
    output on the whole sequence. The module's parameters are used as they are (plain, DDP or FSDP)."""
    if not module.batch_first:
        raise ValueError("self_attention takes a batch_first module: x is (B, n, E)")
    if module.training and module.dropout > 0.0:
        raise ValueError(f"attention dropout ({module.dropout}) is not served under context parallelism; use "
                         f"dropout=0 or eval mode")
    if x.dim() != 3 or x.shape[-1] != module.embed_dim:
        raise ValueError(f"x must be (B, n, {module.embed_dim}); got {tuple(x.shape)}")

    def heads(t: Tensor) -> Tensor:
        return t.unflatten(-1, (module.num_heads, module.head_dim)).transpose(1, 2)

    q, k, v = heads(module.q_proj(x)), heads(module.k_proj(x)), heads(module.v_proj(x))
    rel_k = None if module.rel_k is None else module.rel_k.to(q.dtype)
    rel_v = None if module.rel_v is None else module.rel_v.to(q.dtype)
    cp = context_parallel
    out = context_parallel_attention(q, k, v, rel_k, rel_v, max_relative_position=module.max_relative_position,
                                     beyond=module.beyond, is_causal=is_causal, group=cp.group, layout=cp.layout,
                                     backend=cp.backend)
    return module.out_proj(out.transpose(1, 2).flatten(2))


__all__ = ["LAYOUTS", "RING_BACKENDS", "ContextParallel", "all_gather_attention", "context_parallel_attention",
           "gather", "positions", "record_timeline", "segments", "self_attention", "shard"]
