"""T5's relative attention bias for ``patch(model)``: the T5 family (T5, mT5, umT5, Switch Transformers, Pop2Piano,
Pix2Struct's text decoder, UDOP's and LongT5's decoders) and MPNet.

T5 adds a learned scalar per head and bucket of the offset ``j - i`` to the unscaled scores (``scale = 1``)::

    s_ij = q_i . k_j + b[h, bucket(j - i)]

with the bucket T5's ``_relative_position_bucket`` (:class:`relattn.positions.T5Buckets`: bidirectional in encoders,
the past only in decoders; Pix2Struct's decoder always the past). The table, ``relative_attention_bias.weight``
``(num_buckets, H)``, lives in the first layer of each stack and is shared by the stack's layers (umT5: one per layer);
in relattn's terms it is the op's ``rel_bias`` (its transpose, ``(H, num_buckets)``), read at the rows of
``T5Buckets``, with no tables. A patched self-attention layer calls the op with its layer's table or its stack's
first layer's (the same parameter: every layer's gradient reaches it), never building the ``(1, H, N, M)`` bias; it
hands the next layer no ``position_bias`` (each computes its own). Cross-attention has no positions and is left as
transformers computes it. A decoder's cache is updated as transformers updates it, the new queries sitting at
``query_offset = len(cache)``. A right-padded encoder batch is packed (:func:`~relattn.integrations.hf_common.
right_packing`).

MPNet adds its encoder's one table, with T5's bidirectional buckets (32 buckets whatever the config says, as
transformers' ``compute_position_bias`` is called), to ``(q . k) / sqrt(D)``: the patched encoder hands its layers the
table instead of the ``(B, H, N, N)`` bias, and the layers call the op with ``rel_bias`` and ``scale = 1/sqrt(D)``.

Left as they are, with the reason in the report: UDOP's encoder (its bias adds 2-D layout buckets of the tokens'
bounding boxes, not a function of ``j - i``), LongT5's encoder attention (local and transient-global: block-local
attention with extra global tokens), cross-attention.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..functional import relative_attention, relative_attention_with_weights
from ..padding import merge_heads, packed_self_attention, split_heads
from ..positions import T5Buckets
from .hf_common import as_attn_mask, attentions_recorded, dropout_p, right_packing

SUPPORTED = ("T5", "mT5", "umT5", "Switch Transformers", "Pop2Piano", "Pix2Struct text decoder", "UDOP decoder",
             "LongT5 decoder", "MPNet")


def _table(owner: nn.Module | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The stack's bias table as the op's ``rel_bias``: (H, num_buckets), or None (a stack without one)."""
    if owner is None or not getattr(owner, "has_relative_attention_bias", False):
        return None
    return owner.relative_attention_bias.weight.t().to(dtype)


def _attend(self, hidden_states, mask, cache, kwargs, *, past: int):
    """The patched self-attention of a T5-family module: (output (B, N, E), weights or None)."""
    names = self._relattn_projections
    q_proj, k_proj, v_proj, o_proj = (getattr(self, n) for n in names)
    owner = self._relattn_owner()
    table = _table(owner, hidden_states.dtype)
    source = owner if owner is not None else self
    buckets = T5Buckets(source.relative_attention_num_buckets, source.relative_attention_max_distance,
                        self._relattn_bidirectional)
    recorded = attentions_recorded(type(self).__name__)
    drop = dropout_p(self, self.dropout)
    if cache is None and not recorded:
        packing = right_packing(mask, hidden_states, self)
        if packing is not None:
            out = packed_self_attention(packing, hidden_states, (q_proj, k_proj, v_proj), self.n_heads, o_proj,
                                        rel_bias=table, max_relative_position=buckets, scale=self.scaling,
                                        dropout_p=drop, backend=self._relattn_backend)
            return out, None
    q, k, v = (split_heads(proj(hidden_states), heads=self.n_heads) for proj in (q_proj, k_proj, v_proj))
    if cache is not None:
        layers = getattr(cache, "self_attention_cache", cache)  # an EncoderDecoderCache's, or the cache itself
        k, v = layers.update(k, v, self.layer_idx, kwargs=kwargs)
    attn_mask = as_attn_mask(mask)
    if attn_mask is not None and attn_mask.shape[-1] > k.shape[-2]:  # an over-wide mask, cropped as Pix2Struct does
        attn_mask = attn_mask[..., :k.shape[-2]]
    causal = attn_mask is None and bool(getattr(self, "is_causal", False)) and q.shape[-2] > 1
    args = dict(max_relative_position=buckets, rel_bias=table, attn_mask=attn_mask, is_causal=causal,
                scale=self.scaling, query_offset=past)
    if recorded:
        out, weights = relative_attention_with_weights(q, k, v, dropout_p=drop, **args)
    else:
        out, weights = relative_attention(q, k, v, dropout_p=drop, backend=self._relattn_backend, **args), None
    return o_proj(merge_heads(out)), weights


def _past(self, cache) -> int:
    if cache is None:
        return 0
    seen = cache.get_seq_length(self.layer_idx)
    return int(seen)


def t5_forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, cache=None, **kwargs):
    """T5Attention (and its copies) as self-attention: ``(output, None, weights)``. Cross-attention, or a
    ``position_bias`` handed in from outside (an unpatched first layer), takes transformers' own forward."""
    if key_value_states is not None or position_bias is not None:
        return type(self).forward(self, hidden_states, mask=mask, key_value_states=key_value_states,
                                  position_bias=position_bias, cache=cache, **kwargs)
    out, weights = _attend(self, hidden_states, mask, cache, kwargs, past=_past(self, cache))
    return out, None, weights


def umt5_forward(self, hidden_states, encoder_hidden_states=None, cache=None, attention_mask=None, **kwargs):
    """UMT5Attention as self-attention (its own table in every layer): ``(output, weights)``."""
    if encoder_hidden_states is not None:
        return type(self).forward(self, hidden_states, encoder_hidden_states=encoder_hidden_states, cache=cache,
                                  attention_mask=attention_mask, **kwargs)
    return _attend(self, hidden_states, attention_mask, cache, kwargs, past=_past(self, cache))


def mpnet_encoder_forward(self, hidden_states, attention_mask=None, output_attentions=False,
                          output_hidden_states=False, return_dict=False, **kwargs):
    """MPNetEncoder handing its layers the (H, 32) table instead of the (B, H, N, N) bias."""
    from transformers.modeling_outputs import BaseModelOutput

    table = self.relative_attention_bias.weight.t().to(hidden_states.dtype)
    all_hidden_states = () if output_hidden_states else None
    all_attentions = () if output_attentions else None
    for layer_module in self.layer:
        if output_hidden_states:
            all_hidden_states = all_hidden_states + (hidden_states,)
        layer_outputs = layer_module(hidden_states, attention_mask, table, output_attentions=output_attentions,
                                     **kwargs)
        hidden_states = layer_outputs[0]
        if output_attentions:
            all_attentions = all_attentions + (layer_outputs[1],)
    if output_hidden_states:
        all_hidden_states = all_hidden_states + (hidden_states,)
    if not return_dict:
        return tuple(v for v in [hidden_states, all_hidden_states, all_attentions] if v is not None)
    return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden_states,
                           attentions=all_attentions)


def mpnet_forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    """MPNetSelfAttention handed the (H, 32) table by the patched encoder; any other ``position_bias`` (an unpatched
    encoder's (B, H, N, N)) takes transformers' own forward."""
    if position_bias is None or position_bias.dim() != 2:
        return type(self).forward(self, hidden_states, attention_mask, position_bias, output_attentions, **kwargs)
    args = dict(max_relative_position=T5Buckets(32, 128), rel_bias=position_bias,
                scale=1.0 / self.attention_head_size ** 0.5)
    drop = dropout_p(self, self.dropout.p)
    projections = (self.q, self.k, self.v)
    if not output_attentions:
        packing = right_packing(attention_mask, hidden_states, self)
        if packing is not None:
            return (packed_self_attention(packing, hidden_states, projections, self.num_attention_heads, self.o,
                                          dropout_p=drop, backend=self._relattn_backend, **args),)
    q, k, v = (split_heads(p(hidden_states), heads=self.num_attention_heads) for p in projections)
    attn_mask = as_attn_mask(attention_mask)
    if output_attentions:
        out, weights = relative_attention_with_weights(q, k, v, attn_mask=attn_mask, dropout_p=drop, **args)
        return self.o(merge_heads(out)), weights
    out = relative_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop, backend=self._relattn_backend, **args)
    return (self.o(merge_heads(out)),)


# ------------------------------------------------------------------------------------------ what is patched

_T5_CLASSES = {  # class qualname -> (forward, projections, decoder-only buckets)
    "transformers.models.t5.modeling_t5.T5Attention": (t5_forward, ("q", "k", "v", "o"), False),
    "transformers.models.mt5.modeling_mt5.MT5Attention": (t5_forward, ("q", "k", "v", "o"), False),
    "transformers.models.umt5.modeling_umt5.UMT5Attention": (umt5_forward, ("q", "k", "v", "o"), False),
    "transformers.models.switch_transformers.modeling_switch_transformers.SwitchTransformersAttention":
        (t5_forward, ("q", "k", "v", "o"), False),
    "transformers.models.pop2piano.modeling_pop2piano.Pop2PianoAttention": (t5_forward, ("q", "k", "v", "o"), False),
    "transformers.models.pix2struct.modeling_pix2struct.Pix2StructTextAttention":
        (t5_forward, ("query", "key", "value", "output"), True),
    "transformers.models.udop.modeling_udop.UdopAttention": (t5_forward, ("q", "k", "v", "o"), False),
    "transformers.models.longt5.modeling_longt5.LongT5Attention": (t5_forward, ("q", "k", "v", "o"), False),
}
_LEFT = {
    "transformers.models.longt5.modeling_longt5.LongT5LocalAttention":
        "LongT5's local attention (block-local, its bias per block): not one offset map over the sequence, left as "
        "it is",
    "transformers.models.longt5.modeling_longt5.LongT5TransientGlobalAttention":
        "LongT5's transient-global attention (block-local plus global tokens): left as it is",
}
_MPNET = "transformers.models.mpnet.modeling_mpnet."
_STACK = re.compile(r"^(.*?)(?:^|\.)(?:block|layer)\.\d+\.")


def _qualname(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def handles(module: nn.Module) -> bool:
    """Whether ``module`` is one of the classes :func:`patch_into` considers."""
    name = _qualname(module)
    return name in _T5_CLASSES or name in _LEFT or name in (_MPNET + "MPNetSelfAttention", _MPNET + "MPNetEncoder")


def patch_into(model: nn.Module, report, swap) -> None:
    """Patch every T5-family self-attention and MPNet encoder of ``model`` (``swap``: ``_patching.swap`` with the
    backend bound), adding to ``report``."""
    modules = dict(model.named_modules())
    owners: dict[str, nn.Module] = {}  # stack prefix -> its first layer holding a table
    for name, module in modules.items():
        qualname = _qualname(module)
        if qualname in _LEFT:
            report.skipped[name] = _LEFT[qualname]
            continue
        if qualname == _MPNET + "MPNetEncoder":
            rows = module.relative_attention_bias.num_embeddings
            if rows != 32:
                report.skipped[name] = (f"relative_attention_num_buckets={rows}: transformers' MPNet buckets 32 "
                                        "whatever the table's rows, left as it is")
                continue
            swap(module, mpnet_encoder_forward)
            report.patched.append(name)
            continue
        if qualname == _MPNET + "MPNetSelfAttention":
            swap(module, mpnet_forward)
            report.patched.append(name)
            continue
        if qualname not in _T5_CLASSES:
            continue
        forward, projections, past_only = _T5_CLASSES[qualname]
        parent = modules.get(name.rpartition(".")[0])
        if parent is not None and type(parent).__name__.endswith("CrossAttention"):
            report.skipped[name] = "cross-attention: no relative positions, left as transformers computes it"
            continue
        stack = _STACK.match(name)
        prefix = stack.group(1) if stack else name
        stack_module = modules.get(prefix)
        if type(stack_module).__name__ == "UdopStack" and not stack_module.is_decoder:
            report.skipped[name] = ("UDOP's encoder: its bias adds 2-D layout buckets of the tokens' bounding boxes, "
                                    "not a function of the offset j - i alone; left as it is")
            continue
        if forward is umt5_forward or getattr(module, "has_relative_attention_bias", False):
            owner = module
            if forward is not umt5_forward:
                owners.setdefault(prefix, module)
        else:
            owner = owners.get(prefix)
        bidirectional = not past_only and not module.is_decoder
        swap(module, forward, owner=(lambda o=owner: o), projections=projections, bidirectional=bidirectional)
        report.patched.append(name)
