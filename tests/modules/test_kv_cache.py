"""KVCache(max_len=...): preallocated, written in place, same results as the growing cache; generate() uses it."""

import pytest
import torch

from helpers import assert_close
from relattn import KVCache, RelativeMultiheadAttention
from relattn.schemes import Shaw
from relattn.training.model import TransformerConfig, TransformerLM

E, H = 12, 3


def module(backend="auto"):
    torch.manual_seed(0)
    return RelativeMultiheadAttention(E, H, 2, backend=backend, dtype=torch.float64).eval()


@pytest.mark.parametrize("backend", ["auto", "dense", "blocked"])
@torch.no_grad()
def test_static_cache_equals_full_pass_without_copying(backend):
    mod = module(backend)
    x = torch.randn(2, 9, E, dtype=torch.float64)
    full, _ = mod(x, is_causal=True)
    cache, outs, start, ptrs = KVCache(max_len=9), [], 0, set()
    for c in (4, 1, 1, 3):
        outs.append(mod(x[:, start:start + c], is_causal=True, kv_cache=cache)[0])
        start += c
        assert len(cache) == start and cache.k.shape == (2, H, start, E // H) and cache.v.shape == cache.k.shape
        ptrs.add((cache.k.data_ptr(), cache.v.data_ptr(), cache.k.untyped_storage().data_ptr()))
    assert len(ptrs) == 1  # one buffer, written in place: no copy of the history per step
    assert_close(torch.cat(outs, 1), full, torch.float64)


@torch.no_grad()
def test_static_cache_holds_what_the_growing_one_holds():
    g = torch.Generator().manual_seed(1)
    static, growing = KVCache(max_len=6), KVCache()
    for n in (2, 3, 1):
        k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 5, generator=g)
        a, b = static.update(k, v), growing.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert len(static) == len(growing) == 6


@torch.no_grad()
def test_overflowing_max_len_is_a_clear_error():
    cache = KVCache(max_len=4)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"KVCache\(max_len=4\) holds 3 positions; 2 more would exceed max_len"):
        cache.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    assert len(cache) == 3  # the failed call changed nothing
    mod = module()
    cache = KVCache(max_len=3)
    mod(torch.randn(1, 3, E, dtype=torch.float64), kv_cache=cache)
    with pytest.raises(ValueError, match=r"max_len=3\) holds 3 positions; 1 more"):
        mod(torch.randn(1, 1, E, dtype=torch.float64), kv_cache=cache)


@pytest.mark.parametrize("index", [[1, 0, 1], [2, 0], [1]])
@torch.no_grad()
def test_reorder_static_equals_reorder_growing(index):
    mod = module()
    x = torch.randn(3, 7, E, dtype=torch.float64)
    static, growing = KVCache(max_len=7), KVCache()
    mod(x[:, :5], is_causal=True, kv_cache=static)
    mod(x[:, :5], is_causal=True, kv_cache=growing)
    ptr = static.k.data_ptr()
    idx = torch.tensor(index)
    static.reorder(idx)
    growing.reorder(idx)
    assert (static.k.data_ptr() == ptr) == (len(index) == 3)  # the buffer is kept while B is unchanged
    assert torch.equal(static.k, growing.k) and torch.equal(static.v, growing.v) and len(static) == 5
    step = x[idx, 5:7]
    a, _ = mod(step, is_causal=True, kv_cache=static)
    b, _ = mod(step, is_causal=True, kv_cache=growing)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and equal to the reordered sequences run whole
    assert_close(a, mod(x[idx], is_causal=True)[0][:, 5:7], torch.float64)


def test_static_cache_refuses_gradients_and_bad_arguments():
    mod = module()
    with pytest.raises(RuntimeError, match=r"KVCache\(max_len=...\) writes in place and cannot carry gradients"):
        mod(torch.randn(1, 2, E, dtype=torch.float64), kv_cache=KVCache(max_len=4))
    with pytest.raises(ValueError, match=r"max_len must be None \(growing cache\) or a positive int, got 0"):
        KVCache(max_len=0)
    cache = KVCache(max_len=4)
    with torch.no_grad():
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
        with pytest.raises(ValueError, match=r"cache holds \(B, H\) = \(1, 2\), got keys \(2, 2, 1, 4\)"):
            cache.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
        with pytest.raises(ValueError, match=r"cache holds torch.float32 on cpu; got keys torch.float64"):
            cache.update(torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    grow = KVCache()  # the growing cache still carries gradients
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    grow.update(k, k)[0].sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))


def test_generate_decodes_into_static_caches_in_place():
    cfg = TransformerConfig(d_model=24, n_heads=3, n_layers=2, d_ff=40, max_relative_position=3)
    torch.manual_seed(0)
    model = TransformerLM(cfg).double().eval()
    seen = []

    def record(mod, args, kwargs):
        cache = kwargs["kv_cache"]
        seen.append((id(mod), cache.max_len, cache._k is None or cache._k.data_ptr()))

    hooks = [b.attn.register_forward_pre_hook(record, with_kwargs=True) for b in model.encoder.blocks]
    prompt = torch.tensor([[72, 101, 108, 108, 111]])
    out = model.generate(prompt, 6, temperature=0)
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * 6 and all(max_len == 5 + 6 for _, max_len, _ in seen)
    for layer in {layer for layer, _, _ in seen}:
        ptrs = [p for lyr, _, p in seen if lyr == layer]
        assert ptrs[0] is True and len(set(ptrs[1:])) == 1  # allocated once, at the prompt
    seq = prompt
    for _ in range(6):  # the same ids as recomputing everything at every step
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_a_refused_call_leaves_the_cache_unchanged():
    mod = module()
    cache = KVCache(max_len=8)
    mod(torch.randn(1, 3, E, dtype=torch.float64), kv_cache=cache)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, M\) = \(1, 4\); got \(1, 3\)"):
        mod(torch.randn(1, 1, E, dtype=torch.float64), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool),
            kv_cache=cache)
    assert len(cache) == 3


def test_a_call_refused_for_gradients_leaves_the_cache_free_for_cross_attention():
    """A static cache handed keys that need gradients refuses them and stays as new: the next, valid call (here
    cross-attention, under no_grad) is served and equals the uncached pass."""
    mod = module()
    x, mem = torch.randn(1, 2, E, dtype=torch.float64), torch.randn(1, 5, E, dtype=torch.float64)
    cache = KVCache(max_len=8)
    with pytest.raises(RuntimeError, match="cannot carry gradients"):
        mod(x, kv_cache=cache)
    assert cache.kind is None and len(cache) == 0
    with torch.no_grad():
        got = mod(x, mem, mem, kv_cache=cache)[0]
        assert cache.kind == "cross"
        assert_close(got, mod(x, mem, mem)[0], torch.float64)
        small = KVCache(max_len=3)  # and the other way: a memory too long refused, then self-attention served
        with pytest.raises(ValueError, match=r"cannot hold a memory of 5 positions"):
            mod(x, mem, mem, kv_cache=small)
        assert small.kind is None and len(small) == 0
        assert_close(mod(x, kv_cache=small)[0], mod(x)[0], torch.float64)



@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@torch.no_grad()
def test_unbatched_decoding_with_a_cache_equals_the_full_pass(static):
    """(N, E) inputs, one step at a time, self- and cross-attention: the cache sees the same call as the batched
    one (the query handed as key is self-attention, before the batch dimension is added)."""
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(E, H, Shaw(2, position_to_content=True, share_heads=False), num_kv_heads=1,
                                     dtype=torch.float64).eval()
    x, mem = torch.randn(5, E, dtype=torch.float64), torch.randn(4, E, dtype=torch.float64)
    for memory in (None, mem):
        cache = KVCache(max_len=8) if static else KVCache()
        steps = [mod(x[i:i + 1], memory, memory, is_causal=memory is None, kv_cache=cache)[0] for i in range(5)]
        assert cache.kind == ("self" if memory is None else "cross")
        assert_close(torch.cat(steps), mod(x, memory, memory, is_causal=memory is None)[0], torch.float64)
