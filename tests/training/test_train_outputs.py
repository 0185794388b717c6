"""What a finished ``relattn train`` says it saved: every file it wrote, sample.txt included."""

from __future__ import annotations

import re

from relattn.training.model import TransformerConfig
from relattn.training.train import TrainOptions, train


def test_every_written_file_is_in_the_saved_lines(tmp_path, capsys):
    config = TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, max_relative_position=2, context=8)
    out = tmp_path / "run"
    train(config, TrainOptions(out=str(out), steps=2, batch_size=2, eval_tokens=16, eval_every=0, sample_bytes=8,
                               plots=False, progress=False, device="cpu"))
    saved = set(re.findall(r"^saved (.+)$", capsys.readouterr().out, flags=re.M))
    written = {str(p) for p in out.iterdir() if p.is_file()}
    assert str(out / "sample.txt") in written and written <= saved, (written, saved)


def test_plots_from_zero_leave_headroom_above_their_curves():
    import json
    from pathlib import Path

    from relattn.training.compare import compare_figure
    from relattn.training.plots import UNIFORM_LOSS, context_figure

    summary = json.loads((Path(__file__).resolve().parents[2] / "docs" / "compare.json").read_text())
    top = max(v for r in summary["results"].values() for v in r["val_loss_by_context"].values())
    low, high = compare_figure(summary).axes[0].get_ylim()
    assert low == 0 and high >= 1.1 * top
    config = TransformerConfig(context=64)
    fig = context_figure({"val_loss_by_context": {"64": 1.2, "128": 1.3}}, config)
    low, high = fig.axes[0].get_ylim()
    assert low == 0 and high >= 1.1 * UNIFORM_LOSS
