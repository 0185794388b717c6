"""Command-line plumbing shared by ``relattn train`` and ``relattn compare``: their options, with defaults and
help taken from :class:`~relattn.training.model.TransformerConfig` and :class:`~relattn.training.options.TrainOptions`,
and one error policy (one line on stderr, exit status 2)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

from .._io import OutputPathError
from ..backends import BACKENDS
from .checkpoint import CheckpointError, list_checkpoints
from .data import DataError
from .model import POSITIONS, TransformerConfig
from .options import TrainOptions, UsageError
from .recipe import TrainingDiverged

MODEL_ARGS = {  # CLI flag (argparse dest) -> TransformerConfig field
    "context": "context", "d_model": "d_model", "heads": "n_heads", "layers": "n_layers", "d_ff": "d_ff",
    "dropout": "dropout", "max_relative_position": "max_relative_position", "positions": "positions",
    "share_heads": "share_heads", "relative_values": "relative_values", "backend": "backend",
    "tie_embeddings": "tie_embeddings",
}
OPTION_ARGS = tuple(f.name for f in fields(TrainOptions))
_NOT_FROM_CHECKPOINT = ("out", "resume", "progress", "plots",  # about this invocation, not the run
                        "context_parallel", "fsdp")


def add_model_arguments(p: argparse.ArgumentParser, *, leave_out: tuple[str, ...] = ()) -> None:
    """The model options (all default to None: "the config's default, or the checkpoint's when resuming");
    ``leave_out`` names flags (argparse dests) a command sets itself."""
    d = TransformerConfig()
    g = p.add_argument_group("model (defaults from TransformerConfig)")
    bool_flag = argparse.BooleanOptionalAction
    specs = {
        "positions": dict(choices=POSITIONS, help=f"default: {d.positions}"),
        "context": dict(type=int, help=f"training context in bytes (default: {d.context})"),
        "d_model": dict(type=int, help=f"default: {d.d_model}"),
        "heads": dict(type=int, help=f"default: {d.n_heads}"),
        "layers": dict(type=int, help=f"default: {d.n_layers}"),
        "d_ff": dict(type=int, help=f"default: {d.d_ff}"),
        "dropout": dict(type=float, help=f"default: {d.dropout}"),
        "max_relative_position": dict(type=int, help=f"K (default: {d.max_relative_position})"),
        "share_heads": dict(action=bool_flag, help=f"one relative table shared by all heads (default: "
                                                   f"{d.share_heads})"),
        "relative_values": dict(action=bool_flag, help=f"learn the value-side table too (default: "
                                                       f"{d.relative_values})"),
        "tie_embeddings": dict(action=bool_flag, help=f"default: {d.tie_embeddings}"),
        "backend": dict(choices=("auto", *BACKENDS), help=f"attention backend (default: {d.backend})"),
    }
    for dest, spec in specs.items():
        if dest not in leave_out:
            g.add_argument("--" + dest.replace("_", "-"), default=None, **spec)


def add_train_arguments(p: argparse.ArgumentParser, defaults: TrainOptions) -> None:
    """The training options every training command takes; help shows ``defaults``, the values the command uses."""
    d = defaults
    p.add_argument("--data", default=None, help="UTF-8 text file (default: pydoc_data.topics, shipped with Python)")
    p.add_argument("--steps", type=int, default=None, help=f"default: {d.steps}")
    p.add_argument("--batch-size", type=int, default=None, help=f"global batch (default: {d.batch_size})")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps (default: min(100, steps // 10))" if d.warmup is None else
                   f"warm-up steps (default: {d.warmup})")
    p.add_argument("--weight-decay", type=float, default=None, help=f"default: {d.weight_decay}")
    p.add_argument("--seed", type=int, default=None, help=f"default: {d.seed}")
    p.add_argument("--eval-every", type=int, default=None, help=f"default: {d.eval_every}")
    p.add_argument("--eval-tokens", type=int, default=None, help=f"validation bytes at the end (default: "
                                                                 f"{d.eval_tokens})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help=f"default: {d.device}")
    p.add_argument("--out", default=d.out, help="output folder (default: %(default)s)")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)


def configs_from_args(args: argparse.Namespace, defaults: TrainOptions) -> tuple[TransformerConfig, TrainOptions]:
    """The config and options of a parsed command line: what it gives, over (with ``--resume``) the stored
    run's values, over ``defaults``; so ``relattn train --resume --out DIR`` continues the run in ``DIR``."""
    given_model = {f: getattr(args, a) for a, f in MODEL_ARGS.items() if getattr(args, a, None) is not None}
    given_opts = {a: getattr(args, a) for a in OPTION_ARGS if getattr(args, a, None) is not None}
    base_model, base_opts = {}, {}
    resume = given_opts.get("resume")
    if resume is not None:
        paths = [Path(resume)] if resume != "latest" else \
            list_checkpoints(Path(given_opts.get("out", defaults.out)) / "checkpoints")
        for path in paths:  # the newest readable record; the recipe verifies the checkpoint itself
            try:
                meta = json.loads(path.read_text(encoding="utf-8"))
                base_model = dict(meta["config"])
                base_opts = {k: v for k, v in meta["options"].items() if k in OPTION_ARGS and
                             k not in _NOT_FROM_CHECKPOINT}
                break
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
    try:
        config = TransformerConfig(**{**base_model, **given_model})
    except (TypeError, ValueError) as e:
        msg = str(e)
        for arg, fname in MODEL_ARGS.items():
            msg = re.sub(rf"\b{fname}\b", "--" + arg.replace("_", "-"), msg)
        raise UsageError(msg) from None
    return config, replace(defaults, **{**base_opts, **given_opts})


def run_command(args: argparse.Namespace, body) -> int:
    """Run ``body()``; expected failures become one line on stderr and exit status 2 (1 for divergence). Under
    torchrun every rank meets the same error and exits with the same status, and rank 0 alone says it."""
    def say(message: str) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(f"relattn {args.command}: {message}", file=sys.stderr)

    try:
        body()
    except (DataError, UsageError, CheckpointError, OutputPathError) as e:
        say(f"error: {e}")
        return 2
    except TrainingDiverged as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; rerun with --resume to continue from the last checkpoint")
        return 130
    return 0


def add_parallel_arguments(p: argparse.ArgumentParser, defaults: TrainOptions) -> None:
    """How a torchrun run splits its work: context parallelism and FSDP2 (docs/distributed.md)."""
    g = p.add_argument_group("parallelism (under torchrun; docs/distributed.md)")
    g.add_argument("--context-parallel", type=int, default=None, metavar="P",
                   help=f"split each sequence over P ranks, keys and values passed around a ring (the world is P "
                        f"x data-parallel groups; default: {defaults.context_parallel})")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard parameters, gradients and optimizer state over the ranks (FSDP2) instead of DDP")


__all__ = ["add_model_arguments", "add_parallel_arguments", "add_train_arguments", "configs_from_args",
           "run_command"]
