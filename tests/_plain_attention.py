"""Shaw attention written the plain PyTorch way, as the peers compute it: the yardstick for mixed precision.

"Plain PyTorch attention" for the bf16 tolerance rule (flash-attention's: the kernel's error against a
float64 reference must be at most 2x the error of a plain PyTorch implementation of the *same function*
at the same precision) is, for Shaw attention, the textbook formulation that tensor2tensor and Hugging
Face use: gather the tables into (N, M, D) tensors, einsum them with the queries and the weights, and
``torch.softmax`` the scores. Same projections, same parameters, same function as
``RelativeMultiheadAttention.forward`` for self-attention; only the arithmetic differs. Under autocast the
einsums and matmuls run in bf16 exactly as they would in a user's own code.
"""

from __future__ import annotations

import math

import torch

from relattn import RelativeMultiheadAttention, relative_position_index


def _pairs(table: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(N, M, D) for a shared (2K+1, D) table, (H, N, M, D) for a per-head one, and its einsum letters."""
    return (table[idx], "nmd") if table.dim() == 2 else (table[:, idx], "hnmd")


def plain_shaw_forward(mod: RelativeMultiheadAttention, x: torch.Tensor, *, is_causal: bool = False) -> torch.Tensor:
    """Self-attention of ``mod`` on ``x`` (B, N, E) -> (B, N, E), materialising the (N, N, D) relative tensors."""
    b, n, _ = x.shape
    q, k, v = (mod._heads(proj(x)) for proj in (mod.q_proj, mod.k_proj, mod.v_proj))
    idx = relative_position_index(n, n, mod.max_relative_position, device=x.device)
    scores = q @ k.transpose(-1, -2)
    if mod.rel_k is not None:
        ak, letters = _pairs(mod.rel_k, idx)
        scores = scores + torch.einsum(f"bhnd,{letters}->bhnm", q, ak)
    scores = scores / math.sqrt(mod.head_dim)
    if is_causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    w = torch.softmax(scores, -1)
    out = w @ v
    if mod.rel_v is not None:
        av, letters = _pairs(mod.rel_v, idx)
        out = out + torch.einsum(f"bhnm,{letters}->bhnd", w, av)
    return mod.out_proj(out.transpose(1, 2).reshape(b, n, mod.embed_dim))
