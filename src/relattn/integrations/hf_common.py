"""What the Hugging Face integrations share: a transformers attention mask as the op's ``attn_mask``, the
projections as heads and back, the dropout a module applies."""

from __future__ import annotations

import torch
from torch import nn


def as_attn_mask(attention_mask):
    """A transformers attention mask as relative_attention's ``attn_mask``: 4-D bool (True = may attend) and float
    (additive) masks pass through; a 2-D (B, M) padding mask (1 = keep) becomes (B, 1, 1, M) bool."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError("relattn-patched attention takes a tensor attention mask, got "
                        f"{type(attention_mask).__name__}; load the model with attn_implementation='eager' or 'sdpa'")
    if attention_mask.dim() == 2:
        return attention_mask.bool()[:, None, None, :]
    if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
        return attention_mask.bool()
    return attention_mask


def heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H*D) -> (B, H, N, D)."""
    b, n, _ = x.shape
    return x.view(b, n, num_heads, -1).transpose(1, 2)


def qkv(hidden_states: torch.Tensor, projections, num_heads: int) -> list[torch.Tensor]:
    """The query, key and value projections of ``hidden_states`` (B, N, E), each as heads (B, H, N, D)."""
    return [heads(proj(hidden_states), num_heads) for proj in projections]


def merge(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B, N, H*D)."""
    b, _, n, _ = x.shape
    return x.transpose(1, 2).reshape(b, n, -1)


def dropout_p(module: nn.Module, p: float) -> float:
    """``p`` while ``module`` trains, else 0."""
    return float(p) if module.training else 0.0


__all__ = ["as_attn_mask", "dropout_p", "heads", "merge", "qkv"]
