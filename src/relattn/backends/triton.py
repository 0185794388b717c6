"""The "triton" backend: Shaw attention as one flash-style Triton kernel, forward and backward, on CUDA.

The kernels (``_triton_kernels.py``) follow ``blocked.py`` tile for tile: per (batch, head, query tile) an
online softmax over key tiles with float32 statistics; a key tile left of the band of ``2K+1`` offsets (or
right of it) reads one table row for all its pairs, a band tile loads the window of table rows its offsets
span, adds ``q @ window^T`` to the scores with a gather, and multiplies its weights, skewed into window
coordinates, by the window of ``a^V``. The backward is FlashAttention-2's (P recomputed from the saved
log-sum-exp; one kernel per key tile for dk and dv, one per query tile for dq); the table gradients come
from per-row sums of P and dS per table row, written once each by the dq kernel and reduced by torch in a
fixed order: no atomics, two backward passes are bitwise equal.

Serves CUDA tensors when ``triton`` is importable; with ``TRITON_INTERPRET=1`` in the environment when
relattn is imported, also CPU tensors (the same kernels, interpreted: how CI tests them; slow, so "auto"
never picks it on the CPU). float16 and bfloat16 (float32 statistics, 16-bit matmul inputs as in flash
attention: the weights rounded to 16 bits on their way into a matmul), float32 (IEEE float32 matmuls, no
TF32) and float64 (gradcheck); head dims up to 128 (D != Dv allowed); any K; any mask that needs no
gradient; no dropout.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
from torch import Tensor

from ._common import (
    LOW_PRECISION,
    AttentionCall,
    Backend,
    Serves,
    define_stats_ops,
    stats_dtype,
)

MAX_HEAD_DIM = 128
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Largest tiles (queries, keys) per program: powers of two, at least 16 (tl.dot's minimum), cut to the next power of
# two of N and M. On a GPU flash-attention's sizes. The interpreter pays per tile operation (about 0.2 ms, little
# more for a larger tile), so there they are large; the tests set small ones where they mean to cross tile edges.
FWD_TILES = (128, 128) if INTERPRET else (64, 64)
BWD_TILES = (128, 128) if INTERPRET else (32, 32)
NUM_WARPS = 4
NUM_STAGES = 2  # software pipelining depth of the key/value loads
KV_SPLITS = 0  # forward: splits of the keys (0: chosen by kv_splits)
_state: dict = {}  # "kernels": the imported module; "error": None once imported, else why not


def unavailable() -> str | None:
    """None once the kernels are imported (on the first call), else why they cannot be."""
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


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, x - 1).bit_length())


def _table_strides(t: Tensor | None) -> tuple[int, int, int]:
    """(head, row, dim) strides; head stride 0 for a shared (1, 2K+1, d) table."""
    if t is None:
        return 0, 0, 0
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1), t.stride(2)


def _launch_args(q, k, v, rel_k, rel_v, mask):
    """Pointers and strides shared by the three kernels: q, k, v, tables, mask (broadcast dims stride 0)."""
    b, h, n, _ = q.shape
    m = k.shape[2]
    full_mask = None if mask is None else mask.expand(b, h, n, m)
    ptrs = (q, k, v, q if rel_k is None else rel_k, q if rel_v is None else rel_v,
            q if full_mask is None else full_mask)
    strides = (*q.stride(), *k.stride(), *v.stride(), *_table_strides(rel_k), *_table_strides(rel_v),
               *((0, 0, 0, 0) if full_mask is None else full_mask.stride()))
    return ptrs, strides


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: IEEE for float32 and float64 (no TF32); see ``_dot`` for bf16 interpreted."""
    if dtype == torch.bfloat16 and INTERPRET:
        return "bf16-upcast"
    return "tf32" if dtype in LOW_PRECISION else "ieee"


def _meta(q, k, v, rel_k, rel_v, mask, is_causal, tiles):
    dp, dvp = _pow2(q.shape[-1]), _pow2(v.shape[-1])
    # The tiles are sized for 16-bit elements and head dims up to 128; wider elements get proportionally
    # fewer rows, so the tiles (and the window of table rows) stay within a GPU's shared memory.
    shrink = max(1, q.element_size() * max(dp, dvp) // 256)
    bm, bn = (max(16, t // shrink) for t in tiles)
    bm, bn = min(bm, _pow2(q.shape[2])), min(bn, _pow2(k.shape[2]))  # no tile longer than needed
    return dict(DP=dp, DVP=dvp, BM=bm, BN=bn, W=_pow2(bm + bn - 1),
                HAS_RK=rel_k is not None, HAS_RV=rel_v is not None, HAS_MASK=mask is not None, CAUSAL=is_causal,
                PREC=_precision(q.dtype),
                ACC=_kernels().tl.float64 if q.dtype == torch.float64 else _kernels().tl.float32,
                num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _sizes(q, k, v, kk, query_offset, scale):
    b, h, n, d = q.shape
    return (h, n, k.shape[2], d, v.shape[3], kk, query_offset, scale)


def kv_splits(q_tiles: int, heads: int, m: int, bn: int, device: torch.device) -> int:
    """Splits of the keys for the forward: more than one only when the (query tile, batch * head) programs
    leave most of a GPU idle (decoding: one query against a long cache), each split at least 4 key tiles."""
    if KV_SPLITS:
        return KV_SPLITS
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    programs = q_tiles * heads
    if programs >= target // 2:
        return 1
    return max(1, min(math.ceil(target / programs), m // (4 * bn)))


def forward(q, k, v, rel_k, rel_v, mask, *, max_relative_position: int, is_causal: bool, scale: float,
            query_offset: int) -> tuple[Tensor, Tensor]:
    """(out (B,H,N,Dv) in q's dtype, lse (B,H,N), float32 for 16-bit q); rows with no key give zeros and lse -inf."""
    b, h, n, _ = q.shape
    m, dv = k.shape[2], v.shape[3]
    sdt = stats_dtype(q.dtype)
    if b * h * n == 0:
        return q.new_zeros(b, h, n, dv), q.new_full((b, h, n), float("-inf"), dtype=sdt)
    ptrs, strides = _launch_args(q, k, v, rel_k, rel_v, mask)
    meta = _meta(q, k, v, rel_k, rel_v, mask, is_causal, FWD_TILES)
    q_tiles = math.ceil(n / meta["BM"])
    splits = kv_splits(q_tiles, b * h, m, meta["BN"], q.device)
    split_len = math.ceil(math.ceil(max(m, 1) / splits) / meta["BN"]) * meta["BN"]
    splits = max(1, math.ceil(m / split_len))
    if splits == 1:
        out, lse = q.new_empty(b, h, n, dv), q.new_empty(b, h, n, dtype=sdt)
    else:  # each split's normalised output, in the statistics' dtype, merged below
        out, lse = q.new_empty(splits, b, h, n, dv, dtype=sdt), q.new_empty(splits, b, h, n, dtype=sdt)
    o_strides, l_strides = out.stride()[-4:], lse.stride()[-3:]
    split_strides = (out.stride(0), lse.stride(0)) if splits > 1 else (0, 0)
    _kernels()._fwd_kernel[(q_tiles, b * h, splits)](
        *ptrs, out, lse, *strides, *o_strides, *l_strides, *split_strides, split_len,
        *_sizes(q, k, v, max_relative_position, query_offset, scale), **meta)
    if splits == 1:
        return out, lse
    total = torch.logsumexp(lse, 0)  # fixed order: deterministic
    weights = torch.exp(lse - torch.where(torch.isfinite(total), total, torch.zeros_like(total)))
    return (weights[..., None] * out).sum(0).to(q.dtype), total


def _table_grad(sums: Tensor, x: Tensor, hr: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """scale * sum over batch (and heads when shared) of sums^T @ x: (B,H,N,R), (B,H,N,d) -> (Hr, R, d)."""
    b, h, n, r = sums.shape
    lhs = sums.permute(1, 3, 0, 2).reshape(h, r, b * n)
    rhs = x.to(sums.dtype).permute(1, 0, 2, 3).reshape(h, b * n, x.shape[-1])
    g = torch.bmm(lhs, rhs) * scale
    return (g.sum(0, keepdim=True) if hr == 1 else g).to(dtype)


def backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, *, max_relative_position: int, is_causal: bool,
             scale: float, query_offset: int) -> tuple[Tensor, ...]:
    """(dq, dk, dv, d_rel_k | None, d_rel_v | None) in their inputs' dtypes, dq, dk, dv contiguous."""
    b, h, n, _ = q.shape
    m, kk = k.shape[2], max_relative_position
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_rel_k = None if rel_k is None else torch.zeros_like(rel_k)
    d_rel_v = None if rel_v is None else torch.zeros_like(rel_v)
    if b * h == 0 or n == 0 or m == 0:
        return dq, dk, dv, d_rel_k, d_rel_v
    grad_out = grad_out.to(q.dtype).contiguous()
    sdt = stats_dtype(q.dtype)
    delta = (grad_out.to(sdt) * out.to(sdt)).sum(-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).contiguous()  # empty rows: P = 0
    ptrs, strides = _launch_args(q, k, v, rel_k, rel_v, mask)
    meta = _meta(q, k, v, rel_k, rel_v, mask, is_causal, BWD_TILES)
    sizes = _sizes(q, k, v, kk, query_offset, scale)
    kern = _kernels()
    kern._dkdv_kernel[(math.ceil(m / meta["BN"]), b * h)](
        *ptrs, grad_out, lse, delta, dk, dv, *strides, *grad_out.stride(), *lse.stride(), *sizes, **meta)
    sums = [torch.zeros(b, h, n, 2 * kk + 1, dtype=sdt, device=q.device) if t is not None else lse
            for t in (rel_v, rel_k)]  # per row, per table row: sums of P (for a^V) and of dS (for a^K)
    b_strides = sums[0].stride()[:3] if rel_v is not None else sums[1].stride()[:3]
    kern._dq_kernel[(math.ceil(n / meta["BM"]), b * h)](
        *ptrs, grad_out, lse, delta, dq, *sums, *strides, *grad_out.stride(), *lse.stride(), *b_strides, *sizes,
        **meta)
    if rel_k is not None:
        d_rel_k = _table_grad(sums[1], q, rel_k.shape[0], rel_k.dtype, scale)
    if rel_v is not None:
        d_rel_v = _table_grad(sums[0], grad_out, rel_v.shape[0], rel_v.dtype)
    return dq, dk, dv, d_rel_k, d_rel_v


# relattn::triton_fwd / relattn::triton_bwd: see _common.define_stats_ops.
triton_fwd = define_stats_ops("triton", forward, backward)


def triton_attention(call: AttentionCall) -> Tensor:
    """The output (B, H, N, Dv), in q's dtype."""
    out, _ = triton_fwd(call.q, call.k, call.v, call.rel_k, call.rel_v, call.mask, call.max_relative_position,
                        call.is_causal, call.scale, call.query_offset)
    return out


BACKEND = Backend("triton", triton_attention,
                  Serves(devices=frozenset({"cuda", "cpu"} if INTERPRET else {"cuda"}),
                         max_head_dim=MAX_HEAD_DIM),
                  "Triton flash kernel, forward and backward: band tiles add the key term by a gathered window "
                  "matmul and the value term by a skewed one; CUDA (CPU under TRITON_INTERPRET=1), no dropout",
                  unavailable=unavailable)
