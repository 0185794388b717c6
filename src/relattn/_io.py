"""Writing outputs: atomic writes (a file is either the old one or the complete new one) and output-folder checks."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix or path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give them the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure atomically as PNG and close it."""
    import matplotlib.pyplot as plt

    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)
    return Path(path)


class OutputPathError(ValueError):
    """An output folder the command cannot create or write into (reported as one line, exit status 2)."""


def check_output_dir(path: str | os.PathLike, *, option: str = "--out") -> Path:
    """Return ``path`` as a :class:`~pathlib.Path` if it can be a folder to write into, before any work is done.

    ``path`` may exist as a folder or not exist yet; :class:`OutputPathError` (naming ``option``) if it, or
    the nearest existing folder above it, is a file, or if that folder is not writable.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{option} {path}: exists and is not a folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{option} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {path}: {existing} is not writable")
    return path
