"""``relattn check``: on this CPU machine it runs every backend that can run here against the float64 formula and
exits 0; a backend that is wrong on purpose (handed to the check function, no registry or module patched) makes it
exit 1 and names it."""

from __future__ import annotations

import re

import pytest
import torch

from relattn import cli
from relattn.backends import BACKENDS, Backend, Serves, cpu, native
from relattn.bench.check import CASES, check_case, formula, run_check


@pytest.mark.slow
def test_check_on_the_cpu_prints_the_machine_autos_choices_and_exits_0(capsys):
    assert cli.main(["check", "--time-n", "64"]) == 0
    out = capsys.readouterr().out
    assert "device    cpu" in out and f"torch {torch.__version__}" in out
    assert cpu.features().describe() in out  # the CPU: model, instruction sets, caches
    assert f"native    {native.choice().describe()}; in force: {native.SETTINGS.current}" in out
    chosen = "native" if BACKENDS["native"].unavailable() is None else "blocked"  # auto's choice with dropout
    assert re.search(rf"the same with attention dropout 0\.1\s+{chosen}\b", out)
    for name in BACKENDS:
        assert f"  {name:<8} float32" in out
    assert " ok " in out and "WRONG" not in out and "sdpa (no positions)" in out
    assert out.rstrip().splitlines()[-1].startswith("result: ok")


def _scaled(call):
    return BACKENDS["dense"].run(call) * 1.001  # a 0.1% error: far outside the float32 tolerance


def _raises(call):
    raise RuntimeError("kernel exploded")


def test_check_exits_1_and_names_a_wrong_backend():
    lines = []
    backends = {"dense": BACKENDS["dense"],
                "off": Backend("off", _scaled, Serves(pos_to_content=True), "wrong on purpose"),
                "boom": Backend("boom", _raises, Serves(devices=frozenset({"cpu"})), "fails on purpose")}
    assert run_check(backends=backends, time_n=0, emit=lines.append) == 1
    text = "\n".join(lines)
    assert "  dense    float32" in text and "  off      float32   plain: shared tables" in text
    assert "WRONG" in text and "FAILED: RuntimeError: kernel exploded" in text
    assert "skipped: a position-to-content table rel_q" in text  # "boom" declares no rel_q: that case is skipped
    assert lines[-1].startswith("result: 5 WRONG of 8 checks") and "off float32" in lines[-1]


@pytest.mark.parametrize("case", CASES, ids=[c.name.split(":")[0] for c in CASES])
def test_the_oracle_is_the_specification_and_sees_a_small_error(case):
    """The formula agrees with relattn.reference on every case (check_case raises otherwise), and the tolerance is
    tight enough that a 0.1% error is wrong and dense's own float32 answer is right."""
    assert check_case("dense", BACKENDS["dense"], case, torch.float32, torch.device("cpu")).ok
    off = Backend("off", _scaled, Serves(pos_to_content=True), "wrong on purpose")
    verdict = check_case("off", off, case, torch.float32, torch.device("cpu"))
    assert not verdict.ok and verdict.worst > 10
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    assert torch.allclose(formula(q, q, q, None, None, None, max_relative_position=1),
                          torch.softmax(q @ q.transpose(-1, -2) / 2, -1) @ q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer")
def test_check_asked_for_cuda_without_a_gpu_says_so(capsys):
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
