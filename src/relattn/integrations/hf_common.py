"""What the Hugging Face integrations share: a transformers attention mask as the op's ``attn_mask`` (or, when it
is right-aligned padding, as the :class:`~relattn.padding.Packing` of a packed call), the projections as heads and
back, the dropout a module applies."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..functional import relative_attention_varlen
from ..padding import Packing, remembered, right_padding


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
    only, at least ``relattn.padding.PACK_FROM`` of the positions padding (``Packing.worth_packing``): a 2-D
    (B, N) keep mask (nonzero = token), or a 4-D (B, 1, N | 1, N) mask whose query rows are all the same, bool
    (True = may attend) or additive float (0 at tokens; ``finfo.min`` or ``-inf`` at padding, as transformers
    builds them). None otherwise (no mask, other masks, left padding, while tracing, or a
    patched ``module`` of a model that reads its padded positions, ``_relattn_pack`` False): the layer keeps its
    masked call. Remembered per mask tensor (every layer of a model is handed the same one)."""
    if not isinstance(attention_mask, torch.Tensor) or not isinstance(hidden_states, torch.Tensor) or \
            hidden_states.dim() != 3 or not getattr(module, "_relattn_pack", True) or torch.compiler.is_compiling():
        return None
    packing = remembered(attention_mask, "transformers", _mask_packing)
    if packing is None or not packing.worth_packing or \
            (packing.batch, packing.length) != tuple(hidden_states.shape[:2]):
        return None
    return packing


def _mask_packing(mask: torch.Tensor) -> Packing | None:
    if mask.dim() == 2:
        padding = mask == 0
    elif mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] in (1, mask.shape[3]):
        rows = mask[:, 0]
        row = rows[:, :1]
        if rows.shape[1] > 1 and not torch.equal(rows, row.expand_as(rows)):
            return None
        row = row[:, 0]
        if mask.dtype == torch.bool:
            padding = ~row
        elif mask.is_floating_point():
            padding = row <= torch.finfo(mask.dtype).min / 2
            if not torch.equal(padding, row != 0):
                return None
        else:
            padding = row == 0
    else:
        return None
    packing = right_padding(padding)
    return packing if packing is not None and packing.padded else None


def packed_attention(packing: Packing, hidden_states: torch.Tensor, projections, num_heads: int, output=None,
                     **op_args) -> torch.Tensor:
    """Self-attention of the real tokens of ``hidden_states`` (B, N, E) as one packed
    :func:`relative_attention_varlen` call, the query, key and value ``projections`` (and ``output``, if given)
    applied to those rows only; (B, N, E_out) with **zeros at the padded positions**. ``op_args``: the op's other
    arguments (tables, window, scale, dropout, backend)."""
    x = packing.pack(hidden_states)
    q = projections[0](x).unflatten(-1, (num_heads, -1))
    k, v = (proj(x).unflatten(-1, (-1, q.shape[-1])) for proj in projections[1:])
    out = relative_attention_varlen(q, k, v, cu_seqlens_q=packing.cu_seqlens, max_seqlen_q=packing.max_seqlen,
                                    **op_args).flatten(1)
    return packing.unpack(out if output is None else output(out))


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


__all__ = ["as_attn_mask", "attentions_recorded", "compact_mask", "dropout_p", "heads", "merge", "packed_attention",
           "qkv", "right_packing"]
