"""Dispatch as data: ``check_name``, ``priority``, ``choose``, ``why_not``, ``resolve`` and the one function that
turns a backend's declaration (``Serves``) into refusal reasons.

Fake backends (monkeypatched into the registry) test the rules themselves; the registered backends are then
held to their declarations: each restriction a backend declares refuses, by name, a call that violates it, and
each capability it declares serves a call that uses it, with the reference's answer.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import relattn.backends as dispatch
from helpers import (
    LOW_PRECISION,
    assert_close,
    attention_ref,
    random_inputs,
    reference_output,
    require_backend,
    unavailable_here,
)
from relattn import BACKENDS
from relattn import functional as fn
from relattn.backends import (
    AttentionCall,
    Backend,
    Serves,
    check_name,
    choose,
    native,
    not_supported_reasons,
    priority,
    resolve,
    why_not,
)
from relattn.backends._common import FLOATS


def _never_run(call):
    raise AssertionError("dispatch must not run a backend")


def fake(name, unavailable=None, **serves) -> Backend:
    return Backend(name, _never_run, Serves(**serves), f"fake {name}",
                   unavailable=(lambda: None) if unavailable is None else unavailable)


def call_of(n=9, m=None, *, d=4, dv=None, kk=2, dtype=torch.float32, device="cpu", mask=None, dropout_p=0.0,
            is_causal=False) -> AttentionCall:
    """An AttentionCall as data: zero-stride tensors, so a large N costs no memory."""
    m = n if m is None else m
    dv = d if dv is None else dv

    def t(*shape):
        return torch.zeros((), dtype=dtype, device=device).expand(*shape)

    return AttentionCall(t(1, 2, n, d), t(1, 2, m, d), t(1, 2, m, dv), t(2, 2 * kk + 1, d), t(1, 2 * kk + 1, dv),
                         kk, mask, is_causal, dropout_p, 0.5, 0)


@pytest.fixture
def registry(monkeypatch):
    """Replace the registry with the given fake backends, in order."""

    def install(*backends):
        monkeypatch.setattr(dispatch, "BACKENDS", {b.name: b for b in backends})

    return install


# ----------------------------------------------------------------------------------------- check_name


def test_check_name_accepts_auto_and_every_registered_name():
    assert [check_name(n) for n in ["auto", *BACKENDS]] == ["auto", *BACKENDS]


@pytest.mark.parametrize("bad", ["fast", "Dense", "", None, 3, ("dense",)])
def test_check_name_refuses_anything_else_listing_the_choices(bad):
    valid = ", ".join(repr(n) for n in ["auto", *BACKENDS])
    with pytest.raises(ValueError) as exc:
        check_name(bad)
    assert str(exc.value) == f"backend must be one of {valid}; got {bad!r}"
    with pytest.raises(ValueError, match=r"^attention backend must be one of 'auto', "):
        check_name(bad, what="attention backend")


def test_check_name_reads_the_registry(registry):
    registry(fake("dense"), fake("mine"))
    assert check_name("mine") == "mine"
    with pytest.raises(ValueError, match=r"must be one of 'auto', 'dense', 'mine'; got 'blocked'"):
        check_name("blocked")


# ----------------------------------------------------------------------------------------- not_supported_reasons


DATA = [  # (declaration, a call violating it, the reason derived from the declaration)
    (dict(devices=frozenset({"cuda"})), dict(), "device cpu (serves cuda)"),
    (dict(devices=frozenset({"cuda", "cpu"})), dict(device="meta"), "device meta (serves cpu, cuda)"),
    (dict(dtypes=frozenset({torch.float32, torch.float16})), dict(dtype=torch.float64),
     "dtype torch.float64 (serves torch.float16, torch.float32)"),
    (dict(dropout=False), dict(dropout_p=0.1),
     "dropout_p > 0 (no dropout; 'native', 'triton', 'blocked' and 'dense' take it)"),
    (dict(mask=False), dict(mask=torch.zeros(1, 1, 9, 9)),
     "an attn_mask (takes none; use is_causal, or 'native', 'triton', 'blocked' and 'dense')"),
    (dict(mask_grad=False), dict(mask=torch.zeros(1, 1, 9, 9, requires_grad=True)),
     "attn_mask requires grad (only 'dense' differentiates the mask)"),
    (dict(max_head_dim=4), dict(d=4, dv=5), "head dim 5 (at most 4)"),
    (dict(max_head_dim=4), dict(d=6, dv=2), "head dim 6 (at most 4)"),
    (dict(head_dims_differ=False), dict(d=4, dv=3), "D = 4 != Dv = 3 (needs equal head dims)"),
]


@pytest.mark.parametrize(("declared", "violation", "reason"), DATA, ids=[r.split(" (")[0] for *_, r in DATA])
def test_each_declaration_gives_its_reason(declared, violation, reason):
    backend = fake("f", **declared)
    assert not_supported_reasons(backend, call_of(**violation)) == [reason]
    if "cpu" in declared.get("devices", {"cpu"}):
        assert not_supported_reasons(backend, call_of()) == []
    # what the default declaration serves: everything but dropout and a mask that needs grad
    lenient = fake("g", dropout=True, mask_grad=True)
    assert not_supported_reasons(lenient, call_of(**violation)) == []


def test_default_declaration_refuses_dropout_and_mask_grad_only():
    plain = fake("plain")
    assert plain.serves == Serves()
    assert not_supported_reasons(plain, call_of(dtype=torch.bfloat16, device="meta", d=3, dv=700,
                                                mask=torch.zeros(9, 9), is_causal=True)) == []
    assert not_supported_reasons(plain, call_of(dropout_p=0.5, mask=torch.zeros(9, 9, requires_grad=True))) == [
        "dropout_p > 0 (no dropout; 'native', 'triton', 'blocked' and 'dense' take it)",
        "attn_mask requires grad (only 'dense' differentiates the mask)"]


def test_every_violated_declaration_is_a_reason_in_order():
    backend = fake("strict", devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16}), mask=False,
                   max_head_dim=2, head_dims_differ=False)
    reasons = not_supported_reasons(backend, call_of(d=4, dv=3, dropout_p=0.2, mask=torch.zeros(9, 9,
                                                                                                requires_grad=True)))
    assert reasons == ["device cpu (serves cuda)", "dtype torch.float32 (serves torch.float16)",
                       "dropout_p > 0 (no dropout; 'native', 'triton', 'blocked' and 'dense' take it)",
                       "an attn_mask (takes none; use is_causal, or 'native', 'triton', 'blocked' and 'dense')",
                       "attn_mask requires grad (only 'dense' differentiates the mask)",
                       "head dim 4 (at most 2)", "D = 4 != Dv = 3 (needs equal head dims)"]


def test_unavailable_is_asked_only_when_the_declaration_serves_the_call():
    """A backend that cannot run here says why, but only for calls it would otherwise serve: asking may mean a
    build, which a call refused anyway must not trigger."""
    asked = []

    def unavailable():
        asked.append(1)
        return "no compiler here"

    backend = fake("lazy", unavailable=unavailable)
    assert not_supported_reasons(backend, call_of(dropout_p=0.1)) == [
        "dropout_p > 0 (no dropout; 'native', 'triton', 'blocked' and 'dense' take it)"]
    assert asked == []
    assert not_supported_reasons(backend, call_of()) == ["no compiler here"]
    assert asked == [1]


# ----------------------------------------------------------------------------------------- priority, choose, why_not


def _cuda_call(n, m=None):
    """A call as priority sees it on a CUDA device (shapes and device only; no GPU needed)."""
    c = call_of(n, m)
    return dataclasses.replace(c, q=types.SimpleNamespace(shape=c.q.shape, device=torch.device("cuda")))


def test_priority_lists_per_device_and_size(registry):
    registry(fake("dense"), fake("blocked"), fake("native"), fake("triton"))
    side = int(dispatch.dense_max_scores(2) ** 0.5)
    assert side == 256 + 3 * 2
    assert priority(call_of(side)) == ("native", "dense", "blocked")  # N * M == the bound: small
    assert priority(call_of(side, side + 1)) == ("native", "blocked", "dense")
    assert priority(_cuda_call(9)) == ("triton", "dense", "blocked")
    assert priority(_cuda_call(side, side + 1)) == ("triton", "blocked", "dense")
    assert priority(call_of(9, device="meta")) == ("dense", "blocked")
    assert priority(call_of(side + 1, device="meta")) == ("blocked", "dense")
    assert dispatch.dense_max_scores(64) == (256 + 192) ** 2  # the bound grows with K


def test_priority_skips_backends_not_registered(registry):
    registry(fake("dense"), fake("blocked"))
    assert priority(call_of(9)) == ("dense", "blocked")
    assert priority(_cuda_call(2000)) == ("blocked", "dense")


def test_choose_takes_the_first_that_serves_and_why_not_says_why_the_others_did_not(registry):
    dropout_reason = "dropout_p > 0 (no dropout; 'blocked' and 'dense' take it)"
    registry(fake("dense", dropout=True, mask_grad=True), fake("blocked", dropout=True), fake("native"))
    small, large = call_of(9, dropout_p=0.1), call_of(600, dropout_p=0.1)
    assert choose(call_of(9)).name == "native" and why_not(call_of(9)) == {}
    assert choose(small).name == "dense" and why_not(small) == {"native": [dropout_reason]}
    assert choose(large).name == "blocked" and why_not(large) == {"native": [dropout_reason]}
    grad_mask = call_of(600, mask=torch.zeros(600, 600, requires_grad=True))
    assert choose(grad_mask).name == "dense"
    assert why_not(grad_mask) == {"native": ["attn_mask requires grad (only 'dense' differentiates the mask)"],
                                  "blocked": ["attn_mask requires grad (only 'dense' differentiates the mask)"]}


def test_choose_passes_over_an_unavailable_backend_with_its_reason(registry):
    registry(fake("dense"), fake("blocked"), fake("native", unavailable=lambda: "no C++ compiler"))
    assert choose(call_of(9)).name == "dense"
    assert why_not(call_of(9)) == {"native": ["no C++ compiler"]}
    assert choose(call_of(600)).name == "blocked"


# ----------------------------------------------------------------------------------------- resolve


def test_resolve(registry):
    registry(fake("dense", dropout=True, mask_grad=True), fake("blocked", dropout=True),
             fake("native", devices=frozenset({"cpu"})))
    call = call_of(9)
    assert resolve("auto", call) is choose(call) is dispatch.BACKENDS["native"]
    assert resolve("blocked", call) is dispatch.BACKENDS["blocked"]
    refused = call_of(9, device="meta", dropout_p=0.1)
    with pytest.raises(ValueError) as exc:
        resolve("native", refused)
    assert str(exc.value) == ("backend 'native' cannot serve these inputs: device meta (serves cpu); "
                              "dropout_p > 0 (no dropout; 'blocked' and 'dense' take it)")
    assert resolve("auto", refused).name == "dense"
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'dense', 'blocked', 'native'; got 'x'"):
        resolve("x", call)


# ----------------------------------------------------------------------------------------- the registered backends


def _violations(name):
    """(kind, op keywords and inputs violating what backend ``name`` declares, the reason) for each restriction."""
    s = BACKENDS[name].serves
    out = []
    if s.devices is not None:
        device = next((dev for dev in ("cpu", "meta") if dev not in s.devices), None)
        if device is not None:
            out.append(("device", dict(device=device), f"device {device}"))
    for dtype in sorted(FLOATS - s.dtypes, key=str):
        out.append((f"dtype-{dtype}", dict(dtype=dtype), f"dtype {dtype}"))
    if not s.dropout:
        out.append(("dropout", dict(dropout_p=0.1), "dropout_p > 0"))
    if not s.mask:
        out.append(("mask", dict(attn_mask=torch.zeros(9, 9, dtype=torch.float64)), "an attn_mask"))
    if not s.mask_grad:
        out.append(("mask-grad", dict(attn_mask=torch.zeros(9, 9, dtype=torch.float64, requires_grad=True)),
                    "attn_mask requires grad"))
    if s.max_head_dim is not None:
        out.append(("head-dim", dict(d=s.max_head_dim + 1), f"head dim {s.max_head_dim + 1}"))
    if not s.head_dims_differ:
        out.append(("head-dims-differ", dict(dv=3), "D = 4 != Dv = 3"))
    return [pytest.param(name, kw, reason, id=f"{name}-{kind}") for kind, kw, reason in out]


def _op_inputs(*, d=4, dv=None, dtype=torch.float64, device="cpu", **op_kwargs):
    q, k, v, rk, rv = random_inputs(1, 2, 9, 9, d, d if dv is None else dv, 2, tables="keys_per_head", seed=3)
    return [t.to(dtype=dtype, device=device) for t in (q, k, v, rk, rv)], op_kwargs


@pytest.mark.parametrize(("name", "violation", "reason"), [p for n in BACKENDS for p in _violations(n)])
def test_a_registered_backend_refuses_what_it_declares_it_does_not_serve(name, violation, reason):
    inputs, kw = _op_inputs(**violation)
    with pytest.raises(ValueError) as exc:
        fn.relative_attention(*inputs, max_relative_position=2, backend=name, **kw)
    assert str(exc.value).startswith(f"backend {name!r} cannot serve these inputs: ")
    assert reason in str(exc.value)


def _capabilities(name):
    s = BACKENDS[name].serves
    caps = [f"dtype-{str(dt).removeprefix('torch.')}" for dt in sorted(s.dtypes, key=str)]
    caps += [c for c, ok in (("dropout", s.dropout), ("mask", s.mask), ("mask-grad", s.mask_grad),
                             ("head-dims-differ", s.head_dims_differ)) if ok]
    return [pytest.param(name, c, id=f"{name}-{c}") for c in caps]


@pytest.mark.parametrize(("name", "capability"), [p for n in BACKENDS for p in _capabilities(n)])
def test_a_registered_backend_serves_what_it_declares(name, capability):
    """On the CPU, where the backend serves the CPU (else it is unavailable here and skipped)."""
    require_backend(name)
    inputs, _ = _op_inputs(dv=6 if capability == "head-dims-differ" else None)
    kw = dict(max_relative_position=2, is_causal=True)
    if capability.startswith("dtype-"):
        dtype = getattr(torch, capability.removeprefix("dtype-"))
        low = [t.to(dtype) for t in inputs]
        out = fn.relative_attention(*low, backend=name, **kw)
        assert out.dtype == dtype
        # against the reference on the same (rounded) inputs, by the one tolerance policy (a 16-bit result
        # within twice plain PyTorch's error at that dtype)
        yardstick = attention_ref(*low, upcast=False, **kw) if dtype in LOW_PRECISION else None
        assert_close(out, reference_output(*low, **kw), dtype, capability, yardstick=yardstick)
    elif capability == "dropout":
        # v = 1 and a^V = 0: each output is its row's sum of kept weights / (1 - p), 1 on average, not everywhere
        q, k, v, rk, rv = random_inputs(4, 2, 16, 16, 4, 3, 3, seed=14)
        v, rv = torch.ones_like(v), torch.zeros_like(rv)
        torch.manual_seed(0)
        out = fn.relative_attention(q, k, v, rk, rv, max_relative_position=3, dropout_p=0.25, backend=name)
        assert (out - 1).abs().max() > 0.1 and abs(out.mean().item() - 1) < 0.1
        assert_close(out, out[..., :1].expand_as(out), torch.float64)  # one mask for all Dv columns
    elif capability == "mask-grad":
        mask = torch.randn(1, 2, 9, 9, dtype=torch.float64, requires_grad=True)
        (got,) = torch.autograd.grad(fn.relative_attention(*inputs, attn_mask=mask, backend=name, **kw).sum(), mask)
        (want,) = torch.autograd.grad(fn.relative_attention(*inputs, attn_mask=mask, backend="dense", **kw).sum(),
                                      mask)
        assert_close(got, want, torch.float64, "d attn_mask")
        assert got.abs().max() > 0
    else:  # mask, head-dims-differ
        mask = torch.randn(1, 2, 9, 9, dtype=torch.float64) if capability == "mask" else None
        out = fn.relative_attention(*inputs, attn_mask=mask, backend=name, **kw)
        assert_close(out, reference_output(*inputs, attn_mask=mask, **kw), torch.float64, capability)


# ----------------------------------------------------------------------------------------- "auto" on this machine


def _call(n=9, m=None, mask=None, dropout_p=0.0, mask_grad=False, **kw):
    q, k, v, rk, rv = random_inputs(1, 2, n, n if m is None else m, 4, 4, 2, tables="keys_per_head",
                                    dtype=torch.float32)
    if mask is not None and mask_grad:
        mask = mask.float().requires_grad_()
    return fn.validate(q, k, v, rk, rv, max_relative_position=2, attn_mask=mask, is_causal=kw.get("causal", False),
                       dropout_p=dropout_p, scale=None, query_offset=0)


def test_choose_never_picks_a_backend_that_cannot_serve():
    calls = [_call(), _call(mask=torch.ones(9, 9, dtype=torch.bool)), _call(dropout_p=0.2),
             _call(mask=torch.zeros(9, 9), mask_grad=True), _call(n=600), _call(n=600, dropout_p=0.1),
             _call(n=600, mask=torch.ones(600, 600, dtype=torch.bool)),
             _call(n=600, mask=torch.zeros(600, 600), mask_grad=True), _call(n=2048, causal=True)]
    for call in calls:
        chosen = choose(call)
        assert not not_supported_reasons(chosen, call), (chosen.name, not_supported_reasons(chosen, call))
    with_native = ["native", "native", "native", "dense", "native", "native", "native", "dense", "native"]
    without = ["dense", "dense", "dense", "dense", "blocked", "blocked", "blocked", "dense", "blocked"]
    assert [choose(c).name for c in calls] == (with_native if unavailable_here("native") is None else without)
    assert not not_supported_reasons(BACKENDS["blocked"], calls[2])  # dropout
    assert not_supported_reasons(BACKENDS["blocked"], calls[3]) == [
        "attn_mask requires grad (only 'dense' differentiates the mask)"]
    with pytest.raises(ValueError, match="cannot serve.*attn_mask requires grad"):
        fn.relative_attention(*random_inputs(1, 1, 3, 3, 2, 2, 1), max_relative_position=1,
                              attn_mask=torch.zeros(3, 3, dtype=torch.float64, requires_grad=True), backend="blocked")


def test_choose_without_native_uses_the_other_backends(monkeypatch):
    """No compiler (or RELATTN_NATIVE=0): "native" refuses with the reason and "auto" picks as before."""
    monkeypatch.setitem(native._state, "error", "the native kernel could not be built (no compiler)")
    calls = [_call(), _call(n=600), _call(n=600, mask=torch.ones(600, 600, dtype=torch.bool)),
             _call(n=2048, causal=True)]
    assert [choose(c).name for c in calls] == ["dense", "blocked", "blocked", "blocked"]
    assert why_not(calls[0]) == {"native": ["the native kernel could not be built (no compiler)"]}
    with pytest.raises(ValueError, match="no compiler"):
        fn.relative_attention(*random_inputs(1, 1, 3, 3, 2, 2, 1), max_relative_position=1, backend="native")


@pytest.mark.parametrize(("capability", "dtype", "want"), [
    ((7, 5), torch.float16, "blocked"),  # a T4: Triton emits no tensor-core instruction there
    ((7, 0), torch.bfloat16, "blocked"),  # a V100: no bfloat16 tensor cores
    ((8, 6), torch.bfloat16, "triton"),  # an RTX 3090 or A10
    ((12, 0), torch.float16, "triton"),  # an RTX 5090
])
def test_auto_on_a_gpu_by_its_compute_capability(monkeypatch, capability, dtype, want):
    """Per-arch serving is data (triton's ``Serves.cuda_archs``): on a simulated GPU (fake CUDA tensors, the compute
    capability mocked) "auto" takes triton only on the GPUs it serves, else blocked, and why_not says why."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    with FakeTensorMode():
        q = torch.empty(1, 8, 2048, 64, device="cuda", dtype=dtype)
        table = torch.empty(129, 64, device="cuda", dtype=dtype)
        call = fn.validate(q, q, q, table, table, max_relative_position=64, attn_mask=None, is_causal=True,
                           dropout_p=0.0, scale=None, query_offset=0)
        if want == "triton" and (reason := BACKENDS["triton"].unavailable()) is not None:
            pytest.skip(reason)
        assert choose(call).name == want
    arch = f"sm_{10 * capability[0] + capability[1]}"
    if want == "blocked":
        assert why_not(call) == {"triton": [
            f"GPU compute capability {arch} (serves sm_80, sm_86, sm_89, sm_90, sm_100, sm_120)"]}
        with pytest.raises(ValueError, match=f"backend 'triton' cannot serve these inputs: GPU compute capability "
                                             f"{arch}"):
            dispatch.resolve("triton", call)
    else:
        assert why_not(call) == {}
