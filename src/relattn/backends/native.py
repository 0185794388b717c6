"""The "native" backend: a C++ kernel (``relattn/csrc/shaw_cpu.cpp``), CPU only, built on first use, then cached.

Shaw attention in one flash pass on the CPU: per tile of queries, blocks of keys with an online softmax; the
relative key term is added to each row in three runs (left of the band, the band, right of it) from the
row's ``2K+1`` scores ``q_i . a^K_t``, and the value term is carried as ``2K+1`` weights per row. The kernel
never builds an (N, M) or (N, M, D) tensor, and its cost is within a few percent of PyTorch's own fused
attention.

The kernel is compiled with ``torch.utils.cpp_extension`` the first time it is needed (about 15 s on a
2-core machine) into ``$TORCH_EXTENSIONS_DIR`` (by default ``~/.cache/torch_extensions``), under a name keyed
by what changes the binary only: the source text, the compiler flags, the torch version and the compiler's
``--version``. A library already built under that key is loaded as it is, whichever way relattn was installed
or started. It needs a C++ compiler and ninja (a dependency of relattn, from PyPI; a system one is used first).
Where the build fails, or with ``RELATTN_NATIVE=0`` in the environment, :func:`unavailable` says why and
"auto" uses the other backends.

Any float dtype, any additive mask that needs no gradient, dropout (every backend's mask, ``_common.dropout_keep``,
drawn in the kernel from row and column hashes and drawn again in the backward), the position-to-content table ``rel_q``
(``KA = k a^Q^T`` per head and thread, added per row in the same three runs; its gradient binned per key by the
backward task that owns the key), the scalar bias ``rel_bias`` (T5's: added to each tile's ``2K+1`` row scores before
the runs, its gradient those rows' sums of dS); k and v may have fewer heads than q
(grouped-query attention, ``H % Hkv == 0``), read in place: dk and dv of a key/value head are summed over its
query heads in a fixed order (one task per batch entry and key/value head runs its group's query heads in turn),
so the gradients are the same bits from one run to the next.

Packed calls (:func:`relattn.relative_attention_varlen`; :data:`VARLEN_OPS`, :func:`varlen_forward`,
:func:`varlen_backward`) run whole, in one parallel pass over (sequence, head, tile of queries) tasks forward and
(sequence, key/value head) tasks backward: q (1, H, T, D), k and v (1, Hkv, T_k, .) are the packed tensors' strided
views, read in place; each task reads its sequence's rows (``cu_seqlens_q``, ``cu_seqlens_k``) with positions counted
from the sequence's start, its queries at the end of its keys, and writes its rows of out, lse and the gradients.
The tasks are split into runs of equal cost per thread, as ragged lengths make them unequal; nothing is padded, and
a sequence costs what its own dense call does.

The kernel's choices for the CPU it runs on (queries per tile, keys per block, which 16-bit dtypes take 16-bit GEMMs)
come from the CPU's features (:func:`choice`, :mod:`relattn.backends.cpu`); ``RELATTN_NATIVE_SETTINGS`` and
``SETTINGS.override`` override them.

16-bit inputs (bfloat16, float16) go one of two ways (``SETTINGS.current.gemm16``, :func:`uses_gemm16`):

* **16-bit GEMMs** where the CPU has instructions for them (``avx512_bf16`` or AMX for bfloat16; ``avx512_fp16``
  or AMX-FP16 for float16) and libtorch exports MKL's 16-bit GEMMs: q, k, v, dO stay 16-bit, the GEMMs over keys
  accumulate in float32, P and dS are rounded to 16 bits for theirs (as PyTorch's own CPU flash attention does);
  softmax statistics, relative terms and accumulators are float32. On the ``amx`` class those whose B is k or v
  (q k^T, P v forward; q k^T, dO v^T, dS k backward) go to torch's brgemm (oneDNN's micro-kernel, AMX tiles) on keys
  and values packed once per call, where torch runs it (:func:`uses_brgemm`; the ``brgemm`` setting): 0.2-0.4 of
  MKL's time on a tile's shapes on the Xeon AMX (``benchmarks/gemm16.py``). Float32 calls there take torch's float32
  brgemm for P v and dS k (on v and k as they lie: about 0.9 of MKL's sgemm's time).
* **float32 copies** elsewhere: the inputs are converted to float32 and the float32 kernel runs (one rounding of
  the output). On a CPU without 16-bit instructions this is the faster of the two (MKL's 16-bit GEMMs convert
  inside there, and run slower than its float32 GEMM).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from importlib import resources
from pathlib import Path

import torch

from .._io import atomic_path
from . import cpu
from ._common import (
    LOW_PRECISION,
    Backend,
    Serves,
    StatsOps,
)
from ._settings import Settings
from .cpu import ENV, NativeSettings, settings_from_env

log = logging.getLogger("relattn")



@functools.cache
def choice() -> cpu.NativeChoice:
    """This CPU's choices (:func:`relattn.backends.cpu.choose` of its features), made once per process."""
    return cpu.choose(cpu.features())


SETTINGS = Settings(settings_from_env(os.environ.get(ENV), NativeSettings(tile_k=choice().tile_k)))


_SOURCE = "shaw_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, else the reason


def _capability_flags() -> list[str]:
    """Compiler flags for ATen's vectors at torch's dispatch level (and AVX512_BF16's rounding where the CPU has it)."""
    cap, bf16 = torch.backends.cpu.get_cpu_capability(), ["-mavx512bf16"] if "avx512_bf16" in cpu.features().isa else []
    if cap == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *bf16, "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return ["-DCPU_CAPABILITY=DEFAULT"]


@contextlib.contextmanager
def _ninja_on_path():
    """torch runs ``ninja`` by name: put the interpreter's bin directory (where the ``ninja`` wheel installs it)
    on PATH for the build when the system has none, and restore PATH afterwards."""
    path = os.environ.get("PATH", "")
    bin_dir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is not None or shutil.which("ninja", path=bin_dir) is None:
        yield
        return
    os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def _compiler_identity() -> bytes:
    """The compiler torch will run (``$CXX``, else ``c++``) and what it says of its version."""
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = b""
    return cxx.encode() + b"\0" + version


def build_key(source: bytes, flags: list[str]) -> str:
    """The cache key of a build: the source text, the flags, the torch version and the compiler, nothing else
    (not where relattn is installed, nor which ninja or Python runs the build)."""
    parts = [source, " ".join(flags).encode(), torch.__version__.encode(), _compiler_identity()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def build(package=None) -> None:
    """Build (or load from the cache) the kernel whose source is ``csrc/shaw_cpu.cpp`` of ``package`` (a folder or
    ``importlib.resources`` traversable; default: the installed relattn's) and load it into torch."""
    from torch.utils.cpp_extension import (
        _get_build_directory,  # imported here: slow to import
        load,
    )

    package = resources.files("relattn") if package is None else package
    text = package.joinpath("csrc", _SOURCE).read_bytes()
    flags = ["-O3", "-fopenmp", *_capability_flags()]
    name = f"relattn_native_{build_key(text, flags)}"
    build_dir = _get_build_directory(name, verbose=False)
    library = os.path.join(build_dir, f"{name}.so")
    if os.path.exists(library) and not os.path.exists(os.path.join(build_dir, "lock")):
        torch.ops.load_library(library)
        return
    log.warning("relattn: compiling the native CPU kernel into %s (about 15 s)", build_dir)
    # The build reads a copy of the source kept in its own directory, so the path ninja records never changes.
    source = Path(build_dir, _SOURCE)
    if not source.exists() or source.read_bytes() != text:
        with atomic_path(source) as tmp:
            tmp.write_bytes(text)
    with _ninja_on_path():
        load(name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
             build_directory=build_dir, verbose=False)


_TELLING = re.compile(r"not found|error:|fatal|undefined symbol|no such file|required", re.IGNORECASE)


def _cause(exc: Exception) -> str:
    """The telling line of a failed build (a build log ends in "ninja: build stopped"; the cause is above)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if _TELLING.search(line) and not line.startswith("Error building extension"):
            return line
    return lines[-1] if lines else "no message"


def toolchain_missing() -> str | None:
    """Why no build can even start here (no C++ compiler: torch runs ``$CXX``, else ``c++``), else None. A build
    that starts and fails is not this: that is a bug, and :func:`unavailable` reports it."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; set CXX or install g++)"
    return None


def availability(builder=build) -> str | None:
    """Why the kernel cannot run here, found now (``RELATTN_NATIVE=0``, no compiler, a build ``builder()`` that
    fails), else None once ``builder()`` has loaded it. :func:`unavailable` asks this once and keeps the answer."""
    if os.environ.get("RELATTN_NATIVE", "1") == "0":
        return "disabled by RELATTN_NATIVE=0"
    if (missing := toolchain_missing()) is not None:
        reason = f"the native kernel cannot be built: {missing}"
    else:
        try:
            builder()
            return None
        except Exception as exc:  # no compiler, no ninja, a BLAS symbol missing: fall back
            reason = f"the native kernel could not be built ({type(exc).__name__}: {_cause(exc)})"
    log.warning("relattn: %s; 'auto' uses the other backends", reason)
    return reason


@torch.compiler.assume_constant_result  # traced first (torch.compile as the first call): run eagerly, a constant
def unavailable() -> str | None:
    """None once the kernel is loaded (building it on the first call), else why it cannot be (:func:`availability`,
    asked once per process)."""
    if "error" in _state:
        return _state["error"]
    with _lock:
        if "error" not in _state:
            _state["error"] = availability()
    return _state["error"]


def _require() -> None:
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"relattn: {reason}")


@functools.cache
def gemm16_here(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` inputs take 16-bit GEMMs on this CPU: the CPU's choice (:func:`relattn.backends.cpu.choose`:
    ``avx512_bf16``/AMX-BF16 for bfloat16, ``avx512_fp16``/AMX-FP16 for float16) and libtorch exports MKL's GEMM for
    it (cached: ``gemm16_here.cache_clear()`` reads the CPU again)."""
    _require()
    chosen = str(dtype).removeprefix("torch.") in cpu.choose(cpu.read_features()).gemm16
    return chosen and torch.ops.relattn_native.has_gemm16(dtype)


def uses_gemm16(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` inputs run 16-bit GEMMs: the ``gemm16`` setting when set, else :func:`gemm16_here`."""
    if dtype not in LOW_PRECISION:
        return False
    forced = SETTINGS.current.gemm16
    return gemm16_here(dtype) if forced is None else forced


@functools.cache
def brgemm_here(dtype: torch.dtype) -> bool:
    """Whether torch runs brgemm (oneDNN's micro-kernel, :func:`relattn.backends.cpu.choose`'s ``brgemm``) for
    ``dtype`` on this CPU (``cpublas::could_pack``, as PyTorch's own CPU flash attention asks)."""
    _require()
    return torch.ops.relattn_native.has_brgemm(dtype)


def uses_brgemm(dtype: torch.dtype) -> bool:
    """Whether GEMMs of ``dtype`` go to torch's brgemm rather than MKL's: float32's ``P v`` and ``dS k`` (on v and k
    as they lie), or 16-bit's whose B is k or v (on keys and values packed once; 16-bit GEMMs, :func:`uses_gemm16`);
    the ``brgemm`` setting (None: the CPU's choice), and torch runs it for ``dtype``. The kernel also needs 64 queries
    per key/value head, and for 16-bit inputs head dims that are multiples of 16."""
    if dtype not in LOW_PRECISION and dtype != torch.float32:
        return False
    forced = SETTINGS.current.brgemm
    wanted = choice().brgemm if forced is None else forced
    return wanted and (dtype == torch.float32 or uses_gemm16(dtype)) and brgemm_here(dtype)


def tile_q(n: int, causal: bool, rows: int = 0, keys: int = 0) -> int:
    """Queries per tile for ``n`` queries: the ``tile_q`` setting when set; else the CPU's tile (:func:`choice`,
    256 on every CPU class so far), and for causal calls 32 below 192 queries and 64 below 768 (the split of
    PyTorch's own CPU flash attention): a tile's rows meet the keys up to its last row only, so smaller tiles skip more
    of the masked half (at N = 512, 1 thread: forward 15 ms at 64 against 22 ms at 256, backward 55 against 65;
    without causal, 64 and 256 within noise). A table of ``rows`` rows longer than a full tile reaches against
    ``keys`` keys (DeBERTa-v3's 1013 rows at N = 512) takes the CPU's ``wide_table_tile``: a tile computes only the
    ``tile + keys - 1`` table rows it meets (64 on the Zen 3: DeBERTa-v3's attention at N = 512, one thread, about
    0.9x the time of 256-query tiles; 256 on the Xeon AMX, whose 2 MiB of L2 favour packing each key block less)."""
    if (fixed := SETTINGS.current.tile_q) > 0:
        return fixed
    full, wide = choice().tile_q, choice().wide_table_tile
    if not causal:
        return wide if rows > full + keys - 1 and n > wide else full
    return 32 if n < 192 else 64 if n < 768 else full


def _as_float(t):
    """A 16-bit tensor as float32; anything else (None too) as it is."""
    return t.float() if t is not None and t.dtype in LOW_PRECISION else t


def _data(gemm16: bool, *tensors):
    """q, k, v (and dO, out) for the kernel: 16-bit as they are for 16-bit GEMMs, else as float32 (the whole kernel
    then runs in float32)."""
    if gemm16 or tensors[0].dtype not in LOW_PRECISION:
        return tensors
    return tuple(_as_float(t) for t in tensors)


def _table(t):
    """A table (Hr, 2K+1, d) or the scalar bias (Hr, 2K+1) as the kernel takes it: contiguous, float32 for 16-bit
    inputs (the kernel's compute type), or None."""
    return None if t is None else _as_float(t.contiguous())


def _tables_and_mask(rel_k, rel_v, mask, rel_q):
    """rel_k, rel_v, the mask and rel_q as the kernel takes them (:func:`_table`; the mask float32 for 16-bit)."""
    return _table(rel_k), _table(rel_v), _as_float(mask), _table(rel_q)


def _tiles(n: int, m: int, is_causal: bool, max_relative_position: int) -> tuple[int, int]:
    """(queries per tile, keys per block) for ``n`` queries against ``m`` keys (a packed call: the longest)."""
    return tile_q(n, is_causal, 2 * max_relative_position + 1, m), SETTINGS.current.tile_k


def _in_dtypes(grads, inputs) -> tuple:
    """The kernel's gradients (its compute type) in their inputs' dtypes (an absent input's left as it is)."""
    return tuple(g if t is None or g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, inputs, strict=True))


def forward(q, k, v, rel_k, rel_v, mask, seed=None, *, max_relative_position: int, is_causal: bool,
            dropout_p: float = 0.0, scale: float, query_offset: int, rel_q=None, q_pos=None, rel_bias=None):
    """(out (B,H,N,Dv) in q's dtype, lse (B,H,N), float32 for 16-bit q); rows with no key give zeros, lse -inf.
    k, v may have Hkv heads, H % Hkv == 0; q_pos (q's shape and dtype), when given, the queries rel_k reads;
    rel_bias (Hr, 2K+1), the scalar bias. ``dropout_p > 0``: the weights dropped by every backend's mask
    (``_common.dropout_keep``) of ``seed`` (int64, (seed) or (seed, b0, i0, j0)); lse stays the undropped
    normaliser's."""
    _require()
    dtype = q.dtype
    brgemm = q.shape[-2] * (q.shape[-3] // k.shape[-3]) >= 64 and uses_brgemm(dtype)  # the kernel's test, first
    if dtype in LOW_PRECISION:
        q, k, v, q_pos = _data(uses_gemm16(dtype), q, k, v, q_pos)
        tables = _tables_and_mask(rel_k, rel_v, mask, rel_q)
    else:  # a decoding step's path: every microsecond here is a few percent of it
        tables = (None if rel_k is None else rel_k.contiguous(), None if rel_v is None else rel_v.contiguous(), mask,
                  None if rel_q is None else rel_q.contiguous())
    tiles = _tiles(q.shape[-2], k.shape[-2], is_causal, max_relative_position)
    out, lse = torch.ops.relattn_native.fwd.default(q, k, v, *tables, q_pos, _table(rel_bias), max_relative_position,
                                                    is_causal, scale, query_offset, *tiles, seed, dropout_p, brgemm)
    return (out if out.dtype == dtype else out.to(dtype)), lse


def backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, out, lse, *, max_relative_position: int, is_causal: bool,
             dropout_p: float = 0.0, scale: float, query_offset: int, rel_q=None, q_pos=None, rel_bias=None):
    """(dq, dk, dv, d_rel_k, d_rel_v, d_rel_q, d_q_pos, d_rel_bias) in their inputs' dtypes (dk, dv with k's Hkv
    heads); a table gradient, and d_q_pos, is an empty tensor when its input is None. With q_pos, dq is the content
    term's share only and d_q_pos the key table's."""
    _require()
    gemm16 = uses_gemm16(q.dtype)
    go, q_, k_, v_, out_, qp = _data(gemm16, grad_out, q, k, v, out, q_pos)
    tiles = _tiles(q.shape[-2], k.shape[-2], is_causal, max_relative_position)
    grads = torch.ops.relattn_native.bwd(go, q_, k_, v_, *_tables_and_mask(rel_k, rel_v, mask, rel_q), qp,
                                         _table(rel_bias), out_, lse, max_relative_position, is_causal, scale,
                                         query_offset, *tiles, SETTINGS.current.kv_splits, seed, dropout_p,
                                         uses_brgemm(q.dtype))
    return _in_dtypes(grads, (q, k, v, rel_k, rel_v, rel_q, q_pos, rel_bias))


def _no_mask(mask) -> None:
    if mask is not None:
        raise ValueError(f"relattn native: a packed call takes no mask; got a {type(mask).__name__}")


def varlen_forward(q, k, v, rel_k, rel_v, mask, seed, cu_seqlens_q, cu_seqlens_k, *, max_relative_position: int,
                   is_causal: bool, dropout_p: float = 0.0, scale: float, query_offset: int, max_seqlen_q: int,
                   max_seqlen_k: int, rel_q=None, q_pos=None, rel_bias=None):
    """A packed call: (out (1,H,T,Dv) in q's dtype, lse (1,H,T), float32 for 16-bit q). q (1,H,T,D), k (1,Hkv,T_k,D),
    v (1,Hkv,T_k,Dv) (any row strides; rows closer than a row apart, as an ``expand()``ed row, are copied); sequence
    s holds query rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1`` and key rows ``cu_seqlens_k[s] ..`` likewise, its
    query i at position ``i + m_s - n_s + query_offset``: the dense :func:`forward` of its own rows (with dropout,
    batch entry ``s`` of the mask). Rows with no key give zeros, lse -inf. ``mask`` must be None."""
    _require()
    _no_mask(mask)
    gemm16 = uses_gemm16(q.dtype)
    tiles = _tiles(max_seqlen_q, max_seqlen_k, is_causal, max_relative_position)
    q_, k_, v_, qp = _data(gemm16, q, k, v, q_pos)
    rel_k, rel_v, _, rel_q = _tables_and_mask(rel_k, rel_v, None, rel_q)
    out, lse = torch.ops.relattn_native.varlen_fwd(q_, k_, v_, rel_k, rel_v, rel_q, qp, _table(rel_bias), cu_seqlens_q,
                                                   cu_seqlens_k, max_relative_position, is_causal, scale, query_offset,
                                                   *tiles, seed, dropout_p, uses_brgemm(q.dtype))
    return (out if out.dtype == q.dtype else out.to(q.dtype)), lse


def varlen_backward(grad_out, q, k, v, rel_k, rel_v, mask, seed, cu_seqlens_q, cu_seqlens_k, out, lse, *,
                    max_relative_position: int, is_causal: bool, dropout_p: float = 0.0, scale: float,
                    query_offset: int, max_seqlen_q: int, max_seqlen_k: int, rel_q=None, q_pos=None, rel_bias=None):
    """The gradients of :func:`varlen_forward`'s call, as :func:`backward` gives them (dq (1,H,T,D), dk, dv
    (1,Hkv,T_k,.), the tables' in their shapes): one task per (sequence, key/value head), table gradients summed
    per thread in a fixed order."""
    _require()
    _no_mask(mask)
    gemm16 = uses_gemm16(q.dtype)
    go, q_, k_, v_, out_, qp = _data(gemm16, grad_out, q, k, v, out, q_pos)
    tiles = _tiles(max_seqlen_q, max_seqlen_k, is_causal, max_relative_position)
    rel_k_, rel_v_, _, rel_q_ = _tables_and_mask(rel_k, rel_v, None, rel_q)
    grads = torch.ops.relattn_native.varlen_bwd(go, q_, k_, v_, rel_k_, rel_v_, rel_q_, qp, _table(rel_bias), out_, lse,
                                                cu_seqlens_q, cu_seqlens_k, max_relative_position, is_causal, scale,
                                                query_offset, *tiles, SETTINGS.current.kv_splits, seed, dropout_p,
                                                uses_brgemm(q.dtype))
    return _in_dtypes(grads, (q, k, v, rel_k, rel_v, rel_q, q_pos, rel_bias))


def planned_forward(call):
    """The kernel call of calls like ``call`` that autograd will not differentiate (:meth:`StatsOps.inference`):
    ``f(q, k, v, rel_k, rel_v, rel_q, q_pos, query_offset) -> out``, the op itself with ``call``'s other scalars
    (tables (2K+1, d) or (Hr, 2K+1, d)); None for 16-bit inputs (:func:`forward` converts them) and masks."""
    if call.q.dtype in LOW_PRECISION or call.mask is not None:
        return None
    fwd = torch.ops.relattn_native.fwd.default
    kk, causal, scale, rows = call.max_relative_position, call.is_causal, call.scale, 2 * call.max_relative_position + 1

    def run(q, k, v, rel_k, rel_v, rel_q, q_pos, query_offset):
        tiles = tile_q(q.shape[-2], causal, rows, k.shape[-2]), SETTINGS.current.tile_k
        return fwd(q, k, v, rel_k, rel_v, None, rel_q, q_pos, None, kk, causal, scale, query_offset, *tiles)[0]

    return run


# relattn::native_fwd_{version} / _bwd_{version} (and relattn::native_varlen_fwd_{version} / _bwd_{version} for packed
# calls), the eager path and the ring's pair calls: see _common.StatsOps.
OPS = StatsOps("native", forward, backward, dropout=True, flat_tables=True, planned=planned_forward)
VARLEN_OPS = StatsOps("native_varlen", varlen_forward, varlen_backward, dropout=True, varlen=True)


BACKEND = Backend("native", OPS.run,
                  Serves(devices=frozenset({"cpu"}), dropout=True, grouped_kv=True, pos_to_content=True,
                         position_query=True, rel_bias=True, chunk_pairs=True, varlen=True),
                  "C++ kernel, one flash pass: the key term added per row in three runs (left, band, right), "
                  "the value term as 2K+1 weights per row; CPU, masks, dropout, grouped k/v, rel_q, rel_bias, "
                  "packed sequences in one pass (16-bit GEMMs where the CPU has 16-bit instructions, else float32)",
                  unavailable=unavailable, stats=OPS, packed=VARLEN_OPS)
