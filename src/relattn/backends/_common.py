"""What every backend shares: the validated call, the declaration of what a backend serves, the one function that
turns a declaration into refusal reasons, and the plumbing of a ``torch.library`` custom op with a saved
log-sum-exp (fake kernels, gradient layout, autograd setup).

Notation: ``B`` batch, ``H`` heads, ``N`` queries, ``M`` keys, ``D``/``Dv`` head dims, ``K`` max relative
position; tables arrive as ``(Hr, 2K+1, D|Dv)`` with ``Hr`` in ``{1, H}``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics (max, log-sum-exp) are kept in float32 for 16-bit inputs."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@dataclass(frozen=True)
class AttentionCall:
    """The validated, canonical inputs of one call: what a backend receives.

    q (B,H,N,D), k (B,Hkv,M,D), v (B,Hkv,M,Dv) with ``H % Hkv == 0`` (grouped-query attention: query head ``h``
    reads key/value head ``h // (H // Hkv)``; only backends declaring ``Serves(grouped_kv=True)`` ever see
    ``Hkv < H``, the others get k and v repeated to H heads by the op); tables (Hr,2K+1,D|Dv) or None, clipped
    symmetrically to [-K, K] (:func:`relattn.functional.validate` brings asymmetric windows and zero-beyond
    tables to this form); ``mask`` None or an additive float tensor of 4 dims broadcastable to (B,H,N,M).
    ``rel_q`` (Hr,2K+1,D) or None: the position-to-content table, adding ``k_j . rel_q[idx_ij]`` to the scores at
    the key term's row ``idx_ij = clip(j - i - query_offset, -K, K) + K``; only backends declaring
    ``Serves(pos_to_content=True)`` ever see one.
    ``q_pos`` (B,H,N,D) or None: the queries the key table ``rel_k`` reads, apart from the content queries ``q``
    (Transformer-XL's biases: ``q = q + content_bias``, ``q_pos = q + position_bias``); None means ``q`` itself.
    Only backends declaring ``Serves(position_query=True)`` ever see one; they return its gradient apart from q's.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    rel_k: Tensor | None
    rel_v: Tensor | None
    max_relative_position: int
    mask: Tensor | None
    is_causal: bool
    dropout_p: float
    scale: float
    query_offset: int
    rel_q: Tensor | None = None
    q_pos: Tensor | None = None


@dataclass(frozen=True)
class Serves:
    """What a backend serves, as data. ``None`` for ``devices`` means any device."""

    devices: frozenset[str] | None = None
    dtypes: frozenset[torch.dtype] = FLOATS
    dropout: bool = False
    mask: bool = True
    mask_grad: bool = False
    max_head_dim: int | None = None
    head_dims_differ: bool = True  # D != Dv
    grouped_kv: bool = False  # takes k, v with fewer heads than q (H % Hkv == 0) without repeating them
    pos_to_content: bool = False  # takes rel_q, the position-to-content table (DeBERTa's p2c, BERT's key_query)
    position_query: bool = False  # takes q_pos, queries for the key table apart from q (Transformer-XL's biases)


@dataclass(frozen=True)
class Backend:
    """One backend: ``run(call)`` returns the (B,H,N,Dv) output; ``serves`` says for which calls;
    ``unavailable()`` says why it cannot run on this machine at all (a missing compiler or package), else None."""

    name: str
    run: Callable[[AttentionCall], Tensor]
    serves: Serves
    doc: str
    unavailable: Callable[[], str | None] = lambda: None


def declared_reasons(serves: Serves, *, device: str | None = None, dtype: torch.dtype | None = None,
                     dropout: bool = False, mask: bool = False, mask_grad: bool = False, head_dim: int | None = None,
                     v_head_dim: int | None = None, pos_to_content: bool = False) -> list[str]:
    """Every reason a backend declaring ``serves`` refuses calls of this kind; empty when it serves them.

    ``device`` (a device type), ``dtype`` and the head dims ``D`` (``head_dim``) and ``Dv`` (``v_head_dim``, default
    ``D``) are left unchecked when None; ``dropout``, ``mask`` and ``mask_grad`` say whether the calls have
    ``dropout_p > 0``, an ``attn_mask``, a mask that requires grad; ``pos_to_content`` whether they carry a
    ``rel_q`` table. :func:`not_supported_reasons` asks this about
    one call; the module and ``relattn train`` ask it at construction, before there is any call.
    """
    s, reasons = serves, []
    if device is not None and s.devices is not None and device not in s.devices:
        reasons.append(f"device {device} (serves {', '.join(sorted(s.devices))})")
    if dtype is not None and dtype not in s.dtypes:
        reasons.append(f"dtype {dtype} (serves {', '.join(sorted(str(d) for d in s.dtypes))})")
    if dropout and not s.dropout:
        reasons.append("dropout_p > 0 (no dropout; 'blocked' and 'dense' take it)")
    if mask and not s.mask:
        reasons.append("an attn_mask (takes none; use is_causal, or 'blocked')")
    if mask and mask_grad and not s.mask_grad:
        reasons.append("attn_mask requires grad (only 'dense' differentiates the mask)")
    d = head_dim
    dv = d if v_head_dim is None else v_head_dim
    if d is not None and s.max_head_dim is not None and max(d, dv) > s.max_head_dim:
        reasons.append(f"head dim {max(d, dv)} (at most {s.max_head_dim})")
    if d is not None and d != dv and not s.head_dims_differ:
        reasons.append(f"D = {d} != Dv = {dv} (needs equal head dims)")
    if pos_to_content and not s.pos_to_content:
        reasons.append("a position-to-content table rel_q (no k . a^Q term; 'native', 'triton', 'blocked' and "
                       "'dense' take it)")
    return reasons


def not_supported_reasons(backend: Backend, call: AttentionCall) -> list[str]:
    """Every reason ``backend`` cannot serve ``call``; empty when it can."""
    q, mask = call.q, call.mask
    reasons = declared_reasons(backend.serves, device=q.device.type, dtype=q.dtype, dropout=call.dropout_p > 0.0,
                               mask=mask is not None, mask_grad=mask is not None and mask.requires_grad,
                               head_dim=q.shape[-1], v_head_dim=call.v.shape[-1],
                               pos_to_content=call.rel_q is not None)
    if not reasons and (why := backend.unavailable()) is not None:
        reasons.append(why)
    return reasons


def no_autocast(fn):
    """Run a kernel with autocast off: it computes in its inputs' dtype (16-bit inputs keep float32 softmax
    statistics), instead of autocast re-typing its inner matmuls behind its back."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


# ------------------------------------------------------------------ custom-op plumbing (outputs out and lse)


def stats_fake(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The fake forward of an op returning (out (B,H,N,Dv), lse (B,H,N))."""
    b, h, n, _ = q.shape
    return q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n, dtype=stats_dtype(q.dtype))


def grads_fake(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None,
               *rel_q: Tensor | None) -> tuple[Tensor, ...]:
    """The fake backward: (dq, dk, dv, d_rel_k, d_rel_v[, d_rel_q[, d_q_pos]]), each of the optional inputs' an
    empty tensor when the input is None."""
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            *(q.new_empty(0) if t is None else torch.empty_like(t) for t in (rel_k, rel_v, *rel_q)))


def _laid_out_like(grad: Tensor, like: Tensor) -> Tensor:
    """``grad`` with the strides of ``empty_like(like)``, as the fake kernels promise (and as the compilers
    expect of an input's gradient): free for contiguous inputs, one copy for a strided view."""
    if grad.stride() == like.stride():
        return grad
    return torch.empty_like(like).copy_(grad)


def grads_laid_out(inputs, grads) -> tuple[Tensor, ...]:
    """A backward op's results for ``inputs = (q, k, v, rel_k, rel_v)``: each gradient laid out like its input;
    a table's an empty tensor when the table is None (ops cannot return None)."""
    return tuple(inputs[0].new_empty(0) if t is None else _laid_out_like(g, t)
                 for g, t in zip(grads, inputs, strict=True))


def register_stats_autograd(forward_op, backward_op, *, tensor_inputs: int, n_args: int, tail: int = 1) -> None:
    """Autograd for ``forward_op(q, k, v, rel_k, rel_v, *more tensors, *args, rel_q[, q_pos]) -> (out, lse, ...)``,
    whose first ``tensor_inputs`` inputs are tensors (or None) to save, whose last ``tail`` inputs are the optional
    ``rel_q`` table (and, with ``tail=2``, the position queries ``q_pos``), and whose backward is
    ``backward_op(grad_out, *those tensors, *saved outputs, *args, *tail)`` -> ``(dq, dk, dv, d_rel_k, d_rel_v,
    d_rel_q[, d_q_pos])``. Only ``out`` gets a gradient; none is materialised for the statistics."""

    def setup(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[:tensor_inputs], *inputs[-tail:], *output)
        ctx.args = inputs[tensor_inputs:-tail]
        ctx.present = (inputs[3] is not None, inputs[4] is not None, *(t is not None for t in inputs[-tail:]))

    def backward(ctx, grad_out, *ignored):
        if grad_out is None:  # grads are not materialised: no gradient reached the output
            return (None,) * n_args
        *saved, out, lse = ctx.saved_tensors
        saved, optional = saved[:-tail], saved[-tail:]
        dq, dk, dv, drk, drv, *more = backward_op(grad_out, *saved, out, lse, *ctx.args, *optional)
        has_k, has_v, *has_more = ctx.present
        return (dq, dk, dv, drk if has_k else None, drv if has_v else None, *(None,) * (n_args - 5 - tail),
                *(g if has else None for g, has in zip(more, has_more, strict=True)))

    forward_op.register_autograd(backward, setup_context=setup)


def define_stats_ops(name: str, forward: Callable, backward: Callable):
    """The custom ops of a kernel that saves its log-sum-exp, with fake kernels and autograd:

    * ``relattn::{name}_fwd(q, k, v, rel_k?, rel_v?, mask?, K, is_causal, scale, query_offset, rel_q?=None,
      q_pos?=None)`` -> ``(out, lse)`` around ``forward(q, k, v, rel_k, rel_v, mask, *, max_relative_position,
      is_causal, scale, query_offset, rel_q[, q_pos])`` (``q_pos`` passed only when given);
    * ``relattn::{name}_bwd(grad_out, q, k, v, rel_k?, rel_v?, mask?, out, lse, K, is_causal, scale, query_offset,
      rel_q?=None, q_pos?=None)`` -> ``(dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos)`` around ``backward`` (same
      keywords), which returns the five gradients, a sixth, ``d_rel_q``, when ``rel_q`` is given, and a seventh,
      ``d_q_pos`` (the key table's share of the position queries' gradient, apart from dq), when ``q_pos`` is.

    Returns the forward op. torch.compile and torch.export see each as one opaque, shape-correct op.
    """

    def position_query(q_pos):  # q_pos as a keyword, only when given (a kernel without one never sees it)
        return {} if q_pos is None else {"q_pos": q_pos}

    @torch.library.custom_op(f"relattn::{name}_fwd", mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None, mask: Tensor | None,
            max_relative_position: int, is_causal: bool, scale: float, query_offset: int,
            rel_q: Tensor | None = None, q_pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return forward(q, k, v, rel_k, rel_v, mask, max_relative_position=max_relative_position,
                       is_causal=is_causal, scale=scale, query_offset=query_offset, rel_q=rel_q,
                       **position_query(q_pos))

    @fwd.register_fake
    def _(q, k, v, rel_k, rel_v, mask, max_relative_position, is_causal, scale, query_offset, rel_q=None,
          q_pos=None):
        return stats_fake(q, v)

    @torch.library.custom_op(f"relattn::{name}_bwd", mutates_args=())
    def bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None, rel_v: Tensor | None,
            mask: Tensor | None, out: Tensor, lse: Tensor, max_relative_position: int, is_causal: bool,
            scale: float, query_offset: int, rel_q: Tensor | None = None,
            q_pos: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        grads = backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse,
                         max_relative_position=max_relative_position, is_causal=is_causal, scale=scale,
                         query_offset=query_offset, rel_q=rel_q, **position_query(q_pos))
        return grads_laid_out((q, k, v, rel_k, rel_v, rel_q, q_pos), (*grads, None, None)[:7])

    @bwd.register_fake
    def _(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, max_relative_position, is_causal, scale, query_offset,
          rel_q=None, q_pos=None):
        return grads_fake(q, k, v, rel_k, rel_v, rel_q, q_pos)

    register_stats_autograd(fwd, bwd, tensor_inputs=6, n_args=12, tail=2)
    return fwd
