"""The "native" backend's internals: tiles of any size, the backward's key segments, masks across tiles, 16-bit
inputs (through 16-bit GEMMs, and through float32 copies as on a CPU without 16-bit instructions), grouped k/v
(fewer key/value heads than query heads), and the build: its cache key, loading a library already built, the
"compiling" line, and a failed build as a reason rather than an error. Its results against the reference are in
``test_conformance.py``.

The kernel's tests are skipped, with the reason, only where it cannot be built at all (no C++ compiler, or
``RELATTN_NATIVE=0``); anywhere else it must build, so a compile error fails them.
"""

from __future__ import annotations

import contextlib
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

from helpers import (
    CASES,
    IDS,
    assert_close,
    attention_ref,
    grads,
    oracle_grads,
    random_inputs,
    reference_output,
    unavailable_here,
)
from relattn import functional as fn
from relattn.backends import AttentionCall, native
from relattn.positions import relative_position_index

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


def test_tile_q_by_length_for_causal_calls(kernel_settings):
    kernel_settings(native, tile_q=0)
    assert [native.tile_q(n, True) for n in (1, 191, 192, 767, 768, 4096)] == [32, 32, 64, 64, 256, 256]
    assert {native.tile_q(n, False) for n in (1, 128, 512, 4096)} == {256}
    # a table longer than a 256-query tile reaches: the CPU's tile for long tables (64, or 256 on the amx class)
    wide = native.choice().wide_table_tile
    assert native.tile_q(512, False, 1013, 512) == wide and native.tile_q(512, False, 1013, 1024) == 256
    assert native.tile_q(2048, False, 1023, 2048) == 256 and native.tile_q(40, False, 1013, 40) == 256
    kernel_settings(native, tile_q=7)
    assert native.tile_q(100, True) == native.tile_q(100, False) == 7


def test_settings_refuse_bad_values_and_restore_after_the_block():
    before = native.SETTINGS.current
    with pytest.raises(ValueError, match="tile_k must be an int >= 1; got 0"):
        native.SETTINGS.override(tile_k=0).__enter__()
    with pytest.raises(TypeError, match="unknown setting.*TILE_Q"):
        native.SETTINGS.override(TILE_Q=3).__enter__()
    with native.SETTINGS.override(tile_q=5) as inner:
        assert inner.tile_q == 5 and native.tile_q(100, True) == 5
        with native.SETTINGS.override(gemm16=False):
            assert native.SETTINGS.current.tile_q == 5 and not native.uses_gemm16(torch.bfloat16)
        assert native.SETTINGS.current.gemm16 is before.gemm16
    assert native.SETTINGS.current == before


@needs_native
def test_default_tiles_match_dense(small_tiles):
    """The tiles a user gets (TILE_Q = 0: 64-query tiles for this causal N = 200), with a query offset."""
    run = _case_runner(small_tiles, (1, 2, 200, 230, 8, 8, 5, "per_head", True, 30), tiles=(0, 512), seed=8)
    want_out, want = run("dense")
    got_out, got = run("native")
    assert_close(got_out, want_out, torch.float64, "out")
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, torch.float64, "grad")


@needs_native
@pytest.mark.parametrize("shape", [(67, 64, 64, 64, 66, True), (600, 59, 33, 5, 599, False), (7, 64, 59, 2, 3, True)],
                         ids=["m67-K64-causal", "m600-d59-dv33", "m7-causal-offset3"])
@pytest.mark.parametrize("tables", ["shared", "per_head", "none"])
def test_one_query_in_float32_matches_the_oracle(small_tiles, one_thread, shape, tables):
    """A decoding step (one query against M cached keys) in float32 at the default tiles: every GEMM of the forward
    and of the backward has one row there, which the kernel runs as its own vectorized GEMV (row counts and head dims
    that leave tails: 67 keys, D = 59, Dv = 33); outputs and gradients against the float64 oracle."""
    small_tiles(native=(0, 512))
    m, d, dv, kk, off, causal = shape
    inputs = random_inputs(1, 3, 1, m, d, dv, kk, tables=tables, dtype=torch.float32, requires_grad=True, seed=11)
    kw = dict(max_relative_position=kk, query_offset=off, is_causal=causal)
    go = torch.randn(1, 3, 1, dv, generator=torch.Generator().manual_seed(12))
    got_out, got = grads("native", inputs, go, **kw)
    want_out, want = oracle_grads(inputs, go, **kw)
    assert_close(got_out, want_out, torch.float32, "out")
    with torch.no_grad():  # the inference path calls the kernel directly
        assert torch.equal(fn.relative_attention(*inputs, backend="native", **kw), got_out.detach())
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, torch.float32, "grad")


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
def test_16_bit_fallback_is_float32_inside(kernel_settings, dtype):
    """The path of a CPU without 16-bit instructions (forced here): 16-bit inputs are computed in float32, so the
    output is the float32 computation on the same (rounded) inputs, rounded once. The backward is the float32 one,
    except that rowsum(dO * O) uses the saved 16-bit output (as PyTorch's own flash backward does), so gradients
    are within a few 16-bit roundings of the float32 ones."""
    kernel_settings(native, gemm16=False)
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
def test_16_bit_gemms_only_where_the_cpu_has_the_instructions(monkeypatch):
    """gemm16 None: 16-bit GEMMs for bfloat16 where the CPU reports avx512_bf16 or amx_bf16, for float16 where it
    reports avx512_fp16 or amx_fp16 (and libtorch exports the GEMM); float32 copies on any other CPU. gemm16
    True / False forces one path; float32 and float64 never take it."""
    monkeypatch.setattr(torch.ops.relattn_native, "has_gemm16", lambda dtype: True, raising=False)
    try:
        _check_gemm16_choices(monkeypatch)
    finally:
        native.gemm16_here.cache_clear()  # this CPU's own answer again


def _check_gemm16_choices(monkeypatch):
    for caps, bf16, fp16 in [({}, False, False), ({"avx512_bf16": True}, True, False),
                             ({"amx_bf16": True, "avx512_fp16": False}, True, False),
                             ({"avx512_fp16": True}, False, True), ({"amx_fp16": True, "amx_bf16": True}, True, True)]:
        native.gemm16_here.cache_clear()
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda caps=caps: caps)
        with native.SETTINGS.override(gemm16=None):
            assert (native.uses_gemm16(torch.bfloat16), native.uses_gemm16(torch.float16)) == (bf16, fp16), caps
            assert not native.uses_gemm16(torch.float32) and not native.uses_gemm16(torch.float64)
        for forced in (True, False):
            with native.SETTINGS.override(gemm16=forced):
                assert native.uses_gemm16(torch.bfloat16) is forced and native.uses_gemm16(torch.float16) is forced
                assert not native.uses_gemm16(torch.float32)


def _plain_error(got, plain, want):
    """(max |got - want|, max |plain - want|)."""
    return (got.detach().double() - want).abs().max().item(), (plain.detach().double() - want).abs().max().item()


# (B, H, N, M, K, tables, mask, is_causal, query_offset): masks, causal, offsets and per-head tables
_16_BIT_CASES = {
    "full-shared": (2, 2, 70, 70, 8, "shared", None, False, 0),
    "causal-per-head": (1, 3, 70, 70, 8, "per_head", None, True, 0),
    "decode-offset-keypad": (2, 2, 30, 75, 6, "keys_per_head", "keypad", True, 45),
    "offset-per-head-mask": (1, 2, 50, 60, 5, "values_per_head", "per_head", False, -7),
}


# Where the 2x rule does not hold for a gradient, on both paths alike: rowsum(dO * O) comes from the saved 16-bit
# output (as in PyTorch's own flash backward), and on this decoding shape (a far-left run holding most keys) that
# rounding reaches dq and d rel_k coherently. There the 16-bit GEMMs must stay within 2x of the float32-copies
# path's own error.
_SAVED_OUTPUT_BOUND = {"decode-offset-keypad": {"dq", "drel_k"}}


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(_16_BIT_CASES))
def test_16_bit_gemms_within_2x_of_plain_pytorch(dtype, case):
    """16-bit GEMMs (forced; on a CPU without 16-bit instructions MKL converts inside): the output and every
    gradient within twice the error of plain PyTorch at the same dtype ("dense" on the 16-bit inputs: 16-bit
    matmuls, float32 softmax) against float64 (see _SAVED_OUTPUT_BOUND for the exceptions), and not the
    float32-inside result (another computation ran)."""
    b, h, n, m, kk, tables, mask_kind, causal, off = _16_BIT_CASES[case]
    d = 16
    inputs = random_inputs(b, h, n, m, d, d, kk, tables=tables, requires_grad=True, seed=21)
    inputs = [None if t is None else (t * 0.5).detach().requires_grad_() for t in inputs]
    mask = None if mask_kind is None else _masks(b, h, n, m, torch.Generator().manual_seed(22))[mask_kind]
    go = torch.randn(b, h, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(23))
    kw = dict(max_relative_position=kk, attn_mask=mask, is_causal=causal, query_offset=off)
    want_out, want = grads("dense", inputs, go, **kw)
    lo = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    kw16 = {**kw, "attn_mask": mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)}
    plain_out, plain = grads("dense", lo, go.to(dtype), **kw16)
    with native.SETTINGS.override(gemm16=True):
        got_out, got = grads("native", lo, go.to(dtype), **kw16)
    with native.SETTINGS.override(gemm16=False):
        f32_out, f32 = grads("native", lo, go.to(dtype), **kw16)
    assert got_out.dtype == dtype and not torch.equal(got_out, f32_out)
    for name, a, p, w, f in zip(["out", "dq", "dk", "dv", "drel_k", "drel_v"], [got_out, *got], [plain_out, *plain],
                                [want_out, *want], [f32_out, *f32], strict=True):
        err, plain_err = _plain_error(a, p, w)
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        if name in _SAVED_OUTPUT_BOUND.get(case, ()):
            f32_err = _plain_error(f, p, w)[0]
            assert err <= 2 * f32_err, f"{name}: {dtype} error {err:.3g} > 2 x the float32 path's {f32_err:.3g}"
        else:
            assert err <= 2 * plain_err, f"{name}: {dtype} error {err:.3g} > 2 x plain PyTorch's {plain_err:.3g}"


# ----------------------------------------------------------------------------------------- grouped k and v


def _grouped_call(q, k, v, rel_k, rel_v, kk, mask, causal, off):
    """The AttentionCall the op would pass on for k, v with fewer heads (tables as (Hr, 2K+1, d))."""
    as3 = [None if t is None else (t if t.dim() == 3 else t.unsqueeze(0)) for t in (rel_k, rel_v)]
    return AttentionCall(q, k, v, *as3, kk, mask, causal, 0.0, q.shape[-1] ** -0.5, off)


def _grouped_run(inputs, go, kk, mask, causal, off):
    """native on k, v with Hkv heads (through the backend's run); the output and the gradients of the inputs."""
    present = [t for t in inputs if t is not None]
    out = native.BACKEND.run(_grouped_call(*inputs, kk, mask, causal, off))
    return out, torch.autograd.grad(out, present, go)


def _repeated_reference(inputs, go, kk, mask, causal, off, dtype=None):
    """"dense" on k, v repeated to H heads (``repeat_interleave(H // Hkv, dim=1)``), optionally cast to ``dtype``
    first: the output and the gradients of the (unrepeated) inputs."""
    if dtype is not None:
        inputs = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
        go = go.to(dtype)
    q, k, v, rk, rv = inputs
    g = q.shape[1] // k.shape[1]
    present = [t for t in inputs if t is not None]
    out = fn.relative_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), rk, rv,
                                max_relative_position=kk, attn_mask=mask, is_causal=causal, query_offset=off,
                                backend="dense")
    return out, torch.autograd.grad(out, present, go)


def _grouped_inputs(b, h, hkv, n, m, d, dv, kk, tables, seed, mask_kind=None):
    q, k, v, rk, rv = random_inputs(b, h, n, m, d, dv, kk, tables=tables, seed=seed)
    k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
    mask = None
    if mask_kind is not None:  # an additive float mask, as the op passes on
        keep = _masks(b, h, n, m, torch.Generator().manual_seed(seed + 1))[mask_kind]
        mask = keep if keep.dtype != torch.bool else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(
            ~keep, float("-inf"))
    go = torch.randn(b, h, n, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2))
    return [None if t is None else t.requires_grad_() for t in (q, k, v, rk, rv)], mask, go


# (B, H, Hkv, N, M, D, Dv, K, tables, mask, is_causal, query_offset)
_GROUPED_CASES = {
    "mqa-full": (2, 4, 1, 13, 13, 5, 6, 3, "per_head", None, False, 0),
    "gqa-causal": (1, 6, 3, 17, 17, 4, 4, 2, "keys_per_head", None, True, 0),
    "gqa-decode-offset": (2, 4, 2, 5, 19, 4, 5, 3, "values_per_head", "keypad", True, 14),
    "gqa-per-head-mask": (1, 4, 2, 12, 16, 4, 4, 4, "shared", "per_head", False, -3),
    "gqa-no-tables": (2, 6, 2, 9, 9, 3, 3, 2, "none", None, True, 0),
}


@needs_native
@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("case", list(_GROUPED_CASES))
def test_grouped_kv_matches_repeated_reference(kernel_settings, splits, case):
    """k, v with Hkv < H heads, read in place: the output and every gradient (dk, dv summed over each group's
    query heads) equal "dense" on k, v repeated to H heads, and the same bits from one call to the next (the
    group's query heads are summed in a fixed order); with the backward's key segments forced (3) too."""
    b, h, hkv, n, m, d, dv, kk, tables, mask_kind, causal, off = _GROUPED_CASES[case]
    kernel_settings(native, kv_splits=splits)
    inputs, mask, go = _grouped_inputs(b, h, hkv, n, m, d, dv, kk, tables, seed=31, mask_kind=mask_kind)
    want_out, want = _repeated_reference(inputs, go, kk, mask, causal, off)
    got_out, got = _grouped_run(inputs, go, kk, mask, causal, off)
    again_out, again = _grouped_run(inputs, go, kk, mask, causal, off)
    assert got_out.shape == (b, h, n, dv) and got[1].shape == (b, hkv, m, d) and got[2].shape == (b, hkv, m, dv)
    assert_close(got_out, want_out, torch.float64, "out")
    assert torch.equal(got_out, again_out)
    for name, a, w, a2 in zip("q k v rel_k rel_v".split(), got, want, again, strict=False):
        assert_close(a, w, torch.float64, f"d{name}")
        assert torch.equal(a, a2), f"d{name} differs between runs"


@needs_native
@pytest.mark.parametrize("gemm16", [True, False])
def test_grouped_kv_16_bit_within_2x_of_plain_pytorch(kernel_settings, gemm16):
    """Grouped k, v in bfloat16, through 16-bit GEMMs and through float32 copies: within twice plain PyTorch's
    error (dense on the repeated 16-bit k, v) against float64."""
    kernel_settings(native, gemm16=gemm16)
    inputs, mask, go = _grouped_inputs(1, 4, 2, 40, 40, 16, 16, 6, "per_head", seed=41)
    inputs = [(t * 0.5).detach().requires_grad_() for t in inputs]
    want_out, want = _repeated_reference(inputs, go, 6, None, True, 0)
    plain_out, plain = _repeated_reference(inputs, go, 6, None, True, 0, dtype=torch.bfloat16)
    lo = [t.detach().bfloat16().requires_grad_() for t in inputs]
    got_out, got = _grouped_run(lo, go.bfloat16(), 6, None, True, 0)
    for name, a, p, w in zip(["out", "dq", "dk", "dv", "drel_k", "drel_v"], [got_out, *got], [plain_out, *plain],
                             [want_out, *want], strict=True):
        err, plain_err = _plain_error(a, p, w)
        assert a.dtype == torch.bfloat16, name
        assert err <= 2 * plain_err, f"{name}: error {err:.3g} > 2 x plain PyTorch's {plain_err:.3g}"


@needs_native
def test_the_op_hands_native_grouped_kv_as_they_are():
    """native declares grouped k/v, so the op hands it k and v with their Hkv heads, not repeated to H: what its
    backward saves is k itself (a declaration that did not hold would show here as a repeated copy), and the result
    is the repeated call's."""
    q, k, v, rk, rv = random_inputs(1, 4, 9, 9, 4, 4, 2, tables="per_head", requires_grad=True)
    k, v = (t.detach()[:, :2].contiguous().requires_grad_() for t in (k, v))
    out = fn.relative_attention(q, k, v, rk, rv, max_relative_position=2, enable_gqa=True, backend="native")
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert any(t.data_ptr() == k.data_ptr() and t.shape == k.shape for t in saved)
    assert not [t for t in saved if t.shape == (1, 4, 9, 4) and t.data_ptr() not in (q.data_ptr(), out.data_ptr())]
    want = fn.relative_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), rk, rv,
                                 max_relative_position=2, backend="dense")
    assert_close(out, want, torch.float64)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forced_16_bit_gemms_run_in_the_backward_too(dtype):
    """16-bit GEMMs forced on: the backward takes the 16-bit path as well. The same forward (the same saved output and
    statistics) differentiated again with them off takes the float32 path, and its gradients differ from the first
    ones: had the backward run float32 under GEMM16 on, the two would be equal."""
    lo = [t.to(dtype).requires_grad_() for t in random_inputs(1, 2, 40, 40, 16, 16, 4, tables="per_head", seed=3)]
    go = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    with native.SETTINGS.override(gemm16=True):
        out = fn.relative_attention(*lo, max_relative_position=4, is_causal=True, backend="native")
        sixteen = torch.autograd.grad(out, lo, go, retain_graph=True)
    with native.SETTINGS.override(gemm16=False):
        float32 = torch.autograd.grad(out, lo, go)
    for name, a, b in zip(("dq", "dk", "dv"), sixteen, float32, strict=False):  # (the tables' are float32 in both)
        assert a.dtype == dtype and not torch.equal(a, b), name


# ----------------------------------------------------------------------------------------- availability


def test_build_failure_is_a_reason_not_an_error(monkeypatch):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setenv("CXX", sys.executable)  # some existing program: the toolchain check passes, the build fails
    assert native.availability(no_compiler) == ("the native kernel could not be built (RuntimeError: Ninja is "
                                                "required to load C++ extensions)")

    def no_cxx():
        raise RuntimeError("Error building extension 'relattn_native_x': [1/2] c++ -O3 -c shaw_cpu.cpp\n"
                           "FAILED: [code=127] shaw_cpu.o\n/bin/sh: 1: c++: not found\n"
                           "ninja: build stopped: subcommand failed.\n")

    assert native.availability(no_cxx) == ("the native kernel could not be built (RuntimeError: /bin/sh: 1: c++: not "
                                           "found)")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native.availability(no_cxx) == ("the native kernel cannot be built: no C++ compiler ('/nonexistent/c++' "
                                           "not found; set CXX or install g++)")
    monkeypatch.setenv("RELATTN_NATIVE", "0")
    assert native.availability(no_cxx) == "disabled by RELATTN_NATIVE=0"


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
    monkeypatch.setenv("CXX", sys.executable)  # another program answering --version: another compiler identity
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
    """With the library already built, ``build()`` loads it and compiles nothing (``cpp_extension.load`` raises
    here), from a copy of the package elsewhere and with the interpreter's bin directory off PATH."""
    assert native.unavailable() is None  # built (or loaded) once in this session
    loaded = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _refuse_to_compile)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    native.build()
    (library,) = loaded
    assert os.path.basename(library) == f"relattn_native_{native.build_key(SOURCE, FLAGS)}.so"
    elsewhere = tmp_path / "site-packages" / "relattn"
    shutil.copytree(Path(str(resources.files("relattn").joinpath("csrc"))), elsewhere / "csrc")
    monkeypatch.setenv("PATH", _path_without_interpreter_bin())
    native.build(elsewhere)
    assert loaded == [library, library]


@pytest.mark.slow
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
    """No library under the key (a fresh extensions directory): each ``build()`` logs the "compiling" line with
    the build directory, then compiles a copy of the source kept in that directory -- the second build too."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, sources, **kw: builds.append((name, sources,
                                                                                                      kw)))
    with caplog.at_level(logging.WARNING, logger="relattn"):
        native.build()
        native.build()
    name = f"relattn_native_{native.build_key(SOURCE, FLAGS)}"
    build_dir = tmp_path / name
    compiling = [r.getMessage() for r in caplog.records if "compiling the native CPU kernel" in r.getMessage()]
    assert compiling == [f"relattn: compiling the native CPU kernel into {build_dir} (about 15 s)"] * 2
    assert [(n, s, kw["build_directory"]) for n, s, kw in builds] == [(name, [str(build_dir / "shaw_cpu.cpp")],
                                                                       str(build_dir))] * 2
    assert (build_dir / "shaw_cpu.cpp").read_bytes() == SOURCE


@needs_native
def test_eager_differentiated_calls_skip_the_custom_op_and_equal_it(small_tiles):
    """An eager call that autograd differentiates runs the kernels through a plain autograd Function, not through the
    custom op (whose wrappers cost more than a short sequence's kernels): the same output and gradients, bit for bit,
    as the op gives under a dispatch mode (which, like torch.compile and torch.export, gets the op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    inputs = random_inputs(1, 2, 11, 13, 5, 5, 3, tables="keys_per_head", dtype=torch.float32, requires_grad=True)
    go = torch.randn(1, 2, 11, 5)
    kw = dict(max_relative_position=3, is_causal=True, query_offset=2)

    def ops_run(mode):
        with mode, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = grads("native", inputs, go, **kw)
        return result, {e.name for e in prof.events() if e.name.startswith("relattn::")}

    (op_out, op_grads), op_names = ops_run(Passthrough())
    (out, got), names = ops_run(contextlib.nullcontext())
    assert {native.OPS.fwd_name, native.OPS.bwd_name} <= op_names
    assert not names, f"an eager call went through the custom ops {names}"
    assert torch.equal(out, op_out)
    assert all(torch.equal(a, b) for a, b in zip(got, op_grads, strict=True))


# ------------------------------------------------------------------------------- position queries, wide windows


def _position_formula(q, q_pos, k, v, rel_k, rel_v, rel_q, kk, *, scale, mask, causal, off):
    """Float64 torch, written out independently of the kernels: ``softmax(scale * (q . k_j + q_pos . a^K[t] + k_j .
    a^Q[t]) + mask) @ v + sum_j P_ij a^V[t]`` with t = clip(j - i - off, -K, K) + K; k, v with fewer heads are read
    by groups of query heads; tables (Hr, 2K+1, d) or None; a row with no key gives zeros."""
    b, h, n, _ = q.shape
    m = k.shape[2]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    t = relative_position_index(n, m, kk, query_offset=off)
    s = q @ k.transpose(-1, -2)
    if rel_k is not None:
        s = s + torch.einsum("bhid,hijd->bhij", q_pos, rel_k.expand(h, -1, -1)[:, t])
    if rel_q is not None:
        s = s + torch.einsum("bhjd,hijd->bhij", k, rel_q.expand(h, -1, -1)[:, t])
    s = s * scale
    if mask is not None:
        s = s + mask
    if causal:
        s = s.masked_fill(torch.arange(m)[None, :] > torch.arange(n)[:, None] + off, float("-inf"))
    empty = (s == float("-inf")).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    out = p @ v
    if rel_v is not None:
        out = out + torch.einsum("bhij,hijd->bhid", p, rel_v.expand(h, -1, -1)[:, t])
    return out


# (B, H, Hkv, N, M, D, Dv, K, tables of (rel_k, rel_v, rel_q): "h" per head, "1" shared, "-" none, mask, causal, off)
_POSITION_CASES = {
    "xl-self-K=N-1-gqa-keypad": (2, 4, 2, 13, 13, 5, 4, 12, "h--", "keypad", False, 0),
    "xl-all-tables-causal": (1, 2, 2, 11, 11, 4, 4, 10, "h1h", None, True, 0),
    "K>>N-decode-offset": (1, 3, 1, 5, 19, 4, 3, 60, "11h", "per_head", True, 14),
    "K>N-negative-offset": (1, 2, 2, 12, 7, 4, 4, 30, "hh1", None, False, -3),
    "narrow-K-gqa": (1, 4, 2, 16, 16, 4, 4, 2, "hhh", "per_head", True, 0),
    "K>=N-no-table-term": (1, 2, 2, 9, 9, 3, 3, 20, "-h-", None, False, 0),
    "rel_q-keys-in-chunks": (1, 2, 1, 12, 150, 4, 4, 40, "h1h", "start", False, 100),  # KA in chunks of 64 keys
}


def _position_inputs(case, dtype=torch.float64, seed=51):
    """A _POSITION_CASES entry's inputs (q, q_pos, k, v, rel_k, rel_v, rel_q), all requiring grad (q_pos None
    without rel_k), its float mask and op keywords, and an output gradient."""
    b, h, hkv, n, m, d, dv, kk, tables, mask_kind, causal, off = case
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    q, q_pos, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, hkv, m, d), rnd(b, hkv, m, dv)
    rows = 2 * kk + 1
    rk, rv, rq = (None if c == "-" else rnd(1 if c == "1" else h, rows, width)
                  for c, width in zip(tables, (d, dv, d), strict=True))
    if rk is None:  # no key table to read them (the op never passes q_pos without one)
        q_pos = None
    mask = None
    if mask_kind is not None:
        keep = _masks(b, h, n, m, torch.Generator().manual_seed(seed + 1))[mask_kind]
        mask = (keep if keep.dtype != torch.bool else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(
            ~keep, float("-inf"))).to(dtype)
    go = torch.randn(b, h, n, dv, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64).to(dtype)
    return (q, q_pos, k, v, rk, rv, rq), mask, dict(kk=kk, causal=causal, off=off, scale=d ** -0.5), go


def _position_run(inputs, mask, kw, go):
    """native through the backend's run on an AttentionCall with q_pos: the output and every input's gradient."""
    q, q_pos, k, v, rk, rv, rq = inputs
    call = AttentionCall(q, k, v, rk, rv, kw["kk"], mask, kw["causal"], 0.0, kw["scale"], kw["off"], rel_q=rq,
                         q_pos=q_pos)
    out = native.BACKEND.run(call)
    present = [t for t in inputs if t is not None]
    return out, torch.autograd.grad(out, present, go)


def _position_want(inputs, mask, kw, go):
    x = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    q, q_pos, k, v, rk, rv, rq = x
    out = _position_formula(q, q_pos, k, v, rk, rv, rq, kw["kk"], scale=kw["scale"],
                            mask=None if mask is None else mask.double(), causal=kw["causal"], off=kw["off"])
    return out, torch.autograd.grad(out, [t for t in x if t is not None], go.double())


_NAMES = ("q", "q_pos", "k", "v", "rel_k", "rel_v", "rel_q")


@needs_native
@pytest.mark.parametrize(("tiles", "splits"), [((3, 5), 0), ((2, 3), 2), ((1, 1), 0), ((0, 512), 0)],
                         ids=["tiles-3x5", "tiles-2x3-segments", "tiles-1x1", "default-tiles"])
@pytest.mark.parametrize("case", list(_POSITION_CASES))
def test_position_queries_and_wide_windows_match_the_formula(small_tiles, tiles, splits, case):
    """q_pos (the queries the key table reads, apart from q) with windows as wide as the sequence (K = N - 1) and far
    wider (K >> N), where each tile computes only the table rows it meets: the output and the gradients of q (the
    content term's), q_pos (the key table's), k, v and every table against the float64 formula, with grouped k/v,
    rel_q, masks, causal and query offsets; at small tiles and with the backward's key segments; the same bits from
    one backward to the next."""
    small_tiles(native=tiles, native_splits=splits)
    inputs, mask, kw, go = _position_inputs(_POSITION_CASES[case])
    want_out, want = _position_want(inputs, mask, kw, go)
    got_out, got = _position_run(inputs, mask, kw, go)
    assert_close(got_out, want_out, torch.float64, "out")
    names = [name for name, t in zip(_NAMES, inputs, strict=True) if t is not None]
    for name, a, w in zip(names, got, want, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")
    again = _position_run(inputs, mask, kw, go)[1]
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "the backward is not deterministic"


@needs_native
@pytest.mark.parametrize("case", ["xl-self-K=N-1-gqa-keypad", "K>>N-decode-offset"])
def test_position_queries_float32_within_the_dtype_tolerance(small_tiles, case):
    small_tiles(native=(4, 7))
    inputs, mask, kw, go = _position_inputs(_POSITION_CASES[case], dtype=torch.float32)
    want_out, want = _position_want(inputs, mask, kw, go)
    got_out, got = _position_run(inputs, mask, kw, go)
    assert got_out.dtype == torch.float32
    assert_close(got_out, want_out, torch.float32, "out")
    names = [name for name, t in zip(_NAMES, inputs, strict=True) if t is not None]
    for name, a, w in zip(names, got, want, strict=True):
        assert a.dtype == torch.float32, name
        assert_close(a, w, torch.float32, f"d{name}")


@needs_native
@pytest.mark.parametrize(("n", "kk", "off"), [(300, 150, 0), (300, 310, -20), (150, 75, 0)],
                         ids=["padded", "window-moved-back", "whole"])
def test_long_windows_of_a_long_table(small_tiles, n, kk, off):
    """Windows of more than 256 table rows (their GEMMs compute a multiple of 16 columns) at the default tiles: from
    tables padded with zero rows (a 256-query tile reaches the whole table), from an unpadded table longer than a
    tile reaches (64-query tiles; queries at negative positions put a window at the table's end, and it moves back
    to stay inside), and a table read whole; rel_q's KA too."""
    small_tiles(native=(0, 512))
    case = (1, 2, 2, n, n, 8, 8, kk, "h1h", None, False, off)
    inputs, mask, kw, go = _position_inputs(case, dtype=torch.float32, seed=61)
    want_out, want = _position_want(inputs, mask, kw, go)
    got_out, got = _position_run(inputs, mask, kw, go)
    assert_close(got_out, want_out, torch.float32, "out")
    for name, a, w in zip(("q", "q_pos", "k", "v", "rel_k", "rel_v", "rel_q"), got, want, strict=True):
        assert_close(a, w, torch.float32, f"d{name}")


@needs_native
def test_without_position_queries_q_reads_the_key_table():
    """q_pos None is q: the same output, and dq then carries both shares (the content's and the key table's)."""
    inputs, mask, kw, go = _position_inputs(_POSITION_CASES["xl-all-tables-causal"])
    q, q_pos, k, v, rk, rv, rq = inputs
    same = (q, q.detach().clone().requires_grad_(), k, v, rk, rv, rq)
    out, (dq, dqp, *rest) = _position_run(same, mask, kw, go)
    call = AttentionCall(q, k, v, rk, rv, kw["kk"], mask, kw["causal"], 0.0, kw["scale"], kw["off"], rel_q=rq)
    plain = native.BACKEND.run(call)
    plain_grads = torch.autograd.grad(plain, [t for t in (q, k, v, rk, rv, rq)], go)
    assert_close(plain, out, torch.float64, "out")
    assert_close(plain_grads[0], dq + dqp, torch.float64, "dq")
    for a, w in zip(plain_grads[1:], rest, strict=True):
        assert_close(a, w, torch.float64, "grad")


@needs_native
def test_position_queries_are_checked():
    inputs, mask, kw, go = _position_inputs(_POSITION_CASES["narrow-K-gqa"])
    q, q_pos, k, v, rk, rv, rq = (None if t is None else t.detach() for t in inputs)
    with pytest.raises(RuntimeError, match="q_pos must have q's shape and dtype"):
        native.forward(q, k, v, rk, rv, mask, max_relative_position=kw["kk"], is_causal=True, scale=1.0,
                       query_offset=0, q_pos=q_pos[:, :, :-1])
    with pytest.raises(RuntimeError, match="q_pos must have q's shape and dtype"):
        native.forward(q, k, v, rk, rv, mask, max_relative_position=kw["kk"], is_causal=True, scale=1.0,
                       query_offset=0, q_pos=q_pos.float())
    assert native.BACKEND.serves.position_query


@needs_native
@pytest.mark.parametrize(("tiles", "splits"), [((3, 5), 2), ((0, 512), 0)], ids=["tiles-3x5-segments", "default"])
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_xl_through_the_op_matches_the_oracle(small_tiles, tiles, splits, causal):
    """The op's content_bias and position_bias on native (grouped k/v, a padding mask, K = N - 1 and a window
    wider than the sequence, which the op narrows to the call's reach): outputs and the gradients of q, k, v, the
    key table and both biases against the float64 oracle."""
    small_tiles(native=tiles, native_splits=splits)
    for kk in (16, 40):
        b, h, hkv, n, d = 2, 4, 2, 17, 6
        q, k, v, rk, _ = random_inputs(b, h, n, n, d, d, kk, tables="keys_per_head", seed=kk)
        k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
        g = torch.Generator().manual_seed(kk + 1)
        u, w = (torch.randn(h, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
        mask = (torch.arange(n)[None, :] < torch.tensor([n, n - 4])[:, None])[:, None, None, :]
        inputs = [t.requires_grad_() for t in (q, k, v, rk)] + [None]
        kw = dict(max_relative_position=kk, content_bias=u, position_bias=w, attn_mask=mask, is_causal=causal,
                  enable_gqa=True)
        go = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
        got_out, got = grads("native", inputs, go, **kw)
        want_out, want = oracle_grads(inputs, go, **kw)
        assert_close(got_out, want_out, torch.float64, f"K={kk} out")
        for name, a, x in zip(("q", "k", "v", "rel_k", "content_bias", "position_bias"), got, want, strict=True):
            assert_close(a, x, torch.float64, f"K={kk} d{name}")


@needs_native
@pytest.mark.parametrize("gemm16", [True, False], ids=["gemm16", "float32-copies"])
def test_transformer_xl_bfloat16_within_2x_of_plain_pytorch(kernel_settings, gemm16):
    """bfloat16 with both biases (q_pos in 16 bits beside q) on both 16-bit paths, K = N - 1: the output and every
    gradient within twice plain PyTorch's bfloat16 error against float64."""
    kernel_settings(native, gemm16=gemm16)
    b, h, n, d = 1, 2, 70, 16
    q, k, v, rk, _ = random_inputs(b, h, n, n, d, d, n - 1, tables="keys_per_head", seed=71)
    g = torch.Generator().manual_seed(72)
    u, w = (torch.randn(h, d, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    go = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    lo = [t.bfloat16().requires_grad_() for t in (q * 0.5, k * 0.5, v, rk * 0.5, u, w)]
    kw = dict(max_relative_position=n - 1, is_causal=True)
    got = fn.relative_attention(*lo[:4], None, content_bias=lo[4], position_bias=lo[5], backend="native", **kw)
    got_grads = torch.autograd.grad(got, lo, go.bfloat16())
    plain = attention_ref(*lo[:4], None, content_bias=lo[4], position_bias=lo[5], upcast=False, **kw)
    plain_grads = torch.autograd.grad(plain, lo, go.bfloat16())
    want, want_grads = oracle_grads(lo[:4] + [None], go, content_bias=lo[4], position_bias=lo[5], **kw)
    assert_close(got, want, torch.bfloat16, "out", yardstick=plain)
    for name, a, p, x in zip(("q", "k", "v", "rel_k", "content_bias", "position_bias"), got_grads, plain_grads,
                             want_grads, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert_close(a, x, torch.bfloat16, f"d{name}", yardstick=p)
