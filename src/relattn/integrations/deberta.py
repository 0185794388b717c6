"""DeBERTa (v1) and DeBERTa-v2/v3 (and mDeBERTa-v3) disentangled attention on :func:`relative_attention`, for
:func:`relattn.integrations.transformers.patch`.

transformers' ``DisentangledSelfAttention`` computes, per head (``D`` head dim; ``A`` the relative embeddings
``rel_embeddings``, layer-normed when ``norm_rel_ebd`` says so, through dropout when training; ``t(i, j)`` the row
of key ``j`` seen from query ``i``, :class:`relattn.positions.LogBuckets`)::

    s_ij = (q_i . k_j + q_i . A_K[t(i, j)] + k_j . A_Q[t(i, j)]) / sqrt(f D)

with ``A_K = key_proj(A)``, ``A_Q = query_proj(A)`` when ``share_att_key``, else ``pos_key_proj(A)`` and
``pos_query_proj(A)``; the c2p term (``A_K``) and the p2c term (``A_Q``) each present when ``pos_att_type`` names
it, and ``f`` one plus the number of terms ``pos_att_type`` names (with ``relative_attention=False`` too, as
transformers counts them). No value term. In relattn's terms: ``rel_k = A_K`` and
``rel_q = A_Q``, both ``(H, 2 span, D)`` as DeBERTa stores them, with ``max_relative_position=LogBuckets(...)``;
the op turns them into the equivalent clipped tables (gradients flow back), so no (B, H, N, N) score, index or
mask tensor is built (the encoder hands its layers a (B, 1, 1, N) padding mask and no (N, N) positions).

Differences from the unpatched model, at padding only: a query at a padded position (no key to attend to in
transformers' (B, 1, N, N) mask) attends the real tokens instead of all tokens uniformly. Its output is never
read by a real token, so every real token's output and every gradient of a loss on real tokens are unchanged.
The weights returned with ``output_attentions=True`` are computed (before dropout).

DeBERTa v1 (``DebertaModel``, ``transformers.models.deberta``) is the same attention with its own parametrisation:
q, k, v from one ``in_proj`` (per head ``[q | k | v]``) plus ``q_bias`` and ``v_bias``; ``A_K = pos_proj(A)``,
``A_Q = pos_q_proj(A)``; ``f = 1 + len(pos_att_type)``; no log buckets: positions ``i - j`` clipped to
``[-span, span - 1]`` with ``span = min(N, max_relative_positions)``, over rows ``max_relative_positions - span``
.. ``max_relative_positions + span`` of ``rel_embeddings``. Its ``talking_head`` option mixes the heads' scores
(not Shaw attention): such a model is left as it is.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..functional import relative_attention, relative_attention_weights
from ..padding import Packing, attend_packed, packing_of, split_heads
from ..positions import LogBuckets

_MODULE = "transformers.models.deberta_v2.modeling_deberta_v2."
_MODULE_V1 = "transformers.models.deberta.modeling_deberta."


def positions(module: nn.Module) -> LogBuckets:
    """The :class:`LogBuckets` of a ``DisentangledSelfAttention`` (its ``pos_ebd_size`` rows each side)."""
    buckets = module.position_buckets if module.position_buckets > 0 else 0
    return LogBuckets(module.pos_ebd_size, buckets, module.max_relative_positions if buckets else 0)


def _is_standard(relative_pos: torch.Tensor, module: nn.Module, n: int) -> bool:
    """Whether ``relative_pos`` is what transformers' ``build_relative_position`` gives for length ``n``: Toeplitz,
    first row and column as built (an O(N^2) comparison, no (N, N) allocation). v1 modules have no buckets."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    rp = relative_pos.reshape(relative_pos.shape[-2:]) if relative_pos.dim() > 2 else relative_pos
    if rp.shape != (n, n) or rp.shape[0] > 1 and not torch.equal(rp[1:, 1:], rp[:-1, :-1]):
        return False
    edge = torch.cat([-torch.arange(n - 1, 0, -1), torch.arange(n)]).to(rp.device)  # i - j along row 0, column 0
    if getattr(module, "position_buckets", 0) > 0 and module.max_relative_positions > 0:
        edge = make_log_bucket_position(edge, module.position_buckets, module.max_relative_positions)
    return torch.equal(torch.cat([rp[0].flip(0)[:-1], rp[:, 0]]).long(), edge.long())


@torch.compiler.assume_constant_result
def _scale(head_dim: int, terms: int) -> float:
    """transformers' ``scaled_size_sqrt``: ``sqrt(terms * D)``, computed by torch in float32 as it is there (torch's
    float32 ``sqrt`` is not always the correctly rounded one, so no other way gives the same bits). A constant to
    ``torch.compile``: no graph break."""
    return float(torch.sqrt(torch.tensor(head_dim, dtype=torch.float32) * terms))


def _keep_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """DeBERTa's masks are keep-masks (nonzero = may attend), whatever their dtype: as a bool mask of 4 dims."""
    mask = attention_mask.bool()
    if mask.dim() <= 3:
        mask = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None]
    return mask


def _packed(self, q, k, v, rel_k, packing: Packing, args: dict) -> torch.Tensor:
    """A packed encoder's attention: q, k, v (1, H, T, D) of the real tokens, one packed call; (1, T, H*D)."""
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    return attend_packed(packing, q, k, v, rel_k=rel_k, dropout_p=self.dropout.p if self.training else 0.0,
                         backend=self._relattn_backend, **args)[None]


def _deberta_forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None,
                     relative_pos=None, rel_embeddings=None):
    """DisentangledSelfAttention's forward on :func:`relative_attention`."""
    n = hidden_states.shape[-2]
    odd_queries = query_states is not None and query_states.shape[-2] != n
    if odd_queries or (relative_pos is not None and self.relative_attention
                       and not _is_standard(relative_pos, self, n)):
        return type(self).forward(self, hidden_states, attention_mask, output_attentions=output_attentions,
                                  query_states=query_states, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
    heads = self.num_attention_heads
    q = split_heads(self.query_proj(hidden_states if query_states is None else query_states), heads=heads)
    k, v = (split_heads(proj(hidden_states), heads=heads) for proj in (self.key_proj, self.value_proj))
    rel_k = rel_q = None
    c2p, p2c = "c2p" in self.pos_att_type, "p2c" in self.pos_att_type
    if self.relative_attention:
        table = self.pos_dropout(rel_embeddings)[: 2 * self.pos_ebd_size]
        if c2p:
            rel_k = split_heads((self.key_proj if self.share_att_key else self.pos_key_proj)(table), heads=heads)
        if p2c:
            rel_q = split_heads((self.query_proj if self.share_att_key else self.pos_query_proj)(table), heads=heads)
    terms = 1 + c2p + p2c  # as transformers counts them: with relative_attention=False too
    args = dict(max_relative_position=positions(self) if self.relative_attention else 0, rel_q=rel_q,
                scale=1.0 / _scale(q.shape[-1], terms))
    if isinstance(attention_mask, Packing):
        return _packed(self, q, k, v, rel_k, attention_mask, args), None
    args["attn_mask"] = _keep_mask(attention_mask)
    out = relative_attention(q, k, v, rel_k, None, dropout_p=self.dropout.p if self.training else 0.0,
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, rel_k, **args) if output_attentions else None
    return out.transpose(-2, -3).flatten(-2), weights


def _padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """DebertaV2Encoder.get_attention_mask, without the (B, 1, N, N) outer product: a (B, N) padding mask becomes
    (B, 1, 1, N); a (B, N, N) one (B, 1, N, N)."""
    if attention_mask.dim() <= 2:
        return attention_mask[:, None, None, :]
    return attention_mask.unsqueeze(1) if attention_mask.dim() == 3 else attention_mask


@functools.cache
def _encoder_parameters(cls) -> tuple[tuple[str, object], ...]:
    """(name, default) of an encoder class's ``forward`` parameters after ``hidden_states`` and ``attention_mask``,
    read once per class."""
    return tuple((p.name, p.default) for p in list(inspect.signature(cls.forward).parameters.values())[3:])


def _encoder_argument(self, name: str, args: tuple, kwargs: dict):
    """The value an encoder call's ``args`` and ``kwargs`` (after the mask) give the parameter ``name``."""
    if name in kwargs:
        return kwargs[name]
    for at, (parameter, default) in enumerate(_encoder_parameters(type(self))):
        if parameter == name:
            return args[at] if at < len(args) else default
    raise TypeError(f"{type(self).__name__}.forward has no parameter {name!r}")


def _encoder_packing(self, hidden_states, attention_mask, args, kwargs) -> Packing | None:
    """The :class:`Packing` of an encoder call that can run packed: a (B, N) padding mask (the ``"keep"`` mask rule,
    :func:`relattn.padding.keep_padding`), right-aligned with some padding and some tokens, self-attention (no
    ``query_states``, no ``relative_pos``), no weights asked for, no convolution (DeBERTa-v2's ``conv_kernel_size``
    layer reads neighbouring positions); else None."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or \
            getattr(self, "conv", None) is not None:
        return None
    if any(_encoder_argument(self, name, args, kwargs) is not None for name in ("query_states", "relative_pos")) or \
            _encoder_argument(self, "output_attentions", args, kwargs):
        return None
    packing = packing_of(attention_mask, "keep")
    return packing if packing is not None and packing.total > 0 else None


def _packed_encoder(self, hidden_states, attention_mask, packing: Packing, positions_marker, args, kwargs):
    """The encoder on the real tokens only, as one (1, T, E) sequence whose layers get ``packing`` as their mask
    (and ``positions_marker`` as their positions); its outputs back in the padded layout, zeros at the padding."""
    self.get_attention_mask = lambda mask: packing
    self.get_rel_pos = lambda hidden, query_states=None, relative_pos=None: positions_marker
    try:
        out = type(self).forward(self, packing.pack(hidden_states)[None], attention_mask, *args, **kwargs)
    finally:
        del self.get_attention_mask, self.get_rel_pos
    unpack = packing.unpack
    if isinstance(out, tuple):
        last, *rest = out
        layers = rest[0] if rest and isinstance(rest[0], tuple) else None
        if layers is not None:
            rest[0] = (hidden_states, *(unpack(h[0]) for h in layers[1:]))
        return (unpack(last[0]), *rest)
    out.last_hidden_state = unpack(out.last_hidden_state[0])
    if out.hidden_states is not None:
        out.hidden_states = (hidden_states, *(unpack(h[0]) for h in out.hidden_states[1:]))
    return out


def _encoder_forward(self, hidden_states, attention_mask, *args, **kwargs):
    """DebertaV2Encoder's forward handing its layers a padding mask and no (N, N) positions (the patched layers
    compute the positions they need); with right-aligned padding, on the real tokens only (packed)."""
    packing = _encoder_packing(self, hidden_states, attention_mask, args, kwargs)
    if packing is not None:
        return _packed_encoder(self, hidden_states, attention_mask, packing, None, args, kwargs)
    self.get_attention_mask = _padding_mask
    self.get_rel_pos = lambda hidden, query_states=None, relative_pos=None: relative_pos
    try:
        return type(self).forward(self, hidden_states, attention_mask, *args, **kwargs)
    finally:
        del self.get_attention_mask, self.get_rel_pos


def _attention_reason(module) -> str | None:
    if not module.relative_attention:
        return None
    try:
        positions(module)
    except ValueError as exc:
        return (f"position_buckets={module.position_buckets} with "
                f"max_relative_positions={module.max_relative_positions} (the config's max_relative_positions, or "
                f"max_position_embeddings when that is < 1) gives no finite log buckets ({exc}); left as it is")
    return None


def _encoder_reason(module, attention_reason=None) -> str | None:
    """Why an encoder is not patched: one of its layers' attention is not (``attention_reason``: v2's, or v1's)."""
    attention_reason = attention_reason or _attention_reason
    layers = [layer.attention.self for layer in module.layer]
    if not all(type(a).__name__ == "DisentangledSelfAttention" and attention_reason(a) is None for a in layers):
        return "an encoder whose layers are not all patched keeps transformers' (N, N) masks and positions"
    return None


# ---------------------------------------------------------------------------------------------- DeBERTa v1

# What the patched v1 encoder hands its layers as ``relative_pos``: "the standard positions, not built" (v1's own
# attention adds the position terms only when it is given positions).
_ENCODER_POSITIONS = object()


def _v1_forward(self, hidden_states, attention_mask, output_attentions=False, query_states=None, relative_pos=None,
                rel_embeddings=None):
    """DeBERTa v1's DisentangledSelfAttention forward on :func:`relative_attention`."""
    n = hidden_states.shape[-2]
    from_encoder = relative_pos is _ENCODER_POSITIONS
    if query_states is not None or (relative_pos is not None and not from_encoder
                                    and not _is_standard(relative_pos, self, n)):
        if from_encoder:
            from transformers.models.deberta.modeling_deberta import build_relative_position

            relative_pos = build_relative_position(hidden_states if query_states is None else query_states,
                                                   hidden_states)
        return type(self).forward(self, hidden_states, attention_mask, output_attentions=output_attentions,
                                  query_states=query_states, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
    heads = self.num_attention_heads
    q, k, v = split_heads(self.in_proj(hidden_states), heads=heads).chunk(3, dim=-1)
    q = q + self.q_bias.view(heads, 1, -1)
    v = v + self.v_bias.view(heads, 1, -1)
    rel_k = rel_q = None
    window: int | LogBuckets = 0
    packing = attention_mask if isinstance(attention_mask, Packing) else None
    if self.relative_attention and rel_embeddings is not None and relative_pos is not None:
        span = min(n if packing is None else packing.max_seqlen, self.max_relative_positions)
        window = LogBuckets(span)
        table = self.pos_dropout(rel_embeddings)[self.max_relative_positions - span: self.max_relative_positions + span]
        if "c2p" in self.pos_att_type:
            rel_k = split_heads(self.pos_proj(table), heads=heads)
        if "p2c" in self.pos_att_type:
            rel_q = split_heads(self.pos_q_proj(table), heads=heads)
    args = dict(max_relative_position=window, rel_q=rel_q, scale=1.0 / _scale(q.shape[-1], 1 + len(self.pos_att_type)))
    if packing is not None:
        return _packed(self, q, k, v, rel_k, packing, args), None
    args["attn_mask"] = _keep_mask(attention_mask)
    out = relative_attention(q, k, v, rel_k, None, dropout_p=self.dropout.p if self.training else 0.0,
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, rel_k, **args) if output_attentions else None
    return out.transpose(-2, -3).flatten(-2), weights


def _v1_encoder_forward(self, hidden_states, attention_mask, *args, **kwargs):
    """DebertaEncoder's forward handing its layers a padding mask and, for self-attention, no (N, N) positions;
    with right-aligned padding, on the real tokens only (packed)."""
    packing = _encoder_packing(self, hidden_states, attention_mask, args, kwargs)
    if packing is not None:
        marker = _ENCODER_POSITIONS if self.relative_attention else None
        return _packed_encoder(self, hidden_states, attention_mask, packing, marker, args, kwargs)
    self.get_attention_mask = _padding_mask
    original = type(self).get_rel_pos

    def positions_or_marker(hidden, query_states=None, relative_pos=None):
        if relative_pos is not None or query_states is not None or not self.relative_attention:
            return original(self, hidden, query_states, relative_pos)
        return _ENCODER_POSITIONS

    self.get_rel_pos = positions_or_marker
    try:
        return type(self).forward(self, hidden_states, attention_mask, *args, **kwargs)
    finally:
        del self.get_attention_mask, self.get_rel_pos


def _v1_attention_reason(module) -> str | None:
    if getattr(module, "talking_head", False):
        return "DeBERTa's talking_head mixes the heads' scores: not Shaw attention, left as it is"
    return None


def _v1_encoder_reason(module) -> str | None:
    return _encoder_reason(module, _v1_attention_reason)


HANDLERS = {
    _MODULE + "DisentangledSelfAttention": (_deberta_forward, _attention_reason),
    _MODULE + "DebertaV2Encoder": (_encoder_forward, _encoder_reason),
    _MODULE_V1 + "DisentangledSelfAttention": (_v1_forward, _v1_attention_reason),
    _MODULE_V1 + "DebertaEncoder": (_v1_encoder_forward, _v1_encoder_reason),
}
SUPPORTED = ("DeBERTa-v2/v3 (disentangled attention, log-bucket positions)",
             "DeBERTa v1 (disentangled attention, clipped positions)")

__all__ = ["HANDLERS", "SUPPORTED", "positions"]
