"""What every backend shares: the validated call and the declaration of what a backend serves (from
:mod:`relattn.backends._call`, whose names are here too), and the plumbing of a ``torch.library`` custom op with a
saved log-sum-exp (the ops' arguments and schemas, fake kernels, gradient layout, autograd setup).

Notation: ``B`` batch, ``H`` heads, ``N`` queries, ``M`` keys, ``D``/``Dv`` head dims, ``K`` max relative
position; tables arrive as ``(Hr, 2K+1, D|Dv)`` with ``Hr`` in ``{1, H}``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._call import (  # the call and the declarations: every backend imports them from here
    FLOATS,
    LOW_PRECISION,
    AttentionCall,
    Backend,
    Serves,
    call_seed,
    compute_capability,
    dropout_keep,
    dropout_seed,
    keep_scale,
    mix32,
    stats_dtype,
)


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


# relattn::{name}_fwd's arguments, in order: (name, schema type, which ops take it). Each is the AttentionCall field
# of its name (``seed``: the dropout seed the op draws); ``"dropout"`` / ``"varlen"``: only the ops built with
# StatsOps(dropout=True) / StatsOps(varlen=True). Three groups, in this order: the leading tensors (q, k, v, rel_k,
# rel_v, mask and what the op kind adds), the scalars, and the trailing optional tensors, each with a gradient (rel_q,
# the position-to-content table; q_pos, the queries of the key table; rel_bias, the scalar bias per table row), passed
# to the kernels by name and only when given. relattn::{name}_bwd takes (grad_out, *leading, out, lse, *scalars,
# *trailing) and returns (dq, dk, dv, d_rel_k, d_rel_v, *one per trailing tensor). docs/architecture.md shows the
# native op's schemas.
OP_ARGUMENTS: tuple[tuple[str, str, str | None], ...] = (
    ("q", "Tensor", None),
    ("k", "Tensor", None),
    ("v", "Tensor", None),
    ("rel_k", "Tensor?", None),
    ("rel_v", "Tensor?", None),
    ("mask", "Tensor?", None),
    ("seed", "Tensor?", "dropout"),
    ("cu_seqlens_q", "Tensor", "varlen"),
    ("cu_seqlens_k", "Tensor", "varlen"),
    ("max_relative_position", "int", None),
    ("is_causal", "bool", None),
    ("dropout_p", "float", "dropout"),
    ("scale", "float", None),
    ("query_offset", "int", None),
    ("max_seqlen_q", "int", "varlen"),
    ("max_seqlen_k", "int", "varlen"),
    ("rel_q", "Tensor?", None),
    ("q_pos", "Tensor?", None),
    ("rel_bias", "Tensor?", None),
)
_FIRST_SCALAR = next(i for i, (_, t, _) in enumerate(OP_ARGUMENTS) if not t.startswith("Tensor"))
TRAILING = tuple(n for n, t, _ in OP_ARGUMENTS[_FIRST_SCALAR:] if t.startswith("Tensor"))  # rel_q, q_pos, rel_bias


@dataclass(frozen=True)
class OpSignature:
    """The arguments of one kind of op (:data:`OP_ARGUMENTS` for ``dropout``, ``varlen``), by group: ``leading``
    tensor names, ``scalars`` as (name, type), ``trailing`` tensor names; the slices where each group sits in the
    forward's inputs (``(*leading, *scalars, *trailing)``) and the backward's (``(*leading, out, lse, *scalars,
    *trailing)``, grad_out apart); and the two ops' schemas."""

    leading: tuple[str, ...]
    scalars: tuple[tuple[str, str], ...]
    trailing: tuple[str, ...]

    @staticmethod
    def of(*, dropout: bool = False, varlen: bool = False) -> OpSignature:
        taken = [(n, t) for n, t, only in OP_ARGUMENTS
                 if only is None or (only == "dropout" and dropout) or (only == "varlen" and varlen)]
        tensors = [n for n, t in taken if t.startswith("Tensor")]
        scalars = tuple((n, t) for n, t in taken if not t.startswith("Tensor"))
        return OpSignature(tuple(n for n in tensors if n not in TRAILING), scalars, TRAILING)

    @functools.cached_property
    def fwd_leading(self) -> slice:
        return slice(0, len(self.leading))

    @functools.cached_property
    def fwd_scalars(self) -> slice:
        return slice(len(self.leading), len(self.leading) + len(self.scalars))

    @functools.cached_property
    def fwd_trailing(self) -> slice:
        return slice(len(self.leading) + len(self.scalars), None)

    @functools.cached_property
    def bwd_leading(self) -> slice:  # then out, lse
        return slice(0, len(self.leading) + 2)

    @functools.cached_property
    def bwd_scalars(self) -> slice:
        return slice(len(self.leading) + 2, len(self.leading) + 2 + len(self.scalars))

    @functools.cached_property
    def bwd_trailing(self) -> slice:
        return slice(len(self.leading) + 2 + len(self.scalars), None)

    @functools.cached_property
    def fwd_schema(self) -> str:
        return f"({self._arguments()}) -> (Tensor, Tensor)"

    @functools.cached_property
    def bwd_schema(self) -> str:
        grads = ", ".join(["Tensor"] * (5 + len(self.trailing)))
        return f"({self._arguments(backward=True)}) -> ({grads})"

    def _arguments(self, backward: bool = False) -> str:
        types = {n: t for n, t, _ in OP_ARGUMENTS}
        parts = [f"{types[n]} {n}" for n in self.leading]
        if backward:
            parts = ["Tensor grad_out", *parts, "Tensor out", "Tensor lse"]
        parts += [f"{t} {n}" for n, t in self.scalars]
        parts += [f"{types[n]} {n}=None" for n in self.trailing]
        return ", ".join(parts)


class StatsAutograd:
    """The one autograd wiring of a kernel that saves its log-sum-exp, for its custom op, its eager Function and the
    context-parallel ring alike.

    The forward takes ``(*leading, *scalars, *trailing)`` (``leading`` tensors or None, the first five q, k, v, rel_k,
    rel_v; ``scalars`` anything; ``trailing`` optional tensors) and returns ``(out, lse)``; ``backward(grad_out,
    *leading, out, lse, *scalars, *trailing)`` returns ``(dq, dk, dv, d_rel_k, d_rel_v, *d_trailing)`` (a trailing
    tensor's gradient ignored when the tensor is None); the counts are :class:`OpSignature`'s groups'. Only ``out``
    gets a gradient; none is materialised for ``lse``.
    """

    def __init__(self, backward: Callable, *, leading: int, scalars: int, trailing: int = len(TRAILING)):
        self.backward, self.leading, self.scalars, self.trailing = backward, leading, scalars, trailing

    def setup(self, ctx, inputs, output) -> None:
        ctx.set_materialize_grads(False)
        lead, s = self.leading, self.scalars
        ctx.save_for_backward(*inputs[:lead], *inputs[lead + s:], *output[:2])
        ctx.scalars = inputs[lead:lead + s]

    def grads(self, ctx, grad_out, *ignored) -> tuple:
        """The inputs' gradients, None for the mask, the scalars and the trailing tensors not given."""
        lead, s, t = self.leading, self.scalars, self.trailing
        if grad_out is None:  # grads are not materialised: no gradient reached the output
            return (None,) * (lead + s + t)
        *inputs, out, lse = ctx.saved_tensors
        leading, trailing = inputs[:lead], inputs[lead:]
        got = self.backward(grad_out, *leading, out, lse, *ctx.scalars, *trailing)
        return (*got[:3], *(g if x is not None else None for g, x in zip(got[3:5], leading[3:5], strict=True)),
                *(None,) * (lead - 5 + s),
                *(None if x is None else g for g, x in zip((*got[5:], *(None,) * t)[:t], trailing, strict=True)))

    def function(self, forward: Callable) -> type[torch.autograd.Function]:
        """A plain autograd Function around ``forward``: what the custom op's autograd does, without its dispatch."""
        wiring = self

        class StatsFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                # forward(ctx, ...) rather than setup_context: Function.apply binds a setup_context Function's
                # arguments through inspect.signature on every call (some 50 us)
                out, lse = forward(*inputs)
                wiring.setup(ctx, inputs, (out, lse))
                return out

            @staticmethod
            @once_differentiable
            def backward(ctx, grad_out):
                return wiring.grads(ctx, grad_out)

        return StatsFunction


def _differentiated(call: AttentionCall) -> bool:
    """Whether autograd will ask for a backward of this call."""
    return torch.is_grad_enabled() and (call.q.requires_grad or call.k.requires_grad or call.v.requires_grad or any(
        t is not None and t.requires_grad for t in (call.rel_k, call.rel_v, call.mask, call.rel_q, call.q_pos,
                                                    call.rel_bias)))


def traced() -> bool:
    """Whether something traces or transforms the call: torch.compile and torch.export, a dispatch mode (make_fx's,
    FakeTensorMode), a torch function mode, a torch.func transform. Those see the custom op (fake kernels,
    registered autograd); plain eager calls skip its dispatch and wrappers."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active())


def _padded(grads: tuple) -> tuple:
    """A kernel backward's gradients as (dq, dk, dv, d_rel_k, d_rel_v, *one per TRAILING): None for those it left out
    (a kernel returns d_rel_q, d_q_pos and d_rel_bias only when given them)."""
    return (*grads, *(None,) * len(TRAILING))[:5 + len(TRAILING)]


def schema_version(*schemas: str) -> str:
    """The short hash of a pair of ops' schemas that their names carry (``relattn::{name}_fwd_{version}``).
    torch.compile's on-disk caches are keyed by the traced graph, which names the ops it calls but not their
    schemas: a graph an older relattn cached (its backward too) calls ops of names that code registered; once a
    schema changes, so does the name, the graph a new relattn traces differs, and the stale entry is never hit
    (nor could it find an op of its name registered with other arguments)."""
    return hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:8]


class StatsOps:
    """The ops of a kernel that saves its log-sum-exp: ``forward(*leading, **scalars, rel_q, q_pos) -> (out, lse)`` and
    ``backward(grad_out, *leading, out, lse, **scalars, rel_q, q_pos) -> (dq, dk, dv, d_rel_k, d_rel_v[, d_rel_q[,
    d_q_pos]])``: the optional tensors of :data:`TRAILING` are passed by name, and only when given (a kernel that does
    not take one is never handed it: its declaration refuses the calls that carry it).

    * ``relattn::{name}_fwd_{version}(q, k, v, rel_k?, rel_v?, mask?, [seed,] K, is_causal, [dropout_p,] scale,
      query_offset, rel_q?=None, q_pos?=None) -> (out, lse)`` and ``relattn::{name}_bwd_{version}(grad_out, <the same
      leading tensors>, out, lse, <the same scalars>, rel_q?=None, q_pos?=None) -> (dq, dk, dv, d_rel_k, d_rel_v,
      d_rel_q, d_q_pos)`` (a missing tensor's gradient an empty tensor): custom ops with fake kernels and autograd,
      which torch.compile and torch.export see as one opaque, shape-correct op each; ``version`` is
      :func:`schema_version` of the two schemas (``fwd_name``, ``bwd_name``: the ops' qualified names; ``fwd_op``,
      ``bwd_op``: the ops). ``dropout=True`` adds the seed tensor and
      ``dropout_p``; ``varlen=True`` (a packed call) the tensors ``cu_seqlens_q, cu_seqlens_k`` after the leading
      ones and the scalars ``max_seqlen_q, max_seqlen_k`` after the others.
    * :meth:`run` gives a call's output: through the op when something traces the call, else through a plain
      autograd Function with the same wiring (:class:`StatsAutograd`) when autograd will ask for a backward (the
      op's dispatch and Python wrappers cost about 0.15 ms of a forward+backward, most of a short sequence's
      overhead), else by calling the kernel.
    * :meth:`pair_forward` and :meth:`pair_backward`: one call's ``(out, lse)`` and its gradients given the merged
      ``out`` and ``lse`` of a larger softmax, what a context-parallel chunk pair needs (dropout with a seed whose
      offsets place the pair in the whole call's mask).
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, *, dropout: bool = False,
                 varlen: bool = False,
                 flat_tables: bool = False,  # the forward also takes (2K+1, d) tables (shared, as (1, 2K+1, d))
                 planned: Callable[[AttentionCall], Callable | None] | None = None):  # the kernel's own inference()
        self.name, self.kernel_forward, self.kernel_backward = name, forward, backward
        self.flat_tables, self.planned = flat_tables, planned
        self.signature = sig = OpSignature.of(dropout=dropout, varlen=varlen)
        self.dropout, self.varlen = dropout, varlen
        self.leading_names, self.scalar_names = sig.leading, tuple(n for n, _ in sig.scalars)
        lead, ns, nt = len(sig.leading), len(sig.scalars), len(sig.trailing)
        self.wiring = StatsAutograd(self._backward, leading=lead, scalars=ns, trailing=nt)

        def whole(inputs: tuple, named: dict, trailing: slice) -> tuple:
            """The inputs with the trailing tensors the dispatcher left at their defaults (or passed by name)."""
            given = len(inputs[trailing])
            return (*inputs, *(named.get(n) for n in sig.trailing[given:]))

        def fwd(*inputs, **named):
            inputs = whole(inputs, named, sig.fwd_trailing)
            return tuple(t.contiguous() for t in self._forward(*inputs))  # the fake kernels promise contiguous

        def bwd(grad_out, *inputs, **named):
            inputs = whole(inputs, named, sig.bwd_trailing)
            grads = self._backward(grad_out, *inputs)
            tensors = (*inputs[:5], *inputs[sig.bwd_trailing])  # q, k, v, rel_k, rel_v, then the trailing tensors
            return grads_laid_out(tensors, grads)

        version = schema_version(sig.fwd_schema, sig.bwd_schema)
        self.fwd_name, self.bwd_name = f"relattn::{name}_fwd_{version}", f"relattn::{name}_bwd_{version}"
        self.fwd = torch.library.custom_op(self.fwd_name, fwd, mutates_args=(), schema=sig.fwd_schema)
        self.fwd.register_fake(lambda *inputs, **named: stats_fake(inputs[0], inputs[2]))
        self.bwd = torch.library.custom_op(self.bwd_name, bwd, mutates_args=(), schema=sig.bwd_schema)
        self.bwd.register_fake(lambda grad_out, *inputs, **named: grads_fake(
            *inputs[:5], *whole(inputs, named, sig.bwd_trailing)[sig.bwd_trailing]))
        # the ops as torch.ops holds them (OpOverloadPackets: ``.default`` is the overload), for tests and tools
        self.fwd_op, self.bwd_op = (getattr(torch.ops.relattn, n.split("::")[1])
                                    for n in (self.fwd_name, self.bwd_name))
        op_wiring = StatsAutograd(self.bwd, leading=lead, scalars=ns, trailing=nt)
        self.fwd.register_autograd(op_wiring.grads, setup_context=op_wiring.setup)
        self.eager = self.wiring.function(self._forward)

    def _keywords(self, scalars, trailing) -> dict:
        """The kernel's keywords: the scalars, and the trailing tensors given (a kernel that does not take one is
        never handed it: its declaration refuses the calls that carry it)."""
        kw = dict(zip(self.scalar_names, scalars, strict=True))
        kw.update((n, t) for n, t in zip(TRAILING, trailing, strict=True) if t is not None)
        return kw

    def _forward(self, *inputs):
        sig = self.signature
        return self.kernel_forward(*inputs[sig.fwd_leading],
                                   **self._keywords(inputs[sig.fwd_scalars], inputs[sig.fwd_trailing]))

    def _backward(self, grad_out, *inputs):
        """(dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias) from ``(*leading, out, lse, *scalars,
        *trailing)``."""
        sig = self.signature
        return _padded(self.kernel_backward(grad_out, *inputs[sig.bwd_leading],
                                            **self._keywords(inputs[sig.bwd_scalars], inputs[sig.bwd_trailing])))

    def _inputs(self, call: AttentionCall, seed: Tensor | None) -> tuple:
        """The op's inputs from ``call``: each leading tensor and scalar is the call's field of that name."""
        return (*(seed if n == "seed" else getattr(call, n) for n in self.leading_names),
                *(getattr(call, n) for n in self.scalar_names), *(getattr(call, n) for n in TRAILING))

    def run(self, call: AttentionCall, *, seed: Tensor | None = None) -> Tensor:
        """The output (B, H, N, Dv) of ``call`` (``seed``: the dropout seed, for a kernel with dropout; None: the
        call's own, else drawn by :func:`dropout_seed` with dropout, else None); a packed call only on
        ops built with ``varlen=True`` (the others would read it as one long sequence: a ValueError)."""
        if (call.cu_seqlens_q is not None) != self.varlen:
            raise ValueError(f"relattn::{self.name} takes {'only' if self.varlen else 'no'} packed calls "
                             f"(cu_seqlens); the backend's packed ops run those")
        if self.dropout and seed is None:
            seed = call_seed(call)
        inputs = self._inputs(call, seed)
        if traced():
            return self.fwd(*inputs)[0]
        if _differentiated(call):
            return self.eager.apply(*inputs)
        return self._forward(*inputs)[0]

    def inference(self, call: AttentionCall) -> Callable[..., Tensor] | None:
        """What :meth:`run` does for calls like ``call`` (the same shapes, scalars and tables given, but for the
        query offset) when nothing traces them and autograd will not differentiate them, as one function
        ``f(q, k, v, rel_k, rel_v, rel_q, q_pos, query_offset) -> out`` calling the kernel with ``call``'s other
        scalars: what a planned decoding step runs. Its tables may also be (2K+1, d), shared by all heads (a kernel
        that does not take them so, ``flat_tables=False``, gets them as (1, 2K+1, d)). A kernel may give its own
        (``planned``: the same function, leaner; None to take this one). None where :meth:`run` needs more than
        that (a differentiated call, a mask, a dropout seed, a packed call)."""
        if (call.dropout_p > 0.0 or _differentiated(call)
                or any(getattr(call, n) is not None for n in self.leading_names[5:])):
            return None
        if self.planned is not None and (own := self.planned(call)) is not None:
            return own
        kernel, pad = self.kernel_forward, (None,) * (len(self.leading_names) - 5)
        scalars = {n: getattr(call, n) for n in self.scalar_names if n != "query_offset"}
        named = tuple(n for n in TRAILING if getattr(call, n) is not None)
        if not self.flat_tables:
            def headed(t):
                return t.unsqueeze(0) if t is not None and t.dim() == 2 else t

            inner = self.kernel_forward

            def kernel(q, k, v, rel_k, rel_v, *lead, rel_q=None, **kw):
                return inner(q, k, v, headed(rel_k), headed(rel_v), *lead, **kw,
                             **({} if rel_q is None else {"rel_q": headed(rel_q)}))
        if not named:
            def forward(q, k, v, rel_k, rel_v, rel_q, q_pos, query_offset):
                return kernel(q, k, v, rel_k, rel_v, *pad, query_offset=query_offset, **scalars)[0]
        else:
            def forward(q, k, v, rel_k, rel_v, rel_q, q_pos, query_offset):
                trailing = {"rel_q": rel_q, "q_pos": q_pos}  # a rel_bias call's plan runs the assembled call
                return kernel(q, k, v, rel_k, rel_v, *pad, query_offset=query_offset, **scalars,
                              **{n: trailing[n] for n in named})[0]
        return forward

    def _pair(self, q, k, v, rel_k, rel_v, mask, tables, seed, scalars: dict) -> tuple[tuple, dict]:
        """The kernel's positional inputs and keywords for one chunk pair (without dropout_p in ``scalars``: none)."""
        lead = (q, k, v, rel_k, rel_v, mask)
        tables = (*tables, *(None,) * (len(TRAILING) - len(tables)))  # the ring passes rel_q and q_pos
        if self.dropout:
            if seed is None:
                seed = torch.zeros((), dtype=torch.int64, device=q.device)
            lead, scalars = (*lead, seed), {"dropout_p": 0.0, **scalars}
        elif scalars.pop("dropout_p", 0.0) > 0.0:
            raise ValueError(f"relattn::{self.name} takes no dropout")
        return lead, {**scalars, **{n: t for n, t in zip(TRAILING, tables, strict=True) if t is not None}}

    def pair_forward(self, q, k, v, rel_k, rel_v, mask, tables, *, seed: Tensor | None = None,
                     **scalars) -> tuple[Tensor, Tensor]:
        """(out, lse) of one call; ``tables``: the trailing tensors of :data:`TRAILING` (or None); ``scalars``:
        ``max_relative_position``, ``is_causal``, ``scale``, ``query_offset`` and optionally ``dropout_p``, with
        ``seed`` placing the pair in the mask (:func:`dropout_seed`: its offsets the pair's first row and key)."""
        lead, kw = self._pair(q, k, v, rel_k, rel_v, mask, tables, seed, scalars)
        return self.kernel_forward(*lead, **kw)

    def pair_backward(self, grad_out, q, k, v, rel_k, rel_v, mask, tables, out, lse, *, seed: Tensor | None = None,
                      **scalars) -> tuple:
        """(dq, dk, dv, d_rel_k, d_rel_v, *d tables) of one call given the merged ``out`` and ``lse`` of its rows (one
        gradient per table of ``tables``)."""
        lead, kw = self._pair(q, k, v, rel_k, rel_v, mask, tables, seed, scalars)
        return _padded(self.kernel_backward(grad_out, *lead, out, lse, **kw))[:5 + len(tables)]


__all__ = ["FLOATS", "LOW_PRECISION", "OP_ARGUMENTS", "TRAILING", "AttentionCall", "Backend", "OpSignature", "Serves",
           "StatsAutograd", "StatsOps", "call_seed", "compute_capability", "dropout_keep", "dropout_seed",
           "grads_fake", "grads_laid_out", "keep_scale", "mix32", "no_autocast", "schema_version", "stats_dtype",
           "stats_fake", "traced"]
