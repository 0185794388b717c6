"""What pyproject.toml promises: names, entry points, dependencies, typing marker."""

import importlib.metadata as md
import importlib.util
from pathlib import Path

import relattn
from relattn import cli


def test_distribution_metadata():
    meta = md.metadata("relattn")
    assert meta["Name"] == "relattn" and meta["Requires-Python"] == ">=3.10"
    requires = md.requires("relattn")
    def name(r):
        return r.split(">")[0].split("=")[0].split("[")[0].strip()

    core = {name(r) for r in requires if "extra" not in r}
    assert core == {"numpy", "torch", "ninja"}  # an op-only user needs nothing else
    extra = {e: {name(r) for r in requires if f'extra == "{e}"' in r} for e in ("cli", "hf", "gpu", "dev")}
    assert extra["cli"] == set(cli.CLI_EXTRA)
    assert "transformers" in extra["hf"] and extra["gpu"] == {"triton"}
    assert {"pytest", "hypothesis", "ruff", "relattn"} <= extra["dev"]
    dev_self = next(r for r in requires if 'extra == "dev"' in r and name(r) == "relattn")
    assert all(e in dev_self for e in ("cli", "gpu", "hf")), dev_self  # CI installs and tests every extra


def test_commands_without_the_cli_extra_stop_first_and_say_how_to_install_it(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert cli.main(["demo", "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err == "relattn demo: error: needs matplotlib (the 'cli' extra): pip install 'relattn[cli]'\n"
    assert not (tmp_path / "demo").exists()  # no work done


def test_console_script_and_module_entry():
    scripts = {ep.name: ep.value for ep in md.entry_points(group="console_scripts") if ep.dist.name == "relattn"}
    assert scripts == {"relattn": "relattn.cli:main"} or scripts.get("relattn") == "relattn.cli:main"
    assert (Path(relattn.__file__).parent / "__main__.py").is_file()


def test_py_typed_shipped():
    assert (Path(relattn.__file__).parent / "py.typed").is_file()
    assert relattn.__version__ == md.version("relattn")


def test_the_suite_runs_a_worker_per_core_from_the_dev_extra():
    """pyproject's pytest options use pytest-xdist (``-n``), which the dev extra installs."""
    import pytest

    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
    assert "-n auto" in conf["tool"]["pytest"]["ini_options"]["addopts"]
    assert any(r.replace(" ", "").startswith("pytest-xdist>=") for r in conf["project"]["optional-dependencies"]["dev"])
