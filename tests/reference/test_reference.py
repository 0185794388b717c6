"""The numpy reference: loop forms are the ground truth, vectorised forms must agree, the spec's numbers reproduce."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import SPEC_WEIGHTS
from relattn import reference as ref

# Verbatim from the spec's clipping demonstration (Out[7]): (position, raw offset, clipped offset), query 5, k = 4.
SPEC_CLIPPING = [(0, -5, -4), (1, -4, -4), (2, -3, -3), (3, -2, -2), (4, -1, -1), (5, 0, 0), (6, 1, 1), (7, 2, 2),
                 (8, 3, 3), (9, 4, 4)]


def test_clip_matches_spec_table():
    for j, raw, clipped in SPEC_CLIPPING:
        assert j - 5 == raw
        assert ref.clip_relative_position(j, 5, 4) == clipped


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_clip_rejects_bad_k(bad):
    with pytest.raises((ValueError, TypeError), match="max_relative_position"):
        ref.clip_relative_position(3, 1, bad)


def test_embedding_index_is_clip_then_shift():
    emb = ref.RelativePositionEmbedding(3, 4, 5, seed=0)
    assert emb.a_K.shape == (7, 4) and emb.a_V.shape == (7, 5)
    assert [emb.index(r) for r in (-10, -3, -1, 0, 2, 3, 99)] == [0, 0, 2, 3, 5, 6, 6]
    np.testing.assert_array_equal(emb.get_key_embedding(-8), emb.a_K[0])
    np.testing.assert_array_equal(emb.get_value_embedding(1), emb.a_V[4])


def test_spec_example_reproduces_printed_weights_exactly():
    x = np.random.RandomState(42).randn(6, 8)
    layer = ref.RelativeSelfAttention(8, 4, 4, max_distance=3, seed=123)
    out, weights = layer.forward(x)
    assert out.shape == (6, 4) and weights.shape == (6, 6)
    assert str(np.round(weights, 3)) == SPEC_WEIGHTS
    np.testing.assert_allclose(weights.sum(1), 1.0, rtol=0, atol=1e-12)


def test_seeding_does_not_touch_global_rng():
    np.random.seed(7)
    expected = np.random.rand(3)
    np.random.seed(7)
    ref.RelativeSelfAttention(8, 4, 4, max_distance=3, seed=123)
    ref.RelativeSelfAttention(8, 4, 4, max_distance=3)  # unseeded: a fresh generator, not the global one
    np.testing.assert_array_equal(np.random.rand(3), expected)


def test_seed_is_equivalent_to_spec_global_seeding():
    """The spec calls np.random.seed(seed) then draws; our local RandomState(seed) must draw the same."""
    state = np.random.get_state()
    try:
        np.random.seed(123)
        spec_wq = np.random.randn(8, 4) * np.sqrt(2.0 / 12)
        np.random.seed(123)
        spec_ak = np.random.randn(7, 4) * np.sqrt(2.0 / 11)
    finally:
        np.random.set_state(state)
    layer = ref.RelativeSelfAttention(8, 4, 4, max_distance=3, seed=123)
    np.testing.assert_array_equal(layer.W_q, spec_wq)
    np.testing.assert_array_equal(layer.rel_embed.a_K, spec_ak)


@given(n=st.integers(1, 9), m=st.integers(1, 9), k=st.integers(0, 10), offset=st.integers(-4, 8),
       seed=st.integers(0, 2**31 - 1))
def test_vectorised_equals_loops(n, m, k, offset, seed):
    rng = np.random.default_rng(seed)
    _assert_vectorised_equals_loops(ref.RelativePositionEmbedding(k, 5, 3, rng=rng), n, m, offset, rng)


def _assert_vectorised_equals_loops(emb, n, m, offset, rng):
    """The vectorised scores and outputs of ``emb`` (d_k = 5, d_v = 3) equal the loop forms on random inputs."""
    q, keys, v = rng.normal(size=(n, 5)), rng.normal(size=(m, 5)), rng.normal(size=(m, 3))
    loop = ref.relative_attention_scores(q, keys, emb, query_offset=offset)
    vec = ref.relative_attention_scores_vectorized(q, keys, emb, query_offset=offset)
    np.testing.assert_allclose(vec, loop, rtol=1e-12, atol=1e-12)
    w = ref.softmax(loop)
    np.testing.assert_allclose(ref.relative_attention_output_vectorized(w, v, emb, query_offset=offset),
                               ref.relative_attention_output(w, v, emb, query_offset=offset), rtol=1e-12, atol=1e-12)


def test_scores_use_the_key_table_per_offset():
    """A table that is zero except the row of offset +1 adds q_i . a only where j = i + 1."""
    emb = ref.RelativePositionEmbedding(2, 3, 3, seed=0)
    emb.a_K[:] = 0
    emb.a_K[3] = [1.0, 2.0, 3.0]  # row K + 1 = 3 is offset +1
    q = np.ones((4, 3))
    s = ref.relative_attention_scores(q, np.zeros((4, 3)), emb, scale=1.0)
    np.testing.assert_array_equal(s, np.eye(4, k=1) * 6.0)


def test_softmax_fully_masked_row_is_zero():
    s = np.array([[0.0, 1.0], [-np.inf, -np.inf]])
    w = ref.softmax(s)
    np.testing.assert_allclose(w[0], np.exp([0, 1]) / np.exp([0, 1]).sum())
    np.testing.assert_array_equal(w[1], [0.0, 0.0])


# ----------------------------------------------------------------------------------------- the variants


@given(n=st.integers(1, 9), m=st.integers(1, 9), left=st.integers(0, 10), right=st.integers(0, 10),
       offset=st.integers(-4, 8), beyond=st.sampled_from(["clip", "zero"]), seed=st.integers(0, 2**31 - 1))
def test_vectorised_equals_loops_for_windows_and_zero_beyond(n, m, left, right, offset, beyond, seed):
    rng = np.random.default_rng(seed)
    emb = ref.RelativePositionEmbedding((left, right), 5, 3, rng=rng, beyond=beyond)
    assert emb.a_K.shape == (left + right + 1, 5) and emb.a_V.shape == (left + right + 1, 3)
    _assert_vectorised_equals_loops(emb, n, m, offset, rng)


def test_window_index_clips_to_left_and_right_then_shifts_by_left():
    emb = ref.RelativePositionEmbedding((3, 1), 2, 2, seed=0)
    assert emb.a_K.shape == (5, 2)
    assert [emb.index(r) for r in (-9, -3, -2, 0, 1, 2, 9)] == [0, 0, 1, 3, 4, 4, 4]
    zero = ref.RelativePositionEmbedding.from_tables(emb.a_K, emb.a_V, (3, 1), beyond="zero")
    assert [zero.index(r) for r in (-9, -4, -3, 0, 1, 2, 9)] == [None, None, 0, 3, 4, None, None]
    np.testing.assert_array_equal(zero.get_key_embedding(-4), [0.0, 0.0])
    np.testing.assert_array_equal(zero.get_value_embedding(1), emb.a_V[4])
    # index_matrix marks "no embedding" with one past the last row
    np.testing.assert_array_equal(zero.index_matrix(2, 6), [[3, 4, 5, 5, 5, 5], [2, 3, 4, 5, 5, 5]])
    np.testing.assert_array_equal(emb.index_matrix(2, 6, query_offset=4), [[0, 0, 1, 2, 3, 4], [0, 0, 0, 1, 2, 3]])


def test_an_int_is_the_symmetric_window():
    a = ref.RelativePositionEmbedding(3, 4, 5, seed=11)
    b = ref.RelativePositionEmbedding((3, 3), 4, 5, seed=11)
    np.testing.assert_array_equal(a.a_K, b.a_K)
    assert a.max_distance == 3 and [a.index(r) for r in range(-5, 6)] == [b.index(r) for r in range(-5, 6)]
    with pytest.raises(ValueError, match=r"the window \(2, 1\) is not symmetric"):
        _ = ref.RelativePositionEmbedding((2, 1), 4, 5, seed=0).max_distance


def test_zero_beyond_scores_by_hand():
    """Window (1, 0), zero beyond: a key table of ones adds q_i . 1 only at offsets -1 and 0."""
    emb = ref.RelativePositionEmbedding.from_tables(np.ones((2, 3)), np.zeros((2, 3)), (1, 0), beyond="zero")
    q = np.ones((4, 3))
    s = ref.relative_attention_scores(q, np.zeros((4, 3)), emb, scale=1.0)
    np.testing.assert_array_equal(s, (np.eye(4) + np.eye(4, k=-1)) * 3.0)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    (dict(max_distance=(1, -1)), ValueError, "max_relative_position must be >= 0, got -1"),
    (dict(max_distance=(1, 2.0)), TypeError, "max_relative_position must be an int, got float"),
    (dict(max_distance=2, beyond="edge"), ValueError, "beyond must be 'clip' or 'zero', got 'edge'"),
])
def test_embedding_rejects_bad_windows_and_beyond(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ref.RelativePositionEmbedding(d_k=2, d_v=2, seed=0, **kwargs)


def test_batched_reference_with_no_keys_gives_zeros():
    """M = 0: every row has nothing to attend to, so the output is zeros (as for a fully masked row)."""
    q, v = np.ones((1, 2, 3, 4)), np.ones((1, 2, 0, 5))
    out = ref.relative_attention(q, np.ones((1, 2, 0, 4)), v, np.ones((5, 4)), np.ones((5, 5)),
                                 max_relative_position=2)
    np.testing.assert_array_equal(out, np.zeros((1, 2, 3, 5)))
    np.testing.assert_array_equal(ref.softmax(np.zeros((3, 0))), np.zeros((3, 0)))
