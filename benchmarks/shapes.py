"""Shaw attention on user shapes, side by side with SDPA without positions: one run, interleaved medians, ratios.

Cases (float32 unless said; "auto" backend; both tables, shared by all heads; D = 64):

- ``train``: B=32, H=8, N=128, K=16, causal, forward+backward (training-like: small N, big batch).
- ``encoder``: B=4, H=12, N=512, K=32, not causal, forward+backward.
- ``bf16``, ``fp16``: B=1, H=8, N=2048, K=64, bfloat16 / float16 q, k, v and tables, forward+backward.
- ``autocast``: the module under ``torch.autocast("cpu", bfloat16)``: ``RelativeMultiheadAttention.from_mha(mha,
  64)`` against ``mha = nn.MultiheadAttention(512, 8, batch_first=True)`` (SDPA inside), x (1, 2048, 512),
  forward+backward (gradients of x and the parameters).
- ``short_{N}_k{K}`` and ``short_{N}_k{K}_fwd``: B=1, H=8, N = 128, 256, 512, K = 16, 64, not causal,
  forward+backward and forward under ``no_grad`` (the lengths of ``relattn bench --quick``).
- ``decode_512``, ``decode_4096``: one query (B=1, H=8) against 512 / 4096 cached keys, K=64, forward under
  ``no_grad`` (each timed sample is ``--decode-calls`` calls).
- ``ragged``: 8 sequences of lengths spread evenly over 128..1024 (``torch.linspace``), H=8, K=64, both tables,
  forward+backward: packed (``relative_attention_varlen``, no padding stored or computed) against the padded call
  (B=8, N=1024, a key padding mask; reported as ``padded``, and ``speedup`` = padded / packed time), SDPA on the
  padded batch with the same mask as the baseline.
- ``generate``: ``TransformerLM.generate`` (default config, greedy, 64-byte prompt, 256 new bytes) against the
  same model with ``positions="none"`` whose attention calls SDPA; reported also as tokens/s, and ``none``:
  positions="none" through relattn's op (what the op costs without tables: its per-call overhead).

At M=512 and K=64 the decode cases' tables add 2K+1 = 129 rows to the 512 keys: 25% more arithmetic than SDPA; so
do the tables of ``short_512_k64`` (R / M = 129 / 512, forward and backward alike), and R / M = 1 at N = 128, K = 64.

``ratio`` is relattn's median time over SDPA's, both measured in the same run, interleaved (lower is better; the
issue's target is <= 1.1, and generation at >= 0.9x SDPA's tokens/s, i.e. a time ratio <= 1.11).

    PYTHONPATH=src python benchmarks/shapes.py                       # the real sizes, 2 threads
    PYTHONPATH=src python benchmarks/shapes.py --quick --out /tmp/s.json   # tiny sizes, seconds (for tests)
    PYTHONPATH=src python benchmarks/shapes.py --only ragged              # packed against padded
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from relattn import RelativeMultiheadAttention, relative_attention, relative_attention_varlen
from relattn._io import atomic_write_text
from relattn.backends import cpu, native
from relattn.bench.measure import time_interleaved
from relattn.padding import split_heads
from relattn.positions import causal_allowed
from relattn.schemes import Shaw
from relattn.training.model import TransformerConfig, TransformerLM

RESULTS = Path(__file__).resolve().parent / "results"  # where results go unless --out says otherwise

# name -> sizes; "quick" keeps every case's structure at sizes a test runs in seconds
SIZES = {
    "full": dict(train=(32, 8, 128, 64, 16), encoder=(4, 12, 512, 64, 32), bf16=(1, 8, 2048, 64, 64),
                 autocast=(1, 2048, 512, 8, 64), short=(1, 8, 64), short_lengths=(128, 256, 512), short_ks=(16, 64),
                 decode=(1, 8, 64, 64), decode_lengths=(512, 4096), ragged=(8, 8, 64, 64, 128, 1024),
                 generate=dict(config={}, prompt=64, new=256)),
    "quick": dict(train=(2, 2, 16, 8, 4), encoder=(1, 3, 24, 8, 4), bf16=(1, 2, 32, 8, 4),
                  autocast=(1, 32, 16, 2, 4), short=(1, 2, 8), short_lengths=(8, 12), short_ks=(2, 4),
                  decode=(1, 2, 8, 4), decode_lengths=(16, 48), ragged=(3, 2, 8, 4, 4, 12),
                  generate=dict(config=dict(d_model=16, n_heads=2, n_layers=2, d_ff=32, max_relative_position=4),
                                prompt=4, new=6)),
}


def _randn(*shape, dtype=torch.float32, g, grad=True):
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


def op_case(b, h, n, d, kk, *, causal, dtype=torch.float32, forward_only=False):
    """Forward+backward (or, ``forward_only``, the forward under ``no_grad``) of the op and of SDPA on the same
    q, k, v."""
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (_randn(b, h, n, d, dtype=dtype, g=g) for _ in range(4))
    rk, rv = (_randn(2 * kk + 1, d, dtype=dtype, g=g) for _ in range(2))

    def relattn_out():
        return relative_attention(q, k, v, rk, rv, max_relative_position=kk, is_causal=causal)

    def sdpa_out():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def relattn():
        return torch.autograd.grad(relattn_out(), (q, k, v, rk, rv), go)

    def sdpa():
        return torch.autograd.grad(sdpa_out(), (q, k, v), go)

    shape = f"B={b} H={h} N={n} D={d} K={kk} {dtype} {'causal' if causal else 'full'}"
    if forward_only:
        return torch.no_grad()(relattn_out), torch.no_grad()(sdpa_out), f"{shape} forward"
    return relattn, sdpa, f"{shape} fwd+bwd"


def autocast_case(b, n, e, h, kk):
    """The module under CPU autocast (bfloat16) against the nn.MultiheadAttention it was built from."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(e, h, batch_first=True)
    rel = RelativeMultiheadAttention.from_mha(mha, kk)
    g = torch.Generator().manual_seed(1)
    x = _randn(b, n, e, g=g)
    go = torch.randn(b, n, e, generator=g)

    def run(module, call):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = call()
        return torch.autograd.grad(out.float(), (x, *module.parameters()), go)

    return (lambda: run(rel, lambda: rel(x)[0]), lambda: run(mha, lambda: mha(x, x, x, need_weights=False)[0]),
            f"module, x ({b}, {n}, {e}), H={h} K={kk}, autocast bf16, fwd+bwd")


def decode_case(b, h, d, kk, m, calls):
    """One query at position M-1 against M cached keys, ``calls`` calls per timed sample."""
    g = torch.Generator().manual_seed(0)
    q = _randn(b, h, 1, d, g=g, grad=False)
    k, v = (_randn(b, h, m, d, g=g, grad=False) for _ in range(2))
    rk, rv = (_randn(2 * kk + 1, d, g=g, grad=False) for _ in range(2))

    @torch.no_grad()
    def relattn():
        for _ in range(calls):
            relative_attention(q, k, v, rk, rv, max_relative_position=kk, query_offset=m - 1)

    @torch.no_grad()
    def sdpa():
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v)

    return relattn, sdpa, f"B={b} H={h} 1 query vs M={m} keys, D={d} K={kk}, forward, x{calls} calls"


def ragged_case(sequences, h, d, kk, shortest, longest, *, varlen=relative_attention_varlen):
    """Forward+backward of ``sequences`` sequences of lengths ``torch.linspace(shortest, longest)``, packed through
    ``varlen`` (called as :func:`relative_attention_varlen`) against the padded call with a key padding mask (B =
    sequences, N = longest; an extra baseline, ``padded``) and SDPA on the padded batch with the same mask."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(shortest, longest, sequences).round().long()
    total, b, n = int(lengths.sum()), sequences, int(lengths.max())
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    q, k, v, go = (_randn(total, h, d, g=g) for _ in range(4))
    rk, rv = (_randn(2 * kk + 1, d, g=g) for _ in range(2))
    keep = torch.arange(n)[None, :] < lengths[:, None]  # (B, N): True on real tokens

    def padded_tensor(t):
        out = t.new_zeros(b, n, h, d)
        out[keep] = t.detach()
        return out.transpose(1, 2).contiguous().requires_grad_()

    pq, pk, pv, pgo = (padded_tensor(t) for t in (q, k, v, go))
    mask = keep[:, None, None, :]

    def packed():
        out = varlen(q, k, v, rk, rv, cu_seqlens_q=cu, max_seqlen_q=n, max_relative_position=kk)
        return torch.autograd.grad(out, (q, k, v, rk, rv), go)

    def padded():
        out = relative_attention(pq, pk, pv, rk, rv, max_relative_position=kk, attn_mask=mask)
        return torch.autograd.grad(out, (pq, pk, pv, rk, rv), pgo)

    def sdpa():
        out = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask)
        return torch.autograd.grad(out, (pq, pk, pv), pgo)

    shape = (f"{sequences} sequences of {shortest}..{longest} (T={total}; padded B={b} N={n}), H={h} D={d} K={kk}, "
             f"packed vs padded with a key padding mask, fwd+bwd")
    return packed, sdpa, shape, {"padded": padded}


class SDPAAttention(RelativeMultiheadAttention):
    """The module without positions, SDPA inside: the generate case's baseline (self-attention, KV cache)."""

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, kv_cache=None, context_parallel=None):
        if context_parallel is not None:
            raise ValueError("SDPAAttention (the benchmark's baseline) runs in one process: context_parallel=None")
        q, k, v = (split_heads(p(query), heads=self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        offset = 0
        if kv_cache is not None:
            offset = len(kv_cache)
            k, v = kv_cache.update(k, v)
        n, m = q.shape[2], k.shape[2]
        mask = causal_allowed(n, m, offset, q.device) if is_causal and offset > 0 and n > 1 else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and offset == 0)
        return self.out_proj(out.transpose(1, 2).flatten(2)), None


def generate_case(config: dict, prompt: int, new: int):
    """``TransformerLM.generate`` with relative positions against positions="none" with SDPA attention; also
    positions="none" through relattn's own op (``none``: the op's cost without tables)."""
    torch.manual_seed(0)
    rel = TransformerLM(TransformerConfig(**config)).eval()
    cfg = TransformerConfig(**{**config, "positions": "none"})
    torch.manual_seed(0)
    none = TransformerLM(cfg).eval()
    torch.manual_seed(0)
    base = TransformerLM(cfg).eval()
    for block in base.encoder.blocks:
        block.attn = SDPAAttention(cfg.d_model, cfg.n_heads, Shaw(keys=False, values=False))
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    return (lambda: rel.generate(ids, new, temperature=0), lambda: base.generate(ids, new, temperature=0),
            f"TransformerLM d_model={cfg.d_model} heads={cfg.n_heads} layers={cfg.n_layers} "
            f"K={cfg.max_relative_position}, prompt {prompt}, {new} new tokens, greedy",
            {"none": lambda: none.generate(ids, new, temperature=0)})


def cases(size: str, decode_calls: int) -> dict:
    s = SIZES[size]
    out = {
        "train": op_case(*s["train"], causal=True),
        "encoder": op_case(*s["encoder"], causal=False),
        "bf16": op_case(*s["bf16"], causal=False, dtype=torch.bfloat16),
        "fp16": op_case(*s["bf16"], causal=False, dtype=torch.float16),
        "autocast": autocast_case(*s["autocast"]),
    }
    b, h, d = s["short"]
    for n in s["short_lengths"]:
        for kk in s["short_ks"]:
            out[f"short_{n}_k{kk}"] = op_case(b, h, n, d, kk, causal=False)
            out[f"short_{n}_k{kk}_fwd"] = op_case(b, h, n, d, kk, causal=False, forward_only=True)
    for m in s["decode_lengths"]:
        out[f"decode_{m}"] = decode_case(*s["decode"], m, decode_calls)
    out["ragged"] = ragged_case(*s["ragged"])
    out["generate"] = generate_case(**s["generate"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for tests: same cases, same JSON")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="timed rounds per case (median reported)")
    p.add_argument("--decode-calls", type=int, default=100, help="calls per timed decode sample")
    p.add_argument("--only", nargs="+", help="run only these cases")
    p.add_argument("--out", default=RESULTS / "shapes.json", help="JSON file to write (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = "quick" if args.quick else "full"
    all_cases = cases(size, 2 if args.quick else args.decode_calls)
    unknown = sorted(set(args.only or ()) - set(all_cases))
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {sorted(all_cases)}")
    print(f"CPU {cpu.features().describe()}\nnative kernel: {native.choice().describe()}")
    print(f"torch {torch.__version__}, {args.threads} threads, CPU {torch.backends.cpu.get_cpu_capability()}; "
          f"median of {args.reps} interleaved rounds; ratio = relattn / SDPA (lower is better)")
    print(f"{'case':<12} {'relattn ms':>11} {'sdpa ms':>9} {'ratio':>6}  shape")
    results = {}
    for name, (relattn, sdpa, shape, *more) in all_cases.items():
        if args.only and name not in args.only:
            continue
        extras = more[0] if more else {}
        times = time_interleaved({"relattn": relattn, "sdpa": sdpa, **extras}, args.reps)  # ms per call
        a, b = statistics.median(times["relattn"]), statistics.median(times["sdpa"])
        row = {"shape": shape, "relattn_ms": a, "sdpa_ms": b, "ratio": a / b,
               "relattn_all_ms": times["relattn"], "sdpa_all_ms": times["sdpa"]}
        extra = ""
        for other in extras:  # more baselines of the same case, e.g. generate's positions="none" through relattn
            row[f"{other}_ms"] = statistics.median(times[other])
            row[f"{other}_all_ms"] = times[other]
            row[f"{other}_ratio"] = row[f"{other}_ms"] / b
            extra += f"  ({other}: {row[f'{other}_ratio']:.2f})"
        if name == "ragged":
            row["speedup"] = row["padded_ms"] / a
            extra += f"  (packed {row['speedup']:.2f}x faster than padded)"
        if name == "generate":
            new = SIZES[size]["generate"]["new"]
            row["relattn_tokens_per_s"], row["sdpa_tokens_per_s"] = new / (a / 1e3), new / (b / 1e3)
            row["tokens_per_s_ratio"] = b / a
            extra += f"  ({row['relattn_tokens_per_s']:.0f} vs {row['sdpa_tokens_per_s']:.0f} tokens/s)"
        results[name] = row
        print(f"{name:<12} {a:11.3f} {b:9.3f} {a / b:6.2f}  {shape}{extra}", flush=True)
    worst = max(results.values(), key=lambda r: r["ratio"]) if results else None
    report = {
        "meta": {"torch": torch.__version__, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_features": cpu.features().describe(),
                 "native_choice": native.choice().describe(), "size": size, "reps": args.reps,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(sys.argv)},
        "cases": results,
        "worst_ratio": None if worst is None else worst["ratio"],
    }
    assert all(math.isfinite(r["ratio"]) for r in results.values())
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
