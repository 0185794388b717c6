"""The "triton" backend's kernels (``@triton.jit``): table scores, forward, key/value gradients, query gradients.

Imported only by :mod:`relattn.backends.triton` on first use (it needs ``triton``; under ``TRITON_INTERPRET=1``
the same kernels run interpreted on CPU tensors, with the few workarounds of ``_triton_compat.py``). Notation as
in ``_common.py``; query ``i`` sits at ``p_i = i + off``, key ``j`` has offset ``r = j - p_i`` and table row
``t = clip(r, -K, K) + K``. Scores are kept in log2 units (``scale * log2(e)`` folded into one factor), so the
softmax is ``exp2``.

The key loop of a query tile runs in three stages, as the tutorial's causal ``STAGE`` split does:

* LEFT, key tiles whose every pair has ``r <= -K``: every pair reads table row 0, so the key term is one number
  per row, ``q_i . a^K_0``, and the value term one running sum per row, ``sum_j P_ij``; plain flash otherwise;
* BAND, the few tiles (about ``(2K + BM) / BN``) in between: the key term is gathered, per pair, from the
  row's precomputed table scores ``QA = q a^K^T`` (B, H, N, 2K+1; one small matmul kernel before the loop), and
  each pair's score with ``|r| < K`` is stored to a per-row bin (its table row ``t``; one key per bin);
* RIGHT, key tiles whose every pair has ``r > K``: as LEFT with row 2K (never reached when causal).

The position-to-content term (``HAS_RQ``: ``k_j . a^Q_t``, DeBERTa's p2c) reads the keys' precomputed table
scores ``KA = k a^Q^T`` (B, H or Hkv, M, 2K+1) the same way from the key side: one number per key off the band
(``KA[j, 0]`` left of it, ``KA[j, 2K]`` right), gathered per pair on it.

Band tiles are ``BAND_SPLIT`` times narrower than the others: their per-pair gathers and stores hold addresses
and indices in registers that a plain tile does not, and registers are allocated for the kernel's widest stage.

After the loop the value term is ``sum_t P_it a^V_t``: the bins, exponentiated with the final row maximum, times
the value table, one matmul per chunk of table rows, plus the two edge sums times rows 0 and 2K. The backward
stages its loops the same way (``_dkdv_kernel`` from a key tile's side, ``_dq_kernel`` from a query tile's) and
shares one tile body, ``_bwd_tile``; ``_dq_kernel`` also stores P and dS per (row, table row) for the table
gradients (each bin written once, by the program owning the row: no atomics), and ``_dkdv_kernel`` (HAS_RQ) dS
per (key, table row) for the term of ``a^Q`` (each bin written once, by the program owning the key).

Key/value heads: query head ``h`` reads key/value head ``h // GROUP``; ``_dkdv_kernel``'s program for a
key/value head loops over its group's query heads in a fixed order.

Packed batches (the constexpr ``VARLEN``): one launch for all the sequences of a batch of one entry, the programs'
"batch entries" its sequences; a program takes its sequence's first rows, lengths and query offset from the
cumulative lengths ``CU_Q``, ``CU_K`` (``_sequence``), moves its pointers there, and exits when its tile starts past
the sequence's end. Without ``VARLEN`` none of this is compiled.
"""

from collections import namedtuple

import triton
import triton.language as tl

from ._triton_compat import cast, device_fn, dot

LEFT: tl.constexpr = tl.constexpr(0)
BAND: tl.constexpr = tl.constexpr(1)
RIGHT: tl.constexpr = tl.constexpr(2)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# What the stages share, grouped as the tutorial groups a tensor with its strides in a descriptor: namedtuples
# are Triton tuples (flattened when compiled, read by field name, so no two strides can trade places). A kernel
# builds them once; its constexprs go in one ``Meta``, bound as ``C: tl.constexpr = Meta(...)`` (a plain
# assignment would turn them into runtime values).
Mat = namedtuple("Mat", ["ptr", "stride_n", "stride_d"])  # one head's (tokens, dim) matrix: q, k, v, dO
Table = namedtuple("Table", ["ptr", "stride_n"])  # one head's rows of 2K+1 per token (unit stride): scores, bins
Mask = namedtuple("Mask", ["ptr", "stride_n", "stride_m"])  # one head's additive mask at (query, key) strides
Stats = namedtuple("Stats", ["LSE", "DELTA", "stride_n"])  # one head's log-sum-exp and delta per query row
Terms = namedtuple("Terms", ["QA", "KA", "DOA", "MASK", "qk_scale"])  # what scores and dP add to q k^T and dO v^T
RowBins = namedtuple("RowBins", ["P", "DS"])  # the dq kernel's per-row bins of P (for a^V) and dS (for a^K)
# queries, keys, head dims, K, query offset; the per-row tables' window: table rows [row0, row0 + rows)
Sizes = namedtuple("Sizes", ["N", "M", "D", "DV", "MAX_REL", "off", "row0", "rows"])
Meta = namedtuple("Meta", ["BLOCK_M", "BLOCK_N", "HEAD_DIM", "HEAD_DIM_V", "BAND_SPLIT", "HAS_RK", "HAS_RQ", "HAS_RV",
                           "HAS_MASK", "CAUSAL", "EVEN_M", "EVEN_N", "EVEN_D", "PREC", "ACC", "DROPOUT", "WINDOW"])
# a (batch entry, query head)'s dropout: its key, the seed's row and key offsets, floor(p 2**32), 1/(1-p)
Drop = namedtuple("Drop", ["key", "i0", "j0", "threshold", "scale"])


# ----------------------------------------------------------------------------------------------- loads and stores


@device_fn
def _load_2d(ptrs, offs_0, offs_1, n_0, n_1, EVEN_0: tl.constexpr, EVEN_1: tl.constexpr):
    """A tile, masked (zeros outside) only along the dimensions that may run past the tensor's end."""
    if EVEN_0 and EVEN_1:
        x = tl.load(ptrs)
    elif EVEN_0:
        x = tl.load(ptrs, mask=(offs_1 < n_1)[None, :], other=0.0)
    elif EVEN_1:
        x = tl.load(ptrs, mask=(offs_0 < n_0)[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=(offs_0 < n_0)[:, None] & (offs_1 < n_1)[None, :], other=0.0)
    return x


@device_fn
def _store_2d(ptrs, x, offs_0, offs_1, n_0, n_1, EVEN_0: tl.constexpr, EVEN_1: tl.constexpr):
    if EVEN_0 and EVEN_1:
        tl.store(ptrs, x)
    elif EVEN_0:
        tl.store(ptrs, x, mask=(offs_1 < n_1)[None, :])
    elif EVEN_1:
        tl.store(ptrs, x, mask=(offs_0 < n_0)[:, None])
    else:
        tl.store(ptrs, x, mask=(offs_0 < n_0)[:, None] & (offs_1 < n_1)[None, :])


@device_fn
def _load_rows(ptrs, offs_m, N, other, EVEN_M: tl.constexpr):
    """One value per query row (log-sum-exp, delta)."""
    if EVEN_M:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_m < N, other=other)
    return x


@device_fn
def _store_rows(ptrs, x, offs_m, N, EVEN_M: tl.constexpr):
    if EVEN_M:
        tl.store(ptrs, x)
    else:
        tl.store(ptrs, x, mask=offs_m < N)


# ------------------------------------------------------------------------------------------- the tile body parts



@device_fn
def _rel_term(S, offs_m, offs_n, size, C, STAGE: tl.constexpr):
    """``x_i . a_t(i, j)`` from one head's precomputed table scores ``S = x a^T`` (a :data:`Table`): (BM, 1) off the
    band (one table row for the whole tile), gathered per pair to (BM, BN) on the band. C.WINDOW: S holds the
    table rows ``[size.row0, size.row0 + size.rows)`` only, column ``t - row0``; a pair outside them (past the
    sequence's end, or masked by causality: its score is -inf after) reads the nearest column."""
    if STAGE == BAND:
        t = tl.minimum(tl.maximum(offs_n[None, :] - offs_m[:, None] - size.off, -size.MAX_REL), size.MAX_REL) \
            + size.MAX_REL
    elif STAGE == LEFT:
        t = offs_m[:, None] * 0
    else:
        t = offs_m[:, None] * 0 + 2 * size.MAX_REL
    if C.WINDOW:
        t = tl.minimum(tl.maximum(t - size.row0, 0), size.rows - 1)
    ptrs = S.ptr + offs_m[:, None] * S.stride_n + t
    if C.EVEN_M:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_m < size.N)[:, None], other=0.0)
    return x


@device_fn
def _key_rel_term(KA, offs_m, offs_n, size, STAGE: tl.constexpr, EVEN_N: tl.constexpr):
    """``k_j . a^Q_t(i, j)`` from one head's precomputed key table scores ``KA = k a^Q^T`` (a :data:`Table`, a row
    of 2K+1 per key): (1, BN) off the band (one table row for the whole tile), gathered per pair to (BM, BN) on
    the band."""
    if STAGE == BAND:
        t = tl.minimum(tl.maximum(offs_n[None, :] - offs_m[:, None] - size.off, -size.MAX_REL), size.MAX_REL) \
            + size.MAX_REL
    elif STAGE == LEFT:
        t = offs_n[None, :] * 0
    else:
        t = offs_n[None, :] * 0 + 2 * size.MAX_REL
    ptrs = KA.ptr + offs_n[None, :] * KA.stride_n + t
    if EVEN_N:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_n < size.M)[None, :], other=0.0)
    return x


@device_fn
def _scores(q, kT, terms, offs_m, offs_n, size, C, STAGE: tl.constexpr):
    """A tile's scores in log2 units, ``((q k^T + q a^K_t + k a^Q_t) scale + mask) log2(e)``, -inf where no key may
    be seen. C.HAS_MASK: 0 no mask, 1 a mask with one value per key (the same for every row), 2 one value per
    pair."""
    qk = dot(q, kT, C.PREC)
    if C.HAS_RK:
        qk += _rel_term(terms.QA, offs_m, offs_n, size, C, STAGE)
    if C.HAS_RQ:
        qk += _key_rel_term(terms.KA, offs_m, offs_n, size, STAGE, C.EVEN_N)
    s = qk * terms.qk_scale
    if C.HAS_MASK == 1:  # one value per key (a key-padding mask): a row of the tile
        bias = _load_2d(terms.MASK.ptr + offs_n[None, :] * terms.MASK.stride_m, offs_n, offs_n, 1, size.M, True,
                        C.EVEN_N)
        s += bias.to(s.dtype) * LOG2E
    elif C.HAS_MASK == 2:  # one value per pair
        rows = offs_m.to(tl.int64)[:, None] * terms.MASK.stride_n  # N * M may pass 2**31
        bias = _load_2d(terms.MASK.ptr + rows + offs_n[None, :] * terms.MASK.stride_m, offs_m, offs_n, size.N,
                        size.M, C.EVEN_M, C.EVEN_N)
        s += bias.to(s.dtype) * LOG2E
    if C.CAUSAL and STAGE == BAND:  # the diagonal lies in the band (BAND spans at least BM keys past the rows)
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + size.off, s, float("-inf"))
    if not C.EVEN_N:
        s = tl.where((offs_n < size.M)[None, :], s, float("-inf"))
    return s


@device_fn
def _edge_sums(x, left, right, offs_m, offs_n, size, STAGE: tl.constexpr):
    """Running (BM,) sums of ``x`` over the pairs reading table row 0 (r <= -K) and row 2K (r >= K, r > -K)."""
    if STAGE == LEFT:
        left += tl.sum(x, 1)
    elif STAGE == RIGHT:
        right += tl.sum(x, 1)
    else:
        r = offs_n[None, :] - offs_m[:, None] - size.off
        left += tl.sum(tl.where(r <= -size.MAX_REL, x, 0.0), 1)
        right += tl.sum(tl.where((r >= size.MAX_REL) & (r > -size.MAX_REL), x, 0.0), 1)
    return left, right


@device_fn
def _store_interior(BINS, x, offs_m, offs_n, size, C):
    """A band tile's pairs with |r| < K stored to their row's bin t = r + K of ``BINS`` (a :data:`Table`; one key
    per bin, so no sums); C.WINDOW: to column t - row0, the window's pairs only."""
    r = offs_n[None, :] - offs_m[:, None] - size.off
    ok = (r > -size.MAX_REL) & (r < size.MAX_REL)
    col = r + size.MAX_REL
    if C.WINDOW:
        col -= size.row0
        ok = ok & (col >= 0) & (col < size.rows)
    if not C.EVEN_M:
        ok = ok & (offs_m < size.N)[:, None]
    tl.store(BINS.ptr + offs_m[:, None] * BINS.stride_n + col, x, mask=ok)


@device_fn
def _key_edge_sums(x, left, right, offs_m, offs_n, size, STAGE: tl.constexpr):
    """Running (BN,) sums of ``x`` over a key tile's pairs reading table row 0 (r <= -K) and row 2K (r >= K,
    r > -K): the key-side twin of ``_edge_sums``."""
    if STAGE == LEFT:
        left += tl.sum(x, 0)
    elif STAGE == RIGHT:
        right += tl.sum(x, 0)
    else:
        r = offs_n[None, :] - offs_m[:, None] - size.off
        left += tl.sum(tl.where(r <= -size.MAX_REL, x, 0.0), 0)
        right += tl.sum(tl.where((r >= size.MAX_REL) & (r > -size.MAX_REL), x, 0.0), 0)
    return left, right


@device_fn
def _store_interior_keys(KB, x, offs_m, offs_n, size, C):
    """A band tile's pairs with |r| < K stored to their key's bin t = r + K of ``KB`` (a :data:`Table`; one query
    per bin, so no sums)."""
    r = offs_n[None, :] - offs_m[:, None] - size.off
    ok = (r > -size.MAX_REL) & (r < size.MAX_REL)
    if not C.EVEN_M:
        ok = ok & (offs_m < size.N)[:, None]
    if not C.EVEN_N:
        ok = ok & (offs_n < size.M)[None, :]
    tl.store(KB.ptr + offs_n[None, :] * KB.stride_n + (r + size.MAX_REL), x, mask=ok)


@device_fn
def _store_row_edges(B, left, right, offs_m, size, C):
    """The edge bins of the rows ``offs_m`` (``_store_edges``); C.WINDOW: those the window holds (a window without
    table row 0 or 2K has no pair there: its sums are zero)."""
    if not C.WINDOW:
        _store_edges(B, left, right, offs_m, size.N, size.MAX_REL, C.EVEN_M)
    elif size.MAX_REL == 0:
        _store_rows(B.ptr + offs_m * B.stride_n, left + right, offs_m, size.N, C.EVEN_M)
    else:
        if size.row0 == 0:
            _store_rows(B.ptr + offs_m * B.stride_n, left, offs_m, size.N, C.EVEN_M)
        if 2 * size.MAX_REL - size.row0 < size.rows:
            _store_rows(B.ptr + offs_m * B.stride_n + 2 * size.MAX_REL - size.row0, right, offs_m, size.N, C.EVEN_M)


@device_fn
def _store_edges(B, left, right, offs, n, MAX_REL, EVEN: tl.constexpr):
    """Bins 0 and 2K of ``B`` (a :data:`Table`) for the tokens ``offs`` (one bin when K = 0: both edges are table
    row 0)."""
    if MAX_REL == 0:
        _store_rows(B.ptr + offs * B.stride_n, left + right, offs, n, EVEN)
    else:
        _store_rows(B.ptr + offs * B.stride_n, left, offs, n, EVEN)
        _store_rows(B.ptr + offs * B.stride_n + 2 * MAX_REL, right, offs, n, EVEN)


# ------------------------------------------------------------------------------------------------------ dropout


@device_fn
def _mix32(x):
    """A 32-bit integer hash (uint32 in, uint32 out; the multiplies wrap)."""
    x ^= x >> 16
    x *= 0x45D9F3B
    x ^= x >> 16
    x *= 0x45D9F3B
    x ^= x >> 16
    return x


@device_fn
def _drop(SEED, entry, head, threshold, scale):
    """The :data:`Drop` of (batch entry, query head), from the int64 seed tensor ``(seed, b0, i0, j0)`` (read here:
    no host sync): key ``mix32(mix32(mix32(seed ^ 0x243F6A88) ^ (b0 + b)) ^ h)``; the call's rows and keys are the
    mask's ``i0 + i`` and ``j0 + j`` (a chunk of a longer call, or a sequence run alone, draws the whole call's)."""
    seed = tl.load(SEED).to(tl.uint32)
    b = (tl.load(SEED + 1) + entry).to(tl.uint32)
    key = _mix32(_mix32(_mix32(seed ^ 0x243F6A88) ^ b) ^ head.to(tl.uint32))
    return Drop(key=key, i0=tl.load(SEED + 2), j0=tl.load(SEED + 3), threshold=threshold.to(tl.uint32), scale=scale)


@device_fn
def _row_hashes(drop, offs_m):
    """One hash per query row ``i`` (its index in the call's q; within its sequence when packed)."""
    return _mix32(drop.key ^ 0x85A308D3 ^ (drop.i0 + offs_m).to(tl.uint32))


@device_fn
def _col_hashes(drop, offs_n):
    """One hash per key ``j`` (its index in the call's k; within its sequence when packed)."""
    return _mix32((drop.key + 0x9E3779B9) ^ (drop.j0 + offs_n).to(tl.uint32))


@device_fn
def _kept(rows, cols, threshold):
    """The tile's keep mask: ``mix32(row_i ^ col_j) >= floor(p 2**32)``, unsigned; a function of (seed, b, h, i, j)
    alone, so the backward's tiles regenerate the forward's mask."""
    return _mix32(rows[:, None] ^ cols[None, :]) >= threshold


# ------------------------------------------------------------------------------------------- the stages' bounds


@device_fn
def _tile_start(x, lo, hi, base, BLOCK: tl.constexpr):
    """The start of the tile (of a grid from ``base``) holding ``clip(x, lo, hi)``."""
    return base + ((tl.minimum(tl.maximum(x, lo), hi) - base) // BLOCK) * BLOCK


@device_fn
def _tile_end(x, lo, hi, base, BLOCK: tl.constexpr):
    """The first tile start at or after ``clip(x, lo, hi)``, at most ``hi``."""
    return tl.minimum(base + tl.cdiv(tl.minimum(tl.maximum(x, lo), hi) - base, BLOCK) * BLOCK, hi)


@device_fn
def _key_range(start_m, start, end, size, C, STAGE: tl.constexpr):
    """[lo, hi), the key tiles of ``STAGE`` for the query tile at ``start_m``, among the keys [start, end) (tiles
    counted from ``start``; ``end`` already cut at the last row's diagonal when causal): LEFT every pair r <= -K,
    BAND the tiles in between, RIGHT every pair r > K."""
    band_lo = _tile_start(start_m + size.off - size.MAX_REL + 1, start, end, start, C.BLOCK_N)
    if STAGE == LEFT:
        lo, hi = start, band_lo
    else:
        band_hi = _tile_end(start_m + size.off + C.BLOCK_M + size.MAX_REL, band_lo, end, start, C.BLOCK_N)
        if STAGE == BAND:
            lo, hi = band_lo, band_hi
        else:
            lo, hi = band_hi, end
    return lo, hi


@device_fn
def _query_range(start_n, size, C, STAGE: tl.constexpr):
    """[lo, hi), the query tiles of ``STAGE`` for the key tile at ``start_n``: RIGHT the rows whose every pair reads
    table row 2K (the keys right of their band; from the first row that sees the tile when causal), BAND the rows
    in between, LEFT the rows whose every pair reads row 0."""
    first = 0
    if C.CAUSAL:
        first = _tile_start(start_n - size.off, 0, size.N, 0, C.BLOCK_M)
    band_lo = _tile_start(start_n - size.MAX_REL - size.off, first, size.N, 0, C.BLOCK_M)
    if STAGE == RIGHT:
        lo, hi = first, band_lo
    else:
        band_hi = _tile_end(start_n + C.BLOCK_N - 1 + size.MAX_REL - size.off, band_lo, size.N, 0, C.BLOCK_M)
        if STAGE == BAND:
            lo, hi = band_lo, band_hi
        else:
            lo, hi = band_hi, size.N
    return lo, hi


# ------------------------------------------------------------------------------------------------ packed sequences


@device_fn
def _sequence(CU_Q, CU_K, seq, off):
    """(first query row, first key row, n, m, query offset) of sequence ``seq`` of a packed batch (B = 1): its rows
    from the cumulative lengths, its queries at the end of its keys (``off + m - n``)."""
    q0 = tl.load(CU_Q + seq).to(tl.int64)
    k0 = tl.load(CU_K + seq).to(tl.int64)
    n = (tl.load(CU_Q + seq + 1) - q0).to(tl.int32)
    m = (tl.load(CU_K + seq + 1) - k0).to(tl.int32)
    return q0, k0, n, m, off + m - n


# --------------------------------------------------------------------------------------------------- table scores


@triton.jit
def _table_scores_kernel(X, T, S,
                         stride_xb, stride_xh, stride_xn, stride_xd,
                         stride_th, stride_tr, stride_td,
                         stride_sb, stride_sh, stride_sn,
                         H, XGROUP, N, D, R,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, PREC: tl.constexpr):
    """``S[b, h, i, t] = x_i . T[h, t]`` for t < R = 2K+1 (T's head stride 0 when shared), in S's dtype, x's head
    ``h // XGROUP``: the table scores ``q a^K^T`` and ``k a^Q^T`` (grouped k: XGROUP > 1 for a per-head table) for
    the forward, and ``dO a^V^T`` for the backward."""
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    X += off_b * stride_xb + (off_h // XGROUP) * stride_xh
    T += off_h * stride_th
    S += off_b * stride_sb + off_h * stride_sh
    x = _load_2d(X + offs_n[:, None] * stride_xn + offs_d[None, :] * stride_xd, offs_n, offs_d, N, D, False, False)
    tT = _load_2d(T + offs_d[:, None] * stride_td + offs_r[None, :] * stride_tr, offs_d, offs_r, D, R, False, False)
    s = dot(x, tT, PREC)
    _store_2d(S + offs_n[:, None] * stride_sn + offs_r[None, :], s.to(S.dtype.element_ty), offs_n, offs_r, N, R,
              False, False)


# -------------------------------------------------------------------------------------------------------- forward


@device_fn
def _fwd_inner(acc, l_i, m_i, left, right, q, start_m, start, end, K, V, terms, BINS, drop, rows, size, C,
               STAGE: tl.constexpr):
    """One stage of a query tile's key loop: the online softmax over the stage's key tiles among [start, end)
    (band tiles ``C.BAND_SPLIT`` times narrower). C.DROPOUT: the weights that multiply v and a^V are the kept ones
    (``drop``: :data:`Drop`; ``rows``: the tile's row hashes), the normaliser sums them all."""
    lo, hi = _key_range(start_m, start, end, size, C, STAGE)
    if STAGE == BAND:
        BLOCK_N: tl.constexpr = C.BLOCK_N // C.BAND_SPLIT
    else:
        BLOCK_N: tl.constexpr = C.BLOCK_N
    offs_m = start_m + tl.arange(0, C.BLOCK_M)
    offs_d = tl.arange(0, C.HEAD_DIM)
    offs_dv = tl.arange(0, C.HEAD_DIM_V)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # -- the scores
        kT = _load_2d(K.ptr + offs_d[:, None] * K.stride_d + offs_n[None, :] * K.stride_n, offs_d, offs_n, size.D,
                      size.M, C.EVEN_D, C.EVEN_N)
        s = _scores(q, kT, terms, offs_m, offs_n, size, C, STAGE)
        # -- the online softmax: new row maxima, rescale what was summed so far
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if C.DROPOUT:  # dropped pairs weigh nothing below (1/(1-p) applied to the output once)
            kept = _kept(rows, _col_hashes(drop, offs_n), drop.threshold)
            p = tl.where(kept, p, 0.0)
            if C.HAS_RV and STAGE == BAND:
                s = tl.where(kept, s, float("-inf"))
        # -- P v
        v = _load_2d(V.ptr + offs_n[:, None] * V.stride_n + offs_dv[None, :] * V.stride_d, offs_n, offs_dv, size.M,
                     size.DV, C.EVEN_N, C.EVEN_D)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, C.PREC)
        # -- the value table's share: P per table row (edge sums here, the band's interior as scores in BINS)
        if C.HAS_RV:
            left, right = _edge_sums(p, left * alpha, right * alpha, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                _store_interior(BINS, s, offs_m, offs_n, size, C)
        m_i = m_new
    return acc, l_i, m_i, left, right


@triton.jit(do_not_specialize=["drop_threshold", "ROW0", "ROWS"])
def _fwd_kernel(Q, K, V, QA, KA, RV, MASK, BINS, OUT, LSE, CU_Q, CU_K,
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_sb, stride_sh, stride_sn,
                stride_kab, stride_kah, stride_kan,
                stride_rvh, stride_rvr, stride_rvd,
                stride_mb, stride_mh, stride_mn, stride_mm,
                stride_os, stride_ob, stride_oh, stride_on, stride_od,
                stride_ls, stride_lb, stride_lh, stride_ln,
                H, GROUP, KA_GROUP, N, M, D, DV, MAX_REL, off, ROW0, ROWS, qk_scale, split_len, SEED,
                drop_threshold, drop_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                HAS_RK: tl.constexpr, HAS_RQ: tl.constexpr, HAS_RV: tl.constexpr, HAS_MASK: tl.constexpr,
                CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                PREC: tl.constexpr, ACC: tl.constexpr, BAND_SPLIT: tl.constexpr, VARLEN: tl.constexpr,
                DROPOUT: tl.constexpr, WINDOW: tl.constexpr):
    """Per (query tile, batch * head, split of the keys): out and lse of the split's keys. One split: the
    attention's out and lse. Several (decoding: too few query tiles to fill the GPU): each split's normalised out
    and lse at split strides stride_os and stride_ls, merged by the launcher. QA: the rows' table scores; KA: the
    keys' (head ``h // KA_GROUP``); BINS: scratch (B, H, N, 2K+1) for the band's scores. VARLEN: a packed batch
    (B = 1) whose "batch entries" are the sequences of CU_Q, CU_K (:func:`_sequence`); N, M the longest lengths;
    the programs past their sequence's end exit. DROPOUT: the kept weights of the mask of (the int64 at SEED, batch
    entry or sequence, query head, row, key) times ``drop_scale``, the ones whose hash is at least
    ``drop_threshold`` (:func:`_kept`)."""
    C: tl.constexpr = Meta(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                           BAND_SPLIT=BAND_SPLIT, HAS_RK=HAS_RK, HAS_RQ=HAS_RQ, HAS_RV=HAS_RV, HAS_MASK=HAS_MASK,
                           CAUSAL=CAUSAL, EVEN_M=EVEN_M, EVEN_N=EVEN_N, EVEN_D=EVEN_D, PREC=PREC, ACC=ACC,
                           DROPOUT=DROPOUT, WINDOW=WINDOW)
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    split = tl.program_id(2)
    off_b = (off_bh // H).to(tl.int64)
    entry = off_b  # the dropout mask's b: the batch entry, or the sequence of a packed batch
    q0 = 0
    k0 = 0
    if VARLEN:  # a packed batch: entry off_b is a sequence of the one batch entry, from its rows q0 and keys k0 on
        q0, k0, N, M, off = _sequence(CU_Q, CU_K, off_b, off)
        off_b = 0
        if start_m >= N:  # past this sequence's queries
            return
    size = Sizes(N=N, M=M, D=D, DV=DV, MAX_REL=MAX_REL, off=off, row0=ROW0, rows=ROWS)
    off_h = (off_bh % H).to(tl.int64)
    off_hkv = off_h // GROUP
    Q += off_b * stride_qb + off_h * stride_qh + q0 * stride_qn
    K += off_b * stride_kb + off_hkv * stride_kh + k0 * stride_kn
    V += off_b * stride_vb + off_hkv * stride_vh + k0 * stride_vn
    QA += off_b * stride_sb + off_h * stride_sh + q0 * stride_sn
    KA += off_b * stride_kab + (off_h // KA_GROUP) * stride_kah + k0 * stride_kan
    BINS += off_b * stride_sb + off_h * stride_sh + q0 * stride_sn
    RV += off_h * stride_rvh
    MASK += off_b * stride_mb + off_h * stride_mh
    keys = Mat(ptr=K, stride_n=stride_kn, stride_d=stride_kd)
    values = Mat(ptr=V, stride_n=stride_vn, stride_d=stride_vd)
    terms = Terms(QA=Table(ptr=QA, stride_n=stride_sn), KA=Table(ptr=KA, stride_n=stride_kan),
                  DOA=Table(ptr=QA, stride_n=stride_sn), MASK=Mask(ptr=MASK, stride_n=stride_mn, stride_m=stride_mm),
                  qk_scale=qk_scale)
    bins = Table(ptr=BINS, stride_n=stride_sn)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    drop = Drop(key=0, i0=0, j0=0, threshold=drop_threshold, scale=drop_scale)
    rows = offs_m
    if DROPOUT:
        drop = _drop(SEED, entry, off_h, drop_threshold, drop_scale)
        rows = _row_hashes(drop, offs_m)
    q = _load_2d(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, offs_m, offs_d, N, D, EVEN_M, EVEN_D)
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_V), ACC)
    left = tl.zeros((BLOCK_M,), ACC)
    right = tl.zeros((BLOCK_M,), ACC)

    # -- this split's keys, in three stages: left of the band (row 0 throughout), the band, right of it (row 2K)
    start = split * split_len
    end = tl.minimum(M, start + split_len)
    if CAUSAL:
        end = tl.minimum(end, start_m + BLOCK_M + off)
    end = tl.maximum(end, start)
    acc, l_i, m_i, left, right = _fwd_inner(acc, l_i, m_i, left, right, q, start_m, start, end, keys, values, terms,
                                            bins, drop, rows, size, C, LEFT)
    acc, l_i, m_i, left, right = _fwd_inner(acc, l_i, m_i, left, right, q, start_m, start, end, keys, values, terms,
                                            bins, drop, rows, size, C, BAND)
    if not CAUSAL:  # causal rows see no key right of the band
        acc, l_i, m_i, left, right = _fwd_inner(acc, l_i, m_i, left, right, q, start_m, start, end, keys, values,
                                                terms, bins, drop, rows, size, C, RIGHT)

    # -- the value table's term, sum_t P_it a^V_t: the edge sums, then the band's bins one chunk of rows at a time
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    if HAS_RV:
        tl.debug_barrier()  # other threads of this program stored the bins
        first = _load_2d(RV + offs_dv[None, :] * stride_rvd, offs_dv, offs_dv, 1, DV, True, EVEN_D).to(ACC)
        last = _load_2d(RV + 2 * MAX_REL * stride_rvr + offs_dv[None, :] * stride_rvd, offs_dv, offs_dv, 1, DV, True,
                        EVEN_D).to(ACC)
        acc += left[:, None] * first + right[:, None] * last
        t_lo = 1  # the interior table rows [t_lo, t_hi), in BINS's column t - col0
        t_hi = 2 * MAX_REL
        col0 = 0
        if WINDOW:
            t_lo = tl.maximum(1, ROW0)
            t_hi = tl.minimum(2 * MAX_REL, ROW0 + ROWS)
            col0 = ROW0
        for t0 in range(t_lo, t_hi, BLOCK_N):
            offs_t = t0 + tl.arange(0, BLOCK_N)
            key = offs_m[:, None] + off + offs_t[None, :] - MAX_REL
            ok = (offs_t < t_hi)[None, :] & (key >= start) & (key < end)
            if not EVEN_M:
                ok = ok & (offs_m < N)[:, None]
            s = tl.load(BINS + offs_m[:, None] * stride_sn + (offs_t - col0)[None, :], mask=ok, other=float("-inf"))
            p = tl.exp2(s - m_safe[:, None])
            a = _load_2d(RV + offs_t[:, None] * stride_rvr + offs_dv[None, :] * stride_rvd, offs_t, offs_dv,
                         t_hi, DV, False, EVEN_D)
            acc += dot(cast(p, a.dtype), a, PREC)

    # -- normalise; the log-sum-exp (natural log, -inf for a row with no key) for the backward and the merge
    seen = (l_i > 0.0) | (l_i != l_i)  # a NaN total (a NaN key) is a NaN row, as in the reference, not an empty one
    denom = tl.where(seen, l_i, 1.0)
    if DROPOUT:
        out = acc * (drop.scale / denom)[:, None]
    else:
        out = acc / denom[:, None]
    lse = tl.where(seen, (m_safe + tl.log2(denom)) * LN2, float("-inf"))
    OUT += split * stride_os + off_b * stride_ob + off_h * stride_oh + q0 * stride_on
    LSE += split * stride_ls + off_b * stride_lb + off_h * stride_lh + q0 * stride_ln
    _store_2d(OUT + offs_m[:, None] * stride_on + offs_dv[None, :] * stride_od, cast(out, OUT.dtype.element_ty),
              offs_m, offs_dv, N, DV, EVEN_M, EVEN_D)
    _store_rows(LSE + offs_m * stride_ln, lse, offs_m, N, EVEN_M)




# ------------------------------------------------------------------------------------------------------- backward


@device_fn
def _bwd_tile(q, do, kT, vT, lse2, delta, terms, drop, rows, cols, offs_m, offs_n, size, C, STAGE: tl.constexpr):
    """W and dS of a (query tile, key tile) pair, recomputed from the saved log-sum-exp (FlashAttention-2's
    backward): P = exp(S - lse), dW = dO v^T + dO . a^V_t, dS = P (dW - delta); W = P without dropout. C.DROPOUT
    (``drop``: :data:`Drop`; ``rows``, ``cols``: the tile's row and key hashes): the forward's mask Z regenerated,
    W = P Z / (1 - p) (what multiplied v and a^V), dS = P (dW Z / (1 - p) - delta)."""
    s = _scores(q, kT, terms, offs_m, offs_n, size, C, STAGE)
    p = tl.exp2(s - lse2[:, None])
    dp = dot(do, vT, C.PREC)
    if C.HAS_RV:
        dp += _rel_term(terms.DOA, offs_m, offs_n, size, C, STAGE)
    if C.DROPOUT:
        kept = _kept(rows, cols, drop.threshold)
        ds = p * (tl.where(kept, dp * drop.scale, 0.0) - delta[:, None])
        p = tl.where(kept, p * drop.scale, 0.0)
    else:
        ds = p * (dp - delta[:, None])
    return p, ds


@device_fn
def _dkdv_inner(dk, dv, k_left, k_right, kT, vT, start_n, Q, DO, stats, terms, KB, drop, cols, size, C,
                STAGE: tl.constexpr):
    """One stage of a key tile's loop over the stage's query tiles (band tiles ``C.BAND_SPLIT`` times narrower):
    dv += P^T dO, dk += dS^T q, and (HAS_RQ) dS per key and table row: the edge sums, the band's interior stored to
    KB."""
    lo, hi = _query_range(start_n, size, C, STAGE)
    if STAGE == BAND:
        BLOCK_M: tl.constexpr = C.BLOCK_M // C.BAND_SPLIT
    else:
        BLOCK_M: tl.constexpr = C.BLOCK_M
    offs_n = start_n + tl.arange(0, C.BLOCK_N)
    offs_d = tl.arange(0, C.HEAD_DIM)
    offs_dv = tl.arange(0, C.HEAD_DIM_V)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_2d(Q.ptr + offs_m[:, None] * Q.stride_n + offs_d[None, :] * Q.stride_d, offs_m, offs_d, size.N,
                     size.D, C.EVEN_M, C.EVEN_D)
        do = _load_2d(DO.ptr + offs_m[:, None] * DO.stride_n + offs_dv[None, :] * DO.stride_d, offs_m, offs_dv,
                      size.N, size.DV, C.EVEN_M, C.EVEN_D)
        lse2 = _load_rows(stats.LSE + offs_m * stats.stride_n, offs_m, size.N, float("inf"), C.EVEN_M) * LOG2E
        delta = _load_rows(stats.DELTA + offs_m * stats.stride_n, offs_m, size.N, 0.0, C.EVEN_M)
        rows = offs_m
        if C.DROPOUT:
            rows = _row_hashes(drop, offs_m)
        p, ds = _bwd_tile(q, do, kT, vT, lse2, delta, terms, drop, rows, cols, offs_m, offs_n, size, C, STAGE)
        dv += dot(tl.trans(cast(p, do.dtype)), do, C.PREC)
        dk += dot(tl.trans(cast(ds, q.dtype)), q, C.PREC)
        if C.HAS_RQ:
            k_left, k_right = _key_edge_sums(ds, k_left, k_right, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                _store_interior_keys(KB, ds, offs_m, offs_n, size, C)
    return dk, dv, k_left, k_right


@triton.jit(do_not_specialize=["drop_threshold", "ROW0", "ROWS"])
def _dkdv_kernel(Q, K, V, QA, KA, DOA, MASK, DO, LSE, DELTA, DK, DV_, KB, CU_Q, CU_K,
                 stride_qb, stride_qh, stride_qn, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_sb, stride_sh, stride_sn,
                 stride_kab, stride_kah, stride_kan,
                 stride_kbb, stride_kbh, stride_kbn,
                 stride_mb, stride_mh, stride_mn, stride_mm,
                 stride_dob, stride_doh, stride_don, stride_dod,
                 stride_lb, stride_lh, stride_ln,
                 H_KV, GROUP, KA_GROUP, N, M, D, DV, MAX_REL, off, ROW0, ROWS, qk_scale, scale, SEED, drop_threshold,
                 drop_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 HAS_RK: tl.constexpr, HAS_RQ: tl.constexpr, HAS_RV: tl.constexpr, HAS_MASK: tl.constexpr,
                 CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
                 PREC: tl.constexpr, ACC: tl.constexpr, BAND_SPLIT: tl.constexpr, VARLEN: tl.constexpr,
                 DROPOUT: tl.constexpr, WINDOW: tl.constexpr):
    """Per (key tile, batch * key/value head): dk = scale dS^T q and dv = P^T dO, summed over the group's query
    heads in order (DK, DV_ laid out like k, v). HAS_RQ: KA, the keys' table scores (head ``h // KA_GROUP``), and
    KB (B, H, M, 2K+1), each query head's dS per (key, table row), every bin of this program's keys written once
    (zeros where no pair falls are the launcher's). VARLEN: as the forward's, the programs past their sequence's
    keys exit. DROPOUT: the forward's mask, regenerated (each query head's key)."""
    C: tl.constexpr = Meta(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                           BAND_SPLIT=BAND_SPLIT, HAS_RK=HAS_RK, HAS_RQ=HAS_RQ, HAS_RV=HAS_RV, HAS_MASK=HAS_MASK,
                           CAUSAL=CAUSAL, EVEN_M=EVEN_M, EVEN_N=EVEN_N, EVEN_D=EVEN_D, PREC=PREC, ACC=ACC,
                           DROPOUT=DROPOUT, WINDOW=WINDOW)
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    off_b = (off_bh // H_KV).to(tl.int64)
    entry = off_b  # the dropout mask's b: the batch entry, or the sequence of a packed batch
    q0 = 0
    k0 = 0
    if VARLEN:  # as the forward's
        q0, k0, N, M, off = _sequence(CU_Q, CU_K, off_b, off)
        off_b = 0
        if start_n >= M:  # past this sequence's keys
            return
    size = Sizes(N=N, M=M, D=D, DV=DV, MAX_REL=MAX_REL, off=off, row0=ROW0, rows=ROWS)
    off_hkv = (off_bh % H_KV).to(tl.int64)
    K += off_b * stride_kb + off_hkv * stride_kh + k0 * stride_kn
    V += off_b * stride_vb + off_hkv * stride_vh + k0 * stride_vn
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    kT = _load_2d(K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn, offs_d, offs_n, D, M, EVEN_D, EVEN_N)
    vT = _load_2d(V + offs_dv[:, None] * stride_vd + offs_n[None, :] * stride_vn, offs_dv, offs_n, DV, M, EVEN_D,
                  EVEN_N)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), ACC)
    dv = tl.zeros((BLOCK_N, HEAD_DIM_V), ACC)

    # -- the query tiles that see this key tile, per query head of the group, in three stages: rows whose every
    # pair reads table row 2K (the keys right of their band), the band, rows whose every pair reads row 0
    for g in range(0, GROUP):
        off_h = off_hkv * GROUP + g
        queries = Mat(ptr=Q + off_b * stride_qb + off_h * stride_qh + q0 * stride_qn, stride_n=stride_qn,
                      stride_d=stride_qd)
        grads = Mat(ptr=DO + off_b * stride_dob + off_h * stride_doh + q0 * stride_don, stride_n=stride_don,
                    stride_d=stride_dod)
        stats = Stats(LSE=LSE + off_b * stride_lb + off_h * stride_lh + q0 * stride_ln,
                      DELTA=DELTA + off_b * stride_lb + off_h * stride_lh + q0 * stride_ln, stride_n=stride_ln)
        terms = Terms(QA=Table(ptr=QA + off_b * stride_sb + off_h * stride_sh + q0 * stride_sn, stride_n=stride_sn),
                      KA=Table(ptr=KA + off_b * stride_kab + (off_h // KA_GROUP) * stride_kah + k0 * stride_kan,
                               stride_n=stride_kan),
                      DOA=Table(ptr=DOA + off_b * stride_sb + off_h * stride_sh + q0 * stride_sn, stride_n=stride_sn),
                      MASK=Mask(ptr=MASK + off_b * stride_mb + off_h * stride_mh, stride_n=stride_mn,
                                stride_m=stride_mm), qk_scale=qk_scale)
        key_bins = Table(ptr=KB + off_b * stride_kbb + off_h * stride_kbh + k0 * stride_kbn, stride_n=stride_kbn)
        drop = Drop(key=0, i0=0, j0=0, threshold=drop_threshold, scale=drop_scale)
        cols = offs_n
        if DROPOUT:
            drop = _drop(SEED, entry, off_h, drop_threshold, drop_scale)
            cols = _col_hashes(drop, offs_n)
        k_left = tl.zeros((BLOCK_N,), ACC)
        k_right = tl.zeros((BLOCK_N,), ACC)
        if not CAUSAL:  # causal rows never see keys right of their band
            dk, dv, k_left, k_right = _dkdv_inner(dk, dv, k_left, k_right, kT, vT, start_n, queries, grads, stats,
                                                  terms, key_bins, drop, cols, size, C, RIGHT)
        dk, dv, k_left, k_right = _dkdv_inner(dk, dv, k_left, k_right, kT, vT, start_n, queries, grads, stats, terms,
                                              key_bins, drop, cols, size, C, BAND)
        dk, dv, k_left, k_right = _dkdv_inner(dk, dv, k_left, k_right, kT, vT, start_n, queries, grads, stats, terms,
                                              key_bins, drop, cols, size, C, LEFT)
        if HAS_RQ:
            _store_edges(key_bins, k_left, k_right, offs_n, M, MAX_REL, EVEN_N)

    DK += off_b * stride_kb + off_hkv * stride_kh + k0 * stride_kn
    DV_ += off_b * stride_vb + off_hkv * stride_vh + k0 * stride_vn
    _store_2d(DK + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, cast(dk * scale, DK.dtype.element_ty),
              offs_n, offs_d, M, D, EVEN_N, EVEN_D)
    _store_2d(DV_ + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd, cast(dv, DV_.dtype.element_ty),
              offs_n, offs_dv, M, DV, EVEN_N, EVEN_D)


@device_fn
def _dq_inner(dq, p_left, p_right, s_left, s_right, q, do, lse2, delta, start_m, end, K, V, terms, bins, drop, rows,
              size, C, STAGE: tl.constexpr):
    """One stage of a query tile's loop over the stage's key tiles among [0, end) (band tiles ``C.BAND_SPLIT``
    times narrower): dq += dS k, and P, dS per table row (``bins``: :data:`RowBins`)."""
    lo, hi = _key_range(start_m, 0, end, size, C, STAGE)
    if STAGE == BAND:
        BLOCK_N: tl.constexpr = C.BLOCK_N // C.BAND_SPLIT
    else:
        BLOCK_N: tl.constexpr = C.BLOCK_N
    offs_m = start_m + tl.arange(0, C.BLOCK_M)
    offs_d = tl.arange(0, C.HEAD_DIM)
    offs_dv = tl.arange(0, C.HEAD_DIM_V)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _load_2d(K.ptr + offs_d[:, None] * K.stride_d + offs_n[None, :] * K.stride_n, offs_d, offs_n, size.D,
                      size.M, C.EVEN_D, C.EVEN_N)
        vT = _load_2d(V.ptr + offs_dv[:, None] * V.stride_d + offs_n[None, :] * V.stride_n, offs_dv, offs_n,
                      size.DV, size.M, C.EVEN_D, C.EVEN_N)
        cols = offs_n
        if C.DROPOUT:
            cols = _col_hashes(drop, offs_n)
        p, ds = _bwd_tile(q, do, kT, vT, lse2, delta, terms, drop, rows, cols, offs_m, offs_n, size, C, STAGE)
        dq += dot(cast(ds, kT.dtype), tl.trans(kT), C.PREC)
        if C.HAS_RV:
            p_left, p_right = _edge_sums(p, p_left, p_right, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                _store_interior(bins.P, p, offs_m, offs_n, size, C)
        if C.HAS_RK:
            s_left, s_right = _edge_sums(ds, s_left, s_right, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                _store_interior(bins.DS, ds, offs_m, offs_n, size, C)
    return dq, p_left, p_right, s_left, s_right


@triton.jit(do_not_specialize=["drop_threshold", "ROW0", "ROWS"])
def _dq_kernel(Q, K, V, QA, KA, DOA, RK, MASK, DO, LSE, DELTA, DQ, PB, SB, CU_Q, CU_K,
               stride_qb, stride_qh, stride_qn, stride_qd,
               stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd,
               stride_sb, stride_sh, stride_sn,
               stride_kab, stride_kah, stride_kan,
               stride_rkh, stride_rkr, stride_rkd,
               stride_mb, stride_mh, stride_mn, stride_mm,
               stride_dob, stride_doh, stride_don, stride_dod,
               stride_lb, stride_lh, stride_ln,
               H, GROUP, KA_GROUP, N, M, D, DV, MAX_REL, off, ROW0, ROWS, qk_scale, scale, SEED, drop_threshold,
               drop_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               HAS_RK: tl.constexpr, HAS_RQ: tl.constexpr, HAS_RV: tl.constexpr, HAS_MASK: tl.constexpr,
               CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
               PREC: tl.constexpr, ACC: tl.constexpr, BAND_SPLIT: tl.constexpr, KEY_TABLE_DQ: tl.constexpr,
               VARLEN: tl.constexpr, DROPOUT: tl.constexpr, WINDOW: tl.constexpr):
    """Per (query tile, batch * head): dq = scale (dS k + sum_t SB_it a^K_t), and the per-row bins of P (PB) and
    dS (SB) per table row (zeros where no pair falls), from which the launcher forms the table gradients.
    KEY_TABLE_DQ False (position queries q_pos read the key table): dq = scale dS k only, the launcher forms the
    key table's share, the gradient of q_pos, from SB. VARLEN, DROPOUT: as the forward's (P's bins hold the kept
    weights)."""
    C: tl.constexpr = Meta(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_V=HEAD_DIM_V,
                           BAND_SPLIT=BAND_SPLIT, HAS_RK=HAS_RK, HAS_RQ=HAS_RQ, HAS_RV=HAS_RV, HAS_MASK=HAS_MASK,
                           CAUSAL=CAUSAL, EVEN_M=EVEN_M, EVEN_N=EVEN_N, EVEN_D=EVEN_D, PREC=PREC, ACC=ACC,
                           DROPOUT=DROPOUT, WINDOW=WINDOW)
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    entry = off_b  # the dropout mask's b: the batch entry, or the sequence of a packed batch
    q0 = 0
    k0 = 0
    if VARLEN:  # a packed batch: entry off_b is a sequence of the one batch entry, from its rows q0 and keys k0 on
        q0, k0, N, M, off = _sequence(CU_Q, CU_K, off_b, off)
        off_b = 0
        if start_m >= N:  # past this sequence's queries
            return
    size = Sizes(N=N, M=M, D=D, DV=DV, MAX_REL=MAX_REL, off=off, row0=ROW0, rows=ROWS)
    off_h = (off_bh % H).to(tl.int64)
    off_hkv = off_h // GROUP
    Q += off_b * stride_qb + off_h * stride_qh + q0 * stride_qn
    DO += off_b * stride_dob + off_h * stride_doh + q0 * stride_don
    K += off_b * stride_kb + off_hkv * stride_kh + k0 * stride_kn
    V += off_b * stride_vb + off_hkv * stride_vh + k0 * stride_vn
    QA += off_b * stride_sb + off_h * stride_sh + q0 * stride_sn
    KA += off_b * stride_kab + (off_h // KA_GROUP) * stride_kah + k0 * stride_kan
    DOA += off_b * stride_sb + off_h * stride_sh + q0 * stride_sn
    PB += off_b * stride_sb + off_h * stride_sh + q0 * stride_sn
    SB += off_b * stride_sb + off_h * stride_sh + q0 * stride_sn
    RK += off_h * stride_rkh
    MASK += off_b * stride_mb + off_h * stride_mh
    keys = Mat(ptr=K, stride_n=stride_kn, stride_d=stride_kd)
    values = Mat(ptr=V, stride_n=stride_vn, stride_d=stride_vd)
    terms = Terms(QA=Table(ptr=QA, stride_n=stride_sn), KA=Table(ptr=KA, stride_n=stride_kan),
                  DOA=Table(ptr=DOA, stride_n=stride_sn), MASK=Mask(ptr=MASK, stride_n=stride_mn, stride_m=stride_mm),
                  qk_scale=qk_scale)
    bins = RowBins(P=Table(ptr=PB, stride_n=stride_sn), DS=Table(ptr=SB, stride_n=stride_sn))
    offs_m = start_m + tl.arange(0, BLOCK_M)
    drop = Drop(key=0, i0=0, j0=0, threshold=drop_threshold, scale=drop_scale)
    rows = offs_m
    if DROPOUT:
        drop = _drop(SEED, entry, off_h, drop_threshold, drop_scale)
        rows = _row_hashes(drop, offs_m)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q = _load_2d(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, offs_m, offs_d, N, D, EVEN_M, EVEN_D)
    do = _load_2d(DO + offs_m[:, None] * stride_don + offs_dv[None, :] * stride_dod, offs_m, offs_dv, N, DV, EVEN_M,
                  EVEN_D)
    stats_at = off_b * stride_lb + off_h * stride_lh + q0 * stride_ln
    lse2 = _load_rows(LSE + stats_at + offs_m * stride_ln, offs_m, N, float("inf"), EVEN_M) * LOG2E
    delta = _load_rows(DELTA + stats_at + offs_m * stride_ln, offs_m, N, 0.0, EVEN_M)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), ACC)
    p_left = tl.zeros((BLOCK_M,), ACC)
    p_right = tl.zeros((BLOCK_M,), ACC)
    s_left = tl.zeros((BLOCK_M,), ACC)
    s_right = tl.zeros((BLOCK_M,), ACC)

    # -- the key tiles, in the forward's three stages
    end = M
    if CAUSAL:
        end = tl.maximum(tl.minimum(M, start_m + BLOCK_M + off), 0)
    dq, p_left, p_right, s_left, s_right = _dq_inner(dq, p_left, p_right, s_left, s_right, q, do, lse2, delta,
                                                     start_m, end, keys, values, terms, bins, drop, rows, size, C,
                                                     LEFT)
    dq, p_left, p_right, s_left, s_right = _dq_inner(dq, p_left, p_right, s_left, s_right, q, do, lse2, delta,
                                                     start_m, end, keys, values, terms, bins, drop, rows, size, C,
                                                     BAND)
    if not CAUSAL:
        dq, p_left, p_right, s_left, s_right = _dq_inner(dq, p_left, p_right, s_left, s_right, q, do, lse2, delta,
                                                         start_m, end, keys, values, terms, bins, drop, rows,
                                                         size, C, RIGHT)

    # -- the edge bins; then the key table's share of dq, sum_t SB_it a^K_t, one chunk of table rows at a time
    if HAS_RV:
        _store_row_edges(bins.P, p_left, p_right, offs_m, size, C)
    if HAS_RK:
        _store_row_edges(bins.DS, s_left, s_right, offs_m, size, C)
    if KEY_TABLE_DQ:
        tl.debug_barrier()  # other threads of this program stored the bins
        width = 2 * MAX_REL + 1  # SB's columns, table rows from row 0 (WINDOW: from ROW0)
        if WINDOW:
            width = ROWS
            RK += ROW0 * stride_rkr
        for t0 in range(0, width, BLOCK_N):
            offs_t = t0 + tl.arange(0, BLOCK_N)
            ds = _load_2d(SB + offs_m[:, None] * stride_sn + offs_t[None, :], offs_m, offs_t, N, width, EVEN_M, False)
            a = _load_2d(RK + offs_t[:, None] * stride_rkr + offs_d[None, :] * stride_rkd, offs_t, offs_d, width, D,
                         False, EVEN_D)
            dq += dot(cast(ds, a.dtype), a, PREC)
    DQ += off_b * stride_qb + off_h * stride_qh + q0 * stride_qn
    _store_2d(DQ + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, cast(dq * scale, DQ.dtype.element_ty),
              offs_m, offs_d, N, D, EVEN_M, EVEN_D)
