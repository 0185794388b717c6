"""Backends, picked by one checked string: the registry, ``choose`` (what ``"auto"`` runs) and ``resolve``.

A backend is one file, ``backends/<name>.py``, ending in ``BACKEND = Backend(name, run, Serves(...), doc)``:
``run`` takes the validated :class:`AttentionCall` and returns the output; ``Serves`` declares what it serves,
and :func:`not_supported_reasons` derives every refusal from that declaration. Adding a backend is that file
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
    compute_capability,
    declared_reasons,
    not_supported_reasons,
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


def refusals(name: str, *, device: str | None = None, dtype: torch.dtype | None = None, dropout: bool = False,
             mask: bool = False, head_dim: int | None = None, v_head_dim: int | None = None,
             pos_to_content: bool = False, position_query: bool = False, rel_bias: bool = False,
             chunk_pairs: bool = False) -> list[str]:
    """Every reason backend ``name`` will refuse the calls a module, model or run of this kind makes, known at
    construction (before any call): its ``Serves`` declaration (:func:`declared_reasons`; None leaves a property
    unchecked), then, if that allows them, ``unavailable()`` (a missing package or compiler). ``"auto"`` refuses
    nothing. The same reasons :func:`resolve` gives at the call."""
    if check_name(name) == "auto":
        return []
    backend = BACKENDS[name]
    # on CUDA, the GPU the calls will run on: the current one
    arch = compute_capability(torch.device("cuda")) if device == "cuda" and torch.cuda.is_available() else None
    reasons = declared_reasons(backend.serves, device=device, dtype=dtype, dropout=dropout, mask=mask,
                               head_dim=head_dim, v_head_dim=v_head_dim, pos_to_content=pos_to_content,
                               position_query=position_query, rel_bias=rel_bias, chunk_pairs=chunk_pairs, arch=arch)
    if not reasons and (why := backend.unavailable()) is not None:
        reasons.append(why)
    return reasons


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


def why_not(call: AttentionCall, *, chunk_pairs: bool = False) -> dict[str, list[str]]:
    """For each backend "auto" would have preferred to the one it chose, why it could not serve ``call``."""
    reasons = {}
    for name in priority(call):
        if not (why := not_supported_reasons(BACKENDS[name], call, chunk_pairs=chunk_pairs)):
            break
        reasons[name] = why
    return reasons


def resolve(name: str, call: AttentionCall, *, chunk_pairs: bool = False) -> Backend:
    """The backend ``name`` names (``"auto"``: :func:`choose`), or a ValueError with every reason it refuses.
    ``chunk_pairs``: for the chunk pairs of a context-parallel ring."""
    if check_name(name) == "auto":
        return choose(call, chunk_pairs=chunk_pairs)
    backend = BACKENDS[name]
    if reasons := not_supported_reasons(backend, call, chunk_pairs=chunk_pairs):
        raise ValueError(f"backend {name!r} cannot serve these inputs: {'; '.join(reasons)}")
    return backend


__all__ = ["BACKENDS", "AttentionCall", "Backend", "Registry", "Serves", "StatsAutograd", "StatsOps", "check_name",
           "choose", "declared_reasons", "not_supported_reasons", "priority", "refusals", "resolve", "stats_dtype",
           "why_not"]
