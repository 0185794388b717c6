"""The "native" backend's internals: tiles of any size, the backward's key segments, masks across tiles, 16-bit
inputs computed in float32, and the build: its cache key, loading a library already built, the "compiling" line,
and a failed build as a reason rather than an error. Its results against the reference are in
``test_conformance.py``.

The kernel's tests are skipped, with the reason, only where it cannot be built at all (no C++ compiler, or
``RELATTN_NATIVE=0``); anywhere else it must build, so a compile error fails them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from helpers import CASES, IDS, assert_close, grads, random_inputs, reference_output, unavailable_here
from relattn import functional as fn
from relattn.backends import native

UNAVAILABLE = unavailable_here("native")
needs_native = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
SOURCE = resources.files("relattn").joinpath("csrc", "shaw_cpu.cpp").read_bytes()
FLAGS = ["-O3", "-fopenmp", *native._capability_flags()]


pytestmark = pytest.mark.usefixtures("small_tiles")  # 3 queries per tile, 5 keys per block unless a test sets its own


def _case_runner(small_tiles, case, *, tiles, splits=0, seed):
    """Set the kernel's (queries, keys) tiles and backward key segments, make the inputs of a CASES entry, and
    return ``run(backend)`` -> (output, gradients) for one fixed output gradient."""
    small_tiles(native=tiles, native_splits=splits)
    b, h, n = case[:3]
    inputs, kw = _inputs(case, seed)
    go = torch.randn(b, h, n, case[5], dtype=torch.float64)
    return lambda backend: grads(backend, inputs, go, **kw)


def _inputs(case, seed):
    b, h, n, m, d, dv, kk, tables, causal, off = case
    return (random_inputs(b, h, n, m, d, dv, kk, tables=tables, requires_grad=True, seed=seed),
            dict(max_relative_position=kk, is_causal=causal, query_offset=off))


# ----------------------------------------------------------------------------------------- tiles, key segments


@needs_native
@pytest.mark.parametrize("tiles", [(1, 1), (2, 3), (4, 7), (256, 512)])
@pytest.mark.parametrize("case", CASES[:5] + CASES[9:], ids=IDS[:5] + IDS[9:])
def test_any_tiling_matches_dense_autograd(small_tiles, tiles, case):
    """The kernel's result does not depend on its tile sizes (tiles of 1, odd sizes, one tile for everything)."""
    run = _case_runner(small_tiles, case, tiles=tiles, seed=3)
    want_out, want = run("dense")
    got_out, got = run("native")
    assert_close(got_out, want_out, torch.float64, "out")
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, torch.float64, "grad")


@needs_native
@pytest.mark.parametrize("splits", [0, 2, 5])
@pytest.mark.parametrize("case", CASES[:5] + CASES[9:] + [(1, 1, 40, 40, 4, 4, 3, "per_head", False, 0)],
                         ids=IDS[:5] + IDS[9:] + ["one-head"])
def test_backward_key_segments(small_tiles, splits, case):
    """The backward split into key segments per head (forced, or automatic when batch * heads < threads, as in
    the one-head case): the same gradients, and the same bits from one call to the next."""
    run = _case_runner(small_tiles, case, tiles=(2, 3), splits=splits, seed=4)
    want = run("dense")[1]
    got = run("native")[1]
    again = run("native")[1]
    for a, w, a2 in zip(got, want, again, strict=True):
        assert_close(a, w, torch.float64, "grad")
        assert torch.equal(a, a2)


def _masks(b, h, n, m, g):
    keypad = torch.ones(b, 1, 1, m, dtype=torch.bool)
    keypad[1:, ..., m - m // 3 :] = False  # padding at the end: rows near the start see no far-right key
    start = torch.ones(b, 1, 1, m, dtype=torch.bool)
    start[..., : m // 2] = False  # no key at the start: the far-left region of the first rows is empty
    rows = torch.rand(n, m, generator=g) > 0.4
    rows[3] = False  # a row with nothing to attend to: zeros, zero gradients
    per_head = torch.randn(1, h, n, m, generator=g, dtype=torch.float64)
    per_head[0, 1, :, ::3] = float("-inf")
    return {"keypad": keypad, "start": start, "rows": rows, "per_head": per_head}


@needs_native
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("kind", ["keypad", "start", "rows", "per_head"])
@pytest.mark.parametrize("shape", [(40, 40, 4, False, 0), (40, 40, 4, True, 0), (30, 45, 5, True, 15),
                                   (30, 45, 5, False, -6)], ids=["full", "causal", "decode", "offset"])
def test_masks_match_reference_and_dense_grads(small_tiles, chunked, kind, shape):
    """``chunked``: 1-query tiles, 1-key blocks."""
    n, m, kk, causal, off = shape
    b, h = 2, 3
    inputs = random_inputs(b, h, n, m, 4, 4, kk, tables="keys_per_head", requires_grad=True, seed=5)
    mask = _masks(b, h, n, m, torch.Generator().manual_seed(6))[kind]
    kw = dict(max_relative_position=kk, attn_mask=mask, is_causal=causal, query_offset=off)
    go = torch.randn(b, h, n, 4, dtype=torch.float64)
    want_out, want = grads("dense", inputs, go, **kw)
    if chunked:
        small_tiles(native=(1, 1))
    got_out, got = grads("native", inputs, go, **kw)
    assert torch.isfinite(got_out).all()
    assert_close(got_out, reference_output(*inputs, **kw), torch.float64, "out vs reference")
    assert_close(got_out, want_out, torch.float64, "out")
    for name, a, w in zip("q k v rel_k rel_v".split(), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close(a, w, torch.float64, f"d{name}")
    if kind == "rows":
        assert torch.equal(got_out[:, :, 3], torch.zeros_like(got_out[:, :, 3]))


# ----------------------------------------------------------------------------------------- dtypes, dropout


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_is_float32_inside(dtype):
    """16-bit inputs are computed in float32: the output is the float32 computation on the same (rounded) inputs,
    rounded once. The backward is the float32 one, except that rowsum(dO * O) uses the saved 16-bit output (as
    PyTorch's own flash backward does), so gradients are within a few 16-bit roundings of the float32 ones."""
    lo = [t.to(dtype).requires_grad_() for t in random_inputs(1, 2, 30, 30, 8, 8, 3, tables="keys_per_head")]
    hi = [t.detach().float().requires_grad_() for t in lo]
    go = torch.randn(1, 2, 30, 8).to(dtype)
    out_lo, g_lo = grads("native", lo, go, max_relative_position=3, is_causal=True)
    out_hi, g_hi = grads("native", hi, go.float(), max_relative_position=3, is_causal=True)
    assert out_lo.dtype == dtype and torch.equal(out_lo, out_hi.to(dtype))
    eps = torch.finfo(dtype).eps
    for a, b, x in zip(g_lo, g_hi, lo, strict=True):
        assert a.dtype == x.dtype
        err, bound = (a.float() - b).abs().max().item(), 4 * eps * (1 + b.abs().max().item())
        assert err <= bound, (err, bound)


@needs_native
def test_refuses_dropout():
    with pytest.raises(ValueError, match="native.*dropout"):
        fn.relative_attention(*random_inputs(1, 2, 9, 9, 4, 4, 2), max_relative_position=2, dropout_p=0.1,
                              backend="native")


# ----------------------------------------------------------------------------------------- availability


def test_build_failure_is_a_reason_not_an_error(monkeypatch):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setenv("CXX", sys.executable)  # some existing program: the toolchain check passes, the build fails
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", no_compiler)
    assert native.unavailable() == ("the native kernel could not be built (RuntimeError: Ninja is required to load "
                                    "C++ extensions)")

    def no_cxx():
        raise RuntimeError("Error building extension 'relattn_native_x': [1/2] c++ -O3 -c shaw_cpu.cpp\n"
                           "FAILED: [code=127] shaw_cpu.o\n/bin/sh: 1: c++: not found\n"
                           "ninja: build stopped: subcommand failed.\n")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", no_cxx)
    assert native.unavailable() == "the native kernel could not be built (RuntimeError: /bin/sh: 1: c++: not found)"
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native.unavailable() == ("the native kernel cannot be built: no C++ compiler ('/nonexistent/c++' not "
                                    "found; set CXX or install g++)")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("RELATTN_NATIVE", "0")
    assert native.unavailable() == "disabled by RELATTN_NATIVE=0"


# ----------------------------------------------------------------------------------------- the build and its key


def _path_without_interpreter_bin() -> str:
    bin_dir = os.path.dirname(sys.executable)
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir)


def test_build_key_depends_on_source_flags_torch_and_compiler_only(monkeypatch):
    """Not on PATH (an activated venv puts its bin, with the ninja wheel, first; ``.venv/bin/python`` does not),
    nor on where the source lives (the key takes its text): on the source text, the flags, torch's version and
    the compiler's identity, each of which changes the binary."""
    key = native.build_key(SOURCE, FLAGS)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + _path_without_interpreter_bin())
    assert native.build_key(SOURCE, FLAGS) == key
    monkeypatch.setenv("PATH", _path_without_interpreter_bin())
    assert native.build_key(SOURCE, FLAGS) == key
    assert native.build_key(SOURCE + b"\n// edited", FLAGS) != key
    assert native.build_key(SOURCE, [*FLAGS, "-DEXTRA"]) != key
    monkeypatch.setattr(native, "_compiler_identity", lambda: b"c++\0another compiler 1.0\n")
    assert native.build_key(SOURCE, FLAGS) != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert native.build_key(SOURCE, FLAGS) != key


class _NoBuild(Exception):
    pass


def _refuse_to_compile(*args, **kwargs):
    raise _NoBuild("the library should have been loaded from the cache, not compiled again")


@needs_native
def test_build_loads_the_cached_library_wherever_the_source_is_and_whatever_path(monkeypatch, tmp_path):
    """With the library already built, ``_build()`` loads it and compiles nothing (``cpp_extension.load`` raises
    here), from a copy of the package elsewhere and with the interpreter's bin directory off PATH."""
    assert native.unavailable() is None  # built (or loaded) once in this session
    loaded = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _refuse_to_compile)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    native._build()
    (library,) = loaded
    assert os.path.basename(library) == f"relattn_native_{native.build_key(SOURCE, FLAGS)}.so"
    elsewhere = tmp_path / "site-packages" / "relattn"
    shutil.copytree(Path(str(resources.files("relattn").joinpath("csrc"))), elsewhere / "csrc")
    monkeypatch.setattr(native.resources, "files", lambda package: elsewhere)
    monkeypatch.setenv("PATH", _path_without_interpreter_bin())
    native._build()
    assert loaded == [library, library]


@needs_native
def test_a_second_process_loads_the_cached_library(tmp_path):
    """A fresh interpreter, started another way (PATH without the interpreter's bin directory, another working
    directory), finds the library the first built and runs it without compiling."""
    script = textwrap.dedent("""
        import torch, torch.utils.cpp_extension
        def refuse(*a, **k):
            raise SystemExit("compiled again")
        torch.utils.cpp_extension.load = refuse
        from relattn import relative_attention
        from relattn.backends import native
        assert native.unavailable() is None, native.unavailable()
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
        rk = torch.randn(5, 4, generator=g, dtype=torch.float64)
        got = relative_attention(q, k, v, rk, rk, max_relative_position=2, backend="native")
        want = relative_attention(q, k, v, rk, rk, max_relative_position=2, backend="dense")
        assert (got - want).abs().max() < 1e-12
        print("loaded", native.build_key(native.resources.files("relattn").joinpath("csrc", "shaw_cpu.cpp")
                                         .read_bytes(), ["-O3", "-fopenmp", *native._capability_flags()]))
    """)
    env = {**os.environ, "PATH": _path_without_interpreter_bin(),
           "PYTHONPATH": str(Path(native.__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    assert native.unavailable() is None  # the first process: built (or loaded) here
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["loaded", native.build_key(SOURCE, FLAGS)]
    assert "compiling" not in done.stderr


def test_every_build_says_it_is_compiling(monkeypatch, tmp_path, caplog):
    """No library under the key (a fresh extensions directory): each ``_build()`` logs the "compiling" line with
    the build directory, then compiles a copy of the source kept in that directory -- the second build too."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, sources, **kw: builds.append((name, sources,
                                                                                                      kw)))
    with caplog.at_level(logging.WARNING, logger="relattn"):
        native._build()
        native._build()
    name = f"relattn_native_{native.build_key(SOURCE, FLAGS)}"
    build_dir = tmp_path / name
    compiling = [r.getMessage() for r in caplog.records if "compiling the native CPU kernel" in r.getMessage()]
    assert compiling == [f"relattn: compiling the native CPU kernel into {build_dir} (about 15 s)"] * 2
    assert [(n, s, kw["build_directory"]) for n, s, kw in builds] == [(name, [str(build_dir / "shaw_cpu.cpp")],
                                                                       str(build_dir))] * 2
    assert (build_dir / "shaw_cpu.cpp").read_bytes() == SOURCE
