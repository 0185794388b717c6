"""The library without the ``cli`` extra: ``import relattn`` and every library call (the op, the module, the cache,
``patch``) work with matplotlib, tqdm and safetensors absent; only the application needs them."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relattn.cli import CLI_EXTRA

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "relattn"
APPLICATION = ("training", "bench", "cli")

LIBRARY_CALLS = """
import sys

sys.modules.update(dict.fromkeys(BLOCKED))  # as if not installed: import raises, importlib.util.find_spec is None
import torch
import relattn
import relattn.integrations.bert, relattn.integrations.transformers
from relattn import KVCache, RelativeMultiheadAttention, relative_attention, relative_attention_weights

q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
table = torch.randn(5, 4, dtype=torch.float64)
for backend in ("dense", "blocked"):
    out = relative_attention(q, q, q, table, table, max_relative_position=2, is_causal=True, backend=backend)
    out.sum().backward()
relative_attention_weights(q, q, table, max_relative_position=2)
mod = RelativeMultiheadAttention(8, 2, 2, batch_first=True, backend="dense")
cache = KVCache()
x = torch.randn(1, 3, 8)
mod(x, is_causal=True, kv_cache=cache)[0].sum().backward()
mod(x[:, :1], kv_cache=cache)
assert all(sys.modules[m] is None for m in BLOCKED)
print("library calls ok")
"""


@pytest.mark.slow
def test_library_calls_with_the_cli_extra_absent():
    code = f"BLOCKED = {set(CLI_EXTRA)!r}\n" + LIBRARY_CALLS
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "library calls ok" in r.stdout, r.stdout + r.stderr


def test_the_library_imports_none_of_the_cli_extra_at_module_level():
    """Read from the source: a library module may import an extra's package only inside a function (``_io``'s
    figure writer, ``bert``'s checkpoint reader), where the application or the hf extra calls it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in APPLICATION:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [(path.name, n) for n in names if n.split(".")[0] in CLI_EXTRA]
    assert found == []


@pytest.fixture
def refuse_cli_extra_to_the_library(monkeypatch):
    """Any import of the cli extra's packages made by relattn's code (cached in sys.modules or not) fails."""
    real = builtins.__import__

    def guarded(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        if level == 0 and name.split(".")[0] in CLI_EXTRA and importer.split(".")[0] == "relattn":
            raise ModuleNotFoundError(f"{importer} imports {name}, part of the cli extra", name=name)
        return real(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", guarded)


def test_the_guard_catches_an_import(refuse_cli_extra_to_the_library):
    with pytest.raises(ModuleNotFoundError, match="relattn._io imports matplotlib.pyplot"):
        from relattn._io import save_figure

        save_figure(None, "unused.png")


def test_patch_uses_none_of_the_cli_extra(refuse_cli_extra_to_the_library):
    """A tiny SpeechT5 patched and run: transformers itself may need tqdm or safetensors, relattn does not."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")
    from relattn.integrations.transformers import patch

    cfg = transformers.SpeechT5Config(
        hidden_size=24, encoder_layers=1, encoder_attention_heads=3, encoder_ffn_dim=30, decoder_layers=1,
        decoder_attention_heads=3, decoder_ffn_dim=30, encoder_max_relative_position=4, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, positional_dropout=0.0)
    model = transformers.SpeechT5Model(cfg).eval()
    assert patch(model).patched
    with torch.no_grad():
        out = model(input_values=torch.randn(1, 6, 24), decoder_input_values=torch.randn(1, 2, 24), use_cache=False)
    assert torch.isfinite(out.encoder_last_hidden_state).all()

