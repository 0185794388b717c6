"""``relattn train``: a byte-level language model with relative (or absolute, or no) positions.

The library entry point is :func:`train` (a :class:`~relattn.model.TransformerConfig` and a
:class:`TrainOptions`); the command only parses arguments into those two. Under ``torchrun`` the same
function trains with DistributedDataParallel: ``--batch-size`` is the *global* batch, each rank takes
its slice of it, gradients are averaged, and only rank 0 writes checkpoints, metrics and plots; the
run therefore follows the single-process run with the same global batch.

Determinism: the batch of step ``s`` is drawn from ``(seed, s)`` alone, and dropout's RNG is reseeded
from ``(seed, s, rank)`` at every step, so a resumed run replays exactly the uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ._io import atomic_write_text
from .checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune,
    restore,
    save_checkpoint,
    set_rng_state,
)
from .data import ByteData, DataError, eval_windows, get_batch, load_corpus, step_seed
from .model import POSITIONS, TransformerConfig, TransformerLM

CONTEXT_FACTORS = (1, 2, 4, 8)


class UsageError(ValueError):
    """Bad command-line values: reported as one line, exit status 2."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class TrainOptions:
    """How to train (the model's own sizes are in :class:`~relattn.model.TransformerConfig`)."""

    out: str = "relattn-runs/train"
    """Folder for checkpoints/, metrics.json, the PNGs and sample.txt."""
    data: str | None = None
    """UTF-8 text file; None for the Python reference documentation in ``pydoc_data.topics``."""
    steps: int = 1000
    """Optimizer steps in total (a resumed run continues up to this)."""
    batch_size: int = 32
    """Global batch in windows of ``context`` bytes; split evenly across DDP ranks."""
    lr: float = 2e-3
    """Peak AdamW learning rate, reached after ``warmup`` steps, then cosine decay to ``lr / 10``."""
    warmup: int | None = None
    """Linear warm-up steps; None for ``min(100, steps // 10)``."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on the linear layers' weights only (not embeddings, norms, biases or tables)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 to disable)."""
    seed: int = 0
    """Seeds the initialisation, the batches and dropout."""
    val_fraction: float = 0.1
    """The last fraction of the corpus is held out for validation."""
    checkpoint_every: int = 250
    """Write a checkpoint every this many steps (and always at the end)."""
    keep_checkpoints: int = 3
    """Keep this many newest checkpoints."""
    eval_every: int = 100
    """Validation loss at the training context every this many steps (0: only at the end)."""
    eval_tokens: int = 16384
    """Validation bytes scored at the end, the same bytes at every evaluation context."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (CUDA when available). Under torchrun each rank uses cuda:LOCAL_RANK."""
    resume: str | None = None
    """None: start fresh. "latest": continue from the newest valid checkpoint in ``out`` if any. Else a path."""
    sample_bytes: int = 400
    """Bytes to generate at the end (0: none)."""
    prompt: str = "The "
    temperature: float = 0.8
    top_k: int | None = 40
    plots: bool = True
    progress: bool = True

    # Fields that must match a checkpoint's for a resumed run to continue the same run.
    FIXED = ("data_sha256", "batch_size", "lr", "weight_decay", "grad_clip", "seed", "val_fraction")

    def validate(self) -> None:
        positive = ("steps", "batch_size", "checkpoint_every", "keep_checkpoints", "eval_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("eval_every", "sample_bytes"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.warmup is not None and self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise UsageError(f"--lr must be a positive number, got {self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise UsageError("--weight-decay and --grad-clip must be >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device must be auto, cpu or cuda; got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and not 1 <= self.top_k <= 256:
            raise UsageError(f"--top-k must be in [1, 256], got {self.top_k}")


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass
class TrainResult:
    model: TransformerLM
    metrics: dict
    out: Path
    train_loss: list = field(default_factory=list)


def _dist_from_env() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    return Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")), True)


def _device(options: TrainOptions, dist: Dist) -> torch.device:
    use_cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", dist.local_rank if dist.enabled else torch.cuda.current_device())


def lr_at(step: int, options: TrainOptions) -> float:
    """Learning rate of the update that completes step ``step + 1``: linear warm-up, then cosine to lr/10."""
    warmup = options.warmup if options.warmup is not None else min(100, options.steps // 10)
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def parameter_groups(model: TransformerLM, weight_decay: float) -> list[dict]:
    """Weight decay on linear weights only: relative tables must not decay, the causal LM never updates
    their future rows, and decaying those would fake 'learned' structure."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_table = name.endswith(("rel_k", "rel_v"))
        (decay if p.dim() == 2 and not is_table and not name.startswith("embed") else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model: TransformerLM, val: torch.Tensor, length: int, total: int, *, device, dist: Dist,
             max_tokens_per_batch: int = 8192) -> float:
    """Mean loss (nats per byte) over the first ``total`` validation predictions in windows of ``length``."""
    x, y = eval_windows(val, length, total)
    rows = torch.arange(dist.rank, x.shape[0], dist.world_size)
    per_batch = max(1, max_tokens_per_batch // length)
    was_training = model.training
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(rows), per_batch):
        idx = rows[i:i + per_batch]
        logits = model(x[idx].to(device))
        acc[0] += F.cross_entropy(logits.flatten(0, 1).float(), y[idx].to(device).flatten(), reduction="sum").double()
        acc[1] += idx.numel() * length
    model.train(was_training)
    if dist.enabled:
        torch.distributed.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def eval_plan(val_len: int, context: int, budget: int) -> tuple[int, list[int], list[int]]:
    """Bytes to score and which context lengths (1x, 2x, 4x, 8x context) fit in the validation split."""
    for i in range(len(CONTEXT_FACTORS) - 1, -1, -1):
        unit = CONTEXT_FACTORS[i] * context
        total = min((val_len - 1) // unit, max(1, budget // unit)) * unit
        if total > 0:
            lengths = [f * context for f in CONTEXT_FACTORS[: i + 1]]
            return total, lengths, [f * context for f in CONTEXT_FACTORS[i + 1:]]
    raise DataError(f"validation split ({val_len} bytes) is shorter than the context ({context})")


def key_table_stats(trained: torch.Tensor, initial: torch.Tensor, k: int, band: int = 4) -> dict:
    """How sharp the key-side table is near offset 0 compared with the clipped edge ``-K``.

    ``adjacent[r]`` is ``||a[r] - a[r-1]||`` for offsets r = -K+1 .. 0 (rows for positive offsets are
    never used by a causal LM). The spec predicts larger row-to-row variation near 0 than at ``-K``
    after training; at initialisation (i.i.d. rows) the two are equal in expectation. Per-head tables
    (H, 2K+1, D) are averaged over heads.
    """
    def adjacent(t):
        t = t if t.dim() == 3 else t[None]
        return (t[:, 1:k + 1] - t[:, :k]).norm(dim=-1).mean(0)  # offsets -K+1..0

    band = max(1, min(band, k // 2))
    out = {"max_relative_position": k, "band": band}
    for name, t in (("trained", trained), ("initial", initial)):
        d = adjacent(t.float())
        near, far = d[-band:].mean().item(), d[:band].mean().item()
        out[name] = {"adjacent_distance_by_offset": {str(o): round(v, 5) for o, v in zip(range(-k + 1, 1), d.tolist(),
                                                                                             strict=True)},
                     "near_zero": near, "near_minus_k": far, "ratio": near / far if far > 0 else float("inf")}
    future = (trained.float() - initial.float())[..., k + 1:, :]
    out["future_rows_max_change"] = future.abs().max().item() if future.numel() else 0.0
    # "holds" needs a margin: i.i.d. rows give ratios around 1 that wander by ~10-20% at small K.
    out["prediction_holds"] = out["trained"]["ratio"] > 1.25 * max(1.0, out["initial"]["ratio"])
    return out


def _first_key_table(model: TransformerLM) -> torch.Tensor | None:
    table = model.encoder.blocks[0].attn.rel_k
    return None if table is None else table.detach().cpu().clone()


def _fresh_model(config: TransformerConfig, seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(config)


def _check_resume_fit(ckpt, config: TransformerConfig, options: TrainOptions, data_sha: str) -> None:
    saved = ckpt.meta.get("config", {})
    mine = config.to_dict()
    for key in sorted(set(saved) | set(mine)):
        if saved.get(key) != mine.get(key):
            raise CheckpointError(f"checkpoint {ckpt.path} was trained with {key}={saved.get(key)!r}, "
                                  f"this run asks for {mine.get(key)!r} (drop the option or use another --out)")
    saved_opts = ckpt.meta.get("options", {})
    mine_opts = {**asdict(options), "data_sha256": data_sha}
    for key in TrainOptions.FIXED:
        if saved_opts.get(key) != mine_opts.get(key):
            what = "the training data" if key == "data_sha256" else f"{key}={saved_opts.get(key)!r}"
            raise CheckpointError(f"checkpoint {ckpt.path} was trained with {what}; this run differs "
                                  f"({mine_opts.get(key)!r})")


def _select_checkpoint(options: TrainOptions, ckpt_dir: Path, dist: Dist):
    """The checkpoint to resume from (or None), saying which on rank 0."""
    say = print if dist.main else (lambda *a, **k: None)
    if options.resume is None:
        existing = list_checkpoints(ckpt_dir)
        if existing:
            raise UsageError(f"{ckpt_dir} already holds checkpoints (latest {existing[0].name}); pass --resume "
                             f"to continue that run, or choose another --out")
        return None
    if options.resume != "latest":
        ckpt = load_checkpoint(options.resume)
    else:
        ckpt, refused = latest_checkpoint(ckpt_dir)
        for line in refused:
            print(f"relattn train: warning: refusing {line}", file=sys.stderr)
        if ckpt is None:
            if refused:
                raise CheckpointError(f"no valid checkpoint in {ckpt_dir} (all {len(refused)} refused)")
            say(f"resume: no checkpoint in {ckpt_dir}, starting from step 0")
            return None
    say(f"resume: continuing from {ckpt.path} (step {ckpt.step})")
    return ckpt


def train(config: TransformerConfig, options: TrainOptions) -> TrainResult:
    """Train a :class:`TransformerLM` of ``config`` as ``options`` say; see the module docstring.

    Raises :class:`relattn.data.DataError`, :class:`UsageError` or
    :class:`relattn.checkpoint.CheckpointError` for bad inputs (before any training), and
    :class:`TrainingDiverged` if the loss stops being finite.
    """
    options.validate()
    raw, data_name = load_corpus(options.data)
    data = ByteData.from_bytes(raw, context=config.context, val_fraction=options.val_fraction, name=data_name)
    data_sha = hashlib.sha256(raw).hexdigest()
    dist = _dist_from_env()
    if options.batch_size % dist.world_size:
        raise UsageError(f"--batch-size {options.batch_size} must be divisible by the number of processes "
                         f"({dist.world_size})")
    eval_total, eval_lengths, skipped = eval_plan(len(data.val), config.context, options.eval_tokens)
    out = Path(options.out)
    ckpt_dir = out / "checkpoints"
    ckpt = _select_checkpoint(options, ckpt_dir, dist)

    device = _device(options, dist)
    model = _fresh_model(config, options.seed)
    initial_table = _first_key_table(model)
    model.to(device)
    optimizer = torch.optim.AdamW(parameter_groups(model, options.weight_decay), lr=options.lr, betas=(0.9, 0.95))
    start, train_loss, val_loss, prior_s = 0, [], [], 0.0
    if ckpt is not None:
        _check_resume_fit(ckpt, config, options, data_sha)
        restore(ckpt, model, optimizer)
        set_rng_state(ckpt.meta["rng"])
        start = ckpt.step
        train_loss, val_loss = ckpt.meta["train_loss"], ckpt.meta["val_loss"]
        prior_s = ckpt.meta.get("train_seconds", 0.0)

    if dist.enabled:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _run(config, options, data, data_sha, dist, device, model, optimizer, start, train_loss, val_loss,
                    prior_s, initial_table, eval_total, eval_lengths, skipped, out, ckpt_dir,
                    None if ckpt is None else str(ckpt.path))
    finally:
        if dist.enabled:
            torch.distributed.destroy_process_group()


def _run(config, options, data, data_sha, dist, device, model, optimizer, start, train_loss, val_loss, prior_s,
         initial_table, eval_total, eval_lengths, skipped, out, ckpt_dir, resumed_from) -> TrainResult:
    from tqdm.auto import tqdm

    wrapped = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    tokens_per_step = options.batch_size * config.context
    val_len_during = min((len(data.val) - 1) // config.context, max(1, 4096 // config.context)) * config.context
    opts_meta = {**asdict(options), "data_sha256": data_sha, "data_name": data.name}

    def checkpoint(step: int) -> None:
        if dist.main:
            meta = {"config": config.to_dict(), "options": opts_meta, "train_loss": train_loss, "val_loss": val_loss,
                    "data": {"sampler": "batch of step s drawn from (seed, s)", "next_step": step},
                    "train_seconds": prior_s + train_s}
            save_checkpoint(ckpt_dir, step, model, optimizer, meta)
            prune(ckpt_dir, options.keep_checkpoints)

    if dist.main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        prune(ckpt_dir, options.keep_checkpoints)
        print(f"relattn train: {model.num_parameters():,} parameters, positions={config.positions}, "
              f"context {config.context}, corpus {data.name} ({len(data.train):,} train / {len(data.val):,} "
              f"validation bytes), {options.steps} steps of {tokens_per_step:,} bytes, device {device}"
              + (f", {dist.world_size} processes" if dist.enabled else ""))
    bar = tqdm(total=options.steps, initial=start, unit="step", dynamic_ncols=True, mininterval=0.5,
               disable=not (options.progress and dist.main), file=sys.stderr)
    train_s, session_tokens = 0.0, 0
    model.train()
    for step in range(start, options.steps):
        t0 = time.perf_counter()
        torch.manual_seed(step_seed(options.seed, step) + 104_729 * dist.rank)  # dropout: a function of the step
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, options)
        x, y = get_batch(data.train, step=step, seed=options.seed, batch_size=options.batch_size,
                         context=config.context, rank=dist.rank, world_size=dist.world_size)
        logits = wrapped(x.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if options.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.grad_clip)
        optimizer.step()
        loss = loss.detach()
        if dist.enabled:
            torch.distributed.all_reduce(loss)
            loss /= dist.world_size
        value = loss.item()
        train_s += time.perf_counter() - t0
        session_tokens += tokens_per_step
        if not math.isfinite(value):
            raise TrainingDiverged(f"loss became {value} at step {step + 1}; try a smaller --lr")
        train_loss.append([step + 1, value])
        bar.update(1)
        bar.set_postfix_str(f"loss {value:.3f}, {session_tokens / train_s:,.0f} tok/s", refresh=False)
        done = step + 1
        if options.eval_every and done % options.eval_every == 0 and done < options.steps:
            val_loss.append([done, evaluate(model, data.val, config.context, val_len_during, device=device,
                                            dist=dist)])
            bar.set_postfix_str(f"loss {value:.3f}, val {val_loss[-1][1]:.3f}, "
                                f"{session_tokens / train_s:,.0f} tok/s", refresh=False)
        if done % options.checkpoint_every == 0 or done == options.steps:
            checkpoint(done)
    bar.close()
    if start >= options.steps and dist.main:
        print(f"checkpoint is already at step {start} >= --steps {options.steps}; evaluating it")

    by_context = {str(n): evaluate(model, data.val, n, eval_total, device=device, dist=dist) for n in eval_lengths}
    final_val = by_context[str(config.context)]
    if not val_loss or val_loss[-1][0] != max(start, options.steps):
        val_loss.append([max(start, options.steps), evaluate(model, data.val, config.context, val_len_during,
                                                             device=device, dist=dist)])
    tail = [v for _, v in train_loss[-50:]]
    metrics = {
        "steps": max(start, options.steps),
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_loss_by_context": by_context,
        "val_eval_bytes": eval_total,
        "contexts_skipped_val_too_short": skipped,
        "final_train_loss_mean_last_50": sum(tail) / len(tail) if tail else None,
        "final_val_loss": final_val,
        "tokens_per_s": (session_tokens / train_s) if train_s > 0 else None,
        "train_seconds": prior_s + train_s,
        "parameters": model.num_parameters(),
        "config": config.to_dict(),
        "options": opts_meta,
        "data": {"name": data.name, "train_bytes": len(data.train), "val_bytes": len(data.val)},
        "device": str(device),
        "world_size": dist.world_size,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "resumed_from": resumed_from,
    }
    if dist.main:
        _report(model, config, options, metrics, initial_table, out, device)
    return TrainResult(model, metrics, out, train_loss)


def _report(model, config, options, metrics, initial_table, out: Path, device) -> None:
    tps = metrics["tokens_per_s"]
    print(f"step {metrics['steps']}: train loss {metrics['final_train_loss_mean_last_50']:.4f} (mean of last 50), "
          f"validation {metrics['final_val_loss']:.4f} nats/byte "
          f"({metrics['final_val_loss'] / math.log(2):.3f} bits/byte), "
          + (f"{tps:,.0f} tokens/s" if tps else "no steps this session"))
    print("validation loss by evaluation context (nats/byte, the same "
          f"{metrics['val_eval_bytes']:,} bytes each): "
          + ", ".join(f"{n}: {v:.4f}" for n, v in metrics["val_loss_by_context"].items()))
    if metrics["contexts_skipped_val_too_short"]:
        print(f"  (skipped, validation split too short: {metrics['contexts_skipped_val_too_short']})")
    if config.positions == "relative" and initial_table is not None and config.max_relative_position >= 2:
        stats = key_table_stats(_first_key_table(model), initial_table, config.max_relative_position)
        metrics["key_table"] = stats
        b, k = stats["band"], config.max_relative_position
        tr, ini = stats["trained"], stats["initial"]
        print(f"key-side table a^K, layer 1: mean distance between adjacent offsets near 0 (offsets {-b}..0) "
              f"{tr['near_zero']:.3f} vs at -K ({-k}..{-k + b}) {tr['near_minus_k']:.3f}: ratio {tr['ratio']:.2f} "
              f"(at initialisation {ini['ratio']:.2f}); spec's prediction of sharper structure near offset 0: "
              f"{'holds' if stats['prediction_holds'] else 'not seen (yet)'}. Rows +1..+{k} (future, masked) "
              f"changed by at most {stats['future_rows_max_change']:.1e}.")
    sample = None
    if options.sample_bytes:
        prompt = torch.tensor(list(options.prompt.encode("utf-8")) or [10], dtype=torch.long, device=device)
        g = torch.Generator(device=device).manual_seed(options.seed)
        ids = model.generate(prompt, options.sample_bytes, temperature=options.temperature, top_k=options.top_k,
                             generator=g)
        sample = bytes(ids.tolist()).decode("utf-8", errors="replace")
        metrics["sample"] = sample
        print(f"--- sample ({options.sample_bytes} bytes, temperature {options.temperature}, top-k {options.top_k}):")
        print(sample)
        print("---")
        atomic_write_text(out / "sample.txt", sample + "\n")
    if options.plots:
        for p in plot_run(metrics, model, config, initial_table, out):
            print(f"saved {p}")
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    print(f"saved {out / 'metrics.json'}")


def plot_run(metrics: dict, model: TransformerLM, config: TransformerConfig, initial_table, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ._io import save_figure

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
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
    paths.append(save_figure(fig, out / "loss_curve.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ctx = [int(c) for c in metrics["val_loss_by_context"]]
    ax.plot(ctx, list(metrics["val_loss_by_context"].values()), "o-", label=config.positions)
    ax.axvline(config.context, color="gray", ls="--", lw=1, label="training context")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [str(c) for c in ctx])
    ax.set(xlabel="evaluation context (bytes)", ylabel="validation loss (nats/byte)",
           title="Validation loss vs context length")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(save_figure(fig, out / "val_loss_vs_context.png"))

    trained = _first_key_table(model)
    if trained is not None and config.max_relative_position >= 2:  # the row-to-row comparison needs K >= 2
        k = config.max_relative_position
        head = "" if trained.dim() == 2 else f" (head 1 of {trained.shape[0]})"
        t_show = trained if trained.dim() == 2 else trained[0]
        i_show = initial_table if initial_table.dim() == 2 else initial_table[0]
        fig, axes = plt.subplots(1, 3, figsize=(15, 5), gridspec_kw={"width_ratios": [1, 1, 0.9]})
        lim = float(max(t_show.abs().max(), i_show.abs().max()))
        labels = [f"{o:+d}" for o in range(-k, k + 1)]
        every = max(1, (2 * k + 1) // 17)
        for ax, t, title in ((axes[0], i_show, "at initialisation"), (axes[1], t_show, "after training")):
            im = ax.imshow(t.float().numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
            ax.set_yticks(range(0, 2 * k + 1, every), labels[::every])
            ax.set(title=f"key table a^K, layer 1{head}: {title}", xlabel="dimension")
        axes[0].set_ylabel("relative offset j - i")
        fig.colorbar(im, ax=axes[1], shrink=0.8)
        stats = metrics.get("key_table") or key_table_stats(trained, initial_table, k)
        offs = list(range(-k + 1, 1))
        for name, style in (("initial", "o--"), ("trained", "o-")):
            d = [stats[name]["adjacent_distance_by_offset"][str(o)] for o in offs]
            axes[2].plot(offs, d, style, label=name)
        axes[2].set(xlabel="offset r", ylabel="||a[r] - a[r-1]||",
                    title="Row-to-row change (causal: offsets <= 0 used)")
        axes[2].grid(alpha=0.3)
        axes[2].legend()
        paths.append(save_figure(fig, out / "key_table.png"))
    return paths


# ----------------------------------------------------------------------------------------------- command line

_MODEL_ARGS = {  # CLI flag -> TransformerConfig field
    "context": "context", "d_model": "d_model", "heads": "n_heads", "layers": "n_layers", "d_ff": "d_ff",
    "dropout": "dropout", "max_relative_position": "max_relative_position", "positions": "positions",
    "share_heads": "share_heads", "relative_values": "relative_values", "backend": "backend",
    "tie_embeddings": "tie_embeddings",
}
_OPTION_ARGS = tuple(f.name for f in fields(TrainOptions))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    d = TransformerConfig()
    g = p.add_argument_group("model (defaults from TransformerConfig)")
    g.add_argument("--positions", choices=POSITIONS, default=None, help=f"default: {d.positions}")
    g.add_argument("--context", type=int, default=None, help=f"training context in bytes (default: {d.context})")
    g.add_argument("--d-model", type=int, default=None, help=f"default: {d.d_model}")
    g.add_argument("--heads", type=int, default=None, help=f"default: {d.n_heads}")
    g.add_argument("--layers", type=int, default=None, help=f"default: {d.n_layers}")
    g.add_argument("--d-ff", type=int, default=None, help=f"default: {d.d_ff}")
    g.add_argument("--dropout", type=float, default=None, help=f"default: {d.dropout}")
    g.add_argument("--max-relative-position", type=int, default=None, help=f"K (default: {d.max_relative_position})")
    g.add_argument("--share-heads", action=argparse.BooleanOptionalAction, default=None,
                   help=f"one relative table shared by all heads (default: {d.share_heads})")
    g.add_argument("--relative-values", action=argparse.BooleanOptionalAction, default=None,
                   help=f"learn the value-side table too (default: {d.relative_values})")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help=f"default: {d.tie_embeddings}")
    g.add_argument("--backend", default=None, help=f"attention backend (default: {d.backend})")


def add_train_arguments(p: argparse.ArgumentParser, *, out_default: str) -> None:
    d = TrainOptions()
    p.add_argument("--data", default=None, help="UTF-8 text file (default: pydoc_data.topics, shipped with Python)")
    p.add_argument("--steps", type=int, default=None, help=f"default: {d.steps}")
    p.add_argument("--batch-size", type=int, default=None, help=f"global batch (default: {d.batch_size})")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: min(100, steps // 10))")
    p.add_argument("--weight-decay", type=float, default=None, help=f"default: {d.weight_decay}")
    p.add_argument("--seed", type=int, default=None, help=f"default: {d.seed}")
    p.add_argument("--eval-every", type=int, default=None, help=f"default: {d.eval_every}")
    p.add_argument("--eval-tokens", type=int, default=None, help=f"validation bytes at the end (default: "
                                                                 f"{d.eval_tokens})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help=f"default: {d.device}")
    p.add_argument("--out", default=out_default, help="output folder (default: %(default)s)")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a byte-level Transformer LM with relative positions",
                       description="Train a byte-level Transformer language model. Under torchrun it uses "
                                   "DistributedDataParallel; --batch-size is then the global batch.")
    add_train_arguments(p, out_default=TrainOptions.out)
    p.add_argument("--checkpoint-every", type=int, default=None, help=f"default: {TrainOptions.checkpoint_every}")
    p.add_argument("--keep-checkpoints", type=int, default=None, help=f"default: {TrainOptions.keep_checkpoints}")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the newest valid checkpoint in OUT/checkpoints (or from CHECKPOINT, a "
                        "step-*.json file); the run's settings come from the checkpoint. A larger --steps trains "
                        "further (the learning-rate schedule then stretches to the new total)")
    p.add_argument("--sample-bytes", type=int, default=None, help=f"default: {TrainOptions.sample_bytes}")
    p.add_argument("--prompt", default=None, help=f"sample prompt (default: {TrainOptions.prompt!r})")
    p.add_argument("--temperature", type=float, default=None, help=f"default: {TrainOptions.temperature}")
    p.add_argument("--top-k", type=int, default=None, help=f"default: {TrainOptions.top_k}")
    add_model_arguments(p)
    p.set_defaults(func=main)


def configs_from_args(args: argparse.Namespace) -> tuple[TransformerConfig, TrainOptions]:
    """The config and options of a parsed command line; with ``--resume``, unspecified values come from the
    checkpoint, so ``relattn train --resume --out DIR`` continues the run stored in ``DIR``."""
    given_model = {f: getattr(args, a) for a, f in _MODEL_ARGS.items() if getattr(args, a, None) is not None}
    given_opts = {a: getattr(args, a) for a in _OPTION_ARGS if getattr(args, a, None) is not None}
    base_model, base_opts = {}, {}
    resume = given_opts.get("resume")
    if resume is not None:
        paths = [Path(resume)] if resume != "latest" else \
            list_checkpoints(Path(given_opts.get("out", TrainOptions.out)) / "checkpoints")
        for path in paths:  # the newest readable record; train() verifies the checkpoint itself
            try:
                meta = json.loads(path.read_text(encoding="utf-8"))
                base_model = dict(meta["config"])
                base_opts = {k: v for k, v in meta["options"].items() if k in _OPTION_ARGS and k not in
                             ("out", "resume", "progress", "plots")}
                break
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
    try:
        config = TransformerConfig(**{**base_model, **given_model})
    except (TypeError, ValueError) as e:
        msg = str(e)
        for arg, fname in _MODEL_ARGS.items():
            msg = re.sub(rf"\b{fname}\b", "--" + arg.replace("_", "-"), msg)
        raise UsageError(msg) from None
    return config, TrainOptions(**{**base_opts, **given_opts})


def run_command(args: argparse.Namespace, body) -> int:
    """Run ``body()``; expected failures become one line on stderr and exit status 2 (1 for divergence)."""
    try:
        body()
    except (DataError, UsageError, CheckpointError) as e:
        print(f"relattn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"relattn {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"relattn {args.command}: interrupted; rerun with --resume to continue from the last checkpoint",
              file=sys.stderr)
        return 130
    return 0


def main(args: argparse.Namespace) -> int:
    return run_command(args, lambda: train(*configs_from_args(args)))


__all__ = ["TrainOptions", "TrainResult", "TrainingDiverged", "UsageError", "evaluate", "key_table_stats", "lr_at",
           "train"]
