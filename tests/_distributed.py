"""Running a function on several gloo processes from a test: :func:`spawn`, with a deadline and a clean shutdown.

The workers (functions of this module, so that the spawned interpreters can import them) write their results to
``out_dir/rank<r>.json``; the test reads them. Every worker joins the group through a file store, gets a gloo
timeout, and destroys the group in a ``finally`` after all its collective work.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_TIMEOUT = timedelta(seconds=90)


def spawn(fn, world: int, *args, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world, init_file, *args)`` on ``world`` spawned processes; raise if any fails or the deadline
    passes (the processes are then killed)."""
    init_file = Path(args[0]) / "init" if args else None
    context = mp.start_processes(_entry, args=(fn, world, str(init_file), *args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} processes did not finish in {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join(5)


def _entry(rank, fn, world, init_file, *args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def write(out_dir, rank: int, result) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


def read(out_dir, world: int) -> list:
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(world)]


# ------------------------------------------------------------------------------------------------- the op's cases

# name -> (K or (left, right), tables, is_causal, layout, beyond, mask, backend); 6 positions per rank.
N_LOCAL = 6
OP_CASES = {
    "K<chunk shared": (2, "shared", False, "contiguous", "clip", None, "auto"),
    "K<chunk shared causal": (2, "shared", True, "contiguous", "clip", None, "auto"),
    "K>chunk per-head": (9, "per_head", False, "contiguous", "clip", None, "auto"),
    "K>chunk per-head causal": (9, "per_head", True, "contiguous", "clip", None, "auto"),
    "K>N shared causal": (40, "shared", True, "contiguous", "clip", None, "auto"),
    "K=0 per-head": (0, "per_head", False, "contiguous", "clip", None, "auto"),
    "asymmetric causal": ((1, 8), "per_head", True, "contiguous", "clip", None, "auto"),
    "beyond zero": (3, "shared", False, "contiguous", "zero", None, "auto"),
    "keys only": (4, "keys_only_per_head", True, "contiguous", "clip", None, "auto"),
    "values only": (4, "values_only", False, "contiguous", "clip", None, "auto"),
    "no tables causal": (4, "none", True, "contiguous", "clip", None, "auto"),
    "zigzag causal K<chunk": (2, "per_head", True, "zigzag", "clip", None, "auto"),
    "zigzag causal K>chunk": (9, "shared", True, "zigzag", "clip", None, "auto"),
    "zigzag": (5, "shared", False, "zigzag", "clip", None, "auto"),
    "key padding mask": (3, "shared", False, "contiguous", "clip", "padding", "auto"),
    "full mask causal zigzag": (7, "per_head", True, "zigzag", "clip", "full", "auto"),
    "blocked backend": (9, "per_head", False, "contiguous", "clip", None, "blocked"),
    "blocked backend causal zigzag mask": (3, "shared", True, "zigzag", "clip", "full", "blocked"),
}


# The cases 3 ranks also run (a third process costs more than the cases): both tables, shared and per head, causal
# and not, K smaller and larger than the chunk, both layouts, a mask.
OP_CASES_3 = ("K<chunk shared", "K<chunk shared causal", "K>chunk per-head", "K>chunk per-head causal",
              "K>N shared causal", "asymmetric causal", "zigzag causal K>chunk", "full mask causal zigzag",
              "blocked backend causal zigzag mask")


def cases_for(world: int) -> tuple[str, ...]:
    return tuple(OP_CASES) if world == 2 else OP_CASES_3


def _case_inputs(name: str, world: int):
    from helpers import random_inputs

    window, tables, causal, layout, beyond, mask_kind, backend = OP_CASES[name]
    n = N_LOCAL * world
    q, k, v, rel_k, rel_v = random_inputs(2, 3, n, n, 4, 5, window, tables=tables, seed=len(name))
    g = torch.Generator().manual_seed(len(name) + 1)
    grad_out = torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "padding":
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
        mask[0, ..., -4:] = False
        mask[1, ..., :3] = False
    elif mask_kind == "full":
        mask = torch.rand(2, 1, n, n, generator=g) > 0.3
        mask[1, 0, 2] = False  # one row that sees no key: zeros, zero gradients
    return (q, k, v, rel_k, rel_v, grad_out, mask), dict(max_relative_position=window, beyond=beyond,
                                                         is_causal=causal), layout, backend


def _err(got, want) -> float:
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    return (got - want).abs().max().item() if got.numel() else 0.0


def op_worker(rank: int, world: int, out_dir: str) -> None:
    """For every case of :data:`OP_CASES`: the largest difference from the single-process op, per output and
    gradient (tables: the sum of the ranks' shares); plus one forward+backward's timeline and the error messages
    of bad calls."""
    from relattn import relative_attention
    from relattn.distributed import context_parallel_attention, record_timeline, shard

    results = {}
    for name in cases_for(world):
        (q, k, v, rel_k, rel_v, grad_out, mask), kw, layout, backend = _case_inputs(name, world)
        full = [t.clone().requires_grad_() if t is not None else None for t in (q, k, v, rel_k, rel_v)]
        want = relative_attention(*full, attn_mask=mask, backend="dense", **kw)
        want.backward(grad_out)

        def local(t, layout=layout):
            return shard(t, rank, world, dim=2, layout=layout)

        mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
        mine += [t.clone().requires_grad_() if t is not None else None for t in (rel_k, rel_v)]
        local_mask = None if mask is None or mask.shape[2] == 1 else local(mask)
        got = context_parallel_attention(*mine, attn_mask=mask if local_mask is None else local_mask,
                                         layout=layout, backend=backend, **kw)
        got.backward(local(grad_out))
        errors = {"out": _err(got, local(want)), "dq": _err(mine[0].grad, local(full[0].grad)),
                  "dk": _err(mine[1].grad, local(full[1].grad)), "dv": _err(mine[2].grad, local(full[2].grad))}
        for i, table in ((3, "d_rel_k"), (4, "d_rel_v")):
            if mine[i] is not None:
                share = mine[i].grad.clone()
                dist.all_reduce(share)
                errors[table] = _err(share, full[i].grad)
        results[name] = errors

    (q, k, v, rel_k, rel_v, grad_out, _), kw, _, _ = _case_inputs("K<chunk shared causal", world)
    runs = []
    for _ in range(2):
        mine = [shard(t, rank, world, dim=2).requires_grad_() for t in (q, k, v)]
        with record_timeline() as events:
            out = context_parallel_attention(*mine, rel_k, rel_v, **kw)
            out.backward(shard(grad_out, rank, world, dim=2))
        runs.append([out.detach(), *(t.grad for t in mine)])
    deterministic = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    errors = {}
    bad = {"backend": dict(backend="dense"), "layout": dict(layout="spiral"),
           "mask": dict(attn_mask=torch.ones(2, 3, N_LOCAL, N_LOCAL, dtype=torch.bool))}
    for what, extra in bad.items():
        try:
            context_parallel_attention(mine[0], mine[1], mine[2], rel_k, rel_v, **{**kw, **extra})
            errors[what] = None
        except (ValueError, TypeError) as e:
            errors[what] = str(e)
    write(out_dir, rank, {"cases": results, "timeline": [list(e) for e in events], "errors": errors,
                          "deterministic": deterministic})
