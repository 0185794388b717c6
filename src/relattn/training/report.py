"""What a finished training run tells its user: the summary lines, the key-table analysis, a sample, and the
files metrics.json, sample.txt and the plots (written by rank 0 only)."""

from __future__ import annotations

import json
import math

import torch

from .._io import atomic_write_text
from .evaluation import first_key_table, key_table_stats


def summary_lines(metrics: dict) -> list[str]:
    """The final losses, speed and validation loss per context, as printed at the end of a run."""
    tps, n_tail = metrics["tokens_per_s"], metrics["final_train_loss_steps"]
    train = (f"train loss {metrics['final_train_loss']:.4f} (mean of the last {n_tail} step{'s' * (n_tail != 1)})"
             if n_tail else "no training steps")
    lines = [f"step {metrics['steps']}: {train}, validation {metrics['final_val_loss']:.4f} nats/byte "
             f"({metrics['final_val_loss'] / math.log(2):.3f} bits/byte), "
             + (f"{tps:,.0f} tokens/s" if tps else "no steps this session"),
             "validation loss by evaluation context (nats/byte, the same "
             f"{metrics['val_eval_bytes']:,} bytes each): "
             + ", ".join(f"{n}: {v:.4f}" for n, v in metrics["val_loss_by_context"].items())]
    if metrics["contexts_skipped_val_too_short"]:
        lines.append(f"  (skipped, validation split too short: {metrics['contexts_skipped_val_too_short']})")
    return lines


def key_table_line(stats: dict) -> str:
    b, k = stats["band"], stats["max_relative_position"]
    tr, ini = stats["trained"], stats["initial"]
    return (f"key-side table a^K, layer 1: mean distance between adjacent offsets near 0 (offsets {-b}..0) "
            f"{tr['near_zero']:.3f} vs at -K ({-k}..{-k + b}) {tr['near_minus_k']:.3f}: ratio {tr['ratio']:.2f} "
            f"(at initialisation {ini['ratio']:.2f}); spec's prediction of sharper structure near offset 0: "
            f"{'holds' if stats['prediction_holds'] else 'not seen (yet)'}. Rows +1..+{k} (future, masked) "
            f"changed by at most {stats['future_rows_max_change']:.1e}.")


def sample_text(model, options) -> str:
    """``options.sample_bytes`` bytes generated after ``options.prompt``, seeded by ``options.seed``."""
    device = next(model.parameters()).device
    prompt = torch.tensor(list(options.prompt.encode("utf-8")) or [10], dtype=torch.long, device=device)
    g = torch.Generator(device=device).manual_seed(options.seed)
    ids = model.generate(prompt, options.sample_bytes, temperature=options.temperature, top_k=options.top_k,
                         generator=g)
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def report_run(recipe, result) -> None:
    """Print the summary of a finished :class:`~relattn.training.recipe.TrainingRecipe` run and write its files; adds
    ``key_table`` and ``sample`` to ``result.metrics``."""
    config, options, metrics, out = recipe.config, recipe.options, result.metrics, result.out
    for line in summary_lines(metrics):
        print(line)
    if config.positions == "relative" and recipe.initial_table is not None and config.max_relative_position >= 2:
        metrics["key_table"] = key_table_stats(first_key_table(result.model), recipe.initial_table,
                                               config.max_relative_position)
        print(key_table_line(metrics["key_table"]))
    if options.sample_bytes:
        metrics["sample"] = sample = sample_text(result.model, options)
        print(f"--- sample ({options.sample_bytes} bytes, temperature {options.temperature}, top-k {options.top_k}):")
        print(sample)
        print("---")
        atomic_write_text(out / "sample.txt", sample + "\n")
        print(f"saved {out / 'sample.txt'}")
    if options.plots:
        from .plots import plot_run

        for p in plot_run(result, config, recipe.initial_table):
            print(f"saved {p}")
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    print(f"saved {out / 'metrics.json'}")


__all__ = ["key_table_line", "report_run", "sample_text", "summary_lines"]
