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
