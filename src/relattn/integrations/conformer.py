"""The Transformer-XL relative attention of transformers-5's Conformers on :func:`relative_attention`, for
:func:`relattn.integrations.transformers.patch`.

Each model computes, per head (``D`` head dim, ``u``/``v`` its two learned biases, ``P`` its own position module's
``(2N - 1, E)`` sinusoids, row ``r`` the position ``i - j = N - 1 - r``, through the layer's bias-free projection
and split into heads)::

    s_ij = ((q_i + u) . k_j + (q_i + v) . P[N - 1 + j - i]) / sqrt(D)

after its ``_rel_shift``: in relattn's terms the key table ``rel_k = proj(P)`` (H, 2N - 1, D), unflipped, in the
window ``K = N - 1``, with ``content_bias = u`` and ``position_bias = v``. No (B, H, N, 2N - 1) score, shift or
float mask is built.

- Wav2Vec2-Conformer, SeamlessM4T v1's speech encoder and Wav2Vec2-BERT (``position_embeddings_type="relative"``):
  ``linear_pos``, ``pos_bias_u``, ``pos_bias_v``; the encoder's ``embed_positions`` output (1, 2N - 1, E); the
  masks transformers builds (additive for eager, bool or None for SDPA) pass through. Adapter attention has no
  positions and stays as it is.
- FastSpeech2-Conformer (encoder and decoder): the same names, the sum divided by ``sqrt(dim_key)``, a (B, 1, N)
  0/1 key mask (a row with every key masked gives zeros, as its masked softmax does), dropout after the softmax.
- Parakeet (``ParakeetEncoder`` and every head on it): ``relative_k_proj``, ``bias_u``, ``bias_v``, grouped k/v
  heads when ``num_key_value_heads < num_attention_heads``; a (B, 2N - 1, E) table, per batch element when they
  differ (``dropout_positions`` in training): then the op runs once per batch element, each with its own table.
  Its (B, 1, N, N) bool mask masks padded keys and padded queries: a padded query row, masked whole, attends every
  key uniformly in transformers (its scores all ``finfo.min``), with gradients through the content scores only;
  the patched layer computes that row so too, and the op sees only the (B, 1, 1, N) key mask when the mask is
  that outer product. Its eager softmax runs in float32 (below float64's precision: the patched layer computes in
  the model's dtype, as its SDPA path does; in float64 transformers' eager path turns a padded row's ``finfo.min``
  scores into float32 ``-inf`` and NaN).

``output_attentions``: the weights, from :func:`relative_attention_weights` (before dropout), whenever the model
records them (Parakeet, the Wav2Vec2 family), or when asked (FastSpeech2-Conformer), as transformers' eager paths
return them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..functional import relative_attention, relative_attention_weights
from ..padding import merge_heads, packed_self_attention, split_heads
from .hf_common import as_attn_mask, attentions_recorded, compact_mask, dropout_p, right_packing

_W2V_CONFORMER = "transformers.models.wav2vec2_conformer.modeling_wav2vec2_conformer.Wav2Vec2ConformerSelfAttention"
_SEAMLESS = "transformers.models.seamless_m4t.modeling_seamless_m4t.SeamlessM4TConformerSelfAttention"
_FASTSPEECH2 = "transformers.models.fastspeech2_conformer.modeling_fastspeech2_conformer.FastSpeech2ConformerAttention"
_PARAKEET = "transformers.models.parakeet.modeling_parakeet.ParakeetEncoderAttention"


def position_table(projection: nn.Linear, positions: torch.Tensor, heads: int, dtype) -> torch.Tensor:
    """A model's (2N - 1, E) sinusoids through its position projection, as relattn's key table (H, 2N - 1, D)."""
    table = projection(positions)
    return table.view(table.shape[0], heads, -1).transpose(0, 1).to(dtype)


def _recorded(self) -> bool:
    return attentions_recorded(type(self).__name__)


# ------------------------------------------------------------------------------ the Wav2Vec2 family (relative)


def wav2vec2_forward(self, hidden_states, attention_mask=None, relative_position_embeddings=None, **kwargs):
    """Wav2Vec2ConformerSelfAttention, SeamlessM4TConformerSelfAttention, Wav2Vec2BertSelfAttention with
    ``position_embeddings_type="relative"``."""
    pe, n = relative_position_embeddings, hidden_states.shape[1]
    if pe is None or pe.dim() != 3 or pe.shape[0] != 1 or pe.shape[1] != 2 * n - 1:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask,
                                  relative_position_embeddings=relative_position_embeddings, **kwargs)
    recorded = _recorded(self)
    packing = right_packing(attention_mask, hidden_states, self) \
        if not recorded and type(self).__name__ in _MASKED_CONVOLUTION else None
    if packing is not None:
        dtype = hidden_states.dtype
        longest = packing.max_seqlen  # the table's middle 2 L - 1 rows serve sequences up to L long
        return packed_self_attention(
            packing, hidden_states, (self.linear_q, self.linear_k, self.linear_v), self.num_heads, self.linear_out,
            rel_k=position_table(self.linear_pos, pe[0, n - longest: n + longest - 1], self.num_heads, dtype),
            max_relative_position=longest - 1, scale=self.scaling, content_bias=self.pos_bias_u.to(dtype),
            position_bias=self.pos_bias_v.to(dtype), dropout_p=dropout_p(self, self.dropout.p),
            backend=self._relattn_backend), None
    projections = (self.linear_q, self.linear_k, self.linear_v)
    q, k, v = (split_heads(proj(hidden_states), head_dim=self.head_size) for proj in projections)
    table = position_table(self.linear_pos, pe[0], self.num_heads, q.dtype)
    args = dict(max_relative_position=n - 1, attn_mask=compact_mask(as_attn_mask(attention_mask)), scale=self.scaling,
                content_bias=self.pos_bias_u.to(q.dtype), position_bias=self.pos_bias_v.to(q.dtype))
    out = relative_attention(q, k, v, table, None, dropout_p=dropout_p(self, self.dropout.p),
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, table, **args) if recorded else None
    return self.linear_out(merge_heads(out)), weights


# Whose layers mask padded frames before their convolution (Wav2Vec2-Conformer's does not: the frames after a
# sequence's end reach its last real frames there, so its padded positions are computed as transformers does).
_MASKED_CONVOLUTION = ("Wav2Vec2BertSelfAttention", "SeamlessM4TConformerSelfAttention")


def wav2vec2_reason(module) -> str | None:
    kind = module.position_embeddings_type
    if kind == "relative":
        return None
    if kind is None:
        return "no relative positions (adapter or position-free attention): plain attention, left as it is"
    return f"position_embeddings_type={kind!r} is not a relative attention relattn serves ('rotary' is RoPE)"


# ------------------------------------------------------------------------------ FastSpeech2-Conformer


def fastspeech2_forward(self, hidden_states, attention_mask=None, pos_emb=None, output_attentions=False):
    """FastSpeech2ConformerAttention: (B, 1, N) 0/1 key mask, ``(ac + bd) / sqrt(dim_key)``."""
    b, n, _ = hidden_states.shape
    if pos_emb is None or pos_emb.dim() != 3 or pos_emb.shape[0] != 1 or pos_emb.shape[1] != 2 * n - 1:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, pos_emb=pos_emb,
                                  output_attentions=output_attentions)
    mask = None
    if attention_mask is not None:
        if attention_mask.size() != (b, 1, n):
            raise ValueError(f"Attention mask should be of size {(b, 1, n)}, but is {attention_mask.size()}")
        mask = attention_mask.ne(0)[:, :, None, :]  # (B, 1, 1, N), True = may attend
    projections = (self.linear_q, self.linear_k, self.linear_v)
    q, k, v = (split_heads(proj(hidden_states), head_dim=self.head_dim) for proj in projections)
    table = position_table(self.linear_pos, pos_emb[0], self.num_heads, q.dtype)
    args = dict(max_relative_position=n - 1, attn_mask=mask, scale=self.dim_key ** -0.5,
                content_bias=self.pos_bias_u.to(q.dtype), position_bias=self.pos_bias_v.to(q.dtype))
    out = relative_attention(q, k, v, table, None, dropout_p=dropout_p(self, self.dropout.p),
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, table, **args) if output_attentions else None
    return self.linear_out(merge_heads(out)), weights


# ------------------------------------------------------------------------------ Parakeet


def _key_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Parakeet's (B, 1, N, M) bool mask as the op's mask and the (B, N) rows it masks whole: the (B, 1, 1, M) key
    mask when the mask is the outer product of query and key padding (as ParakeetEncoder builds it), else itself."""
    allowed = mask[:, 0]
    keys, rows = allowed.any(-2), allowed.any(-1)
    if torch.equal(allowed, rows[:, :, None] & keys[:, None, :]):
        return keys[:, None, None, :], ~rows
    return mask, ~rows


def _uniform_rows(out, weights, empty, q, k, v, scale):
    """``out`` (and ``weights``) with the rows ``empty`` (B, N) replaced by what transformers computes for a query
    masked whole: every key weighted ``1 / M``, the gradient of the content scores ``q . k`` passed through (its
    masked position scores get none)."""
    rows = empty.any(0).nonzero().flatten()
    if len(rows) == 0:
        return out, weights
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, 1) if groups > 1 else t for t in (k, v))
    scores = (q[:, :, rows] @ k.transpose(-1, -2)) * scale
    w = torch.softmax(scores - scores.detach(), -1)  # exactly uniform; autograd sees the content scores
    where = empty[:, None, rows, None]
    out = out.index_copy(2, rows, torch.where(where, w @ v, out[:, :, rows]))
    if weights is not None:
        weights = weights.index_copy(2, rows, torch.where(where, w.detach().to(weights.dtype), weights[:, :, rows]))
    return out, weights


def _parakeet_attention(self, hidden_states, mask, table_positions, record):
    """One call: the (B, H, N, D) output and the weights (or None) of a batch sharing one (2N - 1, E) table."""
    n = hidden_states.shape[1]
    projections = (self.q_proj, self.k_proj, self.v_proj)
    q, k, v = (split_heads(proj(hidden_states), head_dim=self.head_dim) for proj in projections)
    heads = self.config.num_attention_heads
    q_u = q + self.bias_u.to(q.dtype)[:, None]  # the content queries, for the rows masked whole
    table = position_table(self.relative_k_proj, table_positions, heads, q.dtype)
    empty = None
    if mask is not None:
        mask, empty = _key_mask(mask)
    args = dict(max_relative_position=n - 1, attn_mask=mask, scale=self.scaling, enable_gqa=k.shape[1] != heads,
                content_bias=self.bias_u.to(q.dtype), position_bias=self.bias_v.to(q.dtype))
    out = relative_attention(q, k, v, table, None, dropout_p=dropout_p(self, self.attention_dropout),
                             backend=self._relattn_backend, **args)
    weights = relative_attention_weights(q, k, table, **args) if record else None
    if empty is not None:
        out, weights = _uniform_rows(out, weights, empty, q_u, k, v, self.scaling)
    return out, weights


def parakeet_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """ParakeetEncoderAttention: a (B, 2N - 1, E) table (one per batch element when they differ) and a (B, 1, N, N)
    bool mask of padded keys and queries."""
    b, n, _ = hidden_states.shape
    pe = position_embeddings
    if pe is None or pe.dim() != 3 or pe.shape[0] != b or pe.shape[1] != 2 * n - 1 or \
            attention_mask is not None and attention_mask.dtype != torch.bool:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask=attention_mask, **kwargs)
    record = _recorded(self)
    if b == 1 or pe.stride(0) == 0 or torch.equal(pe, pe[:1].expand_as(pe)):
        out, weights = _parakeet_attention(self, hidden_states, attention_mask, pe[0], record)
    else:  # one table per batch element (dropout_positions in training): one call each
        parts = [_parakeet_attention(self, hidden_states[i:i + 1],
                                     None if attention_mask is None else attention_mask[i:i + 1], pe[i], record)
                 for i in range(b)]
        out = torch.cat([p[0] for p in parts])
        weights = torch.cat([p[1] for p in parts]) if record else None
    return self.o_proj(merge_heads(out)), weights


# ------------------------------------------------------------------------------ what is supported


def _always(module) -> str | None:
    return None


HANDLERS = {
    _W2V_CONFORMER: (wav2vec2_forward, wav2vec2_reason),
    _SEAMLESS: (wav2vec2_forward, wav2vec2_reason),
    _FASTSPEECH2: (fastspeech2_forward, _always),
    _PARAKEET: (parakeet_forward, _always),
}

SUPPORTED = ("Parakeet (FastConformer)", "Wav2Vec2-Conformer (relative)", "SeamlessM4T v1 speech encoder (relative)",
             "Wav2Vec2-BERT (relative)", "FastSpeech2-Conformer")
