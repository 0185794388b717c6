"""The "native" backend's C++ kernel (``relattn/csrc/shaw_cpu.cpp``): built on first use, then cached.

Shaw attention in one flash pass on the CPU: per tile of queries, blocks of keys with an online softmax; the
relative key term is added to each row in three runs (left of the band, the band, right of it) from the
row's ``2K+1`` scores ``q_i . a^K_t``, and the value term is carried as ``2K+1`` weights per row. The kernel
never builds an (N, M) or (N, M, D) tensor, and its cost is within a few percent of PyTorch's own fused
attention.

The kernel is compiled with ``torch.utils.cpp_extension`` the first time it is needed (about 15 s on a
2-core machine; torch caches it under ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``,
keyed by the source and compiler flags). It needs a C++ compiler and ninja (a dependency of relattn, from
PyPI; a system one is used first). Where the build fails, or with
``RELATTN_NATIVE=0`` in the environment, :func:`unavailable` says why and "auto" uses the other backends.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
from importlib import resources

import torch

log = logging.getLogger("relattn")

TILE_Q = 256  # queries per tile
TILE_K = 512  # keys per block (benchmarks/fast_vs_sdpa.py: 128 and 1024 within a few percent at N = 2048)
KV_SPLITS = 0  # backward: key segments per head (0: more than 1 only when batch * heads leaves threads idle)

_SOURCE = "shaw_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "error": None once loaded, else the reason


def _capability_flags() -> list[str]:
    """Compiler flags for ATen's vectorized types at the CPU capability torch itself dispatches to."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
                "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
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


def _build() -> None:
    from torch.utils.cpp_extension import _get_build_directory as _build_directory  # imported here: slow to import
    from torch.utils.cpp_extension import load

    source = resources.files("relattn").joinpath("csrc", _SOURCE)
    text = source.read_bytes()
    flags = ["-O3", "-fopenmp", *_capability_flags()]
    key = hashlib.sha256(text + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]
    name = f"relattn_native_{key}"
    try:
        cached = os.path.exists(os.path.join(_build_directory(name, verbose=False), f"{name}.so"))
    except Exception:  # a private helper of torch: if it moves, say "compiling" anyway
        cached = False
    if not cached:
        log.warning("relattn: compiling the native CPU kernel (once, about 15 s; torch caches it)")
    with resources.as_file(source) as path, _ninja_on_path():
        load(name, [str(path)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)


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


def unavailable() -> str | None:
    """None once the kernel is loaded (building it on the first call), else why it cannot be."""
    if "error" in _state:
        return _state["error"]
    with _lock:
        if "error" not in _state:
            if os.environ.get("RELATTN_NATIVE", "1") == "0":
                _state["error"] = "disabled by RELATTN_NATIVE=0"
            elif (missing := toolchain_missing()) is not None:
                _state["error"] = f"the native kernel cannot be built: {missing}"
                log.warning("relattn: %s; 'auto' uses the other backends", _state["error"])
            else:
                try:
                    _build()
                    _state["error"] = None
                except Exception as exc:  # no compiler, no ninja, a BLAS symbol missing: fall back
                    _state["error"] = f"the native kernel could not be built ({type(exc).__name__}: {_cause(exc)})"
                    log.warning("relattn: %s; 'auto' uses the other backends", _state["error"])
    return _state["error"]


def _require() -> None:
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"relattn: {reason}")


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _to_kernel(*tensors):
    """The kernel computes in float32 or float64: 16-bit tensors go in as float32 (so the scores, the softmax
    statistics and the sums are float32, as in the "fused" backend), None stays None."""
    return [t.float() if t is not None and t.dtype in _LOW_PRECISION else t for t in tensors]


def _table(t):
    """The kernel reads a table as a contiguous (Hr, 2K+1, d) array."""
    return None if t is None else t.contiguous()


def forward(q, k, v, rel_k, rel_v, mask, *, max_relative_position: int, is_causal: bool, scale: float,
            query_offset: int):
    """(out (B,H,N,Dv) in q's dtype, lse (B,H,N), float32 for 16-bit q); rows with no key give zeros, lse -inf."""
    _require()
    out, lse = torch.ops.relattn_native.fwd(*_to_kernel(q, k, v, _table(rel_k), _table(rel_v), mask),
                                            max_relative_position, is_causal, scale, query_offset, TILE_Q, TILE_K)
    return out.to(q.dtype), lse


def backward(grad_out, q, k, v, rel_k, rel_v, mask, out, lse, *, max_relative_position: int, is_causal: bool,
             scale: float, query_offset: int):
    """(dq, dk, dv, d_rel_k, d_rel_v) in their inputs' dtypes; a table gradient is an empty tensor when the table
    is None."""
    _require()
    grads = torch.ops.relattn_native.bwd(*_to_kernel(grad_out, q, k, v, _table(rel_k), _table(rel_v), mask, out), lse,
                                         max_relative_position, is_causal, scale, query_offset, TILE_Q, TILE_K,
                                         KV_SPLITS)
    return tuple(g if t is None else g.to(t.dtype) for g, t in zip(grads, (q, k, v, rel_k, rel_v), strict=True))
