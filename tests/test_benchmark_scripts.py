"""The scripts under benchmarks/ still run (tiny sizes; their numbers are not checked here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [
    ["fast_vs_sdpa.py", "--lengths", "192", "--k", "8", "--reps", "1", "--no-memory"],
    ["masked.py", "--lengths", "192", "--k", "8", "--reps", "1"],
])
def test_benchmark_script_runs(args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / args[0]), *args[1:]], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["192"]]
    assert rows and all(float(x) > 0 for row in rows for x in row[2:] if x.replace(".", "").isdigit())
