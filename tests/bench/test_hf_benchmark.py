"""benchmarks/hf_models.py --quick runs and writes every case, with finite ratios (its numbers are not checked), and
Flan-T5's greedy generation gives the same tokens patched and unpatched."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relattn.backends import cpu, native

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {  # (model, scope, length) -> variants; each in both modes
    ("w2v-bert", "attention", 40): {"eager", "sdpa", "relattn"},
    ("w2v-bert", "model (1 layers)", 40): {"eager", "sdpa", "relattn"},
    ("vits", "text-encoder", 20): {"eager", "relattn"},
    ("speecht5", "encoder (1 layers)", 30): {"eager", "relattn"},
    ("bert-relative-key-query", "model (1 layers)", 48): {"v4-eager", "relattn"},
    ("deberta-v3-base", "attention", 40): {"eager", "relattn"},
    ("deberta-v3-base", "model (1 layers)", 40): {"eager", "relattn"},
    ("parakeet-0.6b", "attention", 40): {"eager", "sdpa", "relattn"},
    ("t5-base", "encoder (1 layers) x4", 40): {"eager", "sdpa", "relattn"},
    ("mpnet-base", "model ragged 4-40 x8", 40): {"eager", "relattn"},
    ("mpnet-base", "model x4", 40): {"eager", "relattn"},
    ("flan-t5-base", "generate 6 tokens (greedy)", 40): {"eager", "sdpa", "relattn"},  # mode "generate" only
}
GENERATE = {key for key in EXPECTED if key[0] == "flan-t5-base"}


@pytest.mark.slow
def test_hf_models_quick_writes_every_case(tmp_path):
    out = tmp_path / "hf.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_models.py"), "--quick", "--warmup", "0",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["transformers"]
    assert result["machine"]["cpu_features"] == cpu.features().describe()  # where it ran, and the kernel's choice
    assert result["machine"]["native_choice"] == native.choice().describe()
    rows = {(r["model"], r["scope"], r["length"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(*key, mode) for key in EXPECTED
                         for mode in (("generate",) if key in GENERATE else ("forward", "forward+backward"))}
    for (model, scope, length, _), row in rows.items():
        variants = EXPECTED[(model, scope, length)]
        assert set(row["variants"]) == variants and not row["skipped"]
        assert all(v["ms"] > 0 and v["peak_mb"] > 0 for v in row["variants"].values())
        assert set(row["speedup"]) == set(row["memory_ratio"]) == variants - {"relattn"}
        for ratio in (*row["speedup"].values(), *row["memory_ratio"].values()):
            assert math.isfinite(ratio) and ratio > 0
        assert set(row["max_abs_diff"]) == variants - {"relattn"}
        assert all(diff < 1e-4 for diff in row["max_abs_diff"].values()), row["max_abs_diff"]  # generate: 0 tokens


@pytest.mark.slow
def test_hf_models_ragged_deberta_batch(tmp_path):
    """--ragged: one right-padded DeBERTa batch (lengths spread over LO..HI), patched against eager, the outputs at
    the real tokens agreeing."""
    out = tmp_path / "ragged.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_models.py"), "--quick", "--warmup", "0",
                           "--only", "deberta", "--ragged", "8-40", "--batch", "4", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scope"], r["length"], r["mode"]) for r in rows] == [
        ("model (1 layers) ragged 8-40 x4", 40, mode) for mode in ("forward", "forward+backward")]
    assert all(set(r["variants"]) == {"eager", "relattn"} and r["max_abs_diff"]["eager"] < 1e-4 for r in rows)
