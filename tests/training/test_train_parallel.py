"""``relattn train --context-parallel P`` and ``--fsdp`` under torchrun (2 gloo processes) against the single-process
run: the same losses to float32 rounding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relattn import cli
from relattn.training.checkpoint import latest_checkpoint, restore
from relattn.training.model import TransformerConfig
from relattn.training.recipe import fresh_model
from relattn.training.train import TrainOptions, train

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
TINY = TransformerConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, max_relative_position=4, context=16)
ARGS = ["--d-model", "16", "--heads", "2", "--layers", "2", "--d-ff", "32", "--max-relative-position", "4",
        "--context", "16", "--batch-size", "8", "--eval-tokens", "512", "--eval-every", "3", "--steps", "6",
        "--checkpoint-every", "3", "--sample-bytes", "0", "--no-plots", "--no-progress", "--device", "cpu"]
CLOSE = dict(rtol=1e-5, atol=1e-6)  # float32 rounding: the sums are formed in another order


def single_options(out) -> TrainOptions:
    return TrainOptions(out=str(out), steps=6, batch_size=8, eval_tokens=512, eval_every=3, checkpoint_every=3,
                        sample_bytes=0, plots=False, progress=False, device="cpu")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(TINY, single_options(tmp_path_factory.mktemp("single")))
    finally:
        torch.set_num_threads(before)


def torchrun(out: Path, *extra: str) -> dict:
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "relattn", "train",
           "--out", str(out), *ARGS, *extra]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("relattn train:") == 1  # rank 0 speaks alone
    return json.loads((out / "metrics.json").read_text())


def assert_same_run(metrics: dict, single) -> None:
    assert metrics["world_size"] == 2 and metrics["steps"] == 6
    assert len(metrics["train_loss"]) == 6
    torch.testing.assert_close(torch.tensor(metrics["train_loss"], dtype=torch.float64),
                               torch.tensor(single.train_loss, dtype=torch.float64), **CLOSE)
    torch.testing.assert_close(metrics["val_loss_by_context"], single.metrics["val_loss_by_context"], **CLOSE)


@pytest.mark.slow
def test_context_parallel_two_processes_match_a_single_process_run(tmp_path, single):
    metrics = torchrun(tmp_path / "cp", "--context-parallel", "2")
    assert metrics["options"]["context_parallel"] == 2
    assert_same_run(metrics, single)


@pytest.mark.slow
def test_fsdp_two_processes_match_a_single_process_run(tmp_path, single):
    metrics = torchrun(tmp_path / "fsdp", "--fsdp")
    assert metrics["options"]["fsdp"] is True
    assert_same_run(metrics, single)
    # its checkpoints hold the full model, as a single-process run's do: they load into a plain model
    ckpt, refused = latest_checkpoint(tmp_path / "fsdp" / "checkpoints")
    assert ckpt is not None and not refused and ckpt.step == 6
    model = fresh_model(TINY, 1)
    restore(ckpt, model)
    for name, p in single.model.state_dict().items():
        if not name.endswith("k_proj.bias"):  # exact gradient 0: Adam turns rounding into lr-sized steps
            assert (model.state_dict()[name] - p).norm() <= 1e-5 * p.norm() + 1e-6, name
    # ... and an FSDP run resumes from them (optimizer state re-sharded) as the single-process run does
    resumed = torchrun(tmp_path / "fsdp", "--fsdp", "--resume", "--steps", "8")
    shutil.copytree(single.out, tmp_path / "single")
    single_resumed = train(TINY, replace(single_options(tmp_path / "single"), steps=8, resume="latest"))
    torch.testing.assert_close(torch.tensor(resumed["train_loss"], dtype=torch.float64),
                               torch.tensor(single_resumed.train_loss, dtype=torch.float64), **CLOSE)


@pytest.mark.parametrize("flag", [["--context-parallel", "2"], ["--fsdp"]])
def test_parallel_flags_need_torchrun(tmp_path, flag, capsys):
    code = cli.main(["train", "--out", str(tmp_path / "x"), *ARGS, *flag])
    assert code == 2
    assert "run under torchrun" in capsys.readouterr().err


def test_context_parallel_must_be_positive(tmp_path, capsys):
    assert cli.main(["train", "--out", str(tmp_path / "x"), *ARGS, "--context-parallel", "0"]) == 2
    assert "--context-parallel must be a positive integer" in capsys.readouterr().err
