"""The ring: one rank's queries against every rank's keys and values, passed around the group chunk by chunk.

Notation: ``P`` ranks, ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``n`` positions per rank, ``D``/``Dv``
head dims, ``K`` max relative position (after :func:`relattn.functional.validate` brought the window to the
kernels' symmetric form).

At step ``s`` rank ``r`` computes its queries against the chunk of rank ``r - s`` while sending that chunk on to
``r + 1`` and receiving the next from ``r - 1`` (``batch_isend_irecv``), and the partial outputs are merged by their
log-sum-exp in step order (deterministic). A chunk's keys lie at known positions, so each (query segment, key
segment) pair is one call of the backend's pair ops (:meth:`relattn.backends.StatsOps.pair_forward`) with
``query_offset`` placing the queries: keys farther than ``K`` from every query meet only the edge rows ``a[0]`` /
``a[2K]``, which every rank holds, so no table rows travel, only k and v (with their ``Hkv`` heads); the scalar
bias ``rel_bias`` (T5's) is one more table, of one column: whole, or its edge row, per pair. Under
``is_causal`` a pair wholly in the future is skipped. The backward runs the ring again with the k/v chunk, and the
chunk's dK/dV accumulator follows it home; each pair's gradients come from the backend's backward called with the
merged output and log-sum-exp, which makes them the exact contributions of that pair. With dropout every pair
draws the whole call's mask at its global query rows and keys (its seed's offsets are the segments' global starts;
the seed is the same on every rank), so the ring drops what the single-process op drops.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import StatsAutograd, StatsOps, stats_dtype

_TAG_KV, _TAG_GRAD = 7301, 7302  # gloo matches messages by tag; NCCL by order (both kept the same on both sides)

# ------------------------------------------------------------------------------------------------------ timeline

_timeline: list | None = None


@contextlib.contextmanager
def record_timeline():
    """Within the block, the ring appends ``(pass, step, event, time.perf_counter())`` to the yielded list for
    each event: ``"issue"`` (the step's sends and receives posted), ``"compute_start"``, ``"in_flight"`` (at the
    compute's start the step's transfers are posted and not yet waited for; absent for a step without transfers),
    ``"compute_end"`` and ``"wait_end"`` (the step's transfers waited for). How the overlap of communication and
    compute is checked."""
    global _timeline
    previous, _timeline = _timeline, []
    try:
        yield _timeline
    finally:
        _timeline = previous


def _mark(phase: str, step: int, event: str) -> None:
    if _timeline is not None:
        _timeline.append((phase, step, event, time.perf_counter()))


def _start_compute(phase: str, step: int, works: Transfers) -> None:
    _mark(phase, step, "compute_start")
    if works and not works.waited:
        _mark(phase, step, "in_flight")


class Transfers(list):
    """A step's posted sends and receives (``batch_isend_irecv``'s works), and whether they were waited for."""

    waited = False

    def wait(self) -> None:
        for w in self:
            w.wait()
        self.waited = True


# ------------------------------------------------------------------------------------------------------ pairs


def _merge(out: Tensor | None, lse: Tensor | None, o: Tensor, lo: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint keys as one: weights ``exp(lse_part - lse_both)``."""
    if out is None:
        return o, lo
    both = torch.logaddexp(lse, lo)
    ref = torch.where(torch.isneginf(both), torch.zeros_like(both), both)  # no key in either: stays zeros
    return out * torch.exp(lse - ref)[..., None] + o * torch.exp(lo - ref)[..., None], both


@dataclass(frozen=True)
class Pair:
    """One backend call: a segment of this rank's queries against a segment of the chunk held."""

    qs: tuple  # (global start, length, local start)
    ks: tuple
    is_causal: bool
    query_offset: int
    rows: slice | None  # None: the whole table; else the one edge row of a pair wholly beyond the window


@dataclass(frozen=True)
class Ring:
    """One call's ring: the group and neighbours, every rank's segments, the pair ops and the call's scalars."""

    group: object
    rank: int
    world: int
    send_to: int  # global ranks of the neighbours
    recv_from: int
    segments: tuple  # per rank of the group: its (global start, length, local start) segments
    ops: StatsOps
    groups: int  # query heads per key/value head that the pair ops need k and v repeated for (1: read in place)
    max_relative_position: int
    is_causal: bool
    scale: float
    query_offset: int
    dropout_p: float = 0.0
    seed: Tensor | None = None  # the call's dropout seed (_common.dropout_seed), the same on every rank

    def exchange(self, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]):
        """Post the sends (to the next rank) and receives (from the previous), receives first; returns the works."""
        ops = [dist.P2POp(dist.irecv, t, self.recv_from, self.group, tag) for t, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, self.send_to, self.group, tag) for t, tag in sends]
        return Transfers(dist.batch_isend_irecv(ops) if ops else [])

    def pairs(self, src: int):
        """The pairs this rank computes against the chunk of ``src``. Under causality pairs wholly in the future are
        left out and wholly past ones need no causal test. A pair whose offsets ``j - i - query_offset`` all lie below
        ``-K`` (or all above ``K``) meets one table row only, ``a[0]`` (or ``a[2K]``), and runs with that row as a
        table of ``K = 0``: every key of the pair takes it, and the call costs no ``2K + 1`` dot products per
        query."""
        kk, qo = self.max_relative_position, self.query_offset
        for qs in self.segments[self.rank]:
            for ks in self.segments[src]:
                q0, q1, k0, k1 = qs[0], qs[0] + qs[1], ks[0], ks[0] + ks[1]
                if self.is_causal and k0 > q1 - 1 + qo:
                    continue
                lowest, highest = k0 - (q1 - 1) - qo, k1 - 1 - q0 - qo
                rows = slice(0, 1) if highest < -kk else slice(2 * kk, 2 * kk + 1) if lowest > kk else None
                yield Pair(qs, ks, self.is_causal and k1 - 1 > q0 + qo, q0 + qo - k0, rows)

    def scalars(self, pair: Pair) -> dict:
        """The pair call's scalars, and with dropout its seed: the mask of the whole call at the pair's global query
        rows and keys (offsets ``i0``, ``j0``: the segments' global starts)."""
        kw = dict(max_relative_position=self.max_relative_position if pair.rows is None else 0,
                  is_causal=pair.is_causal, scale=self.scale, query_offset=pair.query_offset)
        if self.dropout_p > 0.0:
            kw.update(dropout_p=self.dropout_p, seed=self.seed + self.seed.new_tensor([0, 0, pair.qs[0], pair.ks[0]]))
        return kw


def _table_rows(pair: Pair, table: Tensor | None) -> Tensor | None:
    return None if table is None or pair.rows is None else table[:, pair.rows]


def _mask_for(mask: Tensor | None, qs, ks) -> Tensor | None:
    if mask is None:
        return None
    rows = slice(qs[2], qs[2] + qs[1]) if mask.shape[2] > 1 else slice(None)
    cols = slice(ks[0], ks[0] + ks[1]) if mask.shape[3] > 1 else slice(None)
    return mask[:, :, rows, cols]


def _rows(t: Tensor, seg) -> Tensor:
    return t.narrow(2, seg[2], seg[1])


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """k or v with its key/value heads repeated for the pair ops (each query head's own copy)."""
    return t if groups == 1 else t.repeat_interleave(groups, 1)


def _head_sums(g: Tensor, groups: int) -> Tensor:
    """A repeated k's or v's gradient summed back onto its key/value heads."""
    return g if groups == 1 else g.unflatten(1, (g.shape[1] // groups, groups)).sum(2)


# ------------------------------------------------------------------------------------------------------ the ring


def _pair_tables(pair: Pair, rel_k, rel_v, rel_q, q_pos, rel_bias):
    """The tables a pair's call takes (the whole tables, or their edge row), the rows of ``q_pos`` its queries
    are, and the bias (whole, or its edge row)."""
    tables = (rel_k, rel_v, rel_q, rel_bias)
    if pair.rows is not None:
        tables = tuple(_table_rows(pair, t) for t in tables)
    return (*tables[:3], None if q_pos is None else _rows(q_pos, pair.qs), tables[3])


def ring_forward(q, k, v, rel_k, rel_v, mask, ring: Ring, rel_q, q_pos, rel_bias=None):
    """(out (B,H,n,Dv) in q's dtype, lse (B,H,n)) of the local queries against the whole sequence."""
    d = k.shape[-1]
    stats = stats_dtype(q.dtype)
    kv = torch.cat([k, v], -1).contiguous()
    spare = torch.empty_like(kv) if ring.world > 1 else None
    acc = {qs: (None, None) for qs in ring.segments[ring.rank]}
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        works = ring.exchange([(kv, _TAG_KV)], [(spare, _TAG_KV)]) if step < ring.world - 1 else Transfers()
        _mark("forward", step, "issue")
        _start_compute("forward", step, works)
        for pair in ring.pairs(src):
            qs, ks = pair.qs, pair.ks
            pair_kv = _rows(kv, ks)
            pk, pv, pq, pqp, pb = _pair_tables(pair, rel_k, rel_v, rel_q, q_pos, rel_bias)
            o, lo = ring.ops.pair_forward(_rows(q, qs), _repeat_kv(pair_kv[..., :d], ring.groups),
                                          _repeat_kv(pair_kv[..., d:], ring.groups), pk, pv, _mask_for(mask, qs, ks),
                                          (pq, pqp, pb), **ring.scalars(pair))
            acc[qs] = _merge(*acc[qs], o.to(stats), lo)
        _mark("forward", step, "compute_end")
        works.wait()
        _mark("forward", step, "wait_end")
        if works:
            kv, spare = spare, kv
    outs, lses = zip(*(acc[qs] for qs in ring.segments[ring.rank]), strict=True)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def ring_backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, ring: Ring, rel_q, q_pos, rel_bias=None):
    """(dq, dk, dv, d_rel_k share, d_rel_v share, d_rel_q share, d_q_pos, d_rel_bias share) of the local
    positions."""
    d = k.shape[-1]
    acc_dtype = stats_dtype(q.dtype)
    grad_out = grad_out.contiguous()
    kv = torch.cat([k, v], -1).contiguous()
    spare = torch.empty_like(kv) if ring.world > 1 else None
    dq = torch.zeros_like(q, dtype=acc_dtype)
    d_q_pos = None if q_pos is None else torch.zeros_like(q_pos, dtype=acc_dtype)
    d_tables = [None if t is None else torch.zeros_like(t, dtype=acc_dtype) for t in (rel_k, rel_v, rel_q, rel_bias)]
    arriving = torch.empty_like(kv, dtype=acc_dtype) if ring.world > 1 else None  # dK|dV of the chunk now held
    pending, sent = Transfers(), None  # the previous step's send of the gradient accumulator, and what it sends
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        recvs = ([(arriving, _TAG_GRAD)] if step > 0 else []) + ([(spare, _TAG_KV)] if step < ring.world - 1 else [])
        works = ring.exchange([(kv, _TAG_KV)] if step < ring.world - 1 else [], recvs)
        _mark("backward", step, "issue")
        _start_compute("backward", step, works)
        dkv = torch.zeros_like(kv, dtype=acc_dtype)
        for pair in ring.pairs(src):
            qs, ks = pair.qs, pair.ks
            pair_kv = _rows(kv, ks)
            pk, pv, pq, pqp, pb = _pair_tables(pair, rel_k, rel_v, rel_q, q_pos, rel_bias)
            gq, gk, gv, grk, grv, grq, gqp, grb = ring.ops.pair_backward(
                _rows(grad_out, qs), _rows(q, qs), _repeat_kv(pair_kv[..., :d], ring.groups),
                _repeat_kv(pair_kv[..., d:], ring.groups), pk, pv, _mask_for(mask, qs, ks), (pq, pqp, pb),
                _rows(out, qs), _rows(lse, qs), **ring.scalars(pair))
            g_tables = (grk, grv, grq, grb)
            _rows(dq, qs).add_(gq)
            if d_q_pos is not None:
                _rows(d_q_pos, qs).add_(gqp)
            _rows(dkv[..., :d], ks).add_(_head_sums(gk, ring.groups))
            _rows(dkv[..., d:], ks).add_(_head_sums(gv, ring.groups))
            rows = slice(None) if pair.rows is None else pair.rows
            for acc, g in zip(d_tables, g_tables, strict=True):
                if acc is not None:
                    acc[:, rows].add_(g)
        _mark("backward", step, "compute_end")
        works.wait()
        pending.wait()
        _mark("backward", step, "wait_end")
        if step > 0:
            dkv.add_(arriving)  # a chunk's contributions summed in ring order: deterministic
        if ring.world > 1:
            pending, sent = ring.exchange([(dkv, _TAG_GRAD)], []), dkv
            if step < ring.world - 1:
                kv, spare = spare, kv
    if ring.world > 1:
        ring.exchange([], [(arriving, _TAG_GRAD)]).wait()  # the accumulator of this rank's own chunk, complete
        pending.wait()
        del sent
        dkv = arriving
    grads = (dq, dkv[..., :d], dkv[..., d:], *d_tables[:3], d_q_pos, d_tables[3])
    return tuple(None if g is None else g.to(t.dtype).contiguous()
                 for g, t in zip(grads, (q, k, v, rel_k, rel_v, rel_q, q_pos, rel_bias), strict=True))


# The ring's autograd: the same wiring as every backend's custom op (relattn.backends.StatsAutograd), around the ring.
RingAttention = StatsAutograd(ring_backward, leading=6, scalars=1, trailing=3).function(ring_forward)
