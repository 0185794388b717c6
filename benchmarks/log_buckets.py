"""What DeBERTa's log-bucket positions cost as an expanded table, one sitting.

``max_relative_position=LogBuckets(span, buckets, max_position)`` runs as the equivalent clipped table
(``LogBuckets.expand``): at DeBERTa-v3's 256 buckets up to 512 that is K = 512, 1025 rows, where the compact table
has 512. This times, forward + backward through a backend, both tables (c2p and p2c) per head:

- ``log buckets (expanded)``: the op with DeBERTa-v3's LogBuckets and (H, 512, D) tables;
- ``clipped, 511 rows``: a plain clipped window of the compact table's width (K = 255), what the terms would cost
  if the kernels mapped offsets to the compact rows themselves;
- ``expansion only``: building the two expanded tables and their gradients back to the compact ones.

    PYTHONPATH=src python benchmarks/log_buckets.py              # B=1, H=12, N=2048, D=64 (DeBERTa-v3-base)
    PYTHONPATH=src python benchmarks/log_buckets.py --n 64 --reps 1 --json /tmp/lb.json   # seconds, for tests
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from relattn import relative_attention
from relattn._io import atomic_write_text
from relattn.bench.measure import time_interleaved
from relattn.positions import LogBuckets


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048, help="N = M (default %(default)s)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--backend", default="blocked", help="relattn backend (default %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds (default %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the medians here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    d, positions = 64, LogBuckets(256, 256, 512)
    kk = positions.max_relative_position(-(args.n - 1), args.n - 1)
    q, k, v = (torch.randn(1, args.heads, args.n, d, generator=g).requires_grad_() for _ in range(3))
    grad_out = torch.randn(1, args.heads, args.n, d, generator=g)
    compact = [(0.1 * torch.randn(args.heads, positions.rows, d, generator=g)).requires_grad_() for _ in range(2)]
    narrow = [t.detach()[:, :-1].clone().requires_grad_() for t in compact]  # 511 rows: K = 255

    def op(tables, window):
        params = [q, k, v, *tables]
        return lambda: torch.autograd.grad(
            relative_attention(q, k, v, tables[0], None, rel_q=tables[1], max_relative_position=window,
                               backend=args.backend), params, grad_out)

    def expansion():
        expanded = [positions.expand(t, kk) for t in compact]
        return torch.autograd.grad(expanded, compact, [torch.ones_like(e) for e in expanded])

    fns = {"log buckets (expanded)": op(compact, positions), "clipped, 511 rows": op(narrow, 255),
           "expansion only": expansion}
    times = time_interleaved(fns, args.reps)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["clipped, 511 rows"]
    print(f"B=1 H={args.heads} N={args.n} D={d}, forward+backward, {args.backend}, {args.threads} threads, "
          f"median of {args.reps} interleaved rounds; LogBuckets(256, 256, 512) expands to K = {kk}")
    for name, ms in medians.items():
        print(f"{name:>24}: {ms:9.1f} ms  {ms / base:5.2f}x clipped, 511 rows")
    if args.json:
        atomic_write_text(args.json, json.dumps({"config": vars(args), "K": kk, "median_ms": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
