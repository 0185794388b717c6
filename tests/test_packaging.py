"""What pyproject.toml promises: names, entry points, dependencies, typing marker."""

import importlib.metadata as md
from pathlib import Path

import relattn


def test_distribution_metadata():
    meta = md.metadata("relattn")
    assert meta["Name"] == "relattn" and meta["Requires-Python"] == ">=3.10"
    requires = md.requires("relattn")
    for dep in ("numpy", "torch", "matplotlib"):
        assert any(r.split(">")[0].split("=")[0].strip() == dep and "extra" not in r for r in requires), dep
    dev = [r for r in requires if 'extra == "dev"' in r]
    for dep in ("pytest", "hypothesis", "ruff"):
        assert any(r.startswith(dep) for r in dev), dep


def test_console_script_and_module_entry():
    scripts = {ep.name: ep.value for ep in md.entry_points(group="console_scripts") if ep.dist.name == "relattn"}
    assert scripts == {"relattn": "relattn.cli:main"} or scripts.get("relattn") == "relattn.cli:main"
    assert (Path(relattn.__file__).parent / "__main__.py").is_file()


def test_py_typed_shipped():
    assert (Path(relattn.__file__).parent / "py.typed").is_file()
    assert relattn.__version__ == md.version("relattn")
