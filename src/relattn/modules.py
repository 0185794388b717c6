"""``RelativeMultiheadAttention``: a drop-in for ``nn.MultiheadAttention(batch_first=True)`` with Shaw attention."""

from __future__ import annotations

import math

import torch
from torch import nn

from .functional import additive_mask, relative_attention
from .positions import check_max_relative_position


class KVCache:
    """Keys and values seen so far, (B, H, L, D), for incremental decoding.

    Pass the same cache to every call of one layer; each call appends its keys and values, and the
    queries of that call sit at positions ``L_before .. L_before + N - 1``.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, L_new, D) keys and values; return everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            if k.shape[:2] != self.k.shape[:2]:
                raise ValueError(f"cache holds (B, H) = {tuple(self.k.shape[:2])}, got keys {tuple(k.shape)}")
            self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        return self.k, self.v

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (for beam search)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


def _mha_mask_to_allowed(name: str, mask: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """nn.MultiheadAttention masks (bool True = masked out, or float added) -> SDPA form, 4-D."""
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        if mask.shape[0] != batch * heads:
            raise ValueError(
                f"{name} 3-D must be (B*num_heads, N, M) with B*num_heads={batch * heads}; got {tuple(mask.shape)}"
            )
        mask = mask.view(batch, heads, *mask.shape[1:])
    elif mask.dim() != 4:
        raise ValueError(f"{name} must be (N, M), (B*num_heads, N, M) or (B, H, N, M); got {tuple(mask.shape)}")
    return ~mask if mask.dtype == torch.bool else mask


def _combine(a: torch.Tensor | None, b: torch.Tensor | None, dtype) -> torch.Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    return additive_mask(a, dtype) + additive_mask(b, dtype)


class RelativeMultiheadAttention(nn.Module):
    """Multi-head self-attention with relative position representations, batch-first.

    Shaped like ``nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)``: inputs (B, N, E),
    output (B, N, E). Head dim ``D = embed_dim // num_heads``.

    Args:
        embed_dim: model width ``E``.
        num_heads: ``H``; must divide ``embed_dim``.
        max_relative_position: ``K``; offsets are clipped to ``[-K, K]``, so tables have ``2K + 1`` rows.
        dropout: dropout on the attention weights, in training mode only.
        bias: biases on the four projections.
        relative_keys: learn the key-side table ``rel_k`` (``a^K``).
        relative_values: learn the value-side table ``rel_v`` (``a^V``).
        share_heads: one (2K+1, D) table per side shared by all heads (Shaw et al.), else (H, 2K+1, D).
        backend: passed to :func:`relattn.relative_attention`.

    Initialisation: the query, key and value projections are Xavier-uniform with zero bias and the
    output projection is ``nn.Linear``'s default with zero bias (as ``nn.MultiheadAttention``);
    the tables are ``N(0, 1) * sqrt(2 / (2K + 1 + D))``, the spec's Glorot-normal scale.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_relative_position: int = 16,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        relative_keys: bool = True,
        relative_values: bool = True,
        share_heads: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        from .backends import check_name

        check_name(backend)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.max_relative_position = check_max_relative_position(max_relative_position)
        self.dropout, self.backend, self.share_heads = dropout, backend, share_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        table = (2 * self.max_relative_position + 1, self.head_dim)
        if not share_heads:
            table = (num_heads, *table)
        self.rel_k = nn.Parameter(torch.empty(table, **factory)) if relative_keys else None
        self.rel_v = nn.Parameter(torch.empty(table, **factory)) if relative_values else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
        self.out_proj.reset_parameters()
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        std = math.sqrt(2.0 / (2 * self.max_relative_position + 1 + self.head_dim))
        for table in (self.rel_k, self.rel_v):
            if table is not None:
                nn.init.normal_(table, std=std)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"max_relative_position={self.max_relative_position}, share_heads={self.share_heads}, "
                f"relative_keys={self.rel_k is not None}, relative_values={self.rel_v is not None}, "
                f"backend={self.backend!r}")

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend ``query`` (B, N, E) to ``key`` (B, M, E) / ``value`` (B, M, E); self-attention if None.

        Masks follow ``nn.MultiheadAttention``: ``key_padding_mask`` (B, M) and ``attn_mask``
        ((N, M), (B*H, N, M) or (B, H, N, M)) are bool with True = *not allowed*, or float (added).
        ``is_causal=True`` forbids attending to later positions (no mask needed, unlike
        nn.MultiheadAttention where it is only a hint). With ``kv_cache``, this call's keys and values
        are appended to the cache and queries are placed after the cached positions, so ``M`` and the
        masks count cached keys too.

        Returns ``(output (B, N, E), weights)``; weights are None unless ``need_weights``, then
        (B, N, M) averaged over heads or (B, H, N, M) (computed by the dense path).
        """
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (B, N, {self.embed_dim}); got {tuple(query.shape)}")
        key = query if key is None else key
        value = key if value is None else value
        for name, t in (("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[-1] != self.embed_dim or t.shape[0] != query.shape[0]:
                raise ValueError(f"{name} must be (B={query.shape[0]}, M, {self.embed_dim}); got {tuple(t.shape)}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value must have the same length; got {key.shape[1]} and {value.shape[1]}")
        b = query.shape[0]
        q, k, v = self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        offset = 0
        if kv_cache is not None:
            offset = len(kv_cache)
            k, v = kv_cache.update(k, v)
        m = k.shape[2]
        mask = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != (b, m):
                raise ValueError(f"key_padding_mask must be (B, M) = ({b}, {m}); got {tuple(key_padding_mask.shape)}")
            mask = _mha_mask_to_allowed("key_padding_mask", key_padding_mask[:, None, None, :], b, self.num_heads)
        if attn_mask is not None:
            mask = _combine(mask, _mha_mask_to_allowed("attn_mask", attn_mask, b, self.num_heads), q.dtype)
        dropout = self.dropout if self.training else 0.0
        rel_k = None if self.rel_k is None else self.rel_k.to(q.dtype)
        rel_v = None if self.rel_v is None else self.rel_v.to(q.dtype)
        common = dict(max_relative_position=self.max_relative_position, attn_mask=mask, is_causal=is_causal,
                      query_offset=offset)
        weights = None
        if need_weights:
            from .backends.dense import dense_attention
            from .functional import validate

            call = validate(q, k, v, rel_k, rel_v, dropout_p=dropout, scale=None, **common)
            out, weights = dense_attention(call, need_weights=True)
            if average_attn_weights:
                weights = weights.mean(1)
        else:
            out = relative_attention(q, k, v, rel_k, rel_v, dropout_p=dropout, backend=self.backend, **common)
        out = self.out_proj(out.transpose(1, 2).reshape(b, -1, self.embed_dim))
        return out, weights


__all__ = ["KVCache", "RelativeMultiheadAttention"]
