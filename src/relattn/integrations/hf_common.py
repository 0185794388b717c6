"""What the Hugging Face integrations share: a transformers attention mask as the op's ``attn_mask`` (or, when it
is right-aligned padding, as the :class:`~relattn.padding.Packing` of a packed call, run by
:func:`relattn.padding.packed_self_attention`), the projections as heads, the dropout a module applies."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..padding import Packing, packing_of, split_heads


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


def right_packing(attention_mask, hidden_states: torch.Tensor, module: nn.Module) -> Packing | None:
    """The :class:`Packing` of a self-attention layer's transformers mask when it masks right-aligned padded keys
    only (the ``"transformers"`` mask rule, :func:`relattn.padding.transformers_padding`), at least
    ``relattn.padding.PACK_FROM`` of the positions padding (``Packing.worth_packing``). None otherwise (no mask,
    other masks, left padding, while tracing, or a patched ``module`` of a model that reads its padded positions,
    ``_relattn_pack`` False): the layer keeps its masked call. Remembered per mask tensor (every layer of a model is
    handed the same one)."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or \
            not getattr(module, "_relattn_pack", True):
        return None
    packing = packing_of(attention_mask, "transformers")
    if packing is None or not packing.worth_packing or \
            (packing.batch, packing.length) != tuple(hidden_states.shape[:2]):
        return None
    return packing


def qkv(hidden_states: torch.Tensor, projections, num_heads: int) -> list[torch.Tensor]:
    """The query, key and value projections of ``hidden_states`` (B, N, E), each as heads (B, H, N, D)."""
    return [split_heads(proj(hidden_states), heads=num_heads) for proj in projections]


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


__all__ = ["as_attn_mask", "attentions_recorded", "compact_mask", "dropout_p", "qkv", "right_packing"]
