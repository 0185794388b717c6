"""Masked calls: every relattn backend with a key padding mask against SDPA with the same mask.

Both tables, K = 64, float32, B = 2, H = 8, D = 64, 2 threads by default; batch entry 1 has its last quarter of
keys padded (``--padded-keys``). Forward + backward, interleaved medians in one process
(``relattn.bench.run_bench``); a backend that refuses masks is listed with its reason.

    PYTHONPATH=src python benchmarks/masked.py                  # N = 2048
    PYTHONPATH=src python benchmarks/masked.py --lengths 1024 4096 --repeats 3 --json masked.json
"""

from __future__ import annotations

import argparse
import json
import os

from relattn._io import atomic_write_text
from relattn.bench import BenchConfig, add_arguments, config_from_args, run_bench

DEFAULTS = {"full": BenchConfig(lengths=(2048,), batch=2, padded_keys=0.25, forward=False, memory=False, peers=())}
OPTIONS = ("lengths", "backends", "padded_keys", "max_relative_position", "heads", "head_dim", "batch", "causal",
           "dtype", "device", "threads", "repeats", "warmup", "seed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, DEFAULTS, OPTIONS)
    p.add_argument("--json", metavar="PATH", help="also write the result (every row) here")
    args = p.parse_args(argv)
    if args.json and os.path.isdir(args.json):
        p.error(f"--json: {args.json!r} is a folder")
    config = config_from_args(args, DEFAULTS)
    result = run_bench(config, progress=False)
    m = result["machine"]
    print(f"torch {m['torch']}, {m['torch_threads']} threads ({m['cpu']}), B={config.batch} H={config.heads} "
          f"D={config.head_dim} K={config.max_relative_position}, {config.dtype}, both tables, key padding mask "
          f"(last entry: last {config.padded_keys:g} of keys padded), causal={config.causal}; fwd+bwd ms, median "
          f"of {config.repeats} interleaved calls; ratio = x SDPA with the same mask, same run")
    print(f"{'N':>6}  {'implementation':<18} {'ms':>9} {'ratio':>7}")
    for r in result["rows"]:
        if r["status"] == "ok":
            ratio = f"{r['fwdbwd_ratio']:7.2f}" if r["fwdbwd_ratio"] is not None else f"{'-':>7}"
            print(f"{r['n']:>6}  {r['implementation']:<18} {r['fwdbwd_ms']:9.1f} {ratio}", flush=True)
        else:
            print(f"{r['n']:>6}  {r['implementation']:<18} {r['status']}: {r['reason']}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
