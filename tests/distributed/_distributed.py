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

N_LOCAL = 6  # positions per rank


def _case(window, tables="shared", *, causal=False, layout="contiguous", beyond="clip", mask=None, backend="auto",
          rel_q=None, heads=(3, 3), offset=0, scale=None, biases=False, dropout=0.0, rel_bias=None):
    """One conformance case of the ring: ``tables`` as helpers.TABLES names them, ``rel_q`` and ``rel_bias`` (the
    scalar bias) None / "shared" / "per_head", ``heads`` (H, Hkv), ``mask`` None / "padding" / "full" (random, one
    row fully masked) / "float", ``dropout`` the op's dropout_p (the ring draws the single-process op's mask)."""
    return dict(window=window, tables=tables, causal=causal, layout=layout, beyond=beyond, mask=mask,
                backend=backend, rel_q=rel_q, heads=heads, offset=offset, scale=scale, biases=biases, dropout=dropout,
                rel_bias=rel_bias)


# The ring's conformance cases: the op's features combined pairwise (tables shared / per head / one side / none,
# rel_q, grouped heads, windows: K below and above the chunk, K > N, K = 0, asymmetric, zero beyond, LogBuckets;
# masks, causal, query offsets, both layouts, both CPU backends that serve chunk pairs, dropout; the scalar bias
# rel_bias with T5's buckets and with tables, dropout, rel_q).
OP_CASES = {
    "K<chunk shared": _case(2),
    "K<chunk shared causal": _case(2, causal=True),
    "K>chunk per-head causal rel_q": _case(9, "per_head", causal=True, rel_q="per_head"),
    "K>N shared causal gqa": _case(40, causal=True, heads=(4, 2)),
    "K=0 per-head rel_q shared mqa": _case(0, "per_head", rel_q="shared", heads=(3, 1)),
    "asymmetric causal rel_q": _case((1, 8), "keys_per_head", causal=True, rel_q="shared"),
    "beyond zero gqa mask": _case(3, "values_per_head", beyond="zero", heads=(4, 2), mask="full"),
    "keys only offset causal": _case(4, "keys_only_per_head", causal=True, offset=3),
    "values only offset": _case(4, "values_only", offset=-2, mask="float"),
    "no tables causal scale": _case(4, "none", causal=True, scale=0.3),
    "log buckets": _case(("log", 4, 6, 20), "per_head", rel_q="per_head"),
    "log buckets causal gqa zigzag": _case(("log", 3, 4, 12), causal=True, layout="zigzag", heads=(4, 2),
                                           rel_q="shared"),
    "zigzag causal K<chunk": _case(2, "per_head", causal=True, layout="zigzag"),
    "zigzag rel_q mask": _case(5, layout="zigzag", rel_q="shared", mask="full"),
    "key padding mask gqa rel_q": _case(3, "keys_per_head", mask="padding", heads=(4, 2), rel_q="per_head"),
    "full mask causal zigzag offset": _case(7, "per_head", causal=True, layout="zigzag", mask="full", offset=2),
    "transformer-xl blocked": _case(23, "keys_per_head", biases=True, backend="blocked", mask="padding"),
    "transformer-xl causal gqa zigzag blocked": _case(40, "per_head", biases=True, causal=True, layout="zigzag",
                                                      heads=(4, 2), backend="blocked"),
    "blocked gqa rel_q bias": _case(9, "per_head", backend="blocked", heads=(4, 2), rel_q="shared",
                                    rel_bias="per_head"),
    "blocked causal zigzag mask log": _case(("log", 3, 4, 12), causal=True, layout="zigzag", mask="full",
                                            backend="blocked"),
    "dropout zigzag causal gqa rel_q bias": _case(5, "per_head", causal=True, layout="zigzag", heads=(4, 2),
                                                  rel_q="shared", dropout=0.3, rel_bias="shared"),
    "dropout blocked transformer-xl mask": _case(9, "keys_per_head", biases=True, backend="blocked", mask="padding",
                                                 dropout=0.2),
    "t5 buckets bias causal zigzag": _case(("t5", 8, 12, False), "none", causal=True, layout="zigzag", scale=1.0,
                                           rel_bias="per_head"),
    "t5 buckets bias mask gqa offset": _case(("t5", 8, 20, True), "none", mask="full", heads=(4, 2), offset=2,
                                             scale=1.0, rel_bias="shared"),
}


def _triton_here() -> bool:
    """Whether the "triton" backend runs in these processes (interpreted on the CPU: tests/conftest.py sets
    TRITON_INTERPRET=1 without CUDA, and the spawned processes inherit it)."""
    from helpers import unavailable_here

    return unavailable_here("triton") is None


if _triton_here():  # the ring's chunk pairs on triton's ops: the bias, its edge rows, rel_q, grouped heads
    OP_CASES["triton t5 bias keys rel_q gqa"] = _case(("t5", 8, 12, True), "keys_per_head", heads=(4, 2),
                                                      rel_q="shared", rel_bias="per_head", backend="triton")

# The cases 3 ranks also run (a third process costs more than the cases).
OP_CASES_3 = ("K<chunk shared causal", "K>chunk per-head causal rel_q", "K>N shared causal gqa",
              "asymmetric causal rel_q", "log buckets causal gqa zigzag", "full mask causal zigzag offset",
              "blocked causal zigzag mask log", "dropout zigzag causal gqa rel_q bias", "t5 buckets bias causal zigzag")


def cases_for(world: int) -> tuple[str, ...]:
    return tuple(OP_CASES) if world == 2 else OP_CASES_3


def _window(spec):
    from relattn.positions import LogBuckets, T5Buckets

    if isinstance(spec, tuple) and spec[0] in ("log", "t5"):
        return (LogBuckets if spec[0] == "log" else T5Buckets)(*spec[1:])
    return spec


def _case_inputs(name: str, world: int):
    from helpers import TABLES
    from relattn.positions import table_rows

    c = OP_CASES[name]
    window = _window(c["window"])
    n, (h, hkv), d, dv = N_LOCAL * world, c["heads"], 4, 5
    g = torch.Generator().manual_seed(len(name))

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    rows = table_rows(window)
    (has_k, k_heads), (has_v, v_heads) = TABLES[c["tables"]]
    q, k, v = rnd(2, h, n, d), rnd(2, hkv, n, d), rnd(2, hkv, n, dv)
    rel_k = rnd(*((h,) if k_heads else ()), rows, d) if has_k else None
    rel_v = rnd(*((h,) if v_heads else ()), rows, dv) if has_v else None
    rel_q = None if c["rel_q"] is None else rnd(*((h,) if c["rel_q"] == "per_head" else ()), rows, d)
    rel_bias = None if c["rel_bias"] is None else rnd(*((h,) if c["rel_bias"] == "per_head" else ()), rows)
    grad_out = rnd(2, h, n, dv)
    mask = None
    if c["mask"] == "padding":
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
        mask[0, ..., -4:] = False
        mask[1, ..., :3] = False
    elif c["mask"] == "full":
        mask = torch.rand(2, 1, n, n, generator=g) > 0.3
        mask[1, 0, 2] = False  # a row that sees no key (in every chunk): zeros, zero gradients
    elif c["mask"] == "float":
        mask = rnd(2, h, n, n)
    kw = dict(max_relative_position=window, beyond=c["beyond"], is_causal=c["causal"], query_offset=c["offset"],
              scale=c["scale"], enable_gqa=hkv != h, dropout_p=c["dropout"])
    if c["biases"]:
        kw.update(content_bias=rnd(h, d), position_bias=rnd(h, d))
    return (q, k, v, rel_k, rel_v, rel_q, rel_bias, grad_out, mask), kw, c["layout"], c["backend"]


def _err(got, want) -> float:
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    return (got - want).abs().max().item() if got.numel() else 0.0


def _refusal(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


# Every keyword of the op, with a value that is not its default, and what the ring does with it: "served" (it must
# then equal the single-process op) or "refused" (a ValueError naming it). A keyword of the op missing here fails the
# test that walks them: a new argument is either served or refused by the ring, never dropped.
WALK = {
    "rel_k": ("table", "served"), "rel_v": ("table", "served"), "rel_q": ("table", "served"),
    "max_relative_position": (("log", 3, 4, 12), "served"), "beyond": ("zero", "served"),
    "attn_mask": ("mask", "served"), "is_causal": (True, "served"), "dropout_p": (0.1, "served"),
    "scale": (0.3, "served"), "query_offset": (3, "served"), "enable_gqa": (True, "served"),
    "backend": ("dense", "refused"), "content_bias": ("bias", "served"), "position_bias": ("bias", "served"),
    "rel_bias": ("scalars", "served"),
}


def _walk(rank: int, world: int) -> dict:
    """For each keyword of the op: "served" with the error against the op, "refused" with the message, or
    "unknown" (a keyword :data:`WALK` does not list)."""
    import inspect

    from relattn import relative_attention
    from relattn.distributed import context_parallel_attention, shard

    n = N_LOCAL * world
    g = torch.Generator().manual_seed(99)
    results = {}
    for name in list(inspect.signature(relative_attention).parameters)[3:]:
        if name not in WALK:
            results[name] = ("unknown", None)
            continue
        value, kind = WALK[name]
        hkv = 1 if name == "enable_gqa" else 2
        q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
        k, v = k[:, :hkv], v[:, :hkv]
        kw = dict(max_relative_position=2)
        tables = {}
        if name in ("rel_k", "rel_v", "rel_q"):
            tables[name] = torch.randn(5, 4, generator=g, dtype=torch.float64)
        elif name in ("content_bias", "position_bias"):
            tables[name] = torch.randn(2, 4, generator=g, dtype=torch.float64)
        elif name == "rel_bias":
            tables[name] = torch.randn(5, generator=g, dtype=torch.float64)
        elif name == "max_relative_position":
            kw[name] = _window(value)
            tables["rel_k"] = torch.randn(2 * value[1], 4, generator=g, dtype=torch.float64)
        elif name == "attn_mask":
            kw[name] = torch.rand(1, 1, n, n, generator=g) > 0.4
        else:
            kw[name] = value
        if name in ("beyond", "is_causal", "query_offset", "scale", "enable_gqa", "content_bias", "position_bias"):
            tables["rel_k"] = torch.randn(5, 4, generator=g, dtype=torch.float64)
        torch.manual_seed(5)  # dropout: the op and the ring draw the same seed (the ring: its first rank's)
        want = None if kind == "refused" else relative_attention(q, k, v, **tables, **kw)

        def local(t):
            return shard(t, rank, world, dim=2)

        local_kw = {**kw, **({"attn_mask": local(kw["attn_mask"])} if name == "attn_mask" else {})}
        try:
            torch.manual_seed(5 + rank)  # each rank's generator its own: rank 0's seed is every rank's
            got = context_parallel_attention(local(q), local(k), local(v), **tables, **local_kw)
            results[name] = ("served", _err(got, local(want)) if want is not None else float("inf"))
        except (ValueError, TypeError) as e:
            results[name] = ("refused", str(e))
    return results


def _module_cases(rank: int, world: int) -> dict:
    """The module's own forward under context parallelism (``context_parallel=cp``) against its single-process
    forward: outputs and every parameter's gradient (the ranks' shares summed)."""
    from relattn import RelativeMultiheadAttention
    from relattn.distributed import ContextParallel
    from relattn.positions import LogBuckets
    from relattn.schemes import Shaw, TransformerXL

    cp = ContextParallel(layout="zigzag")
    n = N_LOCAL * world
    results = {}
    configs = {
        "rel_q gqa bias": dict(positions=Shaw(3, position_to_content=True, bias=True), num_kv_heads=2),
        "log buckets per-head": dict(positions=Shaw(LogBuckets(3, 4, 12), share_heads=False,
                                                    position_to_content=True)),
        "window tied": dict(positions=Shaw((2, 5), tie=True)),
        "transformer-xl gqa": dict(positions=TransformerXL(), num_kv_heads=2),
    }
    for name, config in configs.items():
        torch.manual_seed(len(name))
        module = RelativeMultiheadAttention(16, 4, dtype=torch.float64, **config)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.3)
        x = torch.randn(2, n, 16, dtype=torch.float64)
        padding = torch.zeros(2, n, dtype=torch.bool)
        padding[1, -3:] = True
        # real positions only: the single-process call runs packed (zeros at the padding), the ring masked
        real = (~padding)[..., None].double()
        want = module(x, key_padding_mask=padding, is_causal=True)[0] * real
        want.square().sum().backward()
        full = {k: p.grad.clone() for k, p in module.named_parameters()}
        module.zero_grad()
        got = module(cp.shard(x, dim=1), key_padding_mask=padding, is_causal=True, context_parallel=cp)[0]
        got = got * cp.shard(real, dim=1)
        got.square().sum().backward()
        errors = {"out": _err(got, cp.shard(want, dim=1))}
        for k, p in module.named_parameters():
            share = p.grad.clone()
            dist.all_reduce(share)
            errors[k] = _err(share, full[k])
        results[name] = errors
    return results


def op_worker(rank: int, world: int, out_dir: str) -> None:
    """For every case of :data:`OP_CASES`: the largest difference from the single-process op, per output and
    gradient (tables: the sum of the ranks' shares); the keyword walk; the module under context parallelism; one
    forward+backward's timeline; the error messages of bad calls."""
    from relattn import relative_attention
    from relattn.distributed import context_parallel_attention, record_timeline, shard

    results = {}
    for name in cases_for(world):
        (q, k, v, rel_k, rel_v, rel_q, rel_bias, grad_out, mask), kw, layout, backend = _case_inputs(name, world)
        full = [t.clone().requires_grad_() if t is not None else None for t in (q, k, v, rel_k, rel_v, rel_q,
                                                                                 rel_bias)]
        torch.manual_seed(11)  # dropout: the op's seed; the ring's is its first rank's, seeded alike below
        want = relative_attention(*full[:5], rel_q=full[5], rel_bias=full[6], attn_mask=mask, backend="dense", **kw)
        want.backward(grad_out)

        def local(t, layout=layout):
            return shard(t, rank, world, dim=2, layout=layout)

        mine = [local(t).clone().requires_grad_() for t in (q, k, v)]
        mine += [t.clone().requires_grad_() if t is not None else None for t in (rel_k, rel_v, rel_q, rel_bias)]
        local_mask = None if mask is None or mask.shape[2] == 1 else local(mask)
        torch.manual_seed(11 + rank)  # every rank's generator its own: rank 0's draw is broadcast
        got = context_parallel_attention(*mine[:5], rel_q=mine[5], rel_bias=mine[6],
                                         attn_mask=mask if local_mask is None else local_mask, layout=layout,
                                         backend=backend, **kw)
        got.backward(local(grad_out))
        errors = {"out": _err(got, local(want)), "dq": _err(mine[0].grad, local(full[0].grad)),
                  "dk": _err(mine[1].grad, local(full[1].grad)), "dv": _err(mine[2].grad, local(full[2].grad))}
        for i, table in ((3, "d_rel_k"), (4, "d_rel_v"), (5, "d_rel_q"), (6, "d_rel_bias")):
            if mine[i] is not None:
                share = mine[i].grad.clone()
                dist.all_reduce(share)
                errors[table] = _err(share, full[i].grad)
        results[name] = errors

    (q, k, v, rel_k, rel_v, _, _, grad_out, _), kw, _, _ = _case_inputs("K<chunk shared causal", world)
    runs = []
    for _ in range(2):
        mine = [shard(t, rank, world, dim=2).requires_grad_() for t in (q, k, v)]
        with record_timeline() as events:
            out = context_parallel_attention(*mine, rel_k, rel_v, **kw)
            out.backward(shard(grad_out, rank, world, dim=2))
        runs.append([out.detach(), *(t.grad for t in mine)])
    deterministic = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    x = mine[0].detach()
    bad = {"backend": lambda: context_parallel_attention(x, x, x, rel_k, None, **{**kw, "backend": "dense"}),
           "layout": lambda: context_parallel_attention(x, x, x, rel_k, None, **kw, layout="spiral"),
           "mask": lambda: context_parallel_attention(x, x, x, rel_k, None, **kw,
                                                      attn_mask=torch.ones(2, 3, N_LOCAL, N_LOCAL, dtype=torch.bool)),
           # unequal local lengths: rank 0 holds one position fewer; every rank gets the error
           "lengths": lambda: context_parallel_attention(*(x[:, :, :-1] if rank == 0 else x,) * 3, rel_k, None, **kw),
           # one rank's bad table: every rank gets an error (the others: which rank refused)
           "one rank refuses": lambda: context_parallel_attention(x, x, x, rel_k[:-1] if rank == 1 else rel_k, None,
                                                                  **kw),
           "mask grad": lambda: context_parallel_attention(
               x, x, x, rel_k, None, **kw, attn_mask=torch.zeros(1, 1, N_LOCAL, N_LOCAL * world,
                                                                  dtype=torch.float64, requires_grad=True))}
    errors = {what: _refusal(fn) for what, fn in bad.items()}
    write(out_dir, rank, {"cases": results, "timeline": [list(e) for e in events], "errors": errors,
                          "deterministic": deterministic, "walk": _walk(rank, world),
                          "modules": _module_cases(rank, world)})
