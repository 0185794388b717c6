"""``relattn check``: the device, the versions, what ``"auto"`` picks and why, every backend against the float64
formula, one timed call per backend against SDPA (:func:`relattn.bench.check.run_check`). Needs no extra package."""

from __future__ import annotations

import argparse
import sys

import torch

from ..bench.check import run_check
from ..bench.measure import DTYPES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="check this machine: device, versions, auto's choices, every backend against "
                                     "the float64 formula, one timed call (run it first on a new GPU)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES), dest="dtypes",
                   help="a dtype to check (repeatable; default: bfloat16, float16 and float32 on CUDA, float32 on "
                        "the CPU)")
    p.add_argument("--time-n", type=int, default=None,
                   help="sequence length of the timed call (default 4096 on CUDA, 512 on the CPU; 0: no timing)")
    p.set_defaults(func=_run, needs_cli_extra=False)


def _run(args: argparse.Namespace) -> int:
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"relattn check: error: --device {args.device}, but this torch sees no CUDA GPU "
              f"(torch {torch.__version__})", file=sys.stderr)
        return 2
    dtypes = None if args.dtypes is None else [DTYPES[d] for d in args.dtypes]
    return run_check(device=args.device, dtypes=dtypes, time_n=args.time_n)
