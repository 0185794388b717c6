"""Grouped-query attention and SDPA's leading dims: the weights of ``enable_gqa=True`` are the repeated call's and
bad head counts are refused, inputs of 2, 3 or 5 dims equal the 4-D call on every backend, and the module's
``num_kv_heads`` is the same attention. (Grouped heads on every backend against the oracle, combined with the
other features: ``test_paths.py``.)"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, backend_params, reference_output
from relattn import BACKENDS, KVCache, RelativeMultiheadAttention, relative_attention, relative_attention_weights
from relattn.schemes import Shaw

ALL = backend_params(list(BACKENDS))


def _draw(*shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


def test_gqa_weights_and_errors():
    q, k = _draw(1, 4, 5, 3, seed=0), _draw(1, 2, 6, 3, seed=1)
    got = relative_attention_weights(q, k, None, max_relative_position=1, enable_gqa=True)
    want = relative_attention_weights(q, k.repeat_interleave(2, 1), None, max_relative_position=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    v = _draw(1, 2, 6, 3, seed=2)
    with pytest.raises(ValueError, match=r"k must be .* \(fewer key/value heads than query heads: pass enable_gqa"):
        relative_attention(q, k, v, max_relative_position=1)
    with pytest.raises(ValueError, match=r"with enable_gqa=True, key/value heads dividing H = 4; got \(1, 3, 6, 3\)"):
        relative_attention(q, _draw(1, 3, 6, 3, seed=1), _draw(1, 3, 6, 3, seed=2), max_relative_position=1,
                           enable_gqa=True)
    with pytest.raises(ValueError, match=r"v must be .*got \(1, 4, 6, 3\)"):
        relative_attention(q, k, _draw(1, 4, 6, 3, seed=2), max_relative_position=1, enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        relative_attention(q, k, v, max_relative_position=1, enable_gqa=1)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("lead", [(), (3,), (2, 2, 3)])
def test_leading_dims_equal_the_4d_call(backend, lead):
    """(N, D), (H, N, D) and (B1, B2, H, N, D) inputs, as SDPA takes them, give the 4-D call's output and
    gradients in their own shape; a mask broadcasts against their leading dims."""
    n, m, d, kk = 6, 8, 4, 2
    h = lead[-1] if lead else 1
    q, k, v = _draw(*lead, n, d, seed=0), _draw(*lead, m, d, seed=1), _draw(*lead, m, d, seed=2)
    rel_k, rel_v = _draw(h, 2 * kk + 1, d, seed=3), _draw(2 * kk + 1, d, seed=4)
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
    args = dict(max_relative_position=kk, attn_mask=mask)

    def as4(t):
        return t.reshape(-1, h, *t.shape[-2:])

    got = relative_attention(q, k, v, rel_k, rel_v, backend=backend, **args)
    assert got.shape == (*lead, n, d)
    want = relative_attention(as4(q), as4(k), as4(v), rel_k, rel_v, backend=backend, **args)
    assert_close(got, want.reshape(got.shape), torch.float64, "out")
    go = _draw(*got.shape, seed=5).detach()
    for name, g, w in zip("qkv", torch.autograd.grad(got, (q, k, v), go),
                          torch.autograd.grad(want, (q, k, v), go.reshape(want.shape)), strict=True):
        assert g.shape == (*lead, *g.shape[-2:])
        assert_close(g, w, torch.float64, f"d{name}")
    weights = relative_attention_weights(q, k, rel_k, **args)
    assert weights.shape == (*lead, n, m)


def test_module_num_kv_heads_is_grouped_attention_and_caches_hkv_heads():
    """The module with ``num_kv_heads``: its output is the op's grouped call on its projections (equal to
    repeating them), its cache holds Hkv heads, and cached decoding equals the full causal pass."""
    e, h, hkv = 12, 6, 2
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(e, h, Shaw(3, share_heads=False), num_kv_heads=hkv).double()
    assert mod.k_proj.out_features == mod.v_proj.out_features == hkv * (e // h)
    x = torch.randn(2, 7, e, dtype=torch.float64)
    got, _ = mod(x, is_causal=True)

    def heads(t, n):
        return t.view(2, 7, n, e // h).transpose(1, 2)

    q, k, v = heads(mod.q_proj(x), h), heads(mod.k_proj(x), hkv), heads(mod.v_proj(x), hkv)
    o = reference_output(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), mod.rel_k,
                         mod.rel_v, max_relative_position=3, is_causal=True)
    torch.testing.assert_close(got, mod.out_proj(o.transpose(1, 2).reshape(2, 7, e)), rtol=1e-10, atol=1e-10)
    _, w = mod(x, is_causal=True, need_weights=True, average_attn_weights=False)
    assert w.shape == (2, h, 7, 7)
    cache = KVCache()
    steps = [mod(x[:, i:i + 1], is_causal=True, kv_cache=cache)[0] for i in range(7)]
    assert cache.k.shape == (2, hkv, 7, e // h)
    torch.testing.assert_close(torch.cat(steps, 1), got, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"num_kv_heads \(4\) must divide num_heads \(6\)"):
        RelativeMultiheadAttention(e, h, 3, num_kv_heads=4)
