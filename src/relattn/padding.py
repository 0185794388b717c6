"""Right-aligned padding as packed rows: what the module and the patched models use to run a padded batch as one
packed call of :func:`relattn.relative_attention_varlen`, so that padded positions cost nothing.

A padded batch ``(B, N, ...)`` (or ``(N, B, ...)``) is *right-aligned* when each sequence ``b`` holds its ``n_b``
tokens at positions ``0 .. n_b - 1`` and padding after them, as tokenizers and feature extractors pad by default.
:func:`right_padding` reads that from a padding mask and returns a :class:`Packing`: the rows of the real tokens
(``T = sum n_b`` of them, sequence after sequence), ``cu_seqlens`` and the longest length, as the packed call takes
them. ``Packing.pack`` gathers the real rows ``(T, ...)``; ``Packing.unpack`` scatters packed rows back into the
padded layout with **zeros at the padded positions** (and so no gradient reaches a padded position).

Reading the lengths is a host synchronisation (the longest length is a Python int); the answers are
:func:`remembered` per mask tensor and its values, so the layers of one model, which are handed the same mask, read
its lengths once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


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


__all__ = ["PACK_FROM", "Packing", "remembered", "right_padding"]
