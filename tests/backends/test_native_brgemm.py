"""The native kernel's GEMMs through torch's brgemm (oneDNN's micro-kernel, AMX tiles where the CPU has them) on
keys and values packed once per call (``native.uses_brgemm``, the ``brgemm`` setting): against the float64 oracle
within the policy (bfloat16: twice plain PyTorch's error) and against the same call through MKL's 16-bit GEMMs
(within a rounding of the output), outputs and gradients, where features meet: packed blocks cut by odd key counts and
tails, grouped heads with causal and a mask, value heads of 48 and 80 columns (blocks of 64, 48, 16), the
position-to-content term and the scalar bias, decoding offsets, dropout, packed sequences; and the calls it does not
take (odd head dims, value heads not a multiple of 16, too few queries) give the same results by MKL's GEMMs.

Skipped where torch's brgemm does not take bfloat16 on this CPU (no AVX-512 BF16/AMX, or an older torch)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, attention_ref, max_error, oracle_grads, tol, unavailable_here
from relattn import functional as fn
from relattn.backends import native

UNAVAILABLE = unavailable_here("native")


def _brgemm_runs() -> bool:
    return UNAVAILABLE is None and native.brgemm_here(torch.bfloat16)


needs_brgemm = pytest.mark.skipif(not _brgemm_runs(), reason="torch's brgemm takes no bfloat16 on this CPU")

BF16 = torch.bfloat16
# (b, h, hkv, n, m, d, dv, K, causal, query_offset, extra)
_CASES = {
    "odd-keys-and-tails": (1, 2, 2, 150, 601, 32, 32, 40, False, 0, None),
    "grouped-causal-mask": (2, 4, 2, 130, 130, 16, 48, 8, True, 0, "mask"),
    "rel_q-bias-dv80": (1, 2, 2, 100, 77, 64, 80, 30, False, 0, "rel_q"),
    "decode-offset": (1, 4, 4, 70, 201, 32, 32, 16, True, 131, None),
}


def _inputs(case, seed=0, dtype=BF16):
    b, h, hkv, n, m, d, dv, kk, causal, off, extra = _CASES[case]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    inputs = [rand(b, h, n, d), rand(b, hkv, m, d), rand(b, hkv, m, dv), rand(h, 2 * kk + 1, d, scale=0.5),
              rand(2 * kk + 1, dv, scale=0.5)]
    kw = dict(max_relative_position=kk, is_causal=causal, query_offset=off, enable_gqa=hkv != h)
    if extra == "mask":
        kw["attn_mask"] = torch.randn(b, 1, n, m, generator=g, dtype=torch.float64).to(dtype)
    if extra == "rel_q":
        kw["rel_q"], kw["rel_bias"] = rand(h, 2 * kk + 1, d, scale=0.5), rand(h, 2 * kk + 1)
    return inputs, kw


def _run(inputs, go, brgemm, **kw):
    present = inputs + [kw[name] for name in ("rel_q", "rel_bias") if name in kw]
    with native.SETTINGS.override(gemm16=True, brgemm=brgemm):  # the backward's too
        out = fn.relative_attention(*inputs, backend="native", **kw)
        return out, torch.autograd.grad(out, present, go)


def _paths_bound(b, dtype, roundings):
    """How far the two GEMM paths may differ: a few roundings of a 16-bit result at its magnitude; float32's sums in
    another order, the policy's float32 bound."""
    peak = b.detach().abs().max().item()
    return roundings * torch.finfo(dtype).eps * peak if dtype != torch.float32 else tol(dtype) * (1 + peak)


def _one_rounding(a, b, what):
    """a and b (the two GEMM paths) within one rounding of the dtype at their magnitude (float32: the policy)."""
    bound = _paths_bound(b, a.dtype, 2)
    assert max_error(a, b) <= bound, f"{what}: brgemm and MKL differ by {max_error(a, b):.3g} > {bound:.3g}"


@needs_brgemm
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("case", list(_CASES))
def test_brgemm_against_the_oracle_and_mkl(case, dtype):
    """bfloat16 (five GEMMs on packed keys and values) and float32 (P v and dS k on v and k as they lie)."""
    inputs, kw = _inputs(case, dtype=dtype)
    go = torch.randn(inputs[0].shape[:-1] + inputs[2].shape[-1:], generator=torch.Generator().manual_seed(9))
    assert native.uses_brgemm(dtype) or not native.choice().brgemm
    got_out, got = _run(inputs, go.to(dtype), True, **kw)
    mkl_out, mkl = _run(inputs, go.to(dtype), False, **kw)
    kw64 = {n: (t.detach().double() if isinstance(t, torch.Tensor) and n == "attn_mask" else t) for n, t in kw.items()}
    want_out, want = oracle_grads(inputs, go.double(), **{n: t for n, t in kw64.items() if n != "enable_gqa"})
    plain_out = attention_ref(*inputs, upcast=False, **{n: t for n, t in kw.items() if n != "enable_gqa"})
    present = inputs + [kw[name] for name in ("rel_q", "rel_bias") if name in kw]
    plain = torch.autograd.grad(plain_out, present, go.to(dtype))
    assert_close(got_out, want_out, dtype, f"{case} out", yardstick=plain_out)
    _one_rounding(got_out, mkl_out, f"{case} out")
    names = ["dq", "dk", "dv", "drel_k", "drel_v", "drel_q", "drel_bias"]
    for name, a, b, w, p in zip(names, got, mkl, want, plain, strict=False):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert_close(a, w, dtype, f"{case} {name}", yardstick=p)
        # the backward (its brgemm GEMMs, or all through MKL) reads each path's out: as close as those
        assert max_error(a, b) <= _paths_bound(w, dtype, 4), f"{case} {name}"


@needs_brgemm
def test_brgemm_dropout_draws_the_same_mask():
    """Dropout (the kernel's own mask, drawn per block) with grouped heads and causal: the same seed drops the same
    weights through either GEMM path."""
    inputs, kw = _inputs("grouped-causal-mask", seed=3)
    go = torch.randn(2, 4, 130, 48, generator=torch.Generator().manual_seed(4)).to(BF16)
    outs = []
    for brgemm in (True, False):
        torch.manual_seed(11)
        outs.append(_run(inputs, go, brgemm, dropout_p=0.3, **kw))
    (a_out, a), (b_out, b) = outs
    _one_rounding(a_out, b_out, "dropout out")
    for name, x, y in zip(["dq", "dk", "dv", "drel_k", "drel_v"], a, b, strict=True):
        assert max_error(x, y) <= 4 * torch.finfo(BF16).eps * y.abs().max().item(), name
    torch.manual_seed(12)
    other, _ = _run(inputs, go, True, dropout_p=0.3, **kw)
    assert max_error(other, a_out) > 0.1  # another seed, another mask: the test sees the mask


@needs_brgemm
def test_brgemm_packed_sequences():
    """A packed call of ragged sequences (each packed from its own first key; odd ones end in a zero row), causal,
    outputs and gradients: each sequence as its own dense call through MKL."""
    g = torch.Generator().manual_seed(5)
    lens = [70, 131, 64, 99]
    t, h, d, kk = sum(lens), 2, 32, 12
    q, k, v = (torch.randn(t, h, d, generator=g).to(BF16).requires_grad_() for _ in range(3))
    rel_k, rel_v = (torch.randn(2 * kk + 1, d, generator=g).mul(0.5).to(BF16).requires_grad_() for _ in range(2))
    go = torch.randn(t, h, d, generator=g).to(BF16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    kw = dict(max_relative_position=kk, is_causal=True, backend="native")
    inputs = [q, k, v, rel_k, rel_v]
    with native.SETTINGS.override(gemm16=True, brgemm=True):
        got = fn.relative_attention_varlen(q, k, v, rel_k, rel_v, cu_seqlens_q=cu, **kw)
        got_grads = torch.autograd.grad(got, inputs, go)
    with native.SETTINGS.override(gemm16=True, brgemm=False):
        outs = [fn.relative_attention(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), rel_k, rel_v, **kw)[0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        want = torch.cat([o.transpose(0, 1) for o in outs])
        want_grads = torch.autograd.grad(want, inputs, go)
    _one_rounding(got, want, "out")
    for name, a, b in zip(["dq", "dk", "dv", "drel_k", "drel_v"], got_grads, want_grads, strict=True):
        assert max_error(a, b) <= 4 * torch.finfo(BF16).eps * b.abs().max().item(), name


@needs_brgemm
@pytest.mark.parametrize("shape", [(100, 31, 32), (100, 32, 40), (40, 32, 32)], ids=["odd-d", "dv40", "few-queries"])
def test_calls_brgemm_does_not_take_run_on_mkl(shape):
    """Head dims that are not multiples of 16 (odd, 40), fewer than 64 queries per key/value head: the kernel keeps
    MKL's GEMMs for them, with the same results (bitwise) whichever the setting."""
    n, d, dv = shape
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 1, n, d, generator=g).to(BF16) for _ in range(2))
    v = torch.randn(1, 1, n, dv, generator=g).to(BF16)
    outs = []
    for brgemm in (True, False):
        with torch.no_grad(), native.SETTINGS.override(gemm16=True, brgemm=brgemm):
            outs.append(fn.relative_attention(q, k, v, max_relative_position=8, backend="native"))
    assert torch.equal(*outs)
