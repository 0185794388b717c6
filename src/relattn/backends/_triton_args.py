"""What the "triton" backend's launches take (:mod:`relattn.backends.triton`): strides, masks, the dropout's
arguments, a packed batch's sequences, the compact windows of a call with wide tables, the tables' met rows, the
scalar bias folded into the key term's scores, and the reductions that turn the kernels' bins into table and bias
gradients. Plain torch; no kernel is launched here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..positions import met_rows, unmet_rows_zeroed
from ._common import stats_dtype

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Packed:
    """A packed batch's sequences (:class:`~relattn.backends._common.AttentionCall`): q (1, H, T, D), k, v (1, Hkv,
    T_k, D|Dv), sequence ``s`` the query rows ``cu_q[s]:cu_q[s + 1]`` and key rows ``cu_k[s]:cu_k[s + 1]``;
    ``max_q``, ``max_k`` the longest lengths."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int

    @property
    def count(self) -> int:
        return self.cu_q.shape[0] - 1


@dataclass(frozen=True)
class Window:
    """The query rows ``[i0, i1)`` of a call, run as a call of their own, and the rows of the tables their pairs
    meet, ``[row0, row0 + rows)``: the per-row table scores and bins hold those columns only (column ``t - row0``;
    the kernels' constexpr ``WINDOW``)."""

    i0: int
    i1: int
    row0: int
    rows: int


# The most rows of table scores and bins a chunk's per-row tables may hold, per query row of the call and head dim:
# the scores then take at most about 4 N D entries per head (four times q's), whatever K and N.
WINDOW_BUDGET = 4
WINDOW_ALIGN = 128  # chunks of whole tiles (the largest BLOCK_M)


def windows(n, m, kk: int, d: int, query_offset, is_causal: bool, fixed_rows: int = 0) -> list[Window] | None:
    """The query rows in chunks, each with the table rows its pairs meet (:func:`~relattn.positions.met_rows`),
    when the call's per-row tables, ``N x (2K + 1)`` per head, would pass ``WINDOW_BUDGET * N * D`` entries
    (Transformer-XL's ``K = N - 1`` does; Shaw's ``K <= 2 D`` never); None: the call whole. Chunks of C rows, C the
    largest multiple of 128 with ``C (C + M - 1) <= WINDOW_BUDGET * N * D`` (at least 128): O(N) memory for the
    tables however long the call. ``fixed_rows`` > 0: chunks of that many rows whatever K (the tests)."""
    if not all(type(x) is int for x in (n, m, query_offset)):  # symbolic sizes (torch.export): the call whole
        return None
    if fixed_rows:
        rows = fixed_rows
    elif 2 * kk + 1 <= WINDOW_BUDGET * d:
        return None
    else:
        budget = WINDOW_BUDGET * n * d
        rows = int((-(m - 1) + math.sqrt((m - 1) ** 2 + 4 * budget)) / 2)
        rows = max(WINDOW_ALIGN, rows // WINDOW_ALIGN * WINDOW_ALIGN)
    if rows >= n:
        return None
    chunks = []
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        met = met_rows(i1 - i0, m, kk, query_offset=query_offset + i0, is_causal=is_causal)
        first, last = met if met is not None else (0, 0)
        chunks.append(Window(i0, i1, first, last - first + 1))
    return chunks


@dataclass(frozen=True)
class Rows:
    """A chunk's share of a call's per-row arguments (:func:`rows_of`)."""

    q: Tensor
    q_pos: Tensor | None
    mask: Tensor | None
    seed: Tensor | None
    query_offset: int


def rows_of(w: Window, q, q_pos, mask, seed, query_offset: int, dropout_p: float) -> Rows:
    """The query rows of ``w`` as a call of their own: q's and q_pos's rows, the mask's (one row for every query
    stays as it is), the query offset moved to the chunk's first row, and the dropout's seed offsets too (the mask's
    rows ``i0 + i``: the chunk draws the whole call's mask)."""
    rows = slice(w.i0, w.i1)
    if mask is not None and mask.dim() >= 2 and mask.shape[-2] != 1:
        mask = mask[..., rows, :]
    if dropout_p > 0.0 and seed is not None:
        seed = seed.reshape(-1)
        seed = torch.nn.functional.pad(seed, (0, 4 - seed.numel())) + torch.tensor(
            [0, 0, w.i0, 0], dtype=seed.dtype, device=seed.device)
    return Rows(q[:, :, rows], None if q_pos is None else q_pos[:, :, rows], mask, seed, query_offset + w.i0)


def window_of(table: Tensor | None, w: Window | None) -> Tensor | None:
    """The rows of ``table`` (Hr, 2K+1, d) the window holds (all of them without one)."""
    return table if table is None or w is None else table[:, w.row0:w.row0 + w.rows]


def met_tables(tables, q, k, kk: int, is_causal: bool, query_offset: int, packed: Packed | None) -> tuple:
    """The tables with zeros in the rows no pair the call may attend meets (a sequence's queries at the end of its
    keys in a packed call): the kernels read a tile's whole window of rows, and a NaN there must reach nothing. The
    last of ``tables`` is rel_bias (Hr, 2K+1) or None, zeroed as a table of one column."""
    n, m = (q.shape[2], k.shape[2]) if packed is None else (packed.max_k, packed.max_q)
    *tables, bias = tables
    tables = (*tables, None if bias is None else bias[..., None])
    *met, bias = (unmet_rows_zeroed(t, n, m, kk, query_offset=query_offset, is_causal=is_causal) for t in tables)
    return (*met, None if bias is None else bias[..., 0])


def contiguous_rows(t: Tensor) -> Tensor:
    """``t`` as it is when its rows are contiguous and a row apart (a packed batch's (1, H, T, D) view), else
    contiguous (an ``expand()``ed row, stride 0: its gradient, laid out as it, would overlap)."""
    return t if t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1]) else t.contiguous()


def with_bias(qa: Tensor | None, x: Tensor, rel_bias: Tensor | None, scale: float,
              dtype: torch.dtype) -> Tensor | None:
    """The key term's scores ``qa`` (B, H, N, R) or None, plus ``rel_bias / scale`` (Hr, R: the same table rows,
    a window's when the call runs in windows) in ``dtype`` when given (the bias is unscaled: ``scale * QA`` then adds
    it once; the kernels, and SB, the per-row bins of dS the backward forms for a^K, serve it unchanged, and its
    gradient is SB summed over rows, :func:`bias_grad`); x: the queries the key table reads (its B, H, N). None
    without either."""
    if rel_bias is None:
        return qa
    if scale == 0.0:
        raise ValueError("triton: rel_bias is folded into the key term's scores as rel_bias / scale, so it needs "
                         "scale != 0; got scale = 0.0 (use backend='native', 'blocked' or 'dense')")
    bias = (rel_bias.to(dtype) / scale)[:, None, :]  # (Hr, 1, R) against (B, H, N, R)
    if qa is None:
        return bias.expand(x.shape[0], x.shape[1], x.shape[2], -1).contiguous()
    return qa.add_(bias)


def strides(prefix: str, t: Tensor | None, names: str) -> dict:
    """``{stride_<prefix><name>: t.stride(i)}`` (zeros for a missing tensor)."""
    return {f"stride_{prefix}{c}": (0 if t is None else t.stride(i)) for i, c in enumerate(names)}


def table_strides(prefix: str, t: Tensor | None) -> dict:
    """(head, row, dim) strides; head stride 0 for a shared (1, 2K+1, d) table."""
    s = strides(prefix, t, "hrd")
    if t is not None and t.shape[0] == 1:
        s[f"stride_{prefix}h"] = 0
    return s


def mask_kind(q, k, mask) -> int:
    """0: no mask; 1: one value per key, the same for every query (a key-padding mask); 2: one per pair."""
    if mask is None:
        return 0
    return 2 if q.shape[2] > 1 and mask.expand(*q.shape[:3], k.shape[2]).stride(2) != 0 else 1


def mask_args(q, k, mask) -> dict:
    b, h, n, _ = q.shape
    full = None if mask is None else mask.expand(b, h, n, k.shape[2])
    return dict(MASK=q if full is None else full, **strides("m", full, "bhnm"))


def dropout_args(q, seed: Tensor | None, dropout_p: float) -> dict:
    """The dropout's kernel arguments: the seed tensor, int64 ``(seed, b0, i0, j0)`` (a bare seed, 0-dim or of one
    entry, has zero offsets; read by the kernel, no host sync), the keep threshold ``floor(p 2**32)`` and the kept
    weights' scale ``1 / (1 - p)``."""
    if dropout_p == 0.0:
        return dict(SEED=q, drop_threshold=0, drop_scale=1.0)
    if seed is None or seed.dtype != torch.int64 or seed.numel() not in (1, 4):
        raise ValueError(f"triton: dropout_p = {dropout_p} needs the seed as an int64 tensor (seed) or (seed, b0, "
                         f"i0, j0), got {None if seed is None else (seed.dtype, tuple(seed.shape))}")
    seed = seed.reshape(-1)
    if seed.numel() == 1:
        seed = torch.nn.functional.pad(seed, (0, 3))
    return dict(SEED=seed, drop_threshold=math.floor(dropout_p * 2**32), drop_scale=1.0 / (1.0 - dropout_p))


def common_args(q, k, v, max_relative_position, query_offset, scale, packed: Packed | None,
                seed: Tensor | None = None, dropout_p: float = 0.0, window: Window | None = None) -> dict:
    """What every attention kernel takes: strides, sizes (a packed batch's: the longest lengths, and its cumulative
    lengths), the query offset, the per-row tables' rows (``window``'s, else all 2K+1), the scale in log2 units and
    the dropout's arguments."""
    b, h, n, d = q.shape
    n, m = (n, k.shape[2]) if packed is None else (packed.max_q, packed.max_k)
    row0, rows = (0, 2 * max_relative_position + 1) if window is None else (window.row0, window.rows)
    return dict(**strides("q", q, "bhnd"), **strides("k", k, "bhnd"), **strides("v", v, "bhnd"),
                GROUP=h // k.shape[1], N=n, M=m, D=d, DV=v.shape[3], MAX_REL=max_relative_position,
                off=query_offset, ROW0=row0, ROWS=rows, qk_scale=scale * LOG2E,
                CU_Q=q if packed is None else packed.cu_q, CU_K=q if packed is None else packed.cu_k,
                **dropout_args(q, seed, dropout_p))


def table_grad(bins: Tensor, x: Tensor, hr: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """scale * sum over batch (and heads when shared) of bins^T @ x: (B,H,N,R), (B,H,N,d) -> (Hr, R, d)."""
    b, h, n, r = bins.shape
    lhs = bins.permute(1, 3, 0, 2).reshape(h, r, b * n)
    rhs = x.to(bins.dtype).permute(1, 0, 2, 3).reshape(h, b * n, x.shape[-1])
    g = torch.bmm(lhs, rhs) * scale
    return (g.sum(0, keepdim=True) if hr == 1 else g).to(dtype)


def key_table_grads(kb: Tensor, k: Tensor, rel_q: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """From the per-(key, table row) bins of dS, KB (B, H, M, R): dk's share ``scale * sum over the group of
    KB_h @ a^Q_h`` (B, Hkv, M, d) in KB's dtype, and ``d a^Q = scale * sum of KB^T @ k`` (Hr, R, d) in rel_q's
    dtype; every sum in a fixed order."""
    b, h, m, r = kb.shape
    hkv, d = k.shape[1], k.shape[-1]
    g = h // hkv
    kf = k.to(kb.dtype)
    table = rel_q.to(kb.dtype)
    if rel_q.shape[0] == 1:
        bins = kb.view(b, hkv, g, m, r).sum(2)  # (B, Hkv, M, R): the group shares the table
        dk = torch.matmul(bins, table[0]) * scale
        grad = torch.mm(bins.permute(3, 0, 1, 2).reshape(r, b * hkv * m), kf.reshape(b * hkv * m, d))[None]
    else:
        dk = (torch.matmul(kb.view(b, hkv, g, m, r), table.view(hkv, g, r, d)) * scale).sum(2)
        lhs = kb.permute(1, 3, 0, 2).reshape(h, r, b * m)
        rhs = kf.permute(1, 0, 2, 3)[:, None].expand(hkv, g, b, m, d).reshape(h, b * m, d)
        grad = torch.bmm(lhs, rhs)
    return dk, (grad * scale).to(rel_q.dtype)


def zero_grads(q, k, v, rel_k, rel_v, rel_q, q_pos, rel_bias, sdt, window: Window | None) -> tuple:
    """The gradients' buffers, zeros: dq, dk, dv (dk in the statistics' dtype with rel_q, until the table's share is
    added; dk and dv in it in a window, summed over the windows), d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias
    (d_rel_k, d_rel_v and d_rel_bias in the statistics' dtype in a window); None for a tensor not given."""
    wide = window is not None
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k, dtype=sdt if rel_q is not None or wide else k.dtype)
    dv = torch.zeros_like(v, dtype=sdt if wide else v.dtype)
    d_rel_k, d_rel_v, d_rel_bias = (None if t is None else torch.zeros_like(t, dtype=sdt if wide else t.dtype)
                                    for t in (rel_k, rel_v, rel_bias))
    d_rel_q, d_q_pos = (None if t is None else torch.zeros_like(t) for t in (rel_q, q_pos))
    return dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias


def trimmed(grads: tuple, rel_q, q_pos, rel_bias) -> tuple:
    """``grads`` (dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias) as the ops return them: the first five,
    then the rest up to the last one given (None for one not given before it)."""
    given = max((i + 1 for i, t in enumerate((rel_q, q_pos, rel_bias)) if t is not None), default=0)
    return grads[:5 + given]


def table_grads(pb, sb, grad_out, reader, rel_k, rel_v, d_rel_k, d_rel_v, q_pos, scale: float,
                 window: Window | None) -> tuple:
    """(d_rel_k, d_rel_v, d_q_pos) from the row bins, d_rel_k and d_rel_v into the window's rows of the zeros given
    (in their dtype); d_q_pos (None without q_pos): the key table's share of the position queries' gradient,
    ``scale * SB a^K`` per head."""
    rows = slice(None) if window is None else slice(window.row0, window.row0 + window.rows)
    if rel_k is not None:
        d_rel_k[:, rows] = table_grad(sb, reader, rel_k.shape[0], d_rel_k.dtype, scale)
    if rel_v is not None:
        d_rel_v[:, rows] = table_grad(pb, grad_out, rel_v.shape[0], d_rel_v.dtype)
    if q_pos is None:
        return d_rel_k, d_rel_v, None
    if rel_k is not None:
        share = torch.matmul(sb, window_of(rel_k, window).to(sb.dtype)) * scale
    else:
        share = torch.zeros_like(q_pos, dtype=stats_dtype(q_pos.dtype))
    return d_rel_k, d_rel_v, share.to(q_pos.dtype)


def bias_grad(sb: Tensor | None, d_rel_bias: Tensor | None, window: Window | None) -> Tensor | None:
    """``d rel_bias`` (None without the bias): SB (B, H, N, R), the per-row bins of dS, summed over batch and rows
    (and heads when the bias is shared), in a fixed order (no atomics), into the window's rows of the zeros given
    (Hr, 2K+1), in their dtype."""
    if d_rel_bias is None:
        return None
    rows = slice(None) if window is None else slice(window.row0, window.row0 + window.rows)
    g = sb.sum((0, 2))
    d_rel_bias[:, rows] = (g.sum(0, keepdim=True) if d_rel_bias.shape[0] == 1 else g).to(d_rel_bias.dtype)
    return d_rel_bias
