"""What a decoding step pays around the kernel: one query against M cached keys through ``relative_attention``, the
native kernel's bare op with the same inputs, and SDPA without positions; one run, interleaved medians, microseconds.

B = 1, H = 8, D = 64, both tables (2K + 1 rows, shared by the heads), K = 64 by default (as ``shapes.py``'s decode
cases), float32, forward under ``no_grad``; each timed sample is ``--calls`` calls (a decoding loop), so what a call
costs in the loop is what is reported: the median sample, and the fastest (on a busy machine the median measures the
other processes). ``overhead`` = relattn - bare op: the op's checks (or its plan), dispatch and wrappers. At M = 16
the kernel has almost nothing to do, and relattn's time is its overhead plus the bare op's fixed cost.

    PYTHONPATH=src python benchmarks/decode_overhead.py --threads 1                 # M = 16 and 512
    PYTHONPATH=src python benchmarks/decode_overhead.py --quick --out /tmp/d.json   # seconds (for tests)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from relattn import relative_attention
from relattn._io import atomic_write_text
from relattn.backends import native
from relattn.bench.measure import time_interleaved

RESULTS = Path(__file__).resolve().parent / "results"  # where results go unless --out says otherwise


def case(m: int, kk: int, calls: int) -> dict:
    """The three ways of one decoding call against ``m`` keys, each ``calls`` calls per sample."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 8, 1, 64, generator=g), torch.randn(1, 8, m, 64, generator=g), torch.randn(1, 8, m, 64,
                                                                                                       generator=g)
    rk, rv = torch.randn(2 * kk + 1, 64, generator=g), torch.randn(2 * kk + 1, 64, generator=g)
    op = torch.ops.relattn_native.fwd.default
    tiles = native.tile_q(1, False, 2 * kk + 1, m), native.SETTINGS.current.tile_k
    reach = min(kk, m - 1)  # the window the op narrows K to (offsets -(m-1) .. 0)
    rows = slice(kk - reach, kk + reach + 1)
    rk3, rv3 = rk[None, rows].contiguous(), rv[None, rows].contiguous()

    def loop(fn):
        @torch.no_grad()
        def run():
            for _ in range(calls):
                fn()
        return run

    return {"relattn": loop(lambda: relative_attention(q, k, v, rk, rv, max_relative_position=kk, query_offset=m - 1)),
            "op": loop(lambda: op(q, k, v, rk3, rv3, None, None, None, None, reach, False, 0.125, m - 1, *tiles)),
            "sdpa": loop(lambda: F.scaled_dot_product_attention(q, k, v))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, nargs="+", default=[16, 512], help="cached keys M (default: %(default)s)")
    p.add_argument("--max-relative-position", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=21, help="timed rounds (median reported)")
    p.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    p.add_argument("--quick", action="store_true", help="few rounds and calls, for tests")
    p.add_argument("--out", default=RESULTS / "decode_overhead.json", help="JSON file to write (default: %(default)s)")
    args = p.parse_args(argv)
    if (reason := native.unavailable()) is not None:
        p.error(f"the native kernel is needed: {reason}")
    torch.set_num_threads(args.threads)
    reps, calls = (2, 3) if args.quick else (args.reps, args.calls)
    print(f"torch {torch.__version__}, {args.threads} threads; median of {reps} interleaved rounds of {calls} calls; "
          f"B=1 H=8 D=64 K={args.max_relative_position}, one query; us per call")
    print(f"{'M':>6} {'':>8} {'relattn':>9} {'bare op':>9} {'sdpa':>9} {'overhead':>9} {'ratio':>6}")
    rows = []
    for m in args.keys:
        times = time_interleaved(case(m, args.max_relative_position, calls), reps)
        row = {"keys": m, **{f"{n}_all_ms": t for n, t in times.items()}}
        for stat, f in (("median", statistics.median), ("fastest", min)):
            us = {name: f(t) * 1e3 / calls for name, t in times.items()}
            row[stat] = {**{f"{n}_us": u for n, u in us.items()}, "overhead_us": us["relattn"] - us["op"],
                         "ratio": us["relattn"] / us["sdpa"]}
            print(f"{m:6d} {stat:>8} {us['relattn']:9.1f} {us['op']:9.1f} {us['sdpa']:9.1f} "
                  f"{row[stat]['overhead_us']:9.1f} {row[stat]['ratio']:6.2f}", flush=True)
        rows.append(row)
    meta = {"torch": torch.__version__, "threads": args.threads, "reps": reps, "calls": calls,
            "max_relative_position": args.max_relative_position, "command": " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_text(args.out, json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
