"""Position schemes: what a :class:`relattn.RelativeMultiheadAttention` adds for positions, as objects it takes.

A scheme is a frozen description, like :class:`relattn.positions.LogBuckets`: it declares the parameters it needs
(:meth:`Scheme.create`: names, shapes), starts them (:meth:`Scheme.reset`, :meth:`Scheme.start_at_zero`) and, per
call, makes the op's relative terms from them (:meth:`Scheme.terms`: the keywords ``rel_k``, ``rel_v``, ``rel_q``,
``rel_bias``, ``content_bias``, ``position_bias``, ``max_relative_position``, ``beyond``, ``scale`` of
:func:`relattn.relative_attention`). The module registers the parameters under the scheme's names (``rel_k``,
``rel_v``, ``rel_q``, ``rel_bias``; ``pos_proj``, ``content_bias``, ``position_bias``), so the state-dict keys are
the same whichever scheme made them, and one scheme object can be handed to every layer of a model (each layer gets
parameters of its own).

- :class:`Shaw`: learned tables over a window (Shaw et al., 2018): ``a^K`` (``rel_k``), ``a^V`` (``rel_v``), and
  optionally DeBERTa's ``a^Q`` (``rel_q``) and a scalar per row (``rel_bias``); any window the op takes (``K``,
  ``(left, right)``, :class:`~relattn.positions.LogBuckets`, :class:`~relattn.positions.T5Buckets`).
- :class:`Disentangled`: DeBERTa's terms, ``a^K`` and ``a^Q`` and no ``a^V`` (a :class:`Shaw` with those defaults).
- :class:`T5Bias`: T5's scalar bias per head and bucket, no tables, scale 1 (a :class:`Shaw` with those defaults).
- :class:`TransformerXL`: Transformer-XL's relative attention (Dai et al., 2019; the Conformer's): the projected
  sinusoids of every offset as the key table, and the content and position biases ``u``, ``v``.

Notation: ``E`` model width, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass, field

import torch
from torch import nn

from .positions import BUCKET_MAPS, LogBuckets, T5Buckets, check_beyond, check_positions, table_rows


class Scheme:
    """What the module asks of a position scheme (see the module docstring); subclasses are frozen dataclasses."""

    def kinds(self) -> dict:
        """What the calls will ask of a backend (:func:`relattn.backends.why_not`'s ``kinds``)."""
        raise NotImplementedError

    def create(self, embed_dim: int, num_heads: int, head_dim: int, factory: dict) -> dict[str, nn.Module | None]:
        """The parameters (or modules) to register on the module, by name; None for a name the scheme leaves out."""
        raise NotImplementedError

    def reset(self, module: nn.Module) -> None:
        """Initialise the module's parameters of this scheme."""
        raise NotImplementedError

    def start_at_zero(self, module: nn.Module) -> None:
        """Zero them: :meth:`RelativeMultiheadAttention.from_mha` then computes what the ``nn.MultiheadAttention``
        did."""
        with torch.no_grad():
            for name in self.create_names:
                value = getattr(module, name)
                for p in ([value] if isinstance(value, nn.Parameter) else value.parameters()):
                    p.zero_()

    def terms(self, module: nn.Module, dtype: torch.dtype, n: int, m: int, offset: int) -> dict:
        """The op's relative-term keywords for ``n`` queries from position ``offset`` on and ``m`` keys, in
        ``dtype``."""
        raise NotImplementedError

    create_names: tuple[str, ...] = ()

    def __repr__(self) -> str:
        """The scheme with the fields that differ from its defaults, as it would be written."""
        shown = []
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            value = getattr(self, f.name)
            if value != default:
                shown.append(repr(value) if f.kw_only is False and not shown else f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"


def _flag(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True, repr=False)
class Shaw(Scheme):
    """Learned relative tables over a window (Shaw, Uszkoreit & Vaswani, 2018).

    Attributes:
        max_relative_position: ``K`` (offsets clipped to ``[-K, K]``, tables of ``2K + 1`` rows), a pair
            ``(left, right)`` (``left + right + 1`` rows), a :class:`LogBuckets` (DeBERTa's, ``2 * span`` rows) or a
            :class:`T5Buckets` (T5's, ``num_buckets`` rows).
        keys: learn the key-side table ``rel_k`` (``a^K``).
        values: learn the value-side table ``rel_v`` (``a^V``).
        position_to_content: learn the position-to-content table ``rel_q`` (``a^Q``: DeBERTa's p2c term, adding
            ``k_j . a^Q[idx_ij]`` to the scores), shaped like ``rel_k``.
        bias: learn a scalar per table row, ``rel_bias`` ((rows,) shared, or (H, rows) per head), added unscaled to
            the scores (T5's relative attention bias).
        tie: one table for keys and values (OpenNMT-py, CTranslate2): ``rel_v`` is ``rel_k`` (needs both).
        share_heads: one (rows, D) table per side shared by all heads (Shaw et al.), else (H, rows, D).
        beyond: ``"clip"`` (offsets beyond the window take the edge rows) or ``"zero"`` (no relative term); the
            bucket maps saturate and take ``"clip"`` only.
        scale: the scores' scale, ``1/sqrt(D)`` when None.

    Initialisation: ``N(0, 1) * sqrt(2 / (rows + D))``, the spec's Glorot-normal scale.
    """

    max_relative_position: int | tuple[int, int] | LogBuckets | T5Buckets = 16
    _: KW_ONLY
    keys: bool = True
    values: bool = True
    position_to_content: bool = False
    bias: bool = False
    tie: bool = False
    share_heads: bool = True
    beyond: str = "clip"
    scale: float | None = None

    def __post_init__(self):
        owner = type(self).__name__
        check_positions(self.max_relative_position)
        check_beyond(self.beyond)
        for name in ("keys", "values", "position_to_content", "bias", "tie", "share_heads"):
            _flag(owner, name, getattr(self, name))
        if isinstance(self.max_relative_position, BUCKET_MAPS) and self.beyond != "clip":
            raise ValueError(f"beyond={self.beyond!r} does not apply to {type(self.max_relative_position).__name__} "
                             "positions (they saturate); use 'clip'")
        if self.tie and not (self.keys and self.values):
            raise ValueError(f"{owner}(tie=True) needs keys=True and values=True (one table for both)")
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))):
            raise TypeError(f"{owner}.scale must be a float or None, got {type(self.scale).__name__}")

    create_names = ("rel_k", "rel_v", "rel_q", "rel_bias")

    def kinds(self) -> dict:
        return dict(pos_to_content=self.position_to_content, position_query=False, rel_bias=self.bias)

    def create(self, embed_dim, num_heads, head_dim, factory):
        shape = (table_rows(self.max_relative_position), head_dim)
        if not self.share_heads:
            shape = (num_heads, *shape)

        def table(wanted: bool, size=shape):
            return nn.Parameter(torch.empty(size, **factory)) if wanted else None

        rel_k = table(self.keys)
        # tied: the same Parameter under both names (state_dict has both keys; parameters() yields it once)
        return dict(rel_k=rel_k, rel_v=rel_k if self.tie else table(self.values), rel_q=table(self.position_to_content),
                    rel_bias=table(self.bias, shape[:-1]))

    def reset(self, module):
        std = math.sqrt(2.0 / (table_rows(self.max_relative_position) + module.head_dim))
        for name in self.create_names:
            if (t := getattr(module, name)) is not None:
                nn.init.normal_(t, std=std)

    def start_at_zero(self, module):
        with torch.no_grad():
            for name in self.create_names:
                if (t := getattr(module, name)) is not None:
                    t.zero_()

    def terms(self, module, dtype, n, m, offset):
        rel_k, rel_v, rel_q, rel_bias = module.rel_k, module.rel_v, module.rel_q, module.rel_bias
        return dict(rel_k=None if rel_k is None else rel_k.to(dtype), rel_v=None if rel_v is None else rel_v.to(dtype),
                    rel_q=None if rel_q is None else rel_q.to(dtype),
                    rel_bias=None if rel_bias is None else rel_bias.to(dtype),
                    max_relative_position=self.max_relative_position, beyond=self.beyond,
                    scale=None if self.scale is None else float(self.scale))


@dataclass(frozen=True, repr=False)
class Disentangled(Shaw):
    """DeBERTa's disentangled attention (He et al., 2021): the content-to-position table ``rel_k`` (``a^K``) and the
    position-to-content table ``rel_q`` (``a^Q``), no value table: a :class:`Shaw` with ``values=False,
    position_to_content=True``; DeBERTa's own window is a :class:`LogBuckets` and its scale ``1/sqrt(3 D)``."""

    max_relative_position: int | tuple[int, int] | LogBuckets | T5Buckets = 16
    _: KW_ONLY
    values: bool = False
    position_to_content: bool = True


@dataclass(frozen=True, repr=False)
class T5Bias(Shaw):
    """T5's relative attention bias (Raffel et al., 2020): a learned scalar per head and bucket of the offset, added
    to the unscaled scores (``scale = 1``), no tables: a :class:`Shaw` with ``keys=False, values=False, bias=True,
    share_heads=False, scale=1.0`` over :class:`T5Buckets` (``bidirectional=False`` for a decoder). The table is
    ``rel_bias`` (H, num_buckets), T5's ``relative_attention_bias.weight`` transposed."""

    max_relative_position: int | tuple[int, int] | LogBuckets | T5Buckets = field(default_factory=T5Buckets)
    _: KW_ONLY
    keys: bool = False
    values: bool = False
    bias: bool = True
    share_heads: bool = False
    scale: float | None = 1.0


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


@dataclass(frozen=True, repr=False)
class TransformerXL(Scheme):
    """Transformer-XL's relative attention (Dai et al., 2019), the Conformer's ``RelPositionMultiHeadAttention``:
    no learned tables; the key table of each call is ``pos_proj`` (``E -> E``, no bias) of the sinusoids of every
    offset the call reaches (row ``t`` of offset ``t - K`` embeds position ``K - t``, query minus key), split into
    heads, and the learned ``content_bias`` (``u``) and ``position_bias`` (``v``), (H, D), are added to the queries
    of the content and the position term: ``((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(D)``. Takes a
    ``KVCache`` (the queries' positions follow the cache). See docs/usage.md for NeMo's and ESPnet's parameter names.

    Attributes:
        max_relative_position: None (the default): no clipping (every offset of the call); an int ``K`` clips the
            offsets to ``[-K, K]`` (the edge rows beyond).

    Initialisation: Xavier-uniform, as ESPnet's ``RelPositionMultiHeadedAttention``.
    """

    max_relative_position: int | None = None

    def __post_init__(self):
        kk = self.max_relative_position
        if not (kk is None or type(kk) is int and kk >= 0):
            raise ValueError(f"TransformerXL takes max_relative_position None (no clipping) or an int >= 0; got "
                             f"{kk!r}")

    create_names = ("pos_proj", "content_bias", "position_bias")

    def kinds(self) -> dict:
        return dict(pos_to_content=False, position_query=True, rel_bias=False)

    def create(self, embed_dim, num_heads, head_dim, factory):  # NeMo's linear_pos, pos_bias_u, pos_bias_v
        return dict(pos_proj=nn.Linear(embed_dim, embed_dim, bias=False, **factory),
                    content_bias=nn.Parameter(torch.empty(num_heads, head_dim, **factory)),
                    position_bias=nn.Parameter(torch.empty(num_heads, head_dim, **factory)))

    def reset(self, module):
        nn.init.xavier_uniform_(module.pos_proj.weight)
        nn.init.xavier_uniform_(module.content_bias)
        nn.init.xavier_uniform_(module.position_bias)

    def terms(self, module, dtype, n, m, offset):
        kk = max(n - 1 + offset, m - 1 - offset, 0)
        if self.max_relative_position is not None:
            kk = min(kk, self.max_relative_position)
        weight = module.pos_proj.weight
        positions = torch.arange(kk, -kk - 1, -1, device=weight.device, dtype=weight.dtype)
        table = module.pos_proj(sinusoids(positions, module.embed_dim)).to(dtype)
        rel_k = table.unflatten(-1, (module.num_heads, module.head_dim)).transpose(0, 1)
        return dict(rel_k=rel_k, max_relative_position=kk, content_bias=module.content_bias.to(dtype),
                    position_bias=module.position_bias.to(dtype))


def as_scheme(positions) -> Scheme:
    """The module's ``positions`` argument as a scheme: a :class:`Scheme` as it is; a window the op takes (``K``,
    ``(left, right)``, a bucket map) as ``Shaw(window)``; None as ``Shaw(16)``."""
    if isinstance(positions, Scheme):
        return positions
    if positions is None:
        return Shaw()
    if isinstance(positions, (int, tuple, list, *BUCKET_MAPS)) and not isinstance(positions, bool):
        return Shaw(tuple(positions) if isinstance(positions, list) else positions)
    raise TypeError(f"positions must be a position scheme (Shaw, Disentangled, T5Bias, TransformerXL) or a window "
                    f"(an int K, a pair (left, right), a LogBuckets or a T5Buckets); got {type(positions).__name__}")


__all__ = ["Disentangled", "Scheme", "Shaw", "T5Bias", "TransformerXL", "as_scheme", "sinusoids"]
