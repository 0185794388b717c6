"""Attention dropout in the fused kernel: the op with ``dropout_p`` against itself without dropout and against
PyTorch SDPA with the same ``dropout_p`` (no positions), forward+backward.

Both tables, K = 64, float32, B = 1, H = 8, D = 64, 2 threads by default; the inputs of ``relattn.bench.measure``
(``make_inputs``) and its one timing loop (``time_interleaved``: the implementations interleaved, medians), so the
ratios come from one run.

    PYTHONPATH=src python benchmarks/dropout.py                          # N = 2048 4096, p = 0.1
    PYTHONPATH=src python benchmarks/dropout.py --lengths 512 --repeats 2 --json dropout.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from relattn import relative_attention
from relattn._io import atomic_write_text
from relattn.bench.measure import Problem, machine_info, make_inputs, time_interleaved


def _fwdbwd(forward, params, grad_out):
    def run():
        torch.autograd.grad(forward(), params, grad_out)

    return run


def measure(n: int, *, p: float, backend: str, repeats: int, problem: Problem) -> dict:
    """Median forward+backward ms of the op with dropout ``p``, without, and SDPA with ``p``, at length ``n``."""
    inp = make_inputs(problem, n)

    def op(dropout_p):
        return lambda: relative_attention(*inp.params, max_relative_position=inp.max_relative_position,
                                          dropout_p=dropout_p, backend=backend)

    sdpa = lambda: F.scaled_dot_product_attention(inp.q, inp.k, inp.v, dropout_p=p)  # noqa: E731
    fns = {"dropout": _fwdbwd(op(p), inp.params, inp.grad_out), "no dropout": _fwdbwd(op(0.0), inp.params,
                                                                                       inp.grad_out),
           "sdpa dropout": _fwdbwd(sdpa, (inp.q, inp.k, inp.v), inp.grad_out)}
    times = {name: statistics.median(t) for name, t in time_interleaved(fns, repeats).items()}
    return {"n": n, "dropout_p": p, "backend": backend, **{f"{k} ms": v for k, v in times.items()},
            "dropout / no dropout": times["dropout"] / times["no dropout"],
            "sdpa dropout / dropout": times["sdpa dropout"] / times["dropout"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout_p (default 0.1)")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.json and os.path.isdir(args.json):
        ap.error(f"--json: {args.json!r} is a folder")
    torch.set_num_threads(args.threads)
    problem = Problem()
    info = machine_info(torch.device("cpu"), args.threads)
    print(f"torch {info['torch']}, {info['torch_threads']} threads ({info['cpu']}), B=1 H=8 D=64 K=64, float32, both "
          f"tables; fwd+bwd, median of {args.repeats} interleaved calls")
    print(f"{'N':>6} {'dropout ms':>11} {'no-dropout ms':>14} {'SDPA dropout ms':>16} {'dropout/none':>13} "
          f"{'SDPA/relattn':>13}")
    rows = []
    for n in args.lengths:
        r = measure(n, p=args.dropout, backend=args.backend, repeats=args.repeats, problem=problem)
        rows.append(r)
        print(f"{n:>6} {r['dropout ms']:11.1f} {r['no dropout ms']:14.1f} {r['sdpa dropout ms']:16.1f} "
              f"{r['dropout / no dropout']:13.2f} {r['sdpa dropout / dropout']:13.2f}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
