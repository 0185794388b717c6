"""``RelativeMultiheadAttention``: Shaw attention shaped like ``nn.MultiheadAttention``; ``from_mha`` upgrades one."""

from __future__ import annotations

import math

import torch
from torch import nn

from .arguments import AttentionArgs
from .backends import why_not
from .cache import KVCache
from .functional import additive_mask, attend, attend_varlen, attend_with_weights
from .padding import Packing, remembered, right_padding
from .positions import BUCKET_MAPS, LogBuckets, T5Buckets, check_beyond, check_positions, table_rows

_MASKS = {  # argument -> what its bool and float forms mean, as nn.MultiheadAttention takes them
    "key_padding_mask": "bool (True = padding: the key is not attended) or floating (added to the scores)",
    "attn_mask": "bool (True = not allowed to attend) or floating (added to the scores)",
}


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


def _right_packing(key_padding_mask: torch.Tensor, bf: bool) -> Packing | None:
    if key_padding_mask.dtype == torch.bool:
        padding = key_padding_mask
    elif key_padding_mask.is_floating_point():
        padding = key_padding_mask == float("-inf")
        if not torch.equal(padding, key_padding_mask != 0):
            return None
    else:
        return None
    packing = right_padding(padding, batch_first=bf)
    return packing if packing is not None and packing.padded else None


def _right_padding_traced(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: True at the padded positions of a right-aligned ``key_padding_mask`` (those
    :func:`_right_packing` packs, bool True or ``-inf`` only), all False for any other mask; from tensors alone (no
    host read), so that a traced call zeroes what an eager one does."""
    if key_padding_mask.dtype == torch.bool:
        padding, exact = key_padding_mask, True
    else:
        padding = key_padding_mask == float("-inf")
        exact = (padding == (key_padding_mask != 0)).all()
    return padding & (exact & (padding[:, 1:] >= padding[:, :-1]).all())


def sinusoids(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(L, dim) sinusoidal embeddings of ``positions`` (L,) (Vaswani et al.; Transformer-XL's relative encoding):
    column ``2c`` is ``sin(p / 10000^(2c/dim))``, column ``2c + 1`` its cosine, in ``positions``' dtype."""
    rate = torch.exp(torch.arange(0, dim, 2, dtype=positions.dtype, device=positions.device)
                     * (-math.log(10000.0) / dim))
    angles = positions[:, None] * rate[None, :]
    out = positions.new_zeros(len(positions), dim)
    out[:, 0::2] = torch.sin(angles)
    out[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return out


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
        num_kv_heads: key/value heads ``Hkv`` for grouped-query attention (``H % Hkv == 0``; query head ``h``
            reads key/value head ``h // (H // Hkv)``): ``k_proj`` and ``v_proj`` give ``Hkv * D`` features, and a
            ``KVCache`` holds ``Hkv`` heads. Default ``H`` (multi-head attention); 1 is multi-query attention.
        max_relative_position: ``K``; offsets are clipped to ``[-K, K]``, so tables have ``2K + 1`` rows. A pair
            ``(left, right)`` clips to ``[-left, right]`` (``left + right + 1`` rows). A
            :class:`relattn.positions.LogBuckets` maps offsets as DeBERTa does (tables of ``2 * span`` rows), a
            :class:`relattn.positions.T5Buckets` as T5 does (``num_buckets`` rows).
            None (the default): 16, or with ``transformer_xl`` no clipping at all (every offset of the call).
        beyond: ``"clip"`` (offsets beyond the window take the edge rows) or ``"zero"`` (no relative term).
        tie_tables: one table for keys and values (OpenNMT-py, CTranslate2): ``rel_v`` is ``rel_k``.
        dropout: dropout on the attention weights, in training mode only.
        bias: biases on the four projections.
        add_bias_kv, add_zero_attn: accepted for signature parity, but only ``False``: the extra key they
            append has no position, so its relative term is undefined (a ``ValueError`` names the argument).
        kdim, vdim: features of ``key`` and ``value`` (default ``embed_dim``); the relative tables apply
            as in self-attention (query ``i`` at position ``i``, key ``j`` at ``j``).
        batch_first: (B, N, E) if True (the default: this module was always batch-first), (N, B, E) if False.
        relative_keys: learn the key-side table ``rel_k`` (``a^K``); None: True unless ``transformer_xl``.
        relative_values: learn the value-side table ``rel_v`` (``a^V``); None: True unless ``transformer_xl``.
        position_to_content: learn the position-to-content table ``rel_q`` (``a^Q``: DeBERTa's p2c term, adding
            ``k_j . a^Q[idx_ij]`` to the scores), shaped like ``rel_k``.
        share_heads: one (2K+1, D) table per side shared by all heads (Shaw et al.), else (H, 2K+1, D).
        relative_bias: learn a scalar per table row, ``rel_bias`` ((2K+1,) shared, or (H, 2K+1) with
            ``share_heads=False``), added unscaled to the scores (the op's ``rel_bias``: T5's relative attention
            bias). T5's attention is ``RelativeMultiheadAttention(E, H, T5Buckets(), relative_keys=False,
            relative_values=False, relative_bias=True, share_heads=False, scale=1.0, bias=False)``.
        scale: the scores' scale, ``1/sqrt(D)`` when None (T5: 1.0).
        transformer_xl: Transformer-XL's relative attention (Dai et al., 2019), the Conformer's
            ``RelPositionMultiHeadAttention``: no learned tables; the key table of each call is ``pos_proj``
            (``E -> E``, no bias) of the sinusoids of every offset the call reaches (row ``t`` of offset
            ``t - K`` embeds position ``K - t``, query minus key), split into heads, and the learned
            ``content_bias`` (``u``) and ``position_bias`` (``v``), (H, D), are added to the queries of the
            content and the position term: ``((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(D)``. An int
            ``max_relative_position`` clips the offsets (the edge rows beyond); None does not. Takes a
            ``KVCache`` (the queries' positions follow the cache). See docs/usage.md for NeMo's and ESPnet's
            parameter names.
        backend: passed to :func:`relattn.relative_attention`. A backend that will refuse this module's calls
            (dropout it does not serve, a head dim, a ``device`` or ``dtype`` it does not take, a missing package)
            is refused here, with every reason.

    Initialisation: the query, key and value projections are Xavier-uniform with zero bias and the
    output projection is ``nn.Linear``'s default with zero bias (as ``nn.MultiheadAttention``);
    the tables are ``N(0, 1) * sqrt(2 / (2K + 1 + D))``, the spec's Glorot-normal scale.
    :meth:`from_mha` instead takes an ``nn.MultiheadAttention``'s weights and starts the tables at zero.

    Differences from ``nn.MultiheadAttention`` (everything else, with both tables at zero, computes
    what it computes, outputs and gradients):

    1. The third positional constructor argument is ``max_relative_position``; the rest are keyword-only.
    2. ``batch_first`` defaults to True (nn.MultiheadAttention: False).
    3. ``need_weights`` defaults to False, so ``forward`` returns ``(out, None)`` and the fast backends
       run; pass ``need_weights=True`` for the weights (computed by the "dense" backend).
    4. ``key`` and ``value`` may be omitted: ``key = query``, ``value = key`` (self-attention).
    5. ``is_causal=True`` forbids later keys by itself (no ``attn_mask`` needed); with an ``attn_mask``
       both apply. In nn.MultiheadAttention it is only a hint about ``attn_mask``.
    6. A query row with no key to attend to gives zeros before ``out_proj`` (so ``out_proj.bias``), and
       zero weights and gradients, where nn.MultiheadAttention gives NaN.
    7. ``add_bias_kv=True`` and ``add_zero_attn=True`` are refused (see above).
    8. Parameters are the ``nn.Linear`` modules ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` and the
       tables ``rel_k``, ``rel_v`` (and ``rel_q``); ``in_proj_weight`` and ``in_proj_bias`` are None (as
       ``_qkv_same_embed_dim`` is False), so state-dict keys differ. Bring an nn.MultiheadAttention (or its
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
       the call runs packed (:func:`relattn.relative_attention_varlen` on the real tokens only, projections
       included), below that masked (then zeroed); under ``torch.compile`` masked (then zeroed: the lengths are
       data there). Other padding (left-aligned, holes) keeps nn.MultiheadAttention's behaviour.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_relative_position: int | tuple[int, int] | LogBuckets | T5Buckets | None = None,
        *,
        num_kv_heads: int | None = None,
        beyond: str = "clip",
        tie_tables: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        relative_keys: bool | None = None,
        relative_values: bool | None = None,
        position_to_content: bool = False,
        share_heads: bool = True,
        relative_bias: bool = False,
        scale: float | None = None,
        transformer_xl: bool = False,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        for name, flag in (("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn)):
            if flag:
                raise ValueError(f"{name}=True is not supported: the key it appends has no position, so its "
                                 f"relative term is undefined")
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got {type(batch_first).__name__}")
        kv_heads = num_heads if num_kv_heads is None else _positive("num_kv_heads", num_kv_heads)
        if num_heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({num_heads})")
        head_dim = embed_dim // num_heads
        if not isinstance(transformer_xl, bool):
            raise TypeError(f"transformer_xl must be a bool, got {type(transformer_xl).__name__}")
        if transformer_xl:
            learned = dict(relative_keys=relative_keys, relative_values=relative_values,
                           position_to_content=position_to_content, tie_tables=tie_tables)
            if given := [name for name, flag in learned.items() if flag]:
                raise ValueError(f"transformer_xl=True has no learned tables (its key table is the projected "
                                 f"sinusoids, it has no value table); got {', '.join(f'{n}=True' for n in given)}")
            if not (max_relative_position is None or type(max_relative_position) is int) or beyond != "clip":
                raise ValueError(f"transformer_xl=True takes max_relative_position None (no clipping) or an int and "
                                 f"beyond='clip'; got {max_relative_position!r}, beyond={beyond!r}")
            relative_keys = relative_values = False
        else:
            max_relative_position = 16 if max_relative_position is None else max_relative_position
            relative_keys = True if relative_keys is None else relative_keys
            relative_values = True if relative_values is None else relative_values
        if not isinstance(relative_bias, bool):
            raise TypeError(f"relative_bias must be a bool, got {type(relative_bias).__name__}")
        if relative_bias and transformer_xl:
            raise ValueError("relative_bias=True needs a table of offsets; transformer_xl=True has none (its key "
                             "table is computed per call)")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        refused = why_not(backend, dropout=dropout > 0, head_dim=head_dim, dtype=dtype,
                          device=None if device is None else torch.device(device).type,
                          pos_to_content=position_to_content, position_query=transformer_xl, rel_bias=relative_bias)
        if refused:
            raise ValueError(f"backend {backend!r} cannot serve this module: {'; '.join(refused)}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads, self.batch_first = embed_dim, num_heads, kv_heads, \
            batch_first
        self.kdim = embed_dim if kdim is None else _positive("kdim", kdim)
        self.vdim = embed_dim if vdim is None else _positive("vdim", vdim)
        self.head_dim = head_dim
        if max_relative_position is not None:
            check_positions(max_relative_position)
        self.max_relative_position = max_relative_position
        self.transformer_xl = transformer_xl
        self.beyond = check_beyond(beyond)
        if isinstance(max_relative_position, BUCKET_MAPS) and beyond != "clip":
            raise ValueError(f"beyond={beyond!r} does not apply to {type(max_relative_position).__name__} positions "
                             "(they saturate); use 'clip'")
        if tie_tables and not (relative_keys and relative_values):
            raise ValueError("tie_tables=True needs relative_keys=True and relative_values=True (one table for both)")
        self.dropout, self.backend, self.share_heads = dropout, backend, share_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        table = (0 if transformer_xl else table_rows(max_relative_position), self.head_dim)
        if not share_heads:
            table = (num_heads, *table)
        self.rel_k = nn.Parameter(torch.empty(table, **factory)) if relative_keys else None
        # tied: the same Parameter under both names (state_dict has both keys; parameters() yields it once)
        self.rel_v = self.rel_k if tie_tables else (
            nn.Parameter(torch.empty(table, **factory)) if relative_values else None)
        self.tie_tables = tie_tables
        self.rel_q = nn.Parameter(torch.empty(table, **factory)) if position_to_content else None
        self.rel_bias = nn.Parameter(torch.empty(table[:-1], **factory)) if relative_bias else None
        self.scale = None if scale is None else float(scale)
        if transformer_xl:  # NeMo's linear_pos, pos_bias_u, pos_bias_v
            self.pos_proj = nn.Linear(embed_dim, embed_dim, bias=False, **factory)
            self.content_bias = nn.Parameter(torch.empty(num_heads, head_dim, **factory))
            self.position_bias = nn.Parameter(torch.empty(num_heads, head_dim, **factory))
        else:
            self.pos_proj = self.content_bias = self.position_bias = None
        # nn.MultiheadAttention's attributes that torch.nn.Transformer*Layer inspect: with no packed in-projection
        # they never take their fused fast path (which would read in_proj_weight and bypass this module).
        self.register_parameter("in_proj_weight", None)
        self.register_parameter("in_proj_bias", None)
        self._qkv_same_embed_dim = False
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.reset_parameters()

    @classmethod
    def from_mha(
        cls,
        mha: nn.MultiheadAttention,
        max_relative_position: int | tuple[int, int] = 16,
        *,
        beyond: str = "clip",
        tie_tables: bool = False,
        relative_keys: bool = True,
        relative_values: bool = True,
        position_to_content: bool = False,
        share_heads: bool = True,
        backend: str = "auto",
    ) -> RelativeMultiheadAttention:
        """A module with ``mha``'s sizes, layout, dropout, weights (copied), device, dtype and mode; the position
        options (``max_relative_position``, ``beyond``, ``tie_tables``, ``relative_keys``, ``relative_values``,
        ``position_to_content``, ``share_heads``) and ``backend`` are the constructor's.

        The tables start at zero, so until they are trained it computes what ``mha`` computes. To
        upgrade a model in place: ``model.attn = RelativeMultiheadAttention.from_mha(model.attn, 16)``, or
        :func:`upgrade_mha` for every ``nn.MultiheadAttention`` in a model.
        For a saved nn.MultiheadAttention state dict, load it into an ``nn.MultiheadAttention`` of the
        same sizes first (``mha.load_state_dict(sd)``), then call this.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be an nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None:
            raise ValueError("mha has add_bias_kv=True, which RelativeMultiheadAttention does not support")
        if mha.add_zero_attn:
            raise ValueError("mha has add_zero_attn=True, which RelativeMultiheadAttention does not support")
        out_w = mha.out_proj.weight
        mod = cls(mha.embed_dim, mha.num_heads, max_relative_position, beyond=beyond, tie_tables=tie_tables,
                  dropout=mha.dropout,
                  bias=mha.in_proj_bias is not None, kdim=mha.kdim, vdim=mha.vdim, batch_first=mha.batch_first,
                  relative_keys=relative_keys, relative_values=relative_values,
                  position_to_content=position_to_content, share_heads=share_heads, backend=backend,
                  device=out_w.device, dtype=out_w.dtype)
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
            for table in (mod.rel_k, mod.rel_v, mod.rel_q):
                if table is not None:
                    table.zero_()
        return mod.train(mha.training)

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight)
        self.out_proj.reset_parameters()
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.transformer_xl:  # as ESPnet's RelPositionMultiHeadedAttention
            nn.init.xavier_uniform_(self.pos_proj.weight)
            nn.init.xavier_uniform_(self.content_bias)
            nn.init.xavier_uniform_(self.position_bias)
            return
        std = math.sqrt(2.0 / (table_rows(self.max_relative_position) + self.head_dim))
        for table in (self.rel_k, self.rel_v, self.rel_q, self.rel_bias):
            if table is not None:
                nn.init.normal_(table, std=std)

    def extra_repr(self) -> str:
        dims = "" if self.kdim == self.vdim == self.embed_dim else f"kdim={self.kdim}, vdim={self.vdim}, "
        kv = "" if self.num_kv_heads == self.num_heads else f"num_kv_heads={self.num_kv_heads}, "
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, {kv}{dims}"
                f"max_relative_position={self.max_relative_position}, beyond={self.beyond!r}, "
                f"tie_tables={self.tie_tables}, share_heads={self.share_heads}, "
                f"relative_keys={self.rel_k is not None}, relative_values={self.rel_v is not None}, "
                f"position_to_content={self.rel_q is not None}, "
                + (f"relative_bias=True, scale={self.scale}, " if self.rel_bias is not None else "")
                + ("transformer_xl=True, " if self.transformer_xl else "")
                + f"batch_first={self.batch_first}, backend={self.backend!r}")

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

    def _heads(self, x: torch.Tensor, batch_first: bool = True, heads: int | None = None) -> torch.Tensor:
        """A projection, (B, L, heads*D) or (L, B, heads*D), as (B, heads, L, D) (a view); heads: ``num_heads``."""
        x = x.unflatten(-1, (self.num_heads if heads is None else heads, self.head_dim))
        return x.transpose(1, 2) if batch_first else x.permute(1, 2, 0, 3)

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

    @staticmethod
    def _packing(key_padding_mask, batched: bool, bf: bool) -> Packing | None:
        """The :class:`Packing` of a right-aligned ``key_padding_mask`` (bool True, or an added ``-inf``, at padding
        only) with at least one padded position; else None. Not while tracing (the lengths are data)."""
        if key_padding_mask is None or not batched or key_padding_mask.dim() != 2 or torch.compiler.is_compiling():
            return None
        return remembered(key_padding_mask, ("key_padding_mask", bf), lambda mask: _right_packing(mask, bf))

    def _packed_forward(self, query: torch.Tensor, packing: Packing, is_causal: bool) -> torch.Tensor:
        """Self-attention of the real tokens of ``query`` (B, N, E) ((N, B, E) sequence-first) as one packed call,
        the projections on those rows only; the output in the padded layout, zeros at padding."""
        x = packing.pack(query)
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k, v = (p(x).unflatten(-1, (self.num_kv_heads, self.head_dim)) for p in (self.k_proj, self.v_proj))
        n = packing.max_seqlen
        out = attend_varlen(self._arguments(q, k, v, n=n, m=n, offset=0, is_causal=is_causal,
                                            cu_seqlens_q=packing.cu_seqlens, max_seqlen_q=n))
        return packing.unpack(self.out_proj(out.flatten(1)))

    def _arguments(self, q, k, v, *, n: int, m: int, offset: int, is_causal: bool, **more) -> AttentionArgs:
        """The op's arguments for one call of this module on projected q, k, v: its tables (Transformer-XL's made for
        ``n`` queries at ``offset`` and ``m`` keys), window and options; ``more``: the call's own (a mask, a packed
        call's lengths)."""
        rel_k, rel_v, rel_q = (None if t is None else t.to(q.dtype) for t in (self.rel_k, self.rel_v, self.rel_q))
        kk, biases = self.max_relative_position, {}
        if self.rel_bias is not None:
            biases["rel_bias"] = self.rel_bias.to(q.dtype)
        if self.scale is not None:
            biases["scale"] = self.scale
        if self.transformer_xl:
            kk, rel_k = self._position_table(n, m, offset, q)
            biases = {"content_bias": self.content_bias.to(q.dtype), "position_bias": self.position_bias.to(q.dtype)}
        return AttentionArgs(q, k, v, rel_k, rel_v, max_relative_position=kk, rel_q=rel_q, beyond=self.beyond,
                             is_causal=is_causal, query_offset=offset, dropout_p=self.dropout if self.training else 0.0,
                             enable_gqa=self.num_kv_heads != self.num_heads, backend=self.backend, **biases, **more)

    def _keys_values(self, key, value, kv_cache: KVCache | None, bf: bool, self_attention: bool):
        """This call's keys and values (B, Hkv, M, D|Dv), projected or from ``kv_cache``, and the position of its
        first query (``self_attention``: the caller's key was its query, before unbatched inputs got a batch dim).
        The cache is only read here; :meth:`_cache_update` writes it once the call is checked."""
        heads = self.num_kv_heads
        if kv_cache is None:
            return self._heads(self.k_proj(key), bf, heads), self._heads(self.v_proj(value), bf, heads), 0
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be a KVCache or None, got {type(kv_cache).__name__}")
        if self_attention:
            if kv_cache.kind == "cross":
                kv_cache.claim("self")  # raises: a cross-attention cache handed self-attention keys
            return self._heads(self.k_proj(key), bf, heads), self._heads(self.v_proj(value), bf, heads), \
                kv_cache.position
        if kv_cache.kind == "self":
            kv_cache.claim("cross")  # raises: a self-attention cache handed other keys than queries
        memory = (key, value) if bf else (key.transpose(0, 1), value.transpose(0, 1))
        if kv_cache.holds_memory(*memory):
            return kv_cache.k, kv_cache.v, kv_cache.position
        return self._heads(self.k_proj(key), bf, heads), self._heads(self.v_proj(value), bf, heads), \
            kv_cache.position

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

    def _position_table(self, n: int, m: int, offset: int, q: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Transformer-XL's key table for ``n`` queries from position ``offset`` on and ``m`` keys: ``K`` (every
        offset the call reaches, at most ``max_relative_position``) and ``pos_proj`` of the sinusoids of the
        positions ``K, K - 1, .., -K`` (query minus key), (H, 2K + 1, D) in q's dtype."""
        kk = max(n - 1 + offset, m - 1 - offset, 0)
        if self.max_relative_position is not None:
            kk = min(kk, self.max_relative_position)
        weight = self.pos_proj.weight
        positions = torch.arange(kk, -kk - 1, -1, device=weight.device, dtype=weight.dtype)
        table = self.pos_proj(sinusoids(positions, self.embed_dim)).to(q.dtype)
        return kk, table.unflatten(-1, (self.num_heads, self.head_dim)).transpose(0, 1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        kv_cache: KVCache | None = None,
        context_parallel=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
            b, n = (query.shape[:2] if self.batch_first else query.shape[1::-1]) if batched else (1, query.shape[0])
            self._masks(key_padding_mask, None, batched=batched, b=b, n=n, m=n, dtype=query.dtype)  # its checks
            packing = self._packing(key_padding_mask, batched, self.batch_first)
            if packing is not None and packing.worth_packing:
                return self._packed_forward(query, packing, is_causal), None
            zero_at = packing  # little padding: the masked call below, then zeros at the padding all the same
            if batched and key_padding_mask.dim() == 2 and torch.compiler.is_compiling():
                zero_at = _right_padding_traced(key_padding_mask)  # the lengths are data: zeros where eager's are
        if not batched:
            query, key, value = query[None], key[None], value[None]
        bf = self.batch_first or not batched
        q = self._heads(self.q_proj(query), bf, self.num_heads)
        k, v, offset = self._keys_values(key, value, kv_cache, bf, self_attention)
        b, n = q.shape[0], q.shape[2]
        m = k.shape[2] + (offset if self_attention and kv_cache is not None else 0)
        if context_parallel is not None:
            m = context_parallel.key_length(m)
        mask = self._masks(key_padding_mask, attn_mask, batched=batched, b=b, n=n, m=m, dtype=q.dtype)
        # after the checks: a refused call leaves the cache as it was
        k, v = self._cache_update(kv_cache, self_attention, key, value, k, v, n, bf)
        args = self._arguments(q, k, v, n=n, m=m, offset=offset, is_causal=is_causal, attn_mask=mask)
        weights = None
        if need_weights:
            out, weights = attend_with_weights(args)
            weights = weights.mean(1) if average_attn_weights else weights
            weights = weights if batched else weights[0]
        else:
            if context_parallel is not None and self.rel_bias is not None:
                raise ValueError("relative_bias=True is not served under context parallelism (the ring takes no "
                                 "rel_bias yet); run without context_parallel")
            out = attend(args) if context_parallel is None else context_parallel.attend(args)
        out = out.transpose(1, 2) if bf else out.permute(2, 0, 1, 3)
        out = self.out_proj(out.flatten(2))
        if isinstance(zero_at, torch.Tensor):
            out = out.masked_fill((zero_at if self.batch_first else zero_at.T)[..., None], 0)
        elif zero_at is not None:
            out = zero_at.zero_padding(out)
        return (out if batched else out[0]), weights


def upgrade_mha(model: nn.Module, max_relative_position: int = 16, **from_mha_kwargs) -> nn.Module:
    """Replace, in place, every ``nn.MultiheadAttention`` inside ``model`` (``model`` itself excepted) by
    :meth:`RelativeMultiheadAttention.from_mha` of it, under the same name; returns ``model``.

    With the tables at zero the model computes what it did. ``nn.TransformerEncoder`` instances get
    ``use_nested_tensor = False``: their inference fast path would hand the attention modules nested tensors.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(parent, name, RelativeMultiheadAttention.from_mha(child, max_relative_position,
                                                                          **from_mha_kwargs))
        if isinstance(parent, nn.TransformerEncoder):
            parent.use_nested_tensor = False
    return model


__all__ = ["KVCache", "RelativeMultiheadAttention", "upgrade_mha"]
