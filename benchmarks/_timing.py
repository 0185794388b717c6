"""Shared helpers of the benchmark scripts: their inputs, interleaved timing, peak extra memory."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

import torch


def make_inputs(n: int, *, heads: int, dim: int, kk: int, batch: int = 1, seed: int = 0):
    """q, k, v (batch, heads, n, dim), shared tables (2K+1, dim) scaled 0.1, all requiring grad, and an
    output gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(batch, heads, n, dim, generator=g) for _ in range(4))
    rel_k, rel_v = (0.1 * torch.randn(2 * kk + 1, dim, generator=g) for _ in range(2))
    for t in (q, k, v, rel_k, rel_v):
        t.requires_grad_()
    return q, k, v, rel_k, rel_v, grad

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
