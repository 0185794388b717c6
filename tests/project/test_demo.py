"""`relattn demo` prints the spec's numbers digit for digit and writes three PNG heatmaps."""

import re
import subprocess
import sys

import pytest

from helpers import SPEC_WEIGHTS
from relattn.cli.demo import run_demo

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


@pytest.mark.slow
def test_cli_demo(tmp_path):
    r = subprocess.run([sys.executable, "-m", "relattn", "demo", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert SPEC_WEIGHTS in r.stdout
    assert len(list(tmp_path.glob("*.png"))) == 3


@pytest.mark.slow
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


def test_version(capsys):
    import pytest

    import relattn
    from relattn import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"relattn {relattn.__version__}\n"
    assert relattn.__version__ == "0.1.0"


def test_demo_out_naming_a_file_is_refused_before_any_work(tmp_path, capsys):
    from relattn import cli

    taken = tmp_path / "figures.png"
    taken.write_bytes(b"keep me")
    assert cli.main(["demo", "--out", str(taken)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the walkthrough did not run
    assert captured.err == f"relattn demo: error: --out {taken}: exists and is not a folder\n"
    assert taken.read_bytes() == b"keep me" and sorted(tmp_path.iterdir()) == [taken]


def test_check_output_dir(tmp_path):
    import os

    import pytest

    from relattn._io import OutputPathError, check_output_dir

    assert check_output_dir(tmp_path) == tmp_path  # an existing folder
    assert check_output_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"  # created later, by the writer
    assert not (tmp_path / "a").exists()  # checking creates nothing
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"^--out .*/f: exists and is not a folder$"):
        check_output_dir(tmp_path / "f")
    with pytest.raises(OutputPathError, match=r"^--save .*/f/a/b: .*/f is a file, not a folder$"):
        check_output_dir(tmp_path / "f" / "a" / "b", option="--save")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OutputPathError, match="not writable"):
            check_output_dir(locked / "run")


def test_pyproject_license_is_an_spdx_expression():
    """setuptools >= 77 deprecates ``project.license`` as a table (a warning on every install)."""
    import warnings
    from pathlib import Path

    import pytest

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license expressions (77)")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), pyproject)
    assert dist.metadata.license_expression == "MIT"
    assert not [w for w in caught if "license" in str(w.message).lower()], [str(w.message) for w in caught]
    assert 'requires = ["setuptools>=77"]' in pyproject.read_text(encoding="utf-8")
