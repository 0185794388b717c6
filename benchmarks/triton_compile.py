"""Compile the "triton" backend's kernels for real GPUs on a machine without one, and report registers, spills,
shared memory and tensor-core instructions.

Every launch of ``relattn.backends.triton`` is recorded as the launcher makes it on each GPU architecture the
backend serves (``triton.CUDA_ARCHS``: sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120): its forward and backward run
on meta tensors (no memory, no GPU) with the launcher's own tile table for that architecture, and each recorded
launch is compiled by ``triton.compile`` with the same arguments, constexprs, warps, stages and argument
specialisation (divisibility by 16) as Triton's JIT would give it on that GPU. ``ptxas -v`` (shipped inside the
triton wheel) then reports registers and spill bytes; shared memory comes from Triton, and the tensor-core
instructions from the compiled SASS (``cuobjdump -sass``, also in the wheel): HMMA (mma.sync), HGMMA (Hopper's
wgmma), UTCHMMA (Blackwell's tcgen05.mma).

    python benchmarks/triton_compile.py            # every user shape on every served arch (long: ~300 compiles)
    python benchmarks/triton_compile.py --ci       # the subset tests/backends/test_triton_compile.py runs
    python benchmarks/triton_compile.py --arch 90  # one architecture (gpu.sh: the GPU's own)

Under another Triton, run it with that Triton's python, relattn from src/:
``PYTHONPATH=src /path/to/venv/bin/python benchmarks/triton_compile.py``. Exit code 1 when a 16-bit launch spills,
fails to compile, needs more shared memory than its arch has or runs no tensor-core instruction, or a float32 one
spills more than 1 KB.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: set before relattn.backends.triton is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from relattn.backends import triton as tb  # noqa: E402

ARCHS = {80: "sm_80 (A100)", 86: "sm_86 (RTX 3090, A10)", 89: "sm_89 (RTX 4090, L4)", 90: "sm_90a (H100)",
         100: "sm_100a (B200)", 120: "sm_120 (RTX 5090)"}
assert set(ARCHS) == {arch for arch, _ in tb.CUDA_ARCHS}, "every served arch has a name here"
SMS = {80: 108, 86: 84, 89: 128, 90: 132, 100: 148, 120: 170}
# the most shared memory one block may use (bytes): A100 163 KB; consumer Ampere, Ada, RTX 50 99 KB; H100, B200 227 KB
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
FP32_SPILL_LIMIT = 1024
TENSOR_CORE = re.compile(r"\b(HMMA|HGMMA|UTC\w*MMA)\b")


@dataclass(frozen=True)
class Shape:
    """One user shape: what the forward and backward are called with."""

    name: str
    dtype: torch.dtype = torch.bfloat16
    d: int = 64
    causal: bool = False
    tables: str = "both"  # both, keys, per_head; deberta: keys and rel_q per head; all: the three tables, shared;
    # xl: keys per head; none: no table (T5's bias alone)
    mask: bool = False  # a key-padding mask (B, 1, 1, M)
    n: int = 2048
    m: int = 2048
    kk: int = 64
    backward: bool = True
    offset: int = 0
    kv_heads: int = 8  # fewer than the 8 query heads: grouped-query attention
    position_query: bool = False  # q_pos, the key table's own queries (Transformer-XL's biases)
    varlen: bool = False  # a packed batch (cu_seqlens): 3 sequences, the longest n queries and m keys
    dropout: bool = False  # attention dropout (dropout_p = 0.1: the DROPOUT constexpr)
    b: int = 2
    bias: bool = False  # rel_bias, T5's scalar bias per head and table row (folded into the key term's scores)


SHAPES = [
    Shape("bf16 D=64"),
    Shape("bf16 D=64 causal", causal=True),
    Shape("bf16 D=128", d=128),
    Shape("bf16 D=128 causal", d=128, causal=True),
    Shape("fp16 D=64 causal padding mask", dtype=torch.float16, causal=True, mask=True),
    Shape("fp16 D=128 padding mask", dtype=torch.float16, d=128, mask=True),
    Shape("bf16 D=64 keys table only", tables="keys"),
    Shape("bf16 D=64 per-head tables", tables="per_head"),
    Shape("bf16 D=64 decoding 1 x 4096", n=1, m=4096, causal=True, offset=4095, backward=False),
    Shape("bf16 D=128 decoding 1 x 4096", d=128, n=1, m=4096, causal=True, offset=4095, backward=False),
    Shape("bf16 D=64 DeBERTa: keys + rel_q per head, padding mask", tables="deberta", mask=True),
    Shape("bf16 D=128 keys + values + rel_q causal", d=128, causal=True, tables="all"),
    Shape("fp16 D=64 keys + values + rel_q", dtype=torch.float16, tables="all"),
    Shape("fp16 D=128 DeBERTa: keys + rel_q per head", dtype=torch.float16, d=128, tables="deberta"),
    Shape("bf16 D=64 decoding 1 x 4096 rel_q", n=1, m=4096, causal=True, offset=4095, backward=False, tables="all"),
    Shape("bf16 D=128 GQA 8 / 2 heads causal", d=128, causal=True, kv_heads=2),
    Shape("bf16 D=64 GQA 8 / 1 heads, DeBERTa tables", kv_heads=1, tables="deberta"),
    Shape("bf16 D=80", d=80),
    Shape("fp16 D=80 causal padding mask", dtype=torch.float16, d=80, causal=True, mask=True),
    Shape("bf16 D=96 padding mask", d=96, mask=True),
    Shape("fp16 D=96 causal", dtype=torch.float16, d=96, causal=True),
    Shape("bf16 D=96 DeBERTa: keys + rel_q per head, padding mask", d=96, tables="deberta", mask=True),
    Shape("bf16 D=96 padding mask, B = 1, N = 1500 (Parakeet-like)", d=96, mask=True, b=1, n=1500, m=1500),
    Shape("fp32 D=64", dtype=torch.float32),
    Shape("fp32 D=128 causal", dtype=torch.float32, d=128, causal=True),
    Shape("fp32 D=64 DeBERTa: keys + rel_q per head", dtype=torch.float32, tables="deberta"),
    Shape("bf16 D=128 Transformer-XL: keys table per head + q_pos, K = N - 1, padding mask", d=128,
          tables="xl", kk=2047, mask=True, position_query=True),
    Shape("fp16 D=64 Transformer-XL causal: keys table + q_pos, K = N - 1", dtype=torch.float16, causal=True,
          tables="keys", kk=2047, position_query=True),
    Shape("fp32 D=128 Transformer-XL causal: keys table per head + q_pos", dtype=torch.float32, d=128, causal=True,
          tables="xl", kk=2047, position_query=True),
    Shape("bf16 D=96 Transformer-XL window: keys table per head + q_pos, K = N - 1, padding mask, B = 1, N = 1500",
          d=96, tables="xl", kk=1499, mask=True, position_query=True, b=1, n=1500, m=1500),
    Shape("packed bf16 D=64", varlen=True),
    Shape("packed bf16 D=128 causal", d=128, causal=True, varlen=True),
    Shape("packed fp16 D=64 keys + values + rel_q", dtype=torch.float16, tables="all", varlen=True),
    Shape("packed bf16 D=64 DeBERTa: keys + rel_q per head", tables="deberta", varlen=True),
    Shape("packed bf16 D=128 GQA 8 / 2 heads causal", d=128, causal=True, kv_heads=2, varlen=True),
    Shape("packed bf16 D=64 GQA 8 / 1 heads, DeBERTa tables", kv_heads=1, tables="deberta", varlen=True),
    Shape("packed bf16 D=64 decoding 1 x 4096", n=1, m=4096, causal=True, backward=False, varlen=True),
    Shape("packed bf16 D=128 Transformer-XL: keys table per head + q_pos, K = N - 1", d=128, tables="xl", kk=2047,
          position_query=True, varlen=True),
    Shape("packed fp32 D=64 DeBERTa: keys + rel_q per head", dtype=torch.float32, tables="deberta", varlen=True),
    Shape("dropout bf16 D=64", dropout=True),
    Shape("dropout bf16 D=128 causal", d=128, causal=True, dropout=True),
    Shape("dropout fp16 D=64 causal padding mask", dtype=torch.float16, causal=True, mask=True, dropout=True),
    Shape("dropout bf16 D=64 DeBERTa: keys + rel_q per head, padding mask", tables="deberta", mask=True,
          dropout=True),
    Shape("dropout bf16 D=96 padding mask, B = 1, N = 1500", d=96, mask=True, b=1, n=1500, m=1500, dropout=True),
    Shape("dropout bf16 D=128 GQA 8 / 2 heads causal", d=128, causal=True, kv_heads=2, dropout=True),
    Shape("dropout bf16 D=128 Transformer-XL: keys table per head + q_pos, K = N - 1, padding mask", d=128,
          tables="xl", kk=2047, mask=True, position_query=True, dropout=True),
    Shape("dropout bf16 D=96 Transformer-XL window: keys table per head + q_pos, K = N - 1, padding mask, B = 1, "
          "N = 1500", d=96, tables="xl", kk=1499, mask=True, position_query=True, b=1, n=1500, m=1500, dropout=True),
    Shape("dropout fp32 D=64 DeBERTa: keys + rel_q per head", dtype=torch.float32, tables="deberta", dropout=True),
    Shape("dropout packed bf16 D=64 DeBERTa: keys + rel_q per head", tables="deberta", varlen=True, dropout=True),
    Shape("dropout packed bf16 D=128 GQA 8 / 2 heads causal", d=128, causal=True, kv_heads=2, varlen=True,
          dropout=True),
    Shape("T5 bf16 D=64: bias per head, no tables, K = 128", tables="none", bias=True, kk=128),
    Shape("T5 bf16 D=64 causal: bias per head, no tables, K = 128", tables="none", bias=True, kk=128, causal=True),
    Shape("MPNet fp16 D=64: bias per head, no tables, padding mask, K = 128", dtype=torch.float16, tables="none",
          bias=True, kk=128, mask=True),
    Shape("bf16 D=128 bias + keys + values tables causal", d=128, causal=True, bias=True),
    Shape("bf16 D=64 T5 decoding 1 x 4096: bias, no tables", n=1, m=4096, causal=True, offset=4095, backward=False,
          tables="none", bias=True, kk=128),
    Shape("packed bf16 D=64 T5: bias per head, no tables, K = 128", tables="none", bias=True, kk=128, varlen=True),
    Shape("dropout bf16 D=64 T5: bias per head, no tables, K = 128", tables="none", bias=True, kk=128, dropout=True),
    Shape("fp32 D=64 T5: bias per head, no tables, K = 128", dtype=torch.float32, tables="none", bias=True, kk=128),
]
# the CI subset: one or two shapes per arch, every kernel, so that each arch and each kind of launch is compiled
CI_PAIRS = [("bf16 D=64", 80), ("fp16 D=128 padding mask", 90), ("bf16 D=96 padding mask", 86),
            ("bf16 D=64 decoding 1 x 4096", 89), ("bf16 D=64 DeBERTa: keys + rel_q per head, padding mask", 100),
            ("bf16 D=128 GQA 8 / 2 heads causal", 120),
            ("bf16 D=128 Transformer-XL: keys table per head + q_pos, K = N - 1, padding mask", 90),
            ("packed bf16 D=64 DeBERTa: keys + rel_q per head", 80), ("packed bf16 D=128 GQA 8 / 2 heads causal", 90),
            ("bf16 D=96 padding mask, B = 1, N = 1500 (Parakeet-like)", 120),
            ("dropout bf16 D=64 DeBERTa: keys + rel_q per head, padding mask", 80),
            ("dropout packed bf16 D=64 DeBERTa: keys + rel_q per head", 90),
            ("bf16 D=96 Transformer-XL window: keys table per head + q_pos, K = N - 1, padding mask, B = 1, N = 1500",
             120)]


def record(shape: Shape, arch: int) -> list[tuple]:
    """The launches (kernel, kwargs) the launcher makes for ``shape`` on a GPU of compute capability ``arch``."""
    launches = []
    saved = tb._launch, tb._arch, tb._sm_count
    tb._launch = lambda kernel, grid, **kw: launches.append((kernel, kw))
    tb._arch = lambda device: arch
    tb._sm_count = lambda device: SMS[arch]
    try:
        b, h, heads = shape.b, 8, shape.kv_heads
        meta = dict(device="meta", dtype=shape.dtype)
        if shape.varlen:  # (1, H, T, D) views of the packed (T, H, D), as the op passes them
            t, tk = shape.n + shape.n // 2 + 1, shape.m + shape.m // 2 + 1
            q = torch.empty(t, h, shape.d, **meta).transpose(0, 1)[None]
            k, v = (torch.empty(tk, heads, shape.d, **meta).transpose(0, 1)[None] for _ in range(2))
            cu = torch.empty(4, device="meta", dtype=torch.int32)
            packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=shape.n, max_seqlen_k=shape.m)
        else:
            q = torch.empty(b, h, shape.n, shape.d, **meta)
            k, v = torch.empty(b, heads, shape.m, shape.d, **meta), torch.empty(b, heads, shape.m, shape.d, **meta)
        rows = 2 * shape.kk + 1
        hr = h if shape.tables in ("per_head", "deberta", "xl") else 1
        rk = None if shape.tables == "none" else torch.empty(hr, rows, shape.d, **meta)
        rv = None if shape.tables in ("keys", "deberta", "xl", "none") else torch.empty(hr, rows, shape.d, **meta)
        rq = torch.empty(hr, rows, shape.d, **meta) if shape.tables in ("deberta", "all") else None
        mask = torch.empty(b, 1, 1, shape.m, **meta) if shape.mask else None
        kw = dict(max_relative_position=shape.kk, is_causal=shape.causal, scale=shape.d ** -0.5,
                  query_offset=shape.offset, rel_q=rq)
        if shape.position_query:
            kw["q_pos"] = torch.empty_like(q)
        if shape.bias:
            kw["rel_bias"] = torch.empty(h, rows, **meta)
        seed = torch.zeros((), dtype=torch.int64, device="meta") if shape.dropout else None
        kw["dropout_p"] = 0.1 if shape.dropout else 0.0
        if shape.varlen:
            cu_q, cu_k = packed.pop("cu_seqlens_q"), packed.pop("cu_seqlens_k")
            out, lse = tb.varlen_forward(q, k, v, rk, rv, None, seed, cu_q, cu_k, **kw, **packed)
            if shape.backward:
                tb.varlen_backward(torch.empty_like(out), q, k, v, rk, rv, None, seed, cu_q, cu_k, out, lse, **kw,
                                   **packed)
        else:
            out, lse = tb.forward(q, k, v, rk, rv, mask, seed, **kw)
            if shape.backward:
                tb.backward(torch.empty_like(out), q, k, v, rk, rv, mask, seed, out, lse, **kw)
    finally:
        tb._launch, tb._arch, tb._sm_count = saved
    return launches


def _ptxas() -> str:
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.path.exists(os.path.join(here, name)):
            return os.path.join(here, name)
    raise FileNotFoundError(f"no ptxas in {here}")


def compile_launch(kernel, kwargs: dict, arch: int) -> dict:
    """Registers, spill bytes, shared memory and tensor-core instructions of one launch compiled for ``arch``,
    specialised as the JIT would."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        log = subprocess.run([_ptxas(), f"-arch={sm}", "-v", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill=int(spills.group(1)) + int(spills.group(2)) if spills else 0,
                smem=compiled.metadata.shared, mma="+".join(sorted(set(TENSOR_CORE.findall(compiled.asm["sass"])))))


def _key(kernel, kwargs) -> tuple:
    """What makes two launches compile to the same code: the kernel, the argument types and specialisation, the
    constexprs' and launch options' values."""
    exact = {p.name for p in kernel.params if p.is_constexpr} | {"num_warps", "num_stages"}
    plain = {p.name for p in kernel.params if p.do_not_specialize}  # ints the JIT does not specialise

    def kind(name, x):
        if isinstance(x, torch.Tensor):
            return str(x.dtype)
        if isinstance(x, int) and not isinstance(x, bool):
            return "i" if name in plain else "1" if x == 1 else ("16" if x % 16 == 0 else "i")
        return repr(x)

    return (kernel.__name__, tuple(sorted((k, repr(v) if k in exact else kind(k, v)) for k, v in kwargs.items())))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="only the (shape, arch) pairs of CI_PAIRS")
    ap.add_argument("--shape", action="append", choices=[s.name for s in SHAPES], metavar="NAME",
                    help="only this shape (repeatable; default every shape)")
    ap.add_argument("--sixteen", action="store_true", help="only the 16-bit shapes")
    ap.add_argument("--arch", type=int, choices=sorted(ARCHS), action="append",
                    help="a compute capability: " + ", ".join(map(str, sorted(ARCHS))) + " (default all)")
    args = ap.parse_args(argv)
    archs = args.arch or sorted(ARCHS)
    wanted = {(name, arch) for name, arch in CI_PAIRS} if args.ci else None
    shapes = [s for s in SHAPES if (wanted is None or any(name == s.name for name, _ in wanted))
              and (args.shape is None or s.name in args.shape) and not (args.sixteen and s.dtype == torch.float32)]
    print(f"triton {triton.__version__}, torch {torch.__version__}; B = 2, H = 8, N = M = 2048, K = 64 unless said, "
          "keys and values tables shared unless said (rel_q: the position-to-content table); "
          "registers / spill bytes (stores + loads) / shared memory KB / tensor-core instructions")
    cols = " | ".join(f"{ARCHS[a]}" for a in archs)
    print(f"| shape | kernel | tiles, warps, stages | {cols} |")
    print("|---|---|---|" + "---|" * len(archs))
    done: dict = {}
    bad = []
    start = time.time()
    for shape in shapes:
        rows: dict = {}
        shape_archs = [a for a in archs if wanted is None or (shape.name, a) in wanted]
        for arch in shape_archs:
            for kernel, kw in record(shape, arch):
                key = (arch, _key(kernel, kw))
                if key not in done:
                    try:
                        done[key] = compile_launch(kernel, kw, arch)
                    except Exception as exc:  # a failed compile is a result too
                        done[key] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                name = kernel.__name__.strip("_").replace("_kernel", "")
                tiles = f"{kw.get('BLOCK_M', kw.get('BLOCK_N'))}×{kw.get('BLOCK_N', kw.get('BLOCK_R'))}" \
                    f", {kw['num_warps']}, {kw['num_stages']}"
                rows.setdefault(name, {})[arch] = (tiles, done[key])
        for name, per_arch in rows.items():
            cells = []
            for arch in archs:
                if arch not in per_arch:
                    cells.append("")
                    continue
                tiles, r = per_arch[arch]
                if "error" in r:
                    cells.append(f"{tiles}: FAILED {r['error']}")
                    bad.append(f"{shape.name} {name} {ARCHS[arch]}: {r['error']}")
                    continue
                sixteen = shape.dtype != torch.float32
                spill = f"**{r['spill']}**" if r["spill"] else "0"
                smem = f"{r['smem'] / 1024:.0f}" if r["smem"] <= SMEM_LIMIT[arch] else f"**{r['smem'] / 1024:.0f}**"
                mma = r["mma"] or ("**none**" if sixteen else "none")
                cells.append(f"{tiles}: {r['regs']} / {spill} / {smem} / {mma}")
                limit = 0 if sixteen else FP32_SPILL_LIMIT
                if r["spill"] > limit:
                    bad.append(f"{shape.name} {name} {ARCHS[arch]}: {r['spill']} spill bytes (at most {limit})")
                if r["smem"] > SMEM_LIMIT[arch]:
                    bad.append(f"{shape.name} {name} {ARCHS[arch]}: {r['smem']} bytes of shared memory (at most "
                               f"{SMEM_LIMIT[arch]})")
                if sixteen and not r["mma"]:
                    bad.append(f"{shape.name} {name} {ARCHS[arch]}: no tensor-core instruction")
            print(f"| {shape.name} | {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"{len(done)} compiles in {time.time() - start:.0f} s")
    for line in bad:
        print("FAIL:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
