"""What the "triton" backend's kernels share: constants, argument groups (namedtuples) and device functions
(``@device_fn``: loads and stores, the tile body's parts, dropout's hashes, the stages' bounds, packed sequences).
The kernels, their design and notation: :mod:`._triton_kernels`."""

from collections import namedtuple

import triton.language as tl

from ._triton_compat import device_fn, dot

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
def load_2d(ptrs, offs_0, offs_1, n_0, n_1, EVEN_0: tl.constexpr, EVEN_1: tl.constexpr):
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
def store_2d(ptrs, x, offs_0, offs_1, n_0, n_1, EVEN_0: tl.constexpr, EVEN_1: tl.constexpr):
    if EVEN_0 and EVEN_1:
        tl.store(ptrs, x)
    elif EVEN_0:
        tl.store(ptrs, x, mask=(offs_1 < n_1)[None, :])
    elif EVEN_1:
        tl.store(ptrs, x, mask=(offs_0 < n_0)[:, None])
    else:
        tl.store(ptrs, x, mask=(offs_0 < n_0)[:, None] & (offs_1 < n_1)[None, :])


@device_fn
def load_rows(ptrs, offs_m, N, other, EVEN_M: tl.constexpr):
    """One value per query row (log-sum-exp, delta)."""
    if EVEN_M:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_m < N, other=other)
    return x


@device_fn
def store_rows(ptrs, x, offs_m, N, EVEN_M: tl.constexpr):
    if EVEN_M:
        tl.store(ptrs, x)
    else:
        tl.store(ptrs, x, mask=offs_m < N)


# ------------------------------------------------------------------------------------------- the tile body parts



@device_fn
def rel_term(S, offs_m, offs_n, size, C, STAGE: tl.constexpr):
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
def key_rel_term(KA, offs_m, offs_n, size, STAGE: tl.constexpr, EVEN_N: tl.constexpr):
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
def tile_scores(q, kT, terms, offs_m, offs_n, size, C, STAGE: tl.constexpr):
    """A tile's scores in log2 units, ``((q k^T + q a^K_t + k a^Q_t) scale + mask) log2(e)``, -inf where no key may
    be seen. C.HAS_MASK: 0 no mask, 1 a mask with one value per key (the same for every row), 2 one value per
    pair."""
    qk = dot(q, kT, C.PREC)
    if C.HAS_RK:
        qk += rel_term(terms.QA, offs_m, offs_n, size, C, STAGE)
    if C.HAS_RQ:
        qk += key_rel_term(terms.KA, offs_m, offs_n, size, STAGE, C.EVEN_N)
    s = qk * terms.qk_scale
    if C.HAS_MASK == 1:  # one value per key (a key-padding mask): a row of the tile
        bias = load_2d(terms.MASK.ptr + offs_n[None, :] * terms.MASK.stride_m, offs_n, offs_n, 1, size.M, True,
                        C.EVEN_N)
        s += bias.to(s.dtype) * LOG2E
    elif C.HAS_MASK == 2:  # one value per pair
        rows = offs_m.to(tl.int64)[:, None] * terms.MASK.stride_n  # N * M may pass 2**31
        bias = load_2d(terms.MASK.ptr + rows + offs_n[None, :] * terms.MASK.stride_m, offs_m, offs_n, size.N,
                        size.M, C.EVEN_M, C.EVEN_N)
        s += bias.to(s.dtype) * LOG2E
    if C.CAUSAL and STAGE == BAND:  # the diagonal lies in the band (BAND spans at least BM keys past the rows)
        s = tl.where(offs_n[None, :] <= offs_m[:, None] + size.off, s, float("-inf"))
    if not C.EVEN_N:
        s = tl.where((offs_n < size.M)[None, :], s, float("-inf"))
    return s


@device_fn
def edge_sums(x, left, right, offs_m, offs_n, size, STAGE: tl.constexpr):
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
def store_interior(BINS, x, offs_m, offs_n, size, C):
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
def key_edge_sums(x, left, right, offs_m, offs_n, size, STAGE: tl.constexpr):
    """Running (BN,) sums of ``x`` over a key tile's pairs reading table row 0 (r <= -K) and row 2K (r >= K,
    r > -K): the key-side twin of ``edge_sums``."""
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
def store_interior_keys(KB, x, offs_m, offs_n, size, C):
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
def store_row_edges(B, left, right, offs_m, size, C):
    """The edge bins of the rows ``offs_m`` (``store_edges``); C.WINDOW: those the window holds (a window without
    table row 0 or 2K has no pair there: its sums are zero)."""
    if not C.WINDOW:
        store_edges(B, left, right, offs_m, size.N, size.MAX_REL, C.EVEN_M)
    elif size.MAX_REL == 0:
        store_rows(B.ptr + offs_m * B.stride_n, left + right, offs_m, size.N, C.EVEN_M)
    else:
        if size.row0 == 0:
            store_rows(B.ptr + offs_m * B.stride_n, left, offs_m, size.N, C.EVEN_M)
        if 2 * size.MAX_REL - size.row0 < size.rows:
            store_rows(B.ptr + offs_m * B.stride_n + 2 * size.MAX_REL - size.row0, right, offs_m, size.N, C.EVEN_M)


@device_fn
def store_edges(B, left, right, offs, n, MAX_REL, EVEN: tl.constexpr):
    """Bins 0 and 2K of ``B`` (a :data:`Table`) for the tokens ``offs`` (one bin when K = 0: both edges are table
    row 0)."""
    if MAX_REL == 0:
        store_rows(B.ptr + offs * B.stride_n, left + right, offs, n, EVEN)
    else:
        store_rows(B.ptr + offs * B.stride_n, left, offs, n, EVEN)
        store_rows(B.ptr + offs * B.stride_n + 2 * MAX_REL, right, offs, n, EVEN)


# ------------------------------------------------------------------------------------------------------ dropout


@device_fn
def mix32_hash(x):
    """A 32-bit integer hash (uint32 in, uint32 out; the multiplies wrap)."""
    x ^= x >> 16
    x *= 0x45D9F3B
    x ^= x >> 16
    x *= 0x45D9F3B
    x ^= x >> 16
    return x


@device_fn
def drop_of(SEED, entry, head, threshold, scale):
    """The :data:`Drop` of (batch entry, query head), from the int64 seed tensor ``(seed, b0, i0, j0)`` (read here:
    no host sync): key ``mix32(mix32(mix32(seed ^ 0x243F6A88) ^ (b0 + b)) ^ h)``; the call's rows and keys are the
    mask's ``i0 + i`` and ``j0 + j`` (a chunk of a longer call, or a sequence run alone, draws the whole call's)."""
    seed = tl.load(SEED).to(tl.uint32)
    b = (tl.load(SEED + 1) + entry).to(tl.uint32)
    key = mix32_hash(mix32_hash(mix32_hash(seed ^ 0x243F6A88) ^ b) ^ head.to(tl.uint32))
    return Drop(key=key, i0=tl.load(SEED + 2), j0=tl.load(SEED + 3), threshold=threshold.to(tl.uint32), scale=scale)


@device_fn
def row_hashes(drop, offs_m):
    """One hash per query row ``i`` (its index in the call's q; within its sequence when packed)."""
    return mix32_hash(drop.key ^ 0x85A308D3 ^ (drop.i0 + offs_m).to(tl.uint32))


@device_fn
def col_hashes(drop, offs_n):
    """One hash per key ``j`` (its index in the call's k; within its sequence when packed)."""
    return mix32_hash((drop.key + 0x9E3779B9) ^ (drop.j0 + offs_n).to(tl.uint32))


@device_fn
def kept_mask(rows, cols, threshold):
    """The tile's keep mask: ``mix32(row_i ^ col_j) >= floor(p 2**32)``, unsigned; a function of (seed, b, h, i, j)
    alone, so the backward's tiles regenerate the forward's mask."""
    return mix32_hash(rows[:, None] ^ cols[None, :]) >= threshold


# ------------------------------------------------------------------------------------------- the stages' bounds


@device_fn
def tile_start(x, lo, hi, base, BLOCK: tl.constexpr):
    """The start of the tile (of a grid from ``base``) holding ``clip(x, lo, hi)``."""
    return base + ((tl.minimum(tl.maximum(x, lo), hi) - base) // BLOCK) * BLOCK


@device_fn
def tile_end(x, lo, hi, base, BLOCK: tl.constexpr):
    """The first tile start at or after ``clip(x, lo, hi)``, at most ``hi``."""
    return tl.minimum(base + tl.cdiv(tl.minimum(tl.maximum(x, lo), hi) - base, BLOCK) * BLOCK, hi)


@device_fn
def key_range(start_m, start, end, size, C, STAGE: tl.constexpr):
    """[lo, hi), the key tiles of ``STAGE`` for the query tile at ``start_m``, among the keys [start, end) (tiles
    counted from ``start``; ``end`` already cut at the last row's diagonal when causal): LEFT every pair r <= -K,
    BAND the tiles in between, RIGHT every pair r > K."""
    band_lo = tile_start(start_m + size.off - size.MAX_REL + 1, start, end, start, C.BLOCK_N)
    if STAGE == LEFT:
        lo, hi = start, band_lo
    else:
        band_hi = tile_end(start_m + size.off + C.BLOCK_M + size.MAX_REL, band_lo, end, start, C.BLOCK_N)
        if STAGE == BAND:
            lo, hi = band_lo, band_hi
        else:
            lo, hi = band_hi, end
    return lo, hi


@device_fn
def query_range(start_n, size, C, STAGE: tl.constexpr):
    """[lo, hi), the query tiles of ``STAGE`` for the key tile at ``start_n``: RIGHT the rows whose every pair reads
    table row 2K (the keys right of their band; from the first row that sees the tile when causal), BAND the rows
    in between, LEFT the rows whose every pair reads row 0."""
    first = 0
    if C.CAUSAL:
        first = tile_start(start_n - size.off, 0, size.N, 0, C.BLOCK_M)
    band_lo = tile_start(start_n - size.MAX_REL - size.off, first, size.N, 0, C.BLOCK_M)
    if STAGE == RIGHT:
        lo, hi = first, band_lo
    else:
        band_hi = tile_end(start_n + C.BLOCK_N - 1 + size.MAX_REL - size.off, band_lo, size.N, 0, C.BLOCK_M)
        if STAGE == BAND:
            lo, hi = band_lo, band_hi
        else:
            lo, hi = band_hi, size.N
    return lo, hi


# ------------------------------------------------------------------------------------------------ packed sequences


@device_fn
def sequence_rows(CU_Q, CU_K, seq, off):
    """(first query row, first key row, n, m, query offset) of sequence ``seq`` of a packed batch (B = 1): its rows
    from the cumulative lengths, its queries at the end of its keys (``off + m - n``)."""
    q0 = tl.load(CU_Q + seq).to(tl.int64)
    k0 = tl.load(CU_K + seq).to(tl.int64)
    n = (tl.load(CU_Q + seq + 1) - q0).to(tl.int32)
    m = (tl.load(CU_K + seq + 1) - k0).to(tl.int32)
    return q0, k0, n, m, off + m - n
