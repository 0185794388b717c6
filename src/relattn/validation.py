"""The op's checks: every argument of a call checked (a bad one gets an error naming it) and the call brought to the
one form every backend receives (:class:`relattn.backends.AttentionCall`: q, k, v as (B, H, L, D), 4-D additive
masks, (Hr, 2K+1, D) tables clipped symmetrically, Transformer-XL's biases folded into the queries), for the dense
front doors (:func:`check_call`, :func:`validate`) and packed calls (:func:`validate_varlen`).

Notation as in :mod:`relattn.functional`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .arguments import AttentionArgs
from .backends import AttentionCall, Backend
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
    return canonical_mask(attn_mask, target, like.dtype)


def canonical_mask(attn_mask: torch.Tensor, target, dtype: torch.dtype) -> torch.Tensor:
    """A mask that broadcasts to ``target`` = (*lead, N, M) as (B or 1, H or 1, N, M), additive in ``dtype``: what
    :func:`check_mask` returns once it has checked the mask (and a planned call, whose key says it would pass)."""
    shape = tuple(attn_mask.shape)
    mask = attn_mask.reshape((1,) * (len(target) - len(shape)) + shape)
    if len(target) > 4:  # several batch dims: broadcast them, then flatten them into B
        mask = mask.expand(*target[:-3], *mask.shape[-3:]).flatten(0, -4)
    elif len(target) < 4:
        mask = mask.reshape((1,) * (4 - len(target)) + tuple(mask.shape))
    return additive_mask(mask, dtype)


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
    q, k, v, (rel_k, rel_v, rel_q, content_bias, position_bias, rel_bias) = _checked_tensors(args)
    qs, m = q.shape, k.shape[-2]
    n, d, h = qs[-2], qs[-1], qs[-3] if q.dim() > 2 else 1
    kk, (rel_k, rel_v, rel_q, rel_bias), offsets = _checked_tables(args, q, v, (rel_k, rel_v, rel_q, rel_bias),
                                                                   offsets, h=h, n=n, m=m)
    mask = None if args.attn_mask is None else check_mask(args.attn_mask, target=(*qs[:-2], n, m), like=q)
    is_causal, dropout_p, scale, query_offset = args.is_causal, args.dropout_p, args.scale, args.query_offset
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
    return assemble(checked, min(kk, reach))


def _checked_tensors(args: AttentionArgs):
    """q, k, v and the six optional tensors (``rel_k, rel_v, rel_q, content_bias, position_bias, rel_bias``) of
    ``args``, cast as autocast casts them; q, k, v checked: tensors of one dtype and device, k and v shaped to match
    q (grouped heads with ``enable_gqa``)."""
    q, k, v, enable_gqa = args.q, args.k, args.v, args.enable_gqa
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
    q, k, v, *optional = _autocast([q, k, v, args.rel_k, args.rel_v, args.rel_q, args.content_bias,
                                    args.position_bias, args.rel_bias], device.type)
    if k.dtype != q.dtype or k.device != device:
        _check_like("k", k, q)
    if v.dtype != q.dtype or v.device != device:
        _check_like("v", v, q)
    qs, ks, vs = q.shape, k.shape, v.shape
    dims, d = len(qs), qs[-1]
    h = qs[-3] if dims > 2 else 1
    if len(ks) != dims or ks[-1] != d or (ks[0] != qs[0] if dims == 4 else dims > 4 and ks[:-3] != qs[:-3]):
        raise ValueError(_k_message(q, k, d))
    hkv = ks[-3] if dims > 2 else 1
    if hkv != h and not (enable_gqa and hkv > 0 and h % hkv == 0):
        extra = (f" or, with enable_gqa=True, key/value heads dividing H = {h}" if enable_gqa else
                 " (fewer key/value heads than query heads: pass enable_gqa=True)" if hkv and h % hkv == 0 else "")
        raise ValueError(_k_message(q, k, d, extra))
    if len(vs) != dims or (vs[0] != ks[0] or vs[1] != ks[1] or vs[2] != ks[2] if dims == 4 else vs[:-1] != ks[:-1]):
        want = ", ".join(str(x) for x in (*ks[:-1], "Dv"))
        layout = "(B, H, M, Dv)" if dims == 4 else "(..., H, M, Dv)"
        raise ValueError(f"v must be {layout} = ({want}) to match k {_shape(k)}; got {_shape(v)}")
    return q, k, v, optional


def _checked_tables(args: AttentionArgs, q, v, tables, offsets, *, h: int, n: int, m: int):
    """``(K, (rel_k, rel_v, rel_q, rel_bias), offsets)``: the window and the tables checked against it, in the
    kernels' symmetric clipped form (a symmetric clipped window as it is; any other expanded for ``offsets``, by
    default the call's, which are returned)."""
    rel_k, rel_v, rel_q, rel_bias = tables
    max_relative_position, beyond, query_offset = args.max_relative_position, args.beyond, args.query_offset
    d = q.shape[-1]
    symmetric = type(max_relative_position) is int and max_relative_position >= 0 and beyond == "clip"
    if symmetric:  # a symmetric clipped window: the kernels' own form, the tables as they are
        kk, rows = max_relative_position, 2 * max_relative_position + 1
    else:
        window, beyond = check_positions(max_relative_position), check_beyond(beyond)
        rows = table_rows(window)
    rel_k, rel_v, rel_q = (_check_table(name, t, heads=h, rows=rows, dim=dim, like=q) for name, t, dim in
                           (("rel_k", rel_k, d), ("rel_v", rel_v, v.shape[-1]), ("rel_q", rel_q, d)))
    rel_bias = _check_scalar_table(rel_bias, heads=h, rows=rows, like=q)
    if not symmetric:
        if offsets is None:
            offsets = (-(n - 1) - query_offset, m - 1 - query_offset) if isinstance(query_offset, int) else (0, 0)
        kk, (rel_k, rel_v, rel_q, rel_bias) = symmetric_tables(window, beyond, (rel_k, rel_v, rel_q, rel_bias),
                                                               offsets)
    return kk, (rel_k, rel_v, rel_q, rel_bias), offsets


def symmetric_tables(window, beyond: str, tables, offsets: tuple[int, int]):
    """``(K, (rel_k, rel_v, rel_q, rel_bias))``: checked tables of a window that is not symmetric and clipped (or of
    a bucket map) as the symmetric clipped ones the kernels take (:func:`relattn.positions.symmetric_table`), for
    the offsets ``(lowest, highest)``; ``rel_bias`` (Hr, R) as a table of one column."""
    *tables, rel_bias = tables
    tables.append(None if rel_bias is None else rel_bias.unsqueeze(-1))
    kk, out = None, []
    for t in tables:  # each table given expanded, K found once per table (a decoding step pays for each)
        t, kk = (None, kk) if t is None else symmetric_table(t, window, beyond, offsets=offsets)
        out.append(t)
    if kk is None:
        kk = symmetric_table(None, window, beyond, offsets=offsets)[1]
    rel_k, rel_v, rel_q, rel_bias = out
    return kk, (rel_k, rel_v, rel_q, None if rel_bias is None else rel_bias[..., 0])


def canonical(args: AttentionArgs, kk: int, reach: int) -> tuple:
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


def assemble(checked: AttentionArgs, reach: int) -> AttentionCall:
    """The canonical call from checked arguments (:func:`canonical`; the window an int K, the mask canonical
    already, the scale a float; ``rel_bias`` (Hr, 2K+1) narrowed as the tables are)."""
    q, k, v, rel_k, rel_v, rel_q, q_pos, kk = canonical(checked, checked.max_relative_position, reach)
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


def shaped_like(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, X) result of the canonical call back in q's leading dims: (..., N, X)."""
    return out if q.dim() == 4 else out.reshape(*q.shape[:-2], *out.shape[-2:])


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


__all__ = ["additive_mask", "as_served", "assemble", "canonical", "check_call", "check_mask", "shaped_like", "validate",
           "validate_varlen"]
