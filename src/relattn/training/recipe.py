"""The training loop as a recipe: :class:`TrainingRecipe` holds one run's state (``setup``, ``step``,
``evaluate``, ``save_checkpoint``, ``resume``, ``train``, ``cleanup``).

Determinism: the batch of step ``s`` is drawn from ``(seed, s)`` alone, and dropout's RNG is reseeded
from ``(seed, s, rank)`` at every step, so a resumed run replays exactly the uninterrupted one. Under
``torchrun`` each rank takes its slice of the global batch, gradients are averaged by
DistributedDataParallel, and only rank 0 writes.
"""

from __future__ import annotations

import gc
import hashlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .._io import check_output_dir
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune,
    restore,
    save_checkpoint,
    set_rng_state,
)
from .data import ByteData, get_batch, load_corpus, step_seed
from .evaluation import eval_plan, evaluate, first_key_table
from .model import TransformerConfig, TransformerLM
from .options import TrainOptions, UsageError
from .parallel import (
    Dist,
    check_parallel,
    context_parallel_group,
    data_parallel,
    data_parallel_wrapper,
    full_copies,
    fully_shard_model,
    leave_process_group,
    optimizer_for,
    parameter_groups,
)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class TrainResult:
    model: TransformerLM
    metrics: dict
    out: Path
    train_loss: list = field(default_factory=list)


def lr_at(step: int, options: TrainOptions) -> float:
    """Learning rate of the update that completes step ``step + 1``: linear warm-up, then cosine to lr/10."""
    warmup = options.warmup_steps
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def run_device(options: TrainOptions) -> str:
    """The device type a run of ``options`` trains on: "cuda" when asked for, or "auto" with CUDA available."""
    return "cuda" if options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available()) else "cpu"


def check_run(config: TransformerConfig, options: TrainOptions) -> None:
    """Everything about a run that can be refused before any work: the options' ranges, then every reason the
    model's attention backend will refuse its calls (from the backend's ``Serves`` declaration: device, dropout,
    head dim; a missing package), as one :class:`UsageError` naming ``--backend``."""
    from ..backends import why_not

    options.validate()
    why = why_not(config.backend, device=run_device(options), dtype=torch.float32, dropout=config.dropout > 0,
                  head_dim=config.d_model // config.n_heads)
    if why:
        raise UsageError(f"--backend {config.backend} cannot train this model: {'; '.join(why)}")


def fresh_model(config: TransformerConfig, seed: int) -> TransformerLM:
    """The untrained model of a run: ``TransformerLM(config)`` initialised from ``seed``."""
    torch.manual_seed(seed)
    return TransformerLM(config)


class TrainingRecipe:
    """One training run of ``config`` as ``options`` say.

    ``setup()`` checks everything and builds the run (data, model, optimizer, a checkpoint to resume,
    the process group under torchrun); ``train()`` runs the remaining steps and the final evaluation;
    ``cleanup()`` leaves the process group (safe to call whether or not ``setup()`` got that far).
    ``step(s)``, ``evaluate(length, total)`` and ``save_checkpoint(s)`` are its parts, usable on their own.
    """

    def __init__(self, config: TransformerConfig, options: TrainOptions):
        self.config, self.options = config, options
        self.start, self.train_loss, self.val_loss = 0, [], []
        self.prior_s, self.train_s, self.session_tokens = 0.0, 0.0, 0
        self.resumed_from: str | None = None

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Everything before the first step. Bad inputs raise :class:`UsageError`,
        :class:`~relattn.training.data.DataError`, :class:`~relattn.training.checkpoint.CheckpointError` or
        :class:`~relattn._io.OutputPathError` here, before any training."""
        config, options = self.config, self.options
        check_run(config, options)
        self.out = check_output_dir(options.out)
        raw, data_name = load_corpus(options.data)
        self.data = ByteData.from_bytes(raw, context=config.context, val_fraction=options.val_fraction,
                                        name=data_name)
        self.data_sha = hashlib.sha256(raw).hexdigest()
        self.dist = dist = Dist.from_env()
        check_parallel(config, options, dist)
        if options.batch_size % self.data_parallel[1]:
            raise UsageError(f"--batch-size {options.batch_size} must be divisible by the number of processes "
                             f"({dist.world_size})" + (f" over --context-parallel {options.context_parallel}"
                                                        if options.context_parallel > 1 else ""))
        self.eval_total, self.eval_lengths, self.contexts_skipped = eval_plan(len(self.data.val), config.context,
                                                                              options.eval_tokens)
        # validation at the training context during training: up to 4096 bytes
        self.eval_during = min((len(self.data.val) - 1) // config.context,
                               max(1, 4096 // config.context)) * config.context
        self.ckpt_dir = self.out / "checkpoints"
        ckpt = self._checkpoint_to_resume()

        self.device = torch.device("cpu") if run_device(options) == "cpu" else \
            torch.device("cuda", dist.local_rank if dist.enabled else torch.cuda.current_device())
        self.model = fresh_model(config, options.seed)
        self.initial_table = first_key_table(self.model)
        self.model.to(self.device)
        self.optimizer = optimizer_for(self.model, options)
        if ckpt is not None:
            self.resume(ckpt)
        if dist.enabled:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.cp = context_parallel_group(dist, options)
        self.wrapped = self.model  # what a step calls: the model, or its DistributedDataParallel wrapper
        if options.fsdp:
            self.optimizer = fully_shard_model(self.model, self.optimizer, options, self.device)
        elif dist.enabled:
            self.wrapped = data_parallel_wrapper(self.model, self.device)

    def _say(self, *args) -> None:
        if self.dist.main:
            print(*args)

    def _checkpoint_to_resume(self) -> Checkpoint | None:
        """The checkpoint that ``options.resume`` names (or None), saying which on rank 0."""
        resume, ckpt_dir = self.options.resume, self.ckpt_dir
        if resume is None:
            existing = list_checkpoints(ckpt_dir)
            if existing:
                raise UsageError(f"{ckpt_dir} already holds checkpoints (latest {existing[0].name}); pass --resume "
                                 f"to continue that run, or choose another --out")
            return None
        if resume != "latest":
            ckpt = load_checkpoint(resume)
        else:
            ckpt, refused = latest_checkpoint(ckpt_dir)
            for line in refused:
                print(f"relattn train: warning: refusing {line}", file=sys.stderr)
            if ckpt is None:
                if refused:
                    raise CheckpointError(f"no valid checkpoint in {ckpt_dir} (all {len(refused)} refused)")
                self._say(f"resume: no checkpoint in {ckpt_dir}, starting from step 0")
                return None
        self._say(f"resume: continuing from {ckpt.path} (step {ckpt.step})")
        return ckpt

    # ------------------------------------------------------------------------------------------------ resume

    def resume(self, ckpt: Checkpoint) -> None:
        """Continue from ``ckpt``: refuse one of another model or run, then restore weights, optimizer, RNG, history."""
        saved = ckpt.meta.get("config", {})
        mine = self.config.to_dict()
        for key in sorted(set(saved) | set(mine)):
            if saved.get(key) != mine.get(key):
                raise CheckpointError(f"checkpoint {ckpt.path} was trained with {key}={saved.get(key)!r}, "
                                      f"this run asks for {mine.get(key)!r} (drop the option or use another --out)")
        saved_opts = ckpt.meta.get("options", {})
        mine_opts = {**asdict(self.options), "data_sha256": self.data_sha}
        for key in TrainOptions.FIXED:
            if saved_opts.get(key) != mine_opts.get(key):
                what = "the training data" if key == "data_sha256" else f"{key}={saved_opts.get(key)!r}"
                raise CheckpointError(f"checkpoint {ckpt.path} was trained with {what}; this run differs "
                                      f"({mine_opts.get(key)!r})")
        restore(ckpt, self.model, self.optimizer)
        set_rng_state(ckpt.meta["rng"])
        self.start = ckpt.step
        self.train_loss, self.val_loss = ckpt.meta["train_loss"], ckpt.meta["val_loss"]
        self.prior_s = ckpt.meta.get("train_seconds", 0.0)
        self.resumed_from = str(ckpt.path)

    # ------------------------------------------------------------------------------------------------ the loop

    @property
    def options_record(self) -> dict:
        """The options as stored in checkpoints and metrics.json, with the data's name and hash."""
        return {**asdict(self.options), "data_sha256": self.data_sha, "data_name": self.data.name}

    def step(self, step: int) -> float:
        """One optimizer step: the update that completes step ``step + 1``. Returns its (rank-averaged) loss."""
        options, dist = self.options, self.dist
        t0 = time.perf_counter()
        torch.manual_seed(step_seed(options.seed, step) + 104_729 * dist.rank)  # dropout: a function of the step
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, options)
        x, y = self.batch(step)
        logits = self.wrapped(x.to(self.device), **({} if self.cp is None else {"context_parallel": self.cp}))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(self.device).flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if options.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), options.grad_clip)
        self.optimizer.step()
        loss = loss.detach()
        if dist.enabled:
            torch.distributed.all_reduce(loss)
            loss /= dist.world_size
        value = loss.item()
        self.train_s += time.perf_counter() - t0
        self.session_tokens += options.batch_size * self.config.context
        if not math.isfinite(value):
            raise TrainingDiverged(f"loss became {value} at step {step + 1}; try a smaller --lr")
        self.train_loss.append([step + 1, value])
        return value

    def evaluate(self, length: int, total: int) -> float:
        """Validation loss (nats/byte) of the first ``total`` validation predictions in windows of ``length``."""
        # FSDP: every rank scores every window (its forward passes gather parameters: the ranks go in step)
        return evaluate(self.model, self.data.val, length, total, dist=None if self.options.fsdp else self.dist)

    def save_checkpoint(self, step: int) -> None:
        """Write the checkpoint of ``step`` (rank 0 only) and prune old ones."""
        model, optimizer = self.full_copies() if self.options.fsdp else (self.model, self.optimizer)
        if self.dist.main:
            meta = {"config": self.config.to_dict(), "options": self.options_record, "train_loss": self.train_loss,
                    "val_loss": self.val_loss,
                    "data": {"sampler": "batch of step s drawn from (seed, s)", "next_step": step},
                    "train_seconds": self.prior_s + self.train_s}
            save_checkpoint(self.ckpt_dir, step, model, optimizer, meta)
            prune(self.ckpt_dir, self.options.keep_checkpoints)

    def train(self) -> TrainResult:
        """Run the steps from the resumed one up to ``options.steps``, then evaluate; returns the result."""
        from tqdm.auto import tqdm

        config, options, dist = self.config, self.options, self.dist
        if dist.main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            prune(self.ckpt_dir, options.keep_checkpoints)
        self._say(f"relattn train: {self.model.num_parameters():,} parameters, positions={config.positions}, "
                  f"context {config.context}, corpus {self.data.name} ({len(self.data.train):,} train / "
                  f"{len(self.data.val):,} validation bytes), {options.steps} steps of "
                  f"{options.batch_size * config.context:,} bytes, device {self.device}"
                  + (f", {dist.world_size} processes" if dist.enabled else ""))
        bar = tqdm(total=options.steps, initial=self.start, unit="step", dynamic_ncols=True, mininterval=0.5,
                   disable=not (options.progress and dist.main), file=sys.stderr)
        self.model.train()
        for step in range(self.start, options.steps):
            value = self.step(step)
            speed = f"{self.session_tokens / self.train_s:,.0f} tok/s"
            bar.update(1)
            bar.set_postfix_str(f"loss {value:.3f}, {speed}", refresh=False)
            done = step + 1
            if options.eval_every and done % options.eval_every == 0 and done < options.steps:
                self.val_loss.append([done, self.evaluate(config.context, self.eval_during)])
                bar.set_postfix_str(f"loss {value:.3f}, val {self.val_loss[-1][1]:.3f}, {speed}", refresh=False)
            if done % options.checkpoint_every == 0 or done == options.steps:
                self.save_checkpoint(done)
        bar.close()
        if self.start >= options.steps:
            self._say(f"checkpoint is already at step {self.start} >= --steps {options.steps}; evaluating it")
        metrics = self.final_metrics()
        return TrainResult(self.full_copies()[0] if self.options.fsdp else self.model, metrics, self.out,
                           self.train_loss)

    def final_metrics(self) -> dict:
        """Validation loss at every evaluation context and the run's record, as written to metrics.json."""
        config, options = self.config, self.options
        by_context = {str(n): self.evaluate(n, self.eval_total) for n in self.eval_lengths}
        last = max(self.start, options.steps)
        if not self.val_loss or self.val_loss[-1][0] != last:
            self.val_loss.append([last, self.evaluate(config.context, self.eval_during)])
        tail = [v for _, v in self.train_loss[-50:]]
        return {
            "steps": last,
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "val_loss_by_context": by_context,
            "val_eval_bytes": self.eval_total,
            "contexts_skipped_val_too_short": self.contexts_skipped,
            "final_train_loss": sum(tail) / len(tail) if tail else None,
            "final_train_loss_steps": len(tail),
            "final_val_loss": by_context[str(config.context)],
            "tokens_per_s": (self.session_tokens / self.train_s) if self.train_s > 0 else None,
            "train_seconds": self.prior_s + self.train_s,
            "parameters": self.model.num_parameters(),
            "config": config.to_dict(),
            "options": self.options_record,
            "data": {"name": self.data.name, "train_bytes": len(self.data.train), "val_bytes": len(self.data.val)},
            "device": str(self.device),
            "world_size": self.dist.world_size,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "resumed_from": self.resumed_from,
        }

    # ------------------------------------------------------------------------------------------------ parallelism

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(index, count) of this rank's data-parallel group (see :mod:`relattn.training.parallel`)."""
        return data_parallel(self.dist, self.options)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets of step ``step``: its data-parallel group's rows of the global batch,
        and under context parallelism its part of each sequence."""
        index, count = self.data_parallel
        x, y = get_batch(self.data.train, step=step, seed=self.options.seed, batch_size=self.options.batch_size,
                         context=self.config.context, rank=index, world_size=count)
        if self.cp is not None:
            x, y = self.cp.shard(x, dim=1), self.cp.shard(y, dim=1)
        return x, y

    def full_copies(self) -> tuple[TransformerLM, torch.optim.Optimizer]:
        """An FSDP run's model and optimizer as plain ones holding the full state (every rank calls it)."""
        return full_copies(self.model, self.optimizer, self.config, self.options, self.device)

    def _release_parallel(self) -> None:
        """Drop what holds the process group (the sharded model, the context-parallel group) before it is left."""
        if getattr(self, "options", None) is not None and self.options.fsdp and hasattr(self, "model"):
            self.model = self.wrapped = self.optimizer = None
            gc.collect()
        self.cp = None

    def cleanup(self, *, finished: bool = False) -> None:
        """Leave the process group of a distributed run (safe to call whether or not ``setup()`` got that far).

        The DistributedDataParallel wrapper goes first: its reducer holds the process group, and a reducer freed
        after ``destroy_process_group()`` (when the recipe is dropped) joins gloo's threads in its destructor and
        can hang the process at exit. ``finished=True`` (every rank completed ``train()``) also waits for the
        other ranks first, so none tears the group down while another still uses it; after a failure there is
        no such wait, since the other ranks may never arrive.
        """
        if getattr(self, "dist", None) is None or not self.dist.enabled or not torch.distributed.is_initialized():
            return

        def release():
            self._release_parallel()
            self.wrapped = getattr(self, "model", None)

        leave_process_group(finished=finished, release=release)


__all__ = ["Dist", "TrainResult", "TrainingDiverged", "TrainingRecipe", "check_run", "fresh_model", "lr_at",
           "parameter_groups", "run_device"]
