"""Where packing a padded batch pays: RelativeMultiheadAttention on a right-padded batch, packed
(``relative_attention_varlen`` on the real tokens) against masked (the key padding mask, every position computed),
at several padded fractions; what ``relattn.padding.PACK_FROM`` is set from.

Self-attention, E = 512, 8 heads, K = 64, both tables, B = 8, N = 512, float32, forward + backward, 2 threads by
default. The padding is spread over the batch (entry b loses a share proportional to b). Both paths run in one
process, interleaved, best of ``--reps`` (the minimum: the machine is shared); ratio = masked / packed (> 1: packed
faster).

    PYTHONPATH=src python benchmarks/padding.py
    PYTHONPATH=src python benchmarks/padding.py --fractions 0.02 0.1 0.3 --reps 9 --json padding.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from relattn import RelativeMultiheadAttention
from relattn._io import atomic_write_text
from relattn.padding import Packing


def lengths_for(fraction: float, batch: int, n: int) -> list[int]:
    """``batch`` lengths of at most ``n`` whose padding is about ``fraction`` of ``batch * n``, spread by entry."""
    drop, share = round(fraction * batch * n), sum(range(batch)) or 1
    return [n - min(n - 1, round(drop * b / share)) for b in range(batch)]


def _step(module, x, padding, packed: bool):
    """One forward + backward, packed or masked (then zeroed at the padding) whatever PACK_FROM says."""
    worth = Packing.__dict__["worth_packing"]
    Packing.worth_packing = property(lambda self: packed)
    try:
        module(x, key_padding_mask=padding)[0].sum().backward()
    finally:
        Packing.worth_packing = worth


def measure(fraction: float, *, embed: int, heads: int, batch: int, n: int, reps: int, backend: str) -> dict:
    torch.manual_seed(0)
    module = RelativeMultiheadAttention(embed, heads, 64, backend=backend)
    x = torch.randn(batch, n, embed, requires_grad=True)
    lengths = lengths_for(fraction, batch, n)
    padding = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]
    times = {"masked": [], "packed": []}
    for name in times:
        _step(module, x, padding, name == "packed")  # warm-up
    for _ in range(reps):
        for name in times:
            t0 = time.perf_counter()
            _step(module, x, padding, name == "packed")
            times[name].append(time.perf_counter() - t0)
    best = {name: min(t) * 1e3 for name, t in times.items()}
    return {"fraction": padding.float().mean().item(), "lengths": lengths, "masked_ms": best["masked"],
            "packed_ms": best["packed"], "ratio": best["masked"] / best["packed"], "times_s": times}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05, 0.1, 0.2, 0.4])
    p.add_argument("--embed", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for fraction in args.fractions:
        row = measure(fraction, embed=args.embed, heads=args.heads, batch=args.batch, n=args.length, reps=args.reps,
                      backend=args.backend)
        rows.append(row)
        print(f"padded {row['fraction']:.3f}  masked {row['masked_ms']:8.1f} ms  packed {row['packed_ms']:8.1f} ms  "
              f"masked/packed {row['ratio']:.2f}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows},
                                                indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
