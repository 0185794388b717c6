"""Bad input gets a clear error naming the argument and what was received."""

import pytest
import torch

from helpers import assert_close, reference_output
from helpers.bad_calls import CASES, KW_CASES, base
from relattn import BACKENDS, relative_attention


@pytest.mark.parametrize(("over", "exc", "match"), CASES)
def test_bad_tensors(over, exc, match):
    t = base(**over)
    with pytest.raises(exc, match=match):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], max_relative_position=2)


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
