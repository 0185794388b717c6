"""The figures of a training run: loss curves, validation loss per context length, the key-side table.

Each ``*_figure`` function returns a matplotlib figure (inspectable in tests); :func:`plot_run` saves them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .._io import save_figure
from .evaluation import first_key_table, key_table_stats
from .model import TransformerConfig

UNIFORM_LOSS = math.log(256)
"""Loss of a model that guesses each of the 256 byte values with equal probability (nats/byte)."""
HEADROOM = 1.15
"""Plots from zero top their y-axis at this times their highest curve: the curves keep clear of the top border."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curve_figure(metrics: dict, config: TransformerConfig):
    """Training loss per step (and its running mean) with the validation loss at the training context."""
    import numpy as np

    fig, ax = _pyplot().subplots(figsize=(7, 4))
    steps, losses = np.array(metrics["train_loss"], dtype=float).T if metrics["train_loss"] else ([], [])
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="train (per step)")
    if len(losses) > 10:
        w = max(5, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], smooth, color="tab:blue", label=f"train ({w}-step mean)")
    if metrics["val_loss"]:
        vs, vl = np.array(metrics["val_loss"], dtype=float).T
        ax.plot(vs, vl, "o-", color="tab:orange", label=f"validation (context {config.context})")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"relattn train: positions={config.positions}")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def context_figure(metrics: dict, config: TransformerConfig):
    """Validation loss per evaluation context, on a y-axis from zero with the uniform guess (ln 256) marked,
    so that differences are seen at the scale of what training achieved."""
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    ctx = [int(c) for c in metrics["val_loss_by_context"]]
    ax.plot(ctx, list(metrics["val_loss_by_context"].values()), "o-", label=config.positions)
    ax.axvline(config.context, color="gray", ls="--", lw=1, label="training context")
    ax.axhline(UNIFORM_LOSS, color="gray", ls=":", lw=1, label=f"uniform guess (ln 256 = {UNIFORM_LOSS:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [str(c) for c in ctx])
    top = max([UNIFORM_LOSS, *metrics["val_loss_by_context"].values()])
    ax.set_ylim(0, HEADROOM * top)
    ax.set(xlabel="evaluation context (bytes)", ylabel="validation loss (nats/byte)",
           title="Validation loss vs context length")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    return fig


def key_table_figure(trained: torch.Tensor, initial: torch.Tensor, k: int, stats: dict | None = None):
    """The first layer's key-side table before and after training (head 1 if per-head), and the distance
    between adjacent rows at each offset -K+1..0. Needs ``k >= 2``."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    head = "" if trained.dim() == 2 else f" (head 1 of {trained.shape[0]})"
    t_show = trained if trained.dim() == 2 else trained[0]
    i_show = initial if initial.dim() == 2 else initial[0]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), gridspec_kw={"width_ratios": [1, 1, 0.9]})
    lim = float(max(t_show.abs().max(), i_show.abs().max()))
    labels = [f"{o:+d}" for o in range(-k, k + 1)]
    every = max(1, (2 * k + 1) // 17)
    for ax, t, title in ((axes[0], i_show, "at initialisation"), (axes[1], t_show, "after training")):
        im = ax.imshow(t.float().numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_yticks(range(0, 2 * k + 1, every), labels[::every])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # dimensions are whole numbers
        ax.set(title=f"key table a^K, layer 1{head}: {title}", xlabel="dimension")
    axes[0].set_ylabel("relative offset j - i")
    fig.colorbar(im, ax=axes[1], shrink=0.8)
    stats = stats or key_table_stats(trained, initial, k)
    offs = list(range(-k + 1, 1))
    for name, style in (("initial", "o--"), ("trained", "o-")):
        d = [stats[name]["adjacent_distance_by_offset"][str(o)] for o in offs]
        axes[2].plot(offs, d, style, label=name)
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))  # offsets are whole numbers
    axes[2].set(xlabel="offset r", ylabel="||a[r] - a[r-1]||", title="Row-to-row change (causal: offsets <= 0 used)")
    axes[2].grid(alpha=0.3)
    axes[2].legend()
    return fig


def plot_run(result, config: TransformerConfig, initial_table: torch.Tensor | None) -> list[Path]:
    """Save loss_curve.png, val_loss_vs_context.png and (relative positions, K >= 2) key_table.png of a
    :class:`~relattn.training.recipe.TrainResult` into its ``out`` folder; returns the paths."""
    out, metrics = result.out, result.metrics
    paths = [save_figure(loss_curve_figure(metrics, config), out / "loss_curve.png"),
             save_figure(context_figure(metrics, config), out / "val_loss_vs_context.png")]
    trained = first_key_table(result.model)
    if trained is not None and config.max_relative_position >= 2:  # the row-to-row comparison needs K >= 2
        fig = key_table_figure(trained, initial_table, config.max_relative_position, metrics.get("key_table"))
        paths.append(save_figure(fig, out / "key_table.png"))
    return paths


__all__ = ["HEADROOM", "UNIFORM_LOSS", "context_figure", "key_table_figure", "loss_curve_figure", "plot_run"]
