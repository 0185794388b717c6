"""The native kernel's packed (varlen) calls: ``native.VARLEN_OPS`` (through the backend's ``run`` on an
:class:`AttentionCall` with ``cu_seqlens``) against each sequence's own dense call, outputs and gradients.

Sequence ``s`` of a packed call is the dense call on its own rows with ``query_offset = m_s - n_s`` (its queries at
the end of its keys). The oracles, per sequence, concatenated: the float64 PyTorch oracle (``attention_ref``), and the
dense native kernel itself (``native.BACKEND.run`` on the sequence alone: the same tiles and blocks, so float64 agrees
to rounding). The lengths are all different, and include 0 (queries, keys or both), 1, lengths longer than the window
and n_s != m_s, so that a sequence read at another's offset, or a position counted across a boundary, gives another
answer.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, attention_ref, per_sequence, unavailable_here
from relattn.backends import AttentionCall, native

UNAVAILABLE = unavailable_here("native")
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

# (n_s, m_s) per sequence
LENGTHS = {
    "self": [(5, 5), (0, 0), (1, 1), (13, 13), (8, 8)],
    "cross": [(3, 9), (0, 4), (6, 2), (1, 1), (11, 11), (4, 0), (2, 14)],
}
# (H, Hkv, tables of (rel_k, rel_v, rel_q): "h" per head, "1" shared, "-" none, q_pos, causal)
FEATURES = {
    "gqa-per-head-k-shared-q-qpos-causal": (4, 2, "hh1", True, True),
    "mqa-shared-tables": (3, 1, "11-", False, False),
    "per-head-v-q-qpos": (2, 2, "1hh", True, False),
    "gqa-keys-only-causal": (4, 2, "h--", False, True),
    "no-tables-causal": (2, 1, "---", False, True),
    "gqa-per-head-tables-causal": (4, 2, "hhh", False, True),
}
NAMES = ("q", "q_pos", "k", "v", "rel_k", "rel_v", "rel_q")
D, DV, K = 4, 3, 3


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lengths, features, *, dtype=torch.float64, seed=0):
    """Packed leaves (q (T,H,D), q_pos or None, k (T_k,Hkv,D), v (T_k,Hkv,Dv), rel_k, rel_v, rel_q), cu_seqlens_q,
    cu_seqlens_k, the output gradient (T,H,Dv) and the call's keywords."""
    h, hkv, tables, with_q_pos, causal = features
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).mul(0.7).to(dtype).requires_grad_()

    t, tk = sum(n for n, _ in lengths), sum(m for _, m in lengths)
    q, q_pos, k, v = rnd(t, h, D), rnd(t, h, D), rnd(tk, hkv, D), rnd(tk, hkv, DV)
    rk, rv, rq = (None if c == "-" else rnd(1 if c == "1" else h, 2 * K + 1, width)
                  for c, width in zip(tables, (D, DV, D), strict=True))
    if not with_q_pos or rk is None:
        q_pos = None
    go = torch.randn(t, h, DV, generator=g, dtype=torch.float64).to(dtype)
    cu_q, cu_k = _cu([n for n, _ in lengths]), _cu([m for _, m in lengths])
    return (q, q_pos, k, v, rk, rv, rq), cu_q, cu_k, go, dict(causal=causal, scale=D ** -0.5)


def _four(t):
    """A packed (T, H, D) tensor as the backend sees it: the (1, H, T, D) view."""
    return None if t is None else t.transpose(0, 1).unsqueeze(0)


def _varlen(inputs, cu_q, cu_k, go, kw):
    """The packed call through native's packed ops: the output (T, H, Dv) and the gradients of the inputs given."""
    q, q_pos, k, v, rk, rv, rq = inputs
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    call = AttentionCall(_four(q), _four(k), _four(v), rk, rv, K, None, kw["causal"], 0.0, kw["scale"], 0, rel_q=rq,
                         q_pos=_four(q_pos), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=int(lengths_q.max()), max_seqlen_k=int(lengths_k.max()))
    out = native.BACKEND.packed.run(call)[0].transpose(0, 1)
    present = [t for t in inputs if t is not None]
    return out, torch.autograd.grad(out, present, go)


def _per_sequence(inputs, cu_q, cu_k, go, kw, one):
    """``one`` on each sequence's rows (:func:`helpers.per_sequence`): the output (T, H, Dv) and the gradients of
    the inputs given (zeros for an input the output does not depend on)."""
    q, q_pos, k, v, rk, rv, rq = inputs
    out = per_sequence(one, cu_q, cu_k, q, k, v, query_rows=dict(q_pos=q_pos), rel_k=rk, rel_v=rv, rel_q=rq,
                       is_causal=kw["causal"], scale=kw["scale"])
    present = [t for t in inputs if t is not None]
    got = torch.autograd.grad(out, present, go.to(out.dtype), allow_unused=True)
    return out, [torch.zeros_like(t) if g is None else g for t, g in zip(present, got, strict=True)]


def _dense_native(q, k, v, *, q_pos, rel_k, rel_v, rel_q, is_causal, scale, query_offset):
    """native's dense call on one sequence's (contiguous) rows."""
    q, k, v, q_pos = (None if t is None else t.contiguous() for t in (q, k, v, q_pos))
    call = AttentionCall(q, k, v, rel_k, rel_v, K, None, is_causal, 0.0, scale, query_offset, rel_q=rel_q, q_pos=q_pos)
    return native.BACKEND.run(call)


def _oracle(upcast):
    """attention_ref on one sequence (float64 with ``upcast``, else in the inputs' dtype: plain PyTorch). q_pos
    must be None (the oracle reads q for the key table)."""

    def one(q, k, v, *, q_pos, rel_k, rel_v, rel_q, is_causal, scale, query_offset):
        assert q_pos is None
        return attention_ref(q, k, v, rel_k, rel_v, rel_q=rel_q, max_relative_position=K, is_causal=is_causal,
                             scale=scale, query_offset=query_offset, upcast=upcast)

    return one


def _names(inputs):
    return [n for n, t in zip(NAMES, inputs, strict=True) if t is not None]


@pytest.mark.parametrize(("tiles", "splits"), [((3, 5), 0), ((2, 3), 2), ((0, 512), 0)],
                         ids=["tiles-3x5", "tiles-2x3-key-segments", "default-tiles"])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_packed_call_is_each_sequence_s_dense_call(small_tiles, tiles, splits, features, lengths):
    """float64: the packed call's output and every gradient (q, q_pos, k, v, each table) equal each sequence's dense
    native call (query_offset m_s - n_s) concatenated, table gradients summed; and, without q_pos, the float64
    oracle's; with GQA, per-head and shared tables, rel_q, causal, lengths 0 and 1 and longer than K, n_s != m_s;
    at tiles that cross sequences' ends (several tiles and key blocks per sequence) and with key segments."""
    small_tiles(native=tiles, native_splits=splits)
    inputs, cu_q, cu_k, go, kw = _packed(LENGTHS[lengths], FEATURES[features])
    got_out, got = _varlen(inputs, cu_q, cu_k, go, kw)
    want_out, want = _per_sequence(inputs, cu_q, cu_k, go, kw, _dense_native)
    assert_close(got_out, want_out, torch.float64, "out vs dense native")
    for name, a, w in zip(_names(inputs), got, want, strict=True):
        assert_close(a, w, torch.float64, f"d{name} vs dense native")
    if inputs[1] is None:
        true_out, true = _per_sequence(inputs, cu_q, cu_k, go, kw, _oracle(upcast=True))
        assert_close(got_out, true_out, torch.float64, "out vs oracle")
        for name, a, w in zip(_names(inputs), got, true, strict=True):
            assert_close(a, w, torch.float64, f"d{name} vs oracle")
    again = _varlen(inputs, cu_q, cu_k, go, kw)[1]
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "the backward is not deterministic"


def test_rows_without_keys_give_zeros_and_lse_minus_inf(small_tiles):
    """A sequence with no key (m_s = 0), and causal rows before their sequence's first key (n_s > m_s): zeros and
    lse -inf, as in the dense kernel; the other rows finite."""
    lengths = [(3, 0), (5, 2), (2, 2)]
    inputs, cu_q, cu_k, go, kw = _packed(lengths, FEATURES["gqa-per-head-k-shared-q-qpos-causal"])
    q, q_pos, k, v, rk, rv, rq = (None if t is None else t.detach() for t in inputs)
    out, lse = native.varlen_forward(_four(q), _four(k), _four(v), rk, rv, None, None, cu_q, cu_k,
                                     max_relative_position=K, is_causal=True, scale=kw["scale"], query_offset=0,
                                     max_seqlen_q=5, max_seqlen_k=2, rel_q=rq, q_pos=_four(q_pos))
    empty = torch.tensor([True] * 3 + [True] * 3 + [False] * 2 + [False] * 2)  # seq 1: rows 0-2 precede key 0
    assert torch.equal(out[0, :, empty], torch.zeros_like(out[0, :, empty]))
    assert (lse[0, :, empty] == float("-inf")).all() and torch.isfinite(lse[0, :, ~empty]).all()


@pytest.mark.parametrize("gemm16", [True, False], ids=["16-bit-gemms", "float32-copies"])
@pytest.mark.parametrize(("lengths", "features"), [("self", "mqa-shared-tables"),
                                                   ("cross", "gqa-per-head-tables-causal")])
def test_bfloat16_within_the_dtype_policy(kernel_settings, gemm16, lengths, features):
    """bfloat16 (16-bit GEMMs, and float32 copies): the output and gradients within twice plain PyTorch's error
    (attention_ref in bfloat16 per sequence) against the float64 oracle, at tiles smaller than the sequences."""
    kernel_settings(native, tile_q=4, tile_k=6, gemm16=gemm16)
    inputs, cu_q, cu_k, go, kw = _packed(LENGTHS[lengths], FEATURES[features], seed=3)
    lo = [None if t is None else t.detach().to(torch.bfloat16).requires_grad_() for t in inputs]
    got_out, got = _varlen(lo, cu_q, cu_k, go.to(torch.bfloat16), kw)
    true_out, true = _per_sequence(inputs, cu_q, cu_k, go, kw, _oracle(upcast=True))
    plain_out, plain = _per_sequence(lo, cu_q, cu_k, go.to(torch.bfloat16), kw, _oracle(upcast=False))
    assert got_out.dtype == torch.bfloat16
    assert_close(got_out, true_out, torch.bfloat16, "out", yardstick=plain_out)
    for name, a, w, p in zip(_names(inputs), got, true, plain, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert_close(a, w, torch.bfloat16, f"d{name}", yardstick=p)


@pytest.mark.parametrize(("cu_q", "cu_k", "match"), [
    ([1, 3, 6], [0, 3, 6], "cu_seqlens_q must start at 0"),
    ([0, 4, 3, 6], [0, 2, 4, 6], "cu_seqlens_q must never decrease"),
    ([0, 3, 5], [0, 3, 6], "cu_seqlens_q must start at 0 and end at 6"),
    ([0, 3, 6], [0, 6], "as many entries"),
    ([0.0, 3.0, 6.0], [0, 3, 6], "cu_seqlens_q must be a 1-D int32 or int64"),
], ids=["not-from-0", "decreasing", "not-ending-at-T", "counts-differ", "float"])
def test_bad_cu_seqlens_are_refused_by_name(cu_q, cu_k, match):
    """The kernel checks the cumulative lengths it indexes by (the op checks them first, with its own messages)."""
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    cq = torch.tensor(cu_q) if isinstance(cu_q[0], float) else torch.tensor(cu_q, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=match):
        native.varlen_forward(q, k, v, None, None, None, None, cq, torch.tensor(cu_k), max_relative_position=2,
                              is_causal=False, scale=0.5, query_offset=0, max_seqlen_q=6, max_seqlen_k=6)


def test_the_custom_ops_pass_opcheck_and_equal_the_eager_path(small_tiles):
    """relattn::native_varlen_fwd and _bwd (what torch.compile and torch.export see): torch.library.opcheck (schema,
    fake kernels, autograd registration, AOT dispatch) on the arguments a packed call passes, and the forward op's
    result is the eager one (with dropout: the seed tensor and dropout_p in the schema)."""
    inputs, cu_q, cu_k, go, kw = _packed(LENGTHS["cross"], FEATURES["per-head-v-q-qpos"])
    q, q_pos, k, v, rk, rv, rq = inputs
    lead = (_four(q), _four(k), _four(v), rk, rv, None, torch.tensor([3, 0, 0, 0]), cu_q, cu_k)
    scalars = (K, False, 0.2, kw["scale"], 0, 11, 14)
    fwd, bwd = native.VARLEN_OPS.fwd_op.default, native.VARLEN_OPS.bwd_op.default
    out, lse = fwd(*lead, *scalars, rq, _four(q_pos))
    want_out, want_lse = native.varlen_forward(*(None if t is None else t.detach() for t in lead),
                                               max_relative_position=K, is_causal=False, dropout_p=0.2,
                                               scale=kw["scale"],
                                               query_offset=0, max_seqlen_q=11, max_seqlen_k=14, rel_q=rq.detach(),
                                               q_pos=_four(q_pos.detach()))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    torch.library.opcheck(fwd, (*lead, *scalars, rq, _four(q_pos)))
    detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in lead)
    torch.library.opcheck(bwd, (_four(go), *detached, out.detach(), lse.detach(), *scalars, rq.detach(),
                                _four(q_pos.detach())))


@pytest.fixture
def threads():
    """Sets the intra-op threads for the test (restored after it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_runs_of_tasks_per_thread_give_the_one_thread_result(small_tiles, threads):
    """With three threads the tasks are cut into three runs of equal cost (ragged: unequal counts), each adding into
    its own table gradients: the output and gradients equal the one-thread call's to rounding, and the same bits
    from one call to the next."""
    small_tiles(native=(16, 24))
    lengths = [(9, 9), (1, 1), (170, 170), (0, 3), (50, 120), (260, 260), (2, 2)]  # enough work for every thread
    inputs, cu_q, cu_k, go, kw = _packed(lengths, FEATURES["gqa-per-head-k-shared-q-qpos-causal"], seed=5)
    threads(1)
    one_out, one = _varlen(inputs, cu_q, cu_k, go, kw)
    threads(3)
    out, got = _varlen(inputs, cu_q, cu_k, go, kw)
    assert torch.equal(out, one_out)  # the forward's rows do not depend on which thread runs them
    for name, a, w in zip(_names(inputs), got, one, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")
    again = _varlen(inputs, cu_q, cu_k, go, kw)[1]
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "the backward is not deterministic"
