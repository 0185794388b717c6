"""Shaw attention as the peers compute it, for ``relattn bench`` to measure against.

Notation: ``B`` batch, ``H`` heads, ``N`` query length, ``M`` key length, ``D`` head dim, ``K`` max
relative position (tables have ``2K + 1`` rows).

- :func:`materialised_attention`: tensor2tensor's ``dot_product_attention_relative`` (also OpenNMT-py's
  ``MultiHeadedAttention`` with ``max_relative_positions``): gather the tables through the clipped index
  into (N, M, D) tensors, then the "relative attention inner" matmuls. O(N * M * D) memory.
- :class:`HFBertRelativeKey`: Hugging Face ``BertSelfAttention`` with ``position_embedding_type="relative_key"``
  (optional: needs ``transformers<5``, the ``peers`` extra). Key term only, and no clipping: its table has
  ``2 * max_position_embeddings - 1`` rows, one per raw offset, gathered into an (N, M, D) tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from .positions import relative_position_index


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


def materialised_attention(q, k, v, rel_k=None, rel_v=None, *, max_relative_position: int, is_causal: bool = False,
                           scale: float | None = None) -> torch.Tensor:
    """Shaw attention through (N, M, D) gathered tables, the way tensor2tensor and OpenNMT-py compute it.

    Args:
        q: (B, H, N, D); k: (B, H, M, D); v: (B, H, M, Dv).
        rel_k: (2K+1, D) shared by all heads, (H, 2K+1, D) per head, or None.
        rel_v: (2K+1, Dv), (H, 2K+1, Dv) or None.
        max_relative_position: K.
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
    if is_causal:
        future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = weights @ v
    if emb_v is not None:
        out = out + _relative_inner(weights, emb_v, transpose=False)
    return out


def transformers_version() -> str | None:
    """The installed ``transformers`` version if it is a 4.x (the peer's API), else None."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__ if transformers.__version__.split(".")[0] == "4" else None


class _Given(nn.Module):
    """Stands in for a projection: returns the tensor it was given, so the layer sees our exact k and v."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, _hidden: torch.Tensor) -> torch.Tensor:
        return self.value


class HFBertRelativeKey:
    """Hugging Face ``BertSelfAttention(position_embedding_type="relative_key")`` on given q, k, v.

    Its q/k/v projections are replaced by the identity (for q) and by the given tensors (for k and v),
    so what runs is exactly its attention: scores ``q . k + q . E[i - j + P - 1]`` with ``E`` its
    ``distance_embedding`` of ``2P - 1`` rows (``P = max_position_embeddings >= N``), gathered into an
    (N, M, D) tensor; softmax; weights @ v. This is Shaw's key term with ``K = P - 1`` and the table
    reversed (row ``r`` of ``E`` is offset ``j - i = P - 1 - r``), and no value term.

    Args:
        heads: H; head_dim: D; max_position_embeddings: P (must be >= N and >= M).
    """

    def __init__(self, heads: int, head_dim: int, max_position_embeddings: int, *, device=None,
                 dtype=torch.float32) -> None:
        if transformers_version() is None:
            raise ImportError("the Hugging Face peer needs transformers>=4.40,<5: pip install 'relattn[peers]'")
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertSelfAttention

        config = BertConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                            max_position_embeddings=max_position_embeddings, position_embedding_type="relative_key",
                            attention_probs_dropout_prob=0.0)
        layer = BertSelfAttention(config, position_embedding_type="relative_key")
        layer.query, layer.key, layer.value = nn.Identity(), _Given(), _Given()
        self.layer = layer.to(device=device, dtype=dtype).eval()
        self.heads, self.head_dim = heads, head_dim

    @property
    def table(self) -> torch.Tensor:
        """The (2P - 1, D) ``distance_embedding`` weight (a parameter: it gets a gradient)."""
        return self.layer.distance_embedding.weight

    def __call__(self, q, k, v, *, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, N, D), k (B, H, M, D), v (B, H, M, D); attn_mask additive, broadcastable to (B, H, N, M).

        Returns (B, H, N, D).
        """
        b, h, n, d = q.shape

        def flat(t):  # (B, H, L, D) -> (B, L, H * D), the layer's hidden-state layout
            return t.transpose(1, 2).reshape(b, t.shape[2], h * d)

        self.layer.key.value, self.layer.value.value = flat(k), flat(v)
        try:
            context = self.layer(flat(q), attention_mask=attn_mask)[0]
        finally:
            self.layer.key.value = self.layer.value.value = None
        return context.view(b, n, h, d).transpose(1, 2)
