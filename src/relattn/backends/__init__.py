"""Backends, picked by one checked string: the registry, ``choose`` (what ``"auto"`` runs) and ``resolve``.

A backend is one file, ``backends/<name>.py``, ending in ``BACKEND = Backend(name, run, Serves(...), doc)``:
``run`` takes the validated :class:`AttentionCall` and returns the output; ``Serves`` declares what it serves,
and :func:`why_not` derives every refusal from that declaration (:data:`REFUSED`). Adding a backend is that file
and one line in ``_REGISTERED`` below (see docs/architecture.md).
"""

from __future__ import annotations

import torch

from . import blocked, dense, native, triton
from ._common import (
    FLOATS,
    AttentionCall,
    Backend,
    Serves,
    StatsAutograd,
    StatsOps,
    call_seed,
    compute_capability,
    stats_dtype,
)

_REGISTERED = (dense.BACKEND, blocked.BACKEND, native.BACKEND, triton.BACKEND)


def _serves_line(s: Serves) -> str:
    """What a declaration serves, in a few words."""
    parts = ["any device" if s.devices is None else "/".join(sorted(s.devices))]
    if s.dtypes != FLOATS:
        parts.append(", ".join(sorted(str(d).removeprefix("torch.") for d in s.dtypes)))
    parts.append("dropout" if s.dropout else "no dropout")
    parts.append(("masks with gradients" if s.mask_grad else "masks") if s.mask else "no masks")
    if s.max_head_dim is not None:
        parts.append(f"head dim <= {s.max_head_dim}")
    if not s.head_dims_differ:
        parts.append("D = Dv only")
    if s.cuda_archs is not None:
        parts.append("GPUs sm_" + ",".join(str(arch) for arch, _ in s.cuda_archs))
    if s.grouped_kv:
        parts.append("grouped k/v heads in place")
    return ", ".join(parts)


class Registry(dict):
    """The registered backends by name; printed one line each: name, what it serves, what it does."""

    def __repr__(self) -> str:
        width = max((len(n) for n in self), default=0)
        lines = [f"  {n:<{width}}  {_serves_line(b.serves)}: {b.doc}" for n, b in self.items()]
        return "relattn backends ('auto' picks the fastest that serves a call):\n" + "\n".join(lines)


BACKENDS: Registry = Registry((b.name, b) for b in _REGISTERED)

# Priority lists of "auto", per device: the order in which it tries the backends. The device's kernel comes
# first ("native" on the CPU, "triton" on CUDA); after it "dense" for problems of at most dense_max_scores(K)
# scores per head and "blocked" for larger ones, so that at large sizes "auto" never builds an (N, M) tensor.
# The measurements behind the order and the threshold: benchmarks/README.md, "What auto's order rests on".
_SMALL = {"cpu": ("native", "dense", "blocked"), "cuda": ("triton", "dense", "blocked")}
_LARGE = {"cpu": ("native", "blocked", "dense"), "cuda": ("triton", "blocked", "dense")}
_OTHER_DEVICES = (("dense", "blocked"), ("blocked", "dense"))


def dense_max_scores(max_relative_position: int) -> int:
    """Largest N*M per head for which "auto" prefers "dense" over "blocked" (see the priority lists above)."""
    return (256 + 3 * max_relative_position) ** 2


def check_name(name: object, *, what: str = "backend") -> str:
    """``name`` if it is ``"auto"`` or a registered backend, else a ValueError listing the valid choices."""
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        valid = ", ".join(repr(n) for n in ["auto", *BACKENDS])
        raise ValueError(f"{what} must be one of {valid}; got {name!r}")
    return name


# ------------------------------------------------------------------ why a backend refuses: derived from Serves

# Each Serves flag -> the reason a backend declaring it False refuses a call that needs it; {takers}: the registered
# backends declaring it True, in the order "auto" prefers them. Devices, dtypes, GPUs and head dims are compared
# with the declared values in _declared_reasons.
REFUSED = {
    "dropout": "dropout_p > 0 (no dropout; {takers} take it)",
    "mask": "an attn_mask (takes none; use is_causal, or {takers})",
    "mask_grad": "attn_mask requires grad (only {takers} differentiates the mask)",
    "pos_to_content": "a position-to-content table rel_q (no k . a^Q term; {takers} take it)",
    "position_query": "a separate position query q_pos (content/position biases; {takers} take it)",
    "rel_bias": "a scalar bias table rel_bias (T5's; {takers} take it)",
    "chunk_pairs": "a context-parallel chunk pair (returns no log-sum-exp to merge by)",
}


def _takers(flag: str) -> str:
    """The registered backends declaring ``flag``, quoted, "auto"'s preference first: 'a', 'b' and 'c'."""
    preferred = dict.fromkeys(name for names in zip(*_LARGE.values(), strict=True) for name in names)
    names = [n for n in (*preferred, *BACKENDS) if n in BACKENDS and getattr(BACKENDS[n].serves, flag)]
    quoted = [repr(n) for n in dict.fromkeys(names)] or ["no registered backend"]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _sm(arch: int) -> str:
    return f"sm_{arch}"


def _declared_reasons(s: Serves, *, device: str | None = None, dtype: torch.dtype | None = None,
                      dropout: bool = False, mask: bool = False, mask_grad: bool = False, head_dim: int | None = None,
                      v_head_dim: int | None = None, pos_to_content: bool = False, position_query: bool = False,
                      rel_bias: bool = False, chunk_pairs: bool = False, arch: int | None = None) -> list[str]:
    """Every reason a backend declaring ``s`` refuses calls of this kind (the keywords as :func:`why_not` takes
    them; a None leaves a property unchecked); empty when it serves them."""
    reasons = []
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
    needs = {"dropout": dropout, "mask": mask, "mask_grad": mask and mask_grad}
    for flag in ("dropout", "mask", "mask_grad"):
        if needs[flag] and not getattr(s, flag):
            reasons.append(REFUSED[flag].format(takers=_takers(flag)))
    d = head_dim
    dv = d if v_head_dim is None else v_head_dim
    if d is not None and s.max_head_dim is not None and max(d, dv) > s.max_head_dim:
        reasons.append(f"head dim {max(d, dv)} (at most {s.max_head_dim})")
    if d is not None and d != dv and not s.head_dims_differ:
        reasons.append(f"D = {d} != Dv = {dv} (needs equal head dims)")
    needs = {"pos_to_content": pos_to_content, "position_query": position_query, "rel_bias": rel_bias,
             "chunk_pairs": chunk_pairs}
    for flag, needed in needs.items():
        if needed and not getattr(s, flag):
            reasons.append(REFUSED[flag].format(takers=_takers(flag)))
    return reasons


def _kinds_of(call: AttentionCall) -> dict:
    """What :func:`_declared_reasons` asks of one call."""
    q, mask = call.q, call.mask
    return dict(device=q.device.type, dtype=q.dtype, dropout=call.dropout_p > 0.0, mask=mask is not None,
                mask_grad=mask is not None and mask.requires_grad, head_dim=q.shape[-1], v_head_dim=call.v.shape[-1],
                pos_to_content=call.rel_q is not None, position_query=call.q_pos is not None,
                rel_bias=call.rel_bias is not None, arch=compute_capability(q.device))


def why_not(what: str | Backend | AttentionCall, call: AttentionCall | None = None, *, chunk_pairs: bool = False,
            **kinds) -> list[str] | dict[str, list[str]]:
    """Why a backend was not, or will not be, chosen: the one question, asked three ways.

    * ``why_not(call)``: for each backend "auto" prefers to the one it chose for ``call``, why it could not serve
      it (a dict, name -> reasons).
    * ``why_not(backend, call)``: every reason ``backend`` (a name or a :class:`Backend`) refuses ``call``; empty
      when it serves it.
    * ``why_not(name, **kinds)``: every reason backend ``name`` will refuse the calls a module, model or run of
      this kind makes, known at construction, before any call (``kinds``: ``device`` (a type), ``dtype``,
      ``dropout``, ``mask``, ``head_dim``, ``v_head_dim``, ``pos_to_content``, ``position_query``, ``rel_bias``;
      None or absent leaves a property unchecked; on CUDA the current GPU's). ``"auto"`` refuses nothing.

    The reasons come from the backend's :class:`Serves` declaration (:data:`REFUSED`), then, if that allows the
    calls, its ``unavailable()`` (a missing package or compiler). ``chunk_pairs``: as a context-parallel ring's
    chunk pairs. :func:`resolve` raises the same reasons at the call."""
    if isinstance(what, AttentionCall):
        reasons = {}
        for name in priority(what):
            if not (why := why_not(BACKENDS[name], what, chunk_pairs=chunk_pairs)):
                break
            reasons[name] = why
        return reasons
    if isinstance(what, Backend):
        backend = what
    elif check_name(what) == "auto":
        return []
    else:
        backend = BACKENDS[what]
    if call is not None:
        kinds = _kinds_of(call)
    elif kinds.get("device") == "cuda" and torch.cuda.is_available():  # the GPU the calls will run on: the current
        kinds = {**kinds, "arch": compute_capability(torch.device("cuda"))}
    reasons = _declared_reasons(backend.serves, chunk_pairs=chunk_pairs, **kinds)
    if not reasons and (why := backend.unavailable()) is not None:
        reasons.append(why)
    return reasons


def not_supported_reasons(backend: Backend, call: AttentionCall, *, chunk_pairs: bool = False) -> list[str]:
    """``why_not(backend, call)`` (xformers' name)."""
    return why_not(backend, call, chunk_pairs=chunk_pairs)


def refusals(name: str, **kinds) -> list[str]:
    """``why_not(name, **kinds)``: the reasons known at construction."""
    return why_not(name, **kinds)


def priority(call: AttentionCall) -> tuple[str, ...]:
    """The backends "auto" tries for ``call``, in order."""
    n, m = call.q.shape[-2], call.k.shape[-2]
    if call.cu_seqlens_q is not None:  # a packed call: the size of its longest sequences
        n, m = call.max_seqlen_q, call.max_seqlen_k
    # symbolic sizes (torch.export with a dynamic length): no guard on N, take a size-independent order
    small = isinstance(n, int) and isinstance(m, int) and n * m <= dense_max_scores(call.max_relative_position)
    device = call.q.device.type
    order = (_SMALL if small else _LARGE).get(device, _OTHER_DEVICES[0] if small else _OTHER_DEVICES[1])
    return tuple(name for name in order if name in BACKENDS)


def choose(call: AttentionCall, *, chunk_pairs: bool = False) -> Backend:
    """The backend "auto" uses for ``call``: the first of :func:`priority` that serves it ("dense" serves all).
    ``chunk_pairs``: for the chunk pairs of a context-parallel ring (a ValueError with every reason when none
    serves them)."""
    for name in priority(call):
        if not not_supported_reasons(BACKENDS[name], call, chunk_pairs=chunk_pairs):
            return BACKENDS[name]
    if chunk_pairs:
        reasons = {n: not_supported_reasons(b, call, chunk_pairs=True) for n, b in BACKENDS.items()}
        raise ValueError("no backend serves these inputs as context-parallel chunk pairs: "
                         + "; ".join(f"{n}: {', '.join(r)}" for n, r in reasons.items()))
    return BACKENDS["dense"]


def resolve(name: str, call: AttentionCall, *, chunk_pairs: bool = False) -> Backend:
    """The backend ``name`` names (``"auto"``: :func:`choose`), or a ValueError with every reason it refuses.
    ``chunk_pairs``: for the chunk pairs of a context-parallel ring."""
    if check_name(name) == "auto":
        return choose(call, chunk_pairs=chunk_pairs)
    backend = BACKENDS[name]
    if reasons := not_supported_reasons(backend, call, chunk_pairs=chunk_pairs):
        raise ValueError(f"backend {name!r} cannot serve these inputs: {'; '.join(reasons)}")
    return backend


__all__ = ["BACKENDS", "REFUSED", "AttentionCall", "Backend", "Registry", "Serves", "StatsAutograd", "StatsOps",
           "call_seed", "check_name", "choose", "not_supported_reasons", "priority", "refusals", "resolve",
           "stats_dtype", "why_not"]
