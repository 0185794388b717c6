"""What one ``relattn bench`` run measures: :class:`BenchConfig` and its presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends import check_name
from .measure import Problem
from .peers import PEERS

__all__ = ["PRESETS", "PRESET_OUT", "BenchConfig"]


@dataclass(frozen=True)
class BenchConfig(Problem):
    """What one bench run measures: the inputs (:class:`relattn.bench.measure.Problem`), then these."""

    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)  # N = M, self-attention
    threads: int = 2
    repeats: int = 5
    warmup: int = 1
    forward: bool = True  # time the forward alone (inference) too, not only forward+backward
    memory: bool = True  # measure peak memory (one more call of each, outside the timings)
    backends: tuple[str, ...] | None = None  # relattn backends (names in BACKENDS, or "auto"); None: all + auto
    peers: tuple[str, ...] = PEERS  # besides sdpa, which always runs
    memory_limit_bytes: float | None = None  # skip what is predicted to need more; None: half the free memory
    time_limit_s: float = 180.0  # skip a measurement (one implementation, one length) predicted to take longer
    command: str = ""  # the command line, recorded in bench.json

    def __post_init__(self) -> None:
        for name in self.backends or ():
            check_name(name)
        unknown = set(self.peers) - set(PEERS)
        if unknown:
            raise ValueError(f"peers must be among {PEERS}; got {sorted(unknown)}")


PRESETS = {
    "full": BenchConfig(),
    "quick": BenchConfig(lengths=(128, 256, 512), repeats=3, time_limit_s=120.0),
    "memory-check": BenchConfig(lengths=(4096, 8192, 16384), repeats=1, warmup=0, time_limit_s=600.0,
                                backends=("auto",), peers=("materialised",)),
}
PRESET_OUT = {"full": "relattn-bench", "quick": "relattn-bench", "memory-check": "relattn-bench-memory"}
