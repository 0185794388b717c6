"""Packed sequences (:func:`relattn.relative_attention_varlen`): each sequence equals the dense op's call on its own
rows with ``query_offset = m - n`` (outputs and gradients, against the one oracle run sequence by sequence), on
every backend, with lengths 0, 1 and longer than the window, grouped k/v heads, cross-attention lengths (queries at
the end of their keys), the position-to-content table, Transformer-XL's biases, windows, zero beyond them and
LogBuckets; and bad lengths are refused naming the argument.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from helpers import assert_close, attention_ref, per_sequence, unavailable_here
from relattn import BACKENDS, reference, relative_attention_varlen
from relattn.positions import LogBuckets

RUNNABLE = [name for name in ["auto", *BACKENDS] if unavailable_here(name) is None]

pytestmark = pytest.mark.usefixtures("small_tiles", "one_thread")

H, D, DV = 4, 4, 3

# name: (Hkv, query lengths, key lengths (None: the queries'), rel_q, biases, tables, positions, beyond, causal)
CASES = {
    "gqa-self-relq-causal": (2, (5, 0, 1, 9, 3), None, True, False, "shared", 2, "clip", True),
    "gqa-cross-biases-per-head": (2, (2, 0, 1, 4, 3), (6, 3, 0, 4, 1), False, True, "per_head", 2, "clip", True),
    "mqa-self-relq-zero-window": (1, (4, 7, 1, 0), None, True, False, "per_head", (1, 3), "zero", False),
    "mha-cross-relq-buckets": (4, (3, 5, 2), (7, 5, 9), True, True, "shared", LogBuckets(3), "clip", False),
    "mha-self-long-window": (4, (6, 2, 8), None, False, False, "shared", 20, "clip", True),
}


def _rows(positions):
    if isinstance(positions, LogBuckets):
        return positions.rows
    left, right = (positions, positions) if isinstance(positions, int) else positions
    return left + right + 1


def _cu(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


def _case(name, dtype=torch.float64):
    hkv, n, m, rel_q, biases, tables, positions, beyond, causal = CASES[name]
    m = n if m is None else m
    g = torch.Generator().manual_seed(sum(map(ord, name)))

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    rows = _rows(positions)
    lead = () if tables == "shared" else (H,)
    q, k, v = draw(sum(n), H, D), draw(sum(m), hkv, D), draw(sum(m), hkv, DV)
    kw = dict(rel_k=draw(*lead, rows, D), rel_v=draw(*lead, rows, DV), rel_q=draw(*lead, rows, D) if rel_q else None,
              content_bias=draw(H, D) if biases else None, position_bias=draw(H, D) if biases else None)
    op = dict(max_relative_position=positions, beyond=beyond, is_causal=causal)
    go = torch.randn(sum(n), H, DV, generator=g, dtype=torch.float64).to(dtype)
    return (q, k, v), kw, op, (n, m), go


def _oracle(inputs, kw, op, lengths, **ref):
    """The one oracle sequence by sequence (:func:`helpers.per_sequence`), packed back."""
    return per_sequence(attention_ref, _cu(lengths[0]), _cu(lengths[1]), *inputs, **kw, **op, **ref)


def _differentiable(inputs, kw):
    return [*inputs, *(t for t in kw.values() if t is not None)]


def _varlen(inputs, kw, op, lengths, backend):
    n, m = lengths
    cross = dict(cu_seqlens_k=_cu(m), max_seqlen_k=max(m)) if n != m else {}
    return relative_attention_varlen(*inputs, **kw, **op, cu_seqlens_q=_cu(n), max_seqlen_q=max(n), enable_gqa=True,
                                     backend=backend, **cross)


def _params():
    for name in CASES:
        for backend in RUNNABLE:
            slow = backend == "triton" and name != "gqa-cross-biases-per-head"
            yield pytest.param(name, backend, id=f"{name}-{backend}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize(("name", "backend"), list(_params()))
def test_packed_sequences_are_the_dense_calls_on_their_own_rows(name, backend):
    """Outputs and the gradients of q, k, v, every table and bias, against the oracle sequence by sequence."""
    inputs, kw, op, lengths, go = _case(name)
    out = _varlen(inputs, kw, op, lengths, backend)
    want = _oracle(inputs, kw, op, lengths)
    assert out.shape == (sum(lengths[0]), H, DV) and out.is_contiguous()
    assert_close(out, want, torch.float64, f"{backend} out")
    params = _differentiable(inputs, kw)
    got = torch.autograd.grad(out, params, go)
    for i, (a, w) in enumerate(zip(got, torch.autograd.grad(want, params, go), strict=True)):
        assert_close(a, w, torch.float64, f"{backend} grad {i}")


@pytest.mark.parametrize("backend", [b for b in RUNNABLE if b != "triton"])
def test_packed_sequences_in_bfloat16_within_plain_pytorchs_error(backend):
    """16-bit inputs within twice plain PyTorch's own bfloat16 error (the tolerance policy), outputs and gradients."""
    name = "gqa-cross-biases-per-head"
    inputs, kw, op, lengths, go = _case(name, torch.bfloat16)
    out = _varlen(inputs, kw, op, lengths, backend)
    want = _oracle(inputs, kw, op, lengths)
    yardstick = _oracle(inputs, kw, op, lengths, upcast=False)
    assert out.dtype == torch.bfloat16
    assert_close(out, want, torch.bfloat16, f"{backend} out", yardstick=yardstick)
    params = _differentiable(inputs, kw)
    got = torch.autograd.grad(out, params, go)
    wants = torch.autograd.grad(want, params, go.double())
    sticks = torch.autograd.grad(yardstick, params, go)
    for i, (a, w, y) in enumerate(zip(got, wants, sticks, strict=True)):
        assert_close(a, w, torch.bfloat16, f"{backend} grad {i}", yardstick=y)


def test_the_reference_is_the_oracle_sequence_by_sequence():
    """The numpy specification's packed form (``reference.relative_attention_varlen``) is the oracle's."""
    name = "gqa-self-relq-causal"
    inputs, kw, op, lengths, _ = _case(name)
    q, k, v = (t.detach().numpy() for t in inputs)
    tables = {n: None if t is None else t.detach().numpy() for n, t in kw.items()}
    want = reference.relative_attention_varlen(q, k, v, tables["rel_k"], tables["rel_v"], rel_q=tables["rel_q"],
                                               cu_seqlens_q=_cu(lengths[0]).numpy(), **op)
    assert_close(_oracle(inputs, kw, op, lengths), torch.from_numpy(want), torch.float64, "reference")


def test_a_sequence_never_meets_another_sequences_keys():
    """One sequence's output does not change when another sequence's keys and values do, and equals the sequence
    called alone: no key crosses a boundary, and its positions start at its own first row."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    tables = dict(rel_k=torch.randn(5, D, generator=g, dtype=torch.float64),
                  rel_v=torch.randn(5, D, generator=g, dtype=torch.float64))
    cu = torch.tensor([0, 4, 9])
    out = relative_attention_varlen(q, k, v, **tables, cu_seqlens_q=cu, max_relative_position=2)
    k2, v2 = k.clone(), v.clone()
    k2[:4], v2[:4] = 0.0, 7.0
    again = relative_attention_varlen(q, k2, v2, **tables, cu_seqlens_q=cu, max_relative_position=2)
    alone = relative_attention_varlen(q[4:], k[4:], v[4:], **tables, cu_seqlens_q=torch.tensor([0, 5]),
                                      max_relative_position=2)
    assert torch.equal(out[4:], again[4:]) and not torch.allclose(out[:4], again[:4])
    assert_close(out[4:], alone, torch.float64, "alone")


def _bad(**changes):
    q, k, v = (torch.zeros(6, 2, 4) for _ in range(3))
    kw = dict(cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32), max_relative_position=2)
    kw.update(changes)
    return relative_attention_varlen(q, k, v, **kw)


@pytest.mark.parametrize(("changes", "error", "message"), [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 2, 6])), ValueError,
     "cu_seqlens_q must never decrease (cumulative lengths); entry 2 is 2 after 4"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 6])), ValueError, "cu_seqlens_q must start at 0, got 1"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), ValueError, "cu_seqlens_q must end at the number of packed queries"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 6.0])), TypeError, "cu_seqlens_q must be int32 or int64"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 6], device="meta")), ValueError, "cu_seqlens_q is on meta"),
    (dict(cu_seqlens_q=torch.tensor([[0, 2, 6]])), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=[0, 2, 6]), TypeError, "cu_seqlens_q must be a Tensor"),
    (dict(cu_seqlens_k=torch.tensor([0, 1, 5, 6])), ValueError, "as many sequences; got 2 and 3"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 7])), ValueError, "cu_seqlens_k must end at the number of packed keys"),
    (dict(max_seqlen_q=3), ValueError, "max_seqlen_q = 3 but sequence 1 has 4 queries"),
    (dict(max_seqlen_k=1.5), TypeError, "max_seqlen_k must be an int or None"),
])
def test_bad_lengths_are_refused_naming_the_argument(changes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _bad(**changes)


def test_packed_tensors_must_be_three_dimensional():
    with pytest.raises(ValueError, match=r"q must be packed \(T, H, D\), 3-D; got 4 dims"):
        relative_attention_varlen(torch.zeros(1, 6, 2, 4), torch.zeros(6, 2, 4), torch.zeros(6, 2, 4),
                                  cu_seqlens_q=torch.tensor([0, 6]), max_relative_position=2)
    with pytest.raises(ValueError, match="cu_seqlens_k is None .* k has 5 rows and q 6"):
        relative_attention_varlen(torch.zeros(6, 2, 4), torch.zeros(5, 2, 4), torch.zeros(5, 2, 4),
                                  cu_seqlens_q=torch.tensor([0, 6]), max_relative_position=2)


def test_a_kernels_dense_ops_refuse_a_packed_call():
    """A packed call handed to a kernel's dense ops (which would read it as one long sequence) is a ValueError, and
    its packed ops refuse a dense call: only the backend's packed ops run packed calls."""
    from relattn.backends import AttentionCall, blocked

    x = torch.zeros(1, 2, 6, 4, dtype=torch.float64)
    cu = torch.tensor([0, 2, 6])
    packed = AttentionCall(x, x, x, None, None, 1, None, False, 0.0, 1.0, 0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                           max_seqlen_q=4, max_seqlen_k=4)
    with pytest.raises(ValueError, match="relattn::blocked takes no packed calls"):
        blocked.OPS.run(packed, seed=torch.zeros((), dtype=torch.int64))
    native = BACKENDS["native"]
    with pytest.raises(ValueError, match="relattn::native takes no packed calls"):
        native.run(packed)
    with pytest.raises(ValueError, match="relattn::native_varlen takes only packed calls"):
        native.packed.run(dataclasses.replace(packed, cu_seqlens_q=None, cu_seqlens_k=None))
