"""``RelativeMultiheadAttention``: relative attention shaped like ``nn.MultiheadAttention``, its positions a scheme
(:mod:`relattn.schemes`); ``from_mha`` upgrades an ``nn.MultiheadAttention``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .arguments import AttentionArgs
from .backends import why_not
from .cache import KVCache
from .functional import additive_mask, attend, attend_with_weights
from .padding import packed_self_attention, packing_of, split_heads, traced_mha_padding
from .positions import LogBuckets, T5Buckets
from .schemes import Disentangled, Scheme, Shaw, T5Bias, TransformerXL, as_scheme

# Every parameter name a scheme may register on the module (None where the scheme has none): the state-dict keys.
SCHEME_PARAMETERS = ("rel_k", "rel_v", "rel_q", "rel_bias", "pos_proj", "content_bias", "position_bias")

_MASKS = {"key_padding_mask": "bool (True = padding: the key is not attended) or floating (added to the scores)",
          "attn_mask": "bool (True = not allowed to attend) or floating (added to the scores)"}  # as nn.MHA reads them


def _check_mask_dtype(name: str, mask) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be {_MASKS[name]}; got {mask.dtype} of shape {tuple(mask.shape)}")


def _attn_mask_4d(mask: torch.Tensor, batch: int, heads: int, n: int, m: int) -> torch.Tensor:
    """An nn.MultiheadAttention ``attn_mask`` ((N, M) or (B, H, N, M), broadcastable, or (B*num_heads, N, M)) as
    4-D, its shape checked as passed."""
    shape = tuple(mask.shape)
    if mask.dim() == 2 and all(s in (1, t) for s, t in zip(shape, (n, m), strict=True)):
        return mask[None, None]
    if mask.dim() == 3 and shape == (batch * heads, n, m):
        return mask.view(batch, heads, n, m)
    if mask.dim() == 4 and all(s in (1, t) for s, t in zip(shape, (batch, heads, n, m), strict=True)):
        return mask
    if mask.dim() == 3 and shape[1:] == (n, m):
        raise ValueError(f"attn_mask 3-D must be (B*num_heads, N, M) with B*num_heads={batch * heads}; got {shape}")
    raise ValueError(f"attn_mask must be (N, M) = ({n}, {m}), (B*num_heads, N, M) = ({batch * heads}, {n}, {m}) or "
                     f"broadcast to (B, H, N, M) = ({batch}, {heads}, {n}, {m}); got {shape}")


def _allowed_or_added(mask: torch.Tensor) -> torch.Tensor:
    """nn.MultiheadAttention's form (bool True = masked out, or float added) -> the op's (bool True = may attend)."""
    return ~mask if mask.dtype == torch.bool else mask


def _combine(a: torch.Tensor | None, b: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """Two masks in the op's form as one: both bool -> bool; else additive float."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    return additive_mask(a, dtype) + additive_mask(b, dtype)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class RelativeMultiheadAttention(nn.Module):
    """Multi-head attention with relative position representations, shaped like ``nn.MultiheadAttention``.

    Inputs ``query`` (B, N, E), ``key`` (B, M, kdim), ``value`` (B, M, vdim) with ``batch_first=True``
    (the default here), (N, B, E) ... with ``batch_first=False``, or unbatched (N, E), (M, kdim),
    (M, vdim); the output has the query's layout. Head dim ``D = embed_dim // num_heads``.

    Args:
        embed_dim: model width ``E``.
        num_heads: ``H``; must divide ``embed_dim``.
        positions: the position scheme (:mod:`relattn.schemes`), which owns the relative parameters and makes each
            call's relative terms: :class:`~relattn.schemes.Shaw` (learned ``a^K``/``a^V`` tables over a window;
            ``a^Q``, a scalar bias per row, tied or per-head tables as options),
            :class:`~relattn.schemes.Disentangled` (DeBERTa's ``a^K`` and ``a^Q``), :class:`~relattn.schemes.T5Bias`
            (T5's scalar bias per head and bucket, scale 1) or :class:`~relattn.schemes.TransformerXL` (the
            Conformer's projected sinusoids with the ``u``/``v`` biases). A window as the op takes it (an int ``K``,
            ``(left, right)``, a ``LogBuckets``, a ``T5Buckets``) is ``Shaw(window)``; None (the default) is
            ``Shaw(16)``. T5's attention: ``RelativeMultiheadAttention(E, H, T5Bias(T5Buckets()), bias=False)``.
        num_kv_heads: key/value heads ``Hkv`` for grouped-query attention (``H % Hkv == 0``; query head ``h``
            reads key/value head ``h // (H // Hkv)``): ``k_proj`` and ``v_proj`` give ``Hkv * D`` features, and a
            ``KVCache`` holds ``Hkv`` heads. Default ``H`` (multi-head attention); 1 is multi-query attention.
        dropout: dropout on the attention weights, in training mode only.
        bias: biases on the four projections.
        kdim, vdim: features of ``key`` and ``value`` (default ``embed_dim``); positions as in self-attention.
        batch_first: (B, N, E) if True (the default), (N, B, E) if False.
        backend: passed to :func:`relattn.relative_attention`. A backend that will refuse this module's calls
            (dropout it does not serve, a head dim, a ``device`` or ``dtype`` it does not take, a missing package)
            is refused here, with every reason.

    Initialisation: q, k, v projections Xavier-uniform, the output projection ``nn.Linear``'s default, zero biases
    (as ``nn.MultiheadAttention``); the scheme's parameters as the scheme says. :meth:`from_mha` instead takes an
    ``nn.MultiheadAttention``'s weights and starts the scheme's parameters at zero.

    Differences from ``nn.MultiheadAttention`` (everything else, with the scheme's parameters at zero, computes
    what it computes, outputs and gradients):

    1. The third positional constructor argument is ``positions``; the rest are keyword-only.
    2. ``batch_first`` defaults to True (nn.MultiheadAttention: False).
    3. ``need_weights`` defaults to False, so ``forward`` returns ``(out, None)`` and the fast backends
       run; pass ``need_weights=True`` for the weights (computed by the "dense" backend).
    4. ``key`` and ``value`` may be omitted: ``key = query``, ``value = key`` (self-attention).
    5. ``is_causal=True`` forbids later keys by itself (no ``attn_mask`` needed); with an ``attn_mask``
       both apply. In nn.MultiheadAttention it is only a hint about ``attn_mask``.
    6. A query row with no key to attend to gives zeros before ``out_proj`` (so ``out_proj.bias``), and
       zero weights and gradients, where nn.MultiheadAttention gives NaN.
    7. No ``add_bias_kv`` or ``add_zero_attn``: the key they append has no position (:meth:`from_mha` refuses them).
    8. Parameters are the ``nn.Linear`` modules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` and the
       scheme's, under its names (``rel_k``, ``rel_v``, ``rel_q``, ``rel_bias``; Transformer-XL's ``pos_proj``,
       ``content_bias``, ``position_bias``; each absent one None); ``in_proj_weight`` and ``in_proj_bias`` are None
       (as ``_qkv_same_embed_dim`` is False), so state-dict keys differ. Bring an nn.MultiheadAttention (or its
       state dict, loaded into one) over with :meth:`from_mha`. In ``nn.TransformerEncoderLayer`` /
       ``nn.TransformerDecoderLayer`` this module works as ``self_attn`` / ``multihead_attn``; the layers
       then skip their fused inference fast path (it would bypass the attention module). An
       ``nn.TransformerEncoder`` also needs ``use_nested_tensor = False``, which :func:`upgrade_mha` sets.
    9. ``attn_mask`` may also be (B, H, N, M); ``forward`` takes a keyword-only ``kv_cache``; ``num_kv_heads``
       gives grouped-query attention.
    10. No nested-tensor fast path, and dropout draws different random numbers.
    11. Self-attention with a right-aligned ``key_padding_mask`` (each row its tokens first, then padding, as
       tokenizers pad) and no ``attn_mask``, cache or weights: the output is **zero at the padded positions** (no
       ``out_proj.bias`` either) and no gradient flows from them, as ``nn.TransformerEncoder``'s nested-tensor path
       gives zeros there; nn.MultiheadAttention lets a padded query attend the real keys. Every real position gets
       what the masked call gives. When at least ``relattn.padding.PACK_FROM`` (10%) of the positions are padding
       the call runs packed (:func:`relattn.padding.packed_self_attention`: the real tokens only, projections
       included), below that masked (then zeroed); under ``torch.compile`` masked (then zeroed: the lengths are
       data there). Other padding (left-aligned, holes) keeps nn.MultiheadAttention's behaviour.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        positions: Scheme | int | tuple[int, int] | LogBuckets | T5Buckets | None = None,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got {type(batch_first).__name__}")
        kv_heads = num_heads if num_kv_heads is None else _positive("num_kv_heads", num_kv_heads)
        if num_heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({num_heads})")
        self.positions = scheme = as_scheme(positions)
        head_dim = embed_dim // num_heads
        refused = why_not(backend, dropout=dropout > 0, head_dim=head_dim, dtype=dtype,
                          device=None if device is None else torch.device(device).type, **scheme.kinds())
        if refused:
            raise ValueError(f"backend {backend!r} cannot serve this module: {'; '.join(refused)}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, kv_heads, head_dim
        self.kdim = embed_dim if kdim is None else _positive("kdim", kdim)
        self.vdim = embed_dim if vdim is None else _positive("vdim", vdim)
        self.batch_first, self.dropout, self.backend = batch_first, dropout, backend
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        for name in SCHEME_PARAMETERS:
            setattr(self, name, None)
        for name, value in scheme.create(embed_dim, num_heads, head_dim, factory).items():
            setattr(self, name, value)
        # nn.MultiheadAttention's attributes that torch.nn.Transformer*Layer inspect: with no packed in-projection
        # they never take their fused fast path (which would read in_proj_weight and bypass this module).
        self.register_parameter("in_proj_weight", None)
        self.register_parameter("in_proj_bias", None)
        self._qkv_same_embed_dim = False
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.reset_parameters()

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention, positions=16, *, backend: str = "auto") -> RelativeMultiheadAttention:
        """A module with ``mha``'s sizes, layout, dropout, weights (copied), device, dtype and mode; ``positions``
        (a scheme or a window, as the constructor takes it) and ``backend`` are the constructor's.

        The scheme's parameters start at zero, so until they are trained it computes what ``mha`` computes (a scheme
        with its own ``scale``, such as :class:`~relattn.schemes.T5Bias`, changes the scale). To upgrade a model in
        place: ``model.attn = RelativeMultiheadAttention.from_mha(model.attn, 16)``, or :func:`upgrade_mha` for
        every ``nn.MultiheadAttention`` in a model. For a saved nn.MultiheadAttention state dict, load it into an
        ``nn.MultiheadAttention`` of the same sizes first (``mha.load_state_dict(sd)``), then call this.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be an nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None:
            raise ValueError("mha has add_bias_kv=True, which RelativeMultiheadAttention does not support")
        if mha.add_zero_attn:
            raise ValueError("mha has add_zero_attn=True, which RelativeMultiheadAttention does not support")
        out_w = mha.out_proj.weight
        mod = cls(mha.embed_dim, mha.num_heads, positions, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  kdim=mha.kdim, vdim=mha.vdim, batch_first=mha.batch_first, backend=backend, device=out_w.device,
                  dtype=out_w.dtype)
        if mha.in_proj_weight is not None:
            weights = mha.in_proj_weight.chunk(3)
        else:
            weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        projections = (mod.q_proj, mod.k_proj, mod.v_proj)
        with torch.no_grad():
            for proj, w in zip(projections, weights, strict=True):
                proj.weight.copy_(w)
            if mha.in_proj_bias is not None:
                for proj, b in zip(projections, mha.in_proj_bias.chunk(3), strict=True):
                    proj.bias.copy_(b)
            mod.out_proj.weight.copy_(out_w)
            if mod.out_proj.bias is not None:
                mod.out_proj.bias.copy_(mha.out_proj.bias)
        mod.positions.start_at_zero(mod)
        return mod.train(mha.training)

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
        self.out_proj.reset_parameters()
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        self.positions.reset(self)

    def extra_repr(self) -> str:
        dims = "" if self.kdim == self.vdim == self.embed_dim else f"kdim={self.kdim}, vdim={self.vdim}, "
        kv = "" if self.num_kv_heads == self.num_heads else f"num_kv_heads={self.num_kv_heads}, "
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, {kv}{dims}positions={self.positions!r}, "
                f"batch_first={self.batch_first}, backend={self.backend!r}")

    def _check_inputs(self, query, key, value) -> bool:
        """Shapes of the three inputs; returns whether they are batched."""
        layout = "(B, N, E)" if self.batch_first else "(N, B, E)"
        if query.dim() not in (2, 3) or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be {layout.replace('E', str(self.embed_dim))} or unbatched "
                             f"(N, {self.embed_dim}); got {tuple(query.shape)}")
        batched = query.dim() == 3
        batch = query.shape[0 if self.batch_first else 1] if batched else None
        for name, t, dim in (("key", key, self.kdim), ("value", value, self.vdim)):
            if batched:
                ok = t.dim() == 3 and t.shape[-1] == dim and t.shape[0 if self.batch_first else 1] == batch
                want = f"(B={batch}, M, {dim})" if self.batch_first else f"(M, B={batch}, {dim})"
            else:
                ok, want = t.dim() == 2 and t.shape[-1] == dim, f"unbatched (M, {dim}) like query"
            if not ok:
                raise ValueError(f"{name} must be {want}; got {tuple(t.shape)}")
        at = 1 if batched and self.batch_first else 0
        if key.shape[at] != value.shape[at]:
            raise ValueError(f"key and value must have the same length; got {key.shape[at]} and {value.shape[at]}")
        return batched

    def _masks(self, key_padding_mask, attn_mask, *, batched: bool, b: int, n: int, m: int, dtype):
        """The two nn.MultiheadAttention masks, checked as passed, as one mask in the op's form (or None)."""
        mask = None
        if key_padding_mask is not None:
            _check_mask_dtype("key_padding_mask", key_padding_mask)
            want = (b, m) if batched else (m,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"key_padding_mask must be {'(B, M)' if batched else '(M,)'} = {want}; "
                                 f"got {tuple(key_padding_mask.shape)}")
            mask = _allowed_or_added(key_padding_mask.reshape(b, 1, 1, m))
        if attn_mask is not None:
            _check_mask_dtype("attn_mask", attn_mask)
            mask = _combine(mask, _allowed_or_added(_attn_mask_4d(attn_mask, b, self.num_heads, n, m)), dtype)
        return mask

    def _options(self, dtype: torch.dtype, n: int, m: int, offset: int, is_causal: bool) -> dict:
        """The op's keywords for one call of this module but the tensors and the call's own: the scheme's relative
        terms (made for ``n`` queries at ``offset`` and ``m`` keys, in ``dtype``) and the module's options."""
        (terms := self.positions.terms(self, dtype, n, m, offset)).update(
            is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_kv_heads != self.num_heads, backend=self.backend)
        return terms

    def _padding_alone(self, query, key_padding_mask, batched: bool, is_causal: bool):
        """Self-attention masked by a ``key_padding_mask`` alone: ``(output, None)`` when it runs packed, else
        ``(None, where to zero the masked call's output)`` (a :class:`Packing`, a traced (B, N) mask, or None)."""
        b, n = (query.shape[:2] if self.batch_first else query.shape[1::-1]) if batched else (1, query.shape[0])
        self._masks(key_padding_mask, None, batched=batched, b=b, n=n, m=n, dtype=query.dtype)  # its checks
        if not batched:
            return None, None
        packing = packing_of(key_padding_mask, "key_padding_mask", batch_first=self.batch_first)
        if packing is not None and packing.worth_packing:
            n = packing.max_seqlen
            out = packed_self_attention(packing, query, (self.q_proj, self.k_proj, self.v_proj), self.num_heads,
                                        self.out_proj, terms=lambda dtype: self._options(dtype, n, n, 0, is_causal))
            return out, None
        if torch.compiler.is_compiling():  # the lengths are data: zeros where eager's are
            return None, traced_mha_padding(key_padding_mask)
        return None, packing  # little padding: the masked call, then zeros at the padding all the same

    def _project_kv(self, key, value, bf: bool):
        heads = self.num_kv_heads
        return (split_heads(self.k_proj(key), heads=heads, batch_first=bf),
                split_heads(self.v_proj(value), heads=heads, batch_first=bf))

    def _keys_values(self, key, value, kv_cache: KVCache | None, bf: bool, self_attention: bool):
        """This call's keys and values (B, Hkv, M, D|Dv), projected or from ``kv_cache``, and the position of its
        first query (``self_attention``: the caller's key was its query, before unbatched inputs got a batch dim).
        The cache is only read here; :meth:`_cache_update` writes it once the call is checked."""
        if kv_cache is None:
            return *self._project_kv(key, value, bf), 0
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be a KVCache or None, got {type(kv_cache).__name__}")
        if self_attention:
            if kv_cache.kind == "cross":
                kv_cache.claim("self")  # raises: a cross-attention cache handed self-attention keys
            return *self._project_kv(key, value, bf), kv_cache.position
        if kv_cache.kind == "self":
            kv_cache.claim("cross")  # raises: a self-attention cache handed other keys than queries
        memory = (key, value) if bf else (key.transpose(0, 1), value.transpose(0, 1))
        if kv_cache.holds_memory(*memory):
            return kv_cache.k, kv_cache.v, kv_cache.position
        return *self._project_kv(key, value, bf), kv_cache.position

    @staticmethod
    def _check_context_parallel(self_attention: bool, value_is_key: bool, kv_cache, need_weights: bool) -> None:
        if not (self_attention and value_is_key):
            raise ValueError("context_parallel serves self-attention only (key and value None or query itself)")
        if kv_cache is not None:
            raise ValueError("context_parallel takes no kv_cache (a cache holds one process's keys)")
        if need_weights:
            raise ValueError("context_parallel returns no attention weights: pass need_weights=False")

    @staticmethod
    def _cache_update(kv_cache, self_attention: bool, key, value, k, v, n: int, bf: bool):
        """Write this call's keys and values (or memory) into ``kv_cache``; returns the keys and values to use."""
        if kv_cache is None:
            return k, v
        if self_attention:
            return kv_cache.update(k, v)
        if kv_cache.kind is None:
            kv_cache.set_memory(*((key, value) if bf else (key.transpose(0, 1), value.transpose(0, 1))), k, v)
        kv_cache.advance(n)
        return k, v

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                key_padding_mask: Tensor | None = None, need_weights: bool = False, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False, *, kv_cache: KVCache | None = None,
                context_parallel=None) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` to ``key`` / ``value``; self-attention if they are None.

        Shapes (``batch_first=True``): ``query`` (B, N, E), ``key`` (B, M, kdim), ``value`` (B, M, vdim);
        with ``batch_first=False`` the first two dims swap; unbatched inputs drop B.
        Masks follow ``nn.MultiheadAttention``: ``key_padding_mask`` (B, M) ((M,) unbatched) and
        ``attn_mask`` ((N, M), (B*H, N, M) or (B, H, N, M)) are bool with True = *not allowed*, or
        float (added). ``is_causal=True`` forbids attending to later positions (no mask needed, unlike
        nn.MultiheadAttention where it is only a hint). With ``kv_cache``, this call's keys and values
        are appended to the cache and queries are placed after the cached positions, so ``M`` and the
        masks count cached keys too.

        Returns ``(output, weights)``: output shaped like ``query``; weights None unless
        ``need_weights``, then (B, N, M) averaged over heads or (B, H, N, M) ((N, M) or (H, N, M)
        unbatched), computed by the dense path.

        In cross-attention (``key`` not ``query``) a ``kv_cache`` holds the memory's keys and values once: the
        first call projects them, later calls (with the same ``key`` and ``value``) reuse them, and each call's
        queries continue after the previous calls' queries. See :class:`KVCache`.

        ``context_parallel``: a :class:`relattn.distributed.ContextParallel`: ``query`` is this rank's part of a
        sequence split over its process group (self-attention only, no cache, no weights), and so is the output;
        the module's own forward then runs with the context-parallel ring in place of the op, so every option
        (tables, ``rel_q``, grouped heads, windows) is the same. Masks then cover the local queries' rows and
        every key of the whole sequence (``M = P n``, in global position order): ``key_padding_mask`` (B, P n).
        """
        key = query if key is None else key
        value = key if value is None else value
        self_attention = key is query
        if context_parallel is not None:
            self._check_context_parallel(self_attention, value is key, kv_cache, need_weights)
        batched = self._check_inputs(query, key, value)
        zero_at = None
        if self_attention and value is key and kv_cache is None and context_parallel is None and not need_weights \
                and attn_mask is None and key_padding_mask is not None:
            out, zero_at = self._padding_alone(query, key_padding_mask, batched, is_causal)
            if out is not None:
                return out, None
        if not batched:
            query, key, value = query[None], key[None], value[None]
        bf = self.batch_first or not batched
        args = self._arguments(query, key, value, key_padding_mask, attn_mask, is_causal, kv_cache, context_parallel,
                               batched=batched, bf=bf, self_attention=self_attention)
        out, weights = self._run(args, need_weights, average_attn_weights, batched, context_parallel)
        out = self.out_proj((out.transpose(1, 2) if bf else out.permute(2, 0, 1, 3)).flatten(2))
        if isinstance(zero_at, Tensor):
            out = out.masked_fill((zero_at if self.batch_first else zero_at.T)[..., None], 0)
        elif zero_at is not None:
            out = zero_at.zero_padding(out)
        return (out if batched else out[0]), weights

    def _arguments(self, query, key, value, key_padding_mask, attn_mask, is_causal: bool, kv_cache, context_parallel,
                   *, batched: bool, bf: bool, self_attention: bool) -> AttentionArgs:
        """The op's arguments for one call (inputs with a batch dim): the projections as heads (the keys and values
        through ``kv_cache``, which is written once the call is checked), the masks in the op's form, the scheme's
        terms and the module's options."""
        q = split_heads(self.q_proj(query), heads=self.num_heads, batch_first=bf)
        k, v, offset = self._keys_values(key, value, kv_cache, bf, self_attention)
        b, n = q.shape[0], q.shape[2]
        m = k.shape[2] + (offset if self_attention and kv_cache is not None else 0)
        if context_parallel is not None:
            m = context_parallel.key_length(m)
        mask = self._masks(key_padding_mask, attn_mask, batched=batched, b=b, n=n, m=m, dtype=q.dtype)
        # after the checks: a refused call leaves the cache as it was
        k, v = self._cache_update(kv_cache, self_attention, key, value, k, v, n, bf)
        return AttentionArgs(q, k, v, **self._options(q.dtype, n, m, offset, is_causal), query_offset=offset,
                             attn_mask=mask)

    def _run(self, args: AttentionArgs, need_weights: bool, average: bool, batched: bool, context_parallel):
        """The op on one call's arguments: (B, H, N, Dv) and the weights asked for (or None)."""
        if need_weights:
            out, weights = attend_with_weights(args)
            weights = weights.mean(1) if average else weights
            return out, (weights if batched else weights[0])
        if context_parallel is None:
            return attend(args), None
        return context_parallel.attend(args), None


def upgrade_mha(model: nn.Module, positions=16, *, backend: str = "auto") -> nn.Module:
    """Replace, in place, every ``nn.MultiheadAttention`` inside ``model`` (``model`` itself excepted) by
    :meth:`RelativeMultiheadAttention.from_mha` of it, under the same name; returns ``model``.

    ``positions`` (a scheme or a window) and ``backend`` are :meth:`~RelativeMultiheadAttention.from_mha`'s. With the
    scheme's parameters at zero the model computes what it did. ``nn.TransformerEncoder`` instances get
    ``use_nested_tensor = False``: their inference fast path would hand the attention modules nested tensors.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(parent, name, RelativeMultiheadAttention.from_mha(child, positions, backend=backend))
        if isinstance(parent, nn.TransformerEncoder):
            parent.use_nested_tensor = False
    return model


__all__ = ["Disentangled", "KVCache", "RelativeMultiheadAttention", "Shaw", "T5Bias", "TransformerXL", "upgrade_mha"]
