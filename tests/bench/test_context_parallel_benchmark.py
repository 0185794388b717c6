"""benchmarks/context_parallel.py runs at a tiny size, and what it prints is what its JSON holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_context_parallel_benchmark(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = ["--total", "64", "--world", "2", "--heads", "2", "--head-dim", "8", "--max-relative-position", "4",
            "--repeats", "1", "--json", str(tmp_path / "cp.json")]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    ranks = json.loads((tmp_path / "cp.json").read_text())["ranks"]["2"]
    kv = 2 * 1 * 2 * 32 * 8 * 4  # k and v of one rank: B=1, H=2, n=32, D=8, float32
    for r in ranks:
        assert r["n_local"] == 32 and r["ring_ms"] > 0 and r["all-gather_ms"] > 0
        # forward: k|v on once; backward: k|v on once, and the dK|dV accumulator twice (round the ring, then home)
        assert r["ring_bytes"] == 4 * kv and r["gather_bytes"] == 2 * kv
        assert [(s["phase"], s["step"]) for s in r["steps"]] == [("forward", 0), ("backward", 0)]
    row = next(line.split() for line in done.stdout.splitlines() if line.split()[:2] == ["2", "32"])
    assert float(row[6]) == round(4 * kv / 2**20, 2)
