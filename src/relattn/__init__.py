"""relattn: self-attention with relative position representations (Shaw, Uszkoreit & Vaswani, 2018).

- :func:`relative_attention`: the op, shaped like ``F.scaled_dot_product_attention``;
  :func:`relative_attention_varlen` the same over packed sequences of different lengths (``cu_seqlens``).
- :class:`RelativeMultiheadAttention`: the module, a drop-in for ``nn.MultiheadAttention`` (``from_mha`` upgrades
  one, :func:`upgrade_mha` every one in a model), its positions a scheme (:class:`Shaw`, :class:`Disentangled`,
  :class:`T5Bias`, :class:`TransformerXL`: :mod:`relattn.schemes`); :class:`KVCache` for decoding.
- :func:`relative_position_index`: the (N, M) index into the tables, for a window K or (left, right).
- :mod:`relattn.reference`: the specification in numpy, float64, the ground truth for every test.
- :mod:`relattn.integrations`: published Hugging Face models on relattn.
"""

from .backends import BACKENDS
from .cache import KVCache
from .functional import (
    relative_attention,
    relative_attention_varlen,
    relative_attention_weights,
    relative_attention_with_weights,
)
from .modules import RelativeMultiheadAttention, upgrade_mha
from .positions import relative_position_index
from .schemes import Disentangled, Shaw, T5Bias, TransformerXL

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "Disentangled",
    "KVCache",
    "RelativeMultiheadAttention",
    "Shaw",
    "T5Bias",
    "TransformerXL",
    "relative_attention",
    "relative_attention_varlen",
    "relative_attention_weights",
    "relative_attention_with_weights",
    "relative_position_index",
    "upgrade_mha",
]
