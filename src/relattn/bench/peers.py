"""Shaw attention as the peers compute it, for ``relattn bench`` to measure against.

Notation: ``B`` batch, ``H`` heads, ``N`` query length, ``M`` key length, ``D`` head dim, ``K`` max
relative position (tables have ``2K + 1`` rows).

- :func:`materialised_attention`: tensor2tensor's ``dot_product_attention_relative`` (also OpenNMT-py's
  ``MultiHeadedAttention`` with ``max_relative_positions``): gather the tables through the clipped index
  into (N, M, D) tensors, then the "relative attention inner" matmuls. O(N * M * D) memory.
- :class:`HFWav2Vec2BertRelativeKey`: Hugging Face ``Wav2Vec2BertSelfAttention`` with
  ``position_embeddings_type="relative_key"`` (optional: needs ``transformers>=5``, the ``peers`` extra), the
  attention of Wav2Vec2-BERT and SeamlessM4T-v2's speech encoder. Key term only, one table shared by all heads,
  offsets ``j - i`` clipped to ``[-left, right]`` (here ``left = right = K``), gathered into an (N, M, D) tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from ..positions import relative_position_index

PEERS = ("materialised", "hf")  # the peers `relattn bench` can run besides SDPA

PEER_REQUIREMENT = "transformers>=5"


def _relative_inner(x: torch.Tensor, z: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """tensor2tensor's ``_relative_attention_inner``: x (B, H, N, X), z (N, M, D) or (H, N, M, D).

    ``transpose=True``: x is queries (X = D), returns x_i . z_ij, (B, H, N, M).
    ``transpose=False``: x is weights (X = M), returns sum_j x_ij z_ij, (B, H, N, D).
    """
    b, h, n, _ = x.shape
    if z.dim() == 3:  # one table for all heads: fold heads into the matmul batch, as tensor2tensor does
        x_t = x.permute(2, 0, 1, 3).reshape(n, b * h, x.shape[-1])  # (N, B*H, X)
        xz = x_t @ (z.transpose(-1, -2) if transpose else z)  # (N, B*H, M or D)
        return xz.reshape(n, b, h, -1).permute(1, 2, 0, 3)
    return torch.einsum("bhnd,hnmd->bhnm" if transpose else "bhnm,hnmd->bhnd", x, z)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = may attend) -> 0 / -inf; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def materialised_attention(q, k, v, rel_k=None, rel_v=None, *, max_relative_position: int,
                           attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                           scale: float | None = None) -> torch.Tensor:
    """Shaw attention through (N, M, D) gathered tables, the way tensor2tensor and OpenNMT-py compute it.

    Args:
        q: (B, H, N, D); k: (B, H, M, D); v: (B, H, M, Dv).
        rel_k: (2K+1, D) shared by all heads, (H, 2K+1, D) per head, or None.
        rel_v: (2K+1, Dv), (H, 2K+1, Dv) or None.
        max_relative_position: K.
        attn_mask: bool (True = may attend) or float (added to the scaled scores), broadcastable to
            (B, H, N, M); tensor2tensor's ``bias``.
        is_causal: forbid keys ``j > i`` (no query offset: the peers have none).
        scale: score scale, ``1/sqrt(D)`` by default.

    Returns:
        (B, H, N, Dv). Memory: two (N, M, D) gathered tables (per head: (H, N, M, D)) and their gradients.
    """
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    idx = relative_position_index(n, m, max_relative_position, device=q.device)
    scale = d**-0.5 if scale is None else scale

    def gather(table):
        if table is None:
            return None
        return table[idx] if table.dim() == 2 else table[:, idx]  # (N, M, D) or (H, N, M, D)

    emb_k, emb_v = gather(rel_k), gather(rel_v)
    scores = q @ k.transpose(-1, -2)
    if emb_k is not None:
        scores = scores + _relative_inner(q, emb_k, transpose=True)
    scores = scores * scale
    if attn_mask is not None:
        scores = scores + _additive(attn_mask, scores.dtype)
    if is_causal:
        future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = weights @ v
    if emb_v is not None:
        out = out + _relative_inner(weights, emb_v, transpose=False)
    return out


def transformers_version() -> str | None:
    """The installed ``transformers`` version, if there is one and it is 5 or later (the peer's API), else None."""
    try:
        import transformers
    except ImportError:
        return None
    major = transformers.__version__.split(".")[0]
    return transformers.__version__ if major.isdigit() and int(major) >= 5 else None


def hf_missing_reason() -> str | None:
    """Why the Hugging Face peer cannot run here, or None when it can."""
    if transformers_version() is not None:
        return None
    try:
        import transformers
    except ImportError:
        return f"{PEER_REQUIREMENT} not installed (pip install 'relattn[hf]')"
    return f"transformers {transformers.__version__} installed; the peer needs {PEER_REQUIREMENT}"


class _Given(nn.Module):
    """Stands in for a projection: returns the tensor it was given, so the layer sees our exact q, k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, _hidden: torch.Tensor) -> torch.Tensor:
        return self.value


class HFWav2Vec2BertRelativeKey:
    """Hugging Face ``Wav2Vec2BertSelfAttention(position_embeddings_type="relative_key")`` on given q, k, v.

    Built from a small ``Wav2Vec2BertConfig`` (``hidden_size = H * D``, no dropout,
    ``left_max_position_embeddings = right_max_position_embeddings = K``). Its q/k/v projections are replaced
    by the given tensors and its output projection by the identity, so what runs is exactly its attention:
    scores ``(q . k + q . E[clip(j - i, -K, K) + K]) / sqrt(D)`` with ``E`` its ``distance_embedding``
    ((2K+1, D), one table for all heads: row ``r`` is offset ``r - K``, as relattn's ``rel_k``), gathered into an
    (N, M, D) tensor; plus the mask; softmax; weights @ v. This is Shaw's key term; there is no value term.

    Args:
        heads: H; head_dim: D; max_relative_position: K.
        attn_implementation: ``"eager"`` or ``"sdpa"`` (transformers' attention function the layer calls;
            ``from_pretrained`` picks ``"sdpa"`` by default).
    """

    def __init__(self, heads: int, head_dim: int, max_relative_position: int, *, attn_implementation="eager",
                 device=None, dtype=torch.float32) -> None:
        reason = hf_missing_reason()
        if reason is not None:
            raise ImportError(f"the Hugging Face peer cannot run: {reason}")
        from transformers import Wav2Vec2BertConfig
        from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention

        config = Wav2Vec2BertConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                                    position_embeddings_type="relative_key", attention_dropout=0.0,
                                    left_max_position_embeddings=max_relative_position,
                                    right_max_position_embeddings=max_relative_position,
                                    attn_implementation=attn_implementation)
        layer = Wav2Vec2BertSelfAttention(config)
        layer.linear_q, layer.linear_k, layer.linear_v = _Given(), _Given(), _Given()
        layer.linear_out = nn.Identity()
        self.layer = layer.to(device=device, dtype=dtype).eval()
        self.heads, self.head_dim = heads, head_dim

    @property
    def table(self) -> torch.Tensor:
        """The (2K + 1, D) ``distance_embedding`` weight (a parameter: it gets a gradient)."""
        return self.layer.distance_embedding.weight

    def __call__(self, q, k, v, *, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v (B, H, N, D) (self-attention: the layer has one length); attn_mask bool (True = may attend)
        or additive float, broadcastable to (B, H, N, N).

        Returns (B, H, N, D).
        """
        b, h, n, d = q.shape

        def flat(t):  # (B, H, L, D) -> (B, L, H * D), the layer's hidden-state layout
            return t.transpose(1, 2).reshape(b, t.shape[2], h * d)

        given = (self.layer.linear_q, self.layer.linear_k, self.layer.linear_v)
        for module, t in zip(given, (q, k, v), strict=True):
            module.value = flat(t)
        mask = None if attn_mask is None else _additive(attn_mask, q.dtype)
        try:
            context = self.layer(flat(q), attention_mask=mask)[0]
        finally:
            for module in given:
                module.value = None
        return context.view(b, n, h, d).transpose(1, 2)
