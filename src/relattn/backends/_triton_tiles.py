"""The "triton" backend's tiles: one table, :data:`TILES`, and its one lookup, :func:`config`; and the launcher's
overrides of it, :data:`SETTINGS`.

A launch's tiles, warps, pipeline stages and band split are decided by the kernel ("fwd", "dkdv", "dq"), the GPU's
compute capability, the precision (16-bit inputs, or float32/float64), the padded head dim (up to 64, or up to 128)
and the launch's variant: what it adds to the plain tile body in registers (``rel_q``'s gathers and per-key bins,
grouped k/v heads with ``rel_q``, a packed batch's or a dense call's lengths that end mid-tile, dropout's hashes,
dropout with lengths that end mid-tile, a compact window's launches, the scalar bias ``rel_bias`` without
``rel_q``).
:func:`variants` lists the variants a launch may take, most specific first; :func:`config` takes the first the table
holds for its (kernel, arch, precision, dim), else the plain entry. Every entry compiles without spills for its arch
under Triton 3.6 and 3.9 (``benchmarks/triton_compile.py``); why each entry is what it is, and the compile table,
are in docs/backends-triton.md ("Tiles, and the compile check"). None is tuned by timing on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ._settings import Settings


class Tiles(NamedTuple):
    """One launch's choice: BLOCK_M queries, BLOCK_N keys, warps, pipeline stages, and BAND_SPLIT (the band's tiles
    that many times narrower: keys for the forward and dq, queries for dkdv)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    band_split: int


# The archs whose tiles are the A100's (sm_80: at most 64 KB of shared memory per launch, which sm_86, sm_89 and
# sm_120's 99 KB hold; sm_100 takes them too), and the H100's.
A100_LIKE = (80, 86, 89, 100, 120)
H100 = (90,)
EVERY_ARCH = tuple(sorted(A100_LIKE + H100))
SIXTEEN, THIRTY_TWO = "16-bit", "32-bit"  # precisions: float16/bfloat16; float32/float64
# A variant's name -> the launch flags it needs (all of them), most specific first: the lookup's order.
VARIANTS = {
    "dropout_window": {"dropout", "window"},
    "window": {"window"},
    "dropout_ragged": {"dropout", "ragged"},
    "dropout": {"dropout"},
    "varlen_rq": {"varlen", "rel_q"},
    "varlen": {"varlen"},
    "ragged": {"ragged"},
    "bias": {"bias"},
    "gqa_rq": {"grouped", "rel_q"},
    "rq": {"rel_q"},
    "plain": set(),
}
_ROWS = [  # kernel, variant, archs, precision, padded head dims, tiles
    ("fwd", "plain", A100_LIKE, SIXTEEN, (64,), Tiles(128, 64, 8, 2, 2)),
    ("fwd", "plain", (80, 86, 89), SIXTEEN, (128,), Tiles(128, 64, 8, 2, 4)),
    ("fwd", "plain", (100, 120), SIXTEEN, (128,), Tiles(64, 64, 8, 2, 2)),
    ("fwd", "plain", H100, SIXTEEN, (64,), Tiles(128, 64, 8, 3, 2)),
    ("fwd", "plain", H100, SIXTEEN, (128,), Tiles(128, 64, 8, 2, 4)),
    ("dkdv", "plain", A100_LIKE, SIXTEEN, (64,), Tiles(32, 64, 8, 1, 2)),
    ("dkdv", "plain", A100_LIKE, SIXTEEN, (128,), Tiles(32, 64, 8, 2, 2)),
    ("dkdv", "plain", H100, SIXTEEN, (64,), Tiles(32, 64, 4, 2, 2)),
    ("dkdv", "plain", H100, SIXTEEN, (128,), Tiles(32, 64, 8, 2, 2)),
    ("dq", "plain", A100_LIKE, SIXTEEN, (64,), Tiles(64, 32, 4, 2, 2)),
    ("dq", "plain", A100_LIKE, SIXTEEN, (128,), Tiles(32, 64, 8, 2, 4)),
    ("dq", "plain", H100, SIXTEEN, (64,), Tiles(64, 32, 4, 2, 2)),
    ("dq", "plain", H100, SIXTEEN, (128,), Tiles(64, 32, 8, 2, 2)),
    ("fwd", "rq", A100_LIKE, SIXTEEN, (64,), Tiles(128, 64, 8, 2, 4)),
    ("fwd", "rq", A100_LIKE, SIXTEEN, (128,), Tiles(64, 64, 8, 2, 2)),
    ("dkdv", "rq", A100_LIKE, SIXTEEN, (64,), Tiles(64, 32, 8, 2, 2)),
    ("dkdv", "gqa_rq", A100_LIKE, SIXTEEN, (64,), Tiles(64, 32, 8, 1, 2)),
    ("dkdv", "gqa_rq", H100, SIXTEEN, (64,), Tiles(32, 64, 8, 2, 2)),
    ("fwd", "varlen", (80, 86, 89), SIXTEEN, (128,), Tiles(64, 64, 8, 2, 4)),
    ("fwd", "varlen", (100, 120), SIXTEEN, (128,), Tiles(64, 64, 8, 1, 2)),
    ("dkdv", "varlen", EVERY_ARCH, SIXTEEN, (128,), Tiles(32, 64, 8, 1, 2)),
    ("fwd", "varlen_rq", A100_LIKE, SIXTEEN, (64,), Tiles(64, 64, 8, 2, 4)),
    ("fwd", "varlen_rq", H100, SIXTEEN, (64,), Tiles(128, 64, 8, 2, 2)),
    ("dkdv", "varlen_rq", H100, SIXTEEN, (64,), Tiles(32, 64, 8, 1, 2)),
    ("dq", "varlen_rq", A100_LIKE, SIXTEEN, (64,), Tiles(64, 32, 8, 1, 2)),
    ("fwd", "ragged", (80, 86, 89, 90), SIXTEEN, (128,), Tiles(64, 64, 8, 2, 4)),
    ("fwd", "ragged", (100,), SIXTEEN, (128,), Tiles(64, 64, 8, 2, 2)),
    ("fwd", "ragged", (120,), SIXTEEN, (128,), Tiles(64, 64, 8, 1, 4)),
    ("fwd", "dropout", (120,), SIXTEEN, (128,), Tiles(64, 64, 8, 1, 4)),
    ("fwd", "dropout_ragged", (120,), SIXTEEN, (128,), Tiles(32, 64, 8, 1, 4)),
    ("fwd", "window", (100,), SIXTEEN, (128,), Tiles(64, 64, 8, 1, 2)),
    ("dkdv", "window", (100,), SIXTEEN, (128,), Tiles(32, 64, 8, 1, 2)),
    ("fwd", "dropout_window", (100,), SIXTEEN, (128,), Tiles(64, 64, 8, 1, 4)),
    ("fwd", "bias", H100, SIXTEEN, (64,), Tiles(128, 64, 8, 2, 2)),
    ("dkdv", "bias", A100_LIKE, SIXTEEN, (64,), Tiles(64, 32, 8, 2, 2)),
    ("fwd", "plain", EVERY_ARCH, THIRTY_TWO, (64, 128), Tiles(32, 32, 8, 1, 2)),
    ("dkdv", "plain", EVERY_ARCH, THIRTY_TWO, (64, 128), Tiles(16, 16, 8, 1, 1)),
    ("dq", "plain", EVERY_ARCH, THIRTY_TWO, (64, 128), Tiles(32, 16, 4, 2, 1)),
]
# (kernel, variant, arch, precision, padded head dim) -> Tiles: the rows above, one entry per key.
TILES = {(kernel, variant, arch, precision, dim): tiles
         for kernel, variant, archs, precision, dims, tiles in _ROWS for arch in archs for dim in dims}
assert len(TILES) == sum(len(archs) * len(dims) for _, _, archs, _, dims, _ in _ROWS), "a key written twice"
# The interpreter pays per tile operation (about 0.2 ms, little more for a larger tile): large tiles there.
INTERPRETED = Tiles(128, 128, 4, 1, 1)


def variants(rel_q: bool = False, grouped: bool = False, varlen: bool = False, ragged: bool = False,
             dropout: bool = False, window: bool = False, bias: bool = False) -> list[str]:
    """The variants a launch with these flags may take, most specific first (the last is "plain"); ``bias``: the
    launch adds rel_bias without rel_q (with rel_q it takes rel_q's entries)."""
    flags = {name for name, on in (("rel_q", rel_q), ("grouped", grouped), ("varlen", varlen), ("ragged", ragged),
                                   ("dropout", dropout), ("window", window), ("bias", bias)) if on}
    return [name for name, needs in VARIANTS.items() if needs <= flags]


def config(kernel: str, sixteen_bit: bool, head_dim: int, arch: int | None, **flags: bool) -> Tiles:
    """The :class:`Tiles` of ``kernel`` ("fwd", "dkdv", "dq") for 16-bit inputs or not, a padded head dim, on a GPU
    of compute capability ``arch`` (None: interpreted; an arch not served takes sm_80's), with the launch's
    ``flags`` (:func:`variants`' keywords): the first of its variants :data:`TILES` holds."""
    if arch is None:
        return INTERPRETED
    arch = arch if arch in EVERY_ARCH else 80
    dim = 64 if head_dim <= 64 else 128
    precision = SIXTEEN if sixteen_bit else THIRTY_TWO
    return next(TILES[key] for name in variants(**flags)
                if (key := (kernel, name, arch, precision, dim)) in TILES)


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
    window_rows: int = 0  # query rows per compact window (0: chosen by _triton_args.windows, for wide tables only)

    def __post_init__(self):
        for name in ("fwd_tiles", "bwd_tiles"):
            if not _tiles_ok(getattr(self, name)):
                raise ValueError(f"triton setting {name} must be None or two powers of two >= 16 (tl.dot's minimum);"
                                 f" got {getattr(self, name)!r}")
        split = self.band_split
        if split is not None and not (isinstance(split, int) and split >= 1 and split & (split - 1) == 0):
            raise ValueError(f"triton setting band_split must be None or a power of two >= 1; got {split!r}")
        for name in ("kv_splits", "window_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"triton setting {name} must be an int >= 0; got {getattr(self, name)!r}")


SETTINGS = Settings(TritonSettings())
