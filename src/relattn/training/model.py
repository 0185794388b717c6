"""A small Transformer built from :class:`relattn.RelativeMultiheadAttention`: encoder stack and byte-level LM.

Notation: ``B`` batch, ``N`` new positions in a call, ``L`` positions already in the KV cache, ``E`` the
model width ``d_model``, ``V`` the vocabulary size.

Both models use pre-LayerNorm blocks (``x + attn(ln(x))``, ``x + ff(ln(x))``) with a final LayerNorm.
Position information comes from the config's ``positions``:

- ``"relative"``: Shaw et al.'s clipped relative tables inside every attention layer;
- ``"absolute"``: sinusoidal encodings (Vaswani et al., 2017) added to the input, no tables;
- ``"none"``: neither (a causal LM can still infer positions from the mask).

The same attention module serves all three (``Shaw(keys=False, values=False)`` for the last two),
so comparisons between them differ only in where positions come from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import ContextParallel
from ..modules import KVCache, RelativeMultiheadAttention, Shaw

POSITIONS = ("relative", "absolute", "none")


@dataclass
class TransformerConfig:
    """Sizes and options of :class:`TransformerLM` and :class:`TransformerEncoder`.

    The defaults are the ``relattn train`` model: about 0.8M parameters, small enough to learn
    recognisable English from 465 kB of bytes in a couple of CPU minutes.
    """

    vocab_size: int = 256
    """Bytes: any UTF-8 text is a sequence over 256 symbols, so there is no tokenizer to ship."""
    d_model: int = 128
    """Model width ``E``; a multiple of ``n_heads``."""
    n_heads: int = 4
    """Attention heads per layer; head dim is ``d_model // n_heads`` (32 by default)."""
    n_layers: int = 4
    """Transformer blocks."""
    d_ff: int = 512
    """Hidden width of the feed-forward sublayer, ``4 * d_model`` as in Vaswani et al."""
    dropout: float = 0.0
    """On attention weights and sublayer outputs; 0 because a 2-minute run underfits rather than overfits."""
    max_relative_position: int = 16
    """``K``: offsets beyond ``±K`` share a table row (Shaw et al. found 16 enough). Only for "relative"."""
    positions: str = "relative"
    """Where position information comes from: "relative" | "absolute" (sinusoidal) | "none"."""
    share_heads: bool = True
    """One relative table per layer shared by all heads (Shaw et al.), instead of one per head."""
    relative_values: bool = True
    """Learn the value-side table ``a^V`` as well as the key-side ``a^K`` (Shaw et al. use both)."""
    backend: str = "auto"
    """Attention backend, see :data:`relattn.BACKENDS`; "auto" picks the fastest that serves the call."""
    context: int = 64
    """Training context length in bytes. The model itself accepts any length; this records what it saw."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection (Press & Wolf, 2017): fewer parameters."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if isinstance(self.max_relative_position, bool) or not isinstance(self.max_relative_position, int) \
                or self.max_relative_position < 0:
            raise ValueError(f"max_relative_position must be a non-negative int, got {self.max_relative_position!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}; got {self.positions!r}")
        from ..backends import check_name

        check_name(self.backend)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error, missing ones take the defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig fields: {unknown}")
        return cls(**data)


def sinusoidal_positions(length: int, dim: int, *, offset: int = 0, dtype=torch.float32, device=None) -> torch.Tensor:
    """(length, dim) encodings of positions ``offset .. offset + length - 1`` (Vaswani et al., 2017).

    ``PE[p, 2i] = sin(p / 10000^(2i/dim))``, ``PE[p, 2i+1] = cos(p / 10000^(2i/dim))``.
    """
    pos = torch.arange(offset, offset + length, dtype=torch.float64, device=device)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64, device=device) * (-math.log(10000.0) / dim))
    angles = pos * freq
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)[:, :dim]
    return pe.to(dtype)


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: (B, N, E) -> (B, N, E)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        relative = config.positions == "relative"
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = RelativeMultiheadAttention(
            config.d_model, config.n_heads,
            Shaw(config.max_relative_position, keys=relative, values=relative and config.relative_values,
                 share_heads=config.share_heads), dropout=config.dropout, backend=config.backend,
        )
        self.ln2 = nn.LayerNorm(config.d_model)
        self.ff = nn.Sequential(nn.Linear(config.d_model, config.d_ff), nn.GELU(),
                                nn.Linear(config.d_ff, config.d_model))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x, *, key_padding_mask=None, is_causal=False, kv_cache: KVCache | None = None,
                context_parallel: ContextParallel | None = None):
        a, _ = self.attn(self.ln1(x), key_padding_mask=key_padding_mask, is_causal=is_causal, kv_cache=kv_cache,
                         context_parallel=context_parallel)
        x = x + self.drop(a)
        return x + self.drop(self.ff(self.ln2(x)))


class TransformerEncoder(nn.Module):
    """A stack of ``n_layers`` pre-LN blocks and a final LayerNorm: features (B, N, E) -> (B, N, E).

    With ``positions="absolute"`` the sinusoidal encodings of positions ``L .. L + N - 1`` are added to
    the input, where ``L`` is the length already in ``kv_caches`` (0 without caches); with "relative"
    the tables inside each attention layer carry positions; with "none" nothing does (a bidirectional
    encoder is then permutation-equivariant).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        """One empty :class:`relattn.KVCache` per layer, for incremental (causal) decoding.

        ``max_len=None`` gives growing caches; an int gives static ones, preallocated for ``max_len``
        positions and written in place (inference only).
        """
        return [KVCache(max_len) for _ in self.blocks]

    def forward(
        self,
        x: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        kv_caches: list[KVCache] | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> torch.Tensor:
        """Encode ``x`` (B, N, E); ``key_padding_mask`` (B, L + N) bool, True = padding (ignored).

        ``kv_caches``: one cache per layer (see :meth:`new_caches`); this call's keys and values are
        appended and its positions continue after the cached ones.
        ``context_parallel``: ``x`` is this rank's part of a sequence split over a process group (see
        :mod:`relattn.distributed`), and so is the result; no caches or padding mask then.
        """
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"x must be (B, N, {self.config.d_model}); got {tuple(x.shape)}")
        if kv_caches is not None and len(kv_caches) != len(self.blocks):
            raise ValueError(f"kv_caches must hold one cache per layer ({len(self.blocks)}); got {len(kv_caches)}")
        if context_parallel is not None and (kv_caches is not None or key_padding_mask is not None):
            raise ValueError("context_parallel takes no kv_caches and no key_padding_mask")
        if self.config.positions == "absolute" and context_parallel is not None:
            n, cp = x.shape[1], context_parallel
            x = x + sinusoidal_positions(n * cp.world, x.shape[2], dtype=x.dtype, device=x.device)[cp.positions(n)]
        elif self.config.positions == "absolute":
            offset = len(kv_caches[0]) if kv_caches is not None else 0
            x = x + sinusoidal_positions(x.shape[1], x.shape[2], offset=offset, dtype=x.dtype, device=x.device)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            cache = None if kv_caches is None else kv_caches[i]
            x = block(x, key_padding_mask=key_padding_mask, is_causal=is_causal, kv_cache=cache,
                      context_parallel=context_parallel)
        return self.ln_f(x)


class TransformerLM(nn.Module):
    """Decoder-only (causal) language model: token ids (B, N) -> next-token logits (B, N, V).

    Token embeddings are initialised ``N(0, 1/E)`` and multiplied by ``sqrt(E)`` (Vaswani et al.), so
    tokens and sinusoidal positions start on the same scale; with ``tie_embeddings`` the output
    projection is the embedding matrix, giving logits of unit scale at initialisation.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        nn.init.normal_(self.embed.weight, std=config.d_model ** -0.5)
        self.encoder = TransformerEncoder(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        """See :meth:`TransformerEncoder.new_caches`."""
        return self.encoder.new_caches(max_len)

    def forward(self, tokens: torch.Tensor, *, kv_caches: list[KVCache] | None = None,
                context_parallel: ContextParallel | None = None) -> torch.Tensor:
        """Logits (B, N, V) for ids ``tokens`` (B, N); with ``kv_caches``, ``tokens`` continue the cached ones.
        With ``context_parallel``, ``tokens`` (B, n) are this rank's part of the sequences and so are the logits."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be (B, N) int64; got {tuple(tokens.shape)} {tokens.dtype}")
        x = self.embed(tokens) * math.sqrt(self.config.d_model)
        return self.head(self.encoder(x, is_causal=True, kv_caches=kv_caches, context_parallel=context_parallel))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats of ``targets`` (B, N) given ``tokens`` (B, N)."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``prompt`` (N,) or (B, N) by ``max_new_tokens`` sampled ids; returns prompt + new ids.

        The prompt is encoded once into one static KV cache per layer (preallocated for the prompt and
        the new tokens, written in place), then each step feeds only the new token. ``temperature=0`` is
        greedy decoding; ``top_k`` keeps the k most likely ids. Runs in eval mode (no dropout) and restores
        the previous mode.
        """
        squeeze = prompt.dim() == 1
        tokens = prompt[None] if squeeze else prompt
        if tokens.dim() != 2 or tokens.shape[1] == 0 or tokens.dtype != torch.int64:
            raise ValueError(f"prompt must be a non-empty (N,) or (B, N) int64 tensor; got {tuple(prompt.shape)} "
                             f"{prompt.dtype}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"prompt ids must be in [0, {self.config.vocab_size}); got {tokens.min()}..{tokens.max()}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= self.config.vocab_size):
            raise ValueError(f"top_k must be None or an int in [1, {self.config.vocab_size}], got {top_k!r}")
        was_training = self.training
        self.eval()
        try:
            caches = self.new_caches(max_len=tokens.shape[1] + max_new_tokens)
            logits = self(tokens, kv_caches=caches)[:, -1]
            out = [tokens]
            for step in range(max_new_tokens):
                logits = logits.float()
                if temperature == 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
                out.append(nxt)
                if step + 1 < max_new_tokens:
                    logits = self(nxt, kv_caches=caches)[:, -1]
            result = torch.cat(out, 1)
        finally:
            self.train(was_training)
        return result[0] if squeeze else result


__all__ = ["POSITIONS", "TransformerConfig", "TransformerEncoder", "TransformerLM", "sinusoidal_positions"]
