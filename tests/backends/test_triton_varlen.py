"""The "triton" backend's packed (varlen) calls against the per-sequence calls: outputs and every gradient.

A packed call (``cu_seqlens``) is one launch of each kernel for the whole batch, its programs over (query tile of
the longest sequence, sequence * head); sequence ``s`` must equal the dense call on its own rows with
``query_offset = m_s - n_s``. The oracle is that, per sequence, concatenated: ``helpers.attention_ref`` in float64
(and, in one test, the dense "triton" kernels themselves). The lengths are all different, so a program reading
another sequence's rows or offset shows: 0 queries (with keys), 0 keys (with queries), 1 and 1, more keys than
queries (a cache: queries at the end of their keys), more queries than keys (causal rows before every key), and
sequences longer than the window and than one tile. Under ``TRITON_INTERPRET=1`` (tests/conftest.py, without
CUDA) on CPU tensors; tiles small as in test_triton.py.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from helpers import assert_close, attention_ref, per_sequence
from relattn import functional as fn
from relattn.backends import triton as tb
from relattn.backends._common import AttentionCall

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NO_TRITON = tb.unavailable()
pytestmark = pytest.mark.skipif(NO_TRITON is not None, reason=f"triton backend: {NO_TRITON}")
DEVICE = "cuda" if CUDA else "cpu"
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")

# (n_s, m_s) per sequence: distinct, with the edge cases of the module docstring
LENGTHS = [(5, 5), (0, 3), (1, 1), (40, 40), (7, 4), (3, 0), (2, 19)]


@pytest.fixture(autouse=True)
def triton_tiles(small_tiles, kernel_settings):
    small_tiles(triton=((16, 32), (32, 16)))  # forward, backward (queries, keys): sequences cross several tiles
    kernel_settings(tb, band_split=2)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _case(lengths, *, h=4, hkv=2, d=8, dv=4, kk=3, per_head=True, rel_q=True, rel_v=True, seed=0):
    """Packed leaves (T, H, D), (T_k, Hkv, D|Dv), the tables, a position bias (H, D), in float64."""
    g = torch.Generator().manual_seed(seed)
    t, tk = sum(n for n, _ in lengths), sum(m for _, m in lengths)
    hr = h if per_head else 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(q=rnd(t, h, d), k=rnd(tk, hkv, d), v=rnd(tk, hkv, dv), rel_k=rnd(hr, 2 * kk + 1, d),
                rel_v=rnd(hr, 2 * kk + 1, dv) if rel_v else None, rel_q=rnd(hr, 2 * kk + 1, d) if rel_q else None,
                position_bias=rnd(h, d), go=rnd(t, h, dv))


def _leaves(x: dict, names, dtype, device):
    return {n: None if x[n] is None else x[n].to(device, dtype).requires_grad_() for n in names}


NAMES = ("q", "k", "v", "rel_k", "rel_v", "rel_q", "position_bias")


def _varlen(x, lengths, kk, *, causal, dtype, device=DEVICE, position_query=True, scale=0.4, query_offset=0):
    """The packed call through ``tb.VARLEN_OPS.run`` (an AttentionCall as the op builds it): out (T, H, Dv) and the
    gradients of NAMES' leaves (None for those not given)."""
    y = _leaves(x, NAMES, dtype, device)
    q, k, v = (y[n].transpose(0, 1).unsqueeze(0) for n in ("q", "k", "v"))  # (1, H, T, D) strided views
    q_pos = (y["q"] + y["position_bias"]).transpose(0, 1).unsqueeze(0) if position_query else None
    cq, ck = _cu([n for n, _ in lengths]).to(device), _cu([m for _, m in lengths]).to(device)
    call = AttentionCall(q=q, k=k, v=v, rel_k=y["rel_k"], rel_v=y["rel_v"], max_relative_position=kk, mask=None,
                         is_causal=causal, dropout_p=0.0, scale=scale, query_offset=query_offset, rel_q=y["rel_q"],
                         q_pos=q_pos, cu_seqlens_q=cq, cu_seqlens_k=ck,
                         max_seqlen_q=max(n for n, _ in lengths), max_seqlen_k=max(m for _, m in lengths))
    out = tb.BACKEND.packed.run(call)[0].transpose(0, 1)
    leaves = [t for n, t in y.items() if t is not None and (position_query or n != "position_bias")]
    got = iter(torch.autograd.grad(out, leaves, x["go"].to(device, dtype), allow_unused=True))
    return out, {n: next(got) if t is not None and (position_query or n != "position_bias") else None
                 for n, t in y.items()}


def _per_sequence(x, lengths, kk, *, causal, dtype=torch.float64, upcast=True, position_query=True, scale=0.4,
                  backend=None, device="cpu", query_offset=0):
    """The same through one dense call per sequence (``attention_ref``, or the op with ``backend``), concatenated."""
    y = _leaves(x, NAMES, dtype, device)
    if backend is None:
        one = functools.partial(attention_ref, upcast=upcast)
    else:
        one = functools.partial(fn.relative_attention, backend=backend, enable_gqa=True)
    out = per_sequence(one, _cu([n for n, _ in lengths]), _cu([m for _, m in lengths]), y["q"], y["k"], y["v"],
                       rel_k=y["rel_k"], rel_v=y["rel_v"], max_relative_position=kk, rel_q=y["rel_q"],
                       is_causal=causal, scale=scale, query_offset=query_offset,
                       position_bias=y["position_bias"] if position_query else None)
    leaves = [t for n, t in y.items() if t is not None and (position_query or n != "position_bias")]
    got = iter(torch.autograd.grad(out, leaves, x["go"].to(device, dtype), allow_unused=True))
    return out, {n: (next(got) if t is not None and (position_query or n != "position_bias") else None)
                 for n, t in y.items()}


def _compare(got, want, dtype, yardstick=None):
    out, grads = got
    assert_close(out, want[0], dtype, "out", yardstick=None if yardstick is None else yardstick[0])
    for name, g in grads.items():
        w = want[1][name]
        if w is None:
            assert g is None, name
            continue
        w = torch.zeros_like(w) if w is None else w
        g = torch.zeros_like(w) if g is None else g
        assert_close(g, w, dtype, f"d{name}", yardstick=None if yardstick is None else yardstick[1][name])
        assert torch.count_nonzero(w) == 0 or torch.count_nonzero(g) > 0, name


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_matches_per_sequence_oracle_float64(causal):
    """GQA 4 / 2 heads, per-head tables incl. rel_q, position queries (q_pos), D != Dv, K = 3 < the longest
    sequences, every length case; float64 against the float64 oracle."""
    x = _case(LENGTHS, seed=1)
    _compare(_varlen(x, LENGTHS, 3, causal=causal, dtype=torch.float64),
             _per_sequence(x, LENGTHS, 3, causal=causal), torch.float64)


@needs_kernels
def test_rows_without_keys_give_zeros_and_lse_minus_inf():
    x = _case(LENGTHS, rel_q=False, seed=2)
    q, k, v = (x[n].transpose(0, 1).unsqueeze(0).to(DEVICE) for n in ("q", "k", "v"))
    cq = _cu([n for n, _ in LENGTHS]).to(DEVICE)
    ck = _cu([m for _, m in LENGTHS]).to(DEVICE, torch.int64)  # int64 as well as int32
    out, lse = tb.varlen_forward(q, k, v, x["rel_k"].to(DEVICE), x["rel_v"].to(DEVICE), None, None, cq, ck,
                                 max_relative_position=3, is_causal=True, scale=0.4, query_offset=0, max_seqlen_q=40,
                                 max_seqlen_k=40)
    assert out.shape == (1, 4, q.shape[2], 4) and lse.shape == (1, 4, q.shape[2])
    assert out.transpose(1, 2).is_contiguous()  # laid out as the packed (T, H, Dv)
    starts = cq.tolist()
    empty = list(range(starts[5], starts[6]))  # (3, 0): no key at all
    empty += list(range(starts[4], starts[4] + 3))  # (7, 4) causal: rows 0..2 sit before every key
    assert torch.all(out[:, :, empty] == 0) and torch.all(lse[:, :, empty] == float("-inf"))
    seen = torch.ones(q.shape[2], dtype=torch.bool)
    seen[empty] = False
    assert torch.isfinite(lse[:, :, seen]).all()


@needs_kernels
@pytest.mark.slow
def test_packed_matches_dense_triton_per_sequence_float32_with_query_offset():
    """Against the dense kernels themselves, sequence by sequence (float32), with shared tables, no q_pos and an
    extra query offset added to every sequence's."""
    lengths = [(9, 12), (0, 2), (33, 33), (1, 6)]
    x = _case(lengths, per_head=False, h=2, hkv=1, d=8, dv=8, kk=2, seed=3)
    kw = dict(causal=True, position_query=False, query_offset=2)
    got = _varlen(x, lengths, 2, dtype=torch.float32, **kw)
    _compare(got, _per_sequence(x, lengths, 2, **kw), torch.float32)
    dense = _per_sequence(x, lengths, 2, dtype=torch.float32, backend="triton", device=DEVICE, **kw)
    _compare(got, (dense[0].double(), {n: None if g is None else g.double() for n, g in dense[1].items()}),
             torch.float32)


@needs_kernels
@pytest.mark.slow
def test_packed_bfloat16_within_2x_of_plain_pytorch():
    lengths = [(20, 20), (1, 9), (0, 1), (6, 3)]
    x = _case(lengths, seed=4)
    want = _per_sequence(x, lengths, 3, causal=False)
    yard = _per_sequence(x, lengths, 3, causal=False, dtype=torch.bfloat16, upcast=False)
    rounded = {n: None if t is None else t.to(torch.bfloat16).double() for n, t in x.items()}
    want = _per_sequence(rounded, lengths, 3, causal=False)
    _compare(_varlen(x, lengths, 3, causal=False, dtype=torch.bfloat16), want, torch.bfloat16, yardstick=yard)


@needs_kernels
@pytest.mark.slow
def test_keys_split_across_programs(kernel_settings):
    """Decoding-like packed calls (one query per sequence against its cache) with the keys split three ways and
    merged by their log-sum-exp: a sequence shorter than a split sees nothing in the later ones."""
    kernel_settings(tb, kv_splits=3)
    lengths = [(1, 70), (1, 5), (2, 33)]
    x = _case(lengths, rel_v=True, seed=5)
    _compare(_varlen(x, lengths, 3, causal=True, dtype=torch.float64),
             _per_sequence(x, lengths, 3, causal=True), torch.float64)


def test_backend_declares_and_dispatches_packed_calls():
    assert tb.serves().varlen and tb.VARLEN_OPS.varlen and tb.VARLEN_OPS.name == "triton_varlen"
    assert tb.BACKEND.run == tb.OPS.run and tb.BACKEND.packed is tb.VARLEN_OPS


@needs_kernels
@pytest.mark.slow
def test_opcheck_of_the_packed_ops():
    """relattn::triton_varlen_fwd / _bwd: schema, fake kernels, autograd registration (torch.library.opcheck)."""
    lengths = [(3, 5), (0, 2), (6, 6)]
    x = _case(lengths, h=2, hkv=1, d=4, dv=4, kk=2, seed=6)
    q, k, v = (x[n].float().transpose(0, 1).unsqueeze(0).to(DEVICE).requires_grad_() for n in ("q", "k", "v"))
    rk, rq = (x[n].float().to(DEVICE).requires_grad_() for n in ("rel_k", "rel_q"))
    cq, ck = _cu([n for n, _ in lengths]).to(DEVICE), _cu([m for _, m in lengths]).to(DEVICE)
    torch.library.opcheck(tb.VARLEN_OPS.fwd_op.default,
                          (q, k, v, rk, None, None, torch.full((), 5, dtype=torch.int64, device=DEVICE), cq, ck, 2,
                           True, 0.25, 0.5, 0, 6, 6), dict(rel_q=rq))  # with dropout: the seed's mask every time
