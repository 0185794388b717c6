"""``relattn train``: a byte-level language model with relative (or absolute, or no) positions.

The library entry point is :func:`train` (a :class:`~relattn.training.model.TransformerConfig` and a
:class:`TrainOptions`); the command only parses arguments into those two. The work is done by
:class:`~relattn.training.recipe.TrainingRecipe` (the loop, checkpoints, resuming, DDP) and
:func:`~relattn.training.report.report_run` (what rank 0 prints and writes at the end). Under ``torchrun``
``--batch-size`` is the *global* batch, each rank takes its slice of it, gradients are averaged, and
only rank 0 writes checkpoints, metrics and plots; the run therefore follows the single-process run
with the same global batch.
"""

from __future__ import annotations

import argparse

from .arguments import add_model_arguments, add_parallel_arguments, add_train_arguments, configs_from_args, run_command
from .evaluation import eval_plan, evaluate, key_table_stats
from .model import TransformerConfig
from .options import TrainOptions, UsageError
from .recipe import TrainingDiverged, TrainingRecipe, TrainResult, lr_at
from .report import report_run


def train(config: TransformerConfig, options: TrainOptions) -> TrainResult:
    """Train a :class:`~relattn.training.model.TransformerLM` of ``config`` as ``options`` say.

    Raises :class:`~relattn.training.data.DataError`, :class:`UsageError`,
    :class:`~relattn.training.checkpoint.CheckpointError` or :class:`relattn._io.OutputPathError` for bad inputs
    (before any training), and :class:`TrainingDiverged` if the loss stops being finite.
    """
    recipe = TrainingRecipe(config, options)
    finished = False
    try:
        recipe.setup()
        result = recipe.train()
        if recipe.dist.main:
            report_run(recipe, result)
        finished = True
        return result
    finally:
        recipe.cleanup(finished=finished)


def register(sub: argparse._SubParsersAction) -> None:
    d = TrainOptions()
    p = sub.add_parser("train", help="train a byte-level Transformer LM with relative positions",
                       description="Train a byte-level Transformer language model. Under torchrun it uses "
                                   "DistributedDataParallel; --batch-size is then the global batch.")
    add_train_arguments(p, d)
    p.add_argument("--checkpoint-every", type=int, default=None, help=f"default: {d.checkpoint_every}")
    p.add_argument("--keep-checkpoints", type=int, default=None, help=f"default: {d.keep_checkpoints}")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the newest valid checkpoint in OUT/checkpoints (or from CHECKPOINT, a "
                        "step-*.json file); the run's settings come from the checkpoint. A larger --steps trains "
                        "further (the learning-rate schedule then stretches to the new total)")
    p.add_argument("--sample-bytes", type=int, default=None, help=f"default: {d.sample_bytes}")
    p.add_argument("--prompt", default=None, help=f"sample prompt (default: {d.prompt!r})")
    p.add_argument("--temperature", type=float, default=None, help=f"default: {d.temperature}")
    p.add_argument("--top-k", type=int, default=None, help=f"default: {d.top_k}")
    add_model_arguments(p)
    add_parallel_arguments(p, d)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    return run_command(args, lambda: train(*configs_from_args(args, TrainOptions())))


__all__ = ["TrainOptions", "TrainResult", "TrainingDiverged", "UsageError", "eval_plan", "evaluate",
           "key_table_stats", "lr_at", "train"]
