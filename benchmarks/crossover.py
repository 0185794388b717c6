"""Which relattn backend is fastest at small N: forward+backward median ms of every backend, per K.

    PYTHONPATH=src python benchmarks/crossover.py            # N = 64 .. 1536, K = 16 and 64
    PYTHONPATH=src python benchmarks/crossover.py --lengths 256 512 1024 --ks 64 --repeats 9 --json crossover.json

Prints one row per (K, N) with the fastest backend, then per K the runs of N over which each backend was
fastest. ``relattn.backends.choose`` (what ``auto`` picks) cites this script. Measured by
``relattn.bench.run_bench``: interleaved medians in one process; a backend that refuses the inputs is listed
with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from relattn._io import atomic_write_text
from relattn.bench import BenchConfig, add_arguments, config_from_args, run_bench
from relattn.bench.measure import relattn_names

DEFAULTS = {"full": BenchConfig(lengths=(64, 128, 256, 384, 512, 768, 1024, 1536), repeats=7, forward=False,
                                memory=False, backends=tuple(relattn_names()[:-1]), peers=())}  # all but "auto"
KS = (16, 64)
OPTIONS = ("lengths", "backends", "heads", "head_dim", "batch", "per_head_tables", "causal", "dtype", "device",
           "threads", "repeats", "warmup", "seed")


def fastest(rows: list[dict], n: int) -> str | None:
    """The relattn backend with the smallest fwd+bwd median at length ``n`` (None if none ran)."""
    ok = [r for r in rows if r["n"] == n and r["kind"] == "relattn" and r["status"] == "ok"]
    return min(ok, key=lambda r: r["fwdbwd_ms"])["implementation"].removeprefix("relattn:") if ok else None


def spans(winners: list[tuple[int, str | None]]) -> str:
    """``[(64, "a"), (128, "a"), (256, "b")]`` -> ``"a: N = 64..128; b: N = 256"``."""
    parts: list[tuple[str | None, int, int]] = []
    for n, name in winners:
        if parts and parts[-1][0] == name:
            parts[-1] = (name, parts[-1][1], n)
        else:
            parts.append((name, n, n))
    return "; ".join(f"{name}: N = {lo}" + (f"..{hi}" if hi != lo else "") for name, lo, hi in parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, DEFAULTS, OPTIONS)
    p.add_argument("--ks", type=int, nargs="+", default=KS, help=f"values of K (default: {' '.join(map(str, KS))})")
    p.add_argument("--json", metavar="PATH", help="also write every run (one per K) here")
    args = p.parse_args(argv)
    if args.json and os.path.isdir(args.json):
        p.error(f"--json: {args.json!r} is a folder")
    config = config_from_args(args, DEFAULTS)
    names = list(config.backends)
    print(f"{config.threads} threads, B={config.batch} H={config.heads} D={config.head_dim}, {config.dtype}, both "
          f"tables, causal={config.causal}; fwd+bwd median ms of {config.repeats} interleaved calls")
    print(f"{'K':>4} {'N':>6} " + " ".join(f"{b:>9}" for b in names) + "  fastest")
    runs = []
    for kk in args.ks:
        run = run_bench(replace(config, max_relative_position=kk), progress=False)
        runs.append(run)
        by = {(r["n"], r["implementation"].removeprefix("relattn:")): r for r in run["rows"]}
        winners = []
        for n in config.lengths:
            cells = [f"{by[(n, b)]['fwdbwd_ms']:9.2f}" if by[(n, b)]["status"] == "ok" else f"{'-':>9}" for b in names]
            winners.append((n, fastest(run["rows"], n)))
            print(f"{kk:>4} {n:>6} " + " ".join(cells) + f"  {winners[-1][1]}", flush=True)
        refused = {b: by[(n, b)]["reason"] for n in config.lengths for b in names if by[(n, b)]["status"] != "ok"}
        for b, reason in refused.items():
            print(f"K={kk}: {b} not measured: {reason}")
        print(f"K={kk}: fastest {spans(winners)}")
    if args.json:
        atomic_write_text(args.json, json.dumps({"runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
