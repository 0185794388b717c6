"""Every refusal a backend will give comes at construction, from its ``Serves`` declaration: the module, the
model, and ``relattn train`` / ``compare`` (one line on stderr, exit status 2, no folder written)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relattn import BACKENDS, RelativeMultiheadAttention, cli
from relattn.backends import not_supported_reasons, refusals
from relattn.functional import validate
from relattn.training.model import TransformerConfig, TransformerLM


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(("device", "dropout", "head_dim"), [("cpu", 0.0, 4), ("cpu", 0.1, 4), ("meta", 0.0, 200)])
def test_refusals_at_construction_are_the_refusals_at_the_call(name, device, dropout, head_dim):
    """What :func:`refusals` says of a kind of call is what the call itself is refused for: one declaration."""
    q = torch.zeros(1, 2, 3, head_dim, device=device)
    call = validate(q, q, q, None, None, max_relative_position=1, attn_mask=None, is_causal=False,
                    dropout_p=dropout, scale=None, query_offset=0)
    assert refusals(name, device=device, dtype=torch.float32, dropout=dropout > 0, head_dim=head_dim) == \
        not_supported_reasons(BACKENDS[name], call)
    assert refusals("auto", device=device, dropout=True) == []


def _cuda_only_triton(monkeypatch):
    """triton as it declares itself without TRITON_INTERPRET (which the test session sets): CUDA only."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert BACKENDS["triton"].serves.devices == {"cuda"}


def test_module_and_model_refuse_at_construction(monkeypatch):
    _cuda_only_triton(monkeypatch)
    with pytest.raises(ValueError, match=r"backend 'native' cannot serve this module: device meta \(serves cpu\)"):
        RelativeMultiheadAttention(32, 4, backend="native", device="meta")
    with pytest.raises(ValueError, match=r"backend 'triton' cannot serve this module: .*device cpu \(serves cuda\)"):
        RelativeMultiheadAttention(32, 4, backend="triton", device="cpu")
    TransformerLM(TransformerConfig(d_model=16, n_heads=2, n_layers=1, d_ff=16, dropout=0.1, backend="triton"))
    RelativeMultiheadAttention(32, 4, backend="native", dropout=0.1)  # dropout: served (triton's too, above)
    RelativeMultiheadAttention(32, 4, backend="dense", dropout=0.1)


@pytest.mark.parametrize(("command", "args", "expect"), [
    ("train", ["--backend", "triton", "--device", "cpu"], "--backend triton cannot train this model: device cpu"),
    ("compare", ["--dropout", "0.1", "--backend", "triton", "--device", "cpu"],
     "--backend triton cannot train this model: device cpu"),
])
def test_train_and_compare_refuse_before_any_work(tmp_path, capsys, monkeypatch, command, args, expect):
    _cuda_only_triton(monkeypatch)
    out = tmp_path / "out"
    assert cli.main([command, "--out", str(out), "--steps", "2", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"relattn {command}: error: {expect}"), err
    assert captured.out == "" and not out.exists()


@pytest.mark.slow
def test_relattn_train_triton_on_a_cpu_is_one_line_and_exit_2(tmp_path):
    """The command as a user runs it (no TRITON_INTERPRET): one line, exit status 2, no folder."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "relattn", "train", "--backend", "triton", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == ["relattn train: error: --backend triton cannot train this model: "
                                               "device cpu (serves cuda)"]
    assert not out.exists()


def test_train_help_lists_the_backends(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "{auto," + ",".join(BACKENDS) + "}" in capsys.readouterr().out
