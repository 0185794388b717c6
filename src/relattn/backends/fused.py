"""The "fused" kernels: exact Shaw attention on top of PyTorch's own fused attention (no autograd here).

Notation: ``B`` batch, ``H`` heads, ``N`` queries, ``M`` keys, ``D``/``Dv`` head dims, ``K`` max relative
position, ``p_i = i + query_offset`` the absolute position of query ``i``, ``r = j - p_i`` the raw offset.

Beyond the band ``|r| < K`` the clipped index is constant on each side, so the relative terms fold into
the keys and values:

* far left, ``r <= -K``:  ``s_ij = q_i . (k_j + a^K_{-K})``, value ``v_j + a^V_{-K}``;
* far right, ``r >= K``:   ``s_ij = q_i . (k_j + a^K_{+K})``, value ``v_j + a^V_{+K}``;
* band, ``|r| < K``:        ``s_ij = q_i . (k_j + a^K_r)``, value ``v_j + a^V_r`` (2K-1 keys per row).

The far-left region is ``j <= i + c`` with ``c = query_offset - K``: ordinary causal attention on
shifted slices, computed by PyTorch's fused kernel, which also returns the log-sum-exp. The far-right
region is the same on the reversed sequences. The band is computed per tile of ``T`` queries against
its ``T + wb - 1`` key window (batched GEMMs; ``wb = 2K - 1`` offsets, or ``K`` when causal); the per-row
band is read off the tile by a skewed view, so that entry ``(i, r)`` of the band sits next to
``q_i . a^K_r`` without any gather. The softmax and the backward's elementwise work run on that compact
(N, wb) band; the (T, W) tiles exist only in a small buffer reused chunk after chunk (cache-resident, and
no page faults of a fresh (N, W) tensor per step). The parts merge by log-sum-exp. Memory outside the
fused calls is O(N (D + K)): no (N, M) tensor is built.

Backward: with the *merged* log-sum-exp, the fused backward recomputes the merged probabilities of its
region, and ``rowsum(dO * O)`` with the merged output ``O`` is exactly the softmax correction term, so
each region's fused backward, called with (dO, O, lse) of its rows, gives exact gradients for q and for
the edge-shifted keys/values; the edge table rows get the sums of those key/value gradients.

With K = 0 there is no band and the right region starts at r = 1 (both edges use table row 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..positions import clip_and_shift

# The CUDA route (memory-efficient attention with log-sum-exp, below) is written but has not run on a GPU yet;
# until a GPU run of tests/test_fast_backends.py flips this, "auto" does not pick "fused" for CUDA tensors
# (backend="fused" still runs it).
CUDA_VERIFIED = False
DEFAULT_TILE = None  # chosen from the band width by default_tile()
CHUNK_ELEMENTS = 1 << 19  # (T, W) tile buffers are processed this many elements at a time (2 MiB in float32)


def default_tile(band: int) -> int:
    """Queries per band tile. Wasted work is (T - 1)/wb of the band; small tiles make slow batched GEMMs and
    more overlap-adds in the backward (ceil(W/T) of them). Single-thread timings of the six band GEMMs at
    N = 2048, D = 64 (wb = 127: T = 32 and 64 tie, T = 64 needs fewer adds; wb = 64: T = 32 best)."""
    return 64 if band >= 96 else 32


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics (max, log-sum-exp) and the band are kept in float32 for 16-bit inputs."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


# ----------------------------------------------------------------------------------------------------
# PyTorch's fused attention: (out, lse) forward and its backward with a given lse.


def _same_head_dim(q, k, v):
    """The fused kernels need D == Dv: zero-pad the smaller side (scores and outputs are unchanged)."""
    d, dv = q.shape[-1], v.shape[-1]
    if d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    elif dv < d:
        v = F.pad(v, (0, d - dv))
    return q, k, v


def _attn_fwd(q, k, v, causal: bool, scale: float):
    """(B,H,n,D),(B,H,m,D),(B,H,m,Dv) -> out (B,H,n,Dv), lse (B,H,n) float32/float64. Top-left causal."""
    dv = v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    if q.is_cuda:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[..., :dv], lse


def _attn_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of the region given the *merged* lse and output of its rows."""
    d, dv = q.shape[-1], v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    if dv < d:
        do, out = F.pad(do, (0, d - dv)), F.pad(out, (0, d - dv))
    if q.is_cuda:
        pad = (-lse.shape[-1]) % 32  # the CUDA kernel stores lse padded to a multiple of 32 rows
        lse = F.pad(lse, (0, pad)).contiguous()
        zero = torch.zeros((), dtype=torch.int64)  # philox seed/offset: unused without dropout
        dq, dk, dvv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, out, lse, zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq[..., :d], dk[..., :d], dvv[..., :dv]


# ----------------------------------------------------------------------------------------------------
# Region bookkeeping.


def region_calls(n: int, m: int, c: int) -> list[tuple[int, int, int, bool]]:
    """The fused calls covering ``{(i, j): j <= i + c}`` inside ``[0, n) x [0, m)``.

    Each call is ``(first_row, first_key, end_key, causal)``: rows ``first_row..n-1`` against keys
    ``first_key..end_key-1``, top-left causal (local row ``i'`` sees local key ``j' <= i'``) or full.
    """
    calls = []
    if m <= 0 or n <= 0:
        return calls
    if c < 0:
        i0 = -c
        if i0 < n:
            calls.append((i0, 0, min(m, n - i0), True))
        return calls
    if c > 0:
        calls.append((0, 0, min(c, m), False))
    if c < m:
        calls.append((0, c, min(m, c + n), True))
    return calls


def _edge(t: torch.Tensor, table: torch.Tensor | None, row: int, *, flip: bool = False) -> torch.Tensor:
    """``t + table[:, row]`` (reversed along L if ``flip``); t (B, H, L, d), table (Hr, 2K+1, d), Hr in {1, H}."""
    if flip:
        t = t.flip(2)
        return t if table is None else t.add_(table[:, row].to(t.dtype)[None, :, None, :])
    return t if table is None else t + table[:, row].to(t.dtype)[None, :, None, :]


def _accumulate(acc: torch.Tensor | None, g: torch.Tensor, lo: int, length: int, dtype) -> torch.Tensor:
    """``acc[:, :, lo:lo+L] += g`` for g (B, H, L, d); a None ``acc`` becomes a fresh (B, H, length, d) tensor,
    zero outside those rows (one write instead of a zero fill and an add)."""
    hi = lo + g.shape[2]
    if acc is None:
        acc = g.new_empty(*g.shape[:2], length, g.shape[3], dtype=dtype)
        acc[:, :, :lo].zero_()
        acc[:, :, hi:].zero_()
        acc[:, :, lo:hi].copy_(g)
    else:
        acc[:, :, lo:hi] += g
    return acc


def _sum_table_grad(g: torch.Tensor, hr: int) -> torch.Tensor:
    """(B, H, ...) -> (Hr, ...): sum over batch, and over heads when the table is shared (Hr = 1)."""
    g = g.sum(0)
    return g.sum(0, keepdim=True) if hr == 1 else g


class _Band:
    """Geometry of the band tiles. Band offsets are ``r_lo .. r_hi`` (``-(K-1) .. K-1``, or ``.. 0`` if causal).

    Rows are cut into tiles of ``T`` queries; tile ``t`` meets a window of ``W = T + wb - 1`` consecutive
    keys, and row ``a`` of the tile meets offset ``r`` at window column ``a + r - r_lo`` (a skewed view).
    Keys live in one flat zero-padded buffer: head ``g`` holds ``Lh = ntp * T`` rows, padded row ``x``
    holding key ``j = x + query_offset + r_lo``. Each head gets ``ntp = nt + ceil((wb-1)/T)`` tiles (the
    last ones are empty rows), so that *every* window is ``flat[g*T : g*T + W]`` for one flat tile index
    ``g``: a single strided view that ``bmm`` reads without copying.
    """

    def __init__(self, b: int, h: int, n: int, m: int, kk: int, query_offset: int, is_causal: bool, tile: int,
                 device):
        self.b, self.h, self.n, self.m = b, h, n, m
        self.r_lo, r_hi = -(kk - 1), (0 if is_causal else kk - 1)
        self.wb = r_hi - self.r_lo + 1
        self.tile = t = max(1, min(tile or default_tile(self.wb), n))
        self.nt = -(-n // t)
        self.ntp = self.nt + -(-(self.wb - 1) // t)
        self.w = t + self.wb - 1
        self.lh = self.ntp * t
        self.groups = b * h * self.ntp
        self.x0 = query_offset + self.r_lo
        self.j_lo, self.j_hi = max(0, self.x0), min(m, self.x0 + self.lh)
        r = torch.arange(self.r_lo, r_hi + 1, device=device)
        j = torch.arange(self.lh, device=device)[:, None] + query_offset + r[None, :]
        valid = (j >= 0) & (j < m) & (torch.arange(self.lh, device=device)[:, None] < n)
        # (ntp, T, wb) additive, on the compact band: -inf outside the keys or on an empty row
        self.bias = torch.zeros(self.ntp, t, self.wb, device=device).masked_fill_(
            ~valid.view(self.ntp, t, self.wb), float("-inf"))
        self.rows = clip_and_shift(r, kk)  # table rows of the band offsets (raw offset + K: no clipping inside)

    def _skew(self, tiles: torch.Tensor) -> torch.Tensor:
        """View (..., T, W) contiguous tiles as (..., T, wb): entry (a, c) is tile column a + c."""
        s = tiles.stride()
        return tiles.as_strided((*tiles.shape[:-1], self.wb), (*s[:-2], s[-2] + 1, 1), tiles.storage_offset())

    def skew(self, tiles: torch.Tensor) -> torch.Tensor:
        """(G, T, W) tiles -> (B, H, ntp, T, wb) view of the band."""
        return self._skew(tiles.view(self.b, self.h, self.ntp, self.tile, self.w))

    def pad_rows(self, t: torch.Tensor, scale: float = 1.0, dtype=None) -> torch.Tensor:
        """(B, H, N, d) -> (B, H, ntp*T, d) zero-padded copy, times ``scale``."""
        out = t.new_empty(self.b, self.h, self.lh, t.shape[-1], dtype=dtype or t.dtype)
        torch.mul(t, scale, out=out[:, :, : self.n]) if scale != 1.0 else out[:, :, : self.n].copy_(t)
        out[:, :, self.n :].zero_()
        return out

    def row_tiles(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, H, ntp*T, d) -> (G, T, d) view."""
        return rows.view(self.groups, self.tile, rows.shape[-1])

    def pad_keys(self, t: torch.Tensor, dtype, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, M, d) -> flat (B*H*Lh + W, d) zero-padded buffer (written into ``reuse`` if it has that shape:
        fresh large buffers cost page faults)."""
        d = t.shape[-1]
        shape = (self.b * self.h * self.lh + self.w, d)
        flat = reuse if reuse is not None and reuse.shape == shape else t.new_empty(shape, dtype=dtype)
        heads = flat[: self.b * self.h * self.lh].view(self.b, self.h, self.lh, d)
        a, z = self.j_lo - self.x0, self.j_hi - self.x0
        if a < z:
            heads[:, :, a:z] = t[:, :, self.j_lo : self.j_hi]
            heads[:, :, :a].zero_()
            heads[:, :, z:].zero_()
        else:
            heads.zero_()
        flat[self.b * self.h * self.lh :].zero_()
        return flat

    def windows(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat padded keys -> (G, W, d) strided view: the key window of every tile."""
        d = flat.shape[-1]
        return flat.as_strided((self.groups, self.w, d), (self.tile * d, d, 1), flat.storage_offset())

    def chunks(self) -> list[tuple[int, int]]:
        """Tile ranges ``[g0, g1)`` for the (T, W) tile buffers: a small buffer reused chunk after chunk stays in
        cache and costs no page faults, unlike one (G, T, W) tensor per step."""
        step = max(1, CHUNK_ELEMENTS // (self.tile * self.w))
        return [(g0, min(self.groups, g0 + step)) for g0 in range(0, self.groups, step)]

    def add_band_scores(self, band: torch.Tensor, rows: torch.Tensor, flat: torch.Tensor) -> None:
        """``band`` (G, T, wb) += the band of ``rows`` (G, T, d) times the key windows of ``flat``, transposed."""
        wins = self.windows(flat)
        buf = None
        for g0, g1 in self.chunks():
            if buf is None:
                buf = band.new_empty(g1 - g0, self.tile, self.w)
            t = buf[: g1 - g0]
            torch.bmm(rows[g0:g1], wins[g0:g1].transpose(1, 2), out=t)
            band[g0:g1] += self._skew(t)

    def band_products(self, band: torch.Tensor, *, flat: torch.Tensor | None = None,
                      out_rows: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      out_windows: torch.Tensor | None = None) -> None:
        """With ``P`` the (G, T, W) tiles of the band (G, T, wb), zero off the band: ``out_rows`` (G, T, d) =
        ``P @ windows(flat)`` and/or ``out_windows`` (G, W, d) = ``P^T @ rows`` (rows (G, T, d))."""
        buf = band.new_zeros(min(self.groups, self.chunks()[0][1]), self.tile, self.w)
        wins = self.windows(flat) if flat is not None else None
        for g0, g1 in self.chunks():
            t = buf[: g1 - g0]
            self._skew(t).copy_(band[g0:g1])  # the off-band entries of the buffer stay zero
            if out_rows is not None:
                torch.bmm(t, wins[g0:g1], out=out_rows[g0:g1])
            if out_windows is not None:
                torch.bmm(t.transpose(1, 2), rows[g0:g1], out=out_windows[g0:g1])

    def fold_into(self, xw: torch.Tensor, dest: torch.Tensor, alpha: float = 1.0,
                  reuse: torch.Tensor | None = None) -> torch.Tensor:
        """Adjoint of :meth:`windows`: overlap-add (G, W, d) window gradients onto ``dest`` (B, H, M, d).

        Windows start every T rows and span ``ceil(W / T)`` blocks of T, so it is that many shifted adds.
        Returns the work buffer (pass it back as ``reuse``).
        """
        g, t, d = self.groups, self.tile, xw.shape[-1]
        nb = -(-self.w // t)
        shape = (g + nb - 1, t, d)
        out = reuse if reuse is not None and reuse.shape == shape else xw.new_empty(shape)
        out[:g].copy_(xw[:, :t])
        out[g:].zero_()
        for u in range(1, nb):
            width = min(t, self.w - u * t)
            out[u : u + g, :width] += xw[:, u * t : u * t + width]
        a, z = self.j_lo - self.x0, self.j_hi - self.x0
        if a < z:
            heads = out.view(-1, d)[: self.b * self.h * self.lh].view(self.b, self.h, self.lh, d)
            dest[:, :, self.j_lo : self.j_hi].add_(heads[:, :, a:z].to(dest.dtype), alpha=alpha)
        return out


# ----------------------------------------------------------------------------------------------------
# Forward and backward.


def _regions(n, m, kk, query_offset, is_causal):
    """[(side, calls)] with side 0 (far left, table row 0) and 1 (far right, row 2K, reversed sequences)."""
    out = [(0, region_calls(n, m, query_offset - kk))]
    if not is_causal:
        out.append((1, region_calls(n, m, m - n - query_offset - max(kk, 1))))
    return out


def fused_forward(q, k, v, rel_k, rel_v, *, max_relative_position: int, is_causal: bool, scale: float,
                  query_offset: int, tile: int | None = DEFAULT_TILE):
    """Forward. Returns ``out`` (B, H, N, Dv), ``lse`` (B, H, N) and the band weights (B, H, N, wb).

    ``wb = band_width(K, is_causal)`` (0 without a band): entry (i, c) is the weight of offset
    ``c - (K - 1)``. ``lse`` and the band weights are float32 for 16-bit inputs.
    Rows with no key give zeros and lse -inf.
    """
    kk = max_relative_position
    b, h, n, _ = q.shape
    m, dv = k.shape[2], v.shape[3]
    sdt = stats_dtype(q.dtype)
    parts = []  # (lse (B,H,N) in original row order, -inf outside the part; out rows; first row; side)
    for side, calls in _regions(n, m, kk, query_offset, is_causal):
        if not calls:
            continue
        row = 0 if side == 0 else 2 * kk
        qs = q if side == 0 else q.flip(2)
        ke, ve = _edge(k, rel_k, row, flip=side == 1), _edge(v, rel_v, row, flip=side == 1)
        for i0, j0, j1, causal in calls:
            o, lse = _attn_fwd(qs[:, :, i0:], ke[:, :, j0:j1], ve[:, :, j0:j1], causal, scale)
            full = lse.new_full((b, h, n), float("-inf"), dtype=sdt)
            if side == 0:
                full[:, :, i0:] = lse
            else:
                full[:, :, : n - i0] = lse.flip(2)
            parts.append((full, o, i0, side))

    g = _Band(b, h, n, m, kk, query_offset, is_causal, tile, q.device) if kk >= 1 and m > 0 and n > 0 else None
    lse_parts = [p[0] for p in parts]
    if g is not None:
        qrows = g.pad_rows(q, scale, sdt)
        keys = g.pad_keys(k, sdt)
        # The softmax runs on the compact band (B, H, ntp, T, wb): only wb of the W tile columns.
        if rel_k is not None:
            sb = (qrows @ rel_k[:, g.rows].to(sdt).transpose(-1, -2)).view(b, h, g.ntp, g.tile, g.wb)
        else:
            sb = qrows.new_zeros(b, h, g.ntp, g.tile, g.wb)
        g.add_band_scores(sb.view(g.groups, g.tile, g.wb), g.row_tiles(qrows), keys)
        sb.add_(g.bias.to(sdt))
        peak = sb.amax(-1)
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        sb.sub_(peak[..., None]).exp_()
        sb = sb.view(b, h, g.lh, g.wb)
        peak = peak.view(b, h, g.lh)
        lse_parts.append((peak + torch.log(sb.sum(-1)))[:, :, :n])

    if not lse_parts:
        lse = q.new_full((b, h, n), float("-inf"), dtype=sdt)
    elif len(lse_parts) == 1:
        lse = lse_parts[0]
    else:
        lse = torch.logsumexp(torch.stack(lse_parts), 0)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    out = None
    for part_lse, o, i0, side in parts:
        alpha = torch.exp(part_lse - lse_safe)[..., None]
        if side == 0:
            if out is None:  # the first part writes its rows directly: no zero fill, no add
                out = q.new_empty(b, h, n, dv, dtype=sdt)
                out[:, :, :i0].zero_()
                torch.mul(alpha[:, :, i0:], o, out=out[:, :, i0:])
                continue
            out[:, :, i0:] += alpha[:, :, i0:] * o
        else:
            if out is None:
                out = q.new_zeros(b, h, n, dv, dtype=sdt)
            out[:, :, : n - i0].addcmul_(alpha[:, :, : n - i0], o.flip(2))
    if out is None:
        out = q.new_zeros(b, h, n, dv, dtype=sdt)
    if g is not None:
        factor = torch.exp(peak[:, :, :n] - lse_safe)
        sb[:, :, :n].mul_(factor[..., None])  # the band's share of the weights (empty rows are already 0)
        band_out = qrows.new_empty(g.groups, g.tile, dv)
        g.band_products(sb.view(g.groups, g.tile, g.wb), flat=g.pad_keys(v, sdt, reuse=keys), out_rows=band_out)
        out += band_out.view(b, h, g.lh, dv)[:, :, :n]
        # (B, H, N, wb): a shape simple in N, so that export with a dynamic length needs no guard on the tiling
        band = sb[:, :, :n].contiguous()
        if rel_v is not None:
            out += band @ rel_v[:, g.rows].to(sdt)
    else:
        band = q.new_zeros(b, h, n, band_width(kk, is_causal) if m > 0 and n > 0 else 0, dtype=sdt)
    return out.to(q.dtype), lse, band


def band_width(max_relative_position: int, is_causal: bool) -> int:
    """Number of band offsets per row: ``2K - 1`` (``K`` if causal); 0 when K = 0."""
    kk = max_relative_position
    return 0 if kk == 0 else (kk if is_causal else 2 * kk - 1)


def fused_backward(grad_out, q, k, v, rel_k, rel_v, out, lse, band, *, max_relative_position: int,
                   is_causal: bool, scale: float, query_offset: int, tile: int | None = DEFAULT_TILE):
    """Gradients (dq, dk, dv, d_rel_k | None, d_rel_v | None) from the forward's ``out``, ``lse``, band weights."""
    kk = max_relative_position
    b, h, n, d = q.shape
    m = k.shape[2]
    sdt = stats_dtype(q.dtype)
    grad_out = grad_out.contiguous()
    lse = lse.contiguous()
    dq = dk = dvv = None  # the first region's gradients are written in place, the others added
    drk = torch.zeros(rel_k.shape, dtype=sdt, device=q.device) if rel_k is not None else None
    drv = torch.zeros(rel_v.shape, dtype=sdt, device=q.device) if rel_v is not None else None

    for side, calls in _regions(n, m, kk, query_offset, is_causal):
        if not calls:
            continue
        row = 0 if side == 0 else 2 * kk
        if side == 0:
            qs, dos, outs, lses = q, grad_out, out, lse
        else:
            qs, dos, outs, lses = (t.flip(2) for t in (q, grad_out, out, lse))
        ke, ve = _edge(k, rel_k, row, flip=side == 1), _edge(v, rel_v, row, flip=side == 1)
        for i0, j0, j1, causal in calls:
            gq, gk, gv = _attn_bwd(dos[:, :, i0:], qs[:, :, i0:], ke[:, :, j0:j1], ve[:, :, j0:j1],
                                   outs[:, :, i0:], lses[:, :, i0:].contiguous(), causal, scale)
            if drk is not None:
                drk[:, row] += _sum_table_grad(gk.sum(2), drk.shape[0])
            if drv is not None:
                drv[:, row] += _sum_table_grad(gv.sum(2), drv.shape[0])
            if side == 0:
                dq = _accumulate(dq, gq, i0, n, sdt)
                dk = _accumulate(dk, gk, j0, m, sdt)
                dvv = _accumulate(dvv, gv, j0, m, sdt)
            else:
                dq = _accumulate(dq, gq.flip(2), 0, n, sdt)
                dk = _accumulate(dk, gk.flip(2), m - j1, m, sdt)
                dvv = _accumulate(dvv, gv.flip(2), m - j1, m, sdt)
    dq, dk, dvv = (torch.zeros(x.shape, dtype=sdt, device=x.device) if g is None else g
                   for g, x in ((dq, q), (dk, k), (dvv, v)))

    if kk >= 1 and m > 0 and n > 0:
        g = _Band(b, h, n, m, kk, query_offset, is_causal, tile, q.device)
        do_rows = g.pad_rows(grad_out, 1.0, sdt)
        keys = g.pad_keys(v, sdt)
        # Elementwise work on the band only (wb of the W tile columns): ds = p * (dp - dg) in compact form.
        if rel_v is not None:
            dp_band = (do_rows @ rel_v[:, g.rows].to(sdt).transpose(-1, -2)).view(g.groups, g.tile, g.wb)
        else:
            dp_band = do_rows.new_zeros(g.groups, g.tile, g.wb)
        do_tiles = g.row_tiles(do_rows)
        g.add_band_scores(dp_band, do_tiles, keys)
        dg = F.pad((grad_out.to(sdt) * out.to(sdt)).sum(-1), (0, g.lh - n))
        p_band = g.pad_rows(band).view(g.groups, g.tile, g.wb)
        ds_band = dp_band.sub_(dg.view(g.groups, g.tile, 1)).mul_(p_band)  # dL/d(scaled score)
        xw = do_rows.new_empty(g.groups, g.w, do_rows.shape[-1])
        g.band_products(p_band, rows=do_tiles, out_windows=xw)
        work = g.fold_into(xw, dvv)
        qrows = g.pad_rows(q, 1.0, sdt)
        if xw.shape[-1] != d:
            xw = qrows.new_empty(g.groups, g.w, d)
        dq_tiles = qrows.new_empty(g.groups, g.tile, d)
        g.band_products(ds_band, flat=g.pad_keys(k, sdt, reuse=keys), out_rows=dq_tiles, rows=g.row_tiles(qrows),
                        out_windows=xw)
        dq.add_(dq_tiles.view(b, h, g.lh, d)[:, :, :n], alpha=scale)  # `scale` goes into the adds
        g.fold_into(xw, dk, scale, reuse=work)
        ds_band = ds_band.view(b, h, g.lh, g.wb)
        if rel_k is not None:
            dq.add_((ds_band @ rel_k[:, g.rows].to(sdt))[:, :, :n], alpha=scale)
            drk[:, g.rows] += _sum_table_grad(ds_band.transpose(-1, -2) @ qrows, drk.shape[0]) * scale
        if rel_v is not None:
            drv[:, g.rows] += _sum_table_grad(band.transpose(-1, -2) @ grad_out.to(sdt), drv.shape[0])

    return tuple(t.to(q.dtype) if t is not None else None for t in (dq, dk, dvv, drk, drv))
