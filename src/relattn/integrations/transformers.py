"""``patch(model)``: the Shaw attention of Hugging Face transformers-5 models, computed by :func:`relative_attention`.

The recipe is ``model = X.from_pretrained(...)`` then ``patch(model)``. Each supported attention module keeps its
class, its parameters and its ``state_dict`` names; only its ``forward`` is replaced (an instance attribute, so
``unpatch`` restores the original). What each model computes, in relattn's terms (offsets ``j - i``, window
``(left, right)``, see :mod:`relattn.positions`):

- Wav2Vec2-BERT and SeamlessM4T-v2's speech encoder (``position_embeddings_type="relative_key"``): key table
  ``distance_embedding`` shared by the heads, window ``(left_max_position_embeddings,
  right_max_position_embeddings)``, clipped, scale ``1/sqrt(D)`` on both terms.
- SpeechT5's encoder: key table ``embed_positions.pe_k`` of ``2L`` rows indexed by ``clip(i - j, -L, L - 1) + L``,
  which is the flipped table in window ``(L - 1, L)``. The encoder's (N, N, D) embedding is no longer built: its
  ``embed_positions`` hands the (2L, D) table to the layers.
- VITS: key and value tables ``emb_rel_k``, ``emb_rel_v`` (1, 2W+1, D), window ``W``, zero beyond it.
- DeBERTa (v1) and DeBERTa-v2/v3: disentangled attention, :mod:`relattn.integrations.deberta`.
- Transformer-XL relative attention (content and position biases, a window as long as the sequence): Parakeet,
  Wav2Vec2-Conformer, SeamlessM4T v1's speech encoder and Wav2Vec2-BERT (``position_embeddings_type="relative"``),
  FastSpeech2-Conformer, :mod:`relattn.integrations.conformer`.
- T5's relative attention bias (a scalar per head and bucket of ``j - i``, the op's ``rel_bias`` with
  :class:`~relattn.positions.T5Buckets`): T5, mT5, umT5, Switch Transformers, Pop2Piano, Pix2Struct's text decoder,
  UDOP's and LongT5's decoders, and MPNet, :mod:`relattn.integrations.t5`.

With ``output_attentions=True`` patched modules return the weights, from :func:`relative_attention_weights`, as
the unpatched modules do (Wav2Vec2-BERT and SeamlessM4T-v2 whenever the model records attentions).
"""

from __future__ import annotations

import warnings

from torch import nn

from ..backends import check_name
from ..functional import relative_attention, relative_attention_weights
from ..padding import merge_heads, packed_self_attention
from . import t5 as _t5
from ._patching import PatchReport, is_patched, patched_here, swap, unpatch
from .conformer import HANDLERS as _CONFORMER
from .conformer import SUPPORTED as _CONFORMER_SUPPORTED
from .conformer import wav2vec2_forward, wav2vec2_reason
from .deberta import HANDLERS as _DEBERTA
from .deberta import SUPPORTED as _DEBERTA_SUPPORTED
from .hf_common import as_attn_mask, attentions_recorded, dropout_p, qkv, right_packing

SUPPORTED = ("Wav2Vec2-BERT (relative_key)", "SeamlessM4T-v2 speech encoder (relative_key)", "SpeechT5 encoder",
             "VITS", *_DEBERTA_SUPPORTED, *_CONFORMER_SUPPORTED, *_t5.SUPPORTED)


# ------------------------------------------------------------------------------------------ the patched forwards


def _conformer_forward(self, hidden_states, attention_mask=None, relative_position_embeddings=None, **kwargs):
    """Wav2Vec2BertSelfAttention / SeamlessM4Tv2ConformerSelfAttention with position_embeddings_type="relative_key";
    the weights too when the model records them (``output_attentions=True``)."""
    window = (self.left_max_position_embeddings, self.right_max_position_embeddings)
    recorded = attentions_recorded(type(self).__name__)
    packing = None if recorded else right_packing(attention_mask, hidden_states, self)
    if packing is not None:
        projections = (self.linear_q, self.linear_k, self.linear_v)
        return packed_self_attention(packing, hidden_states, projections, self.num_heads, self.linear_out,
                                     rel_k=self.distance_embedding.weight.to(hidden_states.dtype),
                                     max_relative_position=window, scale=self.scaling,
                                     dropout_p=dropout_p(self, self.dropout.p), backend=self._relattn_backend), None
    q, k, v = qkv(hidden_states, (self.linear_q, self.linear_k, self.linear_v), self.num_heads)
    args = dict(max_relative_position=window, attn_mask=as_attn_mask(attention_mask), scale=self.scaling)
    table = self.distance_embedding.weight.to(q.dtype)
    out = relative_attention(q, k, v, table, None, dropout_p=dropout_p(self, self.dropout.p),
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, table, **args) if recorded else None
    return self.linear_out(merge_heads(out)), weights


def _w2v_bert_forward(self, hidden_states, attention_mask=None, relative_position_embeddings=None, **kwargs):
    """Wav2Vec2BertSelfAttention: Shaw's ``relative_key`` or Transformer-XL's ``relative``."""
    forward = wav2vec2_forward if self.position_embeddings_type == "relative" else _conformer_forward
    return forward(self, hidden_states, attention_mask, relative_position_embeddings, **kwargs)


def _speecht5_positions_forward(self, hidden_states):
    """SpeechT5RelativePositionalEncoding: the (2L, D) table itself instead of the (N, N, D) embedding."""
    return self.pe_k.weight


def _speecht5_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None,
                      position_bias=None, output_attentions=False, **kwargs):
    """SpeechT5Attention of the encoder, handed the (2L, D) table by the patched ``embed_positions``."""
    if key_value_states is not None or cache is not None or position_bias is None or position_bias.dim() != 2:
        return type(self).forward(self, hidden_states, key_value_states=key_value_states, cache=cache,
                                  attention_mask=attention_mask, position_bias=position_bias,
                                  output_attentions=output_attentions, **kwargs)
    half = position_bias.shape[0] // 2  # rows r = (i - j) + L for i - j in [-L, L - 1]: flipped, window (L-1, L)
    rel_k = position_bias.flip(0).to(hidden_states.dtype)
    packing = None if output_attentions else right_packing(attention_mask, hidden_states, self)
    if packing is not None:
        return packed_self_attention(packing, hidden_states, (self.q_proj, self.k_proj, self.v_proj), self.num_heads,
                                     self.out_proj, rel_k=rel_k, max_relative_position=(half - 1, half),
                                     scale=self.scaling, dropout_p=dropout_p(self, self.dropout),
                                     backend=self._relattn_backend), None
    q, k, v = qkv(hidden_states, (self.q_proj, self.k_proj, self.v_proj), self.num_heads)
    args = dict(max_relative_position=(half - 1, half), attn_mask=as_attn_mask(attention_mask), scale=self.scaling)
    out = relative_attention(q, k, v, rel_k, None, dropout_p=dropout_p(self, self.dropout),
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, rel_k, **args) if output_attentions else None
    return self.out_proj(merge_heads(out)), weights


def _vits_forward(self, hidden_states, key_value_states=None, attention_mask=None, output_attentions=False):
    """VitsAttention: key and value tables in window ``window_size``, zero beyond it."""
    rel_k, rel_v = self.emb_rel_k.to(hidden_states.dtype), self.emb_rel_v.to(hidden_states.dtype)
    packing = None if output_attentions or key_value_states is not None else \
        right_packing(attention_mask, hidden_states, self)
    if packing is not None:
        return packed_self_attention(packing, hidden_states, (self.q_proj, self.k_proj, self.v_proj), self.num_heads,
                                     self.out_proj, rel_k=rel_k, rel_v=rel_v, max_relative_position=self.window_size,
                                     beyond="zero", scale=self.scaling, dropout_p=dropout_p(self, self.dropout),
                                     backend=self._relattn_backend), None
    q, k, v = qkv(hidden_states, (self.q_proj, self.k_proj, self.v_proj), self.num_heads)
    args = dict(max_relative_position=self.window_size, beyond="zero", attn_mask=as_attn_mask(attention_mask),
                scale=self.scaling)
    out = relative_attention(q, k, v, rel_k, rel_v, dropout_p=dropout_p(self, self.dropout),
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, rel_k, **args) if output_attentions else None
    return self.out_proj(merge_heads(out)), weights


# ------------------------------------------------------------------------------------------ what is supported


def _conformer_reason(module) -> str | None:
    """SeamlessM4Tv2ConformerSelfAttention: ``relative_key`` only (transformers 5 has no other position type
    there: with any other it attends without positions)."""
    kind = module.position_embeddings_type
    if kind == "relative_key":
        return None
    if kind is None:
        return "no relative positions (adapter or position-free attention): plain attention, left as it is"
    return (f"position_embeddings_type={kind!r}: SeamlessM4T-v2's attention computes no positions for it (only "
            "'relative_key' has any), plain attention, left as it is")


def _w2v_bert_reason(module) -> str | None:
    return None if module.position_embeddings_type == "relative_key" else wav2vec2_reason(module)


def _vits_reason(module) -> str | None:
    if not module.window_size:
        return f"window_size={module.window_size!r}: no relative positions, left as it is"
    return None


def _speecht5_reason(module) -> str | None:
    return ("SpeechT5 uses relative positions in its encoder only; this attention (decoder self- or "
            "cross-attention) has none, left as it is")


_HANDLERS = {
    "transformers.models.wav2vec2_bert.modeling_wav2vec2_bert.Wav2Vec2BertSelfAttention":
        (_w2v_bert_forward, _w2v_bert_reason),
    "transformers.models.seamless_m4t_v2.modeling_seamless_m4t_v2.SeamlessM4Tv2ConformerSelfAttention":
        (_conformer_forward, _conformer_reason),
    "transformers.models.vits.modeling_vits.VitsAttention": (_vits_forward, _vits_reason),
    **_DEBERTA,  # DeBERTa v1, v2/v3: integrations/deberta.py
    **_CONFORMER,  # Transformer-XL relative attention: integrations/conformer.py
}
_SPEECHT5 = "transformers.models.speecht5.modeling_speecht5."


def _reads_padding(module: nn.Module) -> bool:
    """Whether ``module`` reads the encoder's outputs at padded positions into real ones (the speech encoders'
    strided adapters and the x-vector head's TDNN convolve them unmasked): its model then keeps every padded
    position computed as transformers computes it (no packed calls)."""
    name = type(module).__name__
    return name.endswith("ConformerAdapter") or name in ("Wav2Vec2BertAdapter", "TDNNLayer")


def _qualname(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _patch_speecht5_positions(model: nn.Module, report: PatchReport, backend: str) -> set[int]:
    """Patch the relative positions of every SpeechT5 encoder of ``model``; the ids of their layers' attention."""
    encoder_attention = set()
    for name, module in model.named_modules():
        if _qualname(module) == _SPEECHT5 + "SpeechT5Encoder":
            swap(module.embed_positions, _speecht5_positions_forward, backend)
            report.patched.append(f"{name}.embed_positions" if name else "embed_positions")
            encoder_attention.update(id(layer.attention) for layer in module.layers)
    return encoder_attention


def patch(model: nn.Module, *, backend: str = "auto") -> PatchReport:
    """Replace, in place, the forward of every supported attention module of ``model`` with one that calls
    :func:`relative_attention` on the module's own parameters (``state_dict`` unchanged).

    Supported: Wav2Vec2-BERT and SeamlessM4T-v2 speech-encoder attention with ``relative_key`` positions, the
    SpeechT5 encoder, VITS, DeBERTa (v1) and DeBERTa-v2/v3 (every ``Deberta*`` / ``DebertaV2*`` model class), and
    Transformer-XL's relative attention: Parakeet (``ParakeetEncoder`` and its CTC, RNN-T, TDT heads),
    Wav2Vec2-Conformer, SeamlessM4T v1's speech encoder and Wav2Vec2-BERT with ``relative`` positions,
    FastSpeech2-Conformer; T5's relative attention bias: T5, mT5, umT5, Switch Transformers, Pop2Piano, Pix2Struct's
    text decoder, UDOP's and LongT5's decoders (every head class), and MPNet (``MPNetModel`` and its heads).
    Other attention modules (rotary, absolute positions, SpeechT5's decoder, DeBERTa's
    talking heads, adapters) are left untouched and listed in ``skipped`` with the reason; a warning names the
    unsupported position types, and one is raised when nothing could be patched.

    Args:
        model: a transformers-5 model (any ``nn.Module`` containing the supported attention modules).
        backend: relattn backend for every patched module (``"auto"`` picks one with dropout when training).

    Returns:
        A :class:`PatchReport`: ``patched`` module names (``named_modules`` names) and ``skipped`` reasons.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    backend = check_name(backend)
    report = PatchReport()
    _t5.patch_into(model, report, lambda module, forward, **attributes: swap(module, forward, backend, **attributes))
    speecht5_encoder_attention = _patch_speecht5_positions(model, report, backend)
    for name, module in model.named_modules():
        qualname = _qualname(module)
        if qualname == _SPEECHT5 + "SpeechT5Attention":
            forward, reason = _speecht5_forward, (None if id(module) in speecht5_encoder_attention
                                                  else _speecht5_reason(module))
        elif _t5.handles(module):
            continue  # integrations/t5.py decided
        elif qualname in _HANDLERS:
            forward, why = _HANDLERS[qualname]
            reason = why(module)
        else:
            wrapper = any(_qualname(child) in _HANDLERS or _t5.handles(child)  # DeBERTa's Attention, T5's layers
                          for child in module.children())
            if not wrapper and (type(module).__name__.endswith("SelfAttention") or qualname.endswith("Attention")):
                report.skipped[name] = f"{type(module).__name__} is not a supported Shaw attention module"
            continue
        if reason is None:
            swap(module, forward, backend)
            report.patched.append(name)
        else:
            report.skipped[name] = reason
    if any(_reads_padding(module) for module in model.modules()):
        for module in model.modules():
            if patched_here(module):
                module._relattn_pack = False
    odd = sorted({r for r in report.skipped.values() if "position_embeddings_type=" in r or "not Shaw attention" in r})
    if odd:
        warnings.warn("relattn.patch left attention untouched: " + "; ".join(odd), stacklevel=2)
    report.warn_if_empty(model, SUPPORTED)
    return report


__all__ = ["SUPPORTED", "PatchReport", "is_patched", "patch", "unpatch"]
