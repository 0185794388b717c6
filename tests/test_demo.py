"""`relattn demo` prints the spec's numbers digit for digit and writes three PNG heatmaps."""

import re
import subprocess
import sys

from relattn.demo import run_demo
from test_reference import SPEC_WEIGHTS

PNG = b"\x89PNG\r\n\x1a\n"


def test_demo_prints_spec_and_saves_pngs(tmp_path, capsys):
    paths = run_demo(tmp_path / "out")
    text = capsys.readouterr().out
    assert SPEC_WEIGHTS in text
    assert "    0    |     -5     |      -4" in text and "    9    |     +4     |      +4" in text
    for line in ("Input shape:     (6, 8)", "Output shape:    (6, 4)", "Weights shape:   (6, 6)"):
        assert line in text
    diffs = [float(x) for x in re.findall(r"reference\| = ([0-9.e+-]+)", text)]
    assert len(diffs) == 4 and max(diffs) < 1e-12
    assert sorted(p.name for p in paths) == ["attention_weights.png", "clipped_positions_k4.png", "key_table_k3.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and f"saved {p}" in text
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left behind


def test_cli_demo(tmp_path):
    r = subprocess.run([sys.executable, "-m", "relattn", "demo", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert SPEC_WEIGHTS in r.stdout
    assert len(list(tmp_path.glob("*.png"))) == 3


def test_cli_unknown_command_exits_2():
    r = subprocess.run([sys.executable, "-m", "relattn", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_saved_files_get_ordinary_permissions(tmp_path):
    import os
    import stat

    from relattn._io import atomic_write_text

    atomic_write_text(tmp_path / "a.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o666 & ~mask
