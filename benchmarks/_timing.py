"""Shared helpers of the benchmark scripts: interleaved timing and peak extra memory from profiler events."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time


def time_interleaved(fns: dict, reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every fn ``warmup`` times, then ``reps`` rounds of each in turn; seconds per call, per name."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return times


def median_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_extra_bytes_in_child(argv: list[str]) -> int:
    """Run ``python argv...`` (which prints one integer: its peak extra bytes) in a fresh process.

    Peak RSS is a high-water mark per process, so each measurement needs its own process.
    """
    out = subprocess.run([sys.executable, *argv], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])
