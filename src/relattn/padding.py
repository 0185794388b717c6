"""The padded-batch path of the module and of every patched model: a padding mask read by its convention's rule,
right-aligned padding as packed rows, one packed call of :func:`relattn.relative_attention_varlen` on the real
tokens only (pack -> project -> run -> unpack, :func:`packed_self_attention`), and the one head split
(:func:`split_heads`).

A padded batch ``(B, N, ...)`` (or ``(N, B, ...)``) is *right-aligned* when each sequence ``b`` holds its ``n_b``
tokens at positions ``0 .. n_b - 1`` and padding after them, as tokenizers and feature extractors pad by default.
:func:`right_padding` reads that from a padding mask and returns a :class:`Packing`: the rows of the real tokens
(``T = sum n_b`` of them, sequence after sequence), ``cu_seqlens`` and the longest length, as the packed call takes
them. ``Packing.pack`` gathers the real rows ``(T, ...)``; ``Packing.unpack`` scatters packed rows back into the
padded layout with **zeros at the padded positions** (and so no gradient reaches a padded position).

Reading the lengths is a host synchronisation (the longest length is a Python int); the answers are
:func:`remembered` per mask tensor and its values, so the layers of one model, which are handed the same mask, read
its lengths once.

Mask rules (:data:`MASK_RULES`): each convention's padding mask as ``(B, N)`` bool, True = padding, or None when the
mask says more than padding (then no packing: the caller keeps its masked call):

* ``"key_padding_mask"`` (:func:`mha_padding`): ``nn.MultiheadAttention``'s ``key_padding_mask``: bool (True =
  padding), or float adding ``-inf`` at padding and ``0`` elsewhere.
* ``"transformers"`` (:func:`transformers_padding`): a transformers attention mask: 2-D (B, N) keep mask (nonzero =
  token), or 4-D (B, 1, N | 1, N) whose query rows are all the same, bool (True = may attend), additive float (0 at
  tokens; ``finfo.min`` or ``-inf`` at padding, anything at most ``finfo.min / 2``) or integer keep mask.
* ``"keep"`` (:func:`keep_padding`): DeBERTa's (B, N) keep mask, nonzero = token, whatever its dtype.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .functional import relative_attention_varlen


@dataclass(frozen=True, eq=False)
class Packing:
    """Where the real tokens of a right-padded batch are.

    Attributes:
        index: (T,) int64, the rows of the real tokens in the batch's first two dims flattened (``b * N + i``
            batch-first, ``i * B + b`` sequence-first), sequence after sequence.
        lengths: (B,) int64, each sequence's number of real tokens ``n_b`` (0 allowed).
        cu_seqlens: (B + 1,) int32, ``0, n_0, n_0 + n_1, .., T``.
        max_seqlen: the longest ``n_b``.
        batch, length: ``B`` and ``N``.
        batch_first: the layout of the padded tensors, (B, N, ...) if True, else (N, B, ...).
    """

    index: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    length: int
    batch_first: bool = True

    @property
    def total(self) -> int:
        """``T``, the number of real tokens."""
        return self.index.shape[0]

    @property
    def padded(self) -> bool:
        """Whether any position is padding (``T < B N``)."""
        return self.total < self.batch * self.length

    @property
    def worth_packing(self) -> bool:
        """Whether a packed call beats the masked one here: at least :data:`PACK_FROM` of the positions are padding
        (below that, gathering and scattering the rows costs more than the padded rows do), and some are not."""
        return 0 < self.total <= (1 - PACK_FROM) * self.batch * self.length

    def padding(self) -> torch.Tensor:
        """(B, N) bool, True at the padded positions."""
        return torch.arange(self.length, device=self.lengths.device)[None, :] >= self.lengths[:, None]

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """The padded-layout ``x`` (B, N, ...) ((N, B, ...) sequence-first) with zeros at the padded positions."""
        self._check(x)
        padding = self.padding() if self.batch_first else self.padding().T
        return x.masked_fill(padding.view(*padding.shape, *(1,) * (x.dim() - 2)), 0)

    def _check(self, x: torch.Tensor) -> None:
        want = (self.batch, self.length) if self.batch_first else (self.length, self.batch)
        if x.dim() < 2 or tuple(x.shape[:2]) != want:
            layout = "(B, N, ...)" if self.batch_first else "(N, B, ...)"
            raise ValueError(f"a padded tensor of this batch must be {layout} = {want} first; got {tuple(x.shape)}")

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """The real rows of the padded ``x`` (B, N, ...) ((N, B, ...) sequence-first) as (T, ...)."""
        self._check(x)
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Packed rows ``x`` (T, ...) in the padded layout (B, N, ...) ((N, B, ...) sequence-first), zeros at the
        padded positions (their gradient is zero too)."""
        if x.dim() < 1 or x.shape[0] != self.total:
            raise ValueError(f"packed rows must be (T, ...) with T = {self.total}; got {tuple(x.shape)}")
        rows = self.batch * self.length
        out = x.new_zeros((rows, *x.shape[1:])).index_copy(0, self.index, x)
        lead = (self.batch, self.length) if self.batch_first else (self.length, self.batch)
        return out.view(*lead, *x.shape[1:])


PACK_FROM = 0.1  # the padded fraction from which the packed call is faster (benchmarks/padding.py measures it)

_REMEMBERED: dict = {}  # (id of a mask, tag) -> (weakref to the mask, a copy of its contents, the answer)
_KEEP = 8  # answers kept: a model's masks of one batch


def remembered(mask: torch.Tensor, tag, compute):
    """``compute(mask)``, remembered for ``(mask, tag)`` while that tensor is alive and holds the same values: the
    layers of a model are handed the same mask, and reading the lengths is a host synchronisation. The values are
    compared with a copy kept of them, as a write through ``.data`` or a numpy view changes them without a trace
    (no ``_version`` bump); comparing costs a fraction of reading the lengths (a (64, 2048) bool mask on one Zen 3
    core: 0.15 ms against 0.86 ms; (8, 512): 8 us against 127 us)."""
    key = (id(mask), tag)
    hit = _REMEMBERED.get(key)
    if hit is not None and hit[0]() is mask and torch.equal(hit[1], mask):
        return hit[2]
    answer = compute(mask)
    if len(_REMEMBERED) >= _KEEP:
        _REMEMBERED.pop(next(iter(_REMEMBERED)))
    _REMEMBERED[key] = (weakref.ref(mask), mask.detach().clone(), answer)
    return answer


def right_padding(padding: torch.Tensor, *, batch_first: bool = True) -> Packing | None:
    """The :class:`Packing` of a batch whose padding mask ``padding`` (B, N), bool, True = padding, is right-aligned
    (each row real tokens first, then padding only); None when it is not (padding first, or holes). A batch without
    padding is right-aligned too (``Packing.padded`` is then False).

    ``batch_first`` says which layout the padded tensors given to ``pack`` and ``unpack`` have; the mask is
    (B, N) in both. The answer is :func:`remembered` for this mask."""
    if not isinstance(padding, torch.Tensor) or padding.dtype != torch.bool or padding.dim() != 2:
        got = f"{padding.dtype} of shape {tuple(padding.shape)}" if isinstance(padding, torch.Tensor) else \
            type(padding).__name__
        raise TypeError(f"padding must be a (B, N) bool tensor (True = padding); got {got}")
    return remembered(padding, ("right", batch_first), lambda p: _packing(p, batch_first))


def _packing(padding: torch.Tensor, batch_first: bool) -> Packing | None:
    b, n = padding.shape
    real = ~padding
    lengths = real.sum(1)
    positions = torch.arange(n, device=padding.device)
    if not torch.equal(real, positions[None, :] < lengths[:, None]):
        return None
    index = real.flatten().nonzero().flatten()  # b * N + i, in sequence order
    if not batch_first:
        index = (index % n) * b + index // n
    cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=padding.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    longest = int(lengths.max()) if b else 0
    return Packing(index, lengths, cu_seqlens, longest, b, n, batch_first)


# ------------------------------------------------------------------------------------------ mask rules


def mha_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """``nn.MultiheadAttention``'s (B, N) ``key_padding_mask`` as padding: bool as it is; float when it adds ``-inf``
    at padding and ``0`` elsewhere; else None."""
    if mask.dim() != 2:
        return None
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    padding = mask == float("-inf")
    return padding if torch.equal(padding, mask != 0) else None


def transformers_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """A transformers attention mask as padding (see the module docstring); None for a mask that is not padding
    alone (query rows that differ, values other than keep / mask)."""
    if mask.dim() == 2:
        return mask == 0
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] not in (1, mask.shape[3]):
        return None
    rows = mask[:, 0]
    row = rows[:, :1]
    if rows.shape[1] > 1 and not torch.equal(rows, row.expand_as(rows)):
        return None
    row = row[:, 0]
    if mask.dtype == torch.bool:
        return ~row
    if not mask.is_floating_point():
        return row == 0
    padding = row <= torch.finfo(mask.dtype).min / 2
    return padding if torch.equal(padding, row != 0) else None


def keep_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """DeBERTa's (B, N) keep mask (nonzero = token, any dtype) as padding; None for another shape."""
    return mask == 0 if mask.dim() == 2 else None


MASK_RULES = {"key_padding_mask": mha_padding, "transformers": transformers_padding, "keep": keep_padding}


def packing_of(mask, rule: str, *, batch_first: bool = True) -> Packing | None:
    """The :class:`Packing` of ``mask`` read by the mask rule ``rule`` (:data:`MASK_RULES`), when it is right-aligned
    padding with at least one padded position; None otherwise (no tensor, a mask that is not padding alone, left
    padding or holes, no padding, while tracing: the lengths are data there). ``batch_first``: the layout of the
    tensors the packing will pack (the mask is (B, N) in both). Remembered per mask tensor and rule."""
    if not isinstance(mask, torch.Tensor) or torch.compiler.is_compiling():
        return None
    if rule not in MASK_RULES:
        raise ValueError(f"rule must be one of {sorted(MASK_RULES)}; got {rule!r}")
    return remembered(mask, (rule, batch_first), lambda m: _padded_packing(MASK_RULES[rule](m), batch_first))


def _padded_packing(padding: torch.Tensor | None, batch_first: bool) -> Packing | None:
    packing = None if padding is None else right_padding(padding, batch_first=batch_first)
    return packing if packing is not None and packing.padded else None


def traced_mha_padding(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: True at the padded positions of a ``key_padding_mask`` that :func:`packing_of` packs under the
    ``"key_padding_mask"`` rule (right-aligned, bool True or ``-inf`` only), all False for any other mask; from
    tensors alone (no host read), so that a traced call zeroes what an eager one does."""
    if key_padding_mask.dtype == torch.bool:
        padding, exact = key_padding_mask, True
    else:
        padding = key_padding_mask == float("-inf")
        exact = (padding == (key_padding_mask != 0)).all()
    return padding & (exact & (padding[:, 1:] >= padding[:, :-1]).all())


# ------------------------------------------------------------------------------------------ heads and the packed call


def split_heads(x: torch.Tensor, *, heads: int = -1, head_dim: int = -1, batch_first: bool = True) -> torch.Tensor:
    """A projection ``(..., L, heads * head_dim)`` as ``(..., heads, L, head_dim)``, a view; with
    ``batch_first=False`` ``(L, B, heads * head_dim)`` as ``(B, heads, L, head_dim)``. Give ``heads`` or
    ``head_dim``; the other is read from the width."""
    x = x.unflatten(-1, (heads, head_dim))
    return x.transpose(-3, -2) if batch_first else x.permute(1, 2, 0, 3)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B, N, H*D): :func:`split_heads` undone."""
    return x.transpose(1, 2).flatten(2)


def attend_packed(packing: Packing, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **op_args) -> torch.Tensor:
    """One packed self-attention call on the real tokens' rows ``q`` (T, H, D), ``k``, ``v`` (T, Hkv, D|Dv):
    :func:`relattn.relative_attention_varlen` with ``packing``'s lengths and ``op_args`` (tables, window, scale,
    dropout, backend); (T, H*Dv)."""
    return relative_attention_varlen(q, k, v, cu_seqlens_q=packing.cu_seqlens, max_seqlen_q=packing.max_seqlen,
                                     **op_args).flatten(1)


def packed_self_attention(packing: Packing, x: torch.Tensor, projections, num_heads: int, output=None, *,
                          terms=None, **op_args) -> torch.Tensor:
    """Self-attention of the real tokens of the padded ``x`` (B, N, E) ((N, B, E) with a sequence-first
    ``packing``) as one packed call: the query, key and value ``projections`` (and ``output``, if given) applied to
    those rows only (key/value heads read from their width: grouped heads need ``enable_gqa=True`` in ``op_args``);
    the result in the padded layout with **zeros at the padded positions**. ``terms``: a function of the projected
    queries' dtype giving more of the op's keywords (a module's tables, cast to it)."""
    rows = packing.pack(x)
    q = projections[0](rows).unflatten(-1, (num_heads, -1))
    k, v = (proj(rows).unflatten(-1, (-1, q.shape[-1])) for proj in projections[1:])
    if terms is not None:
        op_args = {**terms(q.dtype), **op_args}
    out = attend_packed(packing, q, k, v, **op_args)
    return packing.unpack(out if output is None else output(out))


__all__ = ["MASK_RULES", "PACK_FROM", "Packing", "attend_packed", "keep_padding", "merge_heads", "mha_padding",
           "packed_self_attention", "packing_of", "remembered", "right_padding", "split_heads", "traced_mha_padding",
           "transformers_padding"]
