"""The layers as a test: import-linter's contracts in pyproject.toml (``[tool.importlinter]``), and one rule it
cannot express, checked on the source's syntax tree: no module imports a private name (``_y``) of another; and in
tests/, no test module imports another test module (what tests share lives in ``tests/helpers/``).

Each contract is also shown to break: the same contracts are run on a copy of the package into which an
import that breaks it has been written (a backend that imports the application, a backend that imports the op
layer, the module layer calling a backend directly).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "relattn"
CONTRACTS = ("layers", "library-not-app", "backends-below-op", "modules-through-op")



def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """import-linter on the package found first from ``cwd`` (lint-imports puts ``cwd`` first on the path),
    with the repository's contracts."""
    cmd = [str(Path(sys.executable).with_name("lint-imports")), "--config", str(ROOT / "pyproject.toml"), "--no-cache",
           "--no-logo"]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def verdicts(output: str) -> dict[str, str]:
    """Contract name -> "KEPT" or "BROKEN", from lint-imports' summary."""
    import tomllib

    names = {c["id"]: c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
             ["contracts"]}
    flat = " ".join(output.split())
    found = {}
    for cid, name in names.items():
        for verdict in ("KEPT", "BROKEN"):
            if f"{' '.join(name.split())} {verdict}" in flat:
                found[cid] = verdict
    return found


def test_the_contracts_hold():
    r = lint_imports(ROOT / "src")
    assert verdicts(r.stdout) == dict.fromkeys(CONTRACTS, "KEPT"), r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


def test_each_contract_breaks_on_an_import_that_breaks_it(tmp_path):
    """A copy of the package with three imports added, one per rule: every contract reports its violation."""
    copy = tmp_path / "relattn"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.cpp"))
    broken = {
        "backends/native.py": "from ..training import model  # the application",
        "backends/dense.py": "from ..functional import relative_attention  # the op layer",
        "modules.py": "from .backends import blocked  # a backend, past the op layer",
    }
    for path, line in broken.items():
        with open(copy / path, "a") as f:
            f.write(f"\n{line}\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    assert verdicts(r.stdout) == dict.fromkeys(CONTRACTS, "BROKEN"), r.stdout + r.stderr
    for importer, imported in [("relattn.backends.native", "relattn.training.model"),
                               ("relattn.backends.dense", "relattn.functional"),
                               ("relattn.modules", "relattn.backends.blocked")]:
        assert f"{importer} -> {imported}" in r.stdout, (importer, imported, r.stdout)


# ------------------------------------------------------------------------------------ private names


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports(root: Path) -> set[tuple[str, str, str]]:
    """(importer, module, name) for every ``from module import _name`` in the package at ``root`` where
    ``module`` is another module of the package and ``_name`` is not itself a module (importing a private
    module, such as a backend's kernel file, is fine; so is a public name from a private module)."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != root.name or source == importer:
                continue
            folder = root.parent.joinpath(*source.split("."))
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not name.startswith("__")
                is_module = (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()
                if private and not is_module:
                    found.add((importer, source, name))
    return found


def test_no_module_imports_a_private_name_of_another():
    assert private_imports(PACKAGE) == set(), "private names imported from another module"


def test_the_private_name_check_finds_one(tmp_path):
    pkg = tmp_path / "relattn"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "__init__.py").write_text("from . import _kernels\nfrom ._common import Backend\n")
    (pkg / "backends" / "_common.py").write_text("Backend = object\n_helper = 1\n")
    (pkg / "backends" / "_kernels.py").write_text("")
    (pkg / "backends" / "dense.py").write_text("from ._common import _helper, Backend\n")
    (pkg / "bench.py").write_text("from .backends._common import _helper\nfrom relattn.backends import _kernels\n")
    assert private_imports(pkg) == {("relattn.backends.dense", "relattn.backends._common", "_helper"),
                                    ("relattn.bench", "relattn.backends._common", "_helper")}


def test_every_contract_is_checked_here():
    """The ids this file checks are the ones pyproject.toml declares (a contract added or renamed fails here)."""
    import tomllib

    ids = [c["id"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]
    assert sorted(ids) == sorted(CONTRACTS)


# ------------------------------------------------------------------------------------ tests import helpers only


def imports_of_test_modules(tests: Path) -> set[tuple[str, str]]:
    """(importing file, imported module) for every import in the tree ``tests`` of a test module (``test_*``, by
    plain name or as ``tests.<...>.test_*``) or of ``conftest``: what tests share lives in ``tests/helpers/``."""
    found = set()
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] + [f"{node.module or ''}.{a.name}".lstrip(".") for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                if any(part.startswith("test_") or part == "conftest" for part in module.split(".")):
                    found.add((path.relative_to(tests).as_posix(), module))
    return found


def test_no_test_module_imports_another_test_module():
    assert imports_of_test_modules(ROOT / "tests") == set(), "test modules imported (move what they share to helpers/)"


def test_the_test_module_check_finds_each_spelling(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "test_x.py").write_text("from helpers import assert_close\nimport helpers.hf\n_y = 1\n")
    (tmp_path / "a" / "test_y.py").write_text("from test_x import _y\n")
    (tmp_path / "test_z.py").write_text("def f():\n    import tests.a.test_x\n    from a import test_x\n"
                                        "    from conftest import one_thread\n")
    assert imports_of_test_modules(tmp_path) == {("a/test_y.py", "test_x"), ("a/test_y.py", "test_x._y"),
                                             ("test_z.py", "tests.a.test_x"), ("test_z.py", "a.test_x"),
                                             ("test_z.py", "conftest"), ("test_z.py", "conftest.one_thread")}
