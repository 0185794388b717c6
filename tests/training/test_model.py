"""TransformerLM / TransformerEncoder: cached decoding equals the full forward pass, generation, config."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import assert_close
from relattn.training.model import TransformerConfig, TransformerEncoder, TransformerLM, sinusoidal_positions


def tiny(positions, **kw):
    cfg = dict(d_model=24, n_heads=3, n_layers=2, d_ff=40, max_relative_position=3, positions=positions)
    cfg.update(kw)
    return TransformerConfig(**cfg)


def _model(config, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = TransformerLM(config).to(dtype).eval()
    # Make every parameter matter: random biases and LayerNorm gains instead of zeros/ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


CASES = [("relative", {}), ("relative", {"share_heads": False}), ("relative", {"relative_values": False}),
         ("absolute", {}), ("none", {})]


@pytest.mark.parametrize("positions,extra", CASES)
def test_cached_decoding_equals_full_forward_float64(positions, extra):
    # Prompt of 5, then 9 single steps: the sequence (14) is longer than 2K+1 = 7, so clipping is exercised.
    model = _model(tiny(positions, **extra))
    tokens = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    caches = model.new_caches()
    parts = [model(tokens[:, :5], kv_caches=caches)]
    for i in range(5, 14):
        parts.append(model(tokens[:, i:i + 1], kv_caches=caches))
    assert all(len(c) == 14 for c in caches)
    assert_close(torch.cat(parts, 1), full, torch.float64)


@pytest.mark.parametrize("positions", ["relative", "absolute", "none"])
def test_cached_decoding_in_uneven_chunks_float32(positions):
    model = _model(tiny(positions), dtype=torch.float32)
    tokens = torch.randint(0, 256, (3, 23), generator=torch.Generator().manual_seed(2))
    full = model(tokens)
    caches = model.new_caches()
    parts = [model(tokens[:, a:b], kv_caches=caches) for a, b in ((0, 7), (7, 8), (8, 11), (11, 12), (12, 23))]
    assert_close(torch.cat(parts, 1), full, torch.float32)


def test_cache_positions_matter():
    # Guard against a test that passes because positions are ignored: with relative or absolute positions,
    # decoding the last token with a cache that pretends it sits at position 0 gives different logits.
    for positions in ("relative", "absolute"):
        model = _model(tiny(positions))
        tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))
        full = model(tokens)[:, -1]
        alone = model(tokens[:, -1:])[:, -1]
        assert (full - alone).abs().max() > 1e-3


@pytest.mark.parametrize("positions", ["relative", "absolute", "none"])
def test_greedy_generate_matches_recomputing_everything(positions):
    model = _model(tiny(positions))
    prompt = torch.tensor([72, 101, 108, 108, 111])
    out = model.generate(prompt, 12, temperature=0)
    seq = prompt[None]
    for _ in range(12):
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert out.shape == (17,)
    assert torch.equal(out, seq[0])
    assert torch.equal(model.generate(prompt, 12, top_k=1), out)  # top-1 sampling is greedy


def test_generate_sampling_is_reproducible_and_batched():
    model = _model(tiny("relative"))
    prompt = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(4))
    a = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    assert a.shape == (3, 14) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    model.train()
    model.generate(prompt, 1)
    assert model.training  # mode restored
    assert model.generate(prompt, 0).shape == (3, 4)


def test_generate_rejects_bad_arguments():
    model = _model(tiny("none"))
    with pytest.raises(ValueError, match="prompt"):
        model.generate(torch.tensor([], dtype=torch.long), 3)
    with pytest.raises(ValueError, match="prompt ids"):
        model.generate(torch.tensor([256]), 3)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.tensor([1]), 3, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(torch.tensor([1]), 3, top_k=0)


def test_encoder_padding_is_ignored_and_none_is_permutation_equivariant():
    cfg = tiny("relative")
    torch.manual_seed(0)
    enc = TransformerEncoder(cfg).double().eval()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    pad = torch.randn(2, 3, 24, dtype=torch.float64)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 7:] = True
    padded = enc(torch.cat([x, pad], 1), key_padding_mask=mask)[:, :7]
    assert_close(padded, enc(x), torch.float64)

    torch.manual_seed(0)
    enc = TransformerEncoder(tiny("none")).double().eval()
    perm = torch.randperm(7)
    assert_close(enc(x)[:, perm], enc(x[:, perm]), torch.float64)
    torch.manual_seed(0)
    enc = TransformerEncoder(tiny("relative")).double().eval()
    assert (enc(x)[:, perm] - enc(x[:, perm])).abs().max() > 1e-3  # relative positions break the symmetry


def test_sinusoidal_positions_formula_and_offset():
    pe = sinusoidal_positions(12, 7, dtype=torch.float64).numpy()
    for p, i in ((0, 0), (5, 2), (11, 4), (3, 6)):
        angle = p / 10000 ** (2 * (i // 2) / 7)
        assert pe[p, i] == pytest.approx(math.sin(angle) if i % 2 == 0 else math.cos(angle), abs=1e-12)
    np.testing.assert_array_equal(sinusoidal_positions(4, 7, offset=8, dtype=torch.float64).numpy(), pe[8:12])


def test_config_validation_and_round_trip():
    with pytest.raises(ValueError, match="d_model .* divisible by n_heads"):
        TransformerConfig(d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="context"):
        TransformerConfig(context=0)
    with pytest.raises(ValueError, match="positions"):
        TransformerConfig(positions="rotary")
    with pytest.raises(ValueError, match="backend"):
        TransformerConfig(backend="nope")
    cfg = TransformerConfig(positions="absolute", d_model=48, n_heads=6)
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        TransformerConfig.from_dict({"width": 3})


def test_tables_and_tying_follow_the_config():
    lm = TransformerLM(tiny("relative", share_heads=False))
    assert lm.encoder.blocks[0].attn.rel_k.shape == (3, 7, 8)
    assert lm.head.weight is lm.embed.weight
    lm = TransformerLM(tiny("absolute", tie_embeddings=False))
    assert lm.encoder.blocks[0].attn.rel_k is None and lm.encoder.blocks[0].attn.rel_v is None
    assert lm.head.weight is not lm.embed.weight
    lm = TransformerLM(tiny("relative", relative_values=False))
    assert lm.encoder.blocks[0].attn.rel_k is not None and lm.encoder.blocks[0].attn.rel_v is None


@pytest.mark.parametrize("positions", ["relative", "absolute"])
def test_kv_cache_reorder_continues_the_reordered_sequences(positions):
    """Beam-search style: after ``reorder`` every cache holds the chosen rows, so decoding continues exactly as a
    full forward pass over the reordered prompts followed by the new tokens."""
    model = _model(tiny(positions))
    g = torch.Generator().manual_seed(5)
    prompts, cont = torch.randint(0, 256, (3, 6), generator=g), torch.randint(0, 256, (3, 5), generator=g)
    index = torch.tensor([2, 0, 0])
    caches = model.new_caches()
    model(prompts, kv_caches=caches)
    for cache in caches:
        cache.reorder(index)
    assert all(len(c) == 6 for c in caches)
    got = torch.cat([model(cont[:, :1], kv_caches=caches), model(cont[:, 1:], kv_caches=caches)], 1)
    want = model(torch.cat([prompts[index], cont], 1))[:, 6:]
    assert_close(got, want, torch.float64)
    unordered = model(torch.cat([prompts, cont], 1))[:, 6:]
    assert (want - unordered).abs().max() > 1e-3  # guard: the order of the rows matters here


LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.6, 0.0, 1.2, -0.5, 1.9, 0.8, -2.0, 0.5, 1.4], dtype=torch.float64)


def _fixed_logits_model():
    """A real TransformerLM whose next-token logits are ``LOGITS`` whatever the input: the final LayerNorm's gain
    is zero, so its output is its bias e_0, and column 0 of the (untied) output projection is ``LOGITS``."""
    model = _model(tiny("relative", vocab_size=len(LOGITS), tie_embeddings=False, n_layers=1))
    with torch.no_grad():
        model.encoder.ln_f.weight.zero_()
        model.encoder.ln_f.bias.zero_()
        model.encoder.ln_f.bias[0] = 1.0
        model.head.weight.zero_()
        model.head.weight[:, 0] = LOGITS
    tokens = torch.randint(0, len(LOGITS), (2, 5), generator=torch.Generator().manual_seed(6))
    assert_close(model(tokens), LOGITS.expand(2, 5, -1), torch.float64)
    return model


def _draws(model, temperature, top_k, seed=0):
    """4000 sampled ids: 400 rows of 10 new tokens each (every step sees the same logits)."""
    prompt = torch.zeros(400, 1, dtype=torch.long)
    out = model.generate(prompt, 10, temperature=temperature, top_k=top_k,
                         generator=torch.Generator().manual_seed(seed))
    return out[:, 1:].reshape(-1)


def _expected(temperature, top_k):
    logits = LOGITS / temperature
    if top_k is not None:
        logits = logits.masked_fill(LOGITS < LOGITS.topk(top_k).values[-1], float("-inf"))
    return torch.softmax(logits, -1)


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, None), (0.5, None), (2.5, None), (1.0, 4), (0.5, 4),
                                                    (3.0, 2)])
def test_generate_samples_the_tempered_top_k_distribution(temperature, top_k):
    """Empirical frequencies of 4000 draws against softmax(logits / T) restricted to the top k (within 4
    standard errors): a sampler that ignores T or keeps a different number of ids fails."""
    draws = _draws(_fixed_logits_model(), temperature, top_k)
    freq = torch.bincount(draws, minlength=len(LOGITS)).double() / draws.numel()
    p = _expected(temperature, top_k)
    bound = 4 * (p * (1 - p) / draws.numel()).sqrt() + 1e-3
    assert ((freq - p).abs() <= bound).all(), (freq, p)
    if top_k is not None:
        top = set(LOGITS.topk(top_k).indices.tolist())
        assert set(draws.tolist()) == top  # nothing outside the top k, and every one of the top k drawn


@pytest.mark.slow
def test_generate_temperature_limits():
    """T -> 0 approaches greedy; a higher T spreads the draws (more entropy, more distinct ids)."""
    model = _fixed_logits_model()
    assert set(_draws(model, 1e-3, None).tolist()) == {int(LOGITS.argmax())}
    assert set(_draws(model, 1e-3, 5).tolist()) == {int(LOGITS.argmax())}

    def entropy(draws):
        f = torch.bincount(draws, minlength=len(LOGITS)).double() / draws.numel()
        return -(f[f > 0] * f[f > 0].log()).sum().item()

    cold, warm, hot = (entropy(_draws(model, t, None)) for t in (0.5, 1.0, 3.0))
    assert cold + 0.2 < warm < hot - 0.2
    assert len(set(_draws(model, 3.0, None).tolist())) == len(LOGITS)
