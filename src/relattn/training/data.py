"""Byte-level text data for ``relattn train``: the corpus, the train/validation split and batches.

Batches are a pure function of ``(seed, step)``, so resuming at step ``s`` needs no sampler state and
every rank of a distributed run draws the same global batch and keeps its own slice of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_CORPUS = "pydoc_data.topics"


class DataError(ValueError):
    """The training text is unusable (missing, empty, not UTF-8, too short)."""


def default_corpus() -> bytes:
    """The Python reference documentation shipped inside CPython (``pydoc_data.topics``), about 465 kB."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip("\n") for name in sorted(topics)).encode("utf-8")


def load_corpus(path: str | Path | None) -> tuple[bytes, str]:
    """Return the bytes of UTF-8 text file ``path`` (the default corpus for None) and a display name."""
    if path is None:
        return default_corpus(), DEFAULT_CORPUS
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"--data {path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"--data {path}: is a directory, not a text file") from None
    except OSError as e:
        raise DataError(f"--data {path}: cannot read: {e.strerror or e}") from None
    if not data:
        raise DataError(f"--data {path}: file is empty")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {path}: not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})") \
            from None
    return data, str(path)


@dataclass(frozen=True)
class ByteData:
    """A byte corpus split into a training part (first ``1 - val_fraction``) and a validation part (the rest)."""

    train: torch.Tensor  # (T_train,) uint8
    val: torch.Tensor  # (T_val,) uint8
    name: str

    @classmethod
    def from_bytes(cls, data: bytes, *, context: int, val_fraction: float = 0.1, name: str = "") -> ByteData:
        """Split ``data``; both parts need ``context + 1`` bytes (inputs plus the shifted targets)."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n_val = int(len(data) * val_fraction)
        need = context + 1
        if len(data) - n_val < need or n_val < need:
            minimum = max(-(-need // val_fraction), -(-need // (1 - val_fraction)), need * 2)
            raise DataError(f"--data {name or 'text'}: {len(data)} bytes is too short for context {context} "
                            f"(the training and validation splits each need {need} bytes; "
                            f"give at least {int(minimum)} bytes or a smaller --context)")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return cls(train=t[: len(data) - n_val].clone(), val=t[len(data) - n_val:].clone(), name=name)


def step_seed(seed: int, step: int) -> int:
    """The seed of the batch for ``step``: distinct per (seed, step), stable across runs and platforms."""
    return (seed * 1_000_003 + step * 7_919 + 12_345) % (2**63 - 1)


def get_batch(train: torch.Tensor, *, step: int, seed: int, batch_size: int, context: int,
              rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, each (batch_size // world_size, context) int64, for ``step``.

    The global batch of ``batch_size`` random windows is drawn from ``(seed, step)`` alone; rank ``r``
    gets rows ``r * b .. (r + 1) * b - 1`` with ``b = batch_size // world_size``.
    """
    g = torch.Generator().manual_seed(step_seed(seed, step))
    starts = torch.randint(0, len(train) - context, (batch_size,), generator=g)
    per = batch_size // world_size
    starts = starts[rank * per:(rank + 1) * per]
    windows = torch.stack([train[s: s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def eval_windows(val: torch.Tensor, length: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``total`` validation predictions cut into ``total // length`` windows of ``length``.

    Returns inputs and targets, each (total // length, length) int64. Evaluating several lengths on the
    same ``total`` (a multiple of each) scores exactly the same bytes, only with more or less context.
    """
    if total % length or total + 1 > len(val):
        raise ValueError(f"total ({total}) must be a multiple of length ({length}) and < len(val) ({len(val)})")
    x = val[:total].long().view(-1, length)
    y = val[1:total + 1].long().view(-1, length)
    return x, y
