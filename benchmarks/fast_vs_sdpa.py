"""Shaw attention ("auto": the native kernel) vs PyTorch SDPA without positions: forward+backward time and memory.

Issue 3's target: both tables, K = 64, float32, B = 1, H = 8, D = 64, 2 threads; fwd+bwd within 1.5x of
``F.scaled_dot_product_attention`` at N = 2048, 4096, 8192, with and without is_causal; peak extra memory
linear in N. Times are medians of interleaved runs in one process (same q, k, v); peak extra memory is the
peak RSS of a fresh process running one fwd+bwd, minus its RSS once the inputs exist.

    PYTHONPATH=src python benchmarks/fast_vs_sdpa.py                 # N = 2048 4096 8192, causal and not
    PYTHONPATH=src python benchmarks/fast_vs_sdpa.py --lengths 2048 --reps 5 --no-memory --backend fused

The ``far`` column is the floor of the "fused" backend's route: its two far-region calls into PyTorch's causal
kernel alone (1.2x SDPA at N = 2048), which is why "native" exists.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    make_inputs,
    median_ms,
    peak_extra_bytes_in_child,
    peak_rss_bytes,
    rss_bytes,
    time_interleaved,
)

from relattn import relative_attention  # noqa: E402
from relattn.backends.fused import _attn_bwd, _attn_fwd  # noqa: E402


def step(method: str, inputs, *, kk: int, causal: bool, backend: str):
    """One forward + backward (gradients returned, not accumulated)."""
    q, k, v, rel_k, rel_v, grad = inputs
    if method == "far":  # the fused backend's far regions alone: PyTorch's causal kernel on K-shifted slices
        n, scale = q.shape[2], q.shape[-1] ** -0.5
        if n <= kk:  # no far region (and PyTorch's CPU kernel dies of SIGFPE on an empty query length)
            return None
        with torch.no_grad():
            for _ in range(1 if causal else 2):
                qs, ks, vs, gs = q[:, :, kk:], k[:, :, : n - kk], v[:, :, : n - kk], grad[:, :, kk:]
                out, lse = _attn_fwd(qs, ks, vs, True, scale)
                _attn_bwd(gs, qs, ks, vs, out, lse, True, scale)
        return None
    if method == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), grad)
    out = relative_attention(q, k, v, rel_k, rel_v, max_relative_position=kk, is_causal=causal, backend=backend)
    return torch.autograd.grad(out, (q, k, v, rel_k, rel_v), grad)


def child(args) -> None:
    torch.set_num_threads(args.threads)
    inputs = make_inputs(args.child_n, heads=args.heads, dim=args.dim, kk=args.k)
    step(args.child_method, make_inputs(256, heads=args.heads, dim=args.dim, kk=args.k), kk=args.k,
         causal=args.causal_child, backend=args.backend)  # load kernels and libraries first
    base = max(rss_bytes(), peak_rss_bytes() if args.child_n <= 256 else 0)
    step(args.child_method, inputs, kk=args.k, causal=args.causal_child, backend=args.backend)
    print(peak_rss_bytes() - base)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--k", type=int, default=64, help="max relative position K")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="timed rounds per length (median reported)")
    p.add_argument("--backend", default="auto", help="relattn backend to time (default: auto)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--child-n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-method", help=argparse.SUPPRESS)
    p.add_argument("--causal-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_n is not None:
        child(args)
        return 0

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, B=1 H={args.heads} D={args.dim} K={args.k}, "
          f"float32, both tables, backend={args.backend!r}; median of {args.reps} interleaved fwd+bwd runs")
    print("far: only the fused backend's far-region calls (PyTorch's causal kernel on K-shifted slices, one per side)")
    print(f"{'N':>6} {'causal':>6} {'sdpa ms':>9} {'far':>6} {args.backend + ' ms':>10} {'ratio':>6} "
          f"{'sdpa MiB':>9} {args.backend + ' MiB':>10} {'mem ratio':>9}")
    for n in args.lengths:
        for causal in (False, True):
            inputs = make_inputs(n, heads=args.heads, dim=args.dim, kk=args.k)
            fns = {m: (lambda m=m, x=inputs, c=causal: step(m, x, kk=args.k, causal=c, backend=args.backend))
                   for m in ("sdpa", "far", "relattn")}
            times = time_interleaved(fns, args.reps)
            a, b = median_ms(times["sdpa"]), median_ms(times["relattn"])
            far = median_ms(times["far"]) / a
            mem = ""
            if not args.no_memory:
                base = [os.path.abspath(__file__), "--child-n", str(n), "--k", str(args.k), "--heads",
                        str(args.heads), "--dim", str(args.dim), "--threads", str(args.threads), "--backend",
                        args.backend] + (["--causal-child"] if causal else [])
                ms = peak_extra_bytes_in_child([*base, "--child-method", "sdpa"]) / 2**20
                mr = peak_extra_bytes_in_child([*base, "--child-method", "relattn"]) / 2**20
                ratio = f"{mr / ms:9.2f}" if ms > 0 else f"{'-':>9}"  # a tiny N can leave SDPA's peak in the noise
                mem = f"{ms:9.0f} {mr:10.0f} {ratio}"
            print(f"{n:>6} {str(causal):>6} {a:9.1f} {far:6.2f} {b:10.1f} {b / a:6.2f} {mem}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
