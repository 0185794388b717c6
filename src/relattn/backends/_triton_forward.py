"""The "triton" backend's table-scores and forward kernels (``@triton.jit``). Their design and notation, and
the backward kernels: :mod:`._triton_kernels`, which the launcher reads them from."""

import triton
import triton.language as tl

from ._triton_compat import cast, device_fn, dot
from ._triton_device import (
    BAND,
    LEFT,
    LN2,
    RIGHT,
    Drop,
    Mask,
    Mat,
    Meta,
    Sizes,
    Table,
    Terms,
    col_hashes,
    drop_of,
    edge_sums,
    kept_mask,
    key_range,
    load_2d,
    row_hashes,
    sequence_rows,
    store_2d,
    store_interior,
    store_rows,
    tile_scores,
)

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
    x = load_2d(X + offs_n[:, None] * stride_xn + offs_d[None, :] * stride_xd, offs_n, offs_d, N, D, False, False)
    tT = load_2d(T + offs_d[:, None] * stride_td + offs_r[None, :] * stride_tr, offs_d, offs_r, D, R, False, False)
    s = dot(x, tT, PREC)
    store_2d(S + offs_n[:, None] * stride_sn + offs_r[None, :], s.to(S.dtype.element_ty), offs_n, offs_r, N, R,
              False, False)


# -------------------------------------------------------------------------------------------------------- forward


@device_fn
def _fwd_inner(acc, l_i, m_i, left, right, q, start_m, start, end, K, V, terms, BINS, drop, rows, size, C,
               STAGE: tl.constexpr):
    """One stage of a query tile's key loop: the online softmax over the stage's key tiles among [start, end)
    (band tiles ``C.BAND_SPLIT`` times narrower). C.DROPOUT: the weights that multiply v and a^V are the kept ones
    (``drop``: :data:`Drop`; ``rows``: the tile's row hashes), the normaliser sums them all."""
    lo, hi = key_range(start_m, start, end, size, C, STAGE)
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
        kT = load_2d(K.ptr + offs_d[:, None] * K.stride_d + offs_n[None, :] * K.stride_n, offs_d, offs_n, size.D,
                      size.M, C.EVEN_D, C.EVEN_N)
        s = tile_scores(q, kT, terms, offs_m, offs_n, size, C, STAGE)
        # -- the online softmax: new row maxima, rescale what was summed so far
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if C.DROPOUT:  # dropped pairs weigh nothing below (1/(1-p) applied to the output once)
            kept = kept_mask(rows, col_hashes(drop, offs_n), drop.threshold)
            p = tl.where(kept, p, 0.0)
            if C.HAS_RV and STAGE == BAND:
                s = tl.where(kept, s, float("-inf"))
        # -- P v
        v = load_2d(V.ptr + offs_n[:, None] * V.stride_n + offs_dv[None, :] * V.stride_d, offs_n, offs_dv, size.M,
                     size.DV, C.EVEN_N, C.EVEN_D)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, C.PREC)
        # -- the value table's share: P per table row (edge sums here, the band's interior as scores in BINS)
        if C.HAS_RV:
            left, right = edge_sums(p, left * alpha, right * alpha, offs_m, offs_n, size, STAGE)
            if STAGE == BAND:
                store_interior(BINS, s, offs_m, offs_n, size, C)
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
    (B = 1) whose "batch entries" are the sequences of CU_Q, CU_K (:func:`sequence_rows`); N, M the longest lengths;
    the programs past their sequence's end exit. DROPOUT: the kept weights of the mask of (the int64 at SEED, batch
    entry or sequence, query head, row, key) times ``drop_scale``, the ones whose hash is at least
    ``drop_threshold`` (:func:`kept_mask`)."""
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
        q0, k0, N, M, off = sequence_rows(CU_Q, CU_K, off_b, off)
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
        drop = drop_of(SEED, entry, off_h, drop_threshold, drop_scale)
        rows = row_hashes(drop, offs_m)
    q = load_2d(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, offs_m, offs_d, N, D, EVEN_M, EVEN_D)
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
        first = load_2d(RV + offs_dv[None, :] * stride_rvd, offs_dv, offs_dv, 1, DV, True, EVEN_D).to(ACC)
        last = load_2d(RV + 2 * MAX_REL * stride_rvr + offs_dv[None, :] * stride_rvd, offs_dv, offs_dv, 1, DV, True,
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
            a = load_2d(RV + offs_t[:, None] * stride_rvr + offs_dv[None, :] * stride_rvd, offs_t, offs_dv,
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
    store_2d(OUT + offs_m[:, None] * stride_on + offs_dv[None, :] * stride_od, cast(out, OUT.dtype.element_ty),
              offs_m, offs_dv, N, DV, EVEN_M, EVEN_D)
    store_rows(LSE + offs_m * stride_ln, lse, offs_m, N, EVEN_M)
