"""The CPU the native kernel runs on, and what the kernel chooses from it.

:func:`features` reads the CPU once: its model and vendor (``/proc/cpuinfo``), the instruction sets and cache sizes
``torch.cpu.get_capabilities()`` reports, and the vector width torch dispatches to
(``torch.backends.cpu.get_cpu_capability()``). :func:`choose` turns features into the kernel's choices, a pure
function of them (the tests hand it made-up CPUs): the CPU falls in one of four classes, by what it has for
16-bit GEMMs and how wide its vectors are:

========================  =======================  ====================================================================
class                     example                  choices
========================  =======================  ====================================================================
``amx``                   Intel Xeon (Sapphire     256-query tiles, 512-key blocks, long tables too; bfloat16 (and
                          Rapids and later)        float16 with AMX-FP16 or ``avx512_fp16``) through 16-bit GEMMs,
                                                   those whose B is k or v through torch's brgemm
                                                   (oneDNN's micro-kernel, AMX tiles) where torch runs it, and
                                                   float32's P v and dS k (measured)
``avx512_bf16``           AMD EPYC Zen 4, Intel    the same tiles, 64-query ones for long tables (as every class
                          Cooper Lake              below); bfloat16 through 16-bit GEMMs (reasoned, not
                                                   measured: SDPA's own bfloat16 path is fast there, and float32
                                                   copies run float32 GEMMs at half a 16-bit GEMM's rate at best)
``avx512``                Intel Skylake-SP         the same tiles; 16-bit inputs as float32 copies
``avx2`` (and older)      AMD EPYC Zen 2/3         the same tiles; 16-bit inputs as float32 copies (measured: MKL's
                                                   16-bit GEMMs convert inside there, slower than its float32 GEMM)
========================  =======================  ====================================================================

Every choice can be overridden: for a block of code with ``native.SETTINGS.override(...)``, for the process with
``RELATTN_NATIVE_SETTINGS`` (``"tile_q=128,tile_k=256,gemm16=0"``, read at import; see ``native.SETTINGS``).
``relattn check`` and ``relattn bench`` print the CPU and the choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

# torch.cpu.get_capabilities()'s names of what the choices read, in the order they are printed
ISA = ("avx2", "fma3", "avx512_f", "avx512_bw", "avx512_vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
       "amx_fp16")
# the features that make each 16-bit dtype's GEMMs faster than float32 ones
GEMM16_FEATURES = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@dataclass(frozen=True)
class CpuFeatures:
    """What the choices read of a CPU (and what names it): ``isa`` holds the names of :data:`ISA` it has; cache
    sizes in bytes per core (0: unknown); ``capability`` is torch's dispatch level (``"AVX2"``, ``"AVX512"``,
    ``"DEFAULT"``, ...)."""

    model: str
    vendor: str
    isa: frozenset[str]
    family: str = ""  # /proc/cpuinfo's "cpu family" and "model": "25/1" is AMD Zen 3, "25/17" Zen 4
    l1d_bytes: int = 0
    l2_bytes: int = 0
    capability: str = "DEFAULT"

    def describe(self) -> str:
        """One line: model, vendor, instruction sets, caches, torch's capability."""
        caches = ", ".join(f"{name} {size // 1024} KiB" for name, size in (("L1d", self.l1d_bytes),
                                                                           ("L2", self.l2_bytes)) if size)
        isa = " ".join(name for name in ISA if name in self.isa) or "none of " + "/".join(ISA)
        which = f" family/model {self.family}" if self.family else ""
        return (f"{self.model} ({self.vendor or 'vendor unknown'}{which}; {isa}; "
                f"{caches or 'caches unknown'} per core; torch dispatches {self.capability})")


@dataclass(frozen=True)
class NativeChoice:
    """The kernel's choices for one CPU (:func:`choose`): ``tile_q`` queries per tile (the not-causal tile:
    ``native.tile_q`` narrows it for causal calls), ``tile_k`` keys per block, ``gemm16`` the 16-bit dtypes (names)
    that run 16-bit GEMMs rather than float32 copies, ``wide_table_tile`` the queries per tile of a call whose table
    is longer than a full tile reaches (Transformer-XL's, DeBERTa's: a tile computes only the table rows it meets,
    so smaller tiles compute fewer, and pack each key block for their GEMMs more often); ``cpu_class`` and ``why``
    say why."""

    cpu_class: str
    tile_q: int
    tile_k: int
    gemm16: frozenset[str]
    why: str
    wide_table_tile: int = 64
    brgemm: bool = False

    def describe(self) -> str:
        g16 = ", ".join(sorted(self.gemm16)) or "none"
        via = "torch's brgemm for those reading k, v where it runs, else MKL's" if self.brgemm else "MKL's"
        f32 = "; float32's P v and dS k through torch's brgemm where it runs" if self.brgemm else ""
        return (f"class {self.cpu_class}: {self.tile_q}-query tiles ({self.wide_table_tile} for long tables), "
                f"{self.tile_k}-key blocks, 16-bit GEMMs ({via}) for {g16} (other 16-bit inputs as float32 copies)"
                f"{f32}; {self.why}")


def _proc_cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def read_features() -> CpuFeatures:
    """The features of the CPU this process runs on, read now."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    info = _proc_cpuinfo()
    model = info.get("model name") or str(caps.get("cpu_name") or "") or "unknown CPU"
    family = f"{info['cpu family']}/{info['model']}" if "cpu family" in info and "model" in info else ""
    return CpuFeatures(model=model, vendor=info.get("vendor_id", ""), family=family,
                       isa=frozenset(name for name in ISA if caps.get(name, False)),
                       l1d_bytes=int(caps.get("l1d_cache_size", 0) or 0),
                       l2_bytes=int(caps.get("l2_cache_size", 0) or 0),
                       capability=torch.backends.cpu.get_cpu_capability())


@functools.cache
def features() -> CpuFeatures:
    """:func:`read_features`, read once per process (``features.cache_clear()`` reads again)."""
    return read_features()


def choose(cpu: CpuFeatures) -> NativeChoice:
    """The kernel's choices for ``cpu``, from its features alone (module docstring: the four classes)."""
    gemm16 = frozenset(dtype for dtype, needs in GEMM16_FEATURES.items() if any(f in cpu.isa for f in needs))
    if "amx_bf16" in cpu.isa:
        return NativeChoice("amx", 256, 512, gemm16, "measured on an Intel Xeon with AMX (benchmarks/README.md)",
                            wide_table_tile=256, brgemm=True)
    if "avx512_bf16" in cpu.isa:
        return NativeChoice("avx512_bf16", 256, 512, gemm16,
                            "reasoned, not measured (no such CPU measured yet): SDPA's own bfloat16 GEMMs use "
                            "avx512_bf16 here, which float32 copies cannot keep up with")
    if "avx512_f" in cpu.isa:
        return NativeChoice("avx512", 256, 512, gemm16, "as on AVX2 CPUs (no 16-bit GEMM instructions)")
    return NativeChoice("avx2" if "avx2" in cpu.isa else "older", 256, 512, gemm16,
                        "measured on an AMD EPYC Zen 3 (benchmarks/README.md)")


@dataclass(frozen=True)
class NativeSettings:
    """The native kernel's settings (``native.SETTINGS``; the tests set small tiles with ``SETTINGS.override(...)``).
    Their defaults are this CPU's choices (``native.choice()``), then ``RELATTN_NATIVE_SETTINGS``
    (:func:`settings_from_env`)."""

    tile_q: int = 0  # queries per tile (0: by the number of queries and the CPU's tile, see tile_q)
    tile_k: int = 512  # keys per block (benchmarks/fast_vs_sdpa.py: 128 and 1024 within a few percent at N = 2048)
    kv_splits: int = 0  # backward: key segments per head (0: more than 1 only when batch * heads leaves threads idle)
    gemm16: bool | None = None  # 16-bit inputs: True 16-bit GEMMs, False float32 copies, None the CPU's choice
    brgemm: bool | None = None  # GEMMs on k, v: True torch's brgemm where it runs, False MKL's, None the CPU's

    def __post_init__(self):
        for name, low in (("tile_q", 0), ("tile_k", 1), ("kv_splits", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"native setting {name} must be an int >= {low}; got {value!r}")
        for name in _SWITCHES:
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"native setting {name} must be None, True or False; got {getattr(self, name)!r}")


ENV = "RELATTN_NATIVE_SETTINGS"
_BOOLS = {"1": True, "true": True, "0": False, "false": False, "none": None, "auto": None}
_SWITCHES = ("gemm16", "brgemm")  # the settings _BOOLS spells


def settings_from_env(text: str | None, base: NativeSettings) -> NativeSettings:
    """``base`` with the settings ``text`` names (``RELATTN_NATIVE_SETTINGS``'s form: ``"tile_q=128,tile_k=256,
    gemm16=0"``; gemm16 and brgemm take 1/0/true/false/auto); None or empty: ``base``. Bad text: a ValueError naming
    it."""
    if not text or not text.strip():
        return base
    changes: dict[str, int | bool | None] = {}
    fields = set(base.__dataclass_fields__)
    for item in text.split(","):
        name, eq, value = (part.strip() for part in item.partition("="))
        if not eq or name not in fields:
            raise ValueError(f"{ENV} must be name=value pairs of {', '.join(sorted(fields))} separated by commas; "
                             f"got {text!r}")
        if name in _SWITCHES:
            if value.lower() not in _BOOLS:
                raise ValueError(f"{ENV}: {name} must be 1, 0, true, false or auto; got {value!r}")
            changes[name] = _BOOLS[value.lower()]
        else:
            try:
                changes[name] = int(value)
            except ValueError:
                raise ValueError(f"{ENV}: {name} must be an int; got {value!r}") from None
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as exc:
        raise ValueError(f"{ENV}={text!r}: {exc}") from None
