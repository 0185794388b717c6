"""The "triton" backend: Shaw attention as flash-style Triton kernels, forward and backward, on CUDA.

The kernels (``_triton_kernels.py``) split each query tile's key loop into three stages, as the Triton tutorial
splits its causal loop: key tiles left of the band of ``2K+1`` offsets (plain flash plus one key-table score per
row), the band tiles (the key term gathered per pair from ``QA = q a^K^T``, precomputed by one small matmul
kernel; the scores of the band's interior stored per row and table row), and key tiles right of it. The value
term is ``bins @ a^V`` after the loop. The position-to-content term (``rel_q``, DeBERTa's p2c: ``k_j . a^Q_t``)
is gathered the same way from ``KA = k a^Q^T`` (one number per key off the band, per pair on it). The backward
is FlashAttention-2's (P recomputed from the saved log-sum-exp; one kernel per key tile for dk and dv, one per
query tile for dq, sharing one tile body); the table gradients come from per-row bins of P and dS, written once
each by the dq kernel, and (rel_q) per-key bins of dS, written once each by the dk/dv kernel, reduced by torch in
a fixed order: no atomics, two backward passes are bitwise equal. k and v may have fewer heads than q
(grouped-query attention): query head ``h`` reads key/value head ``h // (H // Hkv)``, and dk, dv of a key/value
head are summed over its group by one program, in order. A packed batch (``cu_seqlens``: :func:`varlen_forward`,
:func:`varlen_backward`) runs in the same kernels, one launch each for the whole batch, with the constexpr ``VARLEN``:
each program reads its sequence's rows and lengths from the cumulative lengths.

Serves CUDA tensors on the GPUs of ``CUDA_ARCHS`` (sm_80 and newer) when ``triton`` is importable; while
``TRITON_INTERPRET=1`` is in the environment (read when a call or a construction asks; Triton itself reads it when
the kernels are first imported), also CPU tensors (the same kernels, interpreted: how CI tests them; slow, so
"auto" never picks it on the CPU). float16 and bfloat16 (float32 statistics, 16-bit matmul inputs as in flash
attention: the weights rounded to 16 bits on their way into a matmul), float32 (IEEE float32 matmuls, no
TF32) and float64 (gradcheck); head dims up to 128 (D != Dv allowed); any K; the tables a^K, a^V, a^Q (rel_q),
each optional, shared or per head; the scalar bias rel_bias (T5's), folded into the key term's scores ``QA`` as
``rel_bias / scale`` (its gradient the per-row bins of dS summed over rows: no atomics); any mask that needs no
gradient; dropout (the one mask of every backend, a hash
of (seed, batch entry, query head, row, key), regenerated tile by tile in the backward, never stored).

Tiles, warps and pipeline stages per kernel come from ``config`` (by GPU architecture, element size and head
dim; ``TABLE_OF_ARCH``); ``benchmarks/triton_compile.py`` compiles every launch of this module for every served
arch without a GPU and reports registers, spills, shared memory and tensor-core instructions.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..positions import unmet_rows_zeroed
from ._common import (
    LOW_PRECISION,
    Backend,
    Serves,
    StatsOps,
    compute_capability,
    stats_dtype,
)
from ._settings import Settings

MAX_HEAD_DIM = 128
LOG2E = 1.4426950408889634
# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages, BAND_SPLIT) per kernel, by (arch, padded head dim up to 64
# or 128) for 16-bit inputs. BAND_SPLIT: the band's tiles are that many times narrower (keys for the forward and dq,
# queries for dkdv) than the others: a band tile's per-pair gathers and stores cost registers the plain tiles do
# not. Each entry compiles without spills for its arch under Triton 3.6 and 3.9 (benchmarks/triton_compile.py;
# docs/backends-triton.md has the table); none is tuned on a GPU yet.
CONFIGS = {
    ("fwd", 90, 64): (128, 64, 8, 3, 2), ("fwd", 90, 128): (128, 64, 8, 2, 4),
    ("dkdv", 90, 64): (32, 64, 4, 2, 2), ("dkdv", 90, 128): (32, 64, 8, 2, 2),
    ("dq", 90, 64): (64, 32, 4, 2, 2), ("dq", 90, 128): (64, 32, 8, 2, 2),
    ("fwd", 80, 64): (128, 64, 8, 2, 2), ("fwd", 80, 128): (128, 64, 8, 2, 4),
    ("dkdv", 80, 64): (32, 64, 8, 1, 2), ("dkdv", 80, 128): (32, 64, 8, 2, 2),
    ("dq", 80, 64): (64, 32, 4, 2, 2), ("dq", 80, 128): (32, 64, 8, 2, 4),
}
# Launches with rel_q (the position-to-content term: a per-key gather in the score and, in dkdv, per-key bins of dS)
# where the table above spills: their own entry, compiled without spills under both Tritons likewise.
RQ_CONFIGS = {
    ("fwd", 80, 64): (128, 64, 8, 2, 4), ("dkdv", 80, 64): (64, 32, 8, 2, 2),
    ("fwd", 80, 128): (64, 64, 8, 2, 2),
}
# Launches with grouped k/v and rel_q (dkdv loops over the group's query heads, each with its own per-key bins) where
# the entries above spill (44 bytes on sm_80, 540 on sm_90a at D = 64, Triton 3.9): their own, compiled without.
GQA_RQ_CONFIGS = {("dkdv", 80, 64): (64, 32, 8, 1, 2), ("dkdv", 90, 64): (32, 64, 8, 2, 2)}
# One arch's own entries where the table it takes (TABLE_OF_ARCH) spills there: the forward at D = 128 without a
# causal mask on sm_100a (144 bytes at 128 x 64, Triton 3.9) and sm_120 (16 bytes); 0 at 64 x 64 on both.
ARCH_CONFIGS = {("fwd", 100, 128): (64, 64, 8, 2, 2), ("fwd", 120, 128): (64, 64, 8, 2, 2)}
# Packed launches (VARLEN: every tile masked at its sequence's end) where the entries above spill: their own, by
# table (TABLE_OF_ARCH) or, first, by the GPU's own arch (the forward at D = 128 on sm_100a and sm_120). The entries
# they replace spill 8 to 40 bytes on sm_80, 28 on sm_120 (Triton 3.9); with rel_q 8 on sm_80, 24 on sm_90a, 100
# on sm_90a with grouped k/v, 24 to 132 in dq on sm_120 (3.9); 8 to 16 in the forward and dq on sm_80, sm_86, sm_89,
# 16 in dkdv on sm_90a at D = 128, 8 to 24 in dq and 32 in the forward on sm_100a (3.6). These compile without
# spills under both (benchmarks/triton_compile.py).
VARLEN_CONFIGS = {("fwd", 80, 128): (64, 64, 8, 2, 4), ("fwd", 100, 128): (64, 64, 8, 1, 2),
                  ("fwd", 120, 128): (64, 64, 8, 1, 2), ("dkdv", 80, 128): (32, 64, 8, 1, 2),
                  ("dkdv", 90, 128): (32, 64, 8, 1, 2)}
VARLEN_RQ_CONFIGS = {("fwd", 80, 64): (64, 64, 8, 2, 4), ("fwd", 90, 64): (128, 64, 8, 2, 2),
                     ("dkdv", 90, 64): (32, 64, 8, 1, 2), ("dq", 80, 64): (64, 32, 8, 1, 2)}
# The forward of a dense call whose lengths end mid-tile (N or M not a multiple of the tile: every load masked at
# the end, as a packed batch's) at D = 128 (head dims 65 to 128): with a key-padding mask the 128 x 64 entry above
# spills there (16 bytes on sm_80, 8 on sm_86 and sm_89, 40 on sm_90a at D = 96, N = 1500; 48 on sm_120 at 64 x 64,
# stages 2; Triton 3.9). By arch first, then by table, as VARLEN_CONFIGS; these compile without spills.
RAGGED_CONFIGS = {("fwd", 80, 128): (64, 64, 8, 2, 4), ("fwd", 90, 128): (64, 64, 8, 2, 4),
                  ("fwd", 100, 128): ARCH_CONFIGS[("fwd", 100, 128)], ("fwd", 120, 128): (64, 64, 8, 1, 2)}
# Launches with dropout (the mask's hashes: a row and a key hash per tile, one more per pair) where the entries above
# spill, by arch: the forward at D = 128 on sm_120 (8 bytes at 64 x 64, 2 stages, band / 2, causal; 128 bytes at
# 1 stage with lengths ending mid-tile and a padding mask, D = 96, N = 1500; Triton 3.9): 1 stage, band / 4.
DROPOUT_CONFIGS = {("fwd", 120, 128): (64, 64, 8, 1, 4)}
# Launches with the scalar bias rel_bias (T5's: the key term's scores without a^V, often without a^K) where the entries
# above spill (Triton 3.9): dkdv at D = 64 on the A100's table, 56 bytes on sm_80 and 72 on sm_120 with an fp16
# padding mask, 68 on sm_86 and sm_89 packed, 32 on sm_86, sm_89, sm_120 with dropout (32 x 64, 8 warps, 1 stage);
# the forward at D = 64 on sm_90a, 16 bytes decoding (3 stages). These compile without spills
# (benchmarks/triton_compile.py).
BIAS_CONFIGS = {("dkdv", 80, 64): (64, 32, 8, 2, 2), ("fwd", 90, 64): (128, 64, 8, 2, 2)}
# Which table each served arch uses. The A100's (at most 64 KB of shared memory per launch) fits the 99 KB of
# sm_86, sm_89 and sm_120; sm_100 (B200) takes it too. sm_100 and sm_120 have their own forward at D = 128
# (ARCH_CONFIGS). Each pairing
# compiles without spills and on tensor cores (benchmarks/triton_compile.py); none is timed on its GPU yet.
TABLE_OF_ARCH = {80: 80, 86: 80, 89: 80, 90: 90, 100: 80, 120: 80}
# The GPUs the kernels serve, as data: (compute capability, the dtypes served there). Each is compiled by
# benchmarks/triton_compile.py (docs/backends-triton.md, its table); elsewhere "auto" takes the next backend
# ("blocked": cuBLAS's tensor cores). Not sm_75 (T4) nor older: Triton emits no tensor-core instruction there, even in
# float16, and the forward spills 14-22 KB per thread; nor do they have bfloat16 tensor cores.
_EVERY_DTYPE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
CUDA_ARCHS = tuple((arch, _EVERY_DTYPE) for arch in (80, 86, 89, 90, 100, 120))
FP32_CONFIGS = {"fwd": (32, 32, 8, 1, 2), "dkdv": (16, 16, 8, 1, 1), "dq": (32, 16, 4, 2, 1)}  # float32, float64
# The interpreter pays per tile operation (about 0.2 ms, little more for a larger tile): large tiles there.
INTERPRETED_TILES = (128, 128)


def _tiles_ok(tiles) -> bool:
    return tiles is None or (isinstance(tiles, tuple) and len(tiles) == 2 and all(
        isinstance(t, int) and t >= 16 and t & (t - 1) == 0 for t in tiles))


@dataclass(frozen=True)
class TritonSettings:
    """Overrides of the launcher's choices (:data:`SETTINGS`; the tests set small tiles with
    ``SETTINGS.override(...)``)."""

    fwd_tiles: tuple[int, int] | None = None  # (BLOCK_M, BLOCK_N) of the forward instead of the table's
    bwd_tiles: tuple[int, int] | None = None  # the same for dkdv and dq
    band_split: int | None = None  # instead of the table's
    kv_splits: int = 0  # forward: splits of the keys (0: chosen by kv_splits)

    def __post_init__(self):
        for name in ("fwd_tiles", "bwd_tiles"):
            if not _tiles_ok(getattr(self, name)):
                raise ValueError(f"triton setting {name} must be None or two powers of two >= 16 (tl.dot's minimum);"
                                 f" got {getattr(self, name)!r}")
        split = self.band_split
        if split is not None and not (isinstance(split, int) and split >= 1 and split & (split - 1) == 0):
            raise ValueError(f"triton setting band_split must be None or a power of two >= 1; got {split!r}")
        if not isinstance(self.kv_splits, int) or self.kv_splits < 0:
            raise ValueError(f"triton setting kv_splits must be an int >= 0; got {self.kv_splits!r}")


SETTINGS = Settings(TritonSettings())
_state: dict = {}  # "kernels": the imported module; "error": None once imported, else why not


@torch.compiler.assume_constant_result  # traced first (torch.compile as the first call): run eagerly, a constant
def unavailable(recheck: bool = False) -> str | None:
    """None once the kernels are imported (on the first call), else why they cannot be; ``recheck`` forgets the
    answer given before (triton installed since, or removed)."""
    if recheck:
        _state.pop("error", None)
    if "error" not in _state:
        if importlib.util.find_spec("triton") is None:
            _state["error"] = "triton is not installed (pip install 'relattn[gpu]', Linux)"
        else:
            try:
                _kernels()
                _state["error"] = None
            except Exception as exc:  # an installed but broken triton: "auto" falls back, the error names it
                _state["error"] = f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return _state["error"]


def _kernels():
    """The ``@triton.jit`` kernels, imported on first use (the module state is a dict, as torch.compile and
    torch.export trace it fine)."""
    if "kernels" not in _state:
        from . import _triton_kernels

        _state["kernels"] = _triton_kernels
    return _state["kernels"]


def _launch(kernel, grid, **kwargs) -> None:
    """Every kernel launch of this module goes through here (benchmarks/triton_compile.py records them)."""
    kernel[grid](**kwargs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return max(16, 1 << max(0, x - 1).bit_length())


def _arch(device: torch.device) -> int | None:
    """The GPU's compute capability as 80, 90, ...; None when interpreted."""
    return compute_capability(device)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def config(kernel: str, dtype: torch.dtype, head_dim: int, arch: int | None, rel_q: bool = False,
           grouped: bool = False, varlen: bool = False, ragged: bool = False,
           dropout: bool = False, bias: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, BAND_SPLIT) of ``kernel`` ("fwd", "dkdv", "dq") for a padded head
    dim on a GPU of compute capability ``arch`` (None: interpreted), with or without the ``rel_q`` term, grouped
    k/v heads, a packed batch (``varlen``), lengths that end mid-tile (``ragged``: :data:`RAGGED_CONFIGS`),
    dropout (:data:`DROPOUT_CONFIGS`, by arch, first), the scalar bias without rel_q (``bias``:
    :data:`BIAS_CONFIGS`)."""
    if arch is None:
        return (*INTERPRETED_TILES, 4, 1, 1)
    if dtype not in LOW_PRECISION:
        return FP32_CONFIGS[kernel]
    dim = 64 if head_dim <= 64 else 128
    key = (kernel, TABLE_OF_ARCH.get(arch, 80), dim)
    if dropout and (kernel, arch, dim) in DROPOUT_CONFIGS:
        return DROPOUT_CONFIGS[(kernel, arch, dim)]
    for table in ((VARLEN_RQ_CONFIGS if varlen and rel_q else {}), (VARLEN_CONFIGS if varlen else {}),
                  (RAGGED_CONFIGS if ragged and not varlen else {})):
        if (kernel, arch, dim) in table or key in table:
            return table.get((kernel, arch, dim), table.get(key))
    if bias and not rel_q and key in BIAS_CONFIGS:
        return BIAS_CONFIGS[key]
    if rel_q and grouped and key in GQA_RQ_CONFIGS:
        return GQA_RQ_CONFIGS[key]
    if rel_q and key in RQ_CONFIGS:
        return RQ_CONFIGS[key]
    return ARCH_CONFIGS.get((kernel, arch, dim), CONFIGS[key])


@dataclass(frozen=True)
class Packed:
    """A packed batch's sequences (:class:`~relattn.backends._common.AttentionCall`): q (1, H, T, D), k, v (1, Hkv,
    T_k, D|Dv), sequence ``s`` the query rows ``cu_q[s]:cu_q[s + 1]`` and key rows ``cu_k[s]:cu_k[s + 1]``;
    ``max_q``, ``max_k`` the longest lengths."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int

    @property
    def count(self) -> int:
        return self.cu_q.shape[0] - 1


def _meta(kernel, q, k, v, rel_k, rel_v, mask, is_causal, rel_q=None, packed: Packed | None = None,
          dropout: bool = False, bias: bool = False):
    """The constexprs and launch options of one kernel for these inputs (``packed``: of a packed batch, whose
    lengths vary by sequence: the tiles cut to the longest, every tile masked at its sequence's end; ``rel_k``: the
    key term's table or its scores, QA: HAS_RK when not None, as with a rel_bias and no table)."""
    n, m = (q.shape[2], k.shape[2]) if packed is None else (packed.max_q, packed.max_k)
    dp, dvp = _pow2(q.shape[-1]), _pow2(v.shape[-1])
    bm, bn, warps, stages, split = config(kernel, q.dtype, max(dp, dvp), _arch(q.device), rel_q is not None,
                                          k.shape[1] != q.shape[1], packed is not None, dropout=dropout, bias=bias)
    if packed is None and (n % bm or m % bn):  # the lengths end mid-tile: the ragged entry, if there is one
        bm, bn, warps, stages, split = config(kernel, q.dtype, max(dp, dvp), _arch(q.device), rel_q is not None,
                                              k.shape[1] != q.shape[1], False, True, dropout, bias)
    settings = SETTINGS.current
    override = settings.fwd_tiles if kernel == "fwd" else settings.bwd_tiles
    if override is not None:
        bm, bn = override
    bm, bn = min(bm, _pow2(n)), min(bn, _pow2(m))  # no tile longer than needed
    split = settings.band_split or split
    split = max(1, min(split, (bm if kernel == "dkdv" else bn) // 16))  # band tiles of at least 16 (tl.dot's minimum)
    kern = _kernels()
    return dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=dp, HEAD_DIM_V=dvp,
                HAS_RK=rel_k is not None, HAS_RQ=rel_q is not None, HAS_RV=rel_v is not None,
                HAS_MASK=_mask_kind(q, k, mask), CAUSAL=is_causal,
                EVEN_M=packed is None and n % bm == 0, EVEN_N=packed is None and m % bn == 0,
                EVEN_D=(dp == q.shape[-1] and dvp == v.shape[-1]), VARLEN=packed is not None, DROPOUT=dropout,
                PREC="ieee" if q.dtype not in LOW_PRECISION else "tf32",
                ACC=kern.tl.float64 if q.dtype == torch.float64 else kern.tl.float32,
                BAND_SPLIT=split, num_warps=warps, num_stages=stages)


def _strides(prefix: str, t: Tensor | None, names: str) -> dict:
    """``{stride_<prefix><name>: t.stride(i)}`` (zeros for a missing tensor)."""
    return {f"stride_{prefix}{c}": (0 if t is None else t.stride(i)) for i, c in enumerate(names)}


def _table_strides(prefix: str, t: Tensor | None) -> dict:
    """(head, row, dim) strides; head stride 0 for a shared (1, 2K+1, d) table."""
    s = _strides(prefix, t, "hrd")
    if t is not None and t.shape[0] == 1:
        s[f"stride_{prefix}h"] = 0
    return s


def _mask_kind(q, k, mask) -> int:
    """0: no mask; 1: one value per key, the same for every query (a key-padding mask); 2: one per pair."""
    if mask is None:
        return 0
    return 2 if q.shape[2] > 1 and mask.expand(*q.shape[:3], k.shape[2]).stride(2) != 0 else 1


def _mask_args(q, k, mask) -> dict:
    b, h, n, _ = q.shape
    full = None if mask is None else mask.expand(b, h, n, k.shape[2])
    return dict(MASK=q if full is None else full, **_strides("m", full, "bhnm"))


def table_scores(x: Tensor, table: Tensor, dtype: torch.dtype, heads: int | None = None) -> Tensor:
    """``x @ table^T`` per head: (B, Hx, N, d), (Hr, 2K+1, d) -> (B, H, N, 2K+1) in ``dtype`` (one launch), H =
    ``heads`` (default Hx, a multiple of it: head h reads x's head ``h // (H // Hx)``)."""
    b, hx, n, d = x.shape
    h = hx if heads is None else heads
    r = table.shape[1]
    out = x.new_empty(b, h, n, r, dtype=dtype)
    block_n, block_r = (128, 128) if x.device.type == "cpu" else (64, 64) if x.element_size() == 2 else (32, 32)
    block_n, block_r = min(block_n, _pow2(n)), min(block_r, _pow2(r))
    _launch(_kernels()._table_scores_kernel, (_cdiv(n, block_n), b * h, _cdiv(r, block_r)),
            X=x, T=table, S=out, **_strides("x", x, "bhnd"), **_table_strides("t", table),
            **_strides("s", out, "bhn"), H=h, XGROUP=h // hx, N=n, D=d, R=r,
            BLOCK_N=block_n, BLOCK_R=block_r, HEAD_DIM=_pow2(d),
            PREC="ieee" if x.dtype not in LOW_PRECISION else "tf32", num_warps=4, num_stages=1)
    return out


def kv_splits(q_tiles: int, heads: int, m: int, bn: int, device: torch.device) -> int:
    """Splits of the keys for the forward: more than one only when the (query tile, batch * head) programs
    leave most of a GPU idle (decoding: one query against a long cache), each split at least 4 key tiles."""
    if (fixed := SETTINGS.current.kv_splits) > 0:
        return fixed
    if device.type != "cuda":
        return 1
    target = 2 * _sm_count(device)
    programs = q_tiles * heads
    if programs >= target // 2:
        return 1
    return max(1, min(math.ceil(target / programs), m // (4 * bn)))


def key_scores(k: Tensor, rel_q: Tensor | None, heads: int, dtype: torch.dtype) -> tuple[Tensor | None, int]:
    """``KA = k a^Q^T``, the keys' position-to-content scores, and KA_GROUP (query head h reads KA's head
    ``h // KA_GROUP``): (B, H, M, 2K+1) for a per-head table, (B, Hkv, M, 2K+1) for a shared one (k's own heads).
    (None, 1) without a table."""
    if rel_q is None:
        return None, 1
    if rel_q.shape[0] == 1:
        return table_scores(k, rel_q, dtype), heads // k.shape[1]
    return table_scores(k, rel_q, dtype, heads), 1


def _key_table_grads(kb: Tensor, k: Tensor, rel_q: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """From the per-(key, table row) bins of dS, KB (B, H, M, R): dk's share ``scale * sum over the group of
    KB_h @ a^Q_h`` (B, Hkv, M, d) in KB's dtype, and ``d a^Q = scale * sum of KB^T @ k`` (Hr, R, d) in rel_q's
    dtype; every sum in a fixed order."""
    b, h, m, r = kb.shape
    hkv, d = k.shape[1], k.shape[-1]
    g = h // hkv
    kf = k.to(kb.dtype)
    table = rel_q.to(kb.dtype)
    if rel_q.shape[0] == 1:
        bins = kb.view(b, hkv, g, m, r).sum(2)  # (B, Hkv, M, R): the group shares the table
        dk = torch.matmul(bins, table[0]) * scale
        grad = torch.mm(bins.permute(3, 0, 1, 2).reshape(r, b * hkv * m), kf.reshape(b * hkv * m, d))[None]
    else:
        dk = (torch.matmul(kb.view(b, hkv, g, m, r), table.view(hkv, g, r, d)) * scale).sum(2)
        lhs = kb.permute(1, 3, 0, 2).reshape(h, r, b * m)
        rhs = kf.permute(1, 0, 2, 3)[:, None].expand(hkv, g, b, m, d).reshape(h, b * m, d)
        grad = torch.bmm(lhs, rhs)
    return dk, (grad * scale).to(rel_q.dtype)


def _dropout_args(q, seed: Tensor | None, dropout_p: float) -> dict:
    """The dropout's kernel arguments: the seed tensor, int64 ``(seed, b0, i0, j0)`` (a bare seed, 0-dim or of one
    entry, has zero offsets; read by the kernel, no host sync), the keep threshold ``floor(p 2**32)`` and the kept
    weights' scale ``1 / (1 - p)``."""
    if dropout_p == 0.0:
        return dict(SEED=q, drop_threshold=0, drop_scale=1.0)
    if seed is None or seed.dtype != torch.int64 or seed.numel() not in (1, 4):
        raise ValueError(f"triton: dropout_p = {dropout_p} needs the seed as an int64 tensor (seed) or (seed, b0, "
                         f"i0, j0), got {None if seed is None else (seed.dtype, tuple(seed.shape))}")
    seed = seed.reshape(-1)
    if seed.numel() == 1:
        seed = torch.nn.functional.pad(seed, (0, 3))
    return dict(SEED=seed, drop_threshold=math.floor(dropout_p * 2**32), drop_scale=1.0 / (1.0 - dropout_p))


def _common_args(q, k, v, max_relative_position, query_offset, scale, packed: Packed | None,
                 seed: Tensor | None = None, dropout_p: float = 0.0) -> dict:
    """What every attention kernel takes: strides, sizes (a packed batch's: the longest lengths, and its cumulative
    lengths), the query offset, the scale in log2 units and the dropout's arguments."""
    b, h, n, d = q.shape
    n, m = (n, k.shape[2]) if packed is None else (packed.max_q, packed.max_k)
    return dict(**_strides("q", q, "bhnd"), **_strides("k", k, "bhnd"), **_strides("v", v, "bhnd"),
                GROUP=h // k.shape[1], N=n, M=m, D=d, DV=v.shape[3], MAX_REL=max_relative_position,
                off=query_offset, qk_scale=scale * LOG2E,
                CU_Q=q if packed is None else packed.cu_q, CU_K=q if packed is None else packed.cu_k,
                **_dropout_args(q, seed, dropout_p))


def forward(q, k, v, rel_k, rel_v, mask, seed=None, *, max_relative_position: int, is_causal: bool, scale: float,
            query_offset: int, dropout_p: float = 0.0, rel_q=None, q_pos=None, rel_bias=None) -> tuple[Tensor, Tensor]:
    """(out (B,H,N,Dv) in q's dtype, lse (B,H,N), float32 for 16-bit q); rows with no key give zeros and lse -inf.
    k, v: (B, Hkv, M, D|Dv) with H % Hkv == 0; rel_q: the position-to-content table (Hr, 2K+1, D) or None; q_pos:
    the queries the key table reads (q's shape; None: q); rel_bias (Hr, 2K+1): the scalar bias, added unscaled at
    the key term's row (folded into the key term's scores, :func:`key_term_scores`). ``dropout_p > 0``: the weights
    that multiply v and a^V dropped by the mask of ``seed`` (int64, a bare seed or ``(seed, b0, i0, j0)``: the
    mask's ``(b0 + b, h, i0 + i, j0 + j)``), the kept ones scaled by ``1 / (1 - p)``; lse is the undropped one."""
    return _forward(q, k, v, rel_k, rel_v, mask, max_relative_position=max_relative_position, is_causal=is_causal,
                    scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos, seed=seed, dropout_p=dropout_p,
                    rel_bias=rel_bias)


def varlen_forward(q, k, v, rel_k, rel_v, mask, seed, cu_seqlens_q, cu_seqlens_k, *, max_relative_position: int,
                   is_causal: bool, scale: float, query_offset: int, max_seqlen_q: int, max_seqlen_k: int,
                   dropout_p: float = 0.0, rel_q=None, q_pos=None, rel_bias=None) -> tuple[Tensor, Tensor]:
    """A packed batch's (out (1,H,T,Dv), laid out as the packed (T, H, Dv), lse (1,H,T)): q (1,H,T,D), k, v
    (1,Hkv,T_k,D|Dv), sequence ``s`` its rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and keys likewise, each the
    dense call with ``query_offset + m_s - n_s`` (:class:`~relattn.backends._common.AttentionCall`); one launch of
    each kernel for the whole batch, its programs over (query tile of the longest sequence, sequence * head).
    Dropout as :func:`forward`'s, sequence ``s`` drawn as batch entry ``s`` (rows and keys counted within it)."""
    if mask is not None:
        raise ValueError("triton varlen_forward: a packed call takes no mask")
    return _forward(q, k, v, rel_k, rel_v, None, max_relative_position=max_relative_position, is_causal=is_causal,
                    scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos, seed=seed, dropout_p=dropout_p,
                    rel_bias=rel_bias,
                    packed=Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k))


def _met_tables(tables, q, k, kk: int, is_causal: bool, query_offset: int, packed: Packed | None):
    """The tables with zeros in the rows no pair the call may attend meets (a sequence's queries at the end of its
    keys in a packed call): the kernels read a tile's whole window of rows, and a NaN there must reach nothing."""
    n, m = (q.shape[2], k.shape[2]) if packed is None else (packed.max_k, packed.max_q)
    return [unmet_rows_zeroed(t, n, m, kk, query_offset=query_offset, is_causal=is_causal) for t in tables]


def _met_bias(rel_bias, q, k, kk: int, is_causal: bool, query_offset: int, packed: Packed | None):
    """``rel_bias`` (Hr, 2K+1) with zeros in its unmet rows, as :func:`_met_tables` (a table of one column)."""
    if rel_bias is None:
        return None
    return _met_tables((rel_bias[..., None],), q, k, kk, is_causal, query_offset, packed)[0][..., 0]


def key_term_scores(x: Tensor, rel_k: Tensor | None, rel_bias: Tensor | None, scale: float,
                    dtype: torch.dtype) -> Tensor | None:
    """``QA``, what the kernels add per (row, table row) to ``q k^T`` before the scale: ``x a^K^T`` (B, H, N, 2K+1)
    in ``dtype``, plus ``rel_bias / scale`` (Hr, 2K+1) when given (the bias is unscaled: ``scale * QA`` then adds it
    once; the kernels, and SB, the per-row bins of dS the backward forms for a^K, serve it unchanged, and its
    gradient is SB summed over rows); None without either."""
    qa = table_scores(x, rel_k, dtype) if rel_k is not None else None
    if rel_bias is None:
        return qa
    if scale == 0.0:
        raise ValueError("triton: rel_bias is folded into the key term's scores as rel_bias / scale, so it needs "
                         "scale != 0; got scale = 0.0 (use backend='native', 'blocked' or 'dense')")
    bias = (rel_bias.to(dtype) / scale)[:, None, :]  # (Hr, 1, 2K+1) against (B, H, N, 2K+1)
    if qa is None:
        return bias.expand(x.shape[0], x.shape[1], x.shape[2], -1).contiguous()
    return qa.add_(bias)


def _bias_grad(sb: Tensor, rel_bias: Tensor) -> Tensor:
    """``d rel_bias``: SB (B, H, N, 2K+1), the per-row bins of dS, summed over batch and rows (and heads when
    shared), in a fixed order: (Hr, 2K+1) in rel_bias's dtype."""
    g = sb.sum((0, 2))
    return (g.sum(0, keepdim=True) if rel_bias.shape[0] == 1 else g).to(rel_bias.dtype)


def _forward(q, k, v, rel_k, rel_v, mask, *, max_relative_position: int, is_causal: bool, scale: float,
             query_offset: int, rel_q=None, q_pos=None, packed: Packed | None = None, seed: Tensor | None = None,
             dropout_p: float = 0.0, rel_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    b, h, n, _ = q.shape
    m, dv, kk = k.shape[2], v.shape[3], max_relative_position
    sdt = stats_dtype(q.dtype)
    if b * h * n == 0:
        return q.new_zeros(b, h, n, dv), q.new_full((b, h, n), float("-inf"), dtype=sdt)
    rel_k, rel_v, rel_q = _met_tables((rel_k, rel_v, rel_q), q, k, kk, is_causal, query_offset, packed)
    rel_bias = _met_bias(rel_bias, q, k, kk, is_causal, query_offset, packed)
    qa = key_term_scores(q if q_pos is None else q_pos, rel_k, rel_bias, scale, sdt)
    meta = _meta("fwd", q, k, v, qa, rel_v, mask, is_causal, rel_q, packed, dropout_p > 0.0, rel_bias is not None)
    # programs: (query tile, batch entry * head, split of the keys); a packed batch's entries are its sequences
    rows_n, rows_m, entries = (n, m, b) if packed is None else (packed.max_q, packed.max_k, packed.count)
    q_tiles = math.ceil(rows_n / meta["BLOCK_M"])
    splits = kv_splits(q_tiles, entries * h, rows_m, meta["BLOCK_N"], q.device)
    split_len = math.ceil(math.ceil(max(rows_m, 1) / splits) / meta["BLOCK_N"]) * meta["BLOCK_N"]
    splits = max(1, math.ceil(rows_m / split_len))
    if splits == 1 and packed is not None:  # laid out as the packed (T, H, Dv): the op's view back is free
        out, lse = q.new_empty(1, 1, n, h, dv).transpose(2, 3), q.new_empty(1, b, h, n, dtype=sdt)
    elif splits == 1:
        out, lse = q.new_empty(1, b, h, n, dv), q.new_empty(1, b, h, n, dtype=sdt)
    else:  # each split's normalised output, in the statistics' dtype, merged below
        out, lse = q.new_empty(splits, b, h, n, dv, dtype=sdt), q.new_empty(splits, b, h, n, dtype=sdt)
    ka, ka_group = key_scores(k, rel_q, h, sdt)
    bins = q.new_empty(b, h, n, 2 * kk + 1, dtype=sdt) if rel_v is not None else None
    scratch = qa if qa is not None else bins
    _launch(_kernels()._fwd_kernel, (q_tiles, entries * h, splits),
            Q=q, K=k, V=v, QA=q if qa is None else qa, KA=q if ka is None else ka, RV=q if rel_v is None else rel_v,
            **_mask_args(q, k, mask), BINS=q if bins is None else bins, OUT=out, LSE=lse,
            **_strides("s", scratch, "bhn"), **_strides("ka", ka, "bhn"), **_table_strides("rv", rel_v),
            **_strides("o", out, "sbhnd"), **_strides("l", lse, "sbhn"),
            **_common_args(q, k, v, kk, query_offset, scale, packed, seed, dropout_p), H=h, KA_GROUP=ka_group,
            split_len=split_len,
            **meta)
    if splits == 1:
        return out[0], lse[0]
    total = torch.logsumexp(lse, 0)  # fixed order: deterministic
    weights = torch.exp(lse - torch.where(torch.isfinite(total), total, torch.zeros_like(total)))
    return (weights[..., None] * out).sum(0).to(q.dtype), total


def _table_grad(bins: Tensor, x: Tensor, hr: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """scale * sum over batch (and heads when shared) of bins^T @ x: (B,H,N,R), (B,H,N,d) -> (Hr, R, d)."""
    b, h, n, r = bins.shape
    lhs = bins.permute(1, 3, 0, 2).reshape(h, r, b * n)
    rhs = x.to(bins.dtype).permute(1, 0, 2, 3).reshape(h, b * n, x.shape[-1])
    g = torch.bmm(lhs, rhs) * scale
    return (g.sum(0, keepdim=True) if hr == 1 else g).to(dtype)


def backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, *, max_relative_position: int, is_causal: bool,
             scale: float, query_offset: int, dropout_p: float = 0.0, rel_q=None, q_pos=None,
             rel_bias=None) -> tuple[Tensor, ...]:
    """(dq, dk, dv, d_rel_k | None, d_rel_v | None), then d_rel_q, d_q_pos, d_rel_bias up to the last one given
    (None for one not given before it), in their inputs' dtypes; dq, dk, dv contiguous; dk, dv of a key/value head
    summed over its group of query heads; d_rel_bias the per-row bins of dS summed over rows. With q_pos, dq is
    the content term's share and d_q_pos the key table's, ``scale * SB a^K``.
    Dropout: the forward's mask regenerated from ``seed`` (never stored)."""
    return _backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, max_relative_position=max_relative_position,
                     is_causal=is_causal, scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos, seed=seed,
                     dropout_p=dropout_p, rel_bias=rel_bias)


def varlen_backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, cu_seqlens_q, cu_seqlens_k, out, lse, *,
                    max_relative_position: int, is_causal: bool, scale: float, query_offset: int, max_seqlen_q: int,
                    max_seqlen_k: int, dropout_p: float = 0.0, rel_q=None, q_pos=None,
                    rel_bias=None) -> tuple[Tensor, ...]:
    """The gradients of :func:`varlen_forward`, as :func:`backward`'s (dq, dk, dv laid out as q, k, v: the packed
    layout); one launch of each kernel for the whole batch."""
    if mask is not None:
        raise ValueError("triton varlen_backward: a packed call takes no mask")
    return _backward(grad_out, q, k, v, rel_k, rel_v, None, out, lse, max_relative_position=max_relative_position,
                     is_causal=is_causal, scale=scale, query_offset=query_offset, rel_q=rel_q, q_pos=q_pos,
                     seed=seed, dropout_p=dropout_p, rel_bias=rel_bias,
                     packed=Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k))


def _rows(t: Tensor) -> Tensor:
    """``t`` as it is when its rows are contiguous and a row apart (a packed batch's (1, H, T, D) view), else
    contiguous (an ``expand()``ed row, stride 0: its gradient, laid out as it, would overlap)."""
    return t if t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1]) else t.contiguous()


def _backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, *, max_relative_position: int, is_causal: bool,
              scale: float, query_offset: int, rel_q=None, q_pos=None, packed: Packed | None = None,
              seed: Tensor | None = None, dropout_p: float = 0.0,
              rel_bias: Tensor | None = None) -> tuple[Tensor, ...]:
    b, h, n, _ = q.shape
    hkv, m, kk = k.shape[1], k.shape[2], max_relative_position
    if packed is None:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    else:  # the packed layout kept (the gradients' too: zeros_like keeps it)
        q, k, v = _rows(q), _rows(k), _rows(v)
    sdt = stats_dtype(q.dtype)
    # with rel_q, dk is kept in the statistics' dtype until the table's share is added
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k, dtype=k.dtype if rel_q is None else sdt), torch.zeros_like(v)
    d_rel_k = None if rel_k is None else torch.zeros_like(rel_k)
    d_rel_v = None if rel_v is None else torch.zeros_like(rel_v)
    trailing = (rel_q, q_pos, rel_bias)
    given = max((i + 1 for i, t in enumerate(trailing) if t is not None), default=0)  # d_rel_q, ... up to the last
    if b * h == 0 or n == 0 or m == 0:
        return (dq, dk.to(k.dtype), dv, d_rel_k, d_rel_v,
                *(None if t is None else torch.zeros_like(t) for t in trailing[:given]))
    rel_k, rel_v, rel_q = _met_tables((rel_k, rel_v, rel_q), q, k, kk, is_causal, query_offset, packed)
    rel_bias = _met_bias(rel_bias, q, k, kk, is_causal, query_offset, packed)
    grad_out = grad_out.to(q.dtype)
    grad_out = grad_out.contiguous() if packed is None else _rows(grad_out)
    delta = (grad_out.to(sdt) * out.to(sdt)).sum(-1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).contiguous()  # empty rows: P = 0
    reader = q if q_pos is None else q_pos.contiguous()  # the queries the key table reads
    qa = key_term_scores(reader, rel_k, rel_bias, scale, sdt)
    doa = table_scores(grad_out, rel_v, sdt) if rel_v is not None else None
    ka, ka_group = key_scores(k, rel_q, h, sdt)
    # per key, per table row: dS (for a^Q), written by the dk/dv kernel; zeros where no pair falls
    kb = torch.zeros(b, h, m, 2 * kk + 1, dtype=sdt, device=q.device) if rel_q is not None else None
    # per row, per table row: P (for a^V) and dS (for a^K); zeros where no pair falls
    pb = torch.zeros(b, h, n, 2 * kk + 1, dtype=sdt, device=q.device) if rel_v is not None else None
    sb = torch.zeros(b, h, n, 2 * kk + 1, dtype=sdt, device=q.device) if qa is not None else None
    scratch = next((t for t in (qa, doa, pb, sb) if t is not None), None)
    args = dict(Q=q, K=k, V=v, QA=q if qa is None else qa, KA=q if ka is None else ka,
                DOA=q if doa is None else doa, **_mask_args(q, k, mask), DO=grad_out, LSE=lse, DELTA=delta,
                **_strides("s", scratch, "bhn"), **_strides("ka", ka, "bhn"), **_strides("do", grad_out, "bhnd"),
                **_strides("l", lse, "bhn"), **_common_args(q, k, v, kk, query_offset, scale, packed, seed, dropout_p),
                KA_GROUP=ka_group, scale=scale)
    # programs: (key tile, batch entry * key/value head) and (query tile, batch entry * head); a packed batch's
    # entries are its sequences
    rows_n, rows_m, entries = (n, m, b) if packed is None else (packed.max_q, packed.max_k, packed.count)
    meta = _meta("dkdv", q, k, v, qa, rel_v, mask, is_causal, rel_q, packed, dropout_p > 0.0, rel_bias is not None)
    _launch(_kernels()._dkdv_kernel, (math.ceil(rows_m / meta["BLOCK_N"]), entries * hkv), DK=dk, DV_=dv,
            KB=q if kb is None else kb, **_strides("kb", kb, "bhn"), H_KV=hkv, **args, **meta)
    meta = _meta("dq", q, k, v, qa, rel_v, mask, is_causal, rel_q, packed, dropout_p > 0.0, rel_bias is not None)
    _launch(_kernels()._dq_kernel, (math.ceil(rows_n / meta["BLOCK_M"]), entries * h), DQ=dq,
            RK=q if rel_k is None else rel_k,
            PB=q if pb is None else pb, SB=q if sb is None else sb, H=h, **_table_strides("rk", rel_k), **args,
            KEY_TABLE_DQ=rel_k is not None and q_pos is None, **meta)
    if rel_k is not None:
        d_rel_k = _table_grad(sb, reader, rel_k.shape[0], rel_k.dtype, scale)
    if rel_v is not None:
        d_rel_v = _table_grad(pb, grad_out, rel_v.shape[0], rel_v.dtype)
    d_rel_q = d_q_pos = None
    if q_pos is not None:  # the key table's share of the position queries' gradient, scale * SB a^K, per head
        share = torch.matmul(sb, rel_k.to(sdt)) * scale if rel_k is not None else torch.zeros_like(q_pos, dtype=sdt)
        d_q_pos = share.to(q_pos.dtype)
    if rel_q is not None:
        dk_q, d_rel_q = _key_table_grads(kb, k, rel_q, scale)
        dk = (dk + dk_q).to(k.dtype)
    d_rel_bias = None if rel_bias is None else _bias_grad(sb, rel_bias)
    return (dq, dk, dv, d_rel_k, d_rel_v, *(d_rel_q, d_q_pos, d_rel_bias)[:given])


# relattn::triton_fwd_{version} / _bwd_{version}, the eager path and the ring's pair calls, and
# relattn::triton_varlen_fwd_{version} / _bwd_{version} for packed calls (Backend.packed): see _common.StatsOps.
OPS = StatsOps("triton", forward, backward, dropout=True)
VARLEN_OPS = StatsOps("triton_varlen", varlen_forward, varlen_backward, dropout=True, varlen=True)


def interpreted() -> bool:
    """Whether ``TRITON_INTERPRET`` is set now (Triton then interprets the kernels, on CPU tensors too)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_DECLARATIONS = {interpret: Serves(devices=frozenset({"cuda", "cpu"} if interpret else {"cuda"}),
                                   cuda_archs=CUDA_ARCHS, max_head_dim=MAX_HEAD_DIM, dropout=True, grouped_kv=True,
                                   pos_to_content=True, position_query=True, rel_bias=True,
                                   chunk_pairs=True, varlen=True) for interpret in (False, True)}


def serves() -> Serves:
    """What the backend serves, asked when a call or a construction asks: CUDA on the GPUs of :data:`CUDA_ARCHS`;
    CPU tensors too while ``TRITON_INTERPRET`` is set."""
    return _DECLARATIONS[interpreted()]


BACKEND = Backend("triton", OPS.run, serves,
                  "Triton flash kernels: key loops in three stages (left of the band, band, right), the key term "
                  "gathered from q a^K^T, the position-to-content term (rel_q) from k a^Q^T, the value term as "
                  "per-row bins times a^V (the CPU only under TRITON_INTERPRET=1)",
                  unavailable=unavailable, stats=OPS, packed=VARLEN_OPS)
