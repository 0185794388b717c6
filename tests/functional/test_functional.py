"""relative_attention's own semantics, through "auto": tolerances from the dtype, the relative terms, shared and
per-head tables, causal as a mask, autograd against finite differences of the specification, dropout, and the
weights. What every backend must pass is in test_conformance.py."""

import math

import pytest
import torch

import relattn
from helpers import assert_close, random_inputs, random_mask, reference_output
from relattn import reference as ref
from relattn import relative_attention


def test_float32_tolerance_from_dtype():
    q, k, v, rk, rv = random_inputs(2, 3, 33, 33, 16, 16, 5, dtype=torch.float32, seed=3)
    out = relative_attention(q, k, v, rk, rv, max_relative_position=5)
    expected = reference_output(q, k, v, rk, rv, max_relative_position=5).float()
    assert out.dtype == torch.float32
    assert_close(out, expected, torch.float32)


def test_relative_terms_matter():
    """A wrong implementation that ignores either table would fail here."""
    q, k, v, rk, rv = random_inputs(1, 2, 9, 9, 4, 4, 2, seed=5)
    full = relative_attention(q, k, v, rk, rv, max_relative_position=2)
    for rk_, rv_ in ((None, rv), (rk, None), (None, None)):
        assert (relative_attention(q, k, v, rk_, rv_, max_relative_position=2) - full).abs().max() > 1e-3
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert_close(relative_attention(q, k, v, max_relative_position=2), plain, torch.float64)


def test_shared_table_equals_per_head_copies():
    q, k, v, rk, rv = random_inputs(2, 3, 10, 10, 4, 4, 3, seed=8)
    shared = relative_attention(q, k, v, rk, rv, max_relative_position=3)
    per_head = relative_attention(q, k, v, rk.expand(3, -1, -1), rv.expand(3, -1, -1), max_relative_position=3)
    assert_close(shared, per_head, torch.float64)


def test_is_causal_equals_explicit_mask():
    q, k, v, rk, rv = random_inputs(2, 2, 8, 8, 4, 4, 3, seed=4)
    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    assert_close(relative_attention(q, k, v, rk, rv, max_relative_position=3, is_causal=True),
                 relative_attention(q, k, v, rk, rv, max_relative_position=3, attn_mask=tril), torch.float64)


def test_gradients_match_reference_by_finite_differences_of_the_reference():
    """Autograd of the op against central differences of the numpy reference (independent of torch autograd)."""
    q, k, v, rk, rv = random_inputs(1, 1, 4, 4, 2, 2, 1, seed=9, requires_grad=True)
    g = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    (relative_attention(q, k, v, rk, rv, max_relative_position=1) * g).sum().backward()
    eps = 1e-6
    for t in (q, k, v, rk, rv):
        flat = t.detach().clone().view(-1)
        for idx in range(0, flat.numel(), 3):
            args = [x.detach().clone() for x in (q, k, v, rk, rv)]
            which = [a is t for a in (q, k, v, rk, rv)].index(True)
            vals = []
            for sgn in (1, -1):
                args[which].view(-1)[idx] = flat[idx] + sgn * eps
                vals.append((reference_output(*args, max_relative_position=1) * g).sum().item())
            # central differences with step 1e-6: truncation ~1e-12, rounding ~1e-10
            assert math.isclose(t.grad.view(-1)[idx].item(), (vals[0] - vals[1]) / (2 * eps), abs_tol=1e-6)


def test_dropout_hits_both_value_terms_with_one_mask():
    """With v = 1 and a^V = 0, or v = 0 and a^V = 1, the output is the row sum of the dropped weights:
    the same seed must give the same result, so the relative-value sum sees the same dropped weights."""
    q, k, _, rk, _ = random_inputs(2, 2, 16, 16, 4, 4, 3, seed=10)
    ones, zeros = torch.ones(2, 2, 16, 4, dtype=torch.float64), torch.zeros(2, 2, 16, 4, dtype=torch.float64)
    tab1, tab0 = torch.ones(7, 4, dtype=torch.float64), torch.zeros(7, 4, dtype=torch.float64)
    outs = []
    for v, rv in ((ones, tab0), (zeros, tab1)):
        torch.manual_seed(123)
        outs.append(relative_attention(q, k, v, rk, rv, max_relative_position=3, dropout_p=0.5))
    assert_close(outs[0], outs[1], torch.float64)
    assert (outs[0] - 1).abs().max() > 0.1  # dropout did something: rows no longer sum to one


def test_dropout_is_unbiased():
    q, k, v, rk, rv = random_inputs(1, 1, 6, 6, 4, 4, 2, seed=11)
    clean = relative_attention(q, k, v, rk, rv, max_relative_position=2)
    torch.manual_seed(0)
    qq, kk, vv = (x.expand(4000, -1, -1, -1) for x in (q, k, v))
    noisy = relative_attention(qq, kk, vv, rk, rv, max_relative_position=2, dropout_p=0.3)
    mean, sem = noisy.mean(0), noisy.std(0) / math.sqrt(4000)
    assert ((mean - clean[0]).abs() <= 5 * sem + 1e-9).all()
    assert noisy.std(0).min() > 0


def test_relative_attention_weights_rows_sum_to_one():
    q, k, _, rk, _ = random_inputs(2, 2, 7, 9, 4, 4, 3, seed=12)
    w = relattn.relative_attention_weights(q, k, rk, max_relative_position=3, is_causal=True, query_offset=2)
    assert w.shape == (2, 2, 7, 9)
    assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64), torch.float64)
    assert w[..., 0, 3:].abs().max() == 0  # query 0 sits at position 2: keys 3.. are in its future


@pytest.mark.parametrize("tables", ["shared", "per_head", "none"])
def test_relative_attention_weights_match_reference(tables):
    """The weights returned are the reference's softmax of (q.k + q.a^K) * scale + mask, rel_k included."""
    q, k, v, rk, _ = random_inputs(2, 3, 7, 9, 4, 2, 3, tables=tables, seed=17)
    mask = random_mask("float", (2, 1, 7, 9), 17)
    for kw in (dict(), dict(attn_mask=mask, is_causal=True, query_offset=2, scale=0.37)):
        w = relattn.relative_attention_weights(q, k, rk, max_relative_position=3, **kw)
        m = kw.pop("attn_mask", None)
        _, want = ref.relative_attention(
            q.numpy(), k.numpy(), v.numpy(), None if rk is None else rk.numpy(), None, max_relative_position=3,
            attn_mask=None if m is None else m.numpy(), return_weights=True, **kw)
        assert_close(w, torch.from_numpy(want), torch.float64)
    if rk is not None:  # guard: the table matters for these inputs
        without = relattn.relative_attention_weights(q, k, None, max_relative_position=3)
        assert (relattn.relative_attention_weights(q, k, rk, max_relative_position=3) - without).abs().max() > 1e-2
