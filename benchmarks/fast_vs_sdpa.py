"""relattn (``auto`` by default) against PyTorch SDPA without positions: forward+backward time and peak memory,
causal and not, at long N.

Both tables, K = 64, float32, B = 1, H = 8, D = 64, 2 threads by default. Measured by ``relattn.bench.run_bench``
(interleaved medians in one process, ratios against SDPA from the same run, peak extra memory by
``relattn.bench.measure.memory_method``), once not causal and once causal.

    PYTHONPATH=src python benchmarks/fast_vs_sdpa.py                  # N = 2048 4096 8192
    PYTHONPATH=src python benchmarks/fast_vs_sdpa.py --lengths 2048 --repeats 5 --no-memory --backends native \
        --json fast_vs_sdpa.json
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from relattn._io import atomic_write_text
from relattn.bench import BenchConfig, add_arguments, config_from_args, run_bench
from relattn.bench.measure import fmt_bytes

DEFAULTS = {"full": BenchConfig(lengths=(2048, 4096, 8192), repeats=7, forward=False, backends=("auto",), peers=())}
OPTIONS = ("lengths", "backends", "max_relative_position", "heads", "head_dim", "batch", "dtype", "device",
           "threads", "repeats", "warmup", "memory", "seed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, DEFAULTS, OPTIONS)
    p.add_argument("--json", metavar="PATH", help="also write every row (both runs) here")
    args = p.parse_args(argv)
    if args.json and os.path.isdir(args.json):
        p.error(f"--json: {args.json!r} is a folder")
    config = config_from_args(args, DEFAULTS)
    runs = [run_bench(replace(config, causal=causal), progress=False) for causal in (False, True)]
    m, names = runs[0]["machine"], [f"relattn:{b}" for b in config.backends]
    print(f"torch {m['torch']}, {m['torch_threads']} threads ({m['cpu']}), B={config.batch} H={config.heads} "
          f"D={config.head_dim} K={config.max_relative_position}, {config.dtype}, both tables; fwd+bwd: median of "
          f"{config.repeats} interleaved calls; ratio = relattn / SDPA in the same run")
    print(f"{'N':>6} {'causal':>6} {'sdpa ms':>9} {'implementation':>16} {'ms':>9} {'ratio':>6} {'sdpa peak':>10} "
          f"{'peak':>10} {'mem ratio':>9}")
    for run in runs:
        by = {(r["n"], r["implementation"]): r for r in run["rows"]}
        for n in config.lengths:
            s = by[(n, "sdpa")]
            for name in names:
                r = by[(n, name)]
                if r["status"] != "ok":
                    print(f"{n:>6} {str(run['config']['causal']):>6} {name:>26}  {r['status']}: {r['reason']}")
                    continue
                mem = f"{r['memory_ratio']:9.2f}" if r["memory_ratio"] is not None else f"{'-':>9}"
                print(f"{n:>6} {str(run['config']['causal']):>6} {s['fwdbwd_ms']:9.1f} {name:>16} "
                      f"{r['fwdbwd_ms']:9.1f} {r['fwdbwd_ratio']:6.2f} {fmt_bytes(s['peak_fwdbwd_bytes']):>10} "
                      f"{fmt_bytes(r['peak_fwdbwd_bytes']):>10} {mem}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps({"runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
