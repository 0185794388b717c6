"""relative_attention against the numpy reference, on every registered backend."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import relattn
from helpers import random_inputs, reference_output, require_backend
from relattn import BACKENDS, relative_attention
from relattn import reference as ref

NAMES = ["auto", *BACKENDS]


@pytest.fixture
def served(backend):
    """Skip (with the reason) a backend that is unavailable here as a whole; see helpers.require_backend.

    The tests below feed float64 CPU inputs without dropout or a mask that needs grad, which every available
    backend serves: they call it directly, so a refusal of one input fails the test instead of passing it.
    """
    require_backend(backend)


@st.composite
def cases(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n, m = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    k = draw(st.integers(0, 13))
    tables = draw(st.sampled_from(["shared", "per_head", "keys_only", "values_only", "none"]))
    offset = draw(st.sampled_from([0, m - n, draw(st.integers(-3, 12))]))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    mask_shape = draw(st.sampled_from([(n, m), (1, h, n, m), (b, 1, 1, m), (b, h, n, m), (m,)]))
    return dict(b=b, h=h, n=n, m=m, d=d, dv=dv, k=k, tables=tables, offset=offset, causal=causal,
                mask_kind=mask_kind, mask_shape=mask_shape, seed=draw(st.integers(0, 10**6)))


def make_mask(kind, shape, seed):
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.3
    if kind == "float":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    return None


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", NAMES)
@given(c=cases())
def test_matches_reference_float64(backend, c):
    q, k, v, rk, rv = random_inputs(c["b"], c["h"], c["n"], c["m"], c["d"], c["dv"], c["k"], tables=c["tables"],
                                    seed=c["seed"])
    mask = make_mask(c["mask_kind"], c["mask_shape"], c["seed"])
    kw = dict(max_relative_position=c["k"], attn_mask=mask, is_causal=c["causal"], query_offset=c["offset"])
    out = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    expected = reference_output(q, k, v, rk, rv, **kw)
    assert out.shape == (c["b"], c["h"], c["n"], c["dv"]) and out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize(("n", "m", "k", "offset"), [(1, 1, 0, 0), (7, 7, 3, 0), (97, 97, 8, 0), (7, 7, 40, 0),
                                                     (5, 12, 4, 7), (12, 5, 2, -3)])
def test_awkward_sizes(backend, n, m, k, offset):
    q, key, v, rk, rv = random_inputs(2, 2, n, m, 59 if n == 7 else 8, 5, k, seed=n + k)
    kw = dict(max_relative_position=k, is_causal=offset > 0, query_offset=offset)
    out = relative_attention(q, key, v, rk, rv, backend=backend, **kw)
    torch.testing.assert_close(out, reference_output(q, key, v, rk, rv, **kw), rtol=1e-10, atol=1e-10)


def test_float32_tolerance_from_dtype():
    q, k, v, rk, rv = random_inputs(2, 3, 33, 33, 16, 16, 5, dtype=torch.float32, seed=3)
    out = relative_attention(q, k, v, rk, rv, max_relative_position=5)
    expected = reference_output(q, k, v, rk, rv, max_relative_position=5).float()
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(out, expected, rtol=64 * eps, atol=64 * eps)


def test_relative_terms_matter():
    """A wrong implementation that ignores either table would fail here."""
    q, k, v, rk, rv = random_inputs(1, 2, 9, 9, 4, 4, 2, seed=5)
    full = relative_attention(q, k, v, rk, rv, max_relative_position=2)
    for rk_, rv_ in ((None, rv), (rk, None), (None, None)):
        assert (relative_attention(q, k, v, rk_, rv_, max_relative_position=2) - full).abs().max() > 1e-3
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(relative_attention(q, k, v, max_relative_position=2), plain)


def test_shared_table_equals_per_head_copies():
    q, k, v, rk, rv = random_inputs(2, 3, 10, 10, 4, 4, 3, seed=8)
    shared = relative_attention(q, k, v, rk, rv, max_relative_position=3)
    per_head = relative_attention(q, k, v, rk.expand(3, -1, -1), rv.expand(3, -1, -1), max_relative_position=3)
    torch.testing.assert_close(shared, per_head, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", NAMES)
def test_fully_masked_rows_give_zeros_and_zero_grads(backend):
    q, k, v, rk, rv = random_inputs(1, 2, 6, 6, 4, 4, 2, seed=1, requires_grad=True)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    kw = dict(max_relative_position=2, attn_mask=mask)
    out = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    assert torch.isfinite(out).all()
    assert out[:, :, 2].abs().max() == 0
    out.sum().backward()
    for t in (q, k, v, rk, rv):
        assert torch.isfinite(t.grad).all()
    assert q.grad[:, :, 2].abs().max() == 0
    torch.testing.assert_close(out[:, :, [0, 1, 3, 4, 5]],
                               reference_output(q, k, v, rk, rv, **kw)[:, :, [0, 1, 3, 4, 5]])


def test_causal_with_negative_offset_masks_whole_rows():
    q, k, v, rk, rv = random_inputs(1, 1, 4, 4, 3, 3, 1, seed=2)
    out = relative_attention(q, k, v, rk, rv, max_relative_position=1, is_causal=True, query_offset=-2)
    assert out[0, 0, :2].abs().max() == 0 and out[0, 0, 2:].abs().min() > 0


def test_is_causal_equals_explicit_mask():
    q, k, v, rk, rv = random_inputs(2, 2, 8, 8, 4, 4, 3, seed=4)
    tril = torch.ones(8, 8, dtype=torch.bool).tril()
    torch.testing.assert_close(relative_attention(q, k, v, rk, rv, max_relative_position=3, is_causal=True),
                               relative_attention(q, k, v, rk, rv, max_relative_position=3, attn_mask=tril))


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("tables", ["shared", "per_head"])
def test_gradcheck(backend, tables):
    q, k, v, rk, rv = random_inputs(1, 2, 5, 6, 3, 2, 2, tables=tables, seed=6, requires_grad=True)
    mask = torch.randn(1, 1, 5, 6, dtype=torch.float64)
    kw = dict(max_relative_position=2, attn_mask=mask, is_causal=True, query_offset=1)
    assert torch.autograd.gradcheck(lambda *x: relative_attention(*x, backend=backend, **kw), (q, k, v, rk, rv))


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
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
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
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 7, dtype=torch.float64))
    assert w[..., 0, 3:].abs().max() == 0  # query 0 sits at position 2: keys 3.. are in its future


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_serves_a_mask_that_needs_grad_or_refuses_naming_it(backend):
    """A backend either differentiates the mask as "dense" does or refuses the call with a reason naming it."""
    q, k, v, rk, rv = random_inputs(1, 2, 5, 6, 3, 2, 2, seed=13)
    mask = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    kw = dict(max_relative_position=2, attn_mask=mask, is_causal=True, query_offset=1)
    try:
        out = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    except ValueError as exc:
        assert f"backend {backend!r} cannot serve these inputs: " in str(exc) and "attn_mask" in str(exc)
        return
    torch.testing.assert_close(out, reference_output(q, k, v, rk, rv, **kw), rtol=1e-10, atol=1e-10)
    (grad,) = torch.autograd.grad(out.sum(), mask)
    (want,) = torch.autograd.grad(relative_attention(q, k, v, rk, rv, backend="dense", **kw).sum(), mask)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-10)


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_serves_dropout_or_refuses_naming_it(backend):
    """Either dropout is applied (v = 1, a^V = 0: each output is its row's sum of kept weights / (1 - p), which
    averages 1 but is not 1 everywhere) or the call is refused with a reason naming dropout."""
    q, k, _, rk, _ = random_inputs(4, 2, 16, 16, 4, 4, 3, seed=14)
    v, rv = torch.ones(4, 2, 16, 3, dtype=torch.float64), torch.zeros(7, 3, dtype=torch.float64)
    torch.manual_seed(0)
    try:
        out = relative_attention(q, k, v, rk, rv, max_relative_position=3, dropout_p=0.25, backend=backend)
    except ValueError as exc:
        assert f"backend {backend!r} cannot serve these inputs: " in str(exc) and "dropout" in str(exc)
        return
    assert (out - 1).abs().max() > 0.1
    assert abs(out.mean().item() - 1) < 0.1
    torch.testing.assert_close(out, out[..., :1].expand_as(out))  # one mask for all Dv columns


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("scale", [0.37, 2])
def test_user_scale_matches_reference(backend, scale):
    """A non-default ``scale`` reaches the scores of every backend: against the numpy reference, and against
    the default scale applied to queries multiplied by ``scale * sqrt(D)`` (both score terms are linear in q)."""
    q, k, v, rk, rv = random_inputs(2, 3, 7, 9, 5, 4, 3, tables="per_head", seed=15)
    mask = make_mask("float", (1, 3, 7, 9), 15)
    kw = dict(max_relative_position=3, attn_mask=mask, is_causal=True, query_offset=2)
    out = relative_attention(q, k, v, rk, rv, scale=scale, backend=backend, **kw)
    torch.testing.assert_close(out, reference_output(q, k, v, rk, rv, scale=scale, **kw), rtol=1e-10, atol=1e-10)
    rescaled = relative_attention(q * (scale * math.sqrt(5)), k, v, rk, rv, backend=backend, **kw)
    torch.testing.assert_close(out, rescaled, rtol=1e-10, atol=1e-10)
    default = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    assert (out - default).abs().max() > 1e-2  # the scale changed the answer


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("backend", NAMES)
def test_user_scale_gradients_match_dense(backend):
    """Each backward uses the given scale: gradients against "dense", whose backward is torch autograd."""
    q, k, v, rk, rv = random_inputs(1, 2, 6, 6, 4, 3, 2, seed=16, requires_grad=True)
    kw = dict(max_relative_position=2, is_causal=True, scale=0.37)
    got = torch.autograd.grad(relative_attention(q, k, v, rk, rv, backend=backend, **kw).sum(), (q, k, v, rk, rv))
    want = torch.autograd.grad(relative_attention(q, k, v, rk, rv, backend="dense", **kw).sum(), (q, k, v, rk, rv))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tables", ["shared", "per_head", "none"])
def test_relative_attention_weights_match_reference(tables):
    """The weights returned are the reference's softmax of (q.k + q.a^K) * scale + mask, rel_k included."""
    q, k, v, rk, _ = random_inputs(2, 3, 7, 9, 4, 2, 3, tables=tables, seed=17)
    mask = make_mask("float", (2, 1, 7, 9), 17)
    for kw in (dict(), dict(attn_mask=mask, is_causal=True, query_offset=2, scale=0.37)):
        w = relattn.relative_attention_weights(q, k, rk, max_relative_position=3, **kw)
        m = kw.pop("attn_mask", None)
        _, want = ref.relative_attention(
            q.numpy(), k.numpy(), v.numpy(), None if rk is None else rk.numpy(), None, max_relative_position=3,
            attn_mask=None if m is None else m.numpy(), return_weights=True, **kw)
        torch.testing.assert_close(w, torch.from_numpy(want), rtol=1e-12, atol=1e-12)
    if rk is not None:  # guard: the table matters for these inputs
        without = relattn.relative_attention_weights(q, k, None, max_relative_position=3)
        assert (relattn.relative_attention_weights(q, k, rk, max_relative_position=3) - without).abs().max() > 1e-2
