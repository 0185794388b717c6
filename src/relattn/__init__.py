"""relattn: self-attention with relative position representations (Shaw, Uszkoreit & Vaswani, 2018).

- :func:`relative_attention`: the op, shaped like ``F.scaled_dot_product_attention``.
- :class:`RelativeMultiheadAttention`: the module, shaped like ``nn.MultiheadAttention(batch_first=True)``.
- :func:`relative_position_index`: the clipped, shifted (N, M) index into the 2K+1-row tables.
- :mod:`relattn.reference`: the specification in numpy, float64, the ground truth for every test.
"""

from .backends import BACKENDS
from .functional import relative_attention, relative_attention_weights
from .modules import KVCache, RelativeMultiheadAttention
from .positions import relative_position_index

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "KVCache",
    "RelativeMultiheadAttention",
    "relative_attention",
    "relative_attention_weights",
    "relative_position_index",
]
