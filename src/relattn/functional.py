"""``relative_attention``: Shaw attention shaped like ``torch.nn.functional.scaled_dot_product_attention``.

Notation: ``B`` batch, ``H`` heads, ``N`` query length, ``M`` key length, ``D`` head dim of queries and
keys, ``Dv`` head dim of values, ``K`` max relative position (tables have ``2K + 1`` rows; ``left + right + 1``
for an asymmetric window ``(left, right)``), ``Hkv`` key/value heads (grouped-query attention: ``H % Hkv == 0``).
Inputs may carry any leading dims before ``(L, D)``, as SDPA's: ``(..., H, L, D)``; the last leading dim is the
heads' (there is one head when there is none), the others are batch dims, flattened into ``B`` for the backends.

:func:`validate` checks every argument and brings the call to the one form every backend receives
(:class:`relattn.backends.AttentionCall`): 4-D additive masks, (Hr, 2K+1, D) tables clipped symmetrically.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import backends as _backends
from .arguments import PLAN_RULES, AttentionArgs
from .backends import AttentionCall, Backend, Serves, dense_max_scores, priority, resolve
from .backends._common import call_seed, traced
from .positions import check_beyond, check_positions, symmetric_table, table_rows


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_table(name, table, *, heads, rows, dim, like) -> torch.Tensor | None:
    """``table`` checked against (rows, dim) or (heads, rows, dim) and q's dtype and device; (1 | heads, rows, dim)."""
    if table is None:
        return None
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(table).__name__}")
    shape = table.shape
    if len(shape) == 2:
        fits = shape[0] == rows and shape[1] == dim
    elif len(shape) == 3:
        fits = shape[0] in (1, heads) and shape[1] == rows and shape[2] == dim
    else:
        raise ValueError(f"{name} must be (R, D) or (H, R, D) with R = {rows} table rows; got {table.dim()} dims "
                         f"{_shape(table)}")
    if not fits:
        raise ValueError(
            f"{name} must be ({rows}, {dim}) or ({heads}, {rows}, {dim}) for H={heads}, "
            f"{rows} table rows, head dim {dim}; got {_shape(table)}"
        )
    if table.dtype != like.dtype or table.device != like.device:
        _check_like(name, table, like)
    return table.unsqueeze(0) if len(shape) == 2 else table


def _check_scalar_table(table, *, heads, rows, like) -> torch.Tensor | None:
    """``rel_bias`` checked against (rows,) or (heads, rows) and q's dtype and device; (1 | heads, rows)."""
    if table is None:
        return None
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"rel_bias must be a Tensor or None, got {type(table).__name__}")
    shape = tuple(table.shape)
    if shape not in ((rows,), (heads, rows)):
        raise ValueError(f"rel_bias must be ({rows},) or ({heads}, {rows}): one scalar per table row ({rows} rows), "
                         f"shared or per head (H={heads}); got {_shape(table)}")
    if table.dtype != like.dtype or table.device != like.device:
        _check_like("rel_bias", table, like)
    return table.unsqueeze(0) if len(shape) == 1 else table


def _check_like(name, t, like) -> None:
    if t.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but q has dtype {like.dtype}; all inputs must match")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but q is on {like.device}; all inputs must be on one device")


def check_mask(attn_mask, *, target, like) -> torch.Tensor | None:
    """``attn_mask`` checked against ``target`` = (*lead, N, M) and brought to (B or 1, H or 1, N, M), additive."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = may attend) or floating (added); got {attn_mask.dtype}")
    if attn_mask.device != like.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {like.device}")
    shape = tuple(attn_mask.shape)
    if len(shape) > len(target) or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1], strict=False)):
        names = "(B, H, N, M)" if len(target) == 4 else "(..., N, M)"
        raise ValueError(f"attn_mask of shape {_shape(attn_mask)} does not broadcast to {names} = {tuple(target)}")
    mask = attn_mask.reshape((1,) * (len(target) - len(shape)) + shape)
    if len(target) > 4:  # several batch dims: broadcast them, then flatten them into B
        mask = mask.expand(*target[:-3], *mask.shape[-3:]).flatten(0, -4)
    elif len(target) < 4:
        mask = mask.reshape((1,) * (4 - len(target)) + tuple(mask.shape))
    return additive_mask(mask, like.dtype)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask as scores to add: bool (True = may attend) becomes 0 / -inf, a float mask is cast to ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _autocast(tensors: list, device_type: str) -> list:
    """Under ``torch.autocast`` for ``device_type`` (q's), the inputs as autocast casts SDPA's: 16/32-bit floats to
    the autocast dtype (float64 is left alone, as autocast leaves it). Outside autocast, unchanged."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            else t for t in tensors]


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., L, D) as (B, H, L, D): the last leading dim is the heads', the others are flattened into B."""
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.flatten(0, -4) if t.dim() > 4 else t


def validate(q, k, v, rel_k=None, rel_v=None, *, offsets=None, **options) -> AttentionCall:
    """:func:`check_call` of ``AttentionArgs(q, k, v, rel_k, rel_v, **options)``: the checks and the canonical call
    from the op's keywords."""
    return check_call(AttentionArgs(q, k, v, rel_k, rel_v, **options), offsets=offsets)


def check_call(args: AttentionArgs, *, offsets=None) -> AttentionCall:
    """Check every argument of ``args`` and bring the call to the canonical form backends receive (k and v keep their
    ``Hkv`` heads; :func:`relative_attention` repeats them for the backends that need H). ``args.backend`` and the
    packed call's lengths are not read here (:func:`validate_varlen` checks those).

    Transformer-XL's biases are folded in here: ``call.q`` is ``q + content_bias``, ``call.q_pos`` the queries
    of the key table (``q + position_bias``; ``q`` itself when only ``content_bias`` is given and ``rel_k`` is),
    plain torch additions autograd carries back to q and the biases.

    ``offsets`` (lowest, highest): the offsets ``j - i - query_offset`` the tables must serve, by default those of
    this call's N queries and M keys; a call that is one part of a longer sequence (context parallelism) passes
    the whole sequence's, so that a :class:`~relattn.positions.LogBuckets` or zero-beyond table is expanded for
    every offset of the sequence. A window wider than them is narrowed to them: the tables sliced (views) to the
    rows of ``[-R, R]``, ``R = max(-lowest, highest, 0)``, and ``K = R``. Exact, since no row outside is ever read
    (a Transformer-XL call with ``K >= N`` costs ``2N - 1`` rows, not ``2K + 1``); gradients reach the whole tables
    (zeros in the rows no offset reads). Symbolic sizes (torch.export) keep the window as it is.

    Every call pays for this, a decoding step too: each check is a cheap comparison first, and an error's
    message is built only when it is raised."""
    q, k, v, rel_k, rel_v, rel_q = args.q, args.k, args.v, args.rel_k, args.rel_v, args.rel_q
    content_bias, position_bias, enable_gqa = args.content_bias, args.position_bias, args.enable_gqa
    rel_bias = args.rel_bias
    max_relative_position, beyond, query_offset = args.max_relative_position, args.beyond, args.query_offset
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be (..., L, D), at least 2-D; got {t.dim()} dims {_shape(t)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be floating point, got {q.dtype}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    device = q.device
    q, k, v, rel_k, rel_v, rel_q, content_bias, position_bias, rel_bias = _autocast(
        [q, k, v, rel_k, rel_v, rel_q, content_bias, position_bias, rel_bias], device.type)
    dtype = q.dtype
    if k.dtype != dtype or k.device != device:
        _check_like("k", k, q)
    if v.dtype != dtype or v.device != device:
        _check_like("v", v, q)
    qs, ks, vs = q.shape, k.shape, v.shape
    dims = len(qs)
    n, d = qs[-2], qs[-1]
    h = qs[-3] if dims > 2 else 1
    if len(ks) != dims or ks[-1] != d or (ks[0] != qs[0] if dims == 4 else dims > 4 and ks[:-3] != qs[:-3]):
        raise ValueError(_k_message(q, k, d))
    hkv = ks[-3] if dims > 2 else 1
    if hkv != h and not (enable_gqa and hkv > 0 and h % hkv == 0):
        extra = (f" or, with enable_gqa=True, key/value heads dividing H = {h}" if enable_gqa else
                 " (fewer key/value heads than query heads: pass enable_gqa=True)" if hkv and h % hkv == 0 else "")
        raise ValueError(_k_message(q, k, d, extra))
    m = ks[-2]
    if len(vs) != dims or (vs[0] != ks[0] or vs[1] != ks[1] or vs[2] != m if dims == 4 else vs[:-1] != ks[:-1]):
        want = ", ".join(str(x) for x in (*ks[:-1], "Dv"))
        layout = "(B, H, M, Dv)" if dims == 4 else "(..., H, M, Dv)"
        raise ValueError(f"v must be {layout} = ({want}) to match k {_shape(k)}; got {_shape(v)}")
    symmetric = type(max_relative_position) is int and max_relative_position >= 0 and beyond == "clip"
    if symmetric:  # a symmetric clipped window: the kernels' own form, the tables as they are
        kk, rows = max_relative_position, 2 * max_relative_position + 1
    else:
        window, beyond = check_positions(max_relative_position), check_beyond(beyond)
        rows = table_rows(window)
    rel_k, rel_v, rel_q = (_check_table(name, t, heads=h, rows=rows, dim=dim, like=q) for name, t, dim in
                           (("rel_k", rel_k, d), ("rel_v", rel_v, vs[-1]), ("rel_q", rel_q, d)))
    rel_bias = _check_scalar_table(rel_bias, heads=h, rows=rows, like=q)
    if not symmetric:
        if offsets is None:
            offsets = (-(n - 1) - query_offset, m - 1 - query_offset) if isinstance(query_offset, int) else (0, 0)
        (rel_k, kk), (rel_v, _), (rel_q, _) = (symmetric_table(t, window, beyond, offsets=offsets)
                                               for t in (rel_k, rel_v, rel_q))
        if rel_bias is not None:  # as a table of one column
            rel_bias = symmetric_table(rel_bias.unsqueeze(-1), window, beyond, offsets=offsets)[0][..., 0]
    mask = None if args.attn_mask is None else check_mask(args.attn_mask, target=(*qs[:-2], n, m), like=q)
    is_causal, dropout_p, scale = args.is_causal, args.dropout_p, args.scale
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if isinstance(query_offset, bool) or not isinstance(query_offset, int):
        raise TypeError(f"query_offset must be an int, got {type(query_offset).__name__}")
    lowest, highest = offsets if offsets is not None else (-(n - 1) - query_offset, m - 1 - query_offset)
    reach = max(-lowest, highest, 0) if type(lowest) is int and type(highest) is int else kk
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    content_bias = _check_bias("content_bias", content_bias, heads=h, dim=d, like=q)
    position_bias = _check_bias("position_bias", position_bias, heads=h, dim=d, like=q)
    if position_bias is not None and rel_k is None:
        raise ValueError("position_bias is added to the queries that read the key table rel_k, and rel_k is None: "
                         "it would have no effect (pass rel_k, or no position_bias)")
    checked = AttentionArgs(q, k, v, rel_k, rel_v, max_relative_position=kk, rel_q=rel_q, content_bias=content_bias,
                            position_bias=position_bias, rel_bias=rel_bias, attn_mask=mask, is_causal=is_causal,
                            dropout_p=float(dropout_p), scale=float(scale), query_offset=query_offset)
    return _assemble(checked, min(kk, reach))


def _canonical(args: AttentionArgs, kk: int, reach: int) -> tuple:
    """``(q, k, v, rel_k, rel_v, rel_q, q_pos, K)`` of the canonical call from ``args``' tensors, checked (tables
    (Hr, 2K+1, d), or (2K+1, d) on a planned kernel call; q, k, v in their own leading dims), ``kk`` their window's
    K: a window wider than the offsets
    the call reaches (``reach < kk``) narrowed to the tables' rows of ``[-reach, reach]`` (views) with ``K = reach``,
    q, k, v as (B, H, L, d), Transformer-XL's biases folded in. What :func:`validate` ends with, and all a planned
    call does before its kernel runs."""
    q, k, v, rel_k, rel_v, rel_q = args.q, args.k, args.v, args.rel_k, args.rel_v, args.rel_q
    content_bias, position_bias = args.content_bias, args.position_bias
    if reach < kk:
        rows = slice(kk - reach, kk + reach + 1)
        rel_k, rel_v, rel_q = (None if t is None else t[..., rows, :] for t in (rel_k, rel_v, rel_q))
        kk = reach
    if q.dim() != 4:
        q, k, v = _as_4d(q), _as_4d(k), _as_4d(v)
    q_pos = None
    if position_bias is not None:
        q_pos = q + position_bias[:, None, :]
    elif content_bias is not None and rel_k is not None:
        q_pos = q  # the key table reads the queries without the content bias
    if content_bias is not None:
        q = q + content_bias[:, None, :]
    return q, k, v, rel_k, rel_v, rel_q, q_pos, kk


def _assemble(checked: AttentionArgs, reach: int) -> AttentionCall:
    """The canonical call from checked arguments (:func:`_canonical`; the window an int K, the mask canonical
    already, the scale a float; ``rel_bias`` (Hr, 2K+1) narrowed as the tables are)."""
    q, k, v, rel_k, rel_v, rel_q, q_pos, kk = _canonical(checked, checked.max_relative_position, reach)
    rel_bias = checked.rel_bias
    if rel_bias is not None and kk < checked.max_relative_position:
        rel_bias = rel_bias[..., checked.max_relative_position - kk:checked.max_relative_position + kk + 1]
    return AttentionCall(q, k, v, rel_k, rel_v, kk, checked.attn_mask, checked.is_causal, checked.dropout_p,
                         checked.scale, checked.query_offset, rel_q=rel_q, q_pos=q_pos, rel_bias=rel_bias)


def _check_bias(name, bias, *, heads, dim, like) -> torch.Tensor | None:
    """A Transformer-XL bias checked against (H, D), one row per query head, and q's dtype and device."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (heads, dim):
        raise ValueError(f"{name} must be (H, D) = ({heads}, {dim}), one row per query head; got {_shape(bias)}")
    if bias.dtype != like.dtype or bias.device != like.device:
        _check_like(name, bias, like)
    return bias


def _k_message(q, k, d, extra="") -> str:
    layout = "(B, H, M, D)" if q.dim() == 4 else "(..., H, M, D)"
    want = ", ".join(str(x) for x in (*q.shape[:-2], "M", d))
    return f"k must be {layout} = ({want}) to match q {_shape(q)}{extra}; got {_shape(k)}"


def as_served(backend: Backend, call: AttentionCall) -> AttentionCall:
    """``call`` as ``backend`` takes it: k and v repeated to H heads unless it serves grouped key/value heads."""
    groups = call.q.shape[1] // max(call.k.shape[1], 1)
    if groups == 1 or backend.serves.grouped_kv:
        return call
    return dataclasses.replace(call, k=call.k.repeat_interleave(groups, 1), v=call.v.repeat_interleave(groups, 1))


def _shaped_like(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, X) result of the canonical call back in q's leading dims: (..., N, X)."""
    return out if q.dim() == 4 else out.reshape(*q.shape[:-2], *out.shape[-2:])


# ------------------------------------------------------------------ plans: a repeated call skips validate and resolve
#
# A decoding step repeats the call before it but for the data and one key more: validate's checks would pass again
# and resolve would pick the same backend. A plan, kept per key, is what a call of that key needs past the checks:
# the backend chosen, the scale, which tables are shared (2-D). The key holds everything the checks and the choice
# read (the types, shapes, dtypes, devices and requires_grad of the tensors, every option, grad mode, and from the
# key length M and the query offset only what they decide: the narrowed window and "auto"'s size class), so a call
# that differs in any of them misses, and its full validation raises what it always did. Calls are planned only
# where the checks are cheap to key: no attn_mask, a symmetric clipped window (an int K), plain tensors, no
# autocast, nothing tracing; the others always take the full path.

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
    kk: int  # the window K as given
    reach: int  # the window the calls of this key are narrowed to (validate's K)
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
    "int": "if type(x) is not int: return None\npart = x",
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
    scope = {"plain": _PLAN_TENSORS, "numbers": _PLAN_NUMBERS, "scales": _PLAN_SCALES}
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
    forward = None
    if chosen.stats is not None and chosen.run == chosen.stats.run and as_served(chosen, call) is call:
        forward = chosen.stats.inference(call)
    # the call's q, k, v and tables are canonical as they were passed (4-D, no biases, the window not narrowed)
    as_given = (args.q.dim() == 4 and args.content_bias is None and args.position_bias is None
                and call.max_relative_position == args.max_relative_position)
    shared = tuple(t is not None and t.dim() == 2 for t in (args.rel_k, args.rel_v, args.rel_q))
    _PLANS[key] = _Plan(chosen, forward, as_given and forward is not None, registry, entries,
                        args.max_relative_position, call.max_relative_position, shared, call.is_causal,
                        call.dropout_p, call.scale)


_PLANS: dict[tuple, _Plan] = {}


def relative_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_k: torch.Tensor | None = None,
    rel_v: torch.Tensor | None = None,
    *,
    max_relative_position: int | tuple[int, int],
    rel_q: torch.Tensor | None = None,
    content_bias: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    rel_bias: torch.Tensor | None = None,
    beyond: str = "clip",
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    query_offset: int = 0,
    enable_gqa: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
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
        beyond: ``"clip"`` (offsets beyond the window take the edge rows, Shaw et al.) or ``"zero"``
            (they get no relative term: zero embeddings).
        attn_mask: bool (True = may attend, as SDPA) or float (added to the scores), broadcastable
            to (B, H, N, M).
        is_causal: forbid keys ``j > i + query_offset``.
        dropout_p: dropout on the attention weights, applied before both the value sum and the
            relative-value sum. Always applied when > 0 (pass 0.0 at evaluation, as with SDPA).
        scale: score scale, ``1/sqrt(D)`` by default.
        query_offset: absolute position of the first query; ``M - N`` for incremental decoding.
        enable_gqa: grouped-query attention, as SDPA's: k and v may have ``Hkv`` heads with ``H % Hkv == 0``,
            query head ``h`` reading key/value head ``h // (H // Hkv)``. Backends that serve grouped heads read
            them in place; for the others k and v are repeated to H heads.
        backend: ``"auto"`` (the fastest that supports the inputs) or a name from
            :data:`relattn.backends.BACKENDS`.

    Returns:
        (B, H, N, Dv) (q's leading dims, then (N, Dv)): ``out_i = sum_j w_ij (v_j + a^V[idx_ij])`` with
        ``w_i = softmax_j(((q_i + u) . k_j + (q_i + v) . a^K[idx_ij] + k_j . a^Q[idx_ij]) * scale + b[idx_ij]
        + mask_ij)`` (``b`` = ``rel_bias``)
        (``u``, ``v`` the biases, zero when None) and
        ``idx_ij = clip(j - i - query_offset, -K, K) + K``. A row with nothing to attend to gives
        zeros (and zero gradients); a NaN in the inputs reaches the rows it touches, as in the reference.
        Under ``torch.autocast`` the inputs are cast as autocast casts SDPA's (tables included).
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
            *tensors, _ = _canonical(args, plan.kk, plan.reach)
            return _shaped_like(plan.forward(*tensors, args.query_offset), args.q)
        rk, rv, rq = (t.unsqueeze(0) if shared else t
                      for t, shared in zip((args.rel_k, args.rel_v, args.rel_q), plan.shared, strict=True))
        checked = args.replace(rel_k=rk, rel_v=rv, rel_q=rq, max_relative_position=plan.kk, is_causal=plan.is_causal,
                               dropout_p=plan.dropout_p, scale=plan.scale)
        call = _assemble(checked, plan.reach)
        chosen = plan.backend
    else:
        call = check_call(args)
        chosen = resolve(args.backend, call)
        if key is not None:
            _keep_plan(key, args, chosen, call)
    return _shaped_like(chosen.run(as_served(chosen, call)), args.q)


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
    return _shaped_like(out, args.q), _shaped_like(weights, args.q)


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
    return _shaped_like(_dense_with_weights(call)[1], q)


def _check_lengths(name: str, cu, *, total: int, like: torch.Tensor, what: str) -> list[int]:
    """``cu`` checked as cumulative lengths of ``total`` packed rows (1-D int32/int64 on q's device, 0 first, never
    decreasing, ``total`` last), read back as a list (one device-to-host copy on a GPU)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor of cumulative lengths, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64 (cumulative lengths), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D (S + 1,) for S sequences, got {cu.dim()} dims {_shape(cu)}")
    if cu.device != like.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {like.device}")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:], strict=False)):
        s = next(i for i, (a, b) in enumerate(zip(values, values[1:], strict=False)) if b < a)
        raise ValueError(f"{name} must never decrease (cumulative lengths); entry {s + 1} is {values[s + 1]} "
                         f"after {values[s]}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the number of packed {what}, {total}; got {values[-1]}")
    return values


def _check_longest(name: str, given, lengths: list[int], what: str) -> int:
    """The longest of ``lengths``, checked against the ``max_seqlen`` given (None: not given)."""
    longest = max(lengths, default=0)
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name} must be an int or None, got {type(given).__name__}")
    if given < longest:
        s = lengths.index(longest)
        raise ValueError(f"{name} = {given} but sequence {s} has {longest} {what}")
    return longest


def _check_packed(name: str, t, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be packed {dims}, 3-D; got {t.dim()} dims {_shape(t)}")


def validate_varlen(args: AttentionArgs) -> AttentionCall:
    """:func:`check_call` for packed sequences (``args.cu_seqlens_q`` given): the lengths checked, then the call as one
    (1, H, T, D) batch entry with the lengths attached (:class:`relattn.backends.AttentionCall`), its tables sized for
    the offsets of the longest sequences."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = args.q, args.k, args.v, args.cu_seqlens_q, args.cu_seqlens_k
    _check_packed("q", q, "(T, H, D)")
    _check_packed("k", k, "(T_k, Hkv, D)")
    _check_packed("v", v, "(T_k, Hkv, Dv)")
    cu_q = _check_lengths("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], like=q, what="queries (q.shape[0])")
    if cu_seqlens_k is None:
        cu_k, cu_seqlens_k = cu_q, cu_seqlens_q
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"cu_seqlens_k is None (the keys' lengths are the queries'), but k has {k.shape[0]} rows "
                             f"and q {q.shape[0]}: pass cu_seqlens_k")
    else:
        cu_k = _check_lengths("cu_seqlens_k", cu_seqlens_k, total=k.shape[0], like=q, what="keys (k.shape[0])")
        if len(cu_k) != len(cu_q):
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; got {len(cu_q) - 1} "
                             f"and {len(cu_k) - 1}")
    n = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    m = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    longest_q = _check_longest("max_seqlen_q", args.max_seqlen_q, n, "queries")
    longest_k = _check_longest("max_seqlen_k", args.max_seqlen_k, m, "keys")
    met = [(ns, ms) for ns, ms in zip(n, m, strict=True) if ns > 0 and ms > 0]
    offsets = (-max((ms - 1 for _, ms in met), default=0), max((ns - 1 for ns, _ in met), default=0))
    batched = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    call = check_call(args.replace(**dict(zip("qkv", batched, strict=True)), cu_seqlens_q=None, cu_seqlens_k=None,
                                   max_seqlen_q=None, max_seqlen_k=None), offsets=offsets)
    return dataclasses.replace(call, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=longest_q,
                               max_seqlen_k=longest_k)


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
