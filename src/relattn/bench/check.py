"""``relattn check``: what a user runs first on a new machine (as ``python -m xformers.info`` or
``torch.utils.collect_env``): the device and the versions, which backend ``"auto"`` picks for a few typical calls
and why, a small conformance set on every backend that can run here against the float64 formula (outputs and
gradients), and one timed call per backend against SDPA. :func:`run_check` returns the exit status: 0 when every
answer is right, 1 when one is wrong (or a backend fails on a call it declares it serves).

The oracle is the op's formula in float64 (:func:`formula`, plain torch, differentiable), itself held to the
specification (:func:`relattn.reference.relative_attention`, numpy) on every case before it judges anything.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .. import __version__
from .. import reference as ref
from ..backends import BACKENDS, Backend, choose, native, why_not
from ..backends.cpu import features as cpu_features
from ..functional import as_served, validate
from ..positions import relative_position_index
from .measure import time_interleaved

LOW_PRECISION = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------------- the oracle


def formula(q, k, v, rel_k, rel_v, rel_q, *, max_relative_position, mask=None, is_causal=False, scale=None,
            query_offset=0):
    """The op as written in its docstring, plain torch, in the inputs' dtype (softmax in float32 at least):
    ``out_i = sum_j w_ij (v_j + a^V[t_ij])``, ``w_i = softmax_j((q_i.k_j + q_i.a^K[t_ij] + k_j.a^Q[t_ij]) scale +
    mask_ij)``, ``t_ij = clip(j - i - query_offset, -K, K) + K``. q (B, H, N, D); k, v (B, Hkv, M, D|Dv); tables
    (Hr, 2K+1, d) or None; mask additive, broadcastable to (B, H, N, M), or None. A row with no key gives zeros."""
    b, h, n, d = q.shape
    m = k.shape[2]
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = d ** -0.5 if scale is None else scale
    idx = torch.as_tensor(relative_position_index(n, m, max_relative_position, query_offset=query_offset),
                          device=q.device)
    scores = q @ k.transpose(-1, -2)
    if rel_k is not None:
        scores = scores + torch.einsum("bhnd,hnmd->bhnm", q, rel_k[:, idx].expand(h, n, m, d))
    if rel_q is not None:
        scores = scores + torch.einsum("bhmd,hnmd->bhnm", k, rel_q[:, idx].expand(h, n, m, d))
    scores = scores * scale
    if mask is not None:
        scores = scores + mask
    if is_causal:
        keep = torch.arange(m, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + query_offset
        scores = scores.masked_fill(~keep, float("-inf"))
    work = torch.promote_types(scores.dtype, torch.float32)
    w = torch.softmax(scores.to(work), -1).nan_to_num(0.0).to(q.dtype)  # a row with no key: zeros
    out = w @ v
    if rel_v is not None:
        out = out + torch.einsum("bhnm,hnmd->bhnd", w, rel_v[:, idx].expand(h, n, m, rel_v.shape[-1]))
    return out


# ------------------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One conformance call: shapes and what it combines."""

    name: str
    b: int = 2
    h: int = 4
    hkv: int = 4
    n: int = 33
    m: int = 33
    d: int = 16
    dv: int = 16
    kk: int = 4
    per_head: bool = False
    rel_q: bool = False
    values_table: bool = True
    pad: int = 0  # keys masked at the end of the last batch entry (a key-padding mask)
    causal: bool = False
    offset: int = 0


CASES = (
    Case("plain: shared tables"),
    Case("causal, decoding offset, per-head tables, key padding", n=20, m=37, offset=17, per_head=True, pad=5,
         causal=True, kk=6),
    Case("grouped k/v 4/2 heads, rel_q per head, D != Dv", hkv=2, n=24, m=24, dv=8, kk=3, per_head=True, rel_q=True,
         values_table=False),
)


def _inputs(case: Case, seed: int):
    """float64 leaves (q, k, v, rel_k, rel_v, rel_q), the additive mask (or None) and the output gradient."""
    g = torch.Generator().manual_seed(seed)
    hr = case.h if case.per_head else 1
    rows = 2 * case.kk + 1

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    q, k = randn(case.b, case.h, case.n, case.d), randn(case.b, case.hkv, case.m, case.d)
    v = randn(case.b, case.hkv, case.m, case.dv)
    rel_k = randn(hr, rows, case.d, std=0.5)
    rel_v = randn(hr, rows, case.dv, std=0.5) if case.values_table else None
    rel_q = randn(hr, rows, case.d, std=0.5) if case.rel_q else None
    mask = None
    if case.pad:
        mask = torch.zeros(case.b, 1, 1, case.m, dtype=torch.float64)
        mask[-1, ..., case.m - case.pad:] = float("-inf")
    return (q, k, v, rel_k, rel_v, rel_q), mask, randn(case.b, case.h, case.n, case.dv)


def _kw(case: Case) -> dict:
    return dict(max_relative_position=case.kk, is_causal=case.causal, query_offset=case.offset)


def _grads(out, leaves, grad_out):
    present = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, present, grad_out)


def _spec_output(leaves, mask, case: Case) -> torch.Tensor:
    """The numpy specification's output for the case (k, v repeated to H heads)."""
    q, k, v, rel_k, rel_v, rel_q = leaves
    groups = case.h // case.hkv
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)

    def np64(t):  # a shared table as the specification takes it: (R, d)
        return None if t is None else (t[0] if t.dim() == 3 and t.shape[0] == 1 else t).detach().numpy()

    out = ref.relative_attention(np64(q), np64(k), np64(v), np64(rel_k), np64(rel_v), rel_q=np64(rel_q),
                                 attn_mask=np64(mask), **_kw(case))
    return torch.from_numpy(np.ascontiguousarray(out))


@dataclass
class Verdict:
    """A backend's result on one case in one dtype: the worst error as a fraction of its tolerance (<= 1: right)."""

    backend: str
    case: str
    dtype: torch.dtype
    worst: float | None = None  # max over out and every gradient of error / tolerance
    what: str = ""  # the quantity with the worst ratio
    skipped: str = ""  # why the backend does not take the call
    error: str = ""  # the exception a served call raised

    @property
    def ok(self) -> bool:
        return not self.error and (self.worst is None or self.worst <= 1.0)


def _tolerance(want: torch.Tensor, plain: torch.Tensor | None, dtype: torch.dtype) -> float:
    """The suite's policy: float32/float64 within 512 eps (1 + max|want|); 16-bit within twice plain PyTorch's own
    error at that dtype, never asked to beat one rounding (2 eps (1 + max|want|))."""
    eps = torch.finfo(dtype).eps
    scale = 1.0 + want.abs().max().item() if want.numel() else 1.0
    if plain is None:
        return 512 * eps * scale
    return max(2 * (plain.double() - want).abs().max().item(), 2 * eps * scale)


def check_case(name: str, backend: Backend, case: Case, dtype: torch.dtype, device: torch.device,
               seed: int = 0) -> Verdict:
    """``backend`` on ``case`` in ``dtype``: output and every gradient against the float64 formula (itself checked
    against the specification first)."""
    verdict = Verdict(name, case.name, dtype)
    leaves64, mask64, go64 = _inputs(case, seed)
    # the inputs rounded to the dtype once: the truth is the formula on exactly these values
    rounded = [None if t is None else t.to(dtype).to(torch.float64) for t in leaves64]
    truth_leaves = [None if t is None else t.clone().requires_grad_() for t in rounded]
    want = formula(*truth_leaves, mask=mask64, **_kw(case))
    spec = _spec_output(rounded, mask64, case)
    if not torch.allclose(want.detach(), spec, rtol=1e-10, atol=1e-10):
        raise AssertionError(f"the float64 formula disagrees with relattn.reference on {case.name!r}")
    go = go64.to(dtype)
    want_grads = _grads(want, truth_leaves, go.to(torch.float64))
    plain_out = plain_grads = None
    if dtype in LOW_PRECISION:  # the yardstick: the formula run in the dtype itself, as plain PyTorch would
        low = [None if t is None else t.to(dtype).requires_grad_() for t in rounded]
        plain_out = formula(*low, mask=None if mask64 is None else mask64.to(dtype), **_kw(case))
        plain_grads = _grads(plain_out, low, go)
    x = [None if t is None else t.to(device, dtype).requires_grad_() for t in rounded]
    mask = None if mask64 is None else mask64.to(device, dtype)
    call = validate(*x[:5], rel_q=x[5], attn_mask=mask, dropout_p=0.0, scale=None, beyond="clip",
                    enable_gqa=case.hkv != case.h, **_kw(case))
    if reasons := why_not(backend, call):
        verdict.skipped = "; ".join(reasons)
        return verdict
    try:
        got = backend.run(as_served(backend, call))
        got_grads = _grads(got, x, go.to(device))
    except Exception as exc:  # a backend failing on a call it declares it serves is a wrong answer too
        verdict.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        return verdict
    names = ["out", *(f"d{n}" for n, t in zip(("q", "k", "v", "rel_k", "rel_v", "rel_q"), x, strict=True)
                      if t is not None)]
    plains = [plain_out, *plain_grads] if plain_out is not None else [None] * len(names)
    worst, what = 0.0, ""
    for label, a, w, p in zip(names, [got, *got_grads], [want, *want_grads], plains, strict=True):
        w = w.detach()
        a = a.detach().to("cpu", torch.float64)
        if a.shape != w.shape:
            verdict.error = f"{label} has shape {tuple(a.shape)}, expected {tuple(w.shape)}"
            return verdict
        err = (a - w).abs().max().item() if a.numel() else 0.0
        ratio = err / _tolerance(w, None if p is None else p.detach(), dtype)
        if not math.isfinite(ratio) or ratio > worst:
            worst, what = (math.inf if not math.isfinite(ratio) else ratio), label
    verdict.worst, verdict.what = worst, what
    return verdict


# -------------------------------------------------------------------------------------- auto's typical calls


@dataclass(frozen=True)
class Typical:
    """A typical call, described for people; ``make(device, dtype)`` builds its inputs (small allocations)."""

    what: str
    n: int
    m: int
    d: int = 64
    h: int = 12
    hkv: int | None = None
    kk: int = 64
    causal: bool = False
    offset: int = 0
    dropout: float = 0.0
    pad: bool = False
    rel_q: bool = False
    values_table: bool = True
    extra: dict = field(default_factory=dict)


TYPICAL = (
    Typical("BERT-base encoder, N = 512, key padding", 512, 512, kk=16, pad=True),
    Typical("causal LM training, N = 2048, D = 128", 2048, 2048, d=128, h=16, causal=True),
    Typical("the same with attention dropout 0.1", 2048, 2048, d=128, h=16, causal=True, dropout=0.1),
    Typical("decoding: 1 query, 4096 cached keys, GQA 32/8 heads", 1, 4096, h=32, hkv=8, causal=True, offset=4095),
    Typical("DeBERTa-v3-base: rel_q per head, N = 512, K = 256", 512, 512, kk=256, rel_q=True, values_table=False),
    Typical("short sequences, N = 64", 64, 64, kk=8),
)


def typical_call(t: Typical, device: torch.device, dtype: torch.dtype):
    """The validated call of ``t`` (batch 1)."""
    hkv = t.h if t.hkv is None else t.hkv
    q = torch.zeros(1, t.h, t.n, t.d, device=device, dtype=dtype)
    kv = torch.zeros(1, hkv, t.m, t.d, device=device, dtype=dtype)
    table = torch.zeros(t.h if t.rel_q else 1, 2 * t.kk + 1, t.d, device=device, dtype=dtype)
    mask = torch.ones(1, 1, 1, t.m, dtype=torch.bool, device=device) if t.pad else None
    return validate(q, kv, kv, table, table if t.values_table else None, rel_q=table if t.rel_q else None,
                    max_relative_position=t.kk, attn_mask=mask, is_causal=t.causal, dropout_p=t.dropout, scale=None,
                    query_offset=t.offset, enable_gqa=hkv != t.h)


# ---------------------------------------------------------------------------------------------- the command


def _versions() -> str:
    parts = [f"relattn {__version__}", f"torch {torch.__version__}"]
    try:
        parts.append(f"triton {importlib.metadata.version('triton')}")
    except importlib.metadata.PackageNotFoundError:
        parts.append("triton not installed")
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    parts.append(f"python {platform.python_version()}")
    return ", ".join(parts)


def _device_line(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        return (f"{device} {torch.cuda.get_device_name(device)} (sm_{major}{minor}, {props.multi_processor_count} SMs, "
                f"{props.total_memory / 2**30:.0f} GiB)")
    return (f"{device} {cpu_features().describe()}, {torch.get_num_threads()} threads")


def native_line() -> str:
    """What the native kernel chose for this CPU (its class, tiles, 16-bit GEMMs) and the settings in force."""
    return f"{native.choice().describe()}; in force: {native.SETTINGS.current}"


def _timed(backends: Mapping[str, Backend], device: torch.device, dtype: torch.dtype, n: int, repeats: int,
           emit: Callable[[str], None]) -> None:
    """One forward (no grad) per backend that takes it, against SDPA, median of ``repeats`` interleaved calls."""
    b, h, d, kk = 1, 8, 64, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device, dtype) for _ in range(3))
    rk, rv = (0.1 * torch.randn(2 * kk + 1, d, generator=g)).to(device, dtype), \
        (0.1 * torch.randn(2 * kk + 1, d, generator=g)).to(device, dtype)
    call = validate(q, k, v, rk, rv, max_relative_position=kk, attn_mask=None, is_causal=True, dropout_p=0.0,
                    scale=None, query_offset=0)
    fns = {"sdpa (no positions)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for name, backend in backends.items():
        if not why_not(backend, call):
            fns[name] = lambda backend=backend: backend.run(as_served(backend, call))
    with torch.no_grad():
        times = time_interleaved(fns, repeats, warmup=1, device=device)
    base = float(np.median(times["sdpa (no positions)"]))
    emit(f"one causal forward, B = 1, H = 8, N = {n}, D = 64, K = 32, {str(dtype).removeprefix('torch.')}; "
         f"median of {repeats} interleaved calls:")
    for name, ms in times.items():
        med = float(np.median(ms))
        emit(f"  {name:<20} {med:9.3f} ms" + ("" if name.startswith("sdpa") else f"   x{med / base:.2f} SDPA"))


def default_dtypes(device: torch.device) -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16, torch.float32] if device.type == "cuda" else [torch.float32]


def run_check(*, device: str | torch.device | None = None, dtypes: list[torch.dtype] | None = None,
              backends: Mapping[str, Backend] | None = None, time_n: int | None = None, repeats: int = 3,
              emit: Callable[[str], None] = print) -> int:
    """The check, printed line by line through ``emit``; 0 when every answer is right, else 1. ``backends``: the
    backends to check (default every registered one); ``time_n``: the timed call's length (0: no timing)."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    backends = dict(BACKENDS if backends is None else backends)
    dtypes = default_dtypes(device) if dtypes is None else dtypes
    emit("relattn check")
    emit(f"device    {_device_line(device)}")
    emit(f"versions  {_versions()}")
    if device.type == "cpu":
        emit(f"native    {native_line()}")
    for name, backend in backends.items():
        why = backend.unavailable()
        emit(f"  {name:<8} {'available' if why is None else 'unavailable: ' + why}")

    emit("")
    emit(f"what backend='auto' picks here ({str(dtypes[0]).removeprefix('torch.')} on {device.type}), and why not "
         "the ones before it:")
    for t in TYPICAL:
        call = typical_call(t, device, dtypes[0])
        passed = "; ".join(f"{n}: {', '.join(r)}" for n, r in why_not(call).items())
        emit(f"  {t.what:<52} {choose(call).name:<8}" + (f" ({passed})" if passed else ""))

    emit("")
    emit("conformance: outputs and all gradients against the float64 formula (worst error / tolerance; <= 1 is "
         "right)")
    verdicts = []
    for name, backend in backends.items():
        for dtype in dtypes:
            for case in CASES:
                v = check_case(name, backend, case, dtype, device)
                verdicts.append(v)
                status = ("skipped: " + v.skipped if v.skipped else "FAILED: " + v.error if v.error
                          else f"{'ok' if v.ok else 'WRONG'} {v.worst:.2g} ({v.what})")
                emit(f"  {name:<8} {str(dtype).removeprefix('torch.'):<9} {case.name:<58} {status}")

    if time_n is None:
        time_n = 4096 if device.type == "cuda" else 512
    if time_n:
        emit("")
        _timed({n: b for n, b in backends.items() if b.unavailable() is None}, device, dtypes[0], time_n, repeats,
               emit)

    wrong = [v for v in verdicts if not v.ok]
    ran = [v for v in verdicts if not v.skipped]
    emit("")
    if wrong:
        emit(f"result: {len(wrong)} WRONG of {len(ran)} checks: "
             + "; ".join(f"{v.backend} {str(v.dtype).removeprefix('torch.')} {v.case!r}" for v in wrong))
        return 1
    emit(f"result: ok, {len(ran)} checks on {len({v.backend for v in ran})} backends")
    return 0


def main(argv: list[str] | None = None) -> int:  # python -m relattn.bench.check
    return run_check()


if __name__ == "__main__":
    sys.exit(main())
