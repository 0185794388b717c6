"""``relattn bench``'s run: the implementations it measures, what it skips, one row per implementation and length.

- ``sdpa``: ``F.scaled_dot_product_attention`` with no positions, the floor every ratio is taken against;
- ``materialised``: the (N, M, D) formulation the peers use (:func:`relattn.bench.peers.materialised_attention`);
- ``hf-w2v-bert:eager`` and ``hf-w2v-bert:sdpa``: Hugging Face ``Wav2Vec2BertSelfAttention`` with
  ``relative_key`` (:class:`relattn.bench.peers.HFWav2Vec2BertRelativeKey`), when ``transformers>=5`` is installed;
- ``relattn:<name>``: every backend in :data:`relattn.backends.BACKENDS`, then ``relattn:auto``.

All of them at one length are measured together by :func:`relattn.bench.measure.measure` (interleaved). An
implementation predicted to need more memory than the limit, or more time than the time limit, is skipped.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from ..positions import causal_allowed
from .measure import (
    Inputs,
    Runner,
    calls_per_measurement,
    fmt_bytes,
    machine_info,
    make_inputs,
    max_abs_diff,
    measure,
    memory_method,
    ratio,
    relattn_doc,
    relattn_names,
    relattn_runner,
    sdpa_runner,
    timing_method,
)
from .peers import HFWav2Vec2BertRelativeKey, hf_missing_reason, materialised_attention, transformers_version

if TYPE_CHECKING:
    from .config import BenchConfig

HF_IMPLEMENTATIONS = ("eager", "sdpa")  # transformers' attention functions the Hugging Face peer runs with


@dataclass
class Impl:
    name: str
    kind: str  # "floor", "peer" or "relattn"
    note: str
    make: Callable[[Inputs], Runner | str]  # a Runner, or the reason this implementation can't serve the inputs
    estimate_bytes: Callable[[Inputs], float] = lambda inp: 0.0  # a floor on the forward+backward peak
    probed: list[tuple[int, float]] | None = None  # (N, peak fwd+bwd bytes) at PROBE_LENGTHS, once measured


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


def _gathered_bytes(inp: Inputs, heads: int) -> float:
    """One (N, M, D) tensor per table head."""
    return float(heads * inp.n * inp.k.shape[-2] * inp.q.shape[-1] * inp.q.element_size())


def _scores_bytes(inp: Inputs) -> float:
    b, h, n, _ = inp.q.shape
    return float(b * h * n * inp.k.shape[-2] * inp.q.element_size())


def _materialised(inp: Inputs) -> Runner:
    return Runner(lambda: materialised_attention(*inp.params, max_relative_position=inp.max_relative_position,
                                                 attn_mask=inp.mask, is_causal=inp.causal), inp.params)


def _materialised_bytes(inp: Inputs) -> float:
    # both gathered tables and their gradients, plus scores, weights and their gradients
    return 4 * _gathered_bytes(inp, inp.rel_k.shape[0]) + 3 * _scores_bytes(inp)


def _hf(attn_implementation: str) -> Callable[[Inputs], Runner | str]:
    def make(inp: Inputs) -> Runner | str:
        reason = hf_missing_reason()
        if reason is not None:
            return reason
        _, h, n, d = inp.q.shape
        peer = HFWav2Vec2BertRelativeKey(h, d, inp.max_relative_position, attn_implementation=attn_implementation,
                                         device=inp.q.device, dtype=inp.q.dtype)
        peer.layer.requires_grad_(True)
        mask = inp.mask  # the layer has no is_causal: a causal pattern goes in as a mask
        if inp.causal:
            keep = causal_allowed(n, n, 0, inp.q.device)
            mask = keep if mask is None else mask & keep
        return Runner(lambda: peer(inp.q, inp.k, inp.v, attn_mask=mask), (inp.q, inp.k, inp.v, peer.table),
                      detail=f"transformers {transformers_version()}")

    return make


def _hf_bytes(inp: Inputs) -> float:
    return 2 * _gathered_bytes(inp, 1) + 3 * _scores_bytes(inp)


def implementations(config: BenchConfig) -> list[Impl]:
    """The floor, the peers asked for, then relattn's backends (all of BACKENDS and "auto" by default)."""
    impls = [Impl("sdpa", "floor", "F.scaled_dot_product_attention, no positions", sdpa_runner)]
    if "materialised" in config.peers:
        impls.append(Impl("materialised", "peer", "(N,M,D) gathered tables, as tensor2tensor/OpenNMT-py",
                          _materialised, _materialised_bytes))
    if "hf" in config.peers:
        k = config.max_relative_position
        for attn in HF_IMPLEMENTATIONS:
            impls.append(Impl(f"hf-w2v-bert:{attn}", "peer",
                              f"HF transformers Wav2Vec2BertSelfAttention, position_embeddings_type='relative_key', "
                              f"offsets clipped to [-{k}, {k}] (left/right_max_position_embeddings={k}): key term "
                              f"only, one table for all heads, (N,M,D) gathered; attn_implementation='{attn}'",
                              _hf(attn), _hf_bytes))
    names = relattn_names() if config.backends is None else list(config.backends)
    for name in names:
        impls.append(Impl(f"relattn:{name}", "relattn", relattn_doc(name),
                          lambda inp, name=name: relattn_runner(name, inp)))
    return impls


# ---------------------------------------------------------------------------------------------- skips


def _available_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return float(line.split()[1]) * 1024
    except (OSError, ValueError, StopIteration):
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


PROBE_LENGTHS = (128, 256)  # where an implementation's memory growth is probed before a longer first length


def _probe_peaks(impl: Impl, config: BenchConfig) -> list[tuple[int, float]]:
    """Peak fwd+bwd bytes at :data:`PROBE_LENGTHS` (once per implementation), so a first long length, or a run
    without memory measurements, has two points to extrapolate from."""
    if impl.probed is None:
        impl.probed = []
        for n in PROBE_LENGTHS:
            inp = make_inputs(config, n)
            made = impl.make(inp)
            if isinstance(made, Runner):
                peak = measure({impl.name: made}, inp, repeats=0, warmup=0, forward=False)[impl.name]
                impl.probed.append((n, float(peak.peak_fwdbwd_bytes or 0)))
    return impl.probed


def _skip_reason(impl: Impl, inp: Inputs, history: list[Row], config: BenchConfig, limit: float) -> str | None:
    # predictions only grow with N, so what is skipped at one length is skipped at every longer one
    done = [r for r in history if r.status == "ok"]
    peaks = [(r.n, float(r.peak_fwdbwd_bytes)) for r in done if r.peak_fwdbwd_bytes]
    if not peaks and inp.n > 2 * PROBE_LENGTHS[-1]:
        peaks = _probe_peaks(impl, config)
    mem = max(impl.estimate_bytes(inp), _extrapolate(peaks, inp.n, lo=1.0, hi=2.0, single=1.0) or 0.0)
    if mem > limit:
        return f"predicted peak {fmt_bytes(mem)} > limit {fmt_bytes(limit)}"
    # from the fastest call, not the median: one stall at a short length must not skip the longer ones
    fastest = [(r.n, min(r.fwdbwd_all_ms)) for r in done]
    call_s = (_extrapolate(fastest, inp.n, lo=1.0, hi=2.0, single=2.0) or 0.0) / 1e3
    secs = call_s * calls_per_measurement(config.repeats, config.warmup)
    if secs > config.time_limit_s:
        return f"predicted {secs:.0f} s ({call_s:.1f} s per forward+backward) > limit {config.time_limit_s:g} s"
    return None


# ---------------------------------------------------------------------------------------------- running


def _rows_at(n: int, impls: list[Impl], inp: Inputs, rows: list[Row], config: BenchConfig,
             limit: float) -> list[Row]:
    """Measure every implementation that is not skipped at one length, interleaved; one row each."""
    here = {impl.name: Row(n, impl.name, impl.kind, "ok", note=impl.note) for impl in impls}
    runners = {}
    for impl in impls:
        made = impl.make(inp)
        history = [r for r in rows if r.implementation == impl.name]
        reason = made if isinstance(made, str) else _skip_reason(impl, inp, history, config, limit)
        if reason is not None:
            here[impl.name].status, here[impl.name].reason = "skipped", reason
        else:
            runners[impl.name], here[impl.name].detail = made, made.detail
    measured = measure(runners, inp, repeats=config.repeats, warmup=config.warmup, forward=config.forward,
                       memory=config.memory)
    for name, m in measured.items():
        row = here[name]
        if m.error is not None:
            row.status, row.reason = "failed", m.error
            continue
        row.forward_all_ms, row.fwdbwd_all_ms = m.forward_ms, m.fwdbwd_ms
        row.forward_ms, row.fwdbwd_ms = m.forward_median, m.fwdbwd_median
        row.peak_forward_bytes, row.peak_fwdbwd_bytes = m.peak_forward_bytes, m.peak_fwdbwd_bytes
    floor = here["sdpa"]
    ok = [r for r in here.values() if r.status == "ok"]
    # agreement against the materialised peer (tested against the numpy reference), else the first relattn row
    ref = next((r.implementation for r in ok if r.implementation == "materialised"),
               next((r.implementation for r in ok if r.kind == "relattn"), None))
    for row in ok:
        if floor.status == "ok":
            row.forward_ratio = ratio(row.forward_ms, floor.forward_ms)
            row.fwdbwd_ratio = ratio(row.fwdbwd_ms, floor.fwdbwd_ms)
            row.memory_ratio = ratio(row.peak_fwdbwd_bytes, floor.peak_fwdbwd_bytes)
        if row.kind == "relattn" and ref not in (None, row.implementation):
            row.max_abs_diff = max_abs_diff(measured[row.implementation].output, measured[ref].output)
            row.diff_vs = ref
    return list(here.values())


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
    impls = implementations(config)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    limit = config.memory_limit_bytes or 0.5 * _available_bytes(device)
    rows: list[Row] = []
    bar = tqdm(total=len(config.lengths), disable=not progress, unit="length", leave=False)
    if "hf" in config.peers and transformers_version() is not None:
        import transformers.models.wav2vec2_bert.modeling_wav2vec2_bert  # noqa: F401  (before the freeze below)
    gc.collect()
    gc.freeze()  # what exists now (modules, transformers' classes) is never garbage: keep gc.collect() quick
    try:
        for n in sorted(config.lengths):
            bar.set_postfix_str(f"N={n}")
            rows += _rows_at(n, impls, make_inputs(config, n), rows, config, limit)
            gc.collect()
            bar.update()
    finally:
        gc.unfreeze()
        bar.close()
        torch.set_num_threads(threads_before)
    return {
        "machine": machine_info(device, config.threads, transformers=transformers_version()),
        "config": {**asdict(config), "memory_limit_bytes": limit},
        "timing_method": timing_method(device),
        "memory_method": memory_method(device),
        "rows": [asdict(r) for r in rows],
    }
