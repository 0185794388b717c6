"""ruff is part of the test suite, so CI enforces it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    paths = [p for p in ("src", "tests", "benchmarks") if (ROOT / p).is_dir()]
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *paths], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
