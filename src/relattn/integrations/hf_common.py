"""What the Hugging Face integrations share: a transformers attention mask as the op's ``attn_mask``, the
projections as heads and back, the dropout a module applies."""

from __future__ import annotations

import warnings

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


def attentions_recorded(name: str) -> bool:
    """Whether the running transformers-5 model records its attention modules' weights (``output_attentions``):
    its output-capturing hooks collect them. False, with one warning per module class ``name``, when this
    transformers does not say."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        if name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(f"relattn-patched {name} cannot tell whether output_attentions was asked for with this "
                          "transformers version: it returns no attention weights", stacklevel=3)
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


_WARNED: set[str] = set()


def compact_mask(mask):
    """A 4-D mask whose query rows are all the same (a padding mask, as transformers builds it for encoders) as its
    (B|1, H|1, 1, M) first row, else itself: the op then holds no (N, M) mask. An O(N M) comparison."""
    if mask is None or mask.dim() != 4 or mask.shape[2] <= 1:
        return mask
    first = mask[:, :, :1]
    return first if torch.equal(mask, first.expand_as(mask)) else mask


__all__ = ["as_attn_mask", "attentions_recorded", "compact_mask", "dropout_p", "heads", "merge", "qkv"]
