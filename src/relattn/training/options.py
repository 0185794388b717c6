"""How to train: :class:`TrainOptions`, the options of ``relattn train`` apart from the model's sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class UsageError(ValueError):
    """Bad command-line values: reported as one line, exit status 2."""


@dataclass
class TrainOptions:
    """How to train (the model's own sizes are in :class:`~relattn.training.model.TransformerConfig`)."""

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
    context_parallel: int = 1
    """Under torchrun: ranks each sequence is split over (context parallelism, a ring of keys and values); the
    world is ``context_parallel`` x data-parallel groups."""
    fsdp: bool = False
    """Under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP2, ``fully_shard``)
    instead of replicating them (DistributedDataParallel)."""

    # Fields that must match a checkpoint's for a resumed run to continue the same run.
    FIXED = ("data_sha256", "batch_size", "lr", "weight_decay", "grad_clip", "seed", "val_fraction")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, self.steps // 10)

    def validate(self) -> None:
        """Raise :class:`UsageError` naming the first option (as its command-line flag) that is out of range."""
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
        if not self.weight_decay >= 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip >= 0:  # no flag: set in TrainOptions only
            raise UsageError(f"TrainOptions.grad_clip must be >= 0, got {self.grad_clip}")
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
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise UsageError(f"--context-parallel must be a positive integer, got {cp!r}")


__all__ = ["TrainOptions", "UsageError"]
