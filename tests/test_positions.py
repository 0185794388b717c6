import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from relattn import reference as ref
from relattn import relative_position_index


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
])
def test_index_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        relative_position_index(**kwargs)
