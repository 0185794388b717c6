"""A KVCache in cross-attention holds the encoder memory once: cached decoding equals the uncached pass, and a
cache is never handed the other kind of keys silently."""

from __future__ import annotations

import pytest
import torch

from relattn import KVCache, RelativeMultiheadAttention

E, H = 8, 2


def _module(**kw):
    torch.manual_seed(0)
    return RelativeMultiheadAttention(E, H, 3, **kw).double()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_cached_cross_attention_decoding_equals_the_uncached_pass(static, batch_first):
    mod = _module(batch_first=batch_first, kdim=6, vdim=5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, E, generator=g, dtype=torch.float64)
    mem_k, mem_v = torch.randn(2, 9, 6, generator=g, dtype=torch.float64), torch.randn(2, 9, 5, generator=g,
                                                                                        dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 7:] = True
    if not batch_first:
        x, mem_k, mem_v = x.transpose(0, 1), mem_k.transpose(0, 1), mem_v.transpose(0, 1)
    want, _ = mod(x, mem_k, mem_v, key_padding_mask=pad, is_causal=False)
    cache = KVCache(max_len=16) if static else KVCache()
    steps = []
    with torch.no_grad() if static else torch.enable_grad():
        for a, b in ((0, 1), (1, 2), (2, 5), (5, 6)):
            xs = x[:, a:b] if batch_first else x[a:b]
            steps.append(mod(xs, mem_k, mem_v, key_padding_mask=pad, kv_cache=cache)[0])
            assert len(cache) == 9 and cache.position == b and cache.kind == "cross"
    got = torch.cat(steps, 1 if batch_first else 0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_cross_attention_cache_projects_the_memory_once_and_reorders():
    mod = _module()
    g = torch.Generator().manual_seed(2)
    x, mem = torch.randn(3, 4, E, generator=g, dtype=torch.float64), torch.randn(3, 5, E, generator=g,
                                                                                 dtype=torch.float64)
    calls = []
    mod.k_proj.register_forward_hook(lambda *a: calls.append(1))
    cache = KVCache()
    mod(x[:, :2], mem, mem, kv_cache=cache)
    mod(x[:, 2:3], mem, mem, kv_cache=cache)
    assert len(calls) == 1  # the memory was projected once
    index = torch.tensor([2, 0, 0])
    cache.reorder(index)
    got = mod(x[index, 3:4], mem[index], mem[index], kv_cache=cache)[0]  # a reordered memory is the same memory
    want = mod(x[index], mem[index], mem[index])[0][:, 3:4]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(calls) == 2  # only the uncached pass projected again


def test_a_cache_refuses_the_other_kind_and_another_memory():
    mod = _module()
    g = torch.Generator().manual_seed(3)
    x, mem = torch.randn(1, 3, E, generator=g, dtype=torch.float64), torch.randn(1, 5, E, generator=g,
                                                                                 dtype=torch.float64)
    own = KVCache()
    mod(x[:, :1], kv_cache=own)
    with pytest.raises(ValueError, match="kv_cache holds self-attention keys .* cannot take different keys than"):
        mod(x[:, 1:2], mem, mem, kv_cache=own)
    assert len(own) == 1 and own.kind == "self"  # refused: unchanged
    cross = KVCache()
    mod(x[:, :1], mem, mem, kv_cache=cross)
    with pytest.raises(ValueError, match="kv_cache holds a cross-attention memory"):
        mod(x[:, 1:2], kv_cache=cross)
    with pytest.raises(ValueError, match=r"another cross-attention memory \(key \(1, 5, 8\)\); got key \(1, 5, 8\)"):
        mod(x[:, 1:2], mem + 1, mem + 1, kv_cache=cross)
    # a slice of the memory it holds (the same storage, the same first element) is another memory, not stale keys
    with pytest.raises(ValueError, match=r"another cross-attention memory \(key \(1, 5, 8\)\); got key \(1, 3, 8\)"):
        mod(x[:, 1:2], mem[:, :3], mem[:, :3], kv_cache=cross)
    assert cross.k.shape[2] == 5 and cross.position == 1  # refused: unchanged
    cross.reset()
    assert len(cross) == 0 and cross.kind is None and cross.k is None and cross.position == 0
    got = mod(x[:, :1], mem + 1, mem + 1, kv_cache=cross)[0]  # after reset: a new memory
    torch.testing.assert_close(got, mod(x[:, :1], mem + 1, mem + 1)[0], rtol=1e-12, atol=1e-12)


def test_reset_starts_a_new_self_attention_sequence():
    mod = _module()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    for static in (False, True):
        cache = KVCache(max_len=8) if static else KVCache()
        with torch.no_grad():
            mod(torch.randn(2, 3, E, dtype=torch.float64), is_causal=True, kv_cache=cache)
            cache.reset()
            assert len(cache) == 0 and cache.k is None
            got = torch.cat([mod(x[:, i:i + 1], is_causal=True, kv_cache=cache)[0] for i in range(5)], 1)
            torch.testing.assert_close(got, mod(x, is_causal=True)[0], rtol=1e-12, atol=1e-12)
