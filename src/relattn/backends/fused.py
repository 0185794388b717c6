"""The "fused" kernels: exact Shaw attention on top of PyTorch's own fused attention (no autograd here).

Notation: ``B`` batch, ``H`` heads, ``N`` queries, ``M`` keys, ``D``/``Dv`` head dims, ``K`` max relative
position, ``p_i = i + query_offset`` the absolute position of query ``i``, ``r = j - p_i`` the raw offset.

Beyond the band ``|r| < K`` the clipped index is constant on each side, so the relative terms fold into
the keys and values:

* far left, ``r <= -K``:  ``s_ij = q_i . (k_j + a^K_{-K})``, value ``v_j + a^V_{-K}``;
* far right, ``r >= K``:   ``s_ij = q_i . (k_j + a^K_{+K})``, value ``v_j + a^V_{+K}``;
* band, ``|r| < K``:        ``s_ij = q_i . (k_j + a^K_r)``, value ``v_j + a^V_r`` (2K-1 keys per row).

Subtracting one vector from every row of the key table shifts each row's scores by a constant, which the
softmax ignores; the kernels use ``a^K_r - a^K_{-K}``, so the far-left region needs no key copy at all.
(The log-sum-exp they return is relative to that shift: it is only for their own backward.)

The far-left region is ``j <= i + c`` with ``c = query_offset - K``: ordinary causal attention on
shifted slices, computed by PyTorch's fused kernel, which also returns the log-sum-exp. The far-right
region is the same on the reversed sequences. The band is computed per tile of ``T`` queries against
its ``W = T + wb - 1`` key window (``wb = 2K - 1`` offsets, or ``K`` when causal), a few tiles at a time so
that every intermediate stays in cache: the tile's scores come from one batched GEMM, the relative key
term from one GEMM on the compact band (``q_i . a^K_r`` for the ``wb`` offsets), and a skewed view of the
(T, W) tile puts entry ``(i, r)`` of the band next to it without any gather. The softmax runs on the
compact band, already merged with the far regions' log-sum-exp (those are computed first), so each chunk
leaves its final band weights and its share of the output. The heads are processed in groups, so that
the temporaries of the far regions stay O(N (D + K)) per group: no (N, M) tensor is built.

Backward: with the *merged* log-sum-exp, the fused backward recomputes the merged probabilities of its
region, and ``rowsum(dO * O)`` with the merged output ``O`` is exactly the softmax correction term, so
each region's fused backward, called with (dO, O, lse) of its rows, gives exact gradients for q and for
the edge-shifted keys/values; the edge table rows get the sums of those key/value gradients. The band's
backward runs chunk by chunk like its forward, from the saved band weights.

Masks (CPU): PyTorch's CPU kernel adds an additive mask to its scores; each region call gets the slice of
its rows and keys (the reversed mask on the right), and the band gathers its (row, offset) entries. A row
whose keys in one region are all masked comes back from that kernel with lse 0, so those rows are found
from the mask (counts of unmasked keys) and their lse set to -inf before the merge.

With K = 0 there is no band and the right region starts at r = 1 (both edges use table row 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The CUDA route (memory-efficient attention with log-sum-exp, below) is written but has not run on a GPU yet;
# until a GPU run of tests/test_fast_backends.py flips this, "auto" does not pick "fused" for CUDA tensors
# (backend="fused" still runs it).
CUDA_VERIFIED = False
DEFAULT_TILE = None  # chosen from the band width by default_tile()
CHUNK_ELEMENTS = 1 << 19  # band tiles are processed this many (T, W) elements at a time (2 MiB in float32)
GROUP_ELEMENTS = 1 << 20  # heads are processed in groups of about this many (N, D) elements per tensor (4 MiB)


def default_tile(band: int) -> int:
    """Queries per band tile. Wasted work is (T - 1)/wb of the band; small tiles make slow batched GEMMs.
    Single-thread timings of the band GEMMs at N = 2048, D = 64 (wb = 127: T = 32 and 64 tie; wb = 64:
    T = 32 best)."""
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


def _attn_fwd(q, k, v, causal: bool, scale: float, mask=None):
    """(B,H,n,D),(B,H,m,D),(B,H,m,Dv) -> out (B,H,n,Dv), lse (B,H,n) float32/float64. Top-left causal;
    ``mask`` (CPU only) an additive mask broadcastable to (B,H,n,m). A row whose keys are all masked gives
    out 0 and lse 0 (not -inf): callers that merge must know which rows those are."""
    dv = v.shape[-1]
    q, k, v = _same_head_dim(q, k, v)
    if q.is_cuda:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., : q.shape[2]]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                               scale=scale)
    return out[..., :dv], lse


def _attn_bwd(do, q, k, v, out, lse, causal: bool, scale: float, mask=None):
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
            do, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
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


def _kernel_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """PyTorch's CPU kernel reads each mask row as contiguous keys: make the last dim contiguous if it is not."""
    if mask is None or mask.shape[-1] == 1 or mask.stride(-1) == 1:
        return mask
    return mask.contiguous()


def band_width(max_relative_position: int, is_causal: bool) -> int:
    """Number of band offsets per row: ``2K - 1`` (``K`` if causal); 0 when K = 0."""
    kk = max_relative_position
    return 0 if kk == 0 else (kk if is_causal else 2 * kk - 1)


def _regions(n, m, kk, query_offset, is_causal):
    """[(side, calls)] with side 0 (far left, table row 0) and 1 (far right, row 2K, reversed sequences)."""
    out = [(0, region_calls(n, m, query_offset - kk))]
    if not is_causal:
        out.append((1, region_calls(n, m, m - n - query_offset - max(kk, 1))))
    return out


def head_groups(bh: int, n: int, width: int, heads: int | None = None) -> list[tuple[int, int]]:
    """Ranges of the B*H flattened heads processed together: about GROUP_ELEMENTS (N, D) elements per tensor,
    and at least as many heads as threads (PyTorch's CPU fused backward parallelises over heads). With
    ``heads`` (H), no range crosses from one batch entry to the next (so a mask slices without copies)."""
    size = max(1, GROUP_ELEMENTS // max(1, n * width))
    size = min(bh, max(size, torch.get_num_threads()))
    if heads is None:
        return [(f0, min(bh, f0 + size)) for f0 in range(0, bh, size)]
    size = min(size, heads)
    return [(b + h0, b + min(heads, h0 + size)) for b in range(0, bh, heads) for h0 in range(0, heads, size)]


def _group_mask(mask: torch.Tensor | None, f0: int, f1: int, h: int) -> torch.Tensor | None:
    """(Bm, Hm, Nm, Mm) additive mask -> (1, Hm', Nm, Mm) view for the heads f0..f1-1 of one batch entry."""
    if mask is None:
        return None
    b, h0 = divmod(f0, h)
    g = mask[b if mask.shape[0] > 1 else 0][None]
    return g[:, h0 : h0 + f1 - f0] if g.shape[1] > 1 else g


def _rows_with_keys(mask: torch.Tensor, i0: int, j0: int, j1: int, causal: bool, n: int) -> torch.Tensor:
    """(Hm, n - i0) bool: whether rows i0.. of a region call have an unmasked key (``mask`` (1, Hm, Nm, Mm) in
    the call's coordinates; the call's row i sees keys j0 .. j1-1, or only up to j0 + i - i0 if causal)."""
    fin = torch.isfinite(mask[0])
    m = j1 if fin.shape[-1] == 1 else fin.shape[-1]
    fin = fin.expand(*fin.shape[:2], m)
    count = F.pad(torch.cumsum(fin, -1, dtype=torch.int32), (1, 0))  # count[.., x] = unmasked keys before x
    rows = torch.arange(i0, n, device=mask.device)
    hi = (j0 + rows - i0 + 1).clamp_(max=j1) if causal else torch.full_like(rows, j1)
    if count.shape[1] > 1:
        count = count[:, i0:]
        hi = hi[None, :, None].expand(count.shape[0], -1, 1)
        return (count.gather(-1, hi)[..., 0] - count[:, :, j0]) > 0
    return (count[:, 0, hi] - count[:, 0, j0 : j0 + 1]) > 0


def _flip_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask of the reversed sequences (rows and keys reversed)."""
    if mask is None:
        return None
    dims = [d for d in (2, 3) if mask.shape[d] > 1]
    return mask.flip(dims) if dims else mask


def _call_mask(mask: torch.Tensor | None, i0: int, j0: int, j1: int) -> torch.Tensor | None:
    """The mask of one region call: rows i0.., keys j0..j1-1 (broadcast dims stay size 1)."""
    if mask is None:
        return None
    if mask.shape[2] > 1:
        mask = mask[:, :, i0:]
    return mask[..., j0:j1] if mask.shape[3] > 1 else mask


def _group_rows(table: torch.Tensor | None, f0: int, f1: int, h: int, dtype) -> torch.Tensor | None:
    """(Hr, R, d) table -> (f1 - f0, R, d): the rows of flattened heads f0..f1-1 (head = index mod H)."""
    if table is None:
        return None
    table = table.to(dtype)
    if table.shape[0] == 1:
        return table.expand(f1 - f0, *table.shape[1:])
    return table[torch.arange(f0, f1, device=table.device) % h]


def _edge(t: torch.Tensor, rows: torch.Tensor | None, *, flip: bool = False) -> torch.Tensor:
    """``t + rows`` per head (reversed along L if ``flip``); t (1, hc, L, d), rows (hc, d) or None."""
    if flip:
        t = t.flip(2)
        return t if rows is None else t.add_(rows.to(t.dtype)[None, :, None, :])
    return t if rows is None else t + rows.to(t.dtype)[None, :, None, :]


def _side_inputs(side: int, q4, k4, v4, tk, tv, kk: int, mask):
    """(q, k, v, mask) of one far region for a head group (1, hc, L, d): side 0 as they are (the shifted key
    table's row -K is zero, so the keys need no copy; the values get a^V_{-K}), side 1 reversed, with the
    edge rows a^K_{+K}, a^V_{+K} added."""
    if side == 0:
        return q4, k4, _edge(v4, None if tv is None else tv[:, 0]), mask
    return (q4.flip(2), _edge(k4, None if tk is None else tk[:, 2 * kk], flip=True),
            _edge(v4, None if tv is None else tv[:, 2 * kk], flip=True), _flip_mask(mask))


class _Band:
    """Geometry of the band tiles for one group of ``hc`` heads. Band offsets are ``r_lo .. r_hi``
    (``-(K-1) .. K-1``, or ``.. 0`` if causal), table rows ``1 .. wb``.

    Rows are cut into ``nt`` tiles of ``T`` queries; tile ``t`` meets a window of ``W = T + wb - 1``
    consecutive keys, and row ``a`` of the tile meets offset ``r`` at window column ``a + r - r_lo`` (the
    skewed view). Keys live in one flat zero-padded buffer: head ``g`` holds ``Lh = ntp * T`` rows, padded row
    ``x`` holding key ``j = x + query_offset + r_lo``, with ``ntp = nt + ceil((wb-1)/T)`` so that every window
    is ``flat[f*T : f*T + W]`` for the flat tile index ``f = g * ntp + t``: one strided view that ``bmm``
    reads without copying.
    """

    def __init__(self, hc: int, n: int, m: int, kk: int, query_offset: int, is_causal: bool, tile: int | None,
                 device):
        self.hc, self.n, self.m = hc, n, m
        self.r_lo, r_hi = -(kk - 1), (0 if is_causal else kk - 1)
        self.wb = r_hi - self.r_lo + 1
        self.tile = t = max(1, min(tile or default_tile(self.wb), n))
        self.nt = -(-n // t)
        self.ntp = self.nt + -(-(self.wb - 1) // t)
        self.w = t + self.wb - 1
        self.nb = -(-self.w // t)  # tile blocks a window spans
        self.lh = self.ntp * t
        self.x0 = query_offset + self.r_lo
        self.j_lo, self.j_hi = max(0, self.x0), min(m, self.x0 + self.lh)
        self.step = max(1, CHUNK_ELEMENTS // (t * self.w))
        self.query_offset, self.r_hi, self.device = query_offset, r_hi, device
        self.edges = self._edge_tiles()
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def _edge_tiles(self) -> tuple[int, int]:
        """Tiles ``[0, lead)`` meet keys before 0; tiles ``[trail, nt)`` keys past M or rows past N."""
        t, off = self.tile, self.query_offset
        lead = min(self.nt, max(0, -(-(-off - self.r_lo) // t)))
        trail_m = -(-(self.m - off - self.r_hi + 1) // t) - 1
        return lead, max(0, min(self.nt, trail_m, self.n // t))

    def _keys(self, row0: int, row1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``row0..row1-1`` as a column, and the key ``j`` each meets at every band offset."""
        rows = torch.arange(row0, row1, device=self.device)[:, None]
        return rows, rows + self.query_offset + torch.arange(self.r_lo, self.r_hi + 1, device=self.device)

    def add_bias(self, sc: torch.Tensor, t0: int, t1: int) -> None:
        """``sc`` (c, T, wb) scores of tiles t0..t1-1 get -inf where the key or the row does not exist."""
        lead, trail = self.edges
        for a, b in {(t0, min(t1, lead)), (max(t0, trail), t1)}:
            if a < b:
                if (a, b) not in self._masks:  # the same for every head
                    rows, j = self._keys(a * self.tile, b * self.tile)
                    self._masks[a, b] = ((j < 0) | (j >= self.m) | (rows >= self.n)).view(b - a, self.tile, self.wb)
                sc[a - t0 : b - t0].masked_fill_(self._masks[a, b], float("-inf"))

    def add_mask(self, sc: torch.Tensor, mask: torch.Tensor, g: int, r0: int, r1: int) -> None:
        """``sc`` (c, T, wb) += the additive mask (1, Hm, Nm, Mm) at the band entries of rows r0..r1-1, head g
        (entries whose key does not exist read a clamped key: add_bias makes them -inf after this)."""
        rows = mask[0, g if mask.shape[1] > 1 else 0]
        rows = rows[r0:r1] if rows.shape[0] > 1 else rows
        flat = sc.view(-1, self.wb)[: r1 - r0]
        if rows.shape[1] == 1:
            flat += rows.to(sc.dtype)
            return
        j = self._keys(r0, r1)[1].clamp_(0, self.m - 1)
        flat += rows.expand(r1 - r0, -1).gather(1, j).to(sc.dtype)

    def chunks(self):
        """(head, first tile, end tile, flat index of the first tile, first row, end row) of every chunk."""
        for g in range(self.hc):
            for t0 in range(0, self.nt, self.step):
                t1 = min(self.nt, t0 + self.step)
                yield g, t0, t1, g * self.ntp + t0, t0 * self.tile, min(t1 * self.tile, self.n)

    def skew(self, tiles: torch.Tensor) -> torch.Tensor:
        """View (c, T, W) contiguous tiles as (c, T, wb): entry (a, o) is tile column a + o."""
        s = tiles.stride()
        return tiles.as_strided((*tiles.shape[:-1], self.wb), (s[0], s[1] + 1, 1), tiles.storage_offset())

    def pad_rows(self, t: torch.Tensor, dtype) -> torch.Tensor:
        """(hc, N, d) -> (hc, tiles, T, d), zero past row N (index it [head, t0:t1]): a view when N fills whole
        tiles and ``t`` is contiguous in ``dtype``, else a padded copy."""
        d = t.shape[-1]
        if self.n == self.nt * self.tile and t.dtype == dtype and t.is_contiguous():
            return t.view(self.hc, self.nt, self.tile, d)
        out = t.new_empty(self.hc, self.nt * self.tile, d, dtype=dtype)
        out[:, : self.n].copy_(t)
        out[:, self.n :].zero_()
        return out.view(self.hc, self.nt, self.tile, d)

    def pad_keys(self, t: torch.Tensor, dtype, scale: float = 1.0) -> torch.Tensor:
        """(hc, M, d) -> flat (hc*Lh + W, d) zero-padded buffer, times ``scale``."""
        d = t.shape[-1]
        flat = t.new_empty(self.hc * self.lh + self.w, d, dtype=dtype)
        heads = flat[: self.hc * self.lh].view(self.hc, self.lh, d)
        a, z = self.j_lo - self.x0, self.j_hi - self.x0
        if a < z:
            src = t[:, self.j_lo : self.j_hi]
            torch.mul(src, scale, out=heads[:, a:z]) if scale != 1.0 else heads[:, a:z].copy_(src)
            heads[:, :a].zero_()
            heads[:, z:].zero_()
        else:
            heads.zero_()
        flat[self.hc * self.lh :].zero_()
        return flat

    def windows(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat padded keys -> (hc * ntp, W, d) strided view: the key window of every tile."""
        d = flat.shape[-1]
        return flat.as_strided((self.hc * self.ntp, self.w, d), (self.tile * d, d, 1), flat.storage_offset())

    def fold(self, flat_grad: torch.Tensor, f0: int, xw: torch.Tensor) -> None:
        """Adjoint of :meth:`windows` for the tiles ``f0 .. f0 + c - 1``: overlap-add their (c, W, d) window
        gradients into a flat (hc*ntp + nb, T, d) buffer (``nb`` shifted adds of tile blocks)."""
        c, t = xw.shape[0], self.tile
        for u in range(self.nb):
            width = min(t, self.w - u * t)
            flat_grad[f0 + u : f0 + u + c, :width] += xw[:, u * t : u * t + width]

    def unpad_keys(self, flat_grad: torch.Tensor, dest: torch.Tensor, alpha: float = 1.0) -> None:
        """``dest`` (hc, M, d) += ``alpha`` times the key rows of a flat gradient buffer."""
        a, z = self.j_lo - self.x0, self.j_hi - self.x0
        if a < z:
            heads = flat_grad.view(-1, dest.shape[-1])[: self.hc * self.lh].view(self.hc, self.lh, -1)
            dest[:, self.j_lo : self.j_hi].add_(heads[:, a:z].to(dest.dtype), alpha=alpha)


def _far_forward(q4, k4, v4, tk, tv, kk, query_offset, is_causal, scale, sdt, mask=None):
    """The far regions of one head group: [(lse (hc, N) with -inf outside the part, out rows, first row, side)]."""
    hc, n, m = q4.shape[1], q4.shape[2], k4.shape[2]
    parts = []
    for side, calls in _regions(n, m, kk, query_offset, is_causal):
        if not calls:
            continue
        qs, ks, vs, ms = _side_inputs(side, q4, k4, v4, tk, tv, kk, mask)
        for i0, j0, j1, causal in calls:
            o, lse = _attn_fwd(qs[:, :, i0:], ks[:, :, j0:j1], vs[:, :, j0:j1], causal, scale,
                               _call_mask(ms, i0, j0, j1))
            lse = lse[0]
            if ms is not None:  # rows whose keys here are all masked: lse -inf, not the kernel's 0
                lse = lse.masked_fill(~_rows_with_keys(ms, i0, j0, j1, causal, n), float("-inf"))
            full = lse.new_full((hc, n), float("-inf"), dtype=sdt)
            if side == 0:
                full[:, i0:] = lse
            else:
                full[:, : n - i0] = lse.flip(1)
            parts.append((full, o[0], i0, side))
    return parts


def _add_far(out_rows, parts, safe, g, r0: int, r1: int, n: int) -> None:
    """``out_rows`` (rows r0..r1-1 of head(s) ``g``, Dv) += each far part's rows weighted by its share
    ``exp(lse_part - lse)``; ``safe`` is the merged lse of those rows with -inf as 0, ``g`` a head index or
    ``slice(None)``."""
    for part_lse, o, i0, side in parts:
        lo, hi = (max(r0, i0), r1) if side == 0 else (r0, min(r1, n - i0))
        if lo >= hi:
            continue
        alpha = torch.exp(part_lse[g, lo:hi] - safe[..., lo - r0 : hi - r0])[..., None]
        rows = o[g, lo - i0 : hi - i0] if side == 0 else o[g, n - hi - i0 : n - lo - i0].flip(-2)
        out_rows[..., lo - r0 : hi - r0, :].addcmul_(alpha, rows)


def _band_forward(geo, q, k, v, tk, tv, parts, lse_far, out, lse, band, scale, sdt, mask=None):
    """Band of one head group, chunk by chunk: final band weights into ``band`` (hc, N, wb), merged log-sum-exp
    into ``lse`` (hc, N), and the output rows into ``out`` (hc, N, Dv): the band's share plus the far parts'."""
    t, wb, n = geo.tile, geo.wb, geo.n
    qt = geo.pad_rows(q, sdt)
    kwin = geo.windows(geo.pad_keys(k, sdt, scale))  # the softmax scale rides on the keys and the key table
    vwin = geo.windows(geo.pad_keys(v, sdt))
    rows_k = (tk[:, 1 : 1 + wb] * scale).transpose(1, 2) if tk is not None else None  # (hc, D, wb)
    rows_v = tv[:, 1 : 1 + wb] if tv is not None else None  # (hc, wb, Dv)
    far = F.pad(lse_far, (0, geo.nt * t - n), value=float("-inf"))
    scores = qt.new_empty(geo.step, t, geo.w)
    probs = qt.new_zeros(geo.step, t, geo.w)  # only its band entries are ever written: the rest stays zero
    compact = qt.new_empty(geo.step, t, wb)
    part = qt.new_empty(geo.step, t, out.shape[-1])
    for g, t0, t1, f0, r0, r1 in geo.chunks():
        c, rr = t1 - t0, r1 - r0
        st, sc, pt, ob = scores[:c], compact[:c], probs[:c], part[:c]
        qs = qt[g, t0:t1]
        torch.bmm(qs, kwin[f0 : f0 + c].transpose(1, 2), out=st)
        if rows_k is not None:
            torch.mm(qs.reshape(c * t, -1), rows_k[g], out=sc.view(c * t, wb))
            sc += geo.skew(st)
        else:
            sc.copy_(geo.skew(st))
        if mask is not None:
            geo.add_mask(sc, mask, g, r0, r1)
        geo.add_bias(sc, t0, t1)
        peak = sc.amax(-1)
        peak = peak.nan_to_num_(0.0, 0.0, 0.0)  # a row with no key: -inf -> 0
        sc.sub_(peak[..., None]).exp_()
        merged = torch.logaddexp(peak + torch.log(sc.sum(-1)), far[g, t0 * t : t1 * t].view(c, t))
        safe = merged.nan_to_num(0.0, 0.0, 0.0)
        sc.mul_(torch.exp(peak - safe)[..., None])  # final band weights
        geo.skew(pt).copy_(sc)
        torch.bmm(pt, vwin[f0 : f0 + c], out=ob)
        ob = ob.view(c * t, -1)
        if rows_v is not None:
            ob.addmm_(sc.view(c * t, wb), rows_v[g])
        _add_far(ob, parts, safe.view(-1), g, r0, r1, n)  # the far parts of these rows
        band[g, r0:r1] = sc.view(c * t, wb)[:rr]
        lse[g, r0:r1] = merged.view(-1)[:rr]
        out[g, r0:r1] = ob[:rr]


def fused_forward(q, k, v, rel_k, rel_v, *, max_relative_position: int, is_causal: bool, scale: float,
                  query_offset: int, mask: torch.Tensor | None = None, tile: int | None = DEFAULT_TILE):
    """Forward. Returns ``out`` (B, H, N, Dv), ``lse`` (B, H, N) and the band weights (B, H, N, wb).

    ``wb = band_width(K, is_causal)`` (0 without a band or keys): entry (i, c) is the weight of offset
    ``c - (K - 1)``. ``lse`` (relative to the shifted key table) and the band weights are float32 for
    16-bit inputs. Rows with no key give zeros and lse -inf.
    """
    kk = max_relative_position
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[3]
    sdt = stats_dtype(q.dtype)
    bh = b * h
    wb = band_width(kk, is_causal) if m > 0 and n > 0 else 0
    out = q.new_empty(bh, n, dv)
    lse = q.new_empty(bh, n, dtype=sdt)
    band = q.new_empty(bh, n, wb, dtype=sdt)
    qf, kf, vf = (t.reshape(bh, *t.shape[2:]) for t in (q, k, v))
    shifted_k = rel_k - rel_k[:, :1] if rel_k is not None else None
    mask = _kernel_mask(mask)
    for f0, f1 in head_groups(bh, n, max(d, dv), None if mask is None else h):
        hc = f1 - f0
        tk, tv = _group_rows(shifted_k, f0, f1, h, q.dtype), _group_rows(rel_v, f0, f1, h, q.dtype)
        mask_g = _group_mask(mask, f0, f1, h)
        parts = _far_forward(qf[f0:f1][None], kf[f0:f1][None], vf[f0:f1][None], tk, tv, kk, query_offset,
                             is_causal, scale, sdt, mask_g)
        lse_parts = [p[0] for p in parts]
        lse_far = (torch.logsumexp(torch.stack(lse_parts), 0) if len(lse_parts) > 1 else lse_parts[0]
                   if lse_parts else q.new_full((hc, n), float("-inf"), dtype=sdt))
        out_g = out[f0:f1] if sdt == q.dtype else q.new_empty(hc, n, dv, dtype=sdt)
        if wb:
            geo = _Band(hc, n, m, kk, query_offset, is_causal, tile, q.device)
            tk32 = tk.to(sdt) if tk is not None else None
            tv32 = tv.to(sdt) if tv is not None else None
            _band_forward(geo, qf[f0:f1], kf[f0:f1], vf[f0:f1], tk32, tv32, parts, lse_far, out_g, lse[f0:f1],
                          band[f0:f1], scale, sdt, mask_g)
        else:
            out_g.zero_()
            lse[f0:f1] = lse_far
            _add_far(out_g, parts, lse[f0:f1].nan_to_num(0.0, 0.0, 0.0), slice(None), 0, n, n)
        if sdt != q.dtype:
            out[f0:f1] = out_g
    return out.view(b, h, n, dv), lse.view(b, h, n), band.view(b, h, n, wb)


def _band_backward(geo, q, k, v, do, o, tk, tv, band, dq, dk, dv, drk, drv, scale, sdt):
    """Band gradients of one head group, chunk by chunk: into dq (hc, N, D), dk, dv (hc, M, .) and the table
    gradients drk, drv (hc, 2K+1, .) (rows 1 .. wb)."""
    t, wb = geo.tile, geo.wb
    d, dvd = q.shape[-1], v.shape[-1]
    qt = geo.pad_rows(q, sdt)
    dot = geo.pad_rows(do, sdt)
    kwin = geo.windows(geo.pad_keys(k, sdt, scale))  # dq = dS (scale k): the scale rides on the keys
    vwin = geo.windows(geo.pad_keys(v, sdt))
    dkflat = qt.new_zeros(geo.hc * geo.ntp + geo.nb, t, d)
    dvflat = qt.new_zeros(geo.hc * geo.ntp + geo.nb, t, dvd)
    rows_k = tk[:, 1 : 1 + wb] * scale if tk is not None else None  # (hc, wb, D)
    rows_v = tv[:, 1 : 1 + wb] if tv is not None else None  # (hc, wb, Dv)
    scratch = qt.new_empty(geo.step, t, geo.w)
    tiles = qt.new_zeros(geo.step, t, geo.w)  # only its band entries are ever written: the rest stays zero
    pc_buf, ds_buf = qt.new_zeros(geo.step, t, wb), qt.new_empty(geo.step, t, wb)
    dsum_buf = qt.new_zeros(geo.step * t)
    dq_buf = qt.new_empty(geo.step, t, d)
    wk_buf, wv_buf = qt.new_empty(geo.step, geo.w, d), qt.new_empty(geo.step, geo.w, dvd)
    for g, t0, t1, f0, r0, r1 in geo.chunks():
        c, rr = t1 - t0, r1 - r0
        pc, ds, pt, dqc = pc_buf[:c], ds_buf[:c], tiles[:c], dq_buf[:c]
        pc.view(c * t, wb)[:rr] = band[g, r0:r1]  # rows past N stay zero
        dsum = dsum_buf[: c * t]
        torch.sum(do[g, r0:r1].to(sdt) * o[g, r0:r1].to(sdt), -1, out=dsum[:rr])  # rowsum(dO * O)
        dots = dot[g, t0:t1]
        torch.bmm(dots, vwin[f0 : f0 + c].transpose(1, 2), out=scratch[:c])
        if rows_v is not None:
            torch.mm(dots.reshape(c * t, -1), rows_v[g].T, out=ds.view(c * t, wb))
            ds += geo.skew(scratch[:c])
            drv[g, 1 : 1 + wb].addmm_(pc.view(c * t, wb).T, dots.reshape(c * t, -1))
        else:
            ds.copy_(geo.skew(scratch[:c]))
        ds.sub_(dsum.view(c, t, 1)).mul_(pc)  # dL/d(scaled score)
        geo.skew(pt).copy_(pc)
        torch.bmm(pt.transpose(1, 2), dots, out=wv_buf[:c])
        geo.fold(dvflat, f0, wv_buf[:c])
        geo.skew(pt).copy_(ds)
        qs = qt[g, t0:t1]
        torch.bmm(pt, kwin[f0 : f0 + c], out=dqc)
        dqc = dqc.view(c * t, d)
        if rows_k is not None:
            dqc.addmm_(ds.view(c * t, wb), rows_k[g])
            drk[g, 1 : 1 + wb].addmm_(ds.view(c * t, wb).T, qs.reshape(c * t, d), alpha=scale)
        dq[g, r0:r1] += dqc[:rr]
        torch.bmm(pt.transpose(1, 2), qs, out=wk_buf[:c])
        geo.fold(dkflat, f0, wk_buf[:c])
    geo.unpad_keys(dkflat, dk, scale)
    geo.unpad_keys(dvflat, dv)


def _put(acc: torch.Tensor, g: torch.Tensor, lo: int, *, flip: bool, first: bool) -> None:
    """``acc[:, lo:lo+L] (+)= g`` (reversed along L if ``flip``) for g (hc, L, d); ``first``: write, and zero the
    rows outside."""
    hi = lo + g.shape[1]
    if not first:
        acc[:, lo:hi] += g.flip(1) if flip else g
        return
    acc[:, :lo].zero_()
    acc[:, hi:].zero_()
    if flip and g.dtype == acc.dtype:
        torch.ops.aten.flip.out(g, [1], out=acc[:, lo:hi])  # one pass, no temporary
    else:
        acc[:, lo:hi] = g.flip(1) if flip else g


def fused_backward(grad_out, q, k, v, rel_k, rel_v, out, lse, band, *, max_relative_position: int,
                   is_causal: bool, scale: float, query_offset: int, mask: torch.Tensor | None = None,
                   tile: int | None = DEFAULT_TILE):
    """Gradients (dq, dk, dv, d_rel_k | None, d_rel_v | None) from the forward's ``out``, ``lse``, band weights."""
    kk = max_relative_position
    b, h, n, d = q.shape
    m, dvd = k.shape[2], v.shape[3]
    sdt = stats_dtype(q.dtype)
    bh = b * h
    wb = band.shape[-1]
    qf, kf, vf, dof, of = (t.reshape(bh, *t.shape[2:]) for t in (q, k, v, grad_out, out))
    lsef, bandf = lse.reshape(bh, n), band.reshape(bh, n, wb)
    dq_all = q.new_empty(bh, n, d)
    dk_all = q.new_empty(bh, m, d)
    dv_all = q.new_empty(bh, m, dvd)
    drk = torch.zeros(rel_k.shape, dtype=sdt, device=q.device) if rel_k is not None else None
    drv = torch.zeros(rel_v.shape, dtype=sdt, device=q.device) if rel_v is not None else None
    shifted_k = rel_k - rel_k[:, :1] if rel_k is not None else None
    mask = _kernel_mask(mask)
    for f0, f1 in head_groups(bh, n, max(d, dvd), None if mask is None else h):
        hc = f1 - f0
        tk, tv = _group_rows(shifted_k, f0, f1, h, q.dtype), _group_rows(rel_v, f0, f1, h, q.dtype)
        q4, k4, v4, do4, o4 = (t[f0:f1][None] for t in (qf, kf, vf, dof, of))
        l3 = lsef[f0:f1][None]
        mask_g = _group_mask(mask, f0, f1, h)
        if mask_g is not None:  # a row masked everywhere has lse -inf: its weights exp(-inf - 0) are 0
            l3 = l3.nan_to_num(0.0, 0.0, 0.0)
        drk_g = torch.zeros(hc, *rel_k.shape[1:], dtype=sdt, device=q.device) if rel_k is not None else None
        drv_g = torch.zeros(hc, *rel_v.shape[1:], dtype=sdt, device=q.device) if rel_v is not None else None
        direct = sdt == q.dtype
        if direct:  # accumulate straight into the results
            dq, dk, dv = dq_all[f0:f1], dk_all[f0:f1], dv_all[f0:f1]
        else:
            dq, dk, dv = (x.new_empty(hc, *x.shape[1:], dtype=sdt) for x in (qf, kf, vf))
        first = True
        # The right region first: its gradients come reversed, and a reversed copy is then the first write.
        for side, calls in reversed(_regions(n, m, kk, query_offset, is_causal)):
            if not calls:
                continue
            row = 0 if side == 0 else 2 * kk
            qs, ks, vs, ms = _side_inputs(side, q4, k4, v4, tk, tv, kk, mask_g)
            dos, outs, lses = (do4.contiguous(), o4, l3) if side == 0 else (x.flip(2) for x in (do4, o4, l3))
            for i0, j0, j1, causal in calls:
                gq, gk, gv = (x[0] for x in _attn_bwd(dos[:, :, i0:], qs[:, :, i0:], ks[:, :, j0:j1], vs[:, :, j0:j1],
                                                      outs[:, :, i0:], lses[:, :, i0:].contiguous(), causal, scale,
                                                      _call_mask(ms, i0, j0, j1)))
                if drk_g is not None:
                    drk_g[:, row] += gk.sum(1)
                if drv_g is not None:
                    drv_g[:, row] += gv.sum(1)
                flip = side == 1
                _put(dq, gq, 0 if flip else i0, flip=flip, first=first)
                _put(dk, gk, m - j1 if flip else j0, flip=flip, first=first)
                _put(dv, gv, m - j1 if flip else j0, flip=flip, first=first)
                first = False
            del qs, dos, outs, lses, ks, vs, ms
        if first:
            for x in (dq, dk, dv):
                x.zero_()
        if wb:
            geo = _Band(hc, n, m, kk, query_offset, is_causal, tile, q.device)
            tk32 = tk.to(sdt) if tk is not None else None
            tv32 = tv.to(sdt) if tv is not None else None
            _band_backward(geo, qf[f0:f1], kf[f0:f1], vf[f0:f1], dof[f0:f1], of[f0:f1], tk32, tv32, bandf[f0:f1],
                           dq, dk, dv, drk_g, drv_g, scale, sdt)
        if not direct:
            dq_all[f0:f1], dk_all[f0:f1], dv_all[f0:f1] = dq, dk, dv
        for total, part in ((drk, drk_g), (drv, drv_g)):
            if total is not None:
                if total.shape[0] == 1:
                    total[0] += part.sum(0)
                else:
                    total.index_add_(0, torch.arange(f0, f1, device=q.device) % h, part)
    return (dq_all.view(b, h, n, d), dk_all.view(b, h, m, d), dv_all.view(b, h, m, dvd),
            drk.to(q.dtype) if drk is not None else None, drv.to(q.dtype) if drv is not None else None)
