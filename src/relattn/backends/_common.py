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
from torch.autograd.function import once_differentiable

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
    ``rel_bias`` (Hr,2K+1) or None: a scalar per table row (T5's and MPNet's bias), added unscaled at the key term's
    row: ``score_ij = scale * (q_i . k_j + q_i . a^K[idx_ij] + ...) + rel_bias[h, idx_ij]``; its gradient is the sum
    of dS over the pairs of each row. Only backends declaring ``Serves(rel_bias=True)`` ever see one.

    A packed call (:func:`relattn.relative_attention_varlen`) has ``cu_seqlens_q`` and ``cu_seqlens_k``: q is
    (1, H, T, D) and k, v (1, Hkv, T_k, D|Dv) (views of the packed (T, H, D) tensors), sequence ``s`` holding the
    query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1`` (``n_s`` of them) and the key rows of ``cu_seqlens_k``
    likewise (``m_s``); both int32 or int64 1-D tensors of S + 1 entries on q's device, checked (0 first, never
    decreasing, T last). Positions count within each sequence, and a sequence's queries sit at the end of its keys:
    the sequence is the dense call with ``query_offset = m_s - n_s`` (plus ``query_offset``, 0 from the op), causal
    bottom-right. ``max_seqlen_q`` and ``max_seqlen_k`` are the longest ``n_s`` and ``m_s``. ``mask`` is None.
    Backends declaring ``Serves(varlen=True)`` take the packed call whole; the op runs the others sequence by sequence.
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
    rel_bias: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


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
    rel_bias: bool = False  # takes rel_bias, a scalar per table row added unscaled to the scores (T5's, MPNet's)
    chunk_pairs: bool = False  # computes one chunk pair of a larger softmax (its log-sum-exp, and its gradients
    # given the merged output and log-sum-exp): what context parallelism's ring runs; such a backend has ``stats``
    varlen: bool = False  # takes a packed call (cu_seqlens) whole, in one launch (the op runs others per sequence)
    # CUDA: the GPUs served, as ((compute capability 10 * major + minor, the dtypes served there), ...); None: every
    # GPU in every dtype of ``dtypes``
    cuda_archs: tuple[tuple[int, frozenset[torch.dtype]], ...] | None = None


@dataclass(frozen=True)
class Backend:
    """One backend: ``run(call)`` returns the (B,H,N,Dv) output (``packed.run(call)`` a packed call's, where it serves
    them whole); ``declares`` says for which calls, as a
    :class:`Serves` or a function returning one when asked (what "triton" serves depends on ``TRITON_INTERPRET``
    at that moment); ``unavailable()`` says why it cannot run on this machine at all (a missing compiler or
    package), else None."""

    name: str
    run: Callable[[AttentionCall], Tensor]
    declares: Serves | Callable[[], Serves]
    doc: str
    unavailable: Callable[[], str | None] = lambda: None
    stats: StatsOps | None = None  # the ops of a kernel that saves its log-sum-exp (``serves.chunk_pairs``)
    packed: StatsOps | None = None  # the ops that run a packed call whole (``serves.varlen``; varlen=True)

    def __post_init__(self) -> None:
        serves = self.serves
        if serves.chunk_pairs != (self.stats is not None):
            raise ValueError(f"backend {self.name!r}: Serves(chunk_pairs=True) goes with stats ops, and only with them")
        if serves.varlen != (self.packed is not None):
            raise ValueError(f"backend {self.name!r}: Serves(varlen=True) goes with packed ops, and only with them")

    @property
    def serves(self) -> Serves:
        """What the backend serves now."""
        return self.declares if isinstance(self.declares, Serves) else self.declares()


def compute_capability(device: torch.device) -> int | None:
    """A CUDA device's compute capability as ``10 * major + minor`` (75 for a T4, 90 for an H100); None elsewhere."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _sm(arch: int) -> str:
    return f"sm_{arch}"


def declared_reasons(serves: Serves, *, device: str | None = None, dtype: torch.dtype | None = None,
                     dropout: bool = False, mask: bool = False, mask_grad: bool = False, head_dim: int | None = None,
                     v_head_dim: int | None = None, pos_to_content: bool = False,
                     position_query: bool = False, rel_bias: bool = False, chunk_pairs: bool = False,
                     arch: int | None = None) -> list[str]:
    """Every reason a backend declaring ``serves`` refuses calls of this kind; empty when it serves them.

    ``device`` (a device type), ``dtype`` and the head dims ``D`` (``head_dim``) and ``Dv`` (``v_head_dim``, default
    ``D``) are left unchecked when None; ``dropout``, ``mask`` and ``mask_grad`` say whether the calls have
    ``dropout_p > 0``, an ``attn_mask``, a mask that requires grad; ``pos_to_content`` whether they carry a
    ``rel_q`` table; ``position_query`` whether they carry a ``q_pos`` (content or position biases); ``rel_bias``
    whether they carry a scalar bias table;
    ``chunk_pairs`` whether they are a context-parallel ring's chunk pairs; ``arch`` the GPU's compute capability
    on CUDA (None: unchecked). :func:`not_supported_reasons` asks this about one call; the module and ``relattn
    train`` ask it at construction, before there is any call.
    """
    s, reasons = serves, []
    if device is not None and s.devices is not None and device not in s.devices:
        reasons.append(f"device {device} (serves {', '.join(sorted(s.devices))})")
    if dtype is not None and dtype not in s.dtypes:
        reasons.append(f"dtype {dtype} (serves {', '.join(sorted(str(d) for d in s.dtypes))})")
    if device == "cuda" and arch is not None and s.cuda_archs is not None:
        archs = dict(s.cuda_archs)
        if arch not in archs:
            reasons.append(f"GPU compute capability {_sm(arch)} (serves {', '.join(_sm(a) for a in sorted(archs))})")
        elif dtype is not None and dtype in s.dtypes and dtype not in archs[arch]:
            reasons.append(f"dtype {dtype} on {_sm(arch)} (serves {', '.join(sorted(str(d) for d in archs[arch]))}"
                           " there)")
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
    if position_query and not s.position_query:
        reasons.append("a separate position query q_pos (content/position biases; 'native', 'triton', 'blocked' and "
                       "'dense' take it)")
    if rel_bias and not s.rel_bias:
        reasons.append("a scalar bias table rel_bias (T5's; 'native', 'blocked' and 'dense' take it)")
    if chunk_pairs and not s.chunk_pairs:
        reasons.append("a context-parallel chunk pair (returns no log-sum-exp to merge by)")
    return reasons


def not_supported_reasons(backend: Backend, call: AttentionCall, *, chunk_pairs: bool = False) -> list[str]:
    """Every reason ``backend`` cannot serve ``call`` (as a context-parallel chunk pair with ``chunk_pairs``); empty
    when it can."""
    q, mask = call.q, call.mask
    reasons = declared_reasons(backend.serves, device=q.device.type, dtype=q.dtype, dropout=call.dropout_p > 0.0,
                               mask=mask is not None, mask_grad=mask is not None and mask.requires_grad,
                               head_dim=q.shape[-1], v_head_dim=call.v.shape[-1],
                               pos_to_content=call.rel_q is not None, position_query=call.q_pos is not None,
                               rel_bias=call.rel_bias is not None, chunk_pairs=chunk_pairs,
                               arch=compute_capability(q.device))
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


# The arguments every kernel with a saved log-sum-exp takes, in its ops' order: the leading tensors (q, k, v, rel_k?,
# rel_v?, mask?), the scalars, then the optional tensors that came later, each with a gradient after the first five
# (rel_q, the position-to-content table; q_pos, the queries of the key table; rel_bias, the scalar bias table).
LEADING = ("q", "k", "v", "rel_k", "rel_v", "mask")
SCALARS = (("max_relative_position", "int"), ("is_causal", "bool"), ("scale", "float"), ("query_offset", "int"))
TABLES = ("rel_q", "q_pos", "rel_bias")
# What a packed call adds (``StatsOps(varlen=True)``): the cumulative lengths after the leading tensors, the longest
# lengths after the scalars (:class:`AttentionCall`).
VARLEN_LEADING = ("cu_seqlens_q", "cu_seqlens_k")
VARLEN_SCALARS = (("max_seqlen_q", "int"), ("max_seqlen_k", "int"))


class StatsAutograd:
    """The one autograd wiring of a kernel that saves its log-sum-exp, for its custom op, its eager Function and the
    context-parallel ring alike.

    The forward takes ``(*leading, *scalars, *tables)`` (``leading`` tensors or None, the first five q, k, v, rel_k,
    rel_v; ``scalars`` anything; ``tables`` optional tensors) and returns ``(out, lse)``; ``backward(grad_out,
    *leading, out, lse, *scalars, *tables)`` returns ``(dq, dk, dv, d_rel_k, d_rel_v, *d_tables)`` (a table's
    gradient ignored when the table is None). Only ``out`` gets a gradient; none is materialised for ``lse``.
    """

    def __init__(self, backward: Callable, *, leading: int, scalars: int, tables: int = len(TABLES)):
        self.backward, self.leading, self.scalars, self.tables = backward, leading, scalars, tables

    def setup(self, ctx, inputs, output) -> None:
        ctx.set_materialize_grads(False)
        lead, s = self.leading, self.scalars
        ctx.save_for_backward(*inputs[:lead], *inputs[lead + s:], *output[:2])
        ctx.scalars = inputs[lead:lead + s]

    def grads(self, ctx, grad_out, *ignored) -> tuple:
        """The inputs' gradients, None for the mask, the scalars and the tables not given."""
        lead, s, t = self.leading, self.scalars, self.tables
        if grad_out is None:  # grads are not materialised: no gradient reached the output
            return (None,) * (lead + s + t)
        *inputs, out, lse = ctx.saved_tensors
        leading, tables = inputs[:lead], inputs[lead:]
        got = self.backward(grad_out, *leading, out, lse, *ctx.scalars, *tables)
        return (*got[:3], *(g if x is not None else None for g, x in zip(got[3:5], leading[3:5], strict=True)),
                *(None,) * (lead - 5 + s),
                *(None if x is None else g for g, x in zip((*got[5:], *(None,) * t)[:t], tables, strict=True)))

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
    """A kernel backward's gradients as (dq, dk, dv, d_rel_k, d_rel_v, *one per TABLES): None for those it left out
    (a kernel returns d_rel_q, d_q_pos and d_rel_bias only when given them)."""
    return (*grads, *(None,) * len(TABLES))[:5 + len(TABLES)]


class StatsOps:
    """The ops of a kernel that saves its log-sum-exp: ``forward(*leading, **scalars, rel_q, q_pos) -> (out, lse)`` and
    ``backward(grad_out, *leading, out, lse, **scalars, rel_q, q_pos) -> (dq, dk, dv, d_rel_k, d_rel_v[, d_rel_q[,
    d_q_pos]])``: the optional tensors of :data:`TABLES` are passed by name, and only when given (a kernel that does
    not take one is never handed it: its declaration refuses the calls that carry it).

    * ``relattn::{name}_fwd(q, k, v, rel_k?, rel_v?, mask?, [seed,] K, is_causal, [dropout_p,] scale, query_offset,
      rel_q?=None, q_pos?=None, rel_bias?=None) -> (out, lse)`` and ``relattn::{name}_bwd(grad_out, <the same leading
      tensors>, out, lse, <the same scalars>, rel_q?=None, q_pos?=None, rel_bias?=None) -> (dq, dk, dv, d_rel_k,
      d_rel_v, d_rel_q, d_q_pos, d_rel_bias)`` (a
      missing tensor's gradient an empty tensor): custom ops with fake kernels and autograd, which torch.compile
      and torch.export see as one opaque, shape-correct op each. ``dropout=True`` adds the seed tensor and
      ``dropout_p``; ``varlen=True`` (a packed call) the tensors ``cu_seqlens_q, cu_seqlens_k`` after the leading
      ones and the scalars ``max_seqlen_q, max_seqlen_k`` after the others.
    * :meth:`run` gives a call's output: through the op when something traces the call, else through a plain
      autograd Function with the same wiring (:class:`StatsAutograd`) when autograd will ask for a backward (the
      op's dispatch and Python wrappers cost about 0.15 ms of a forward+backward, most of a short sequence's
      overhead), else by calling the kernel.
    * :meth:`pair_forward` and :meth:`pair_backward`: one call's ``(out, lse)`` and its gradients given the merged
      ``out`` and ``lse`` of a larger softmax, what a context-parallel chunk pair needs (no dropout).
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, *, dropout: bool = False,
                 varlen: bool = False,
                 flat_tables: bool = False,  # the forward also takes (2K+1, d) tables (shared, as (1, 2K+1, d))
                 planned: Callable[[AttentionCall], Callable | None] | None = None):  # the kernel's own inference()
        self.name, self.kernel_forward, self.kernel_backward = name, forward, backward
        self.flat_tables, self.planned = flat_tables, planned
        leading = LEADING + (("seed",) if dropout else ()) + (VARLEN_LEADING if varlen else ())
        scalars = (SCALARS[:2] + ((("dropout_p", "float"),) if dropout else ()) + SCALARS[2:]
                   + (VARLEN_SCALARS if varlen else ()))
        self.dropout, self.varlen, self.scalar_names = dropout, varlen, tuple(n for n, _ in scalars)
        self.leading_names = leading
        lead, ns, nt = len(leading), len(scalars), len(TABLES)
        self.wiring = StatsAutograd(self._backward, leading=lead, scalars=ns, tables=nt)

        def tensor(n: str) -> str:
            return f"Tensor{'?' if n in ('rel_k', 'rel_v', 'mask') else ''} {n}"

        args = ", ".join([*(tensor(n) for n in leading)])
        scalars_schema = ", ".join(f"{t} {n}" for n, t in scalars)
        tables_schema = ", ".join(f"Tensor? {n}=None" for n in TABLES)
        fwd_schema = f"({args}, {scalars_schema}, {tables_schema}) -> (Tensor, Tensor)"
        bwd_schema = (f"(Tensor grad_out, {args}, Tensor out, Tensor lse, {scalars_schema}, {tables_schema}) -> "
                      f"({', '.join(['Tensor'] * (5 + nt))})")

        def whole(inputs: tuple, named: dict, count: int) -> tuple:
            """The inputs with the tables the dispatcher left at their defaults (or passed by name) filled in."""
            given = len(inputs) - (count - nt)
            return (*inputs, *(named.get(n) for n in TABLES[given:]))

        def fwd(*inputs, **named):
            inputs = whole(inputs, named, lead + ns + nt)
            return tuple(t.contiguous() for t in self._forward(*inputs))  # the fake kernels promise contiguous

        def bwd(grad_out, *inputs, **named):
            inputs = whole(inputs, named, lead + 2 + ns + nt)
            grads = self._backward(grad_out, *inputs)
            tensors = (*inputs[:5], *inputs[lead + 2 + ns:])  # q, k, v, rel_k, rel_v, then the tables
            return grads_laid_out(tensors, grads)

        self.fwd = torch.library.custom_op(f"relattn::{name}_fwd", fwd, mutates_args=(), schema=fwd_schema)
        self.fwd.register_fake(lambda *inputs, **named: stats_fake(inputs[0], inputs[2]))
        self.bwd = torch.library.custom_op(f"relattn::{name}_bwd", bwd, mutates_args=(), schema=bwd_schema)
        self.bwd.register_fake(lambda grad_out, *inputs, **named: grads_fake(
            *inputs[:5], *whole(inputs, named, lead + 2 + ns + nt)[lead + 2 + ns:]))
        op_wiring = StatsAutograd(self.bwd, leading=lead, scalars=ns, tables=nt)
        self.fwd.register_autograd(op_wiring.grads, setup_context=op_wiring.setup)
        self.eager = self.wiring.function(self._forward)
        self._leading, self._scalars = lead, ns

    def _keywords(self, scalars, tables) -> dict:
        """The kernel's keywords: the scalars, and the optional tensors given (a kernel that does not take one is
        never handed it: its declaration refuses the calls that carry it)."""
        kw = dict(zip(self.scalar_names, scalars, strict=True))
        kw.update((n, t) for n, t in zip(TABLES, tables, strict=True) if t is not None)
        return kw

    def _forward(self, *inputs):
        lead, ns = self._leading, self._scalars
        return self.kernel_forward(*inputs[:lead], **self._keywords(inputs[lead:lead + ns], inputs[lead + ns:]))

    def _backward(self, grad_out, *inputs):
        """(dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias) from ``(*leading, out, lse, *scalars,
        *tables)``."""
        lead, ns = self._leading, self._scalars
        return _padded(self.kernel_backward(grad_out, *inputs[:lead + 2],
                                            **self._keywords(inputs[lead + 2:lead + 2 + ns], inputs[lead + 2 + ns:])))

    def _inputs(self, call: AttentionCall, seed: Tensor | None) -> tuple:
        """The op's inputs from ``call``: each leading tensor and scalar is the call's field of that name."""
        return (*(seed if n == "seed" else getattr(call, n) for n in self.leading_names),
                *(getattr(call, n) for n in self.scalar_names), *(getattr(call, n) for n in TABLES))

    def run(self, call: AttentionCall, *, seed: Tensor | None = None) -> Tensor:
        """The output (B, H, N, Dv) of ``call`` (``seed``: the dropout seed, for a kernel with dropout); a packed call
        only on ops built with ``varlen=True`` (the others would read it as one long sequence: a ValueError)."""
        if (call.cu_seqlens_q is not None) != self.varlen:
            raise ValueError(f"relattn::{self.name} takes {'only' if self.varlen else 'no'} packed calls "
                             f"(cu_seqlens); the backend's packed ops run those")
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
        if self.dropout or _differentiated(call) or any(getattr(call, n) is not None for n in self.leading_names[5:]):
            return None
        if self.planned is not None and (own := self.planned(call)) is not None:
            return own
        kernel, pad = self.kernel_forward, (None,) * (self._leading - 5)
        scalars = {n: getattr(call, n) for n in self.scalar_names if n != "query_offset"}
        named = tuple(n for n in TABLES if getattr(call, n) is not None)
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
                tables = {"rel_q": rel_q, "q_pos": q_pos}  # a call with a rel_bias is never planned
                return kernel(q, k, v, rel_k, rel_v, *pad, query_offset=query_offset, **scalars,
                              **{n: tables[n] for n in named})[0]
        return forward

    def _pair(self, q, k, v, rel_k, rel_v, mask, tables, scalars: dict) -> tuple[tuple, dict]:
        """The kernel's positional inputs and keywords for one chunk pair (no dropout: a zero seed)."""
        lead = (q, k, v, rel_k, rel_v, mask)
        tables = (*tables, *(None,) * (len(TABLES) - len(tables)))  # the ring passes rel_q and q_pos
        if self.dropout:
            lead, scalars = (*lead, torch.zeros((), dtype=torch.int64, device=q.device)), {**scalars, "dropout_p": 0.0}
        return lead, {**scalars, **{n: t for n, t in zip(TABLES, tables, strict=True) if t is not None}}

    def pair_forward(self, q, k, v, rel_k, rel_v, mask, tables, **scalars) -> tuple[Tensor, Tensor]:
        """(out, lse) of one call, no dropout; ``tables``: the optional tensors of :data:`TABLES` (or None);
        ``scalars``: ``max_relative_position``, ``is_causal``, ``scale``, ``query_offset``."""
        lead, kw = self._pair(q, k, v, rel_k, rel_v, mask, tables, scalars)
        return self.kernel_forward(*lead, **kw)

    def pair_backward(self, grad_out, q, k, v, rel_k, rel_v, mask, tables, out, lse, **scalars) -> tuple:
        """(dq, dk, dv, d_rel_k, d_rel_v, *d tables) of one call given the merged ``out`` and ``lse`` of its rows (one
        gradient per table of ``tables``)."""
        lead, kw = self._pair(q, k, v, rel_k, rel_v, mask, tables, scalars)
        return _padded(self.kernel_backward(grad_out, *lead, out, lse, **kw))[:5 + len(tables)]
