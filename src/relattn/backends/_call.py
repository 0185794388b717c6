"""The call every backend receives and what a backend declares: :class:`AttentionCall` (the validated, canonical
call), the counter-based dropout mask every backend draws alike, :class:`Serves` (what a backend serves, as data:
the registry turns it into refusal reasons, :func:`relattn.backends.why_not`) and :class:`Backend`.

Notation: ``B`` batch, ``H`` heads, ``N`` queries, ``M`` keys, ``D``/``Dv`` head dims, ``K`` max relative
position; tables arrive as ``(Hr, 2K+1, D|Dv)`` with ``Hr`` in ``{1, H}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ._common import StatsOps

LOW_PRECISION = (torch.bfloat16, torch.float16)
FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics (max, log-sum-exp) are kept in float32 for 16-bit inputs."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@dataclass(frozen=True)
class AttentionCall:
    """The validated, canonical inputs of one call: what a backend receives.

    q (B,H,N,D), k (B,Hkv,M,D), v (B,Hkv,M,Dv) with ``H % Hkv == 0`` (grouped-query attention: query head ``h``
    reads key/value head ``h // (H // Hkv)``; only backends declaring ``Serves(grouped_kv=True)`` ever see
    ``Hkv < H``, the others get k and v repeated to H heads by the op); tables (Hr,2K+1,D|Dv) or None, clipped
    symmetrically to [-K, K] (:func:`relattn.functional.validate` brings asymmetric windows and zero-beyond
    tables to this form); ``mask`` None or an additive float tensor of 4 dims broadcastable to (B,H,N,M).
    ``rel_q`` (Hr,2K+1,D) or None: the position-to-content table, adding ``k_j . rel_q[idx_ij]`` to the scores at
    the key term's row ``idx_ij = clip(j - i - query_offset, -K, K) + K``; only backends declaring
    ``Serves(pos_to_content=True)`` ever see one.
    ``q_pos`` (B,H,N,D) or None: the queries the key table ``rel_k`` reads, apart from the content queries ``q``
    (Transformer-XL's biases: ``q = q + content_bias``, ``q_pos = q + position_bias``); None means ``q`` itself.
    Only backends declaring ``Serves(position_query=True)`` ever see one; they return its gradient apart from q's.
    ``rel_bias`` (Hr,2K+1) or None: a scalar per table row (T5's and MPNet's bias), added unscaled at the key term's
    row: ``score_ij = scale * (q_i . k_j + q_i . a^K[idx_ij] + ...) + rel_bias[h, idx_ij]``; its gradient is the sum
    of dS over the pairs of each row. Only backends declaring ``Serves(rel_bias=True)`` ever see one.

    A packed call (:func:`relattn.relative_attention_varlen`) has ``cu_seqlens_q`` and ``cu_seqlens_k``: q is
    (1, H, T, D) and k, v (1, Hkv, T_k, D|Dv) (views of the packed (T, H, D) tensors), sequence ``s`` holding the
    query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1`` (``n_s`` of them) and the key rows of ``cu_seqlens_k``
    likewise (``m_s``); both int32 or int64 1-D tensors of S + 1 entries on q's device, checked (0 first, never
    decreasing, T last). Positions count within each sequence, and a sequence's queries sit at the end of its keys:
    the sequence is the dense call with ``query_offset = m_s - n_s`` (plus ``query_offset``, 0 from the op), causal
    bottom-right. ``max_seqlen_q`` and ``max_seqlen_k`` are the longest ``n_s`` and ``m_s``. ``mask`` is None.
    Backends declaring ``Serves(varlen=True)`` take the packed call whole; the op runs the others sequence by sequence.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    rel_k: Tensor | None
    rel_v: Tensor | None
    max_relative_position: int
    mask: Tensor | None
    is_causal: bool
    dropout_p: float
    scale: float
    query_offset: int
    rel_q: Tensor | None = None
    q_pos: Tensor | None = None
    rel_bias: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seed: Tensor | None = None  # the dropout seed (:func:`dropout_seed`); None: the backend draws one


# ------------------------------------------------------------------ the dropout mask, one for every backend

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: a 32-bit value times it stays inside int64


def mix32(x: Tensor) -> Tensor:
    """The 32-bit integer hash of the dropout mask (three xorshifts, two multiplies), of int64 values in
    [0, 2**32); the C++ and Triton kernels compute it on uint32."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    return x ^ (x >> 16)


def dropout_keep(seed: Tensor | int, b: Tensor, h: Tensor, i: Tensor, j: Tensor, dropout_p: float) -> Tensor:
    """Whether attention weight (b, h, i, j) is kept under dropout ``dropout_p`` with ``seed``: bool, the broadcast
    shape of the int64 tensors ``b`` (batch entry; a packed call's sequence), ``h`` (query head), ``i`` (query row of
    the call's q, within its sequence) and ``j`` (key row of the call's k, within its sequence). The mask every
    backend draws (docs/backends.md, "Dropout")::

        key(seed, b, h) = mix32(mix32(mix32(seed ^ 0x243F6A88) ^ b) ^ h)
        row(key, i) = mix32(key ^ 0x85A308D3 ^ i);  col(key, j) = mix32((key + 0x9E3779B9) ^ j)   (mod 2**32)
        keep = mix32(row ^ col) >= floor(p * 2**32)

    A function of (seed, b, h, i, j) alone: no shape, tile, thread or backend changes it; P(keep) = 1 - p within
    2**-32."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    key = mix32(mix32(mix32((seed & _M32) ^ 0x243F6A88) ^ (b & _M32)) ^ (h & _M32))
    row = mix32(key ^ 0x85A308D3 ^ (i & _M32))
    col = mix32(((key + 0x9E3779B9) & _M32) ^ (j & _M32))
    return mix32(row ^ col) >= int(dropout_p * 2**32)


def dropout_seed(device: torch.device) -> Tensor:
    """A fresh dropout seed: int64 ``(seed, b0, i0, j0)`` on ``device``, the seed drawn from torch's generator for
    that device (``torch.manual_seed`` reproduces it; two calls differ), the offsets zero. A call with seed
    ``(s, b0, i0, j0)`` draws at its weight (b, h, i, j) the mask's (s, b0 + b, h, i0 + i, j0 + j): a packed call's
    sequence run alone (b0 its index) or a chunk of a longer sequence draws what the whole call would."""
    seed = torch.zeros(4, dtype=torch.int64, device=device)
    seed[0] = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)
    return seed


def call_seed(call: AttentionCall) -> Tensor | None:
    """The dropout seed of ``call``: its own when given, else None without dropout, else a fresh one."""
    if call.seed is not None or call.dropout_p == 0.0:
        return call.seed
    return dropout_seed(call.q.device)


def keep_scale(seed: Tensor, batch: int, heads: int, rows: Tensor, cols: Tensor, dropout_p: float,
               dtype: torch.dtype) -> Tensor:
    """(batch, heads, len(rows), len(cols)) of ``dtype``: ``1 / (1 - p)`` where the mask keeps weight (b, h, rows[x],
    cols[y]) of a call with dropout seed ``seed`` (:func:`dropout_seed`'s layout, or a bare seed: offsets 0), else 0:
    what the weights are multiplied by."""
    seed = seed.reshape(-1)
    dev = rows.device
    origin = [seed[n] if n < seed.numel() else 0 for n in range(4)]
    b = (origin[1] + torch.arange(batch, device=dev)).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    keep = dropout_keep(seed[0], b, h, (origin[2] + rows).view(-1, 1), (origin[3] + cols).view(1, -1), dropout_p)
    return keep.to(dtype) / (1.0 - dropout_p)


@dataclass(frozen=True)
class Serves:
    """What a backend serves, as data. ``None`` for ``devices`` means any device."""

    devices: frozenset[str] | None = None
    dtypes: frozenset[torch.dtype] = FLOATS
    dropout: bool = False
    mask: bool = True
    mask_grad: bool = False
    max_head_dim: int | None = None
    head_dims_differ: bool = True  # D != Dv
    grouped_kv: bool = False  # takes k, v with fewer heads than q (H % Hkv == 0) without repeating them
    pos_to_content: bool = False  # takes rel_q, the position-to-content table (DeBERTa's p2c, BERT's key_query)
    position_query: bool = False  # takes q_pos, queries for the key table apart from q (Transformer-XL's biases)
    rel_bias: bool = False  # takes rel_bias, a scalar per table row added unscaled to the scores (T5's, MPNet's)
    chunk_pairs: bool = False  # computes one chunk pair of a larger softmax (its log-sum-exp, and its gradients
    # given the merged output and log-sum-exp): what context parallelism's ring runs; such a backend has ``stats``
    varlen: bool = False  # takes a packed call (cu_seqlens) whole, in one launch (the op runs others per sequence)
    # CUDA: the GPUs served, as ((compute capability 10 * major + minor, the dtypes served there), ...); None: every
    # GPU in every dtype of ``dtypes``
    cuda_archs: tuple[tuple[int, frozenset[torch.dtype]], ...] | None = None


@dataclass(frozen=True)
class Backend:
    """One backend: ``run(call)`` returns the (B,H,N,Dv) output (``packed.run(call)`` a packed call's, where it serves
    them whole); ``declares`` says for which calls, as a
    :class:`Serves` or a function returning one when asked (what "triton" serves depends on ``TRITON_INTERPRET``
    at that moment); ``unavailable()`` says why it cannot run on this machine at all (a missing compiler or
    package), else None."""

    name: str
    run: Callable[[AttentionCall], Tensor]
    declares: Serves | Callable[[], Serves]
    doc: str
    unavailable: Callable[[], str | None] = lambda: None
    stats: StatsOps | None = None  # the ops of a kernel that saves its log-sum-exp (``serves.chunk_pairs``)
    packed: StatsOps | None = None  # the ops that run a packed call whole (``serves.varlen``; varlen=True)

    def __post_init__(self) -> None:
        serves = self.serves
        if serves.chunk_pairs != (self.stats is not None):
            raise ValueError(f"backend {self.name!r}: Serves(chunk_pairs=True) goes with stats ops, and only with them")
        if serves.varlen != (self.packed is not None):
            raise ValueError(f"backend {self.name!r}: Serves(varlen=True) goes with packed ops, and only with them")

    @property
    def serves(self) -> Serves:
        """What the backend serves now."""
        return self.declares if isinstance(self.declares, Serves) else self.declares()


def compute_capability(device: torch.device) -> int | None:
    """A CUDA device's compute capability as ``10 * major + minor`` (75 for a T4, 90 for an H100); None elsewhere."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


__all__ = ["FLOATS", "LOW_PRECISION", "AttentionCall", "Backend", "Serves", "call_seed", "compute_capability",
           "dropout_keep", "dropout_seed", "keep_scale", "mix32", "stats_dtype"]
