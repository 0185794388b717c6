"""The "triton" backend: Shaw attention as flash-style Triton kernels, forward and backward, on CUDA.

The kernels (``_triton_kernels.py``) split each query tile's key loop into three stages, as the Triton tutorial
splits its causal loop: key tiles left of the band of ``2K+1`` offsets (plain flash plus one key-table score per
row), the band tiles (the key term gathered per pair from ``QA = q a^K^T``, precomputed by one small matmul
kernel; the scores of the band's interior stored per row and table row), and key tiles right of it. The value
term is ``bins @ a^V`` after the loop. The position-to-content term (``rel_q``, DeBERTa's p2c: ``k_j . a^Q_t``)
is gathered the same way from ``KA = k a^Q^T`` (one number per key off the band, per pair on it). The backward
is FlashAttention-2's (P recomputed from the saved log-sum-exp; one kernel per key tile for dk and dv, one per
query tile for dq, sharing one tile body); the table gradients come from per-row bins of P and dS, written once
each by the dq kernel, and (rel_q) per-key bins of dS, written once each by the dk/dv kernel, reduced by torch in
a fixed order: no atomics, two backward passes are bitwise equal. k and v may have fewer heads than q
(grouped-query attention): query head ``h`` reads key/value head ``h // (H // Hkv)``, and dk, dv of a key/value
head are summed over its group by one program, in order. A packed batch (``cu_seqlens``: :func:`varlen_forward`,
:func:`varlen_backward`) runs in the same kernels, one launch each for the whole batch, with the constexpr ``VARLEN``:
each program reads its sequence's rows and lengths from the cumulative lengths.

Serves CUDA tensors on the GPUs of ``CUDA_ARCHS`` (sm_80 and newer) when ``triton`` is importable; while
``TRITON_INTERPRET=1`` is in the environment (read when a call or a construction asks; Triton itself reads it when
the kernels are first imported), also CPU tensors (the same kernels, interpreted: how CI tests them; slow, so
"auto" never picks it on the CPU). float16 and bfloat16 (float32 statistics, 16-bit matmul inputs as in flash
attention: the weights rounded to 16 bits on their way into a matmul), float32 (IEEE float32 matmuls, no
TF32) and float64 (gradcheck); head dims up to 128 (D != Dv allowed); any K; the tables a^K, a^V, a^Q (rel_q),
each optional, shared or per head; the scalar bias rel_bias (T5's), folded into the key term's scores ``QA`` as
``rel_bias / scale`` (its gradient the per-row bins of dS summed over rows: no atomics); any mask that needs no
gradient; dropout (the one mask of every backend, a hash of (seed, batch entry, query head, row, key), regenerated
tile by tile in the backward, never stored).

Tiles, warps and pipeline stages per kernel come from one table (:mod:`._triton_tiles`: by kernel, GPU
architecture, precision, head dim and the launch's variant); ``benchmarks/triton_compile.py`` compiles every
launch of this module for every served arch without a GPU and reports registers, spills, shared memory and
tensor-core instructions.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
from torch import Tensor

from ._common import (
    LOW_PRECISION,
    Backend,
    Serves,
    StatsOps,
    compute_capability,
    stats_dtype,
)
from ._triton_args import (
    Packed,
    Window,
    bias_grad,
    common_args,
    contiguous_rows,
    key_table_grads,
    mask_args,
    mask_kind,
    met_tables,
    rows_of,
    strides,
    table_grads,
    table_strides,
    trimmed,
    window_of,
    windows,
    with_bias,
    zero_grads,
)
from ._triton_tiles import EVERY_ARCH, SETTINGS, config

MAX_HEAD_DIM = 128
# The GPUs the kernels serve, as data: (compute capability, the dtypes served there). Each is compiled by
# benchmarks/triton_compile.py (docs/backends-triton.md, its table); elsewhere "auto" takes the next backend
# ("blocked": cuBLAS's tensor cores). Not sm_75 (T4) nor older: Triton emits no tensor-core instruction there, even in
# float16, and the forward spills 14-22 KB per thread; nor do they have bfloat16 tensor cores.
_EVERY_DTYPE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
CUDA_ARCHS = tuple((arch, _EVERY_DTYPE) for arch in EVERY_ARCH)
_state: dict = {}  # "kernels": the imported module; "error": None once imported, else why not


@torch.compiler.assume_constant_result  # traced first (torch.compile as the first call): run eagerly, a constant
def unavailable(recheck: bool = False) -> str | None:
    """None once the kernels are imported (on the first call), else why they cannot be; ``recheck`` forgets the
    answer given before (triton installed since, or removed)."""
    if recheck:
        _state.pop("error", None)
    if "error" not in _state:
        if importlib.util.find_spec("triton") is None:
            _state["error"] = "triton is not installed (pip install 'relattn[gpu]', Linux)"
        else:
            try:
                _kernels()
                _state["error"] = None
            except Exception as exc:  # an installed but broken triton: "auto" falls back, the error names it
                _state["error"] = f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return _state["error"]


def _kernels():
    """The ``@triton.jit`` kernels, imported on first use (the module state is a dict, as torch.compile and
    torch.export trace it fine)."""
    if "kernels" not in _state:
        from . import _triton_kernels

        _state["kernels"] = _triton_kernels
    return _state["kernels"]


def _launch(kernel, grid, **kwargs) -> None:
    """Every kernel launch of this module goes through here (benchmarks/triton_compile.py records them)."""
    kernel[grid](**kwargs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, x - 1).bit_length())


def _arch(device: torch.device) -> int | None:
    """The GPU's compute capability as 80, 90, ...; None when interpreted."""
    return compute_capability(device)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _meta(kernel, q, k, v, rel_k, rel_v, mask, is_causal, rel_q=None, packed: Packed | None = None,
          dropout: bool = False, window: Window | None = None, bias: bool = False):
    """The constexprs and launch options of one kernel for these inputs (``packed``: of a packed batch, whose
    lengths vary by sequence: the tiles cut to the longest, every tile masked at its sequence's end; ``rel_k``: the
    key term's table or its scores, QA: HAS_RK when not None, as with a rel_bias and no table)."""
    n, m = (q.shape[2], k.shape[2]) if packed is None else (packed.max_q, packed.max_k)
    dp, dvp = _pow2(q.shape[-1]), _pow2(v.shape[-1])
    flags = dict(rel_q=rel_q is not None, grouped=k.shape[1] != q.shape[1], varlen=packed is not None,
                 dropout=dropout, window=window is not None, bias=bias and rel_q is None)
    tiles = config(kernel, q.dtype in LOW_PRECISION, max(dp, dvp), _arch(q.device), **flags)
    if packed is None and (n % tiles.block_m or m % tiles.block_n):  # lengths that end mid-tile
        tiles = config(kernel, q.dtype in LOW_PRECISION, max(dp, dvp), _arch(q.device), **flags, ragged=True)
    bm, bn, warps, stages, split = tiles
    settings = SETTINGS.current
    override = settings.fwd_tiles if kernel == "fwd" else settings.bwd_tiles
    if override is not None:
        bm, bn = override
    bm, bn = min(bm, _pow2(n)), min(bn, _pow2(m))  # no tile longer than needed
    split = settings.band_split or split
    split = max(1, min(split, (bm if kernel == "dkdv" else bn) // 16))  # band tiles of at least 16 (tl.dot's minimum)
    kern = _kernels()
    return dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=dp, HEAD_DIM_V=dvp,
                HAS_RK=rel_k is not None, HAS_RQ=rel_q is not None, HAS_RV=rel_v is not None,
                HAS_MASK=mask_kind(q, k, mask), CAUSAL=is_causal,
                EVEN_M=packed is None and n % bm == 0, EVEN_N=packed is None and m % bn == 0,
                EVEN_D=(dp == q.shape[-1] and dvp == v.shape[-1]), VARLEN=packed is not None, DROPOUT=dropout,
                WINDOW=window is not None,
                PREC="ieee" if q.dtype not in LOW_PRECISION else "tf32",
                ACC=kern.tl.float64 if q.dtype == torch.float64 else kern.tl.float32,
                BAND_SPLIT=split, num_warps=warps, num_stages=stages)


def table_scores(x: Tensor, table: Tensor, dtype: torch.dtype, heads: int | None = None) -> Tensor:
    """``x @ table^T`` per head: (B, Hx, N, d), (Hr, 2K+1, d) -> (B, H, N, 2K+1) in ``dtype`` (one launch), H =
    ``heads`` (default Hx, a multiple of it: head h reads x's head ``h // (H // Hx)``)."""
    b, hx, n, d = x.shape
    h = hx if heads is None else heads
    r = table.shape[1]
    out = x.new_empty(b, h, n, r, dtype=dtype)
    block_n, block_r = (128, 128) if x.device.type == "cpu" else (64, 64) if x.element_size() == 2 else (32, 32)
    block_n, block_r = min(block_n, _pow2(n)), min(block_r, _pow2(r))
    _launch(_kernels()._table_scores_kernel, (_cdiv(n, block_n), b * h, _cdiv(r, block_r)),
            X=x, T=table, S=out, **strides("x", x, "bhnd"), **table_strides("t", table),
            **strides("s", out, "bhn"), H=h, XGROUP=h // hx, N=n, D=d, R=r,
            BLOCK_N=block_n, BLOCK_R=block_r, HEAD_DIM=_pow2(d),
            PREC="ieee" if x.dtype not in LOW_PRECISION else "tf32", num_warps=4, num_stages=1)
    return out


def kv_splits(q_tiles: int, heads: int, m: int, bn: int, device: torch.device) -> int:
    """Splits of the keys for the forward: more than one only when the (query tile, batch * head) programs
    leave most of a GPU idle (decoding: one query against a long cache), each split at least 4 key tiles."""
    if (fixed := SETTINGS.current.kv_splits) > 0:
        return fixed
    if device.type != "cuda":
        return 1
    target = 2 * _sm_count(device)
    programs = q_tiles * heads
    if programs >= target // 2:
        return 1
    return max(1, min(math.ceil(target / programs), m // (4 * bn)))


def key_scores(k: Tensor, rel_q: Tensor | None, heads: int, dtype: torch.dtype) -> tuple[Tensor | None, int]:
    """``KA = k a^Q^T``, the keys' position-to-content scores, and KA_GROUP (query head h reads KA's head
    ``h // KA_GROUP``): (B, H, M, 2K+1) for a per-head table, (B, Hkv, M, 2K+1) for a shared one (k's own heads).
    (None, 1) without a table."""
    if rel_q is None:
        return None, 1
    if rel_q.shape[0] == 1:
        return table_scores(k, rel_q, dtype), heads // k.shape[1]
    return table_scores(k, rel_q, dtype, heads), 1


def key_term_scores(x: Tensor, rel_k: Tensor | None, rel_bias: Tensor | None, scale: float, dtype: torch.dtype,
                    window: Window | None = None) -> Tensor | None:
    """``QA``, what the kernels add per (row, table row) to ``q k^T`` before the scale: ``x a^K^T`` (B, H, N, R) over
    the window's table rows (all 2K+1 without one) plus the same rows of ``rel_bias / scale`` (:func:`with_bias`)."""
    qa = table_scores(x, window_of(rel_k, window), dtype) if rel_k is not None else None
    return with_bias(qa, x, window_of(rel_bias, window), scale, dtype)


def forward(q, k, v, rel_k, rel_v, mask, seed=None, *, max_relative_position: int, is_causal: bool, scale: float,
            query_offset: int, dropout_p: float = 0.0, rel_q=None, q_pos=None, rel_bias=None) -> tuple[Tensor, Tensor]:
    """(out (B,H,N,Dv) in q's dtype, lse (B,H,N), float32 for 16-bit q); rows with no key give zeros and lse -inf.
    k, v: (B, Hkv, M, D|Dv) with H % Hkv == 0; rel_q: the position-to-content table (Hr, 2K+1, D) or None; q_pos:
    the queries the key table reads (q's shape; None: q); rel_bias (Hr, 2K+1): the scalar bias, added unscaled at
    the key term's row (folded into the key term's scores, :func:`key_term_scores`). ``dropout_p > 0``: the weights
    that multiply v and a^V dropped by the mask of ``seed`` (int64, a bare seed or ``(seed, b0, i0, j0)``: the
    mask's ``(b0 + b, h, i0 + i, j0 + j)``), the kept ones scaled by ``1 / (1 - p)``; lse is the undropped one."""
    return _forward(q, k, v, rel_k, rel_v, mask, max_relative_position=max_relative_position, is_causal=is_causal,
                    scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos, seed=seed, dropout_p=dropout_p,
                    rel_bias=rel_bias)


def varlen_forward(q, k, v, rel_k, rel_v, mask, seed, cu_seqlens_q, cu_seqlens_k, *, max_relative_position: int,
                   is_causal: bool, scale: float, query_offset: int, max_seqlen_q: int, max_seqlen_k: int,
                   dropout_p: float = 0.0, rel_q=None, q_pos=None, rel_bias=None) -> tuple[Tensor, Tensor]:
    """A packed batch's (out (1,H,T,Dv), laid out as the packed (T, H, Dv), lse (1,H,T)): q (1,H,T,D), k, v
    (1,Hkv,T_k,D|Dv), sequence ``s`` its rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and keys likewise, each the
    dense call with ``query_offset + m_s - n_s`` (:class:`~relattn.backends._common.AttentionCall`); one launch of
    each kernel for the whole batch, its programs over (query tile of the longest sequence, sequence * head).
    Dropout as :func:`forward`'s, sequence ``s`` drawn as batch entry ``s`` (rows and keys counted within it)."""
    if mask is not None:
        raise ValueError("triton varlen_forward: a packed call takes no mask")
    return _forward(q, k, v, rel_k, rel_v, None, max_relative_position=max_relative_position, is_causal=is_causal,
                    scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos, seed=seed, dropout_p=dropout_p,
                    rel_bias=rel_bias,
                    packed=Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k))


def _windows(q, k, kk: int, query_offset, is_causal: bool, rel_q, packed: Packed | None) -> list[Window] | None:
    """The compact windows of a dense call without rel_q (:func:`._triton_args.windows`), or None: the call whole."""
    if packed is not None or rel_q is not None:
        return None
    return windows(q.shape[2], k.shape[2], kk, q.shape[-1], query_offset, is_causal, SETTINGS.current.window_rows)


def _forward(q, k, v, rel_k, rel_v, mask, *, max_relative_position: int, is_causal: bool, scale: float,
             query_offset: int, rel_q=None, q_pos=None, packed: Packed | None = None, seed: Tensor | None = None,
             dropout_p: float = 0.0, rel_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    kw = dict(max_relative_position=max_relative_position, is_causal=is_causal, scale=scale, rel_q=rel_q,
              packed=packed, dropout_p=dropout_p, rel_bias=rel_bias)
    chunks = _windows(q, k, max_relative_position, query_offset, is_causal, rel_q, packed)
    if chunks is None or q.shape[0] * q.shape[1] == 0:
        return _forward_rows(q, k, v, rel_k, rel_v, mask, query_offset=query_offset, q_pos=q_pos, seed=seed, **kw)
    b, h, n, _ = q.shape
    out = q.new_empty(b, h, n, v.shape[3])
    lse = q.new_empty(b, h, n, dtype=stats_dtype(q.dtype))
    for w in chunks:  # one chunk of query rows at a time, each reading its window of the tables (and of rel_bias)
        part = rows_of(w, q, q_pos, mask, seed, query_offset, dropout_p)
        out[:, :, w.i0:w.i1], lse[:, :, w.i0:w.i1] = _forward_rows(
            part.q, k, v, rel_k, rel_v, part.mask, query_offset=part.query_offset, q_pos=part.q_pos, seed=part.seed,
            window=w, **kw)
    return out, lse


def _forward_rows(q, k, v, rel_k, rel_v, mask, *, max_relative_position: int, is_causal: bool, scale: float,
                  query_offset: int, rel_q=None, q_pos=None, packed: Packed | None = None, seed: Tensor | None = None,
                  dropout_p: float = 0.0, window: Window | None = None,
                  rel_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    b, h, n, _ = q.shape
    m, dv, kk = k.shape[2], v.shape[3], max_relative_position
    sdt = stats_dtype(q.dtype)
    if b * h * n == 0:
        return q.new_zeros(b, h, n, dv), q.new_full((b, h, n), float("-inf"), dtype=sdt)
    rel_k, rel_v, rel_q, rel_bias = met_tables((rel_k, rel_v, rel_q, rel_bias), q, k, kk, is_causal, query_offset,
                                                packed)
    qa = key_term_scores(q if q_pos is None else q_pos, rel_k, rel_bias, scale, sdt, window)
    meta = _meta("fwd", q, k, v, qa, rel_v, mask, is_causal, rel_q, packed, dropout_p > 0.0, window,
                 rel_bias is not None)
    # programs: (query tile, batch entry * head, split of the keys); a packed batch's entries are its sequences
    rows_n, rows_m, entries = (n, m, b) if packed is None else (packed.max_q, packed.max_k, packed.count)
    q_tiles = math.ceil(rows_n / meta["BLOCK_M"])
    splits = kv_splits(q_tiles, entries * h, rows_m, meta["BLOCK_N"], q.device)
    split_len = math.ceil(math.ceil(max(rows_m, 1) / splits) / meta["BLOCK_N"]) * meta["BLOCK_N"]
    splits = max(1, math.ceil(rows_m / split_len))
    if splits == 1 and packed is not None:  # laid out as the packed (T, H, Dv): the op's view back is free
        out, lse = q.new_empty(1, 1, n, h, dv).transpose(2, 3), q.new_empty(1, b, h, n, dtype=sdt)
    elif splits == 1:
        out, lse = q.new_empty(1, b, h, n, dv), q.new_empty(1, b, h, n, dtype=sdt)
    else:  # each split's normalised output, in the statistics' dtype, merged below
        out, lse = q.new_empty(splits, b, h, n, dv, dtype=sdt), q.new_empty(splits, b, h, n, dtype=sdt)
    ka, ka_group = key_scores(k, rel_q, h, sdt)
    width = 2 * kk + 1 if window is None else window.rows
    bins = q.new_empty(b, h, n, width, dtype=sdt) if rel_v is not None else None
    scratch = qa if qa is not None else bins
    _launch(_kernels()._fwd_kernel, (q_tiles, entries * h, splits),
            Q=q, K=k, V=v, QA=q if qa is None else qa, KA=q if ka is None else ka, RV=q if rel_v is None else rel_v,
            **mask_args(q, k, mask), BINS=q if bins is None else bins, OUT=out, LSE=lse,
            **strides("s", scratch, "bhn"), **strides("ka", ka, "bhn"), **table_strides("rv", rel_v),
            **strides("o", out, "sbhnd"), **strides("l", lse, "sbhn"),
            **common_args(q, k, v, kk, query_offset, scale, packed, seed, dropout_p, window), H=h,
            KA_GROUP=ka_group, split_len=split_len, **meta)
    if splits == 1:
        return out[0], lse[0]
    total = torch.logsumexp(lse, 0)  # fixed order: deterministic
    weights = torch.exp(lse - torch.where(torch.isfinite(total), total, torch.zeros_like(total)))
    return (weights[..., None] * out).sum(0).to(q.dtype), total


def backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, *, max_relative_position: int, is_causal: bool,
             scale: float, query_offset: int, dropout_p: float = 0.0, rel_q=None, q_pos=None,
             rel_bias=None) -> tuple[Tensor, ...]:
    """(dq, dk, dv, d_rel_k | None, d_rel_v | None), then d_rel_q, d_q_pos, d_rel_bias up to the last one given
    (None for one not given before it), in their inputs' dtypes; dq, dk, dv contiguous; dk, dv of a key/value head
    summed over its group of query heads; d_rel_bias the per-row bins of dS summed over rows. With q_pos, dq is
    the content term's share and d_q_pos the key table's, ``scale * SB a^K``.
    Dropout: the forward's mask regenerated from ``seed`` (never stored)."""
    return _backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, max_relative_position=max_relative_position,
                     is_causal=is_causal, scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos, seed=seed,
                     dropout_p=dropout_p, rel_bias=rel_bias)


def varlen_backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, cu_seqlens_q, cu_seqlens_k, out, lse, *,
                    max_relative_position: int, is_causal: bool, scale: float, query_offset: int, max_seqlen_q: int,
                    max_seqlen_k: int, dropout_p: float = 0.0, rel_q=None, q_pos=None,
                    rel_bias=None) -> tuple[Tensor, ...]:
    """The gradients of :func:`varlen_forward`, as :func:`backward`'s (dq, dk, dv laid out as q, k, v: the packed
    layout); one launch of each kernel for the whole batch."""
    if mask is not None:
        raise ValueError("triton varlen_backward: a packed call takes no mask")
    return _backward(grad_out, q, k, v, rel_k, rel_v, None, out, lse, max_relative_position=max_relative_position,
                     is_causal=is_causal, scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos,
                     seed=seed, dropout_p=dropout_p, rel_bias=rel_bias,
                     packed=Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k))


def _backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, *, max_relative_position: int, is_causal: bool,
              scale: float, query_offset: int, rel_q=None, q_pos=None, packed: Packed | None = None,
              seed: Tensor | None = None, dropout_p: float = 0.0, rel_bias: Tensor | None = None) -> tuple[Tensor, ...]:
    kw = dict(max_relative_position=max_relative_position, is_causal=is_causal, scale=scale, rel_q=rel_q,
              packed=packed, dropout_p=dropout_p, rel_bias=rel_bias)
    chunks = _windows(q, k, max_relative_position, query_offset, is_causal, rel_q, packed)
    if chunks is None or q.shape[0] * q.shape[1] * k.shape[2] == 0:
        return trimmed(_backward_rows(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, query_offset=query_offset,
                                      q_pos=q_pos, seed=seed, **kw), rel_q, q_pos, rel_bias)
    dq, d_q_pos, sums = [], [], None
    for w in chunks:  # one chunk of query rows at a time: its dq and d_q_pos rows, its shares of the others
        part, rows = rows_of(w, q, q_pos, mask, seed, query_offset, dropout_p), slice(w.i0, w.i1)
        g = _backward_rows(grad_out[:, :, rows], part.q, k, v, rel_k, rel_v, part.mask, out[:, :, rows],
                           lse[:, :, rows], query_offset=part.query_offset, q_pos=part.q_pos, seed=part.seed,
                           window=w, **kw)
        dq.append(g[0])
        d_q_pos.append(g[6])
        share = (*g[1:5], g[7])  # dk, dv, d_rel_k, d_rel_v, d_rel_bias: summed over the chunks in order
        sums = share if sums is None else [None if a is None else a + b for a, b in zip(sums, share, strict=True)]
    dk, dv, d_rel_k, d_rel_v, d_rel_bias = (None if t is None else t.to(like.dtype)
                                            for t, like in zip(sums, (k, v, rel_k, rel_v, rel_bias), strict=True))
    grads = (torch.cat(dq, 2), dk, dv, d_rel_k, d_rel_v, None, None if q_pos is None else torch.cat(d_q_pos, 2),
             d_rel_bias)
    return trimmed(grads, rel_q, q_pos, rel_bias)


def _backward_rows(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, *, max_relative_position: int, is_causal: bool,
                   scale: float, query_offset: int, rel_q=None, q_pos=None, packed: Packed | None = None,
                   seed: Tensor | None = None, dropout_p: float = 0.0, window: Window | None = None,
                   rel_bias: Tensor | None = None) -> tuple:
    """(dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias), None for a tensor not given."""
    b, h, n, _ = q.shape
    hkv, m, kk = k.shape[1], k.shape[2], max_relative_position
    q, k, v = (t.contiguous() if packed is None else contiguous_rows(t) for t in (q, k, v))
    sdt = stats_dtype(q.dtype)
    dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias = zero_grads(q, k, v, rel_k, rel_v, rel_q, q_pos,
                                                                            rel_bias, sdt, window)
    if b * h == 0 or n == 0 or m == 0:
        return dq, dk.to(k.dtype), dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias
    rel_k, rel_v, rel_q, rel_bias = met_tables((rel_k, rel_v, rel_q, rel_bias), q, k, kk, is_causal, query_offset,
                                                packed)
    grad_out = grad_out.to(q.dtype)
    grad_out = grad_out.contiguous() if packed is None else contiguous_rows(grad_out)
    delta = (grad_out.to(sdt) * out.to(sdt)).sum(-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).contiguous()  # empty rows: P = 0
    reader = q if q_pos is None else q_pos.contiguous()  # the queries the key table reads
    qa = key_term_scores(reader, rel_k, rel_bias, scale, sdt, window)
    doa = table_scores(grad_out, window_of(rel_v, window), sdt) if rel_v is not None else None
    ka, ka_group = key_scores(k, rel_q, h, sdt)
    # per key, per table row: dS (for a^Q), written by the dk/dv kernel; zeros where no pair falls
    kb = torch.zeros(b, h, m, 2 * kk + 1, dtype=sdt, device=q.device) if rel_q is not None else None
    # per row, per table row (of the window): P (for a^V) and dS (for a^K and rel_bias); zeros where no pair falls
    width = 2 * kk + 1 if window is None else window.rows
    pb, sb = (torch.zeros(b, h, n, width, dtype=sdt, device=q.device) if t is not None else None for t in (rel_v, qa))
    scratch = next((t for t in (qa, doa, pb, sb) if t is not None), None)
    args = dict(Q=q, K=k, V=v, QA=q if qa is None else qa, KA=q if ka is None else ka,
                DOA=q if doa is None else doa, **mask_args(q, k, mask), DO=grad_out, LSE=lse, DELTA=delta,
                **strides("s", scratch, "bhn"), **strides("ka", ka, "bhn"), **strides("do", grad_out, "bhnd"),
                **strides("l", lse, "bhn"),
                **common_args(q, k, v, kk, query_offset, scale, packed, seed, dropout_p, window),
                KA_GROUP=ka_group, scale=scale)
    # programs: (key tile, batch entry * key/value head) and (query tile, batch entry * head); a packed batch's
    # entries are its sequences
    rows_n, rows_m, entries = (n, m, b) if packed is None else (packed.max_q, packed.max_k, packed.count)
    flags = (is_causal, rel_q, packed, dropout_p > 0.0, window, rel_bias is not None)
    meta = _meta("dkdv", q, k, v, qa, rel_v, mask, *flags)
    _launch(_kernels()._dkdv_kernel, (math.ceil(rows_m / meta["BLOCK_N"]), entries * hkv), DK=dk, DV_=dv,
            KB=q if kb is None else kb, **strides("kb", kb, "bhn"), H_KV=hkv, **args, **meta)
    meta = _meta("dq", q, k, v, qa, rel_v, mask, *flags)
    _launch(_kernels()._dq_kernel, (math.ceil(rows_n / meta["BLOCK_M"]), entries * h), DQ=dq,
            RK=q if rel_k is None else rel_k, PB=q if pb is None else pb, SB=q if sb is None else sb, H=h,
            **table_strides("rk", rel_k), **args, KEY_TABLE_DQ=rel_k is not None and q_pos is None, **meta)
    d_rel_k, d_rel_v, d_q_pos = table_grads(pb, sb, grad_out, reader, rel_k, rel_v, d_rel_k, d_rel_v, q_pos, scale,
                                            window)
    d_rel_bias = bias_grad(sb, d_rel_bias, window)
    if rel_q is not None:
        dk_q, d_rel_q = key_table_grads(kb, k, rel_q, scale)
        dk = (dk + dk_q).to(k.dtype)
    return dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias


# relattn::triton_fwd_{version} / _bwd_{version}, the eager path and the ring's pair calls, and
# relattn::triton_varlen_fwd_{version} / _bwd_{version} for packed calls (Backend.packed): see _common.StatsOps.
OPS = StatsOps("triton", forward, backward, dropout=True)
VARLEN_OPS = StatsOps("triton_varlen", varlen_forward, varlen_backward, dropout=True, varlen=True)


def interpreted() -> bool:
    """Whether ``TRITON_INTERPRET`` is set now (Triton then interprets the kernels, on CPU tensors too)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_DECLARATIONS = {interpret: Serves(devices=frozenset({"cuda", "cpu"} if interpret else {"cuda"}),
                                   cuda_archs=CUDA_ARCHS, max_head_dim=MAX_HEAD_DIM, dropout=True, grouped_kv=True,
                                   pos_to_content=True, position_query=True, rel_bias=True,
                                   chunk_pairs=True, varlen=True) for interpret in (False, True)}


def serves() -> Serves:
    """What the backend serves, asked when a call or a construction asks: CUDA on the GPUs of :data:`CUDA_ARCHS`;
    CPU tensors too while ``TRITON_INTERPRET`` is set."""
    return _DECLARATIONS[interpreted()]


BACKEND = Backend("triton", OPS.run, serves,
                  "Triton flash kernels: key loops in three stages (left of the band, band, right), the key term "
                  "gathered from q a^K^T, the position-to-content term (rel_q) from k a^Q^T, the value term as "
                  "per-row bins times a^V (the CPU only under TRITON_INTERPRET=1)",
                  unavailable=unavailable, stats=OPS, packed=VARLEN_OPS)
