"""The "triton" backend's kernels (``@triton.jit``): forward, the key/value gradients, the query gradients.

Imported only by :mod:`relattn.backends.triton` on first use (it needs ``triton``; under ``TRITON_INTERPRET=1``
the same kernels run interpreted on CPU tensors). Notation as in ``_common.py``; query ``i`` sits at
``p_i = i + off``, key ``j`` has offset ``r = j - p_i`` and table row ``t = clip(r, -K, K) + K``.

A (query tile, key tile) pair of sizes (BM, BN) spans offsets ``[rmin, rmax]``, rmin = n0 - (m0 + BM - 1) - off.
Three kinds (the runs of ``csrc/shaw_cpu.cpp``, one level up): ``rmax <= -K`` (left of the band: every pair
reads row 0, a constant per query row), ``rmin >= K`` (right: row 2K), else a band tile. A band tile loads
the ``W >= BM + BN - 1`` table rows of its offsets (clipped, so rows repeat at the ends) as a window:
``x @ window^T`` is gathered into key coordinates (the key term, and dO's value term in the backward), and a
(BM, BN) weight tile is skewed into window coordinates and multiplied by the window (the value term, and
the key table's share of dq). Window column ``w`` holds offset ``rmin + w``; pair (i, j) of the tile sits at
``w = j - i + BM - 1``.
"""

import os

import triton
import triton.language as tl


def _device(fn):
    """``triton.jit`` for a device function. Under ``TRITON_INTERPRET=1``, Triton 3.9 re-patches
    ``triton.language`` on every device-function call (about a millisecond each, a dozen calls per tile); the
    kernel calling it has patched it already, so there the rewritten function is called directly."""
    jitted = triton.jit(fn)
    rewrite = getattr(jitted, "rewrite", None)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or rewrite is None:
        return jitted
    return lambda *args, **kwargs: rewrite()(*args, **kwargs)


@_device
def _dot(a, b, PREC: tl.constexpr):
    """a @ b accumulated in float32 (float64 for float64). PREC "bf16-upcast": Triton 3.9's interpreter multiplies
    bfloat16 operands as their raw uint16 bits, so there they go in as float32 (exact: a bf16 product is exact
    in float32, as on tensor cores)."""
    if PREC == "bf16-upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@_device
def _cast(x, dtype: tl.constexpr, PREC: tl.constexpr):
    """x (float32) rounded to ``dtype`` to nearest. Triton 3.9's interpreter truncates float32 -> bfloat16 (a GPU
    rounds to nearest even): a bias the sums over many weights would accumulate. There ("bf16-upcast") the
    rounding is done on the bits first (ties away from zero), so the truncation that follows is exact."""
    if PREC == "bf16-upcast":
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x8000) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@_device
def _skew(x, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """(BM, BN) key coordinates -> (BM, W) window coordinates (zeros where no key of the tile lands)."""
    i = tl.arange(0, BM)[:, None]
    j = tl.arange(0, W)[None, :] - (BM - 1) + i
    ok = (j >= 0) & (j < BN)
    return tl.where(ok, tl.gather(x, tl.where(ok, j, 0), axis=1), 0.0)


@_device
def _window(T, base, K, dim, s_r, s_d, DP: tl.constexpr, W: tl.constexpr):
    """The (W, DP) table rows t = clip(base + w, -K, K) + K of one head's table ``T``."""
    rows = tl.minimum(tl.maximum(base + tl.arange(0, W), -K), K) + K
    cols = tl.arange(0, DP)
    return tl.load(T + rows[:, None] * s_r + cols[None, :] * s_d, mask=(cols < dim)[None, :], other=0.0)


@_device
def _edge_row(T, row, dim, s_r, s_d, DP: tl.constexpr, ACC: tl.constexpr):
    cols = tl.arange(0, DP)
    return tl.load(T + row * s_r + cols * s_d, mask=cols < dim, other=0.0).to(ACC)


@_device
def _rel_scores(x, T, rmin, rmax, K, dim, s_r, s_d, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                W: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """(BM, BN) in ACC: x_i . T[t(i, j)] for x (BM, DP) (q with a^K, or dO with a^V)."""
    if rmax <= -K:
        c = tl.sum(x.to(ACC) * _edge_row(T, 0, dim, s_r, s_d, DP, ACC)[None, :], 1)
        out = tl.broadcast_to(c[:, None], (BM, BN))
    elif rmin >= K:
        c = tl.sum(x.to(ACC) * _edge_row(T, 2 * K, dim, s_r, s_d, DP, ACC)[None, :], 1)
        out = tl.broadcast_to(c[:, None], (BM, BN))
    else:
        xw = _dot(x, tl.trans(_window(T, rmin, K, dim, s_r, s_d, DP, W)), PREC)
        idx = tl.arange(0, BN)[None, :] - tl.arange(0, BM)[:, None] + (BM - 1)
        out = tl.gather(xw, idx, axis=1)
    return out


@_device
def _rel_values(p, T, rmin, rmax, K, dim, s_r, s_d, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                W: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """(BM, DP) in ACC: sum_j p_ij T[t(i, j)] for p (BM, BN) in ACC (P with a^V, or dS with a^K)."""
    if rmax <= -K:
        out = tl.sum(p, 1)[:, None] * _edge_row(T, 0, dim, s_r, s_d, DP, ACC)[None, :]
    elif rmin >= K:
        out = tl.sum(p, 1)[:, None] * _edge_row(T, 2 * K, dim, s_r, s_d, DP, ACC)[None, :]
    else:
        win = _window(T, rmin, K, dim, s_r, s_d, DP, W)
        out = _dot(_cast(_skew(p, BM, BN, W), win.dtype, PREC), win, PREC)
    return out


@_device
def _scores(q, kt, RK, MASK, oi, oj, N, M, off, K, scale, rmin, rmax, D, s_rk_r, s_rk_d, s_m_n, s_m_m,
            DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, HAS_RK: tl.constexpr,
            HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """(BM, BN) scores (in ACC) of a tile: (q k^T + q a^K_t) * scale + mask, -inf where no key may be seen."""
    s = _dot(q, kt, PREC)
    if HAS_RK:
        s += _rel_scores(q, RK, rmin, rmax, K, D, s_rk_r, s_rk_d, DP, BM, BN, W, PREC, ACC)
    s = s * scale
    if HAS_MASK:
        ok = (oi < N)[:, None] & (oj < M)[None, :]
        rows = oi.to(tl.int64)[:, None] * s_m_n  # N * M may pass 2**31
        s += tl.load(MASK + rows + oj[None, :] * s_m_m, mask=ok, other=0.0).to(ACC)
    valid = (oj < M)[None, :]
    if CAUSAL:
        valid = valid & (oj[None, :] <= oi[:, None] + off)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _fwd_kernel(Q, Kp, V, RK, RV, MASK, OUT, LSE,
                s_q_b, s_q_h, s_q_n, s_q_d, s_k_b, s_k_h, s_k_n, s_k_d, s_v_b, s_v_h, s_v_n, s_v_d,
                s_rk_h, s_rk_r, s_rk_d, s_rv_h, s_rv_r, s_rv_d, s_m_b, s_m_h, s_m_n, s_m_m,
                s_o_b, s_o_h, s_o_n, s_o_d, s_l_b, s_l_h, s_l_n, s_o_s, s_l_s, split_len,
                H, N, M, D, DV, K, off, scale,
                DP: tl.constexpr, DVP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
                HAS_RK: tl.constexpr, HAS_RV: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                PREC: tl.constexpr, ACC: tl.constexpr):
    """Per (query tile, batch * head, split of the keys): the online softmax over the split's key tiles. One
    split: out and lse. Several (decoding: too few query tiles to fill the GPU): each split's normalised out
    and lse, at split strides s_o_s and s_l_s, merged by the launcher."""
    m0 = tl.program_id(0) * BM
    start = tl.program_id(2) * split_len
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * s_q_b + h * s_q_h
    Kp += b * s_k_b + h * s_k_h
    V += b * s_v_b + h * s_v_h
    RK += h * s_rk_h
    RV += h * s_rv_h
    MASK += b * s_m_b + h * s_m_h
    oi = m0 + tl.arange(0, BM)
    cd = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    q = tl.load(Q + oi[:, None] * s_q_n + cd[None, :] * s_q_d, mask=(oi < N)[:, None] & (cd < D)[None, :], other=0.0)
    m_i = tl.full((BM,), float("-inf"), ACC)
    l_i = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, DVP), ACC)
    end = tl.minimum(M, start + split_len)
    if CAUSAL:
        end = tl.minimum(end, m0 + BM + off)
    for n0 in range(start, end, BN):
        oj = n0 + tl.arange(0, BN)
        rmin = n0 - (m0 + BM - 1) - off
        rmax = n0 + BN - 1 - m0 - off
        kt = tl.load(Kp + oj[None, :] * s_k_n + cd[:, None] * s_k_d, mask=(oj < M)[None, :] & (cd < D)[:, None],
                     other=0.0)
        s = _scores(q, kt, RK, MASK, oi, oj, N, M, off, K, scale, rmin, rmax, D, s_rk_r, s_rk_d, s_m_n, s_m_m,
                    DP, BM, BN, W, HAS_RK, HAS_MASK, CAUSAL, PREC, ACC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + oj[:, None] * s_v_n + cv[None, :] * s_v_d, mask=(oj < M)[:, None] & (cv < DV)[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + _dot(_cast(p, v.dtype, PREC), v, PREC)
        if HAS_RV:
            acc += _rel_values(p, RV, rmin, rmax, K, DV, s_rv_r, s_rv_d, DVP, BM, BN, W, PREC, ACC)
        m_i = m_new
    seen = l_i > 0.0
    denom = tl.where(seen, l_i, 1.0)
    out = acc / denom[:, None]
    lse = tl.where(seen, m_i + tl.log(denom), float("-inf"))
    OUT += b * s_o_b + h * s_o_h + tl.program_id(2) * s_o_s
    tl.store(OUT + oi[:, None] * s_o_n + cv[None, :] * s_o_d, _cast(out, OUT.dtype.element_ty, PREC),
             mask=(oi < N)[:, None] & (cv < DV)[None, :])
    tl.store(LSE + b * s_l_b + h * s_l_h + tl.program_id(2) * s_l_s + oi * s_l_n, lse, mask=oi < N)


@triton.jit
def _dkdv_kernel(Q, Kp, V, RK, RV, MASK, DO, LSE, DELTA, DK, DV_,
                 s_q_b, s_q_h, s_q_n, s_q_d, s_k_b, s_k_h, s_k_n, s_k_d, s_v_b, s_v_h, s_v_n, s_v_d,
                 s_rk_h, s_rk_r, s_rk_d, s_rv_h, s_rv_r, s_rv_d, s_m_b, s_m_h, s_m_n, s_m_m,
                 s_do_b, s_do_h, s_do_n, s_do_d, s_l_b, s_l_h, s_l_n,
                 H, N, M, D, DV, K, off, scale,
                 DP: tl.constexpr, DVP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
                 HAS_RK: tl.constexpr, HAS_RV: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                 PREC: tl.constexpr, ACC: tl.constexpr):
    """Per key tile, over the query tiles that see it: dv = P^T dO, dk = scale dS^T q. dK/dV are laid out like k/v."""
    n0 = tl.program_id(0) * BN
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * s_q_b + h * s_q_h
    DO += b * s_do_b + h * s_do_h
    Kp += b * s_k_b + h * s_k_h
    V += b * s_v_b + h * s_v_h
    RK += h * s_rk_h
    RV += h * s_rv_h
    MASK += b * s_m_b + h * s_m_h
    LSE += b * s_l_b + h * s_l_h
    DELTA += b * s_l_b + h * s_l_h
    oj = n0 + tl.arange(0, BN)
    cd = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    k_ok = (oj < M)[:, None] & (cd < D)[None, :]
    v_ok = (oj < M)[:, None] & (cv < DV)[None, :]
    k = tl.load(Kp + oj[:, None] * s_k_n + cd[None, :] * s_k_d, mask=k_ok, other=0.0)
    v = tl.load(V + oj[:, None] * s_v_n + cv[None, :] * s_v_d, mask=v_ok, other=0.0)
    kt = tl.trans(k)
    dk = tl.zeros((BN, DP), ACC)
    dv = tl.zeros((BN, DVP), ACC)
    start = 0
    if CAUSAL:
        start = (tl.maximum(n0 - off, 0) // BM) * BM
    for m0 in range(start, N, BM):
        oi = m0 + tl.arange(0, BM)
        rmin = n0 - (m0 + BM - 1) - off
        rmax = n0 + BN - 1 - m0 - off
        q = tl.load(Q + oi[:, None] * s_q_n + cd[None, :] * s_q_d, mask=(oi < N)[:, None] & (cd < D)[None, :],
                    other=0.0)
        do = tl.load(DO + oi[:, None] * s_do_n + cv[None, :] * s_do_d, mask=(oi < N)[:, None] & (cv < DV)[None, :],
                     other=0.0)
        lse = tl.load(LSE + oi * s_l_n, mask=oi < N, other=float("inf"))
        delta = tl.load(DELTA + oi * s_l_n, mask=oi < N, other=0.0)
        s = _scores(q, kt, RK, MASK, oi, oj, N, M, off, K, scale, rmin, rmax, D, s_rk_r, s_rk_d, s_m_n, s_m_m,
                    DP, BM, BN, W, HAS_RK, HAS_MASK, CAUSAL, PREC, ACC)
        p = tl.exp(s - lse[:, None])
        dv += _dot(tl.trans(_cast(p, do.dtype, PREC)), do, PREC)
        dp = _dot(do, tl.trans(v), PREC)
        if HAS_RV:
            dp += _rel_scores(do, RV, rmin, rmax, K, DV, s_rv_r, s_rv_d, DVP, BM, BN, W, PREC, ACC)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(_cast(ds, q.dtype, PREC)), q, PREC)
    dk = dk * scale
    DK += b * s_k_b + h * s_k_h
    DV_ += b * s_v_b + h * s_v_h
    tl.store(DK + oj[:, None] * s_k_n + cd[None, :] * s_k_d, _cast(dk, DK.dtype.element_ty, PREC), mask=k_ok)
    tl.store(DV_ + oj[:, None] * s_v_n + cv[None, :] * s_v_d, _cast(dv, DV_.dtype.element_ty, PREC), mask=v_ok)


@_device
def _bucket_edges(x, r, K, left, right, BM: tl.constexpr, BN: tl.constexpr, rmin, rmax):
    """Running (BM,) sums of ``x`` over the pairs reading row 0 (r <= -K) and row 2K (r >= K, r > -K)."""
    if rmax <= -K:
        left += tl.sum(x, 1)
    elif (rmin >= K) & (rmin > -K):
        right += tl.sum(x, 1)
    else:
        left += tl.sum(tl.where(r <= -K, x, 0.0), 1)
        right += tl.sum(tl.where((r >= K) & (r > -K), x, 0.0), 1)
    return left, right


@_device
def _bucket_flush(B, acc, oi, wbase, K, N, s_b_r, BM: tl.constexpr, W: tl.constexpr, UPTO: tl.constexpr):
    """Store window columns w < UPTO whose row t = wbase + w + K is inside the band (0 < t < 2K)."""
    w = tl.arange(0, W)
    t = wbase + w + K
    ok = (oi < N)[:, None] & ((w < UPTO) & (t > 0) & (t < 2 * K))[None, :]
    tl.store(B + oi[:, None] * s_b_r + t[None, :], acc, mask=ok)


@_device
def _shift(acc, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """Window columns w + BN moved to w (zeros come in at the right)."""
    w = tl.broadcast_to(tl.arange(0, W)[None, :] + BN, (BM, W))
    return tl.where(w < W, tl.gather(acc, tl.minimum(w, W - 1), axis=1), 0.0)


@triton.jit
def _dq_kernel(Q, Kp, V, RK, RV, MASK, DO, LSE, DELTA, DQ, PB, SB,
               s_q_b, s_q_h, s_q_n, s_q_d, s_k_b, s_k_h, s_k_n, s_k_d, s_v_b, s_v_h, s_v_n, s_v_d,
               s_rk_h, s_rk_r, s_rk_d, s_rv_h, s_rv_r, s_rv_d, s_m_b, s_m_h, s_m_n, s_m_m,
               s_do_b, s_do_h, s_do_n, s_do_d, s_l_b, s_l_h, s_l_n, s_b_b, s_b_h, s_b_n,
               H, N, M, D, DV, K, off, scale,
               DP: tl.constexpr, DVP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
               HAS_RK: tl.constexpr, HAS_RV: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
               PREC: tl.constexpr, ACC: tl.constexpr):
    """Per query tile, over its key tiles: dq = scale (dS k + sum_j dS_ij a^K_t); and the per-row sums of P
    (PB) and dS (SB) for each table row t, from which the launcher forms the table gradients. A row's sums
    of one band tile sit in a (BM, W) window that slides by BN per tile: the BN columns it leaves are final
    and stored once (no read-modify-write); rows 0 and 2K are running sums stored at the end."""
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * s_q_b + h * s_q_h
    DO += b * s_do_b + h * s_do_h
    Kp += b * s_k_b + h * s_k_h
    V += b * s_v_b + h * s_v_h
    RK += h * s_rk_h
    RV += h * s_rv_h
    MASK += b * s_m_b + h * s_m_h
    PB += b * s_b_b + h * s_b_h
    SB += b * s_b_b + h * s_b_h
    oi = m0 + tl.arange(0, BM)
    cd = tl.arange(0, DP)
    cv = tl.arange(0, DVP)
    q_ok = (oi < N)[:, None] & (cd < D)[None, :]
    q = tl.load(Q + oi[:, None] * s_q_n + cd[None, :] * s_q_d, mask=q_ok, other=0.0)
    do = tl.load(DO + oi[:, None] * s_do_n + cv[None, :] * s_do_d, mask=(oi < N)[:, None] & (cv < DV)[None, :],
                 other=0.0)
    lse = tl.load(LSE + b * s_l_b + h * s_l_h + oi * s_l_n, mask=oi < N, other=float("inf"))
    delta = tl.load(DELTA + b * s_l_b + h * s_l_h + oi * s_l_n, mask=oi < N, other=0.0)
    dq = tl.zeros((BM, DP), ACC)
    p_win = tl.zeros((BM, W), ACC)
    s_win = tl.zeros((BM, W), ACC)
    p_left = tl.zeros((BM,), ACC)
    p_right = tl.zeros((BM,), ACC)
    s_left = tl.zeros((BM,), ACC)
    s_right = tl.zeros((BM,), ACC)
    wbase = -K
    end = M
    if CAUSAL:
        end = tl.minimum(M, m0 + BM + off)
    for n0 in range(0, end, BN):
        oj = n0 + tl.arange(0, BN)
        rmin = n0 - (m0 + BM - 1) - off
        rmax = n0 + BN - 1 - m0 - off
        k = tl.load(Kp + oj[:, None] * s_k_n + cd[None, :] * s_k_d, mask=(oj < M)[:, None] & (cd < D)[None, :],
                    other=0.0)
        v = tl.load(V + oj[:, None] * s_v_n + cv[None, :] * s_v_d, mask=(oj < M)[:, None] & (cv < DV)[None, :],
                    other=0.0)
        s = _scores(q, tl.trans(k), RK, MASK, oi, oj, N, M, off, K, scale, rmin, rmax, D, s_rk_r, s_rk_d, s_m_n,
                    s_m_m, DP, BM, BN, W, HAS_RK, HAS_MASK, CAUSAL, PREC, ACC)
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), PREC)
        if HAS_RV:
            dp += _rel_scores(do, RV, rmin, rmax, K, DV, s_rv_r, s_rv_d, DVP, BM, BN, W, PREC, ACC)
        ds = p * (dp - delta[:, None])
        dq += _dot(_cast(ds, k.dtype, PREC), k, PREC)
        r = oj[None, :] - (oi[:, None] + off)
        band = (rmax > -K) & (rmin < K)
        if HAS_RK:
            dq += _rel_values(ds, RK, rmin, rmax, K, D, s_rk_r, s_rk_d, DP, BM, BN, W, PREC, ACC)
            s_left, s_right = _bucket_edges(ds, r, K, s_left, s_right, BM, BN, rmin, rmax)
            if band:
                s_win += _skew(ds, BM, BN, W)
                _bucket_flush(SB, s_win, oi, rmin, K, N, s_b_n, BM, W, BN)
                s_win = _shift(s_win, BM, BN, W)
        if HAS_RV:
            p_left, p_right = _bucket_edges(p, r, K, p_left, p_right, BM, BN, rmin, rmax)
            if band:
                p_win += _skew(p, BM, BN, W)
                _bucket_flush(PB, p_win, oi, rmin, K, N, s_b_n, BM, W, BN)
                p_win = _shift(p_win, BM, BN, W)
        if band:
            wbase = rmin + BN
    DQ += b * s_q_b + h * s_q_h
    tl.store(DQ + oi[:, None] * s_q_n + cd[None, :] * s_q_d, _cast(dq * scale, DQ.dtype.element_ty, PREC), mask=q_ok)
    if HAS_RK:
        _bucket_flush(SB, s_win, oi, wbase, K, N, s_b_n, BM, W, W)
        _store_edges(SB, s_left, s_right, oi, K, N, s_b_n)
    if HAS_RV:
        _bucket_flush(PB, p_win, oi, wbase, K, N, s_b_n, BM, W, W)
        _store_edges(PB, p_left, p_right, oi, K, N, s_b_n)


@_device
def _store_edges(B, left, right, oi, K, N, s_b_n):
    """Rows 0 and 2K of the sums (one row when K = 0: both edges are row 0)."""
    if K == 0:
        tl.store(B + oi * s_b_n, left + right, mask=oi < N)
    else:
        tl.store(B + oi * s_b_n, left, mask=oi < N)
        tl.store(B + oi * s_b_n + 2 * K, right, mask=oi < N)
