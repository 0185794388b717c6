"""``relative_attention``: Shaw attention shaped like ``torch.nn.functional.scaled_dot_product_attention``.

Notation: ``B`` batch, ``H`` heads, ``N`` query length, ``M`` key length, ``D`` head dim of queries and
keys, ``Dv`` head dim of values, ``K`` max relative position (tables have ``2K + 1`` rows; ``left + right + 1``
for an asymmetric window ``(left, right)``), ``Hkv`` key/value heads (grouped-query attention: ``H % Hkv == 0``).
Inputs may carry any leading dims before ``(L, D)``, as SDPA's: ``(..., H, L, D)``; the last leading dim is the
heads' (there is one head when there is none), the others are batch dims, flattened into ``B`` for the backends.

:func:`validate` (:mod:`relattn.validation`) checks every argument and brings the call to the one form every backend
receives (:class:`relattn.backends.AttentionCall`): 4-D additive masks, (Hr, 2K+1, D) tables clipped symmetrically.
Here: the front doors, the plans of repeated calls, and the packed calls' dispatch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import backends as _backends
from .arguments import PLAN_RULES, AttentionArgs
from .backends import AttentionCall, Backend, Serves, dense_max_scores, priority, resolve
from .backends._common import call_seed, traced
from .positions import BUCKET_MAPS
from .validation import (  # the checks' public names, here too: the op's layer is where callers find them
    additive_mask,
    as_served,
    assemble,
    canonical,
    canonical_mask,
    check_call,
    check_mask,
    shaped_like,
    symmetric_tables,
    validate,
    validate_varlen,
)

# ------------------------------------------------------------------ plans: a repeated call skips validate and resolve
#
# A decoding step repeats the call before it but for the data and one key more: validate's checks would pass again
# and resolve would pick the same backend. A plan, kept per key, is what a call of that key needs past the checks:
# the backend chosen, the scale, which tables are shared (2-D). The key holds everything the checks and the choice
# read (the types, shapes, dtypes, devices and requires_grad of the tensors, every option, grad mode, and from the
# key length M and the query offset only what they decide: the narrowed window and "auto"'s size class), so a call
# that differs in any of them misses, and its full validation raises what it always did. Calls are planned only
# where the checks are cheap to key: a symmetric clipped window (an int K) or a bucket map (whose tables a planned
# call expands for its offsets as validate does), an attn_mask keyed by its shape but the key length, plain tensors,
# no packed lengths, no autocast, nothing tracing; the others always take the full path.

_PLAN_CAPACITY = 512  # distinct keys kept (a model's layers share theirs); the cache is emptied when it is full
_PLAN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAN_NUMBERS = (int, float)
_PLAN_SCALES = (type(None), int, float)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a call of one key runs past the checks: ``backend``, which it keeps while the registry holds the same
    backends under the names it was chosen among, and they are (un)available as they were (``entries``)."""

    backend: Backend
    forward: object  # the backend's kernel call for such calls (StatsOps.inference), or None: backend.run(call)
    direct: bool  # forward takes the call's arguments as they are (no reshaping, biases or narrowing to do)
    registry: dict
    entries: tuple  # ((name, backend, unavailable()), ...): the name asked for, or "auto"'s candidates up to its choice
    kk: int  # the window K as given (a bucket map's: the K its tables expand to, which is reach)
    reach: int  # the window the calls of this key are narrowed to (validate's K)
    positions: object  # the bucket map whose tables each call expands for its offsets, or None (an int K)
    shared: tuple[bool, bool, bool]  # rel_k, rel_v, rel_q given as (2K+1, d): unsqueezed to (1, 2K+1, d)
    is_causal: bool
    dropout_p: float
    scale: float

    def holds(self) -> bool:
        """Whether the choice still stands (tests replace backends and fake their availability)."""
        if _backends.BACKENDS is not self.registry:
            return False
        for name, backend, why in self.entries:
            if self.registry.get(name) is not backend or backend.unavailable() != why:
                return False
        return True


# How plan_key reads a field of each plan rule (relattn.arguments' docstring says what each rule means): a statement
# that sets ``part`` (None: the field adds nothing to the key) or returns None (the call is never planned); q, k and v
# also keep their shapes, which the key's last parts read.
_PLAN_READS = {
    "tensor": "if x is None: part = None\n"
              "elif type(x) in plain: part = (x.shape, x.dtype, x.device, x.requires_grad)\n"
              "else: return None",
    "query": "if type(x) not in plain: return None\n"
             "s = x.shape; shapes.append(s)\n"
             "if len(s) < 2: return None\n"
             "part = (s, x.dtype, x.device, x.requires_grad)",
    "keys": "if type(x) not in plain: return None\n"
            "s = x.shape; shapes.append(s)\n"
            "if len(s) < 2: return None\n"
            "part = (s[:-2], s[-1], x.dtype, x.device, x.requires_grad)",
    "positions": "if type(x) is not int and type(x) not in maps: return None\npart = x",
    "mask": "if x is None: part = None\n"
            "elif type(x) not in plain or x.dim() < 1 or x.shape[-1] not in (1, shapes[1][-2]): return None\n"
            "else: s = x.shape; part = (s[:-1], s[-1] == 1, x.dtype, x.device, x.requires_grad)",
    "bool": "if type(x) is not bool: return None\npart = x",
    "number": "if type(x) not in numbers: return None\npart = x",
    "scale": "if type(x) not in scales: return None\npart = x",
    "name": "if type(x) is not str: return None\npart = x",
    "clip": "if type(x) is not str or x != 'clip': return None\npart = None",
    "offset": "if type(x) is not int: return None\npart = None",
    "absent": "if x is not None: return None\npart = None",
}


def _plan_fields():
    """The first half of :func:`plan_key`: a function of the arguments returning the key of their fields and the
    shapes of q, k, v (or None), written out from :data:`relattn.arguments.PLAN_RULES` (one straight run of checks:
    a loop over the rules would double what a planned decoding step pays before its kernel)."""
    lines, parts = ["def fields(args):", "    shapes = []"], []
    for i, (name, rule) in enumerate(PLAN_RULES):
        lines.append(f"    x = args.{name}")
        lines += ["    " + line for line in _PLAN_READS[rule].replace("part", f"p{i}").splitlines()]
        parts.append(f"p{i}")
    lines.append(f"    return ({', '.join(parts)},), shapes")
    scope = {"plain": _PLAN_TENSORS, "numbers": _PLAN_NUMBERS, "scales": _PLAN_SCALES, "maps": BUCKET_MAPS}
    exec("\n".join(lines), scope)  # noqa: S102 - written from the declared rules above
    return scope["fields"]


_plan_key_of_fields = _plan_fields()


def plan_key(args: AttentionArgs) -> tuple | None:
    """The key of this call's plan, or None for a call that is never planned: each field of ``args`` by its plan rule
    (:data:`relattn.arguments.PLAN_RULES`, :data:`_PLAN_READS`), then what the key length and the query offset decide
    (the narrowed window and "auto"'s size class), and the grad mode."""
    got = _plan_key_of_fields(args)
    if got is None:
        return None
    key, (qs, ks, vs) = got
    if ks[-2] != vs[-2] or torch._C._is_any_autocast_enabled() or traced():
        return None
    kk, offset, n, m = args.max_relative_position, args.query_offset, qs[-2], ks[-2]
    if type(kk) is not int:  # a bucket map: the K its tables expand to for this call's offsets (validate's)
        kk = kk.max_relative_position(-(n - 1) - offset, m - 1 - offset)
    reach = min(kk, max(n - 1 + offset, m - 1 - offset, 0))  # the window validate narrows K to
    return (*key, reach, n * m <= dense_max_scores(reach), torch.is_grad_enabled())


def _keep_plan(key: tuple, args: AttentionArgs, chosen: Backend, call: AttentionCall) -> None:
    """Remember the plan of ``key``: ``call`` was validated from ``args`` and ``chosen`` resolved for it."""
    backend_name = args.backend
    if not isinstance(chosen.declares, Serves):  # what it serves may change between calls (triton's interpreter)
        return
    registry = _backends.BACKENDS
    names = priority(call) if backend_name == "auto" else (backend_name,)
    names = names[:names.index(chosen.name) + 1] if chosen.name in names else (chosen.name,)
    entries = tuple((name, registry[name], registry[name].unavailable()) for name in names)
    if len(_PLANS) >= _PLAN_CAPACITY:
        _PLANS.clear()
    positions = None if type(args.max_relative_position) is int else args.max_relative_position
    forward = None
    if (chosen.stats is not None and chosen.run == chosen.stats.run and as_served(chosen, call) is call
            and call.rel_bias is None and call.mask is None and positions is None):
        forward = chosen.stats.inference(call)  # else the assembled call (inference() takes no bias nor mask)
    # the call's q, k, v and tables are canonical as they were passed (4-D, no biases, the window not narrowed)
    as_given = (args.q.dim() == 4 and args.content_bias is None and args.position_bias is None
                and call.max_relative_position == args.max_relative_position)
    shared = tuple(t is not None and t.dim() == 2 for t in (args.rel_k, args.rel_v, args.rel_q))
    kk = call.max_relative_position if positions is not None else args.max_relative_position
    _PLANS[key] = _Plan(chosen, forward, as_given and forward is not None, registry, entries,
                        kk, call.max_relative_position, positions, shared, call.is_causal, call.dropout_p, call.scale)


_PLANS: dict[tuple, _Plan] = {}


def relative_attention(
    q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor | None = None, rel_v: Tensor | None = None, *,
    max_relative_position: int | tuple[int, int], rel_q: Tensor | None = None, content_bias: Tensor | None = None,
    position_bias: Tensor | None = None, rel_bias: Tensor | None = None, beyond: str = "clip",
    attn_mask: Tensor | None = None, is_causal: bool = False, dropout_p: float = 0.0, scale: float | None = None,
    query_offset: int = 0, enable_gqa: bool = False, backend: str = "auto",
) -> Tensor:
    """Self-attention with relative position representations (Shaw et al., 2018).

    Args:
        q: (B, H, N, D) queries (or, as SDPA takes them, any leading dims: (..., H, N, D), (N, D)). Query ``i``
            sits at absolute position ``i + query_offset``.
        k: (B, H, M, D) keys at positions ``0 .. M-1``; (B, Hkv, M, D) with ``enable_gqa``.
        v: (B, H, M, Dv) values; (B, Hkv, M, Dv) with ``enable_gqa``.
        rel_k: key-side table ``a^K``: (2K+1, D) shared by all heads, (H, 2K+1, D) one per head, or
            None for no relative term on the keys.
        rel_v: value-side table ``a^V``: (2K+1, Dv), (H, 2K+1, Dv) or None.
        rel_q: position-to-content table ``a^Q`` (DeBERTa's p2c term, BERT's ``relative_key_query``): (2K+1, D),
            (H, 2K+1, D) or None. It adds ``k_j . a^Q[idx_ij]`` to the scores, at the same row ``idx_ij`` as the
            key term, and has the key term's window and ``beyond``.
        content_bias: Transformer-XL's ``u`` (NeMo's ``pos_bias_u``): (H, D), one row per query head, or None. It
            adds ``u_h . k_j`` to the scores: the content term reads ``q_i + u``.
        position_bias: Transformer-XL's ``v`` (NeMo's ``pos_bias_v``): (H, D) or None; needs ``rel_k``. It adds
            ``v_h . a^K[idx_ij]``: the key term reads ``q_i + v``. With a window as long as the sequence
            (``K >= N - 1``, ``beyond="clip"``) and the table a projection of sinusoids, the call is
            Transformer-XL's attention (Dai et al., 2019); the op computes only the table rows the call reaches.
        rel_bias: a scalar per table row (T5's and MPNet's relative attention bias): (R,) shared by all heads, (H, R)
            one per head (R the tables' rows), or None. It adds ``rel_bias[h, idx_ij]`` to the scores, unscaled, at
            the key term's row (T5 passes ``scale=1.0`` and no tables; MPNet its bias beside ``1/sqrt(D)``); its
            gradient is the sum of the scores' gradients over the pairs of each row (no atomics: deterministic).
        max_relative_position: ``K``; offsets ``j - i`` are clipped to ``[-K, K]`` and shifted by ``K``.
            A pair ``(left, right)`` clips to ``[-left, right]`` and shifts by ``left`` (tables of
            ``left + right + 1`` rows). A :class:`relattn.positions.LogBuckets` maps offsets to the rows of
            tables of ``2 * span`` rows as DeBERTa does (log buckets, saturating), a
            :class:`relattn.positions.T5Buckets` to the ``num_buckets`` rows of T5's buckets; ``beyond`` must then be
            ``"clip"``.
        beyond: ``"clip"`` (offsets beyond the window take the edge rows, Shaw et al.) or ``"zero"`` (no term).
        attn_mask: bool (True = may attend, as SDPA) or float (added to the scores), broadcastable to (B, H, N, M).
        is_causal: forbid keys ``j > i + query_offset``.
        dropout_p: dropout on the attention weights, applied before both the value sum and the
            relative-value sum. Always applied when > 0 (pass 0.0 at evaluation, as with SDPA).
        scale: score scale, ``1/sqrt(D)`` by default. query_offset: the first query's position (decoding: ``M - N``).
        enable_gqa: grouped-query attention, as SDPA's: k and v may have ``Hkv`` heads with ``H % Hkv == 0``,
            query head ``h`` reading key/value head ``h // (H // Hkv)``. Backends that serve grouped heads read
            them in place; for the others k and v are repeated to H heads.
        backend: ``"auto"`` (the fastest that supports the inputs) or a name from
            :data:`relattn.backends.BACKENDS`.

    Returns:
        (B, H, N, Dv) (q's leading dims, then (N, Dv)): ``out_i = sum_j w_ij (v_j + a^V[idx_ij])`` with
        ``w_i = softmax_j(((q_i + u) . k_j + (q_i + v) . a^K[idx_ij] + k_j . a^Q[idx_ij]) * scale + b[idx_ij]
        + mask_ij)`` (``b`` = ``rel_bias``, ``u``, ``v`` the biases, zero when None) and ``idx_ij = clip(j - i -
        query_offset, -K, K) + K``. A row with nothing to attend to gives zeros (and zero gradients); a NaN in the
        inputs reaches the rows it touches, as in the reference. Under ``torch.autocast`` the inputs are cast as
        autocast casts SDPA's (tables included).
    """
    return attend(AttentionArgs(q, k, v, rel_k, rel_v, max_relative_position=max_relative_position, rel_q=rel_q,
                                content_bias=content_bias, position_bias=position_bias, rel_bias=rel_bias,
                                beyond=beyond, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                scale=scale, query_offset=query_offset, enable_gqa=enable_gqa, backend=backend))


def attend(args: AttentionArgs) -> torch.Tensor:
    """:func:`relative_attention` of ``args``: what the module and every front door that holds an
    :class:`~relattn.arguments.AttentionArgs` calls. A call repeating an earlier one's key (:func:`plan_key`) runs
    its plan: no checks, no resolve."""
    key = plan_key(args)
    if key is not None and (plan := _PLANS.get(key)) is not None and plan.holds():
        if plan.direct:
            return plan.forward(args.q, args.k, args.v, args.rel_k, args.rel_v, args.rel_q, None, args.query_offset)
        if plan.forward is not None:  # one kernel call, the tables as they are
            *tensors, _ = canonical(args, plan.kk, plan.reach)
            return shaped_like(plan.forward(*tensors, args.query_offset), args.q)
        rk, rv, rq = (t.unsqueeze(0) if shared else t
                      for t, shared in zip((args.rel_k, args.rel_v, args.rel_q), plan.shared, strict=True))
        rb = args.rel_bias
        rb = rb.unsqueeze(0) if rb is not None and rb.dim() == 1 else rb  # (R,) -> (1, R), as check_call gives it
        qs, m, offset = args.q.shape, args.k.shape[-2], args.query_offset
        if plan.positions is not None:  # a bucket map's tables, expanded for this call's offsets as check_call does
            _, (rk, rv, rq, rb) = symmetric_tables(plan.positions, "clip", (rk, rv, rq, rb),
                                                   (-(qs[-2] - 1) - offset, m - 1 - offset))
        mask = args.attn_mask
        if mask is not None:
            mask = canonical_mask(mask, (*qs[:-2], qs[-2], m), args.q.dtype)
        checked = args.replace(rel_k=rk, rel_v=rv, rel_q=rq, rel_bias=rb, max_relative_position=plan.kk,
                               attn_mask=mask, is_causal=plan.is_causal, dropout_p=plan.dropout_p, scale=plan.scale)
        call = assemble(checked, plan.reach)
        chosen = plan.backend
    else:
        call = check_call(args)
        chosen = resolve(args.backend, call)
        if key is not None:
            _keep_plan(key, args, chosen, call)
    return shaped_like(chosen.run(as_served(chosen, call)), args.q)


def _dense_with_weights(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    from .backends.dense import BACKEND as DENSE
    from .backends.dense import dense_attention

    return dense_attention(as_served(DENSE, call), need_weights=True)


def relative_attention_with_weights(q, k, v, rel_k=None, rel_v=None, *, max_relative_position, rel_q=None,
                                    content_bias=None, position_bias=None, rel_bias=None, beyond="clip",
                                    attn_mask=None, is_causal=False, dropout_p=0.0, scale=None, query_offset=0,
                                    enable_gqa=False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`relative_attention`'s output and its attention weights ``w`` (before dropout), ``(out, w)``:
    out (B, H, N, Dv) and w (B, H, N, M), in q's leading dims. Computed by the "dense" backend, the one that
    forms the weights; the arguments are :func:`relative_attention`'s."""
    return attend_with_weights(AttentionArgs(
        q, k, v, rel_k, rel_v, max_relative_position=max_relative_position, rel_q=rel_q, content_bias=content_bias,
        position_bias=position_bias, rel_bias=rel_bias, beyond=beyond, attn_mask=attn_mask, is_causal=is_causal,
        dropout_p=dropout_p, scale=scale, query_offset=query_offset, enable_gqa=enable_gqa, backend="dense"))


def attend_with_weights(args: AttentionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`relative_attention_with_weights` of ``args`` (its backend is not read: "dense" forms the weights)."""
    out, weights = _dense_with_weights(check_call(args))
    return shaped_like(out, args.q), shaped_like(weights, args.q)


def relative_attention_weights(q, k, rel_k=None, *, max_relative_position, rel_q=None, content_bias=None,
                               position_bias=None, rel_bias=None, beyond="clip",
                               attn_mask=None, is_causal=False, scale=None, query_offset=0,
                               enable_gqa=False) -> torch.Tensor:
    """The (B, H, N, M) attention weights ``w`` of :func:`relative_attention` (no dropout), in q's leading dims."""
    call = check_call(AttentionArgs(q, k, k[..., :0], rel_k, None, max_relative_position=max_relative_position,
                                    rel_q=rel_q, content_bias=content_bias, position_bias=position_bias,
                                    rel_bias=rel_bias, beyond=beyond,
                                    attn_mask=attn_mask, is_causal=is_causal, scale=scale, query_offset=query_offset,
                                    enable_gqa=enable_gqa, backend="dense"))
    return shaped_like(_dense_with_weights(call)[1], q)


def run_packed(backend: Backend, call: AttentionCall) -> torch.Tensor:
    """The (1, H, T, Dv) output of a packed call on ``backend``: whole where it serves packed calls, else one
    sequence at a time (each the dense call with ``query_offset = m - n``; a sequence without keys gives zeros)."""
    if backend.packed is not None and backend.serves.varlen:
        return backend.packed.run(as_served(backend, call))
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    rows = lambda t, a, b: None if t is None else t[:, :, a:b]  # noqa: E731
    seed = call_seed(call)  # one draw for the call; sequence s draws the mask's batch entry s, as the packed kernels do
    outs = []
    for s in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (cu_q[s], cu_q[s + 1]), (cu_k[s], cu_k[s + 1])
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(call.q.new_zeros(1, call.q.shape[1], q1 - q0, call.v.shape[-1]))
            continue
        offset = call.query_offset + (k1 - k0) - (q1 - q0)
        one = dataclasses.replace(call, q=rows(call.q, q0, q1), k=rows(call.k, k0, k1), v=rows(call.v, k0, k1),
                                  q_pos=rows(call.q_pos, q0, q1), query_offset=offset,
                                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                                  seed=None if seed is None else seed + seed.new_tensor([0, s, 0, 0]))
        outs.append(backend.run(as_served(backend, one)))
    if not outs:
        return call.q.new_zeros(1, call.q.shape[1], call.q.shape[2], call.v.shape[-1])
    return torch.cat(outs, dim=2)


def relative_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_k: torch.Tensor | None = None,
    rel_v: torch.Tensor | None = None,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    max_relative_position: int | tuple[int, int],
    rel_q: torch.Tensor | None = None,
    content_bias: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    beyond: str = "clip",
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`relative_attention` over packed sequences of different lengths, shaped as flash-attention's
    ``flash_attn_varlen_func`` and torch's ``varlen_attn``: no padding is stored or computed.

    Args:
        q: (T, H, D), the queries of every sequence one after another.
        k: (T_k, H, D) keys packed the same way; (T_k, Hkv, D) with ``enable_gqa``.
        v: (T_k, H, Dv) values; (T_k, Hkv, Dv) with ``enable_gqa``.
        rel_k, rel_v: the tables, as :func:`relative_attention`'s (and ``rel_bias``, its scalar bias table).
        cu_seqlens_q: (S + 1,) int32 or int64 on q's device, the cumulative query lengths: sequence ``s`` holds the
            query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1``. It starts at 0, never decreases and ends at T.
        cu_seqlens_k: the same for the keys, ending at T_k; None: ``cu_seqlens_q`` (self-attention).
        max_seqlen_q, max_seqlen_k: the longest query and key lengths, as flash-attention takes them; optional
            (the lengths are read back to check them, one device-to-host copy on a GPU, and the exact maxima used).
        is_causal: forbid, in each sequence, keys after the query's position (bottom-right aligned, as
            flash-attention's varlen causal and a cache: see below).
        The other arguments are :func:`relative_attention`'s; there is no ``attn_mask`` and no ``query_offset``.

    Positions count within each sequence, and a sequence's ``n`` queries sit at the end of its ``m`` keys: query
    ``i`` at position ``i + m - n``, key ``j`` at ``j`` (self-attention: ``n = m``, query ``i`` at ``i``; a decoding
    step against a cache: the new queries after the cached keys). Sequence ``s`` is exactly
    ``relative_attention(q_s, k_s, v_s, ..., query_offset=m - n)`` on its own rows, and its queries never meet
    another sequence's keys. A sequence without keys gives zeros; one without queries gives no rows.

    Returns:
        (T, H, Dv), contiguous. "native" (CPU) and "triton" (CUDA) run the packed batch in one kernel launch; the
        other backends one sequence at a time.
    """
    return attend_varlen(AttentionArgs(
        q, k, v, rel_k, rel_v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, max_relative_position=max_relative_position, rel_q=rel_q, content_bias=content_bias,
        position_bias=position_bias, rel_bias=rel_bias, beyond=beyond, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, enable_gqa=enable_gqa, backend=backend))


def attend_varlen(args: AttentionArgs) -> torch.Tensor:
    """:func:`relative_attention_varlen` of ``args``: (T, H, Dv)."""
    call = validate_varlen(args)
    chosen = resolve(args.backend, call)
    return run_packed(chosen, call)[0].transpose(0, 1).contiguous()


__all__ = ["additive_mask", "as_served", "attend", "attend_varlen", "attend_with_weights", "check_call", "check_mask",
           "plan_key", "relative_attention", "relative_attention_varlen", "relative_attention_weights",
           "relative_attention_with_weights", "run_packed", "validate", "validate_varlen"]
