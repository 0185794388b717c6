"""benchmarks/shapes.py: --quick writes every case with finite ratios; its SDPA baseline model is the same model."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relattn.backends import cpu, native
from relattn.schemes import Shaw
from relattn.training.model import TransformerConfig, TransformerLM

ROOT = Path(__file__).resolve().parents[2]
CASES = {"train", "encoder", "bf16", "fp16", "autocast", "decode_16", "decode_48", "ragged", "generate",
         *(f"short_{n}_k{kk}{fwd}" for n in (8, 12) for kk in (2, 4) for fwd in ("", "_fwd"))}


@pytest.mark.slow
def test_quick_run_writes_every_case(tmp_path):
    out = tmp_path / "shapes.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "shapes.py"), "--quick", "--reps", "2",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["cases"]) == CASES and report["meta"]["size"] == "quick"
    assert report["meta"]["cpu_features"] == cpu.features().describe()  # where it ran, and the kernel's choice
    assert report["meta"]["native_choice"] == native.choice().describe() and "native kernel: class" in done.stdout
    for name, row in report["cases"].items():
        assert len(row["relattn_all_ms"]) == len(row["sdpa_all_ms"]) == 2, name
        assert row["relattn_ms"] > 0 and row["sdpa_ms"] > 0 and math.isfinite(row["ratio"]), name
        assert math.isclose(row["ratio"], row["relattn_ms"] / row["sdpa_ms"]), name
    gen = report["cases"]["generate"]
    assert math.isclose(gen["tokens_per_s_ratio"], gen["relattn_tokens_per_s"] / gen["sdpa_tokens_per_s"])
    assert len(gen["none_all_ms"]) == 2 and math.isclose(gen["none_ratio"], gen["none_ms"] / gen["sdpa_ms"])
    assert math.isclose(report["worst_ratio"], max(r["ratio"] for r in report["cases"].values()))


def test_sdpa_baseline_model_is_the_positions_none_model():
    # The generate case's baseline swaps each attention for SDPAAttention: with the same weights it must decode
    # the same tokens as the positions="none" model (prompt, cached single steps, and a chunk after the prompt).
    spec = importlib.util.spec_from_file_location("shapes", ROOT / "benchmarks" / "shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    cfg = TransformerConfig(d_model=24, n_heads=3, n_layers=2, d_ff=40, positions="none")
    torch.manual_seed(0)
    model = TransformerLM(cfg).double().eval()
    base = TransformerLM(cfg).double().eval()
    base.load_state_dict(model.state_dict())
    for block in base.encoder.blocks:
        block.attn = shapes.SDPAAttention(24, 3, Shaw(keys=False, values=False), dtype=torch.float64)
    for mine, theirs in zip(model.encoder.blocks, base.encoder.blocks, strict=True):
        theirs.attn.load_state_dict(mine.attn.state_dict())
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
    caches = base.new_caches()
    parts = [base(tokens[:, :5], kv_caches=caches), base(tokens[:, 5:6], kv_caches=caches),
             base(tokens[:, 6:], kv_caches=caches)]
    torch.testing.assert_close(torch.cat(parts, 1), model(tokens), rtol=1e-10, atol=1e-10)
    prompt = tokens[:1, :4]
    assert torch.equal(base.generate(prompt, 8, temperature=0), model.generate(prompt, 8, temperature=0))
