"""RelativeMultiheadAttention: against nn.MultiheadAttention (tables off), against the op, and its KV cache."""

import math
import re

import pytest
import torch
from torch import nn

from helpers import assert_close
from relattn import KVCache, RelativeMultiheadAttention, relative_attention
from relattn.schemes import Shaw, TransformerXL

E, H = 12, 3


def twin_mha(mod: RelativeMultiheadAttention) -> nn.MultiheadAttention:
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([mod.q_proj.weight, mod.k_proj.weight, mod.v_proj.weight]))
        mha.in_proj_bias.copy_(torch.cat([mod.q_proj.bias, mod.k_proj.bias, mod.v_proj.bias]))
        mha.out_proj.weight.copy_(mod.out_proj.weight)
        mha.out_proj.bias.copy_(mod.out_proj.bias)
    return mha.eval()


SHAW_FIELDS = ("keys", "values", "position_to_content", "bias", "tie", "share_heads", "beyond", "scale")


def module(**kw):
    """A float64 module of ``Shaw(k, ...)`` (``kw``: Shaw's fields and the constructor's), projection biases set."""
    torch.manual_seed(0)
    shaw = {name: kw.pop(name) for name in SHAW_FIELDS if name in kw}
    mod = RelativeMultiheadAttention(E, H, Shaw(kw.pop("k", 3), **shaw), dtype=torch.float64, **kw).eval()
    with torch.no_grad():
        for p in (mod.q_proj.bias, mod.k_proj.bias, mod.v_proj.bias, mod.out_proj.bias):
            p.normal_()
    return mod


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "padding", "both", "3d"])
def test_without_tables_equals_nn_multihead_attention(mask_kind):
    """A drop-in: with relative terms off, masks in nn.MultiheadAttention's convention give its exact result."""
    mod = module(keys=False, values=False)
    mha = twin_mha(mod)
    g = torch.Generator().manual_seed(1)
    x, mem = torch.randn(2, 5, E, generator=g, dtype=torch.float64), torch.randn(2, 7, E, generator=g,
                                                                                dtype=torch.float64)
    kw = {}
    if mask_kind in ("bool", "both"):
        kw["attn_mask"] = torch.rand(5, 7, generator=g) > 0.7
        kw["attn_mask"][:, 0] = False
    if mask_kind == "float":
        kw["attn_mask"] = torch.randn(5, 7, generator=g, dtype=torch.float64)
    if mask_kind == "3d":
        kw["attn_mask"] = torch.randn(2 * H, 5, 7, generator=g, dtype=torch.float64)
    if mask_kind in ("padding", "both"):
        kw["key_padding_mask"] = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    got, w = mod(x, mem, mem, need_weights=True, **kw)
    want, want_w = mha(x, mem, mem, need_weights=True, **kw)
    assert_close(got, want, torch.float64)
    assert_close(w, want_w, torch.float64)
    got_fast, none = mod(x, mem, mem, **kw)
    assert none is None
    assert_close(got_fast, want, torch.float64)


@pytest.mark.parametrize("share_heads", [True, False])
def test_module_equals_op(share_heads):
    mod = module(share_heads=share_heads, k=2)
    assert mod.rel_k.shape == ((5, E // H) if share_heads else (H, 5, E // H))
    x = torch.randn(2, 6, E, dtype=torch.float64)

    def split(t):
        return t.view(2, 6, H, E // H).transpose(1, 2)

    q, k, v = split(mod.q_proj(x)), split(mod.k_proj(x)), split(mod.v_proj(x))
    o = relative_attention(q, k, v, mod.rel_k, mod.rel_v, max_relative_position=2, is_causal=True)
    want = mod.out_proj(o.transpose(1, 2).reshape(2, 6, E))
    got, _ = mod(x, is_causal=True)
    assert_close(got, want, torch.float64)


def test_is_causal_equals_triu_mask():
    mod = module()
    x = torch.randn(1, 8, E, dtype=torch.float64)
    future = torch.ones(8, 8, dtype=torch.bool).triu(1)
    assert_close(mod(x, is_causal=True)[0], mod(x, attn_mask=future)[0], torch.float64)


@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [9]])
def test_kv_cache_matches_full_causal_pass(chunks):
    mod = module(k=2)
    x = torch.randn(2, sum(chunks), E, dtype=torch.float64)
    full, _ = mod(x, is_causal=True)
    cache, outs, start = KVCache(), [], 0
    for c in chunks:
        outs.append(mod(x[:, start:start + c], is_causal=True, kv_cache=cache)[0])
        start += c
        assert len(cache) == start
    assert_close(torch.cat(outs, 1), full, torch.float64)


def test_need_weights_per_head_and_averaged():
    mod = module()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    out, w = mod(x, need_weights=True, average_attn_weights=False)
    assert w.shape == (2, H, 5, 5)
    assert_close(w.sum(-1), torch.ones(2, H, 5, dtype=torch.float64), torch.float64)
    out2, wm = mod(x, need_weights=True)
    assert_close(wm, w.mean(1), torch.float64)
    assert_close(out, out2, torch.float64)
    assert_close(out, mod(x)[0], torch.float64)


def test_dropout_only_in_training():
    mod = module(dropout=0.5)
    x = torch.randn(1, 6, E, dtype=torch.float64)
    assert_close(mod(x)[0], mod(x)[0], torch.float64)
    mod.train()
    torch.manual_seed(0)
    a = mod(x)[0]
    torch.manual_seed(1)
    assert (a - mod(x)[0]).abs().max() > 1e-3


def test_initialisation():
    mod = RelativeMultiheadAttention(256, 4, 64)
    d = 64
    std = math.sqrt(2.0 / (129 + d))
    for t in (mod.rel_k, mod.rel_v):
        assert t.shape == (129, d)
        assert abs(t.std().item() / std - 1) < 0.05 and abs(t.mean().item()) < 0.01
    bound = math.sqrt(6.0 / (256 + 256))  # Xavier-uniform
    assert mod.q_proj.weight.abs().max() <= bound and mod.q_proj.weight.abs().max() > 0.9 * bound
    assert mod.q_proj.bias.abs().max() == 0 and mod.out_proj.bias.abs().max() == 0
    assert RelativeMultiheadAttention(8, 2, Shaw(4, values=False)).rel_v is None


def test_gradients_reach_every_parameter():
    mod = module(share_heads=False)
    mod(torch.randn(2, 5, E, dtype=torch.float64), is_causal=True)[0].square().sum().backward()
    for name, p in mod.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(("ctor", "match"), [
    (dict(embed_dim=10, num_heads=3), r"embed_dim \(10\) must be a positive multiple of num_heads \(3\)"),
    (dict(embed_dim=8, num_heads=2, positions=-2), r"max_relative_position must be >= 0"),
    (dict(embed_dim=8, num_heads=2, backend="cuda"), r"backend must be one of .*got 'cuda'"),
    (dict(embed_dim=8, num_heads=2, dropout=1.5), r"dropout must be in \[0, 1\)"),
])
def test_constructor_errors(ctor, match):
    with pytest.raises(ValueError, match=match):
        RelativeMultiheadAttention(**ctor)


def test_forward_errors():
    mod = RelativeMultiheadAttention(8, 2, 2)
    with pytest.raises(ValueError, match=r"query must be \(B, N, 8\) or unbatched \(N, 8\); got \(1, 3, 4\)"):
        mod(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match=r"key must be \(B=1, M, 8\); got \(1, 4, 6\)"):
        mod(torch.randn(1, 3, 8), torch.randn(1, 4, 6))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, M\) = \(1, 3\); got \(1, 4\)"):
        mod(torch.randn(1, 3, 8), key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask 3-D must be \(B\*num_heads, N, M\)"):
        mod(torch.randn(1, 3, 8), attn_mask=torch.zeros(3, 3, 3, dtype=torch.bool))


def test_kv_cache_reorder_keeps_the_chosen_rows():
    """After ``reorder(index)`` the next call attends to the cached keys and values of rows ``index``: the same
    as a full causal pass over the reordered prefix followed by the new inputs."""
    mod = module(k=2)
    g = torch.Generator().manual_seed(3)
    prefix, new = torch.randn(3, 5, E, generator=g, dtype=torch.float64), torch.randn(3, 4, E, generator=g,
                                                                                      dtype=torch.float64)
    index = torch.tensor([1, 2, 1])
    cache = KVCache()
    mod(prefix, is_causal=True, kv_cache=cache)
    cache.reorder(index)
    assert len(cache) == 5
    got = mod(new, is_causal=True, kv_cache=cache)[0]
    want = mod(torch.cat([prefix[index], new], 1), is_causal=True)[0][:, 5:]
    assert_close(got, want, torch.float64)
    assert (want - mod(torch.cat([prefix, new], 1), is_causal=True)[0][:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("window,beyond,share_heads", [((4, 1), "clip", True), ((0, 3), "zero", False),
                                                       (2, "zero", True)])
def test_module_variants_equal_the_reference(window, beyond, share_heads):
    """Asymmetric windows and zero-beyond tables in the module: its heads' output is the numpy reference's."""
    from helpers import reference_output

    mod = module(k=window, beyond=beyond, share_heads=share_heads)
    left, right = (window, window) if isinstance(window, int) else window
    assert mod.rel_k.shape[-2] == left + right + 1
    x = torch.randn(2, 7, E, dtype=torch.float64)

    def split(t):
        return t.view(2, 7, H, E // H).transpose(1, 2)

    q, k, v = split(mod.q_proj(x)), split(mod.k_proj(x)), split(mod.v_proj(x))
    o = reference_output(q, k, v, mod.rel_k, mod.rel_v, max_relative_position=window, beyond=beyond,
                         is_causal=True)
    want = mod.out_proj(o.transpose(1, 2).reshape(2, 7, E))
    got, _ = mod(x, is_causal=True)
    assert_close(got, want, torch.float64)
    _, weights = mod(x, is_causal=True, need_weights=True, average_attn_weights=False)
    from relattn.reference import relative_attention as ref_attention

    _, ref_w = ref_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(),
                             mod.rel_k.detach().numpy(), None, max_relative_position=window, beyond=beyond,
                             is_causal=True, return_weights=True)
    assert_close(weights, torch.from_numpy(ref_w), torch.float64)


def test_tied_tables_are_one_parameter_used_on_both_sides():
    tied = module(tie=True)
    assert tied.rel_v is tied.rel_k
    assert sum(p is tied.rel_k for p in tied.parameters()) == 1
    assert {"rel_k", "rel_v"} <= set(tied.state_dict())
    untied = module()
    untied.load_state_dict(tied.state_dict())  # the same table on both sides, as two parameters
    assert torch.equal(untied.rel_k, untied.rel_v)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    torch.testing.assert_close(tied(x, is_causal=True)[0], untied(x, is_causal=True)[0], rtol=0, atol=0)
    tied(x, is_causal=True)[0].square().sum().backward()
    untied(x, is_causal=True)[0].square().sum().backward()
    assert_close(tied.rel_k.grad, untied.rel_k.grad + untied.rel_v.grad, torch.float64)
    reloaded = module(tie=True)
    reloaded.load_state_dict(tied.state_dict())
    assert reloaded.rel_v is reloaded.rel_k and torch.equal(reloaded.rel_k, tied.rel_k)


@pytest.mark.parametrize("kw,match", [
    (dict(tie=True, values=False), r"Shaw\(tie=True\) needs keys=True and values=True"),
    (dict(k=(3,)), r"max_relative_position as a pair must be \(left, right\)"),
    (dict(k=(2, -1)), "max_relative_position's right must be an int >= 0"),
    (dict(beyond="edge"), "beyond must be one of"),
])
def test_variant_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        module(**kw)


# ------------------------------------------------------------------------------------ the Transformer-XL option


def xl_formula(mod, x, *, pad=None, causal=False):
    """Transformer-XL's attention (Dai et al., 2019, appendix B; NeMo's and ESPnet's RelPositionMultiHeadAttention)
    written out in float64 from ``mod``'s parameters: ``p_r`` the sinusoid of position ``r = i - j`` (``sin``/``cos``
    of ``r / 10000^(2c/E)``) through ``pos_proj``, scores ``((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(D)``,
    ``r`` clipped to ``[-K, K]`` when the module has an int window. ``pad`` (B, N) True = padding key, right-aligned
    (the module's output is zero at padded positions)."""
    b, n, e = x.shape
    h, d = mod.num_heads, mod.head_dim

    def heads(t):
        return t.view(b, n, h, d).transpose(1, 2)

    q, k, v = heads(mod.q_proj(x)), heads(mod.k_proj(x)), heads(mod.v_proj(x))
    kk = mod.positions.max_relative_position
    pe = torch.zeros(n, n, e, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            r = i - j if kk is None else max(-kk, min(kk, i - j))
            for c in range(0, e, 2):
                angle = r / math.pow(10000.0, c / e)
                pe[i, j, c] = math.sin(angle)
                if c + 1 < e:
                    pe[i, j, c + 1] = math.cos(angle)
    p = mod.pos_proj(pe).view(n, n, h, d)
    scores = (torch.einsum("bhid,bhjd->bhij", q + mod.content_bias[:, None], k)
              + torch.einsum("bhid,ijhd->bhij", q + mod.position_bias[:, None], p)) / math.sqrt(d)
    if pad is not None:
        scores = scores.masked_fill(pad[:, None, None, :], -math.inf)
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    out = mod.out_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, n, e))
    return out if pad is None else out.masked_fill(pad[..., None], 0.0)  # right-aligned padding: zeros there


def xl_module(**kw):
    torch.manual_seed(0)
    return RelativeMultiheadAttention(E, H, TransformerXL(kw.pop("k", None)), dtype=torch.float64, **kw).eval()


@pytest.mark.parametrize("backend", ["auto", "dense", "blocked"])
@pytest.mark.parametrize("k", [None, 3])
def test_transformer_xl_equals_its_formula(backend, k):
    """Outputs and every parameter's gradient (projections, pos_proj, u, v) against the formula, with a padding
    mask; with K = 3 the offsets beyond are clipped (N = 7). The position terms matter."""
    mod = xl_module(k=k, backend=backend)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, E, generator=g, dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    go = torch.randn(2, 7, E, generator=g, dtype=torch.float64)
    params = [p for _, p in sorted(mod.named_parameters())]
    names = [name for name, _ in sorted(mod.named_parameters())]
    assert {"pos_proj.weight", "content_bias", "position_bias"} <= set(names) and "rel_k" not in names
    got = mod(x, key_padding_mask=pad)[0]
    want = xl_formula(mod, x, pad=pad)
    assert_close(got, want, torch.float64, "out")
    for name, a, w in zip(names, torch.autograd.grad(got, params, go), torch.autograd.grad(want, params, go),
                          strict=True):
        assert_close(a, w, torch.float64, f"d {name}")
        assert a.abs().max() > 0, name
    with torch.no_grad():
        mod.pos_proj.weight.zero_()
        mod.position_bias.zero_()
    assert (mod(x, key_padding_mask=pad)[0] - got).abs().max() > 1e-3  # the position term changed the answer


@pytest.mark.parametrize("chunks", [[1] * 6, [3, 1, 2]])
def test_transformer_xl_kv_cache_matches_full_causal_pass(chunks):
    """Decoding with a KVCache: the queries sit after the cached keys, the table covers their offsets."""
    mod = xl_module()
    x = torch.randn(2, sum(chunks), E, dtype=torch.float64)
    full = mod(x, is_causal=True)[0]
    assert_close(full, xl_formula(mod, x, causal=True), torch.float64, "full")
    cache, outs, start = KVCache(), [], 0
    for c in chunks:
        outs.append(mod(x[:, start:start + c], is_causal=True, kv_cache=cache)[0])
        start += c
    assert_close(torch.cat(outs, 1), full, torch.float64, "decoded")


def test_transformer_xl_weights_and_errors():
    mod = xl_module()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    out, w = mod(x, need_weights=True, average_attn_weights=False)
    assert_close(out, mod(x)[0], torch.float64) and w.shape == (2, H, 5, 5)
    assert "positions=TransformerXL()" in repr(mod) and \
        mod.state_dict().keys() >= {"pos_proj.weight", "content_bias"}
    for k in ((3, 1), -1, 2.0):
        with pytest.raises(ValueError, match=r"TransformerXL takes max_relative_position None \(no clipping\) or an "
                                             rf"int >= 0; got {re.escape(repr(k))}"):
            TransformerXL(k)
    for name in ("native", "triton"):
        from relattn.backends import BACKENDS

        if not BACKENDS[name].serves.position_query:
            with pytest.raises(ValueError, match=rf"backend '{name}' cannot serve this module: .*q_pos"):
                RelativeMultiheadAttention(E, H, TransformerXL(), backend=name)


# ------------------------------------------------------------------------------------ a T5 module from the schemes


def t5_oracle(mod, x, *, decoder: bool):
    """T5's self-attention written out in float64 from ``mod``'s parameters (Raffel et al., 2020; transformers'
    ``T5Attention``): scores ``q_i . k_j + b[h, bucket(j - i)]``, unscaled, the bucket the numpy reference's literal
    ``t5_bucket`` (causal in a decoder, which also forbids later keys), no relative terms in the values."""
    from relattn import reference as ref

    b, n, e = x.shape
    h, d = mod.num_heads, mod.head_dim

    def heads(t):
        return t.view(b, n, h, d).transpose(1, 2)

    buckets = mod.positions.max_relative_position
    bucket = torch.tensor([[ref.t5_bucket(j - i, buckets.num_buckets, buckets.max_distance, not decoder)
                            for j in range(n)] for i in range(n)])
    q, k, v = heads(mod.q_proj(x)), heads(mod.k_proj(x)), heads(mod.v_proj(x))
    scores = q @ k.transpose(-1, -2) + mod.rel_bias[:, bucket]
    if decoder:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return mod.out_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_t5_module_from_the_public_api_is_t5_attention_and_decodes_with_a_cache(decoder):
    """``RelativeMultiheadAttention(E, H, T5Bias(T5Buckets(...)), bias=False)``: the bias table (H, num_buckets), no
    a^K / a^V, scale 1, against the hand-written oracle (outputs and every gradient, lengths past max_distance so the
    log buckets and their saturation are met); a decoder decodes with a growing and a static KVCache to the oracle's
    rows, one token and a few at a time."""
    from relattn.positions import T5Buckets
    from relattn.schemes import T5Bias

    torch.manual_seed(3)
    mod = RelativeMultiheadAttention(E, H, T5Bias(T5Buckets(8, 10, not decoder)), bias=False, dtype=torch.float64)
    assert (mod.rel_k, mod.rel_v, mod.rel_q, mod.q_proj.bias) == (None, None, None, None)
    assert mod.rel_bias.shape == (H, 8) and sorted(mod.state_dict()) == [
        "k_proj.weight", "out_proj.weight", "q_proj.weight", "rel_bias", "v_proj.weight"]
    with torch.no_grad():
        mod.rel_bias.normal_(0, 2.0)  # large enough that a wrong bucket or scale is seen
    x = torch.randn(2, 23, E, dtype=torch.float64)
    got, want = mod(x, is_causal=decoder)[0], t5_oracle(mod, x, decoder=decoder)
    assert_close(got, want, torch.float64, "T5 attention")
    params = [p for _, p in sorted(mod.named_parameters())]
    go = torch.randn_like(got)
    for name, a, w in zip(sorted(dict(mod.named_parameters())), torch.autograd.grad(got, params, go),
                          torch.autograd.grad(want, params, go), strict=True):
        assert_close(a, w, torch.float64, f"d {name}")
    scaled = RelativeMultiheadAttention(E, H, T5Bias(T5Buckets(8, 10, not decoder), scale=None), bias=False,
                                        dtype=torch.float64)
    scaled.load_state_dict(mod.state_dict())
    assert (scaled(x, is_causal=decoder)[0] - want).abs().max() > 1e-3  # the scale of 1 matters
    if not decoder:
        return
    with torch.no_grad():
        for cache in (KVCache(), KVCache(max_len=23)):
            for chunks in ([1] * 23, [5, 1, 7, 10]):
                cache.reset()
                steps, start = [], 0
                for c in chunks:
                    steps.append(mod(x[:, start:start + c], is_causal=True, kv_cache=cache)[0])
                    start += c
                assert_close(torch.cat(steps, 1), want, torch.float64, f"decoded {chunks}")


def _schemes():
    from relattn.schemes import Disentangled, T5Bias

    return {"Shaw(3)": (Shaw(3), {"rel_k", "rel_v"}),
            "Shaw(3, values=False, position_to_content=True)": (Shaw(3, values=False, position_to_content=True),
                                                                {"rel_k", "rel_q"}),
            "Shaw(3, tie=True)": (Shaw(3, tie=True), {"rel_k", "rel_v"}),
            "Disentangled(3)": (Disentangled(3), {"rel_k", "rel_q"}),
            "Shaw(3, keys=False, values=False)": (Shaw(3, keys=False, values=False), set()),
            "T5Bias()": (T5Bias(), {"rel_bias"}),
            "TransformerXL()": (TransformerXL(), {"pos_proj.weight", "content_bias", "position_bias"})}


@pytest.mark.parametrize("name", list(_schemes()))
def test_each_scheme_keeps_the_state_dict_keys_the_flags_had(name):
    """Checkpoints of the flag-built module load into the scheme-built one: the parameters keep their names (written
    out here as the flags named them: relative_keys/values, position_to_content, tie_tables, relative_bias,
    transformer_xl), the scheme shows in the repr as written, and a state dict round-trips."""
    scheme, keys = _schemes()[name]
    projections = {f"{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")}
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(E, H, scheme)
    assert set(mod.state_dict()) == projections | keys and f"positions={name}," in repr(mod)
    other = RelativeMultiheadAttention(E, H, scheme)
    other.load_state_dict(mod.state_dict())
    x = torch.randn(2, 5, E)
    torch.testing.assert_close(other(x)[0], mod(x)[0], rtol=0, atol=0)


def test_positions_must_be_a_scheme_or_a_window():
    for bad in ("16", True, 2.5, {"K": 3}):
        with pytest.raises(TypeError, match=rf"positions must be a position scheme .* got {type(bad).__name__}"):
            RelativeMultiheadAttention(E, H, bad)
    assert RelativeMultiheadAttention(E, H, [2, 1]).positions == Shaw((2, 1))
    assert RelativeMultiheadAttention(E, H).positions == Shaw(16)
