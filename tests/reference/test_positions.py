"""Relative positions: the clipped, shifted index and the symmetric tables the kernels take, against the reference."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from relattn import reference as ref
from relattn import relative_position_index
from relattn.positions import causal_allowed, clip_and_shift, symmetric_table, table_rows


@given(n=st.integers(0, 12), m=st.integers(0, 12), k=st.integers(0, 14), offset=st.integers(-6, 12))
def test_index_matches_reference(n, m, k, offset):
    idx = relative_position_index(n, m, k, query_offset=offset)
    assert idx.dtype == torch.long and idx.shape == (n, m)
    expected = ref.relative_position_matrix(n, m, k, query_offset=offset) + k
    assert idx.tolist() == expected.tolist()


def test_index_spec_matrix_k4():
    idx = relative_position_index(10, 10, 4)
    assert idx[5].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]  # query 5: offsets -4,-4,-3,...,+4 shifted by 4
    assert idx.diagonal().eq(4).all() and idx[0, 9] == 8 and idx[9, 0] == 0
    # Toeplitz: constant along diagonals.
    assert (idx[1:, 1:] == idx[:-1, :-1]).all()


def test_incremental_offset_places_queries_after_cache():
    full = relative_position_index(7, 7, 3)
    assert torch.equal(relative_position_index(2, 7, 3, query_offset=5), full[5:])


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    (dict(query_len=3, key_len=3, max_relative_position=-1), ValueError, "max_relative_position must be >= 0"),
    (dict(query_len=3, key_len=3, max_relative_position=1.5), TypeError, "max_relative_position must be an int"),
    (dict(query_len=-2, key_len=3, max_relative_position=1), ValueError, "query_len"),
    (dict(query_len=2, key_len=3, max_relative_position=1, query_offset=0.5), TypeError, "query_offset"),
    (dict(query_len=3, key_len=3, max_relative_position=(1, -2)), ValueError,
     r"max_relative_position's right must be an int >= 0; got -2"),
    (dict(query_len=3, key_len=3, max_relative_position=(1.0, 2)), ValueError,
     r"max_relative_position's left must be an int >= 0; got 1.0"),
    (dict(query_len=3, key_len=3, max_relative_position=(1, 2, 3)), ValueError,
     r"max_relative_position as a pair must be \(left, right\); got \(1, 2, 3\)"),
    (dict(query_len=3, key_len=3, max_relative_position=2, beyond="edge"), ValueError,
     r"beyond must be one of \('clip', 'zero'\); got 'edge'"),
])
def test_index_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        relative_position_index(**kwargs)


@given(n=st.integers(0, 12), m=st.integers(0, 12), left=st.integers(0, 14), right=st.integers(0, 14),
       offset=st.integers(-6, 12), beyond=st.sampled_from(["clip", "zero"]))
def test_window_index_matches_reference(n, m, left, right, offset, beyond):
    """Windows (left, right) and zero beyond them: the reference's index matrix, "no embedding" marked with
    left + right + 1 (one past the last row) in both."""
    idx = relative_position_index(n, m, (left, right), query_offset=offset, beyond=beyond)
    assert idx.dtype == torch.long and idx.shape == (n, m)
    emb = ref.RelativePositionEmbedding((left, right), 1, 1, seed=0, beyond=beyond)
    assert idx.tolist() == emb.index_matrix(n, m, query_offset=offset).tolist()
    assert table_rows((left, right)) == left + right + 1


def test_window_index_by_hand():
    """Wav2Vec2-BERT-like window (3, 1) over 5 positions: offsets j - i clipped to [-3, 1], shifted by 3."""
    assert relative_position_index(5, 5, (3, 1))[4].tolist() == [0, 0, 1, 2, 3]
    assert relative_position_index(5, 5, (3, 1))[0].tolist() == [3, 4, 4, 4, 4]
    assert relative_position_index(5, 5, (3, 1), beyond="zero")[0].tolist() == [3, 4, 5, 5, 5]
    assert relative_position_index(5, 5, (0, 2), beyond="zero")[2].tolist() == [3, 3, 0, 1, 2]
    assert torch.equal(relative_position_index(6, 6, 2), relative_position_index(6, 6, (2, 2)))


@pytest.mark.parametrize("window", [(5, 1), (0, 3), (3, 0), (2, 7), (4, 4), (0, 0)])
@pytest.mark.parametrize("beyond", ["clip", "zero"])
@pytest.mark.parametrize("lead", [(), (3,)], ids=["shared", "per-head"])
def test_symmetric_table_gives_each_offset_its_row(window, beyond, lead):
    """The symmetric table the kernels take, read at ``clip_and_shift(r, K)``, is the reference's embedding of
    offset r (the edge row beyond the window, or zero) for every offset, and its gradient reaches the table."""
    left, right = window
    table = torch.randn(*lead, left + right + 1, 2, dtype=torch.float64, requires_grad=True)
    sym, kk = symmetric_table(table, window, beyond)
    assert sym.shape == (*lead, 2 * kk + 1, 2) and kk >= max(left, right)
    for h in range(lead[0] if lead else 1):
        t = table[h] if lead else table
        emb = ref.RelativePositionEmbedding.from_tables(t.detach().numpy(), t.detach().numpy(), window, beyond=beyond)
        for r in range(-kk - 3, kk + 4):
            row = (sym[h] if lead else sym)[clip_and_shift(torch.tensor(r), kk)]
            np.testing.assert_array_equal(row.detach().numpy(), emb.get_key_embedding(r), err_msg=f"offset {r}")
    (grad,) = torch.autograd.grad(sym.sum(), table)
    assert grad.shape == table.shape and (grad >= 1).all()  # every row of the table is read at least once


def test_symmetric_table_keeps_none_and_a_symmetric_clipped_table():
    table = torch.randn(5, 3)
    assert symmetric_table(None, (2, 1), "zero") == (None, 3)
    same, kk = symmetric_table(table, (2, 2), "clip")
    assert same is table and kk == 2


def test_causal_allowed_is_the_past_and_present_of_each_query():
    """Query i sits at position i + query_offset and sees keys j <= i + query_offset."""
    assert causal_allowed(3, 3, 0, "cpu").tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert causal_allowed(2, 4, 2, "cpu").tolist() == [[True, True, True, False], [True, True, True, True]]
    assert not causal_allowed(2, 3, -1, "cpu")[0].any()  # the first query sits before every key
