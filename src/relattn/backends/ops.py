"""The fast backends as ``torch.library`` custom ops (namespace ``relattn``), with fake kernels and autograd.

``torch.compile`` and ``torch.export`` see each forward and backward as one opaque, shape-correct op:

* ``relattn::blocked_fwd(q, k, v, rel_k?, rel_v?, mask?, seed, K, is_causal, dropout_p, scale, query_offset)``
  -> ``(out (B,H,N,Dv), lse (B,H,N))``; ``relattn::blocked_bwd`` -> ``(dq, dk, dv, d_rel_k, d_rel_v)``.
* ``relattn::fused_fwd(q, k, v, rel_k?, rel_v?, mask?, K, is_causal, scale, query_offset)``
  -> ``(out, lse, band (B,H,N,wb))`` (``fused.band_width``);
  ``relattn::fused_bwd`` -> ``(dq, dk, dv, d_rel_k, d_rel_v)``.

A table gradient is an empty tensor when the table is None (ops cannot return None). ``lse`` and the
band weights are float32 for 16-bit inputs; they are outputs only so that the backward can use them
(their gradients are ignored). The layers: kernels (``blocked.py``, ``fused.py``) -> these ops -> the
backend functions below (the signature of ``dense_attention``) -> ``relattn.relative_attention`` -> modules.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import native as _native
from .blocked import blocked_backward as _blocked_backward_kernel
from .blocked import blocked_forward as _blocked_forward_kernel
from .fused import band_width, stats_dtype
from .fused import fused_backward as _fused_backward_kernel
from .fused import fused_forward as _fused_forward_kernel


def _no_autocast(fn):
    """Run a kernel with autocast off: it computes in its inputs' dtype (16-bit inputs keep float32 softmax
    statistics), instead of autocast re-typing its inner matmuls to bfloat16 behind its back."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


blocked_forward_kernel = _no_autocast(_blocked_forward_kernel)
blocked_backward_kernel = _no_autocast(_blocked_backward_kernel)
fused_forward_kernel = _no_autocast(_fused_forward_kernel)
fused_backward_kernel = _no_autocast(_fused_backward_kernel)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


def _table_grads_fake(q: Tensor, rel_k: Tensor | None, rel_v: Tensor | None) -> tuple[Tensor, Tensor]:
    return (q.new_empty(0) if rel_k is None else torch.empty_like(rel_k),
            q.new_empty(0) if rel_v is None else torch.empty_like(rel_v))


def _grads_fake(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _laid_out_like(grad: Tensor, like: Tensor) -> Tensor:
    """``grad`` with the strides of ``empty_like(like)``, as the fake kernels promise (and as the compilers
    expect of an input's gradient): free for contiguous inputs, one copy for a strided view."""
    if grad.stride() == like.stride():
        return grad
    return torch.empty_like(like).copy_(grad)


def _grads_laid_out(q, k, v, rel_k, rel_v, dq, dk, dv, drk, drv) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A backward op's results: each gradient laid out like its input; a table's an empty tensor when the table
    is None (ops cannot return None)."""
    return (_laid_out_like(dq, q), _laid_out_like(dk, k), _laid_out_like(dv, v),
            _or_empty(drk, q) if rel_k is None else _laid_out_like(drk, rel_k),
            _or_empty(drv, q) if rel_v is None else _laid_out_like(drv, rel_v))


# ---------------------------------------------------------------------------------------------- blocked


@torch.library.custom_op("relattn::blocked_fwd", mutates_args=())
def blocked_fwd(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None, mask: Tensor | None,
                seed: Tensor, max_relative_position: int, is_causal: bool, dropout_p: float, scale: float,
                query_offset: int) -> tuple[Tensor, Tensor]:
    out = blocked_forward_kernel(q, k, v, rel_k, rel_v, mask, seed, max_relative_position=max_relative_position,
                          is_causal=is_causal, dropout_p=dropout_p, scale=scale, query_offset=query_offset)
    return tuple(t.contiguous() for t in out)  # the fake kernels promise contiguous outputs


@blocked_fwd.register_fake
def _(q, k, v, rel_k, rel_v, mask, seed, max_relative_position, is_causal, dropout_p, scale, query_offset):
    b, h, n, _ = q.shape
    return q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n, dtype=stats_dtype(q.dtype))


@torch.library.custom_op("relattn::blocked_bwd", mutates_args=())
def blocked_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None,
                mask: Tensor | None, seed: Tensor, out: Tensor, lse: Tensor, max_relative_position: int,
                is_causal: bool, dropout_p: float, scale: float,
                query_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = blocked_backward_kernel(
        grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, max_relative_position=max_relative_position,
        is_causal=is_causal, dropout_p=dropout_p, scale=scale, query_offset=query_offset)
    return _grads_laid_out(q, k, v, rel_k, rel_v, *grads)


@blocked_bwd.register_fake
def _(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, max_relative_position, is_causal, dropout_p, scale,
      query_offset):
    return (*_grads_fake(q, k, v), *_table_grads_fake(q, rel_k, rel_v))


def _blocked_setup(ctx, inputs, output):
    q, k, v, rel_k, rel_v, mask, seed, kk, is_causal, dropout_p, scale, query_offset = inputs
    ctx.save_for_backward(q, k, v, rel_k, rel_v, mask, seed, *output)
    ctx.args = (kk, is_causal, dropout_p, scale, query_offset)
    ctx.has_tables = (rel_k is not None, rel_v is not None)


def _blocked_backward(ctx, grad_out, grad_lse):
    q, k, v, rel_k, rel_v, mask, seed, out, lse = ctx.saved_tensors
    dq, dk, dv, drk, drv = blocked_bwd(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, *ctx.args)
    return (dq, dk, dv, drk if ctx.has_tables[0] else None, drv if ctx.has_tables[1] else None,
            None, None, None, None, None, None, None)


blocked_fwd.register_autograd(_blocked_backward, setup_context=_blocked_setup)


# ---------------------------------------------------------------------------------------------- fused


@torch.library.custom_op("relattn::fused_fwd", mutates_args=())
def fused_fwd(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None, mask: Tensor | None,
              max_relative_position: int, is_causal: bool, scale: float,
              query_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    out = fused_forward_kernel(q, k, v, rel_k, rel_v, max_relative_position=max_relative_position, is_causal=is_causal,
                               scale=scale, query_offset=query_offset, mask=mask)
    return tuple(t.contiguous() for t in out)


@fused_fwd.register_fake
def _(q, k, v, rel_k, rel_v, mask, max_relative_position, is_causal, scale, query_offset):
    b, h, n, _ = q.shape
    sdt = stats_dtype(q.dtype)
    wb = band_width(max_relative_position, is_causal) if k.shape[2] > 0 and n > 0 else 0
    return (q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n, dtype=sdt), q.new_empty(b, h, n, wb, dtype=sdt))


@torch.library.custom_op("relattn::fused_bwd", mutates_args=())
def fused_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None,
              mask: Tensor | None, out: Tensor, lse: Tensor, band: Tensor, max_relative_position: int,
              is_causal: bool, scale: float, query_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = fused_backward_kernel(
        grad_out, q, k, v, rel_k, rel_v, out, lse, band, max_relative_position=max_relative_position,
        is_causal=is_causal, scale=scale, query_offset=query_offset, mask=mask)
    return _grads_laid_out(q, k, v, rel_k, rel_v, *grads)


@fused_bwd.register_fake
def _(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, band, max_relative_position, is_causal, scale,
      query_offset):
    return (*_grads_fake(q, k, v), *_table_grads_fake(q, rel_k, rel_v))


def _stats_setup(ctx, inputs, output):
    """setup_context of the fused and native ops: save the inputs and every output (out, lse and, for fused, the
    band weights); only ``out`` gets a gradient, so none is materialised for the others (for the band that
    would be (B, H, N, wb) zeros)."""
    q, k, v, rel_k, rel_v, mask, kk, is_causal, scale, query_offset = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, rel_k, rel_v, mask, *output)
    ctx.args = (kk, is_causal, scale, query_offset)
    ctx.has_tables = (rel_k is not None, rel_v is not None)


def _stats_backward(backward_op):
    """The autograd backward of an op set up by ``_stats_setup``: ``backward_op(grad_out, q, k, v, rel_k, rel_v,
    mask, *saved outputs, *args)``."""

    def backward(ctx, grad_out, *ignored):
        if grad_out is None:  # grads are not materialised: no gradient reached the output
            return (None,) * 10
        q, k, v, rel_k, rel_v, mask, *outputs = ctx.saved_tensors
        dq, dk, dv, drk, drv = backward_op(grad_out, q, k, v, rel_k, rel_v, mask, *outputs, *ctx.args)
        return (dq, dk, dv, drk if ctx.has_tables[0] else None, drv if ctx.has_tables[1] else None,
                None, None, None, None, None)

    return backward


fused_fwd.register_autograd(_stats_backward(fused_bwd), setup_context=_stats_setup)


# ---------------------------------------------------------------------------------------------- native


@torch.library.custom_op("relattn::native_fwd", mutates_args=())
def native_fwd(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None, mask: Tensor | None,
               max_relative_position: int, is_causal: bool, scale: float,
               query_offset: int) -> tuple[Tensor, Tensor]:
    return _native.forward(q, k, v, rel_k, rel_v, mask, max_relative_position=max_relative_position,
                           is_causal=is_causal, scale=scale, query_offset=query_offset)


@native_fwd.register_fake
def _(q, k, v, rel_k, rel_v, mask, max_relative_position, is_causal, scale, query_offset):
    b, h, n, _ = q.shape
    return q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n, dtype=stats_dtype(q.dtype))


@torch.library.custom_op("relattn::native_bwd", mutates_args=())
def native_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None,
               mask: Tensor | None, out: Tensor, lse: Tensor, max_relative_position: int, is_causal: bool,
               scale: float, query_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _native.backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse,
                             max_relative_position=max_relative_position, is_causal=is_causal, scale=scale,
                             query_offset=query_offset)
    return _grads_laid_out(q, k, v, rel_k, rel_v, *grads)


@native_bwd.register_fake
def _(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, max_relative_position, is_causal, scale, query_offset):
    return (*_grads_fake(q, k, v), *_table_grads_fake(q, rel_k, rel_v))


native_fwd.register_autograd(_stats_backward(native_bwd), setup_context=_stats_setup)


# ---------------------------------------------------------------------------------------------- backends


def blocked_attention(q, k, v, rel_k, rel_v, *, max_relative_position, mask, is_causal, dropout_p, scale,
                      query_offset):
    """The "blocked" backend: flash algorithm in plain torch, any mask, dropout. Shapes as ``dense_attention``:
    q (B,H,N,D), k (B,H,M,D), v (B,H,M,Dv), tables (Hr,2K+1,D|Dv) or None, mask additive 4-D or None
    -> (B,H,N,Dv). The dropout seed is drawn from torch's default generator (``torch.manual_seed``)."""
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=q.device)
    else:
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
    out, _ = blocked_fwd(q, k, v, rel_k, rel_v, mask, seed, max_relative_position, is_causal, float(dropout_p),
                         float(scale), query_offset)
    return out


def fused_attention(q, k, v, rel_k, rel_v, *, max_relative_position, mask, is_causal, dropout_p, scale,
                    query_offset):
    """The "fused" backend: PyTorch's fused attention for the far regions, a band of 2K-1 keys per row.
    Shapes as ``dense_attention``; no dropout, and a mask only on the CPU (see ``fused_supports``)."""
    if dropout_p > 0.0:
        raise ValueError("the 'fused' backend takes no dropout; use 'blocked' or 'dense'")
    out, _, _ = fused_fwd(q, k, v, rel_k, rel_v, mask, max_relative_position, is_causal, float(scale), query_offset)
    return out


def native_attention(q, k, v, rel_k, rel_v, *, max_relative_position, mask, is_causal, dropout_p, scale,
                     query_offset):
    """The "native" backend: Shaw attention in one flash pass, a C++ kernel (``backends/native.py``). Shapes as
    ``dense_attention``; CPU, any float dtype (16-bit computed in float32), any additive mask that needs no
    gradient, no dropout."""
    if dropout_p > 0.0:
        raise ValueError("the 'native' backend takes no dropout; use 'blocked' or 'dense'")
    out, _ = native_fwd(q, k, v, rel_k, rel_v, mask, max_relative_position, is_causal, float(scale), query_offset)
    return out


def _mask_needs_grad(call) -> str | None:
    if call.mask is not None and call.mask.requires_grad:
        return "attn_mask requires grad (only 'dense' differentiates the mask)"
    return None


def _dropout(call) -> str | None:
    return "dropout_p > 0 (use 'blocked')" if call.dropout_p > 0.0 else None


def native_supports(call) -> str | None:
    if call.q.device.type != "cpu":
        return f"device {call.q.device.type} (the native kernel is CPU only)"
    return _mask_needs_grad(call) or _dropout(call) or _native.unavailable()


def blocked_supports(call) -> str | None:
    return _mask_needs_grad(call)


def fused_supports(call) -> str | None:
    if reason := _mask_needs_grad(call):
        return reason
    if call.mask is not None and call.q.device.type != "cpu":
        return "an attn_mask on cuda (the CUDA route takes none yet; use is_causal, or 'blocked')"
    if reason := _dropout(call):
        return reason
    q = call.q
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type} (cpu and cuda only)"
    if q.is_cuda and q.dtype == torch.float64:
        return "float64 on cuda (the CUDA fused kernels take 16/32-bit floats)"
    return None
