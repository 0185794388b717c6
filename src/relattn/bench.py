"""``relattn bench``: relattn's backends against the floor and the peers, side by side in one process.

On the same q, k, v (float32, B=1, H=8, D=64, K=64, both tables, by default) at each length N:

- ``sdpa``: ``F.scaled_dot_product_attention`` with no positions, the floor every ratio is taken against;
- ``materialised``: the (N, M, D) formulation the peers use (:func:`relattn.peers.materialised_attention`);
- ``hf-bert``: Hugging Face ``BertSelfAttention`` with ``relative_key``, when ``transformers<5`` is installed;
- ``relattn:<name>``: every backend in :data:`relattn.BACKENDS`, then ``relattn:auto``.

Each is timed forward (inference, under ``torch.no_grad``) and forward+backward (gradients of q, k, v and
the tables for a fixed output gradient): medians of ``repeats`` calls after ``warmup`` calls. Peak extra
memory of one extra call of each is measured separately, so the profiler never touches a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import __version__
from ._io import atomic_write_text, save_figure
from .backends import BACKENDS, choose, not_supported_reasons
from .backends.dense import causal_allowed
from .functional import additive_mask, relative_attention, validate
from .peers import HFBertRelativeKey, materialised_attention, transformers_version

FULL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (128, 256, 512)
MEMORY_CHECK_LENGTHS = (4096, 8192, 16384)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchConfig:
    """What one bench run measures. Defaults are the target configuration of issue 3."""

    lengths: tuple[int, ...] = FULL_LENGTHS  # N = M, self-attention
    causal: bool = False
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    max_relative_position: int = 64  # K: tables have 2K + 1 rows
    per_head_tables: bool = False  # (H, 2K+1, D) tables instead of one (2K+1, D) shared by all heads
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 2
    repeats: int = 5
    warmup: int = 1
    backends: tuple[str, ...] | None = None  # relattn backends (names in BACKENDS, or "auto"); None: all + auto
    peers: tuple[str, ...] = ("materialised", "hf")  # besides sdpa, which always runs
    memory_limit_bytes: float | None = None  # skip what is predicted to need more; None: half the free memory
    time_limit_s: float = 180.0  # skip a measurement (one implementation, one length) predicted to take longer
    seed: int = 0
    command: str = ""  # the command line, recorded in bench.json


@dataclass
class Inputs:
    """The tensors every implementation gets at one length: q, k, v (B, H, N, D); tables (Hr, 2K+1, D)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rel_k: torch.Tensor
    rel_v: torch.Tensor
    grad_out: torch.Tensor
    causal: bool
    max_relative_position: int

    @property
    def n(self) -> int:
        return self.q.shape[-2]


@dataclass
class Runner:
    """One implementation made ready for one length: ``fn()`` computes the output, grads go to ``params``."""

    fn: Callable[[], torch.Tensor]
    params: tuple[torch.Tensor, ...]
    detail: str = ""  # e.g. the backend "auto" chose


@dataclass
class Impl:
    name: str
    kind: str  # "floor", "peer" or "relattn"
    note: str
    make: Callable[[Inputs], Runner | str]  # a Runner, or the reason this implementation can't serve the inputs
    estimate_bytes: Callable[[Inputs], float] = lambda inp: 0.0  # a floor on the forward+backward peak


@dataclass
class Row:
    n: int
    implementation: str
    kind: str
    status: str  # "ok", "skipped" or "failed"
    reason: str = ""
    note: str = ""
    detail: str = ""
    forward_ms: float | None = None
    fwdbwd_ms: float | None = None
    forward_ratio: float | None = None  # forward_ms / sdpa's forward_ms at the same N, same run
    fwdbwd_ratio: float | None = None
    peak_forward_bytes: int | None = None
    peak_fwdbwd_bytes: int | None = None
    memory_ratio: float | None = None  # peak_fwdbwd_bytes / sdpa's
    max_abs_diff: float | None = None  # forward output against `diff_vs` at the same N
    diff_vs: str | None = None
    forward_all_ms: list[float] = field(default_factory=list)
    fwdbwd_all_ms: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- implementations


def _elt(inp: Inputs) -> int:
    return inp.q.element_size()


def _scores_bytes(inp: Inputs) -> float:
    b, h, n, _ = inp.q.shape
    return float(b * h * n * inp.k.shape[-2] * _elt(inp))


def _gathered_bytes(inp: Inputs, rows: int) -> float:
    """One (N, M, D) tensor per table head."""
    return float(rows * inp.n * inp.k.shape[-2] * inp.q.shape[-1] * _elt(inp))


def _sdpa(inp: Inputs) -> Runner:
    return Runner(lambda: F.scaled_dot_product_attention(inp.q, inp.k, inp.v, is_causal=inp.causal),
                  (inp.q, inp.k, inp.v))


def _materialised(inp: Inputs) -> Runner:
    return Runner(lambda: materialised_attention(inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v,
                                                 max_relative_position=inp.max_relative_position,
                                                 is_causal=inp.causal),
                  (inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v))


def _materialised_bytes(inp: Inputs) -> float:
    # both gathered tables and their gradients, plus scores, weights and their gradients
    return 4 * _gathered_bytes(inp, inp.rel_k.shape[0]) + 3 * _scores_bytes(inp)


def _hf(inp: Inputs) -> Runner | str:
    if transformers_version() is None:
        return "transformers>=4.40,<5 not installed (pip install 'relattn[peers]')"
    b, h, n, d = inp.q.shape
    peer = HFBertRelativeKey(h, d, n, device=inp.q.device, dtype=inp.q.dtype)
    peer.layer.requires_grad_(True)
    mask = None
    if inp.causal:  # BertSelfAttention has no is_causal: an additive mask, as BERT decoders pass
        mask = additive_mask(causal_allowed(n, n, 0, inp.q.device), inp.q.dtype)
    return Runner(lambda: peer(inp.q, inp.k, inp.v, attn_mask=mask), (inp.q, inp.k, inp.v, peer.table),
                  detail=f"transformers {transformers_version()}")


def _hf_bytes(inp: Inputs) -> float:
    return 2 * _gathered_bytes(inp, 1) + 3 * _scores_bytes(inp)


def _dense_bytes(inp: Inputs) -> float:
    return 4 * _scores_bytes(inp)  # scores, gathered key term, weights, and their gradients at any one time


def _relattn(name: str) -> Callable[[Inputs], Runner | str]:
    def make(inp: Inputs) -> Runner | str:
        call = validate(inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v, max_relative_position=inp.max_relative_position,
                        attn_mask=None, is_causal=inp.causal, dropout_p=0.0, scale=None, query_offset=0)
        if name == "auto":
            detail = f"chose {choose(call).name}"
        else:
            reason = "; ".join(not_supported_reasons(BACKENDS[name], call)) or None
            if reason is not None:
                return reason
            detail = ""
        return Runner(lambda: relative_attention(inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v,
                                                 max_relative_position=inp.max_relative_position,
                                                 is_causal=inp.causal, backend=name),
                      (inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v), detail)

    return make


def _relattn_bytes(name: str) -> Callable[[Inputs], float]:
    def estimate(inp: Inputs) -> float:
        if name == "auto":
            call = validate(inp.q, inp.k, inp.v, inp.rel_k, inp.rel_v,
                            max_relative_position=inp.max_relative_position, attn_mask=None, is_causal=inp.causal,
                            dropout_p=0.0, scale=None, query_offset=0)
            return _relattn_bytes(choose(call).name)(inp)
        return _dense_bytes(inp) if name == "dense" else 0.0

    return estimate


def implementations(config: BenchConfig) -> list[Impl]:
    """The floor, the peers asked for, then relattn's backends (all of BACKENDS and "auto" by default)."""
    impls = [Impl("sdpa", "floor", "F.scaled_dot_product_attention, no positions", _sdpa)]
    if "materialised" in config.peers:
        impls.append(Impl("materialised", "peer", "(N,M,D) gathered tables, as tensor2tensor/OpenNMT-py",
                          _materialised, _materialised_bytes))
    if "hf" in config.peers:
        impls.append(Impl("hf-bert", "peer", "HF BertSelfAttention relative_key: key term only, "
                          "no clipping (2N-1 rows, max_position_embeddings=N), (N,M,D) gathered", _hf, _hf_bytes))
    names = list(BACKENDS) + ["auto"] if config.backends is None else list(config.backends)
    for name in names:
        impls.append(Impl(f"relattn:{name}", "relattn", BACKENDS[name].doc if name in BACKENDS else
                          "what relative_attention(backend='auto') picks", _relattn(name), _relattn_bytes(name)))
    return impls


# ---------------------------------------------------------------------------------------------- measuring


def make_inputs(config: BenchConfig, n: int, device: torch.device, dtype: torch.dtype) -> Inputs:
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + n)
    b, h, d, kk = config.batch, config.heads, config.head_dim, config.max_relative_position
    rows = h if config.per_head_tables else 1

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).to(device, dtype).requires_grad_(True)

    q, k, v = randn(b, h, n, d), randn(b, h, n, d), randn(b, h, n, d)
    rel_k, rel_v = randn(rows, 2 * kk + 1, d, std=d**-0.5), randn(rows, 2 * kk + 1, d, std=d**-0.5)
    grad_out = randn(b, h, n, d).detach()
    return Inputs(q, k, v, rel_k, rel_v, grad_out, config.causal, kk)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
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


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return ("torch.cuda.max_memory_allocated() during one call, minus torch.cuda.memory_allocated() before it "
                "(inputs excluded; outputs, saved tensors and gradients included)")
    return ("peak live bytes of PyTorch's CPU allocator during one call beyond what was live before it: "
            "torch.profiler (profile_memory=True) allocation and free events summed in time order "
            "(inputs excluded; outputs, saved tensors and gradients included; oneDNN's private scratch not seen)")


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


def _available_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _extrapolate(points: list[tuple[int, float]], n: int, *, lo: float, hi: float, single: float) -> float | None:
    """Value at ``n`` from a power law through the last two (N, value) points, exponent clamped to [lo, hi];
    with one point the exponent is ``single``."""
    points = [(pn, pv) for pn, pv in points if pv and pv > 0]
    if not points:
        return None
    if len(points) == 1:
        (n1, v1), p = points[0], single
    else:
        (n0, v0), (n1, v1) = points[-2], points[-1]
        p = min(hi, max(lo, math.log(v1 / v0) / math.log(n1 / n0))) if n1 != n0 else single
    return v1 * (n / n1) ** p


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def machine_info(device: torch.device, threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "relattn": __version__,
        "transformers": transformers_version(),
        "device": str(device),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _measure(runner: Runner, inp: Inputs, config: BenchConfig, device: torch.device, row: Row) -> torch.Tensor:
    """Fill in times and peaks; return the forward output of the first call (for the agreement check)."""

    def forward():
        with torch.no_grad():
            return runner.fn()

    def fwdbwd():
        out = runner.fn()
        return torch.autograd.grad(out, runner.params, inp.grad_out)

    first = forward().detach()
    _sync(device)
    for _ in range(max(0, config.warmup - 1)):
        forward()
    row.forward_all_ms = [_time_ms(forward, device) for _ in range(config.repeats)]
    for _ in range(config.warmup):
        fwdbwd()
    row.fwdbwd_all_ms = [_time_ms(fwdbwd, device) for _ in range(config.repeats)]
    row.forward_ms = statistics.median(row.forward_all_ms)
    row.fwdbwd_ms = statistics.median(row.fwdbwd_all_ms)
    row.peak_forward_bytes = peak_extra_bytes(forward, device)
    row.peak_fwdbwd_bytes = peak_extra_bytes(fwdbwd, device)
    return first


def _calls(config: BenchConfig) -> int:
    """Calls one measurement makes (each forward counted as a forward+backward): see :func:`_measure`."""
    return 2 * (max(1, config.warmup) + config.repeats) + 2


def _skip_reason(impl: Impl, inp: Inputs, history: list[Row], config: BenchConfig, limit: float) -> str | None:
    # predictions only grow with N, so what is skipped at one length is skipped at every longer one
    done = [r for r in history if r.status == "ok"]
    mem = max(impl.estimate_bytes(inp), _extrapolate([(r.n, r.peak_fwdbwd_bytes) for r in done], inp.n,
                                                     lo=1.0, hi=2.0, single=1.0) or 0.0)
    if mem > limit:
        return f"predicted peak {_fmt_bytes(mem)} > limit {_fmt_bytes(limit)}"
    # from the fastest call, not the median: one stall at a short length must not skip the longer ones
    fastest = [(r.n, min(r.fwdbwd_all_ms)) for r in done]
    call_s = (_extrapolate(fastest, inp.n, lo=1.0, hi=2.0, single=2.0) or 0.0) / 1e3
    secs = call_s * _calls(config)
    if secs > config.time_limit_s:
        return f"predicted {secs:.0f} s ({call_s:.1f} s per forward+backward) > limit {config.time_limit_s:g} s"
    return None


class _NoBar:
    def update(self, *_args) -> None:
        pass

    set_postfix_str = close = update


def run_bench(config: BenchConfig, *, progress: bool = True) -> dict:
    """Measure every implementation at every length; returns what ``bench.json`` holds.

    Returns a dict with ``machine``, ``config``, ``memory_method``, ``timing_method`` and ``rows`` (one per
    implementation and length, fields of :class:`Row`; ratios against ``sdpa`` at the same length).
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:  # a declared dependency, but a bare GPU box may lack it: measure without a bar
        def tqdm(*_args, **_kwargs):
            return _NoBar()

    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for but torch.cuda.is_available() is False")
    dtype = DTYPES[config.dtype]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    limit = config.memory_limit_bytes or 0.5 * _available_bytes(device)
    impls = implementations(config)
    rows: list[Row] = []
    bar = tqdm(total=len(impls) * len(config.lengths), disable=not progress, unit="run", leave=False)
    if "hf" in config.peers and transformers_version() is not None:
        import transformers.models.bert.modeling_bert  # noqa: F401  (import before the freeze below)
    gc.collect()
    gc.freeze()  # what exists now (modules, transformers' classes) is never garbage: keep gc.collect() quick
    try:
        for n in sorted(config.lengths):
            inp = make_inputs(config, n, device, dtype)
            outputs: dict[str, torch.Tensor] = {}
            sdpa_row: Row | None = None
            for impl in impls:
                bar.set_postfix_str(f"N={n} {impl.name}")
                row = Row(n, impl.name, impl.kind, "ok", note=impl.note)
                history = [r for r in rows if r.implementation == impl.name]
                made = impl.make(inp)
                reason = made if isinstance(made, str) else _skip_reason(impl, inp, history, config, limit)
                if reason is not None:
                    row.status, row.reason = "skipped", reason
                else:
                    row.detail = made.detail
                    try:
                        first = _measure(made, inp, config, device, row)
                    except Exception as err:  # e.g. out of memory: a bench reports a failure and goes on
                        first_line = (str(err).splitlines() or [""])[0]
                        row.status, row.reason = "failed", f"{type(err).__name__}: {first_line}"
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    else:
                        ref_name = next((r for r in ("materialised", "relattn:dense") if r in outputs), None)
                        if impl.kind == "relattn" and ref_name is not None and ref_name != impl.name:
                            row.max_abs_diff = float((first.float() - outputs[ref_name].float()).abs().max())
                            row.diff_vs = ref_name
                        if impl.name in ("materialised", "relattn:dense"):
                            outputs[impl.name] = first
                    made = None
                if impl.name == "sdpa":
                    sdpa_row = row
                if row.status == "ok" and sdpa_row is not None and sdpa_row.status == "ok":
                    row.forward_ratio = row.forward_ms / sdpa_row.forward_ms
                    row.fwdbwd_ratio = row.fwdbwd_ms / sdpa_row.fwdbwd_ms
                    if sdpa_row.peak_fwdbwd_bytes:
                        row.memory_ratio = row.peak_fwdbwd_bytes / sdpa_row.peak_fwdbwd_bytes
                rows.append(row)
                gc.collect()
                bar.update()
            del inp, outputs
    finally:
        gc.unfreeze()
        bar.close()
        torch.set_num_threads(threads_before)
    return {
        "machine": machine_info(device, config.threads),
        "config": {**asdict(config), "memory_limit_bytes": limit},
        "timing_method": ("median of `repeats` calls after `warmup` calls; forward = inference under "
                          "torch.no_grad(); forward+backward = forward with autograd, then torch.autograd.grad of "
                          "q, k, v and the tables for a fixed random output gradient"
                          + ("; CUDA events around each call, synchronized" if device.type == "cuda"
                             else "; time.perf_counter around each call")),
        "memory_method": memory_method(device),
        "rows": [asdict(r) for r in rows],
    }


# ---------------------------------------------------------------------------------------------- reporting


def format_table(result: dict) -> str:
    """The terminal table: one line per implementation and length."""
    cfg = result["config"]
    head = ["N", "implementation", "fwd ms", "x SDPA", "fwd+bwd ms", "x SDPA", "peak fwd+bwd", "x SDPA", "note"]
    lines = []
    for r in result["rows"]:
        if r["status"] == "ok":
            note = "; ".join(s for s in (r["detail"], r["diff_vs"] and f"max|diff| vs {r['diff_vs']} "
                                         f"{r['max_abs_diff']:.1e}") if s)
            lines.append([str(r["n"]), r["implementation"], _fmt_ms(r["forward_ms"]), _fmt_ratio(r["forward_ratio"]),
                          _fmt_ms(r["fwdbwd_ms"]), _fmt_ratio(r["fwdbwd_ratio"]), _fmt_bytes(r["peak_fwdbwd_bytes"]),
                          _fmt_ratio(r["memory_ratio"]), note])
        else:
            lines.append([str(r["n"]), r["implementation"], "-", "-", "-", "-", "-", "-", f"{r['status']}: "
                          f"{r['reason']}"])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    widths[-1] = 0

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in (0, 2, 3, 4, 5, 6, 7) else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    m = result["machine"]
    title = (f"relattn bench: {cfg['dtype']}, B={cfg['batch']}, H={cfg['heads']}, D={cfg['head_dim']}, "
             f"K={cfg['max_relative_position']}, {'per-head' if cfg['per_head_tables'] else 'shared'} key+value "
             f"tables, {'causal' if cfg['causal'] else 'not causal'}, {cfg['device']}, {m['torch_threads']} threads "
             f"({m['cpu']}), torch {m['torch']}")
    notes = {r["implementation"]: r["note"] for r in result["rows"]}
    legend = [f"  {name}: {note}" for name, note in notes.items()]
    return "\n".join([title, "", fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines), "",
                      f"time: {result['timing_method']}", f"peak: {result['memory_method']}", "implementations:",
                      *legend])


def plot(result: dict, path: str | os.PathLike) -> Path:
    """Log-log time vs N per implementation (forward, forward+backward) and peak memory; saved atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), layout="constrained")
    names = list(dict.fromkeys(r["implementation"] for r in result["rows"]))
    lengths = sorted({r["n"] for r in result["rows"]})
    for ax, key, scale, label in ((axes[0], "forward_ms", 1.0, "forward: median ms"),
                                  (axes[1], "fwdbwd_ms", 1.0, "forward + backward: median ms"),
                                  (axes[2], "peak_fwdbwd_bytes", 1e-6, "forward + backward: peak extra MB")):
        for name in names:
            pts = [(r["n"], r[key] * scale) for r in result["rows"]
                   if r["implementation"] == name and r["status"] == "ok"]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name,
                        linewidth=2.5 if name == "sdpa" else 1.5, linestyle="--" if name == "sdpa" else "-")
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", title=label)
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    cfg, m = result["config"], result["machine"]
    fig.suptitle(f"{cfg['dtype']}, B={cfg['batch']}, H={cfg['heads']}, D={cfg['head_dim']}, "
                 f"K={cfg['max_relative_position']}, {'causal' if cfg['causal'] else 'not causal'}, "
                 f"{cfg['device']} ({m.get('gpu', m['cpu'])}), {m['torch_threads']} threads")
    return save_figure(fig, path)


def write_results(result: dict, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``bench.json`` and ``bench.png`` in ``out_dir``, both written atomically."""
    out_dir = Path(out_dir)
    json_path = out_dir / "bench.json"
    atomic_write_text(json_path, json.dumps(result, indent=1) + "\n")
    return json_path, plot(result, out_dir / "bench.png")


# ---------------------------------------------------------------------------------------------- command line


def _bounded(convert: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse ``type``: ``convert(text)``, refused with "expected {what}" unless ``ok(value)``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value if convert is int else repr(text)}")
        return value

    return parse


_positive_int = _bounded(int, "a positive integer", lambda x: x >= 1)
_non_negative_int = _bounded(int, "an integer >= 0", lambda x: x >= 0)
_positive_float = _bounded(float, "a positive number", lambda x: x > 0 and math.isfinite(x))


def _backend_name(text: str) -> str:
    if text != "auto" and text not in BACKENDS:
        valid = ", ".join(["auto", *BACKENDS])
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; valid: {valid}")
    return text


def _command_line(argv: Sequence[str] | None) -> str:
    if argv is None:
        if not sys.argv or not sys.argv[0].endswith(("relattn", "__main__.py")):
            return ""
        argv = sys.argv[1:]
    return " ".join(["relattn", *argv])


def config_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> BenchConfig:
    if args.memory_check:
        lengths, repeats, time_limit = MEMORY_CHECK_LENGTHS, 1, 600.0
        backends, peers = ("auto",), ("materialised",)
    elif args.quick:
        lengths, repeats, time_limit = QUICK_LENGTHS, 3, 120.0
        backends, peers = None, ("materialised", "hf")
    else:
        lengths, repeats, time_limit = FULL_LENGTHS, 5, 180.0
        backends, peers = None, ("materialised", "hf")
    return BenchConfig(
        lengths=tuple(args.lengths or lengths), causal=args.causal, batch=args.batch, heads=args.heads,
        head_dim=args.head_dim, max_relative_position=args.max_relative_position,
        per_head_tables=args.per_head_tables, dtype=args.dtype, device=args.device, threads=args.threads,
        repeats=args.repeats or repeats,
        warmup=(0 if args.memory_check else 1) if args.warmup is None else args.warmup,
        backends=tuple(args.backends) if args.backends else backends,
        peers=tuple(args.peers) if args.peers is not None else peers,
        memory_limit_bytes=args.memory_limit * 1e9 if args.memory_limit else None,
        time_limit_s=args.time_limit or time_limit, seed=args.seed,
        command=_command_line(argv),
    )


def _main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.device == "cuda" and not torch.cuda.is_available():
        print("relattn bench: error: --device cuda: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    out = Path(args.out or ("relattn-bench-memory" if args.memory_check else
                            "relattn-bench-causal" if args.causal else "relattn-bench"))
    result = run_bench(config, progress=not args.no_progress)
    print(format_table(result))
    json_path, png_path = write_results(result, out)
    print(f"\nsaved {json_path} and {png_path}")
    return 0


def _one_line_error(prog: str) -> Callable[[str], None]:
    def error(message: str) -> None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    return error


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time and memory of relattn's backends against SDPA and the peers",
                       description="Time and peak memory of relattn's backends against PyTorch's SDPA (no "
                                   "positions) and the peers' formulations, side by side in one process, "
                                   "on the same q, k, v. Writes bench.json and bench.png to --out.")
    p.error = _one_line_error("relattn bench")  # one line, not the usage block
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 3 repeats: under a minute")
    mode.add_argument("--memory-check", action="store_true",
                      help=f"N={MEMORY_CHECK_LENGTHS}: SDPA vs relattn auto (and the materialised form's need), "
                           "1 repeat, no warm-up")
    p.add_argument("--causal", action="store_true", help="causal attention (is_causal=True everywhere)")
    p.add_argument("--lengths", nargs="+", type=_positive_int, metavar="N",
                   help=f"sequence lengths (default {FULL_LENGTHS})")
    p.add_argument("--backends", nargs="+", type=_backend_name, metavar="NAME",
                   help=f"relattn backends to run: 'auto' or any of {', '.join(BACKENDS)} (default: all and auto)")
    p.add_argument("--peers", nargs="*", choices=("materialised", "hf"),
                   help="peers besides SDPA (default: materialised hf; give none for none)")
    p.add_argument("--batch", type=_positive_int, default=1, help="B (default %(default)s)")
    p.add_argument("--heads", type=_positive_int, default=8, help="H (default %(default)s)")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="D (default %(default)s)")
    p.add_argument("--max-relative-position", type=_non_negative_int, default=64, help="K (default %(default)s)")
    p.add_argument("--per-head-tables", action="store_true", help="(H, 2K+1, D) tables instead of shared ones")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="(default %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=2, help="torch threads (default %(default)s)")
    p.add_argument("--repeats", type=_positive_int,
                   help="timed calls per measurement (default 5; quick 3; --memory-check 1)")
    p.add_argument("--warmup", type=_non_negative_int, help="untimed calls first (default 1; --memory-check 0)")
    p.add_argument("--memory-limit", type=_positive_float, metavar="GB",
                   help="skip what is predicted to need more (default: half the free memory)")
    p.add_argument("--time-limit", type=_positive_float, metavar="S",
                   help="skip a measurement (one implementation at one length) predicted to take longer, "
                        "from the times at shorter lengths (default 180; quick 120)")
    p.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", metavar="DIR",
                   help="folder for bench.json and bench.png (default relattn-bench, relattn-bench-causal or "
                        "relattn-bench-memory)")
    p.set_defaults(func=_main)
