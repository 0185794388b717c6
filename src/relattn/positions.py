"""Relative positions: the window of offsets a table covers, the one place the clipped index is written, and the
causal pattern (which keys a query may see).

A window is ``(left, right)``: offsets ``j - i`` from ``-left`` to ``right`` have rows ``0 .. left + right``
(offset ``r`` at row ``r + left``). An int ``K`` is the symmetric window ``(K, K)`` of Shaw et al., with
``2K + 1`` rows. Beyond the window, ``beyond="clip"`` repeats the edge rows (Shaw et al.) and ``beyond="zero"``
gives zero embeddings (tensor2tensor's ``relative_v2``, VITS).
"""

from __future__ import annotations

import torch

BEYOND = ("clip", "zero")


def check_max_relative_position(max_relative_position: object) -> int:
    """Validate a symmetric ``K``: a non-negative int (bools refused)."""
    if isinstance(max_relative_position, bool) or not isinstance(max_relative_position, int):
        raise TypeError(
            f"max_relative_position must be an int, got {type(max_relative_position).__name__} "
            f"({max_relative_position!r})"
        )
    if max_relative_position < 0:
        raise ValueError(f"max_relative_position must be >= 0, got {max_relative_position}")
    return max_relative_position


def check_window(max_relative_position: object) -> tuple[int, int]:
    """``(left, right)`` from an int ``K`` (``(K, K)``) or a pair of non-negative ints."""
    if isinstance(max_relative_position, (tuple, list)):
        if len(max_relative_position) != 2:
            raise ValueError(f"max_relative_position as a pair must be (left, right); got {max_relative_position!r}")
        left, right = max_relative_position
        for side, value in (("left", left), ("right", right)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"max_relative_position's {side} must be an int >= 0; got {value!r}")
        return left, right
    k = check_max_relative_position(max_relative_position)
    return k, k


def check_beyond(beyond: object) -> str:
    if beyond not in BEYOND:
        raise ValueError(f"beyond must be one of {BEYOND}; got {beyond!r}")
    return beyond


def table_rows(max_relative_position) -> int:
    """Rows of a table for this window: ``left + right + 1`` (``2K + 1`` for an int K)."""
    left, right = check_window(max_relative_position)
    return left + right + 1


def clip_and_shift(offsets: torch.Tensor, max_relative_position: int) -> torch.Tensor:
    """Table row for raw offsets ``j - i`` in a symmetric window: clip to ``[-K, K]``, then shift by ``K``."""
    return offsets.clamp(-max_relative_position, max_relative_position) + max_relative_position


def causal_allowed(n: int, m: int, query_offset: int, device) -> torch.Tensor:
    """(N, M) bool, True where key ``j`` is not in the future of query ``i``: ``j <= i + query_offset``."""
    return torch.arange(m, device=device)[None, :] <= torch.arange(n, device=device)[:, None] + query_offset


def relative_position_index(
    query_len: int | torch.SymInt,
    key_len: int | torch.SymInt,
    max_relative_position: int | tuple[int, int],
    *,
    query_offset: int = 0,
    beyond: str = "clip",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """LongTensor ``(N, M)``: the table row of key ``j`` seen from query ``i``.

    With a window ``(left, right)`` (an int ``K`` is ``(K, K)``), the entry is ``clip(j - (i + query_offset),
    -left, right) + left``. With ``beyond="zero"``, offsets outside the window get ``left + right + 1``: one
    past the last row, where a zero row appended to the table (as a ``padding_idx``) gives zero embeddings.
    Query ``i`` sits at absolute position ``i + query_offset`` and key ``j`` at ``j``, so for incremental
    decoding with ``M`` cached keys and ``N`` new queries, ``query_offset = M - N``.
    """
    for name, value in (("query_len", query_len), ("key_len", key_len)):
        if isinstance(value, torch.SymInt):
            continue  # a symbolic tensor size under torch.compile / torch.export: never negative
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if isinstance(query_offset, bool) or not isinstance(query_offset, int):
        raise TypeError(f"query_offset must be an int, got {type(query_offset).__name__}")
    left, right = check_window(max_relative_position)
    keys = torch.arange(key_len, device=device)
    queries = torch.arange(query_len, device=device) + query_offset
    offsets = keys[None, :] - queries[:, None]
    index = offsets.clamp(-left, right) + left
    if check_beyond(beyond) == "zero":
        index = index.masked_fill((offsets < -left) | (offsets > right), left + right + 1)
    return index


def symmetric_table(table: torch.Tensor | None, window: tuple[int, int],
                    beyond: str) -> tuple[torch.Tensor | None, int]:
    """A ``(..., left + right + 1, D)`` table as the equivalent symmetric one the kernels take, and its ``K``.

    Clipping to ``[-left, right]`` equals clipping to ``[-K, K]``, ``K = max(left, right)``, with the edge rows
    repeated out to ``K``; zero beyond the window equals clipping to ``K = max(left, right) + 1`` with zero rows
    out to ``K``. The symmetric clipped window is returned as it is. Gradients flow back to ``table``.
    """
    left, right = window
    k = max(left, right) + (beyond == "zero")
    if table is None or (left == right == k):
        return table, k
    lead = table.shape[:-2]
    if beyond == "zero":
        before = table.new_zeros(*lead, k - left, table.shape[-1])
        after = table.new_zeros(*lead, k - right, table.shape[-1])
    else:
        before = table[..., :1, :].expand(*lead, k - left, table.shape[-1])
        after = table[..., -1:, :].expand(*lead, k - right, table.shape[-1])
    return torch.cat([before, table, after], dim=-2), k
