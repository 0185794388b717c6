"""Bad input gets a clear error naming the argument and what was received."""

import pytest
import torch

from helpers import assert_close, reference_output
from relattn import BACKENDS, relative_attention


def base(**over):
    t = dict(q=torch.randn(2, 3, 5, 4), k=torch.randn(2, 3, 6, 4), v=torch.randn(2, 3, 6, 7),
             rel_k=torch.randn(5, 4), rel_v=torch.randn(5, 7))
    t.update(over)
    return t


CASES = [
    (dict(q=torch.randn(4)), ValueError, r"q must be \(\.\.\., L, D\), at least 2-D; got 1 dims \(4\)"),
    (dict(q=torch.randn(3, 5, 4)), ValueError, r"k must be \(\.\.\., H, M, D\) = \(3, M, 4\) to match q \(3, 5, 4\); "
                                               r"got \(2, 3, 6, 4\)"),
    (dict(k=torch.randn(2, 3, 6, 5)), ValueError, r"k must be \(B, H, M, D\) = \(2, 3, M, 4\).*got \(2, 3, 6, 5\)"),
    (dict(k=torch.randn(2, 2, 6, 4)), ValueError, r"k must be .*got \(2, 2, 6, 4\)"),
    (dict(v=torch.randn(2, 3, 5, 7)), ValueError, r"v must be \(B, H, M, Dv\) = \(2, 3, 6, Dv\).*got \(2, 3, 5, 7\)"),
    (dict(rel_k=torch.randn(7, 4)), ValueError, r"rel_k must be \(5, 4\) or \(3, 5, 4\).*got \(7, 4\)"),
    (dict(rel_k=torch.randn(5, 3)), ValueError, r"rel_k must be \(5, 4\).*got \(5, 3\)"),
    (dict(rel_k=torch.randn(2, 5, 4)), ValueError, r"rel_k .*H=3.*got \(2, 5, 4\)"),
    (dict(rel_v=torch.randn(5, 4)), ValueError, r"rel_v must be \(5, 7\).*got \(5, 4\)"),
    (dict(rel_v=torch.randn(1, 1, 5, 7)), ValueError, r"rel_v must be .*got 4 dims"),
    (dict(k=torch.randn(2, 3, 6, 4, dtype=torch.float64)), TypeError, r"k has dtype torch.float64 but q has dtype"),
    (dict(rel_v=torch.randn(5, 7, dtype=torch.float16)), TypeError, r"rel_v has dtype torch.float16"),
    (dict(v=torch.randn(2, 3, 6, 7, device="meta")), ValueError, r"v is on meta but q is on cpu"),
    (dict(q=torch.ones(2, 3, 5, 4, dtype=torch.long)), TypeError, r"q must be floating point"),
    (dict(q=[1, 2]), TypeError, r"q must be a Tensor, got list"),
]


@pytest.mark.parametrize(("over", "exc", "match"), CASES)
def test_bad_tensors(over, exc, match):
    t = base(**over)
    with pytest.raises(exc, match=match):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2)


KW_CASES = [
    (dict(max_relative_position=-1), ValueError, r"max_relative_position must be >= 0, got -1"),
    (dict(max_relative_position=2.0), TypeError, r"max_relative_position must be an int"),
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.int32)), TypeError, r"attn_mask must be bool .*got torch.int32"),
    (dict(attn_mask=torch.ones(6, 6, dtype=torch.bool)), ValueError,
     r"attn_mask of shape \(6, 6\) does not broadcast to \(B, H, N, M\) = \(2, 3, 5, 6\)"),
    (dict(attn_mask=torch.ones(2, 2, 5, 6)), ValueError, r"attn_mask of shape \(2, 2, 5, 6\) does not broadcast"),
    (dict(attn_mask=torch.ones(1, 2, 3, 5, 6)), ValueError, r"attn_mask of shape \(1, 2, 3, 5, 6\)"),
    (dict(attn_mask=[[True]]), TypeError, r"attn_mask must be a Tensor"),
    (dict(backend="fast"), ValueError, r"backend must be one of 'auto', 'dense'.*got 'fast'"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
    (dict(is_causal=1), TypeError, r"is_causal must be a bool"),
    (dict(query_offset=1.0), TypeError, r"query_offset must be an int"),
    (dict(scale="x"), TypeError, r"scale must be a float"),
    # windows (left, right) and what lies beyond them
    (dict(max_relative_position=(1, -1)), ValueError, r"max_relative_position's right must be an int >= 0; got -1"),
    (dict(max_relative_position=(True, 3)), ValueError, r"max_relative_position's left must be an int >= 0; got True"),
    (dict(max_relative_position=(2,)), ValueError,
     r"max_relative_position as a pair must be \(left, right\); got \(2,\)"),
    (dict(max_relative_position=[1, 2, 1]), ValueError, r"max_relative_position as a pair must be \(left, right\)"),
    (dict(max_relative_position="2"), TypeError, r"max_relative_position must be an int, got str"),
    (dict(beyond="edge"), ValueError, r"beyond must be one of \('clip', 'zero'\); got 'edge'"),
    (dict(beyond=None), ValueError, r"beyond must be one of \('clip', 'zero'\); got None"),
    # the tables have 5 rows: right for K = 2 and for (3, 1), wrong for (2, 1) and (4, 1)
    (dict(max_relative_position=(2, 1)), ValueError,
     r"rel_k must be \(4, 4\) or \(3, 4, 4\) for H=3, 4 table rows, head dim 4; got \(5, 4\)"),
    (dict(max_relative_position=(4, 1), beyond="zero"), ValueError, r"rel_k must be \(6, 4\) .*got \(5, 4\)"),
    # Transformer-XL's biases: (H, D), one row per query head, q's dtype and device
    (dict(content_bias=torch.randn(4)), ValueError, r"content_bias must be \(H, D\) = \(3, 4\), one row per query "
                                                    r"head; got \(4\)"),
    (dict(position_bias=torch.randn(1, 4)), ValueError, r"position_bias must be \(H, D\) = \(3, 4\).*got \(1, 4\)"),
    (dict(position_bias=torch.randn(3, 4, dtype=torch.float64)), TypeError, r"position_bias has dtype torch.float64"),
    (dict(content_bias=[0.0] * 4), TypeError, r"content_bias must be a Tensor or None, got list"),
]


@pytest.mark.parametrize(("kw", "exc", "match"), KW_CASES)
def test_bad_arguments(kw, exc, match):
    t = base()
    kw = {"max_relative_position": 2, **kw}
    with pytest.raises(exc, match=match):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], **kw)


def test_table_rows_follow_the_window():
    """Tables of left + right + 1 rows: a (3, 1) window takes the 5-row tables of K = 2; a wrong value table is
    named as such."""
    t = base()
    out = relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=(3, 1))
    assert out.shape == (2, 3, 5, 7)
    with pytest.raises(ValueError, match=r"rel_v must be \(4, 7\) or \(3, 4, 7\) .* 4 table rows.*got \(5, 7\)"):
        relative_attention(t["q"], t["k"], t["v"], torch.randn(4, 4), t["rel_v"], max_relative_position=(0, 3))


def test_mask_of_other_float_dtype_is_cast_not_refused():
    """A float64 mask on float32 inputs is cast and applied: the reference's output with that mask, not the
    unmasked one (the mask forbids a key in every row and adds to the others)."""
    t = base()
    mask = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask[:, 2] = float("-inf")
    out = relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2, attn_mask=mask)
    assert out.dtype == torch.float32
    want = reference_output(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2, attn_mask=mask)
    assert_close(out, want, torch.float32, "masked")
    unmasked = relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2)
    assert (out - unmasked).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_keys_of_another_batch_are_refused_on_every_backend(backend):
    """k and v of batch 1 against q of batch 2 are refused before any backend could broadcast them."""
    t = base(k=torch.randn(1, 3, 6, 4), v=torch.randn(1, 3, 6, 7))
    with pytest.raises(ValueError, match=r"k must be \(B, H, M, D\) = \(2, 3, M, 4\) .*got \(1, 3, 6, 4\)"):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2, backend=backend)
    t = base(v=torch.randn(1, 3, 6, 7))
    with pytest.raises(ValueError, match=r"v must be \(B, H, M, Dv\) = \(2, 3, 6, Dv\) .*got \(1, 3, 6, 7\)"):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2, backend=backend)


def test_meta_tensors_pass_validation():
    """Inputs on the meta device (shape inference, models built without memory) are validated like any other:
    "dense" computes the (B, H, N, Dv) shape, and a backend that does not serve the device refuses it by name."""
    t = {name: x.to("meta") for name, x in base().items()}
    out = relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2, backend="dense")
    assert out.device.type == "meta" and out.shape == (2, 3, 5, 7)
    with pytest.raises(ValueError, match=r"backend 'native' cannot serve these inputs: device meta \(serves cpu\)"):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2, backend="native")


def test_position_bias_without_a_key_table_is_refused_naming_it():
    """Without rel_k the position bias would have no effect: an error naming it, not a silent no-op."""
    t = base()
    with pytest.raises(ValueError, match=r"position_bias .* rel_k is None: it would have no effect"):
        relative_attention(t["q"], t["k"], t["v"], None, t["rel_v"], max_relative_position=2,
                           position_bias=torch.randn(3, 4))


def test_a_backend_without_position_queries_refuses_the_biases_by_name(monkeypatch):
    """Every built-in backend takes q_pos; one declaring no position queries is refused the biases by name, at
    construction (refusals) and at the call."""
    from relattn.backends import BACKENDS, Backend, Serves, refusals

    assert all(b.serves.position_query for b in BACKENDS.values())
    monkeypatch.setitem(BACKENDS, "without", Backend("without", lambda c: c.q, Serves(), "declares no q_pos"))
    t = base()
    assert any("q_pos" in r for r in refusals("without", position_query=True))
    with pytest.raises(ValueError, match=r"backend 'without' cannot serve these inputs: .*a separate position "
                                         r"query q_pos \(content/position biases"):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2,
                           content_bias=torch.randn(3, 4), backend="without")
