"""Redraw the figures under docs/ from the records committed beside them: ``make docs-images``.

- ``docs/compare.png`` from ``docs/compare.json``, the summary ``relattn compare`` writes to ``OUT/compare.json``
  (copy a new run's there to update the figure and docs/compare.md's table together);
- ``docs/bench.png`` and ``docs/bench-causal.png`` from ``docs/bench.json`` and ``docs/bench-causal.json``, the
  records ``relattn bench`` (``--causal``) writes to ``OUT/bench.json``, when they are there.

Each figure is drawn by the function the command itself uses, so it looks as a fresh run's would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def main() -> int:
    from relattn.bench.cli import plot as bench_plot
    from relattn.training.compare import plot as compare_plot

    figures = [("compare", compare_plot), ("bench", bench_plot), ("bench-causal", bench_plot)]
    for name, draw in figures:
        record = DOCS / f"{name}.json"
        if not record.is_file():
            print(f"skipped docs/{name}.png: no {record.name} (copy the record of a run there)")
            continue
        print(f"saved {draw(json.loads(record.read_text(encoding='utf-8')), DOCS / f'{name}.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
