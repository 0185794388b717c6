"""``AttentionArgs``: what one call of the op asks, declared once.

The public front doors (:func:`relattn.relative_attention`, ``relative_attention_with_weights``,
``relative_attention_weights``, ``relative_attention_varlen``) keep their keyword signatures and build one
``AttentionArgs`` from them; :func:`relattn.functional.check_call` (``validate``) reads it by name and brings it to
the canonical :class:`relattn.backends.AttentionCall`; the module, the context-parallel ring and the plan cache
read it by name too. A new option is one field here, with its ``plan`` rule (how a repeated call's plan key holds
it, :data:`PLAN_RULES`): the plan key iterates these fields, so no field can be left out of it.

Plan rules (what :func:`relattn.functional.plan_key` does with the field; a call breaking a rule is never planned
and always takes the full checks):

* ``"tensor"``: a plain tensor or None; its shape, dtype, device and requires_grad are in the key.
* ``"query"``: a plain tensor of at least 2 dims; its shape, dtype, device and requires_grad are in the key.
* ``"keys"``: a plain tensor of at least 2 dims; the same without its length ``M`` (``shape[-2]``), which only decides
  the narrowed window and ``"auto"``'s size class (both in the key): a decoding step's growing cache keeps its plan.
* ``"int"``, ``"bool"``, ``"number"``, ``"scale"``, ``"name"``: a value of that type, in the key as it is.
* ``"positions"``: an int ``K`` or a bucket map (:data:`relattn.positions.BUCKET_MAPS`, hashable), in the key as it is;
  a window ``(left, right)`` is never planned.
* ``"mask"``: None, or a plain tensor whose last dim is 1 or the keys' ``M``: its shape but that dim (and whether it
  is 1), dtype, device and requires_grad are in the key (a decoding step's mask grows with the cache).
* ``"clip"``: must be ``"clip"``.
* ``"offset"``: an int, not in the key (it decides only what the ``"keys"`` length decides).
* ``"absent"``: must be None (a packed call's lengths: such calls are not planned).
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass, field

import torch
from torch import Tensor


def _rule(plan: str, **kw):
    return field(metadata={"plan": plan}, **kw)


@dataclass(frozen=True, slots=True)
class AttentionArgs:
    """The arguments of one call, as given (unchecked): the tensors, the relative terms and every option, named as
    :func:`relattn.relative_attention` names them (see there for shapes and meanings). ``cu_seqlens_q``,
    ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` are :func:`relattn.relative_attention_varlen`'s (a packed
    call); None elsewhere."""

    q: Tensor = _rule("query")
    k: Tensor = _rule("keys")
    v: Tensor = _rule("keys")
    rel_k: Tensor | None = _rule("tensor", default=None)
    rel_v: Tensor | None = _rule("tensor", default=None)
    _: KW_ONLY
    max_relative_position: object = _rule("positions")  # int K, (left, right), a LogBuckets or a T5Buckets
    rel_q: Tensor | None = _rule("tensor", default=None)
    content_bias: Tensor | None = _rule("tensor", default=None)
    position_bias: Tensor | None = _rule("tensor", default=None)
    rel_bias: Tensor | None = _rule("tensor", default=None)
    beyond: str = _rule("clip", default="clip")
    attn_mask: Tensor | None = _rule("mask", default=None)
    is_causal: bool = _rule("bool", default=False)
    dropout_p: float = _rule("number", default=0.0)
    scale: float | None = _rule("scale", default=None)
    query_offset: int = _rule("offset", default=0)
    enable_gqa: bool = _rule("bool", default=False)
    backend: str = _rule("name", default="auto")
    cu_seqlens_q: Tensor | None = _rule("absent", default=None)
    cu_seqlens_k: Tensor | None = _rule("absent", default=None)
    max_seqlen_q: int | None = _rule("absent", default=None)
    max_seqlen_k: int | None = _rule("absent", default=None)

    def replace(self, **changes) -> AttentionArgs:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


def _fast_init(cls):
    """``cls.__init__`` as the dataclass writes it, but setting each slot through its descriptor: a frozen dataclass's
    own ``__init__`` pays ``object.__setattr__`` per field (some 4 us for these 21 fields, on every call of the op);
    the signature (positional, keyword-only, defaults) is the dataclass's."""
    # torch.compile cannot trace a slot's __set__: while it traces, the dataclass's own __init__ runs
    params, names = [], {"_compiling": torch.compiler.is_compiling, "_traced_init": cls.__init__}
    body, fields = [], []
    kw_only_seen = False
    for f in dataclasses.fields(cls):
        if f.kw_only and not kw_only_seen:
            params.append("*")
            kw_only_seen = True
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            names[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
        names[f"_s_{f.name}"] = getattr(cls, f.name).__set__
        body.append(f"    _s_{f.name}(self, {f.name})")
        fields.append(f"{f.name}={f.name}" if f.kw_only else f.name)
    source = (f"def __init__(self, {', '.join(params)}):\n"
              f"    if _compiling():\n        return _traced_init(self, {', '.join(fields)})\n" + "\n".join(body))
    exec(source, names)  # noqa: S102 - generated from the fields above, as dataclasses itself does
    names["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = names["__init__"]
    return cls


_fast_init(AttentionArgs)

# (name, rule) of every field, in declaration order: what the plan key iterates.
PLAN_RULES: tuple[tuple[str, str], ...] = tuple((f.name, f.metadata["plan"]) for f in dataclasses.fields(AttentionArgs))
