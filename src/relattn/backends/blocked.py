"""The "blocked" backend: the flash algorithm in plain torch, any device, any mask, dropout; O(N (D + K)) memory.

Notation: ``B`` batch, ``H`` heads, ``N`` queries, ``M`` keys, ``D``/``Dv`` head dims, ``K`` max relative
position, ``p_i = i + query_offset``. This is the readable statement of the algorithm a GPU kernel mirrors:

forward, for each block of ``Bk`` keys (all queries at once; memory O(N (D + K + Bk))):
    idx   = clip(j - p_i, -K, K) + K                      (positions.clip_and_shift, per tile)
    s     = (q k_blk^T + gather(q a^K^T, idx) + gather(k_blk a^Q^T, idx^T)^T) * scale + b[idx] + mask_blk,
            -inf where causal forbids                      (k_blk a^Q^T: (Bk, 2K+1), the block's keys x the window)
    m'    = max(m, rowmax s);  c = exp(m - m');  e = exp(s - m')
    l     = c l + rowsum e                                 (normaliser: before dropout)
    e~    = e * keep / (1 - p)                             (dropout: same weights for both sums)
    acc   = c acc + e~ v_blk;   acc_r = c acc_r + bucket(e~, idx)     (acc_r: (N, 2K+1))
out = (acc + acc_r a^V) / l, lse = m + log l. Rows with nothing to attend to give zeros, lse -inf.
With position queries ``q_pos`` (Transformer-XL's position bias) the key table is read by them: ``q_pos a^K^T``
in place of ``q a^K^T``, and its gradient goes to ``q_pos`` instead of ``q``.

backward, per key block, recomputing ``p = exp(s - lse)`` and the same dropout mask:
    dv_blk = (p z)^T dO;  bucket(p z, idx) -> d a^V;  dp = (dO v_blk^T + gather(dO a^V^T, idx)) z
    ds = p (dp - rowsum(dO * out)) * scale;  dq += ds k_blk;  dk_blk = ds^T q;  bucket(ds, idx) -> d(q a^K^T)
    (after the loop: d(q a^K^T) a^K -> dq, or d q_pos with position queries; d(q a^K^T)^T q -> d a^K)
    key_bins = bucket(ds^T, idx^T) (Bk, 2K+1), per key row;  dk_blk += key_bins a^Q;  d a^Q += key_bins^T k_blk
    bucket(ds / scale, idx) -> d b (the scalar bias, T5's: unscaled, so its gradient is the unscaled dS's row sums)

The dropout mask is every backend's (``_common.dropout_keep``): a counter-based hash of (seed, b, h, i, j) in
integer torch ops, so the backward regenerates exactly the forward's mask whatever the tiling; ``seed`` is drawn
from torch's generator for the device (``_common.dropout_seed``), so ``torch.manual_seed`` makes it reproducible.
Softmax statistics are float32 for 16-bit inputs. Every reduction has a fixed order (no atomics): the backward is
deterministic on CPU.
"""

from __future__ import annotations

import torch

from ..positions import clip_and_shift, unmet_rows_zeroed
from ._common import (
    Backend,
    Serves,
    StatsOps,
    keep_scale,
    no_autocast,
    stats_dtype,
)

DEFAULT_BLOCK = 128
def _sum_table_grad(g: torch.Tensor, hr: int) -> torch.Tensor:
    """(B, H, ...) -> (Hr, ...): sum over batch, and over heads when the table is shared (Hr = 1)."""
    g = g.sum(0)
    return g.sum(0, keepdim=True) if hr == 1 else g


class _Tile:
    """Everything about one key block that forward and backward both recompute."""

    def __init__(self, q, k, rel_scores, mask, seed, *, j0, j1, n, m, kk, is_causal, dropout_p, scale,
                 query_offset, rel_q=None, rel_bias=None):
        b, h = q.shape[:2]
        dev = q.device
        rows = torch.arange(n, device=dev)
        cols = torch.arange(j0, j1, device=dev)
        self.idx = clip_and_shift(cols[None, :] - (rows[:, None] + query_offset), kk)  # (N, Bk)
        s = q @ k[:, :, j0:j1].transpose(-1, -2)  # a fresh (B, H, N, Bk) tile: the terms are added in place
        if rel_scores is not None:
            s += torch.gather(rel_scores, -1, self.idx.expand(b, h, n, j1 - j0))
        if rel_q is not None:
            by_key = k[:, :, j0:j1] @ rel_q.transpose(-1, -2)  # (B, H, Bk, 2K+1): this block's keys x the window
            s += torch.gather(by_key.flatten(-2), -1, self.key_rows(kk).expand(b, h, -1)).view(b, h, n, j1 - j0)
        s *= scale
        if rel_bias is not None:  # (Hr, N, Bk) against (B, H, N, Bk)
            s += rel_bias[:, self.idx]
        if mask is not None:
            s += mask[..., j0:j1] if mask.shape[-1] == m else mask
        if is_causal:
            s.masked_fill_(cols[None, :] > rows[:, None] + query_offset, float("-inf"))
        self.s = s
        self.keep = None
        if dropout_p > 0.0:
            self.keep = keep_scale(seed, b, h, rows, cols, dropout_p, s.dtype)

    def bucket_into(self, acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``acc`` (B, H, N, 2K+1) plus, in place, the sums of ``x`` (B, H, N, Bk) over the keys sharing a table row
        (no (N, 2K+1) temporary per block)."""
        return acc.scatter_add_(-1, self.idx.expand_as(x), x)

    def key_rows(self, kk: int) -> torch.Tensor:
        """(N * Bk,) positions in a flattened (Bk, 2K+1) per-key table of each (query, key) pair of the tile: key
        ``j``'s row ``idx_ij``, laid out like the (N, Bk) tile (no transposed gather)."""
        width = self.idx.shape[1]
        return (torch.arange(width, device=self.idx.device) * (2 * kk + 1) + self.idx).flatten()

    def key_bins(self, x: torch.Tensor, kk: int) -> torch.Tensor:
        """(B, H, N, Bk) -> (B, H, Bk, 2K+1): per key, sums of ``x`` over the queries sharing a table row."""
        b, h, _, width = x.shape
        bins = x.new_zeros(b, h, width * (2 * kk + 1))
        return bins.scatter_add_(-1, self.key_rows(kk).expand(b, h, -1), x.reshape(b, h, -1)).view(b, h, width, -1)


def _met_rows(q, k, kk, query_offset, is_causal, *tables):
    """The tables (the last, rel_bias, a table of one column) with zeros in the rows no allowed pair meets."""
    *tables, bias = tables
    tables = [unmet_rows_zeroed(t, q.shape[2], k.shape[2], kk, query_offset=query_offset, is_causal=is_causal)
              for t in tables]
    if bias is not None:
        bias = unmet_rows_zeroed(bias[..., None], q.shape[2], k.shape[2], kk, query_offset=query_offset,
                                 is_causal=is_causal)[..., 0]
    return (*tables, bias)


def _prepare(*tensors):
    sdt = stats_dtype(tensors[0].dtype)
    return [t.to(sdt) if t is not None else None for t in tensors]


def blocked_forward(q, k, v, rel_k, rel_v, mask, seed, *, max_relative_position: int, is_causal: bool,
                    dropout_p: float, scale: float, query_offset: int, block: int = DEFAULT_BLOCK, rel_q=None,
                    q_pos=None, rel_bias=None):
    """Returns ``out`` (B, H, N, Dv) and ``lse`` (B, H, N) (float32 for 16-bit inputs). ``q_pos`` (B, H, N, D):
    the queries of the key table, when not ``q``; ``rel_bias`` (Hr, 2K+1): the scalar bias."""
    kk = max_relative_position
    dtype = q.dtype
    q, k, v, rel_k, rel_v, mask, rel_q, q_pos, rel_bias = _prepare(q, k, v, rel_k, rel_v, mask, rel_q, q_pos,
                                                                   rel_bias)
    rel_k, rel_v, rel_q, rel_bias = _met_rows(q, k, kk, query_offset, is_causal, rel_k, rel_v, rel_q, rel_bias)
    b, h, n, _ = q.shape
    m, dv = k.shape[2], v.shape[3]
    reader = q if q_pos is None else q_pos
    rel_scores = reader @ rel_k.transpose(-1, -2) if rel_k is not None else None  # (B, H, N, 2K+1)
    run_max = q.new_full((b, h, n), float("-inf"))
    total = q.new_zeros(b, h, n)
    acc = q.new_zeros(b, h, n, dv)
    acc_rel = q.new_zeros(b, h, n, 2 * kk + 1) if rel_v is not None else None
    for j0 in range(0, m, block):
        j1 = min(m, j0 + block)
        tile = _Tile(q, k, rel_scores, mask, seed, j0=j0, j1=j1, n=n, m=m, kk=kk, is_causal=is_causal,
                     dropout_p=dropout_p, scale=scale, query_offset=query_offset, rel_q=rel_q,
                     rel_bias=rel_bias)
        new_max = torch.maximum(run_max, tile.s.amax(-1))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(run_max - safe)
        e = tile.s.sub_(safe[..., None]).exp_()
        total = total * correction + e.sum(-1)
        if tile.keep is not None:
            e = e * tile.keep
        acc = acc * correction[..., None] + e @ v[:, :, j0:j1]
        if acc_rel is not None:
            acc_rel = tile.bucket_into(acc_rel.mul_(correction[..., None]), e)
        run_max = new_max
    if acc_rel is not None:
        acc = acc + acc_rel @ rel_v
    nonempty = total != 0  # a NaN total (a NaN score in the row) is not an empty row: the row stays NaN
    out = acc / torch.where(nonempty, total, torch.ones_like(total))[..., None]
    safe = torch.where(torch.isfinite(run_max), run_max, torch.zeros_like(run_max))
    lse = torch.where(nonempty, safe + torch.log(torch.where(nonempty, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out.to(dtype), lse


def _table_grads(dq, d_rel_scores, reader, rel_k, rel_v, q_pos, p_buckets, grad_out):
    """``(d_rel_k, d_rel_v, d_q_pos)`` from the gradients gathered per table row (the scores' ``d_rel_scores``, the
    weights' ``p_buckets``); the key table's share of the queries' gradient goes into ``dq`` (in place) when the
    table reads the queries themselves, else into ``d_q_pos``."""
    d_rel_k = d_rel_v = d_q_pos = None
    if rel_k is not None:
        d_reader = d_rel_scores @ rel_k
        if q_pos is None:
            dq += d_reader
        else:
            d_q_pos = d_reader
        d_rel_k = _sum_table_grad(d_rel_scores.transpose(-1, -2) @ reader, rel_k.shape[0])
    elif q_pos is not None:
        d_q_pos = torch.zeros_like(q_pos)
    if rel_v is not None:
        d_rel_v = _sum_table_grad(p_buckets.transpose(-1, -2) @ grad_out, rel_v.shape[0])
    return d_rel_k, d_rel_v, d_q_pos


def blocked_backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, *, max_relative_position: int,
                     is_causal: bool, dropout_p: float, scale: float, query_offset: int,
                     block: int = DEFAULT_BLOCK, rel_q=None, q_pos=None, rel_bias=None):
    """Gradients (dq, dk, dv, d_rel_k | None, d_rel_v | None), recomputed block by block, then those of the optional
    tables up to the last one given: d_rel_q, d_q_pos, d_rel_bias (None for one not given)."""
    kk = max_relative_position
    dtype = q.dtype
    q, k, v, rel_k, rel_v, mask, rel_q, q_pos, rel_bias = _prepare(q, k, v, rel_k, rel_v, mask, rel_q, q_pos,
                                                                   rel_bias)
    rel_k, rel_v, rel_q, rel_bias = _met_rows(q, k, kk, query_offset, is_causal, rel_k, rel_v, rel_q, rel_bias)
    grad_out, out = grad_out.to(q.dtype), out.to(q.dtype)
    b, h, n, _ = q.shape
    m = k.shape[2]
    lse = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)  # empty rows: p = 0; NaN stays
    rowdot = (grad_out * out).sum(-1, keepdim=True)
    reader = q if q_pos is None else q_pos
    rel_scores = reader @ rel_k.transpose(-1, -2) if rel_k is not None else None
    grad_rel_out = grad_out @ rel_v.transpose(-1, -2) if rel_v is not None else None  # (B, H, N, 2K+1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_rel_scores = torch.zeros_like(rel_scores) if rel_k is not None else None
    p_buckets = q.new_zeros(b, h, n, 2 * kk + 1) if rel_v is not None else None
    d_rel_q = q.new_zeros(b, h, 2 * kk + 1, q.shape[3]) if rel_q is not None else None
    d_bias = q.new_zeros(b, h, n, 2 * kk + 1) if rel_bias is not None else None
    for j0 in range(0, m, block):
        j1 = min(m, j0 + block)
        tile = _Tile(q, k, rel_scores, mask, seed, j0=j0, j1=j1, n=n, m=m, kk=kk, is_causal=is_causal,
                     dropout_p=dropout_p, scale=scale, query_offset=query_offset, rel_q=rel_q,
                     rel_bias=rel_bias)
        p = tile.s.sub_(lse[..., None]).exp_()
        pz = p if tile.keep is None else p * tile.keep
        dv[:, :, j0:j1] = pz.transpose(-1, -2) @ grad_out
        dp = grad_out @ v[:, :, j0:j1].transpose(-1, -2)
        if grad_rel_out is not None:
            tile.bucket_into(p_buckets, pz)
            dp = dp + torch.gather(grad_rel_out, -1, tile.idx.expand_as(dp))
        if tile.keep is not None:
            dp *= tile.keep
        ds = dp.sub_(rowdot).mul_(p)
        if d_bias is not None:  # the bias is added after the scale: its gradient is the unscaled dS's
            tile.bucket_into(d_bias, ds)
        ds = ds.mul_(scale)
        dq += ds @ k[:, :, j0:j1]
        dk[:, :, j0:j1] = ds.transpose(-1, -2) @ q
        if d_rel_scores is not None:
            tile.bucket_into(d_rel_scores, ds)
        if d_rel_q is not None:
            bins = tile.key_bins(ds, kk)  # (B, H, Bk, 2K+1): this block's key rows only, no other block writes them
            dk[:, :, j0:j1] += bins @ rel_q
            d_rel_q += bins.transpose(-1, -2) @ k[:, :, j0:j1]
    d_rel_k, d_rel_v, d_q_pos = _table_grads(dq, d_rel_scores, reader, rel_k, rel_v, q_pos, p_buckets, grad_out)
    grads = [dq, dk, dv, d_rel_k, d_rel_v, None if rel_q is None else _sum_table_grad(d_rel_q, rel_q.shape[0]),
             d_q_pos, None if rel_bias is None else _sum_table_grad(d_bias.sum(2), rel_bias.shape[0])]
    while len(grads) > 5 and grads[-1] is None:  # the optional tables' gradients up to the last one given
        grads.pop()
    return tuple(t.to(dtype) if t is not None else None for t in grads)


# relattn::blocked_fwd_{version}(q, k, v, rel_k?, rel_v?, mask?, seed, K, is_causal, dropout_p, scale, query_offset,
#   rel_q?, q_pos?) -> (out, lse) and relattn::blocked_bwd_{version}, the eager path and the ring's pair calls: see
#   _common.StatsOps.
OPS = StatsOps("blocked", no_autocast(blocked_forward), no_autocast(blocked_backward), dropout=True)


BACKEND = Backend("blocked", OPS.run,
                  Serves(dropout=True, pos_to_content=True, position_query=True, rel_bias=True, chunk_pairs=True),
                  "flash algorithm in plain torch: online softmax over key blocks, O(N(D+K)) memory, any mask, dropout",
                  stats=OPS)
