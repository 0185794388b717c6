"""The clipped relative-position index: the one place ``clip(j - i, -K, K) + K`` is written."""

from __future__ import annotations

import torch


def check_max_relative_position(max_relative_position: object) -> int:
    """Validate ``K``: a non-negative int (bools refused)."""
    if isinstance(max_relative_position, bool) or not isinstance(max_relative_position, int):
        raise TypeError(
            f"max_relative_position must be an int, got {type(max_relative_position).__name__} "
            f"({max_relative_position!r})"
        )
    if max_relative_position < 0:
        raise ValueError(f"max_relative_position must be >= 0, got {max_relative_position}")
    return max_relative_position


def clip_and_shift(offsets: torch.Tensor, max_relative_position: int) -> torch.Tensor:
    """Table row for raw offsets ``j - i``: clip to ``[-K, K]``, then shift by ``K`` into ``[0, 2K]``."""
    return offsets.clamp(-max_relative_position, max_relative_position) + max_relative_position


def relative_position_index(
    query_len: int | torch.SymInt,
    key_len: int | torch.SymInt,
    max_relative_position: int,
    *,
    query_offset: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """LongTensor ``(N, M)`` with entries ``clip(j - (i + query_offset), -K, K) + K``.

    Query ``i`` sits at absolute position ``i + query_offset`` and key ``j`` at ``j``, so for
    incremental decoding with ``M`` cached keys and ``N`` new queries, ``query_offset = M - N``.
    Rows index a table of ``2K + 1`` relative embeddings (offset ``-K`` at row 0, ``0`` at row ``K``).
    """
    for name, value in (("query_len", query_len), ("key_len", key_len)):
        if isinstance(value, torch.SymInt):
            continue  # a symbolic tensor size under torch.compile / torch.export: never negative
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if isinstance(query_offset, bool) or not isinstance(query_offset, int):
        raise TypeError(f"query_offset must be an int, got {type(query_offset).__name__}")
    k = check_max_relative_position(max_relative_position)
    keys = torch.arange(key_len, device=device)
    queries = torch.arange(query_len, device=device) + query_offset
    return clip_and_shift(keys[None, :] - queries[:, None], k)
