"""Which backend is fastest at small N ("native", "dense", "fused", "blocked"): fwd+bwd median ms, for ``choose``.

    PYTHONPATH=src python benchmarks/crossover.py            # N = 64 .. 1536, K = 16 and 64
    PYTHONPATH=src python benchmarks/crossover.py --lengths 256 512 1024 --ks 64 --reps 9

Prints one row per (K, N) and, per K, the largest N at which dense is still fastest (None: never). The
order in ``relattn.backends.choose`` and its ``dense_max_scores`` threshold (for when "native" cannot
serve) cite this script.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import make_inputs, median_ms, time_interleaved  # noqa: E402

from relattn import relative_attention  # noqa: E402

BACKENDS = ("dense", "native", "fused", "blocked")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 384, 512, 768, 1024, 1536])
    p.add_argument("--ks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, B=1 H={args.heads} D={args.dim}, float32, both "
          f"tables, causal={args.causal}; fwd+bwd median ms of {args.reps} interleaved runs")
    print(f"{'K':>4} {'N':>6} " + " ".join(f"{b:>9}" for b in BACKENDS) + "  fastest")
    for kk in args.ks:
        last_dense = None
        for n in args.lengths:
            inputs = make_inputs(n, heads=args.heads, dim=args.dim, kk=kk, seed=n)

            def run(backend, inputs=inputs, kk=kk):
                *params, grad = inputs
                out = relative_attention(*params, max_relative_position=kk, is_causal=args.causal, backend=backend)
                torch.autograd.grad(out, params, grad)

            times = time_interleaved({b: (lambda b=b: run(b)) for b in BACKENDS}, args.reps)
            med = {b: median_ms(t) for b, t in times.items()}
            best = min(med, key=med.get)
            if best == "dense":
                last_dense = n
            print(f"{kk:>4} {n:>6} " + " ".join(f"{med[b]:9.2f}" for b in BACKENDS) + f"  {best}", flush=True)
        print(f"K={kk}: dense fastest up to N={last_dense}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
