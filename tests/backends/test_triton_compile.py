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
    """One table: every served arch has a plain entry for every kernel, precision and head dim (so every lookup
    ends in one); forward tiles at least 64 x 64 in 16 bits (but sm_120's forward with dropout and lengths that end
    mid-tile, 32 x 64: every 64 x 64 entry spills there under Triton 3.6), backward at least 32 x 64 (either way
    round); band tiles at least 16 wide (tl.dot's minimum); the rel_bias entries (dkdv at D = 64 on the A100's,
    the forward at D = 64 on sm_90a) among them."""
    from relattn.backends import _triton_tiles as tiles
    from relattn.backends import triton as tb

    assert set(tiles.EVERY_ARCH) == {arch for arch, _ in tb.CUDA_ARCHS}
    for kernel in ("fwd", "dkdv", "dq"):
        for arch in tiles.EVERY_ARCH:
            for precision in (tiles.SIXTEEN, tiles.THIRTY_TWO):
                assert all((kernel, "plain", arch, precision, d) in tiles.TILES for d in (64, 128)), (kernel, arch)
    assert {variant for _, variant, *_ in tiles.TILES} <= set(tiles.VARIANTS)
    bias = {key[::2] for key in tiles.TILES if key[1] == "bias"}  # (kernel, arch, padded head dim)
    assert bias == {("dkdv", arch, 64) for arch in tiles.A100_LIKE} | {("fwd", 90, 64)}
    for (kernel, variant, arch, precision, d), (bm, bn, _, _, split) in tiles.TILES.items():
        key = (kernel, variant, arch, d)
        if kernel == "fwd" and precision == tiles.SIXTEEN and variant != "dropout_ragged":
            assert bm >= 64 and bn >= 64, key
        elif precision == tiles.SIXTEEN:
            assert min(bm, bn) >= 32 and bm * bn >= 32 * 64, key
        assert (bn if kernel != "dkdv" else bm) // split >= 16, key  # band tiles: tl.dot's minimum


def test_tile_lookup_takes_the_most_specific_variant():
    """The lookup's order: dropout, then a packed batch with rel_q, packed, ragged lengths, rel_bias (without
    rel_q), grouped k/v with rel_q, rel_q, plain; a variant the table has no entry for falls through to the next
    (values a wrong order gets wrong)."""
    from relattn.backends._triton_tiles import INTERPRETED, config, variants

    assert variants(rel_q=True, grouped=True, varlen=True, dropout=True) == [
        "dropout", "varlen_rq", "varlen", "gqa_rq", "rq", "plain"]
    assert config("fwd", True, 96, 100, window=True, ragged=True) == (64, 64, 8, 1, 2)
    assert config("fwd", True, 96, 100, window=True, ragged=True, dropout=True) == (64, 64, 8, 1, 4)
    assert config("fwd", True, 96, 90, window=True, ragged=True) == (64, 64, 8, 2, 4)  # sm_90a: no window entry
    assert config("fwd", True, 128, 120, dropout=True, ragged=True) == (32, 64, 8, 1, 4)  # both first
    assert config("fwd", True, 128, 120, dropout=True) == (64, 64, 8, 1, 4)  # dropout before ragged
    assert config("fwd", True, 128, 100, dropout=True, ragged=True) == (64, 64, 8, 2, 2)
    assert config("fwd", True, 128, 120, ragged=True) == (64, 64, 8, 1, 4)
    assert config("fwd", True, 128, 86, ragged=True) == (64, 64, 8, 2, 4)
    assert config("fwd", True, 128, 86) == (128, 64, 8, 2, 4)
    assert config("dkdv", True, 64, 80, rel_q=True, grouped=True) == (64, 32, 8, 1, 2)
    assert config("dkdv", True, 64, 80, rel_q=True) == (64, 32, 8, 2, 2)
    assert config("dkdv", True, 64, 90, rel_q=True) == (32, 64, 4, 2, 2)  # no H100 rel_q entry: plain
    assert config("dq", True, 64, 89, rel_q=True, varlen=True) == (64, 32, 8, 1, 2)
    assert config("dq", False, 96, 90, rel_q=True, dropout=True) == (32, 16, 4, 2, 1)  # float32: its own
    assert config("fwd", True, 64, 75) == config("fwd", True, 64, 80)  # an arch not served: sm_80's
    assert config("fwd", True, 64, None) == INTERPRETED
    assert variants(ragged=True, bias=True) == ["ragged", "bias", "plain"]
    assert config("dkdv", True, 64, 86, bias=True) == (64, 32, 8, 2, 2)  # the A100's plain entry is 32 x 64
    assert config("dkdv", True, 64, 120, bias=True, dropout=True, varlen=True) == (64, 32, 8, 2, 2)
    assert config("fwd", True, 64, 90, bias=True) == (128, 64, 8, 2, 2)  # sm_90a's plain: 3 stages
    assert config("fwd", True, 64, 80, bias=True) == (128, 64, 8, 2, 2)  # no A100 forward entry: plain
    assert config("fwd", True, 128, 120, bias=True, ragged=True) == (64, 64, 8, 1, 4)  # ragged first
    assert config("dkdv", False, 64, 80, bias=True) == (16, 16, 8, 1, 1)  # float32: plain


def test_stage_calls_pass_grouped_arguments():
    """The kernels' calls pass a handful of positional arguments (the tutorial's inner call passes 18), and every
    group of shared arguments (``Mat``, ``Terms``, ``Meta``, ...) is built by field name, so two strides cannot trade
    places silently."""
    import ast

    folder = os.path.join(ROOT, "src", "relattn", "backends")
    trees = [ast.parse(open(os.path.join(folder, f"_triton_{name}.py"), encoding="utf-8").read())
             for name in ("device", "forward", "kernels")]
    groups = {node.targets[0].id for node in trees[0].body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "namedtuple"}
    assert {"Mat", "Terms", "Sizes", "Meta"} <= groups, groups
    calls = [node for tree in trees for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
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
