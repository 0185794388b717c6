"""Kernel settings: a backend's tuning knobs (tiles, splits, which GEMMs) as one frozen object, read by its launcher
on every call and changed only for a block of code, by a context manager:

    from relattn.backends import native
    with native.SETTINGS.override(tile_q=3, tile_k=5):   # small tiles: rows cross several key blocks
        ...

Not thread-local on purpose: a backward that autograd runs on another thread (CUDA) sees the same settings as the
forward that the block ran. Unknown names and bad values are refused when the block is entered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Settings(Generic[T]):
    """The current settings of one backend (``current``, a frozen dataclass) and ``override(**changes)``."""

    def __init__(self, default: T) -> None:
        self.default = default
        self.current = default
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def override(self, **changes) -> Iterator[T]:
        """The settings with ``changes`` for the block (nested blocks stack); the previous ones after it."""
        fields = {f.name for f in dataclasses.fields(self.current)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(sorted(fields))}")
        with self._lock:
            previous = self.current
            self.current = dataclasses.replace(previous, **changes)  # the dataclass checks the values
        try:
            yield self.current
        finally:
            with self._lock:
                self.current = previous

    def __repr__(self) -> str:
        return f"Settings({self.current!r})"
