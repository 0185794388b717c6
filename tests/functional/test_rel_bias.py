"""The scalar bias ``rel_bias`` (T5's and MPNet's relative attention bias, ``b[h, idx_ij]`` added unscaled to the
scores at the key term's row) and T5's bucket map :class:`relattn.positions.T5Buckets`: the buckets against
transformers' own functions, the numpy reference's loop against its vectorised form and against an independent torch
formula, and every backend that serves the term against the reference (outputs and every gradient, the bias's
included), combined with tables or none, windows and buckets, masks, causal, grouped heads, query offsets, packed
sequences and decoding step by step; dropout with the bias one mask on native, blocked, triton and dense; gradcheck in
float64, the bias's gradient the same bits run to run, bfloat16 within twice plain PyTorch's error, and the backends
that do not serve it refusing it by declaration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    assert_close,
    attention_ref,
    backend_params,
    np64,
    oracle_grads,
    reference_output,
    unavailable_here,
)
from relattn import (
    BACKENDS,
    relative_attention,
    relative_attention_varlen,
    relative_attention_weights,
    relative_attention_with_weights,
)
from relattn import reference as ref
from relattn.backends import not_supported_reasons, resolve, why_not
from relattn.functional import validate
from relattn.positions import T5Buckets, t5_bucket
from relattn.schemes import Shaw, T5Bias

SERVING = [name for name, b in BACKENDS.items() if b.serves.rel_bias]
REFUSING = [name for name, b in BACKENDS.items() if not b.serves.rel_bias]

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------- T5's buckets


BUCKET_CONFIGS = [(32, 128, True), (32, 128, False), (8, 20, True), (64, 256, False), (6, 7, True), (16, 9, False)]


@pytest.mark.parametrize("config", BUCKET_CONFIGS, ids=str)
def test_t5_buckets_are_transformers_buckets(config):
    """Every offset up to +-1e5: T5's ``_relative_position_bucket``; MPNet's ``relative_position_bucket`` for the
    bidirectional maps; the numpy reference's literal :func:`relattn.reference.t5_bucket` on a sample."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    mpnet = pytest.importorskip("transformers.models.mpnet.modeling_mpnet")
    num_buckets, max_distance, bidirectional = config
    offsets = torch.arange(-100_000, 100_001)
    got = T5Buckets(*config).row(offsets)
    assert torch.equal(got, t5.T5Attention._relative_position_bucket(offsets, bidirectional, num_buckets,
                                                                     max_distance))
    if bidirectional:
        assert torch.equal(got, mpnet.MPNetEncoder.relative_position_bucket(offsets, num_buckets, max_distance))
    sample = list(range(-300, 301)) + [-100_000, -4097, 1023, 99_999]
    assert [ref.t5_bucket(r, *config) for r in sample] == got[torch.tensor(sample) + 100_000].tolist()
    assert got.min() >= 0 and got.max() == num_buckets - 1  # every bucket reached: a wrong split would not


@pytest.mark.parametrize("config", BUCKET_CONFIGS, ids=str)
def test_t5_buckets_clipped_at_saturation_are_exact(config):
    """The K the op clips to gives every offset of the range its bucket: the expanded table's row of
    ``clip(r, -K, K)`` is the compact table's row of ``r``, and over a symmetric range K is the smallest such (K - 1
    is not)."""
    buckets = T5Buckets(*config)
    for lowest, highest in ((-5000, 5000), (-40, 3), (0, 700), (-9, 0)):
        kk = buckets.max_relative_position(lowest, highest)
        offsets = torch.arange(lowest, highest + 1)
        table = torch.arange(buckets.rows, dtype=torch.float64)[:, None]
        expanded = buckets.expand(table, kk)[:, 0]
        assert torch.equal(expanded[offsets.clamp(-kk, kk) + kk].long(), buckets.row(offsets))
        if kk > 0 and lowest == -highest:
            narrower = buckets.expand(table, kk - 1)[:, 0]
            assert not torch.equal(narrower[offsets.clamp(-kk + 1, kk - 1) + kk - 1].long(), buckets.row(offsets))


def test_t5_buckets_check_their_fields():
    with pytest.raises(TypeError, match="num_buckets"):
        T5Buckets(32.0)
    with pytest.raises(TypeError, match="bidirectional"):
        T5Buckets(32, 128, 1)
    with pytest.raises(ValueError, match="num_buckets >= 4"):
        T5Buckets(3)
    with pytest.raises(ValueError, match="max_distance > 8"):
        T5Buckets(32, 8)
    assert t5_bucket(torch.tensor([5]), 32, 128, False).item() == 0  # the future takes the bucket of 0 (causal)


# ------------------------------------------------------------------------------------------- the reference


def test_reference_loop_equals_vectorised_and_torch_formula():
    """The spec's loop (``get_bias`` per pair) = its vectorised gather = the independent torch formula, with tables
    and buckets, and the bias really moves the scores (a reference that dropped it would fail)."""
    rng = np.random.RandomState(0)
    n, m, d, rows = 6, 9, 4, 8
    q, k = rng.randn(n, d), rng.randn(m, d)
    a_k, a_v, b = rng.randn(rows, d), rng.randn(rows, d), rng.randn(rows) * 3
    emb = ref.RelativePositionEmbedding.from_tables(a_k, a_v, 0, b=b, buckets=(8, 12, True))
    loop = ref.relative_attention_scores(q, k, emb, query_offset=2, scale=0.5)
    vec = ref.relative_attention_scores_vectorized(q, k, emb, query_offset=2, scale=0.5)
    np.testing.assert_allclose(loop, vec, rtol=1e-12, atol=1e-12)
    plain = ref.RelativePositionEmbedding.from_tables(a_k, a_v, 0, buckets=(8, 12, True))
    assert np.abs(loop - ref.relative_attention_scores(q, k, plain, query_offset=2, scale=0.5)).max() > 0.1
    t = [torch.from_numpy(x)[None, None] for x in (q, k, k)]
    got = reference_output(*t, torch.from_numpy(a_k), torch.from_numpy(a_v), rel_bias=torch.from_numpy(b),
                           max_relative_position=T5Buckets(8, 12), scale=0.5, query_offset=2)
    want = attention_ref(*t, torch.from_numpy(a_k), torch.from_numpy(a_v), rel_bias=torch.from_numpy(b),
                         max_relative_position=T5Buckets(8, 12), scale=0.5, query_offset=2)
    assert_close(got, want, torch.float64, "reference vs formula")


# ------------------------------------------------------------------------------------------- conformance


def _inputs(b, h, hkv, n, m, d, rows, *, tables, bias_heads, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, m, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, m, d + 1, generator=g, dtype=torch.float64)
    rel_k = torch.randn(rows, d, generator=g, dtype=torch.float64) * 0.5 if "k" in tables else None
    rel_v = torch.randn(h, rows, d + 1, generator=g, dtype=torch.float64) * 0.5 if "v" in tables else None
    bias = torch.randn(*((h,) if bias_heads else ()), rows, generator=g, dtype=torch.float64) * 2
    return [None if t is None else t.to(dtype).requires_grad_() for t in (q, k, v, rel_k, rel_v)], \
        bias.to(dtype).requires_grad_()


# (name, heads, kv heads, N, M, positions, rows, tables, per-head bias, causal, query offset, mask)
CASES = [
    ("t5-encoder", 3, 3, 11, 11, T5Buckets(8, 12), 8, "", True, False, 0, None),
    ("t5-decoder-causal", 3, 3, 11, 11, T5Buckets(8, 12, False), 8, "", True, True, 0, None),
    ("mpnet-shaped-mask", 2, 2, 9, 9, T5Buckets(8, 12), 8, "", True, False, 0, "bool"),
    ("shared-bias-tables", 2, 2, 9, 9, 3, 7, "kv", False, False, 0, None),
    ("keys-gqa-causal-float-mask", 4, 2, 10, 10, 2, 5, "k", True, True, 0, "float"),
    ("window-decoding", 2, 1, 3, 13, (4, 2), 7, "kv", True, True, 10, None),
    ("buckets-offset-negative", 2, 2, 12, 7, T5Buckets(8, 12), 8, "v", True, False, -3, None),
    ("long-saturated", 2, 2, 70, 70, T5Buckets(16, 20), 16, "k", True, False, 0, None),
]
IDS = [c[0] for c in CASES]


def _mask(kind, n, m, seed=1):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(1, 1, n, m, generator=g) > 0.3
    allowed[..., 0] = True
    return allowed if kind == "bool" else torch.where(allowed, torch.randn(1, 1, n, m, generator=g,
                                                                           dtype=torch.float64), -torch.inf)


@pytest.mark.parametrize("backend", backend_params(SERVING))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_serving_backend_against_the_reference(backend, case, small_tiles):
    """Outputs against the numpy reference, every gradient (the bias's included) against the float64 oracle."""
    name, h, hkv, n, m, positions, rows, tables, per_head, causal, offset, mask_kind = case
    small_tiles()
    inputs, bias = _inputs(2, h, hkv, n, m, 5, rows, tables=tables, bias_heads=per_head)
    mask = _mask(mask_kind, n, m)
    kw = dict(max_relative_position=positions, is_causal=causal, query_offset=offset, attn_mask=mask,
              enable_gqa=hkv != h, scale=1.0 if not tables else None, rel_bias=bias)
    out = relative_attention(*inputs, backend=backend, **kw)
    want = reference_output(*inputs, **kw)
    assert_close(out, want, torch.float64, f"{backend} {name} out")
    go = torch.randn_like(out)
    present = [t for t in inputs if t is not None] + [bias]
    got = torch.autograd.grad(out, present, go)
    _, expected = oracle_grads(inputs, go, **kw)
    for i, (a, w) in enumerate(zip(got, expected, strict=True)):
        assert_close(a, w, torch.float64, f"{backend} {name} grad {i}")
    assert got[-1].abs().max() > 0  # the bias gets a gradient


@pytest.mark.parametrize("backend", backend_params(SERVING))
def test_packed_sequences_and_decoding(backend, small_tiles):
    """Packed sequences of ragged lengths (one launch on "native") against the reference's varlen form, every
    gradient against the sequences run one by one; and a causal decoder run one query at a time against the
    growing keys (a KV cache: query_offset = len(cache)) equals the whole causal call."""
    small_tiles()
    lengths = [5, 1, 12, 7]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    total, h, d = int(cu[-1]), 3, 4
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(total, h, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(h, 8, generator=g, dtype=torch.float64, requires_grad=True)
    for causal in (False, True):
        kw = dict(max_relative_position=T5Buckets(8, 6, not causal), rel_bias=bias, is_causal=causal, scale=1.0)
        out = relative_attention_varlen(q, k, v, cu_seqlens_q=cu, backend=backend, **kw)
        want = ref.relative_attention_varlen(np64(q), np64(k), np64(v), cu_seqlens_q=cu.numpy(),
                                             **{**kw, "rel_bias": np64(bias)})
        assert_close(out, torch.from_numpy(want), torch.float64, f"{backend} varlen causal={causal}")
        go = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v, bias), go)
        one_by_one = torch.cat([relative_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), backend="dense",
                                                   **kw).transpose(0, 1) for a, b in zip(cu[:-1], cu[1:],
                                                                                         strict=True)])
        expected = torch.autograd.grad(one_by_one, (q, k, v, bias), go)
        for i, (a, w) in enumerate(zip(got, expected, strict=True)):
            assert_close(a, w, torch.float64, f"{backend} varlen grad {i}")
    qd, kd, vd = (t.detach()[:12].transpose(0, 1)[None] for t in (q, k, v))
    kw = dict(max_relative_position=T5Buckets(8, 6, False), rel_bias=bias.detach(), scale=1.0, backend=backend)
    whole = relative_attention(qd, kd, vd, is_causal=True, **kw)
    steps = [relative_attention(qd[:, :, i:i + 1], kd[:, :, :i + 1], vd[:, :, :i + 1], query_offset=i, **kw)
             for i in range(12)]
    assert_close(torch.cat(steps, dim=2), whole, torch.float64, f"{backend} decoding")


@pytest.mark.parametrize("backend", backend_params(SERVING))
def test_gradcheck(backend, small_tiles):
    small_tiles()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rel_k = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, rel_k, bias):
        return relative_attention(q, k, v, rel_k, max_relative_position=2, rel_bias=bias, is_causal=True,
                                  backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, rel_k, bias))
    assert torch.autograd.gradcheck(lambda q, k, v, b: relative_attention(
        q, k, v, max_relative_position=T5Buckets(4, 5), rel_bias=b, scale=1.0, backend=backend),
        (q, k, v, bias[0, :4].detach().clone().requires_grad_()))


@pytest.mark.parametrize("backend", backend_params(SERVING))
def test_bias_gradient_is_deterministic(backend):
    """Two threads, several key segments and sequences: the bias's gradient is the same bits run to run (no
    atomics), shared and per head."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(3, 4, 150, 16, generator=g, requires_grad=True) for _ in range(3))
        for shape in ((32,), (4, 32)):
            bias = torch.randn(*shape, generator=g, requires_grad=True)
            go = torch.randn(3, 4, 150, 16, generator=g)
            runs = [torch.autograd.grad(relative_attention(q, k, v, max_relative_position=T5Buckets(), rel_bias=bias,
                                                           scale=1.0, backend=backend), bias, go)[0]
                    for _ in range(3)]
            assert all(torch.equal(runs[0], r) for r in runs[1:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", backend_params(SERVING))
def test_bfloat16_within_twice_plain_pytorch(backend):
    q, k, v = (torch.randn(1, 2, 96, 32, generator=torch.Generator().manual_seed(s)) for s in (6, 7, 8))
    bias = torch.randn(2, 32, generator=torch.Generator().manual_seed(9)) * 2
    bf = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    bb = bias.to(torch.bfloat16).requires_grad_()
    kw = dict(max_relative_position=T5Buckets(), rel_bias=bb, scale=1.0, is_causal=True)
    go = torch.randn(1, 2, 96, 32, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    want, want_grads = oracle_grads(bf + [None, None], go, **kw)
    plain = attention_ref(*bf, upcast=False, **kw)
    plain_grads = torch.autograd.grad(plain, [*bf, bb], go)
    out = relative_attention(*bf, backend=backend, **kw)
    got = torch.autograd.grad(out, [*bf, bb], go)
    assert out.dtype == torch.bfloat16 and got[-1].dtype == torch.bfloat16
    assert_close(out, want, torch.bfloat16, f"{backend} out", yardstick=plain)
    for i, (a, w, p) in enumerate(zip(got, want_grads, plain_grads, strict=True)):
        assert_close(a, w, torch.bfloat16, f"{backend} grad {i}", yardstick=p)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("t5-decoder-causal", "mpnet-shaped-mask",
                                                              "keys-gqa-causal-float-mask", "window-decoding",
                                                              "buckets-offset-negative")], ids=lambda c: c[0])
@pytest.mark.parametrize("backend", backend_params(["native", "blocked", "triton"]))
def test_dropout_with_the_bias_is_one_mask_on_every_backend(backend, case, small_tiles):
    """Dropout with ``rel_bias`` (the bias is part of the scores the weights come from): native, blocked, triton and
    dense draw the same mask for the same ``torch.manual_seed`` and give the same outputs and gradients (the bias's
    included) in float64 to 1e-12; dropout and the bias each change the output (a backend ignoring either fails)."""
    name, h, hkv, n, m, positions, rows, tables, per_head, causal, offset, mask_kind = case
    small_tiles()
    inputs, bias = _inputs(2, h, hkv, n, m, 5, rows, tables=tables, bias_heads=per_head, seed=3)
    kw = dict(max_relative_position=positions, is_causal=causal, query_offset=offset, attn_mask=_mask(mask_kind, n, m),
              enable_gqa=hkv != h, scale=1.0 if not tables else None)
    present = [t for t in inputs if t is not None] + [bias]
    go = torch.randn(2, h, n, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def run(backend, p=0.3, rel_bias=bias):
        torch.manual_seed(17)
        out = relative_attention(*inputs, backend=backend, dropout_p=p, rel_bias=rel_bias, **kw)
        return out, torch.autograd.grad(out, present if rel_bias is not None else present[:-1], go)

    def rel_err(a, b):
        return float((a - b).detach().abs().max() / (b.detach().abs().max() + 1e-300))

    want, want_grads = run("dense")
    got, got_grads = run(backend)
    assert rel_err(got, want) <= 1e-12, backend
    for i, (a, w) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert rel_err(a, w) <= 1e-12, (backend, i)
    assert want_grads[-1].abs().max() > 0  # the bias gets a gradient through the dropped weights
    assert rel_err(want, run("dense", p=0.0)[0]) > 1e-2  # dropout did something
    assert rel_err(want, run("dense", rel_bias=None)[0]) > 1e-2  # and so did the bias


def test_weights_carry_the_bias():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 8, generator=g, dtype=torch.float64) * 3
    kw = dict(max_relative_position=T5Buckets(8, 12), rel_bias=bias, scale=1.0)
    out, w = relative_attention_with_weights(q, k, v, **kw)
    _, want = ref.relative_attention(np64(q), np64(k), np64(v), return_weights=True,
                                     **{**kw, "rel_bias": np64(bias)})
    assert_close(w, torch.from_numpy(want), torch.float64, "weights")
    assert_close(relative_attention_weights(q, k, **kw), torch.from_numpy(want), torch.float64, "weights only")
    assert_close(out, relative_attention(q, k, v, backend="dense", **kw), torch.float64, "out")


# ------------------------------------------------------------------------------------------- refusals, validation


def test_backends_without_the_term_refuse_it_and_auto_passes_them_over():
    assert set(SERVING) >= {"dense", "blocked", "native"}
    assert why_not("dense", rel_bias=True) == []
    assert all("rel_bias" in " ".join(why_not(name, rel_bias=True)) for name in REFUSING)
    q = torch.randn(1, 2, 4, 3)
    call = validate(q, q, q, None, None, max_relative_position=2, attn_mask=None, is_causal=False, dropout_p=0.0,
                    scale=None, query_offset=0, rel_bias=torch.randn(5))
    for name in REFUSING:
        assert any("rel_bias" in r for r in not_supported_reasons(BACKENDS[name], call)), name
    assert resolve("auto", call).name in SERVING


def test_bad_bias_tables_are_refused_by_name():
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"rel_bias must be \(5,\) or \(2, 5\).*got \(3, 5\)"):
        relative_attention(q, q, q, max_relative_position=2, rel_bias=torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"rel_bias must be \(32,\)"):
        relative_attention(q, q, q, max_relative_position=T5Buckets(), rel_bias=torch.randn(31))
    with pytest.raises(TypeError, match="rel_bias has dtype torch.float64"):
        relative_attention(q, q, q, max_relative_position=2, rel_bias=torch.randn(5, dtype=torch.float64))
    with pytest.raises(TypeError, match="rel_bias must be a Tensor"):
        relative_attention(q, q, q, max_relative_position=2, rel_bias=[0.0] * 5)
    with pytest.raises(ValueError, match="does not apply to T5Buckets"):
        relative_attention(q, q, q, max_relative_position=T5Buckets(), rel_bias=torch.randn(32), beyond="zero")


# ------------------------------------------------------------------------------------------- the module


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_t5_style_module_is_t5_attention(decoder):
    """``RelativeMultiheadAttention`` with a bias table, no tables and scale 1.0 computes transformers' T5Attention
    with the same weights (outputs and the table's gradient), a right-padded batch too; the decoder step by step
    through a ``KVCache`` equals its whole causal call."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from relattn import KVCache, RelativeMultiheadAttention

    config = t5.T5Config(d_model=12, d_kv=4, num_heads=3, relative_attention_num_buckets=8,
                         relative_attention_max_distance=12, dropout_rate=0.0, is_decoder=decoder)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = t5.T5Attention(config, has_relative_attention_bias=True, layer_idx=0, is_causal=decoder).double()
    mine = RelativeMultiheadAttention(12, 3, T5Bias(T5Buckets(8, 12, not decoder)), bias=False, dtype=torch.float64)
    with torch.no_grad():
        for a, b in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
            getattr(mine, a).weight.copy_(getattr(theirs, b).weight)
        mine.rel_bias.copy_(theirs.relative_attention_bias.weight.t())
    x = torch.randn(2, 20, 12, dtype=torch.float64)
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, 13:] = False
    n = x.shape[1]
    allowed = keep[:, None, None, :] & (torch.ones(n, n, dtype=torch.bool).tril() if decoder else True)
    want = theirs(x, mask=torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -torch.inf))[0]
    got, _ = mine(x, key_padding_mask=~keep, is_causal=decoder)
    real = keep[..., None]
    assert_close(got * real, want * real, torch.float64, "T5 attention")
    g_mine = torch.autograd.grad((got * real).sum(), mine.rel_bias)[0]
    g_theirs = torch.autograd.grad((want * real).sum(), theirs.relative_attention_bias.weight)[0]
    assert_close(g_mine, g_theirs.t(), torch.float64, "bias gradient")
    if decoder:
        cache = KVCache()
        steps = [mine(x[:, i:i + 1], kv_cache=cache, is_causal=True)[0] for i in range(n)]
        assert_close(torch.cat(steps, 1), mine(x, is_causal=True)[0], torch.float64, "decoding")


def test_module_bias_options_checked():
    from relattn import RelativeMultiheadAttention

    with pytest.raises(TypeError, match="Shaw.bias must be a bool"):
        Shaw(3, bias=1)
    with pytest.raises(TypeError, match="T5Bias.scale must be a float or None, got str"):
        T5Bias(scale="1")
    with pytest.raises(ValueError, match="rel_bias"):
        RelativeMultiheadAttention(8, 2, T5Bias(), backend=REFUSING[0]) if REFUSING else \
            pytest.skip("every backend serves rel_bias")
    shared = RelativeMultiheadAttention(8, 2, Shaw(T5Buckets(), bias=True))
    assert shared.rel_bias.shape == (32,) and shared.rel_k.shape == (32, 4)


@pytest.mark.skipif(unavailable_here("triton") is not None, reason=str(unavailable_here("triton")))
def test_triton_needs_a_nonzero_scale_with_the_bias():
    """triton folds the bias into the key term's scores as rel_bias / scale: scale = 0 is refused by name (the other
    backends serve it)."""
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    kw = dict(max_relative_position=2, rel_bias=torch.randn(5, dtype=torch.float64), scale=0.0)
    with pytest.raises(ValueError, match="scale != 0"):
        relative_attention(q, q, q, backend="triton", **kw)
    assert relative_attention(q, q, q, backend="dense", **kw).isfinite().all()
