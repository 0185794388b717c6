"""The native kernel's choices from the CPU (``relattn.backends.cpu``): the class and choices follow the features
(mocked: AVX2 only, AVX-512, AVX-512 with BF16, AMX), the features are read from what torch and /proc/cpuinfo
report, ``RELATTN_NATIVE_SETTINGS`` overrides them, and the kernel under every class's choices gives the
reference's outputs and gradients (float64, float32, bfloat16)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_close, attention_ref, grads, oracle_grads, random_inputs, unavailable_here
from relattn.backends import cpu, native

UNAVAILABLE = unavailable_here("native")
needs_native = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

AVX2 = frozenset({"avx2", "fma3"})
AVX512 = AVX2 | {"avx512_f", "avx512_bw", "avx512_vl"}
# the CPUs of the measurements and of the issue (torch.cpu.get_capabilities()' names)
CPUS = {
    "zen3": cpu.CpuFeatures("AMD EPYC", "AuthenticAMD", AVX2, "25/1", 32768, 524288, "AVX2"),
    "skylake-sp": cpu.CpuFeatures("Intel Xeon Gold 6148", "GenuineIntel", AVX512, "6/85", 32768, 1048576, "AVX512"),
    "zen4": cpu.CpuFeatures("AMD EPYC 9R14", "AuthenticAMD", AVX512 | {"avx512_bf16"}, "25/17", 32768, 1048576,
                            "AVX512"),
    "sapphire-rapids": cpu.CpuFeatures("Intel Xeon Platinum 8488C", "GenuineIntel",
                                       AVX512 | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"},
                                       "6/143", 49152, 2097152, "AVX512"),
    "no-avx2": cpu.CpuFeatures("an old x86", "GenuineIntel", frozenset(), "", 0, 0, "DEFAULT"),
}
# (class, 16-bit GEMM dtypes) each CPU falls in; the tiles are today's on every class (256 queries, 512 keys)
WANT = {"zen3": ("avx2", set()), "skylake-sp": ("avx512", set()), "zen4": ("avx512_bf16", {"bfloat16"}),
        "sapphire-rapids": ("amx", {"bfloat16", "float16"}), "no-avx2": ("older", set())}


@pytest.mark.parametrize("name", list(CPUS))
def test_the_choice_follows_the_features(name):
    choice = cpu.choose(CPUS[name])
    cls, gemm16 = WANT[name]
    assert (choice.cpu_class, set(choice.gemm16), choice.tile_q, choice.tile_k) == (cls, gemm16, 256, 512)
    assert choice.wide_table_tile == (256 if cls == "amx" else 64)  # measured on the Xeon AMX and the Zen 3
    assert choice.brgemm == (cls == "amx")  # measured on the Xeon AMX only
    assert ("reasoned, not measured" in choice.why) == (cls == "avx512_bf16")  # no Zen 4 was measured
    assert cls in choice.describe() and CPUS[name].model in CPUS[name].describe()


# the build's vector flags follow torch's dispatch level, and AVX512_BF16's rounding instruction the CPU's features
FLAGS = {"zen3": {"-mavx2"}, "skylake-sp": {"-mavx512f"}, "zen4": {"-mavx512f", "-mavx512bf16"},
         "sapphire-rapids": {"-mavx512f", "-mavx512bf16"}, "no-avx2": set()}


@pytest.mark.parametrize("name", list(CPUS))
def test_the_build_flags_follow_the_features(monkeypatch, name):
    monkeypatch.setattr(cpu, "features", lambda: CPUS[name])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: CPUS[name].capability)
    flags = native._capability_flags()
    assert {f for f in flags if f.startswith("-mavx")} == FLAGS[name] | ({"-mavx512bw", "-mavx512vl", "-mavx512dq"}
                                                                         if "-mavx512f" in FLAGS[name] else set())
    assert f"-DCPU_CAPABILITY={CPUS[name].capability}" in flags


def test_features_read_from_torch_and_proc_cpuinfo(monkeypatch):
    caps = {"avx2": True, "fma3": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False, "sse2": True,
            "l1d_cache_size": 32768, "l2_cache_size": 1048576, "cpu_name": "from torch"}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(cpu, "_proc_cpuinfo", lambda: {"model name": "AMD EPYC 9R14", "vendor_id": "AuthenticAMD",
                                                       "cpu family": "25", "model": "17"})
    got = cpu.read_features()
    assert got == cpu.CpuFeatures("AMD EPYC 9R14", "AuthenticAMD", frozenset({"avx2", "fma3", "avx512_f",
                                                                              "avx512_bf16"}),
                                  "25/17", 32768, 1048576, torch.backends.cpu.get_cpu_capability())
    assert "family/model 25/17; avx2 fma3 avx512_f avx512_bf16; L1d 32 KiB, L2 1024 KiB" in got.describe()
    monkeypatch.setattr(cpu, "_proc_cpuinfo", lambda: {})  # no /proc/cpuinfo: torch's name, no vendor
    assert cpu.read_features().model == "from torch" and cpu.read_features().vendor == ""


def test_this_machines_features_are_what_torch_reports():
    caps = torch.cpu.get_capabilities()
    here = cpu.features()
    assert here.isa == {name for name in cpu.ISA if caps.get(name, False)}
    assert native.choice() == cpu.choose(here)
    if not os.environ.get(native.ENV):
        assert native.SETTINGS.default == native.NativeSettings(tile_k=native.choice().tile_k)


@needs_native
@pytest.mark.parametrize("name", list(CPUS))
def test_gemm16_follows_the_features(monkeypatch, name):
    """The CPU's choice of 16-bit GEMMs is what ``uses_gemm16`` answers (where libtorch exports the GEMM)."""
    caps = {f: True for f in CPUS[name].isa}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(torch.ops.relattn_native, "has_gemm16", lambda dtype: True, raising=False)
    native.gemm16_here.cache_clear()
    try:
        with native.SETTINGS.override(gemm16=None):
            got = {d for d in ("bfloat16", "float16") if native.uses_gemm16(getattr(torch, d))}
        assert got == WANT[name][1]
    finally:
        native.gemm16_here.cache_clear()


@needs_native
@pytest.mark.parametrize("name", list(CPUS))
def test_brgemm_follows_the_choice(monkeypatch, name):
    """brgemm where the CPU's class chooses it (AMX) and torch runs it for the dtype (mocked: it does), for float32
    and for 16-bit inputs that run 16-bit GEMMs, never float64; the ``brgemm`` setting overrides the class, never the
    other two."""
    choice = cpu.choose(CPUS[name])
    monkeypatch.setattr(native, "choice", lambda: choice)
    monkeypatch.setattr(native, "brgemm_here", lambda dtype: True)
    with native.SETTINGS.override(gemm16=True, brgemm=None):
        assert native.uses_brgemm(torch.bfloat16) == native.uses_brgemm(torch.float32) == (WANT[name][0] == "amx")
        assert not native.uses_brgemm(torch.float64)
    with native.SETTINGS.override(gemm16=True, brgemm=True):
        assert native.uses_brgemm(torch.bfloat16)
    with native.SETTINGS.override(gemm16=False, brgemm=True):
        assert not native.uses_brgemm(torch.bfloat16)  # float32 copies: no 16-bit GEMM at all
        assert native.uses_brgemm(torch.float32)
    monkeypatch.setattr(native, "brgemm_here", lambda dtype: False)
    with native.SETTINGS.override(gemm16=True, brgemm=True):
        assert not native.uses_brgemm(torch.bfloat16)


def test_tile_q_takes_the_cpus_tile(monkeypatch):
    """The rule narrows the CPU's tile (causal calls, long tables); an explicit setting wins."""
    monkeypatch.setattr(native, "choice", lambda: cpu.NativeChoice("test", 128, 512, frozenset(), "a test"))
    with native.SETTINGS.override(tile_q=0):
        assert [native.tile_q(n, False) for n in (1, 4096)] == [128, 128]
        assert [native.tile_q(n, True) for n in (100, 500, 4096)] == [32, 64, 128]
        assert native.tile_q(512, False, 1013, 512) == 64
    monkeypatch.setattr(native, "choice", lambda: cpu.NativeChoice("test", 128, 512, frozenset(), "a test",
                                                                   wide_table_tile=32))
    with native.SETTINGS.override(tile_q=0):
        assert native.tile_q(512, False, 1013, 512) == 32 and native.tile_q(512, False, 100, 512) == 128
        assert native.tile_q(16, False, 1013, 16) == 128  # no narrower than the queries
    with native.SETTINGS.override(tile_q=9):
        assert native.tile_q(4096, False) == 9


def test_settings_from_env_text():
    base = native.NativeSettings(tile_k=512)
    assert native.settings_from_env(None, base) is base and native.settings_from_env(" ", base) is base
    got = native.settings_from_env("tile_q=128, tile_k=256,kv_splits=2,gemm16=0", base)
    assert got == native.NativeSettings(tile_q=128, tile_k=256, kv_splits=2, gemm16=False)
    assert native.settings_from_env("gemm16=auto", native.NativeSettings(gemm16=True)).gemm16 is None
    assert native.settings_from_env("brgemm=0", base).brgemm is False
    for text, match in [("tile_q", "name=value pairs of brgemm, gemm16, kv_splits, tile_k, tile_q"),
                        ("tile=3", "name=value pairs"), ("tile_k=0", "tile_k must be an int >= 1; got 0"),
                        ("tile_q=a", "tile_q must be an int; got 'a'"), ("gemm16=maybe", "gemm16 must be 1, 0"),
                        ("brgemm=2", "brgemm must be 1, 0")]:
        with pytest.raises(ValueError, match=match):
            native.settings_from_env(text, base)


@pytest.mark.slow
def test_the_environment_variable_sets_the_defaults_at_import():
    code = "from relattn.backends import native; print(native.SETTINGS.current)"
    env = {**os.environ, native.ENV: "tile_k=96,gemm16=true"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "tile_k=96" in out and "gemm16=True" in out
    env[native.ENV] = "tile_k=-1"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "RELATTN_NATIVE_SETTINGS='tile_k=-1'" in bad.stderr


# (B, H, N, M, K, causal, query_offset): two query tiles against two key blocks at the choices' 256/512 (the causal
# tiles narrowed to 64), and a table longer than a full tile reaches (64-query tiles over the rows they meet)
_SHAPES = {"tiles-and-blocks": (1, 2, 300, 600, 40, True, 300), "long-table": (1, 2, 100, 100, 400, False, 0)}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("name", ["zen3", "skylake-sp", "zen4", "sapphire-rapids"])
def test_every_choice_gives_the_references_results(monkeypatch, name, shape, dtype):
    """The kernel under each class's choices (its tiles through the rule, its 16-bit GEMM path forced): outputs and
    every gradient within the dtype's tolerance of the float64 oracle (bfloat16: within 2x plain PyTorch's)."""
    choice = cpu.choose(CPUS[name])
    monkeypatch.setattr(native, "choice", lambda: choice)
    b, h, n, m, kk, causal, off = _SHAPES[shape]
    d = 16
    inputs = random_inputs(b, h, n, m, d, d, kk, tables="shared", dtype=dtype, requires_grad=True, seed=5)
    go = torch.randn(b, h, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    kw = dict(max_relative_position=kk, is_causal=causal, query_offset=off)
    want_out, want = oracle_grads(inputs, go, **kw)
    with native.SETTINGS.override(tile_q=0, tile_k=choice.tile_k, gemm16="bfloat16" in choice.gemm16):
        got_out, got = grads("native", inputs, go.to(dtype), **kw)
    plain_out, plain = None, [None] * 5
    if dtype == torch.bfloat16:
        plain_out = attention_ref(*inputs, upcast=False, **kw)
        plain = torch.autograd.grad(plain_out, inputs, go.to(dtype))
    for what, a, w, p in zip(["out", "dq", "dk", "dv", "drel_k", "drel_v"], [got_out, *got], [want_out, *want],
                             [plain_out, *plain], strict=True):
        assert a.dtype == dtype, what
        assert_close(a, w, dtype, f"{name} {what}", yardstick=p)
