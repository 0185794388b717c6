"""What the variants cost: an asymmetric window or zero-beyond table against symmetric windows, one sitting.

The kernels take symmetric windows only; ``(left, right)`` runs as ``K = max(left, right)`` with the edge rows
repeated, and ``beyond="zero"`` as ``K + 1`` with zero rows (``positions.symmetric_table``). This measures what
that costs against a symmetric window of the same number of rows. Forward + backward through ``auto``.

    PYTHONPATH=src python benchmarks/variants.py              # B=1, H=16, N=1500, D=64 (w2v-bert-2.0's shape)
    PYTHONPATH=src python benchmarks/variants.py --n 32 --reps 1 --json /tmp/v.json   # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from relattn import relative_attention
from relattn._io import atomic_write_text
from relattn.bench.measure import time_interleaved

CASES = {  # name: (max_relative_position, beyond, value table)
    "K=36 (73 rows)": (36, "clip", True),
    "(64, 8) (73 rows)": ((64, 8), "clip", True),
    "K=64 (129 rows)": (64, "clip", True),
    "(64, 8) keys only": ((64, 8), "clip", False),
    "K=4": (4, "clip", True),
    "K=4 zero beyond": (4, "zero", True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1500, help="N = M (default %(default)s)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds (default %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the medians here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    d = 64
    q, k, v = (torch.randn(1, args.heads, args.n, d, generator=g).requires_grad_() for _ in range(3))
    grad_out = torch.randn(1, args.heads, args.n, d, generator=g)

    def case(window, beyond, values):
        left, right = (window, window) if isinstance(window, int) else window
        rk = (0.1 * torch.randn(left + right + 1, d, generator=g)).requires_grad_()
        rv = (0.1 * torch.randn(left + right + 1, d, generator=g)).requires_grad_() if values else None
        params = [t for t in (q, k, v, rk, rv) if t is not None]
        return lambda: torch.autograd.grad(
            relative_attention(q, k, v, rk, rv, max_relative_position=window, beyond=beyond), params, grad_out)

    times = time_interleaved({name: case(*c) for name, c in CASES.items()}, args.reps)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["K=36 (73 rows)"]
    print(f"B=1 H={args.heads} N={args.n} D={d}, forward+backward, auto, {args.threads} threads, "
          f"median of {args.reps} interleaved rounds")
    for name, ms in medians.items():
        print(f"{name:>20}: {ms:9.1f} ms  {ms / base:5.2f}x K=36")
    if args.json:
        atomic_write_text(args.json, json.dumps({"config": vars(args), "median_ms": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
