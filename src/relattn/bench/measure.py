"""How relattn is measured: one input factory, one timing loop, one memory method (for ``relattn bench`` and
the scripts under ``benchmarks/``).

- :class:`Problem` and :func:`make_inputs`: the q, k, v, tables, output gradient and optional key padding mask
  every implementation gets at one length ``N`` (self-attention, ``M = N``).
- :class:`Runner`: one implementation made ready for those inputs; :func:`sdpa_runner` (the floor) and
  :func:`relattn_runner` (a backend of :data:`relattn.backends.BACKENDS`, or ``"auto"``).
- :func:`measure`: forward (under ``torch.no_grad``) and forward+backward of every runner: warm-up, then
  ``repeats`` interleaved rounds (each runner once per round, so drift of the machine hits all alike), then
  the peak extra memory of one more call of each (:func:`peak_extra_bytes`), so the profiler never touches a
  timing. Ratios are taken between runners of the same call.
- :class:`BackendCalls`: which backend's kernel served the calls made under it (for a benchmark or a test that
  must show a patched model runs relattn's fused kernel, not a fallback).

Notation: ``B`` batch, ``H`` heads, ``N`` length, ``D`` head dim, ``K`` max relative position.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..backends import BACKENDS, choose, native, why_not
from ..backends.cpu import features as cpu_features
from ..functional import relative_attention, validate
from ..positions import causal_allowed

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Problem:
    """What the inputs at every length look like."""

    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    max_relative_position: int = 64  # K: tables have 2K + 1 rows
    per_head_tables: bool = False  # (H, 2K+1, D) tables instead of one (2K+1, D) shared by all heads
    causal: bool = False
    padded_keys: float = 0.0  # this fraction of keys, at the end of the last batch entry, masked out (bool mask)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0


@dataclass
class Inputs:
    """q, k, v (B, H, N, D); tables (Hr, 2K+1, D), Hr in {1, H}; grad_out (B, H, N, D); mask (B, 1, 1, N) bool
    (True = may attend) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rel_k: torch.Tensor
    rel_v: torch.Tensor
    grad_out: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    max_relative_position: int

    @property
    def n(self) -> int:
        return self.q.shape[-2]

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.rel_k, self.rel_v


def make_inputs(problem: Problem, n: int) -> Inputs:
    """The inputs at length ``n``: standard normal q, k, v, output gradient; tables with std ``D**-0.5``.

    Seeded by ``problem.seed`` and ``n``, so every implementation and every run sees the same tensors.
    """
    g = torch.Generator().manual_seed(problem.seed * 1_000_003 + n)
    device, dtype = torch.device(problem.device), DTYPES[problem.dtype]
    b, h, d, kk = problem.batch, problem.heads, problem.head_dim, problem.max_relative_position
    rows = h if problem.per_head_tables else 1

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).to(device, dtype).requires_grad_(True)

    q, k, v = randn(b, h, n, d), randn(b, h, n, d), randn(b, h, n, d)
    rel_k, rel_v = randn(rows, 2 * kk + 1, d, std=d**-0.5), randn(rows, 2 * kk + 1, d, std=d**-0.5)
    grad_out = randn(b, h, n, d).detach()
    mask = None
    padded = int(problem.padded_keys * n)
    if padded:
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)
        mask[-1, ..., n - padded:] = False
    return Inputs(q, k, v, rel_k, rel_v, grad_out, mask, problem.causal, kk)


@dataclass
class Runner:
    """One implementation made ready for one set of inputs: ``fn()`` computes the output, grads go to ``params``."""

    fn: Callable[[], torch.Tensor]
    params: tuple[torch.Tensor, ...]
    detail: str = ""  # e.g. the backend "auto" chose


def sdpa_runner(inp: Inputs) -> Runner:
    """``F.scaled_dot_product_attention`` with no positions (the same mask, causal or not)."""
    mask, causal = inp.mask, inp.causal
    if mask is not None and causal:  # SDPA takes one or the other: fold the causal pattern into the mask
        mask, causal = mask & causal_allowed(inp.n, inp.n, 0, inp.q.device), False
    return Runner(lambda: F.scaled_dot_product_attention(inp.q, inp.k, inp.v, attn_mask=mask, is_causal=causal),
                  (inp.q, inp.k, inp.v))


# -- what relattn's backend registry is asked: the names, their descriptions, refusals and auto's choice.


def relattn_names() -> list[str]:
    """Every backend in :data:`relattn.backends.BACKENDS`, then ``"auto"``."""
    return [*BACKENDS, "auto"]


def relattn_doc(name: str) -> str:
    return "what relative_attention(backend='auto') picks" if name == "auto" else BACKENDS[name].doc


def _call(inp: Inputs):
    return validate(inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v, max_relative_position=inp.max_relative_position,
                    attn_mask=inp.mask, is_causal=inp.causal, dropout_p=0.0, scale=None, query_offset=0)


def relattn_runner(name: str, inp: Inputs) -> Runner | str:
    """``relative_attention(..., backend=name)`` on the inputs, or the reason the backend refuses them."""
    call = _call(inp)
    if name == "auto":
        detail = f"chose {choose(call).name}"
    else:
        if reasons := why_not(name, call):
            return "; ".join(reasons)
        detail = ""
    return Runner(lambda: relative_attention(*inp.params, max_relative_position=inp.max_relative_position,
                                             attn_mask=inp.mask, is_causal=inp.causal, backend=name),
                  inp.params, detail)


# -- timing and memory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one ``fn()`` call in ms (CUDA events, synchronized, on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                     device: torch.device | None = None) -> dict[str, list[float]]:
    """The one timing loop: every fn ``warmup`` times, then ``repeats`` rounds calling each in turn (so a slow
    patch of the machine hits all of them alike); ms per call, per name."""
    device = torch.device("cpu") if device is None else device
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_ms(fn, device))
    return times


def timing_method(device: torch.device) -> str:
    return ("median of `repeats` calls after `warmup` calls, the implementations interleaved (one call of each "
            "per round); forward = inference under torch.no_grad(); forward+backward = forward with autograd, then "
            "torch.autograd.grad of q, k, v and the tables for a fixed random output gradient"
            + ("; CUDA events around each call, synchronized" if device.type == "cuda"
               else "; time.perf_counter around each call"))


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return ("torch.cuda.max_memory_allocated() during one call, minus torch.cuda.memory_allocated() before it "
                "(inputs excluded; outputs, saved tensors and gradients included)")
    return ("peak live bytes of PyTorch's CPU allocator during one call beyond what was live before it: "
            "torch.profiler (profile_memory=True) allocation and free events summed in time order "
            "(inputs excluded; outputs, saved tensors and gradients included; oneDNN's private scratch not seen)")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (the profiler's C++ start/stop chatter) for the duration."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak extra memory of one ``fn()`` call, by :func:`memory_method`."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if str(e.device_type()).endswith("CPU"):  # DeviceType.CPU
            live += e.nbytes()
            peak = max(peak, live)
    return int(peak)


class BackendCalls(TorchDispatchMode):
    """Counts the relattn kernel calls made while it is active, by backend: ``forward["native"]`` is the number of
    ``relattn::native_fwd_*`` op calls (``"native_varlen"``: packed calls run whole), ``backward`` likewise.

        with BackendCalls() as calls:
            model(x).sum().backward()
        calls.forward  # Counter({'native': 12})

    Every backend with a kernel (``native``, ``triton``, ``blocked``) runs as these custom ops while a dispatch mode is
    active (as under torch.compile; the eager shortcut is the same kernel), so each of their calls shows; ``dense``
    is plain torch ops and does not show: a call served by it (or by the model's own attention) is one missing
    from the counts. Measure time outside this mode: it sees every op."""

    def __init__(self):
        super().__init__()
        self.forward: Counter[str] = Counter()
        self.backward: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "relattn" and (op := _KERNEL_OP.fullmatch(func.__name__.split(".")[0])):
            (self.forward if op.group(2) == "fwd" else self.backward)[op.group(1)] += 1
        return func(*args, **(kwargs or {}))


_KERNEL_OP = re.compile(r"(\w+?)_(fwd|bwd)_\w+")


@dataclass
class Measured:
    """One implementation at one length: every timed call, the peaks, the first forward output, or the error."""

    forward_ms: list[float] = field(default_factory=list)
    fwdbwd_ms: list[float] = field(default_factory=list)
    peak_forward_bytes: int | None = None
    peak_fwdbwd_bytes: int | None = None
    output: torch.Tensor | None = None
    error: str | None = None

    @property
    def forward_median(self) -> float | None:
        return statistics.median(self.forward_ms) if self.forward_ms else None

    @property
    def fwdbwd_median(self) -> float | None:
        return statistics.median(self.fwdbwd_ms) if self.fwdbwd_ms else None


def _calls(runner: Runner, grad_out: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    def forward():
        with torch.no_grad():
            return runner.fn()

    def fwdbwd():
        return torch.autograd.grad(runner.fn(), runner.params, grad_out)

    return forward, fwdbwd


def calls_per_measurement(repeats: int, warmup: int) -> int:
    """Calls :func:`measure` makes per runner (a forward counted as a forward+backward, two for the peaks)."""
    return 2 * (max(1, warmup) + repeats) + 2


def measure(runners: dict[str, Runner], inp: Inputs, *, repeats: int, warmup: int = 1, forward: bool = True,
            memory: bool = True) -> dict[str, Measured]:
    """Time (and peak memory of) every runner on the same inputs; one :class:`Measured` per name.

    A first untimed forward of each (its output kept for agreement checks) counts as its first forward
    warm-up. A runner that raises is dropped, its error kept (first line), and the others go on.
    """
    device = inp.q.device
    results = {name: Measured() for name in runners}
    calls = {name: _calls(r, inp.grad_out) for name, r in runners.items()}

    def call(name: str, fn: Callable[[], object]) -> object:
        if results[name].error is not None:
            return None
        try:
            out = fn()
            _sync(device)
            return out
        except Exception as err:  # e.g. out of memory: report it and go on with the others
            results[name].error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    def rounds(phase: int, times_of: Callable[[Measured], list[float]]) -> None:
        # a runner that fails on the way keeps going as a no-op; its times are dropped at the end
        live = {name: (lambda name=name, fn=fns[phase]: call(name, fn)) for name, fns in calls.items()
                if results[name].error is None}
        for name, ms in time_interleaved(live, repeats, warmup=0, device=device).items():
            times_of(results[name]).extend(ms)

    for name, (fwd, _) in calls.items():
        out = call(name, fwd)
        results[name].output = None if out is None else out.detach()
    if forward:
        for name, (fwd, _) in calls.items():
            for _ in range(warmup - 1):
                call(name, fwd)
        rounds(0, lambda r: r.forward_ms)
    for name, (_, fwdbwd) in calls.items():
        for _ in range(warmup):
            call(name, fwdbwd)
    rounds(1, lambda r: r.fwdbwd_ms)
    if memory:
        for name, (fwd, fwdbwd) in calls.items():
            if forward:
                results[name].peak_forward_bytes = call(name, lambda fn=fwd: peak_extra_bytes(fn, device))
            results[name].peak_fwdbwd_bytes = call(name, lambda fn=fwdbwd: peak_extra_bytes(fn, device))
    for r in results.values():
        if r.error is not None:
            r.forward_ms, r.fwdbwd_ms, r.peak_forward_bytes, r.peak_fwdbwd_bytes = [], [], None, None
    return results


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing or ``b`` is zero."""
    return None if a is None or not b else a / b


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def fmt_bytes(b: float | None) -> str:
    """Bytes for people: 3 significant digits and a decimal unit (kB, MB, GB); "-" for None."""
    if b is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


def machine_info(device: torch.device, threads: int, **extra) -> dict:
    """The machine a result was measured on: CPU model, threads, versions, date (UTC), GPU if any."""
    from .. import __version__

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info = {"cpu": cpu, "cpu_features": cpu_features().describe(), "native_choice": native.choice().describe(),
            "logical_cpus": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "relattn": __version__, **extra,
            "device": str(device), "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info
