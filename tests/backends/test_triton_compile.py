"""The "triton" backend compiled for real GPUs without one: ``benchmarks/triton_compile.py --ci`` records the
launcher's launches for each served arch (sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120) on meta tensors, compiles
each as Triton's JIT would and reads ``ptxas -v`` and the SASS. Fails on any spill, failed compile, shared memory
past the arch's limit or missing tensor-core instruction of a 16-bit launch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_gpu_tiles_are_at_least_the_floor():
    """Forward tiles at least 64 x 64, backward at least 32 x 64 (either way round), for every arch and head dim,
    with and without rel_q, with rel_bias."""
    from relattn.backends import triton as tb

    assert {a for _, a, _ in tb.CONFIGS} == {80, 90} and {d for *_, d in tb.CONFIGS} == {64, 128}
    assert set(tb.TABLE_OF_ARCH) == {arch for arch, _ in tb.CUDA_ARCHS}  # every served arch has its table
    assert set(tb.TABLE_OF_ARCH.values()) <= {80, 90}
    assert set(tb.RQ_CONFIGS) <= set(tb.CONFIGS) and set(tb.GQA_RQ_CONFIGS) <= set(tb.CONFIGS)
    assert set(tb.BIAS_CONFIGS) <= set(tb.CONFIGS)
    assert {(kernel, d) for kernel, _, d in tb.ARCH_CONFIGS} <= {(kernel, d) for kernel, _, d in tb.CONFIGS}
    assert {arch for _, arch, _ in tb.ARCH_CONFIGS} <= set(tb.TABLE_OF_ARCH)
    assert {arch for _, arch, _ in (*tb.VARLEN_CONFIGS, *tb.VARLEN_RQ_CONFIGS, *tb.RAGGED_CONFIGS,
                                    *tb.DROPOUT_CONFIGS)} <= set(tb.TABLE_OF_ARCH)
    entries = [*tb.CONFIGS.items(), *tb.RQ_CONFIGS.items(), *tb.GQA_RQ_CONFIGS.items(), *tb.ARCH_CONFIGS.items(),
               *tb.VARLEN_CONFIGS.items(), *tb.VARLEN_RQ_CONFIGS.items(), *tb.RAGGED_CONFIGS.items(),
               *tb.DROPOUT_CONFIGS.items(), *tb.BIAS_CONFIGS.items()]
    for (kernel, arch, d), (bm, bn, _, _, split) in entries:
        if kernel == "fwd":
            assert bm >= 64 and bn >= 64, (kernel, arch, d)
        else:
            assert min(bm, bn) >= 32 and bm * bn >= 32 * 64, (kernel, arch, d)
        assert (bn if kernel != "dkdv" else bm) // split >= 16, (kernel, arch, d)  # band tiles: tl.dot's minimum


def test_stage_calls_pass_grouped_arguments():
    """The kernels' calls pass a handful of positional arguments (the tutorial's inner call passes 18), and every
    group of shared arguments (``Mat``, ``Terms``, ``Meta``, ...) is built by field name, so two strides cannot trade
    places silently."""
    import ast

    path = os.path.join(ROOT, "src", "relattn", "backends", "_triton_kernels.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    groups = {node.targets[0].id for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "namedtuple"}
    assert {"Mat", "Terms", "Sizes", "Meta"} <= groups, groups
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    stages = [c for c in calls if c.func.id in ("_fwd_inner", "_dkdv_inner", "_dq_inner")]
    assert len(stages) == 9
    for call in calls:
        assert len(call.args) <= 20, (call.func.id, call.lineno, len(call.args))
        if call.func.id in groups:
            assert not call.args and call.keywords, (call.func.id, call.lineno)


@pytest.mark.slow
def test_kernels_compile_for_every_served_arch_without_spills_on_tensor_cores():
    """The CI pairs (one shape per served arch, every kernel of it): no spill, shared memory within the arch's
    limit, a tensor-core instruction in every 16-bit kernel (HMMA, HGMMA on sm_90a, UTCHMMA on sm_100a)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join("benchmarks", "triton_compile.py"), "--ci"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| bf16 ")
            or line.startswith("| fp16 ")]
    kernels = {row[1].strip() for row in rows}
    assert kernels == {"table_scores", "fwd", "dkdv", "dq"}, kernels
    archs = set()
    for row in rows:  # "tiles: registers / spill bytes / shared KB / tensor-core instructions" per arch
        for arch, cell in enumerate(row[2:]):
            if not cell.strip():
                continue
            archs.add(arch)
            regs, spill, smem, mma = cell.split(": ")[1].split(" / ")
            assert int(spill) == 0 and 0 < int(regs) <= 255 and int(smem) <= 227, row
            assert mma.strip() and "none" not in mma, row
    assert len(archs) == 6  # every served arch


def test_gpu_script_parses():
    """benchmarks/gpu.sh (run only on a CUDA machine) is valid bash, and each Python program it embeds compiles."""
    path = os.path.join(ROOT, "benchmarks", "gpu.sh")
    done = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = open(path, encoding="utf-8").read()
    programs = [part.split("\nEOF\n")[0] for part in text.split("<<'EOF'\n")[1:]]
    assert len(programs) == 2  # the peers and decoding
    for program in programs:
        compile(program, "gpu.sh", "exec")
        assert "TFLOP/s" in program
