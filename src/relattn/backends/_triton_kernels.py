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
cumulative lengths ``CU_Q``, ``CU_K`` (``sequence_rows``), moves its pointers there, and exits when its tile starts past
the sequence's end. Without ``VARLEN`` none of this is compiled.
"""

import triton
import triton.language as tl

from . import _triton_forward
from ._triton_compat import cast, device_fn, dot
from ._triton_device import (
    BAND,
    LEFT,
    LOG2E,
    RIGHT,
    Drop,
    Mask,
    Mat,
    Meta,
    RowBins,
    Sizes,
    Stats,
    Table,
    Terms,
    col_hashes,
    drop_of,
    edge_sums,
    kept_mask,
    key_edge_sums,
    key_range,
    load_2d,
    load_rows,
    query_range,
    rel_term,
    row_hashes,
    sequence_rows,
    store_2d,
    store_edges,
    store_interior,
    store_interior_keys,
    store_row_edges,
    tile_scores,
)

# the launcher reads every kernel from here
_table_scores_kernel = _triton_forward._table_scores_kernel
_fwd_kernel = _triton_forward._fwd_kernel


# ------------------------------------------------------------------------------------------------------- backward


@device_fn
def _bwd_tile(q, do, kT, vT, lse2, delta, terms, drop, rows, cols, offs_m, offs_n, size, C, STAGE: tl.constexpr):
    """W and dS of a (query tile, key tile) pair, recomputed from the saved log-sum-exp (FlashAttention-2's
    backward): P = exp(S - lse), dW = dO v^T + dO . a^V_t, dS = P (dW - delta); W = P without dropout. C.DROPOUT
    (``drop``: :data:`Drop`; ``rows``, ``cols``: the tile's row and key hashes): the forward's mask Z regenerated,
    W = P Z / (1 - p) (what multiplied v and a^V), dS = P (dW Z / (1 - p) - delta)."""
    s = tile_scores(q, kT, terms, offs_m, offs_n, size, C, STAGE)
    p = tl.exp2(s - lse2[:, None])
    dp = dot(do, vT, C.PREC)
    if C.HAS_RV:
        dp += rel_term(terms.DOA, offs_m, offs_n, size, C, STAGE)
    if C.DROPOUT:
        kept = kept_mask(rows, cols, drop.threshold)
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
    lo, hi = query_range(start_n, size, C, STAGE)
    if STAGE == BAND:
        BLOCK_M: tl.constexpr = C.BLOCK_M // C.BAND_SPLIT
    else:
        BLOCK_M: tl.constexpr = C.BLOCK_M
    offs_n = start_n + tl.arange(0, C.BLOCK_N)
    offs_d = tl.arange(0, C.HEAD_DIM)
    offs_dv = tl.arange(0, C.HEAD_DIM_V)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_2d(Q.ptr + offs_m[:, None] * Q.stride_n + offs_d[None, :] * Q.stride_d, offs_m, offs_d, size.N,
                     size.D, C.EVEN_M, C.EVEN_D)
        do = load_2d(DO.ptr + offs_m[:, None] * DO.stride_n + offs_dv[None, :] * DO.stride_d, offs_m, offs_dv,
                      size.N, size.DV, C.EVEN_M, C.EVEN_D)
        lse2 = load_rows(stats.LSE + offs_m * stats.stride_n, offs_m, size.N, float("inf"), C.EVEN_M) * LOG2E
        delta = load_rows(stats.DELTA + offs_m * stats.stride_n, offs_m, size.N, 0.0, C.EVEN_M)
        rows = offs_m
        if C.DROPOUT:
            rows = row_hashes(drop, offs_m)
        p, ds = _bwd_tile(q, do, kT, vT, lse2, delta, terms, drop, rows, cols, offs_m, offs_n, size, C, STAGE)
        dv += dot(tl.trans(cast(p, do.dtype)), do, C.PREC)
        dk += dot(tl.trans(cast(ds, q.dtype)), q, C.PREC)
        if C.HAS_RQ:
            k_left, k_right = key_edge_sums(ds, k_left, k_right, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                store_interior_keys(KB, ds, offs_m, offs_n, size, C)
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
        q0, k0, N, M, off = sequence_rows(CU_Q, CU_K, off_b, off)
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
    kT = load_2d(K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn, offs_d, offs_n, D, M, EVEN_D, EVEN_N)
    vT = load_2d(V + offs_dv[:, None] * stride_vd + offs_n[None, :] * stride_vn, offs_dv, offs_n, DV, M, EVEN_D,
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
            drop = drop_of(SEED, entry, off_h, drop_threshold, drop_scale)
            cols = col_hashes(drop, offs_n)
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
            store_edges(key_bins, k_left, k_right, offs_n, M, MAX_REL, EVEN_N)

    DK += off_b * stride_kb + off_hkv * stride_kh + k0 * stride_kn
    DV_ += off_b * stride_vb + off_hkv * stride_vh + k0 * stride_vn
    store_2d(DK + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, cast(dk * scale, DK.dtype.element_ty),
              offs_n, offs_d, M, D, EVEN_N, EVEN_D)
    store_2d(DV_ + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd, cast(dv, DV_.dtype.element_ty),
              offs_n, offs_dv, M, DV, EVEN_N, EVEN_D)


@device_fn
def _dq_inner(dq, p_left, p_right, s_left, s_right, q, do, lse2, delta, start_m, end, K, V, terms, bins, drop, rows,
              size, C, STAGE: tl.constexpr):
    """One stage of a query tile's loop over the stage's key tiles among [0, end) (band tiles ``C.BAND_SPLIT``
    times narrower): dq += dS k, and P, dS per table row (``bins``: :data:`RowBins`)."""
    lo, hi = key_range(start_m, 0, end, size, C, STAGE)
    if STAGE == BAND:
        BLOCK_N: tl.constexpr = C.BLOCK_N // C.BAND_SPLIT
    else:
        BLOCK_N: tl.constexpr = C.BLOCK_N
    offs_m = start_m + tl.arange(0, C.BLOCK_M)
    offs_d = tl.arange(0, C.HEAD_DIM)
    offs_dv = tl.arange(0, C.HEAD_DIM_V)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = load_2d(K.ptr + offs_d[:, None] * K.stride_d + offs_n[None, :] * K.stride_n, offs_d, offs_n, size.D,
                      size.M, C.EVEN_D, C.EVEN_N)
        vT = load_2d(V.ptr + offs_dv[:, None] * V.stride_d + offs_n[None, :] * V.stride_n, offs_dv, offs_n,
                      size.DV, size.M, C.EVEN_D, C.EVEN_N)
        cols = offs_n
        if C.DROPOUT:
            cols = col_hashes(drop, offs_n)
        p, ds = _bwd_tile(q, do, kT, vT, lse2, delta, terms, drop, rows, cols, offs_m, offs_n, size, C, STAGE)
        dq += dot(cast(ds, kT.dtype), tl.trans(kT), C.PREC)
        if C.HAS_RV:
            p_left, p_right = edge_sums(p, p_left, p_right, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                store_interior(bins.P, p, offs_m, offs_n, size, C)
        if C.HAS_RK:
            s_left, s_right = edge_sums(ds, s_left, s_right, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                store_interior(bins.DS, ds, offs_m, offs_n, size, C)
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
        q0, k0, N, M, off = sequence_rows(CU_Q, CU_K, off_b, off)
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
        drop = drop_of(SEED, entry, off_h, drop_threshold, drop_scale)
        rows = row_hashes(drop, offs_m)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    q = load_2d(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, offs_m, offs_d, N, D, EVEN_M, EVEN_D)
    do = load_2d(DO + offs_m[:, None] * stride_don + offs_dv[None, :] * stride_dod, offs_m, offs_dv, N, DV, EVEN_M,
                  EVEN_D)
    stats_at = off_b * stride_lb + off_h * stride_lh + q0 * stride_ln
    lse2 = load_rows(LSE + stats_at + offs_m * stride_ln, offs_m, N, float("inf"), EVEN_M) * LOG2E
    delta = load_rows(DELTA + stats_at + offs_m * stride_ln, offs_m, N, 0.0, EVEN_M)
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
        store_row_edges(bins.P, p_left, p_right, offs_m, size, C)
    if HAS_RK:
        store_row_edges(bins.DS, s_left, s_right, offs_m, size, C)
    if KEY_TABLE_DQ:
        tl.debug_barrier()  # other threads of this program stored the bins
        width = 2 * MAX_REL + 1  # SB's columns, table rows from row 0 (WINDOW: from ROW0)
        if WINDOW:
            width = ROWS
            RK += ROW0 * stride_rkr
        for t0 in range(0, width, BLOCK_N):
            offs_t = t0 + tl.arange(0, BLOCK_N)
            ds = load_2d(SB + offs_m[:, None] * stride_sn + offs_t[None, :], offs_m, offs_t, N, width, EVEN_M, False)
            a = load_2d(RK + offs_t[:, None] * stride_rkr + offs_d[None, :] * stride_rkd, offs_t, offs_d, width, D,
                         False, EVEN_D)
            dq += dot(cast(ds, a.dtype), a, PREC)
    DQ += off_b * stride_qb + off_h * stride_qh + q0 * stride_qn
    store_2d(DQ + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, cast(dq * scale, DQ.dtype.element_ty),
              offs_m, offs_d, N, D, EVEN_M, EVEN_D)
