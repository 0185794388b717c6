"""Masked calls: a key padding mask on "native" and "fused" (both take masks on the CPU) vs "blocked" and SDPA.

Both tables, K = 64, float32, B = 2, H = 8, D = 64, 2 threads; batch entry 1 has its last quarter of keys
padded. Forward + backward, medians of interleaved runs in one process; SDPA gets the same mask.

    PYTHONPATH=src python benchmarks/masked.py                  # N = 2048
    PYTHONPATH=src python benchmarks/masked.py --lengths 1024 4096 --reps 3
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import make_inputs, median_ms, time_interleaved  # noqa: E402

from relattn import relative_attention  # noqa: E402
from relattn.backends import native  # noqa: E402


def measure(n: int, kk: int, reps: int) -> dict[str, float]:
    """Median fwd+bwd ms of SDPA with the mask and of relattn's native, fused and blocked backends."""
    q, k, v, rel_k, rel_v, grad = make_inputs(n, heads=8, dim=64, kk=kk, batch=2)
    params = [q, k, v, rel_k, rel_v]
    mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
    mask[1, ..., n - n // 4 :] = False

    def sdpa():
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), params[:3], grad)

    def step(backend):
        def run():
            out = relative_attention(q, k, v, rel_k, rel_v, max_relative_position=kk, attn_mask=mask,
                                     backend=backend)
            return torch.autograd.grad(out, params, grad)
        return run

    backends = [b for b in ("native", "fused", "blocked") if b != "native" or native.unavailable() is None]
    times = time_interleaved({"sdpa": sdpa, **{b: step(b) for b in backends}}, reps)
    return {name: median_ms(ts) for name, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048])
    p.add_argument("--k", type=int, default=64, help="max relative position K")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per length (median reported)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, B=2 H=8 D=64 K={args.k}, float32, both tables, "
          f"key padding mask (entry 1: last quarter padded); fwd+bwd ms, median of {args.reps}")
    print(f"{'N':>6} {'sdpa+mask':>10} {'native':>8} {'fused':>8} {'blocked':>8} {'native/sdpa':>11} "
          f"{'fused/sdpa':>10} {'blocked/sdpa':>12}")
    for n in args.lengths:
        t = measure(n, args.k, args.reps)
        s, nat, f, b = t["sdpa"], t.get("native", float("nan")), t["fused"], t["blocked"]  # nan: no native kernel
        print(f"{n:>6} {s:10.1f} {nat:8.1f} {f:8.1f} {b:8.1f} {nat / s:11.2f} {f / s:10.2f} {b / s:12.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
