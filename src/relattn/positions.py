"""Relative positions: the window of offsets a table covers, the one place the clipped index is written, and the
causal pattern (which keys a query may see).

A window is ``(left, right)``: offsets ``j - i`` from ``-left`` to ``right`` have rows ``0 .. left + right``
(offset ``r`` at row ``r + left``). An int ``K`` is the symmetric window ``(K, K)`` of Shaw et al., with
``2K + 1`` rows. Beyond the window, ``beyond="clip"`` repeats the edge rows (Shaw et al.) and ``beyond="zero"``
gives zero embeddings (tensor2tensor's ``relative_v2``, VITS).

Offset maps beyond clipping: :class:`LogBuckets` is DeBERTa's map from an offset to a row of a ``2 * span``-row
table (log-spaced buckets far away, or plain clipping without buckets). The row depends only on the offset, so
the op turns such a table into the equivalent symmetric clipped one (:meth:`LogBuckets.expand`, gradients flowing
back to the compact table) and the kernels see only ``clip(j - i, -K, K) + K``. :class:`T5Buckets` is T5's and
MPNet's map (transformers' ``_relative_position_bucket``: exact near, log-spaced up to ``max_distance``, split by
sign or causal), brought to the clipped form the same way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LogBuckets:
    """DeBERTa's relative positions (transformers' ``make_log_bucket_position`` and ``disentangled_attention_bias``),
    as a map from relattn's offset ``r = j - i`` to a row of a table of ``2 * span`` rows.

    DeBERTa writes positions as ``i - j``: with ``delta = log_bucket_position(i - j, buckets, max_position)``
    (identity for ``|i - j| <= buckets // 2``, log-spaced beyond, unbounded), key ``j`` seen from query ``i`` takes
    row ``clamp(delta + span, 0, 2 * span - 1)`` of the table as DeBERTa stores it (no flip needed).
    ``buckets <= 0`` means no buckets: ``delta = i - j``, plain clipping to ``[-span, span - 1]``.

    Attributes:
        span: DeBERTa's ``att_span`` (``position_buckets`` when bucketed, else ``max_relative_positions``).
        buckets: ``position_buckets`` (<= 0: none).
        max_position: ``max_relative_positions``: the offset the log buckets reach ``buckets // 2 - 1`` steps
            past ``buckets // 2`` (used only with buckets).

    A ``max_position`` below ``buckets // 2 + 1`` (small configs: ``position_buckets=256`` with
    ``max_position_embeddings=64``) makes transformers' log map fold back: offsets past ``buckets // 2`` take rows
    nearer the middle again, and far ones the opposite edge row. That is transformers' behaviour, not a design, but
    it is what such a model was trained with, so the map is kept as transformers computes it.
    """

    span: int
    buckets: int = 0
    max_position: int = 0

    def __post_init__(self):
        for name in ("span", "buckets", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LogBuckets.{name} must be an int, got {type(value).__name__}")
        if self.span < 1:
            raise ValueError(f"LogBuckets.span must be >= 1, got {self.span}")
        finite = self.max_position >= 1 and self.max_position != self.buckets // 2 + 1
        if self.buckets > 0 and (self.buckets < 2 or not finite):
            raise ValueError(f"LogBuckets with buckets={self.buckets} needs buckets >= 2 and a max_position >= 1 other "
                             f"than buckets // 2 + 1 = {self.buckets // 2 + 1} (there the log buckets divide by "
                             f"log(1) = 0); got max_position={self.max_position}")

    @property
    def rows(self) -> int:
        """Rows of the compact table: ``2 * span``."""
        return 2 * self.span

    def row(self, offsets: torch.Tensor) -> torch.Tensor:
        """LongTensor: the compact table's row for each raw offset ``r = j - i``."""
        delta = -offsets
        if self.buckets > 0:
            delta = log_bucket_position(delta, self.buckets, self.max_position)
        return (delta + self.span).clamp(0, 2 * self.span - 1)

    def max_relative_position(self, lowest: int, highest: int) -> int:
        """The smallest ``K`` such that clipping to ``[-K, K]`` gives every offset in ``[lowest, highest]`` its row:
        beyond ``K`` the row no longer changes (it saturates) or no offset reaches. A constant to ``torch.compile``
        (computed eagerly when traced: no graph break)."""
        return _saturation(self.span, self.buckets, self.max_position, lowest, highest)

    def expand(self, table: torch.Tensor, max_relative_position: int) -> torch.Tensor:
        """``(..., 2 * span, D)`` -> the equivalent ``(..., 2K + 1, D)`` table of clipped offsets
        (:func:`clipped_rows`)."""
        return clipped_rows(self, table, max_relative_position)


def clipped_rows(positions, table: torch.Tensor, max_relative_position: int) -> torch.Tensor:
    """A compact table ``(..., R, D)`` -> the equivalent ``(..., 2K + 1, D)`` table of clipped offsets: row ``r + K``
    is the compact table's ``positions.row(r)``. An index (gradients flow back, summed over rows sharing one; the
    index is made once per map and window)."""
    kk = max_relative_position
    if torch.compiler.is_compiling():
        index = positions.row(torch.arange(-kk, kk + 1))
    else:
        index = _clipped_index(positions, kk)
    return table.index_select(-2, index.to(table.device))


@functools.lru_cache(maxsize=64)
def _clipped_index(positions, max_relative_position: int) -> torch.Tensor:
    """:func:`clipped_rows`' index, once per map and window (a decoding step asks for the same one every call)."""
    return positions.row(torch.arange(-max_relative_position, max_relative_position + 1))


@torch.compiler.assume_constant_result
def _saturation(span: int, buckets: int, max_position: int, lowest: int, highest: int) -> int:
    """:meth:`LogBuckets.max_relative_position` (plain ints in: what the compiler takes as a constant's key)."""
    return _saturating(LogBuckets(span, buckets, max_position), lowest, highest)


@dataclass(frozen=True)
class T5Buckets:
    """T5's relative positions (transformers' ``T5Attention._relative_position_bucket``; MPNet's
    ``relative_position_bucket`` is the bidirectional map): relattn's offset ``r = j - i`` (T5's ``memory_position -
    context_position``) to a row of a table of ``num_buckets`` rows, T5's bucket.

    Bidirectional: half the buckets for ``r <= 0``, half (from ``num_buckets // 2``) for ``r > 0``; causal
    (``bidirectional=False``): ``r > 0`` (the future) takes the bucket of 0. Within each half, with ``n = |r|`` (causal:
    ``max(-r, 0)``) and ``exact`` half its buckets, ``n`` itself below ``exact``, beyond ``exact + floor(log(n / exact)
    / log(max_distance / exact) * (half - exact))`` capped at the last (computed in float32 as transformers does, so
    the buckets match bit for bit). The buckets saturate at ``max_distance``: the op then serves any length with the
    table of the offsets that occur (:meth:`expand`), each row the compact table's bucket.

    Attributes:
        num_buckets: ``relative_attention_num_buckets`` (T5: 32).
        max_distance: ``relative_attention_max_distance`` (T5: 128).
        bidirectional: True for encoders (and MPNet), False for T5's decoder self-attention.
    """

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    def __post_init__(self):
        for name in ("num_buckets", "max_distance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"T5Buckets.{name} must be an int, got {type(value).__name__}")
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"T5Buckets.bidirectional must be a bool, got {type(self.bidirectional).__name__}")
        half = self.num_buckets // 2 if self.bidirectional else self.num_buckets
        if half < 2:
            raise ValueError(f"T5Buckets needs num_buckets >= {4 if self.bidirectional else 2} (at least two buckets "
                             f"per side); got {self.num_buckets}")
        if self.max_distance <= half // 2:
            raise ValueError(f"T5Buckets needs max_distance > {half // 2} (the exact buckets' reach: the log buckets "
                             f"divide by log(max_distance / {half // 2})); got {self.max_distance}")

    @property
    def rows(self) -> int:
        """Rows of the compact table: ``num_buckets``."""
        return self.num_buckets

    def row(self, offsets: torch.Tensor) -> torch.Tensor:
        """LongTensor: the compact table's row (T5's bucket) for each raw offset ``r = j - i``."""
        return t5_bucket(offsets, self.num_buckets, self.max_distance, self.bidirectional)

    def max_relative_position(self, lowest: int, highest: int) -> int:
        """The smallest ``K`` such that clipping to ``[-K, K]`` gives every offset in ``[lowest, highest]`` its row
        (:meth:`LogBuckets.max_relative_position`'s rule)."""
        return _t5_saturation(self.num_buckets, self.max_distance, self.bidirectional, lowest, highest)

    def expand(self, table: torch.Tensor, max_relative_position: int) -> torch.Tensor:
        """``(..., num_buckets, D)`` -> the equivalent ``(..., 2K + 1, D)`` table of clipped offsets
        (:func:`clipped_rows`)."""
        return clipped_rows(self, table, max_relative_position)


def t5_bucket(offsets: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool) -> torch.Tensor:
    """T5's bucket of each offset ``j - i`` (transformers' ``_relative_position_bucket``), LongTensor."""
    offsets = offsets.long()
    buckets = torch.zeros_like(offsets)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (offsets > 0).long() * num_buckets
        distance = offsets.abs()
    else:
        distance = -torch.min(offsets, torch.zeros_like(offsets))
    exact = num_buckets // 2
    far = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).to(torch.long)
    far = torch.min(far, torch.full_like(far, num_buckets - 1))
    return buckets + torch.where(distance < exact, distance, far)


@torch.compiler.assume_constant_result
def _t5_saturation(num_buckets: int, max_distance: int, bidirectional: bool, lowest: int, highest: int) -> int:
    """:meth:`T5Buckets.max_relative_position` (plain ints in: what the compiler takes as a constant's key)."""
    return _saturating(T5Buckets(num_buckets, max_distance, bidirectional), lowest, highest)


@functools.lru_cache(maxsize=256)
def _saturating(positions, lowest: int, highest: int) -> int:
    """The smallest ``K`` past which ``positions.row`` (offsets -> rows) no longer changes within ``[lowest,
    highest]`` (once per map and range: a decoding step asks for the same one every call)."""
    reach = max(-lowest, highest, 0)
    rows = positions.row(torch.arange(-reach, reach + 1))
    changes_right = torch.nonzero(rows[reach:] != rows[-1])
    changes_left = torch.nonzero(rows[: reach + 1].flip(0) != rows[0])
    right = int(changes_right[-1]) + 1 if len(changes_right) else 0
    left = int(changes_left[-1]) + 1 if len(changes_left) else 0
    return max(left, right)


def log_bucket_position(relative_pos: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    """DeBERTa's log buckets of signed positions (transformers' ``make_log_bucket_position``), LongTensor.

    With ``mid = buckets // 2``: ``r`` itself for ``|r| <= mid``; beyond,
    ``sign(r) * (ceil(log(|r| / mid) / log((max_position - 1) / mid) * (mid - 1)) + mid)`` (an odd function of
    ``r``, growing without bound when ``max_position > mid + 1``, folding back when it is smaller). Computed in
    float32 as transformers computes it, so the buckets match bit for bit.
    """
    relative_pos = relative_pos.long()
    mid = buckets // 2
    sign = torch.sign(relative_pos)
    abs_pos = torch.where((relative_pos < mid) & (relative_pos > -mid), torch.full_like(relative_pos, mid - 1),
                          relative_pos.abs())
    ratio = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32))
    log_pos = torch.ceil(torch.log(abs_pos.float() / mid) / ratio * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative_pos, (log_pos * sign).long())


BUCKET_MAPS = (LogBuckets, T5Buckets)  # offset maps the op expands to the clipped table (they saturate)


def check_positions(max_relative_position: object) -> tuple[int, int] | LogBuckets | T5Buckets:
    """A window ``(left, right)`` (:func:`check_window`), or a :class:`LogBuckets` or :class:`T5Buckets` map as it
    is."""
    if isinstance(max_relative_position, BUCKET_MAPS):
        return max_relative_position
    return check_window(max_relative_position)


def check_beyond(beyond: object) -> str:
    if beyond not in BEYOND:
        raise ValueError(f"beyond must be one of {BEYOND}; got {beyond!r}")
    return beyond


def table_rows(max_relative_position) -> int:
    """Rows of a table for this window: ``left + right + 1`` (``2K + 1`` for an int K; ``2 * span`` for
    :class:`LogBuckets`, ``num_buckets`` for :class:`T5Buckets`)."""
    if isinstance(max_relative_position, BUCKET_MAPS):
        return max_relative_position.rows
    left, right = check_window(max_relative_position)
    return left + right + 1


def clip_and_shift(offsets: torch.Tensor, max_relative_position: int) -> torch.Tensor:
    """Table row for raw offsets ``j - i`` in a symmetric window: clip to ``[-K, K]``, then shift by ``K``."""
    return offsets.clamp(-max_relative_position, max_relative_position) + max_relative_position


def causal_allowed(n: int, m: int, query_offset: int, device) -> torch.Tensor:
    """(N, M) bool, True where key ``j`` is not in the future of query ``i``: ``j <= i + query_offset``."""
    return torch.arange(m, device=device)[None, :] <= torch.arange(n, device=device)[:, None] + query_offset


def met_rows(n, m, max_relative_position: int, *, query_offset: int = 0, is_causal: bool = False):
    """(first, last): the rows of a symmetric clipped ``2K + 1``-row table that the pairs a call may attend meet,
    ``N`` queries (the first at ``query_offset``) against ``M`` keys, causal or not: the clipped offsets from
    ``-(N - 1) - query_offset`` to ``M - 1 - query_offset`` (at most 0 under ``is_causal``); None when no pair may
    attend. Every offset in between occurs, so the rows met are exactly ``first .. last``."""
    kk = max_relative_position
    lowest, highest = -(n - 1) - query_offset, m - 1 - query_offset
    if is_causal:
        highest = torch.sym_min(highest, 0)
    if n == 0 or m == 0 or lowest > highest:
        return None
    return torch.sym_max(torch.sym_min(lowest, kk), -kk) + kk, torch.sym_max(torch.sym_min(highest, kk), -kk) + kk


def unmet_rows_zeroed(table, n, m, max_relative_position: int, *, query_offset: int = 0, is_causal: bool = False):
    """``table`` (..., 2K + 1, d) with zeros in the rows no pair the call may attend meets (:func:`met_rows`;
    ``table`` itself when every row is met, None for None): such a row is never read, so a NaN there reaches
    nothing, as in the kernels, which never read it (no ``0 * NaN`` through a masked pair's zero weight). Its
    gradient is zero. Symbolic sizes (torch.export) always take the ``where``, bounds symbolic, and no call is
    taken to have no pair."""
    if table is None:
        return None
    rows = 2 * max_relative_position + 1
    r = torch.arange(rows, device=table.device)
    if not all(type(x) is int for x in (n, m, query_offset)):  # symbolic sizes (torch.export): no guard on them
        kk, highest = max_relative_position, m - 1 - query_offset
        bounds = [torch.sym_max(torch.sym_min(x, kk), -kk) + kk for x in
                  (-(n - 1) - query_offset, torch.sym_min(highest, 0) if is_causal else highest)]
        return torch.where(((r >= bounds[0]) & (r <= bounds[1]))[:, None], table,
                           torch.zeros((), dtype=table.dtype, device=table.device))
    met = met_rows(n, m, max_relative_position, query_offset=query_offset, is_causal=is_causal)
    if met is not None and met[0] == 0 and met[1] == rows - 1:
        return table
    keep = (r >= met[0]) & (r <= met[1]) if met is not None else torch.zeros(rows, dtype=torch.bool,
                                                                            device=table.device)
    return torch.where(keep[:, None], table, torch.zeros((), dtype=table.dtype, device=table.device))


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


def symmetric_table(table: torch.Tensor | None, window: tuple[int, int] | LogBuckets | T5Buckets,
                    beyond: str, *, offsets: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor | None, int]:
    """A ``(..., left + right + 1, D)`` table as the equivalent symmetric one the kernels take, and its ``K``.

    Clipping to ``[-left, right]`` equals clipping to ``[-K, K]``, ``K = max(left, right)``, with the edge rows
    repeated out to ``K``; zero beyond the window equals clipping to ``K = max(left, right) + 1`` with zero rows
    out to ``K``. The symmetric clipped window is returned as it is. A :class:`LogBuckets` table
    (``2 * span`` rows) becomes :meth:`LogBuckets.expand`'s, for the offsets ``j - i`` in the range ``offsets``
    (lowest, highest) that occur (a :class:`T5Buckets` table likewise). Gradients flow back to ``table``.
    """
    if isinstance(window, BUCKET_MAPS):
        if beyond != "clip":
            raise ValueError(f"beyond={beyond!r} does not apply to {type(window).__name__} positions (they saturate); "
                             "use 'clip'")
        k = window.max_relative_position(*offsets)
        return (None if table is None else window.expand(table, k)), k
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
