"""``relattn compare``: relative vs absolute (sinusoidal) vs no positions, same budget and seed.

Each variant is an ordinary ``relattn train`` run in ``OUT/<positions>`` (resumable: rerunning the
command continues unfinished runs and reuses finished ones); then one table and one plot of
validation loss per evaluation context (1x, 2x, 4x, 8x the training context). Clipping makes the
relative model's attention at 8x the context use only table rows it trained on; sinusoidal
positions beyond the training length were never seen.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from pathlib import Path

from .._io import atomic_write_text, check_output_dir, save_figure
from .arguments import add_model_arguments, add_train_arguments, configs_from_args, run_command
from .model import POSITIONS, TransformerConfig
from .plots import HEADROOM
from .recipe import check_run
from .train import TrainOptions, train

COMPARE_DEFAULTS = TrainOptions(out="relattn-runs/compare", steps=700, sample_bytes=120)
"""The options of ``relattn compare`` (it has no --sample-bytes; each run checkpoints once, at its end)."""


def compare(config: TransformerConfig, options: TrainOptions, positions=POSITIONS) -> dict:
    """Train one model per ``positions`` value (otherwise identical) and return the comparison.

    Each run is ``train(replace(config, positions=pos), replace(options, out=OUT/pos, resume="latest"))``.
    """
    for pos in positions:  # every run's refusals before any folder is made
        check_run(replace(config, positions=pos), options)
    out = check_output_dir(options.out)
    results = {}
    for pos in positions:
        print(f"\n=== positions={pos} ===")
        run = train(replace(config, positions=pos), replace(options, out=str(out / pos), resume="latest"))
        m = run.metrics
        results[pos] = {"val_loss_by_context": m["val_loss_by_context"], "parameters": m["parameters"],
                        "final_train_loss": m["final_train_loss"],
                        "tokens_per_s": m["tokens_per_s"], "train_seconds": m["train_seconds"]}
    summary = {"config": config.to_dict(), "steps": options.steps, "batch_size": options.batch_size,
               "seed": options.seed, "data": options.data or "pydoc_data.topics", "machine": machine(),
               "results": results}
    table = markdown_table(summary)
    print("\nValidation loss (nats/byte) by evaluation context:\n")
    print(table)
    atomic_write_text(out / "compare.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "compare.md", table + "\n")
    saved = [out / "compare.json", out / "compare.md"]
    if options.plots:
        saved.append(plot(summary, out / "compare.png"))
    print("\n" + "\n".join(f"saved {path}" for path in saved))
    return summary


def machine() -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def markdown_table(summary: dict) -> str:
    ctx = summary["config"]["context"]
    lengths = list(next(iter(summary["results"].values()))["val_loss_by_context"])
    head = "| positions | params | train loss | " + " | ".join(
        f"val @ {n} ({int(n) // ctx}x)" for n in lengths) + " |"
    rows = [head, "|" + "---|" * (3 + len(lengths))]
    best = {n: min(r["val_loss_by_context"][n] for r in summary["results"].values()) for n in lengths}
    for pos, r in summary["results"].items():
        cells = []
        for n in lengths:
            v = r["val_loss_by_context"][n]
            cells.append(f"**{v:.4f}**" if v == best[n] else f"{v:.4f}")
        rows.append(f"| {pos} | {r['parameters']:,} | {r['final_train_loss']:.4f} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(summary: dict, path: Path) -> Path:
    """Save :func:`compare_figure` of ``summary`` as ``path``."""
    return save_figure(compare_figure(summary), path)


def compare_figure(summary: dict):
    """Validation loss per evaluation context, one curve per positions variant, on a y-axis from zero."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for pos, r in summary["results"].items():
        n = [int(c) for c in r["val_loss_by_context"]]
        ax.plot(n, list(r["val_loss_by_context"].values()), "o-", label=pos)
    ctx = summary["config"]["context"]
    ax.axvline(ctx, color="gray", ls="--", lw=1, label="training context")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(c) for c in n])
    top = max(v for r in summary["results"].values() for v in r["val_loss_by_context"].values())
    ax.set_ylim(0, HEADROOM * top)  # from zero: differences at the scale of the losses themselves
    ax.set(xlabel="evaluation context (bytes)", ylabel="validation loss (nats/byte)",
           title=f"Length generalisation, {summary['steps']} steps, seed {summary['seed']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")  # below the curves, which start well above zero, clear of the training context
    return fig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="relative vs absolute vs no positions: validation loss per context length",
                       description="Train the same model with relative, absolute (sinusoidal) and no positions, "
                                   "same budget and seed; tabulate and plot validation loss at 1x, 2x, 4x, 8x the "
                                   "training context. Rerunning continues unfinished runs.")
    add_train_arguments(p, COMPARE_DEFAULTS)
    add_model_arguments(p, leave_out=("positions",))  # what compare varies
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    def body():
        config, options = configs_from_args(args, COMPARE_DEFAULTS)
        compare(config, replace(options, checkpoint_every=options.steps))

    return run_command(args, body)
