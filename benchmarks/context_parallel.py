"""Context parallelism on this machine: the ring (``relattn.distributed.context_parallel_attention``) against an
all-gather of k and v, for P = 1, 2, 4 gloo processes at a fixed total sequence length N.

Per P, per implementation: forward + backward ms (median of interleaved repeats; the slowest rank), the peak
extra memory of one forward + backward on a rank (``relattn.bench.measure.peak_extra_bytes``, torch.profiler on
the CPU), and the bytes each rank hands to ``torch.distributed`` per forward + backward. The all-gather baseline
gathers k and v (``torch.distributed.nn.functional.all_gather``, whose backward sends each rank its gradients
back by all-to-all), then calls ``relative_attention`` on its queries against the whole sequence. Both use the same
backend for the attention itself. The ring's overlap is shown per step from its timeline
(``relattn.distributed.record_timeline``): compute time, time left waiting for the transfer after the compute, and
the same transfer timed alone.

    PYTHONPATH=src python benchmarks/context_parallel.py                      # N = 2048, P = 1 2 4
    PYTHONPATH=src python benchmarks/context_parallel.py --total 4096 --world 1 2 --json cp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path


def _worker(rank: int, world: int, init_file: str, args: dict, out_dir: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*all_gather is deprecated", category=FutureWarning)
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(_measure(rank, world, args)), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, a: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    from relattn import distributed as cp
    from relattn import relative_attention
    from relattn.bench.measure import peak_extra_bytes

    n = a["total"] // world
    layout = a["layout"]
    g = torch.Generator().manual_seed(rank)
    b, h, d, kk = a["batch"], a["heads"], a["head_dim"], a["max_relative_position"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
    torch.manual_seed(0)
    rel_k, rel_v = torch.randn(2 * kk + 1, d).requires_grad_(), torch.randn(2 * kk + 1, d).requires_grad_()
    grad_out = torch.randn(b, h, n, d, generator=g)
    kw = dict(max_relative_position=kk, is_causal=a["causal"], backend=a["backend"])
    segs = cp.segments(n, rank, world, layout)

    def ring():
        out = cp.context_parallel_attention(q, k, v, rel_k, rel_v, layout=layout, **kw)
        out.backward(grad_out)

    def gathered():
        order = torch.argsort(torch.cat([cp.positions(n, r, world, layout) for r in range(world)]))
        full_k = torch.cat(all_gather(k), 2)[:, :, order]
        full_v = torch.cat(all_gather(v), 2)[:, :, order]
        out = torch.cat([relative_attention(q[:, :, local:local + length], full_k, full_v, rel_k, rel_v,
                                            query_offset=start, **kw) for start, length, local in segs], 2)
        out.backward(grad_out)

    sent = [0]
    original = dist.batch_isend_irecv

    def counting(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)

    dist.batch_isend_irecv = counting
    ring()
    ring_bytes = sent[0]
    dist.batch_isend_irecv = original
    kv_bytes = 2 * q.numel() * q.element_size()
    gather_bytes = 2 * (world - 1) * kv_bytes  # forward: k, v to each other rank; backward: their gradients back
    result = {"n_local": n, "ring_bytes": ring_bytes, "gather_bytes": gather_bytes}
    calls = {"ring": ring, "all-gather": gathered}
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(a["repeats"]):  # interleaved: drift in the machine's load reaches both alike
        for name, fn in calls.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, fn in calls.items():
        dist.barrier()
        result[f"{name}_ms"] = 1e3 * statistics.median(times[name])
        result[f"{name}_peak_bytes"] = peak_extra_bytes(fn, torch.device("cpu"))
    dist.barrier()
    with cp.record_timeline() as events:
        ring()
    at = {(p, s, e): t for p, s, e, t in events}
    steps = []
    for phase in ("forward", "backward"):
        for s in range(world - 1):
            steps.append({"phase": phase, "step": s,
                          "compute_ms": 1e3 * (at[(phase, s, "compute_end")] - at[(phase, s, "compute_start")]),
                          "wait_after_compute_ms": 1e3 * (at[(phase, s, "wait_end")] - at[(phase, s, "compute_end")])})
    result["steps"] = steps
    if world > 1:  # the forward's k|v transfer of one step, alone
        kv = torch.cat([k, v], -1).detach().contiguous()
        spare = torch.empty_like(kv)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        alone = []
        for _ in range(a["repeats"]):
            dist.barrier()
            t0 = time.perf_counter()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, spare, prv), dist.P2POp(dist.isend, kv, nxt)]):
                w.wait()
            alone.append(time.perf_counter() - t0)
        result["transfer_alone_ms"] = 1e3 * statistics.median(alone)
    return result


def run(world: int, args: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, str(Path(tmp, "init")), args, tmp), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(world)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", type=int, default=2048, help="N, the whole sequence (default: %(default)s)")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4], help="P values (default: 1 2 4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-relative-position", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    p.add_argument("--backend", default="native")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.json and os.path.isdir(a.json):
        p.error(f"--json: {a.json!r} is a folder")
    for w in a.world:
        if w < 1 or a.total % (w * (2 if a.layout == "zigzag" else 1)):
            p.error(f"--total {a.total} must split into {w} ranks with layout {a.layout}")
    import torch

    from relattn.backends import native

    native.unavailable()  # build the kernel once, before the ranks start
    args = vars(a)
    rows = {w: run(w, args) for w in a.world}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {a.threads} thread(s) per rank, gloo; N={a.total} "
          f"B={a.batch} H={a.heads} D={a.head_dim} K={a.max_relative_position}, float32, both tables, "
          f"causal={a.causal}, layout {a.layout}, backend {a.backend}; fwd+bwd, median of {a.repeats} (slowest "
          f"rank); memory: peak extra bytes of one fwd+bwd (largest rank); sent: bytes per rank per fwd+bwd")
    print(f"{'P':>2} {'n/rank':>7}  {'ring ms':>8} {'gather ms':>9}  {'ring MiB':>8} {'gather MiB':>10}  "
          f"{'ring sent MiB':>13} {'gather sent MiB':>15}")
    mib = 2.0 ** 20
    for w, ranks in rows.items():
        def worst(key, ranks=ranks):
            return max(r[key] for r in ranks)

        print(f"{w:>2} {ranks[0]['n_local']:>7}  {worst('ring_ms'):>8.1f} {worst('all-gather_ms'):>9.1f}  "
              f"{worst('ring_peak_bytes') / mib:>8.1f} {worst('all-gather_peak_bytes') / mib:>10.1f}  "
              f"{worst('ring_bytes') / mib:>13.2f} {worst('gather_bytes') / mib:>15.2f}")
    print("\nring overlap, rank 0, per step with a transfer: compute ms | still waiting after compute ms "
          "(transfer alone ms)")
    for w, ranks in rows.items():
        if w > 1:
            r0 = ranks[0]
            cells = ", ".join(f"{s['phase'][0]}{s['step']}: {s['compute_ms']:.1f} | {s['wait_after_compute_ms']:.2f}"
                              for s in r0["steps"])
            print(f"P={w}: {cells}  ({r0['transfer_alone_ms']:.2f})")
    if a.json:
        from relattn._io import atomic_write_text

        atomic_write_text(a.json, json.dumps({"args": args, "ranks": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
