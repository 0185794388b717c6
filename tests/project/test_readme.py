"""The README and docs/*.md run: every ```python block is executed, so the documentation cannot drift.

Blocks of one file run in order in one shared namespace (a later block may use names an earlier one
defined), in a fresh temporary working directory; any exception fails the test for that file. Files without
python blocks are not collected. Global switches a block might flip (deterministic algorithms, grad mode,
default dtype) are put back afterwards so the rest of the suite is unaffected.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ```python block in ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


DOCS = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.exists() and python_blocks(p)]


def test_fence_extraction():
    text = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x + 1\n\nz = y\n```\n"
    assert FENCE.findall(text) == ["x = 1\n", "y = x + 1\n\nz = y\n"]


def test_documentation_has_python_blocks():
    assert DOCS, "no ```python block found in README.md or docs/*.md"


SLOW_DOCS = {"training.md", "usage.md"}  # (a model trained; compiles and exports: over ten seconds each)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow] if p.name in SLOW_DOCS else [])
                                  for p in DOCS], ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_markdown_code_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        for line, code in python_blocks(path):
            try:
                exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"the python block at {path.name} line {line} raised {exc!r}") from exc
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)


def test_usage_page_shows_each_toolchain_feature_in_executed_code():
    """docs/usage.md (linked from the README) shows each toolchain feature in code that runs."""
    code = "".join(FENCE.findall((ROOT / "docs" / "usage.md").read_text(encoding="utf-8")))
    for feature in ("RelativeMultiheadAttention(", "from_mha(", "relative_attention(", "KVCache()",
                    "KVCache(max_len=", "torch.compile(", "torch.export.export(", "torch.export.save(",
                    "torch.export.load(", "torch.autocast(", "torch.use_deterministic_algorithms(True)",
                    "beyond=", "tie=True", "TransformerXL()", "T5Bias("):
        assert feature in code, feature


def test_readme_is_a_front_door():
    """About 200 lines; the op and the module each in one executed block; every docs page linked."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 230
    code = "".join(FENCE.findall(readme))
    assert "relative_attention(" in code and "RelativeMultiheadAttention(" in code
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, page.name


def test_api_in_brief_names_every_parameter():
    """The README's API in brief writes the op's and the module's signatures whole: a parameter added to either
    and left out there fails here."""
    import inspect

    from relattn import RelativeMultiheadAttention, relative_attention

    brief = (ROOT / "README.md").read_text(encoding="utf-8").split("## API in brief", 1)[1].split("\n## ", 1)[0]
    for name, fn in (("relative_attention", relative_attention),
                     ("RelativeMultiheadAttention", RelativeMultiheadAttention)):
        written = re.search(rf"`{name}\((.*?)\)`", brief, re.DOTALL).group(1)
        said = [part.strip().split("=")[0] for part in written.split(",") if part.strip() not in ("*", "")]
        want = [p for p in inspect.signature(fn).parameters if p not in ("device", "dtype")]
        assert said == want, name
