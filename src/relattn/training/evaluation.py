"""Measuring a language model: validation loss per context length, and the structure of its key-side table."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import DataError, eval_windows
from .model import TransformerLM

CONTEXT_FACTORS = (1, 2, 4, 8)
"""Evaluation contexts, as multiples of the training context."""


@torch.no_grad()
def evaluate(model: TransformerLM, val: torch.Tensor, length: int, total: int, *, dist=None) -> float:
    """Mean loss (nats per byte) over the first ``total`` validation predictions in windows of ``length``.

    ``val`` is the (T,) uint8 validation split; ``total`` a multiple of ``length`` below ``T``. The model
    is scored in eval mode on its own device. Under DistributedDataParallel (``dist`` a
    :class:`~relattn.training.recipe.Dist` that is enabled) each rank scores every ``world_size``-th window and
    the sums are all-reduced, so every rank returns the same value.
    """
    x, y = eval_windows(val, length, total)
    rank, world = (dist.rank, dist.world_size) if dist is not None and dist.enabled else (0, 1)
    rows = torch.arange(rank, x.shape[0], world)
    per_batch = max(1, 8192 // length)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(rows), per_batch):
        idx = rows[i:i + per_batch]
        logits = model(x[idx].to(device))
        acc[0] += F.cross_entropy(logits.flatten(0, 1).float(), y[idx].to(device).flatten(), reduction="sum").double()
        acc[1] += idx.numel() * length
    model.train(was_training)
    if world > 1:
        torch.distributed.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def eval_plan(val_len: int, context: int, budget: int) -> tuple[int, list[int], list[int]]:
    """Bytes to score, the context lengths (1x, 2x, 4x, 8x ``context``) that fit in the validation split, and
    those that do not: the largest multiple of the longest fitting length within ``budget`` (at least one)."""
    for i in range(len(CONTEXT_FACTORS) - 1, -1, -1):
        unit = CONTEXT_FACTORS[i] * context
        total = min((val_len - 1) // unit, max(1, budget // unit)) * unit
        if total > 0:
            lengths = [f * context for f in CONTEXT_FACTORS[: i + 1]]
            return total, lengths, [f * context for f in CONTEXT_FACTORS[i + 1:]]
    raise DataError(f"validation split ({val_len} bytes) is shorter than the context ({context})")


def first_key_table(model: TransformerLM) -> torch.Tensor | None:
    """A CPU copy of the first layer's key-side table a^K ((2K+1, D) or (H, 2K+1, D)); None without one."""
    table = model.encoder.blocks[0].attn.rel_k
    return None if table is None else table.detach().cpu().clone()


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


__all__ = ["CONTEXT_FACTORS", "evaluate", "eval_plan", "first_key_table", "key_table_stats"]
