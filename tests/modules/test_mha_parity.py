"""RelativeMultiheadAttention as a drop-in for nn.MultiheadAttention: from_mha, layouts, kdim/vdim, unbatched.

With both tables at zero, ``from_mha(mha)`` must give mha's outputs, weights and gradients (float64, within
the one tolerance policy of tests/helpers/__init__.py).
"""

import pytest
import torch
from torch import nn

from helpers import assert_close
from relattn import RelativeMultiheadAttention, relative_attention
from relattn.modules import upgrade_mha
from relattn.schemes import Shaw

E, H = 12, 3


def make_mha(*, batch_first=True, kdim=None, vdim=None, bias=True, seed=0):
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                dtype=torch.float64)
    with torch.no_grad():  # non-zero biases, so a bias copied to the wrong projection shows
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_()
    return mha.eval()


def inputs(shape_q, shape_kv, kdim=E, vdim=E, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, E, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*shape_kv, kdim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shape_kv, vdim, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def masks(kind, b, n, m, g):
    kw = {}
    if kind in ("bool", "both"):
        kw["attn_mask"] = torch.rand(n, m, generator=g) > 0.6
        kw["attn_mask"][:, 0] = False
    if kind == "float":
        kw["attn_mask"] = torch.randn(n, m, generator=g, dtype=torch.float64)
    if kind == "3d":
        kw["attn_mask"] = torch.randn((b or 1) * H, n, m, generator=g, dtype=torch.float64)
    if kind in ("padding", "both"):
        pad = torch.zeros(b or 1, m, dtype=torch.bool)
        pad[-1, m - 2:] = True
        kw["key_padding_mask"] = pad if b else pad[0]
    return kw


def mha_param_grads(mha):
    """mha's gradients named as RelativeMultiheadAttention's parameters."""
    if mha.in_proj_weight is not None:
        wq, wk, wv = mha.in_proj_weight.grad.chunk(3)
    else:
        wq, wk, wv = mha.q_proj_weight.grad, mha.k_proj_weight.grad, mha.v_proj_weight.grad
    out = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv, "out_proj.weight": mha.out_proj.weight.grad}
    if mha.in_proj_bias is not None:
        bq, bk, bv = mha.in_proj_bias.grad.chunk(3)
        out.update({"q_proj.bias": bq, "k_proj.bias": bk, "v_proj.bias": bv, "out_proj.bias": mha.out_proj.bias.grad})
    return out


def run(module, q, k, v, kw, need_weights):
    for t in (q, k, v):
        t.grad = None
    out, w = module(q, k, v, need_weights=need_weights, **kw)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype)
    loss = (out * weight).sum() + (0.0 if w is None else (w * torch.randn(w.shape, generator=g, dtype=w.dtype)).sum())
    loss.backward()
    return out.detach(), None if w is None else w.detach(), [t.grad.clone() for t in (q, k, v)]


LAYOUTS = ["batch_first", "seq_first", "unbatched"]
MASKS = ["none", "bool", "float", "3d", "padding", "both"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_from_mha_reproduces_outputs_weights_and_gradients(layout, mask_kind, need_weights):
    b, n, m = (None if layout == "unbatched" else 2), 5, 7
    mha = make_mha(batch_first=layout != "seq_first")
    mod = RelativeMultiheadAttention.from_mha(mha, positions=2)
    assert mod.rel_k.abs().sum() == 0 and mod.rel_v.abs().sum() == 0 and not mod.training
    if layout == "unbatched":
        q, k, v = inputs((n,), (m,))
    elif layout == "batch_first":
        q, k, v = inputs((b, n), (b, m))
    else:
        q, k, v = inputs((n, b), (m, b))
    kw = masks(mask_kind, b, n, m, torch.Generator().manual_seed(2))
    want, want_w, want_g = run(mha, q, k, v, kw, need_weights)
    got, got_w, got_g = run(mod, q, k, v, kw, need_weights)
    assert got.shape == want.shape == q.shape
    assert_close(got, want, torch.float64)
    if need_weights:
        assert_close(got_w, want_w, torch.float64)
    else:
        assert got_w is None
    for a, c in zip(got_g, want_g, strict=True):
        assert_close(a, c, torch.float64)
    theirs = mha_param_grads(mha)
    for name, p in mod.named_parameters():
        if name.startswith("rel_"):
            assert p.grad is not None and p.grad.abs().sum() > 0  # tables at zero still learn
        else:
            assert_close(p.grad, theirs[name], torch.float64)


@pytest.mark.parametrize("bias", [True, False])
def test_from_mha_kdim_vdim_and_no_bias(bias):
    mha = make_mha(kdim=5, vdim=7, bias=bias)
    mod = RelativeMultiheadAttention.from_mha(mha, 3)
    assert mod.k_proj.weight.shape == (E, 5) and mod.v_proj.weight.shape == (E, 7)
    assert (mod.q_proj.bias is None) == (not bias)
    q, k, v = inputs((2, 4), (2, 9), kdim=5, vdim=7)
    mask = torch.ones(4, 4 + 5, dtype=torch.bool).triu(5 + 1)  # a causal mask for queries placed at 5..8
    want, want_w, want_g = run(mha, q, k, v, {"attn_mask": mask}, True)
    got, got_w, got_g = run(mod, q, k, v, {"attn_mask": mask}, True)
    assert_close(got, want, torch.float64)
    assert_close(got_w, want_w, torch.float64)
    for a, c in zip(got_g, want_g, strict=True):
        assert_close(a, c, torch.float64)
    theirs = mha_param_grads(mha)
    for name, p in mod.named_parameters():
        if not name.startswith("rel_"):
            assert_close(p.grad, theirs[name], torch.float64)


def test_is_causal_with_its_mask_equals_mha():
    mha = make_mha()
    mod = RelativeMultiheadAttention.from_mha(mha, 2)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    want = mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    assert_close(mod(x, x, x, attn_mask=causal, is_causal=True)[0], want, torch.float64)
    assert_close(mod(x, is_causal=True)[0], want, torch.float64)  # here is_causal needs no mask


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
def test_forward_takes_mha_positional_order():
    mha = make_mha()
    mod = RelativeMultiheadAttention.from_mha(mha, 2)
    x, mem = torch.randn(2, 4, E, dtype=torch.float64), torch.randn(2, 6, E, dtype=torch.float64)
    pad = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    attn = torch.randn(4, 6, dtype=torch.float64)
    # (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
    want, want_w = mha(x, mem, mem, pad, True, attn, False, False)
    got, got_w = mod(x, mem, mem, pad, True, attn, False, False)
    assert got_w.shape == (2, H, 4, 6)
    assert_close(got, want, torch.float64)
    assert_close(got_w, want_w, torch.float64)


def test_state_dict_of_mha_loads_via_from_mha(tmp_path):
    saved = make_mha(seed=3)
    torch.save(saved.state_dict(), tmp_path / "mha.pt")
    fresh = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    fresh.load_state_dict(torch.load(tmp_path / "mha.pt"))
    mod = RelativeMultiheadAttention.from_mha(fresh.eval(), 4)
    x = torch.randn(3, 5, E, dtype=torch.float64)
    assert_close(mod(x)[0], saved(x, x, x)[0], torch.float64)


def test_tables_matter_after_from_mha():
    # Guard: the parity above is not because tables are ignored -- non-zero tables change the output.
    mha = make_mha()
    mod = RelativeMultiheadAttention.from_mha(mha, Shaw(2, share_heads=False))
    x = torch.randn(1, 6, E, dtype=torch.float64)
    with torch.no_grad():
        mod.rel_k.normal_()
    assert (mod(x)[0] - mha(x, x, x)[0]).abs().max() > 1e-3


def test_layouts_agree_with_tables_and_kdim():
    # Non-zero tables: seq-first and unbatched inputs give the batch-first result, rearranged; and with kdim/vdim
    # the module equals the op on its projections (tables apply with query i at i, key j at j).
    torch.manual_seed(0)
    bf = RelativeMultiheadAttention(E, H, Shaw(2, share_heads=False), kdim=5, vdim=7, dtype=torch.float64).eval()
    sf = RelativeMultiheadAttention(E, H, Shaw(2, share_heads=False), kdim=5, vdim=7, batch_first=False,
                                    dtype=torch.float64).eval()
    sf.load_state_dict(bf.state_dict())
    q, k, v = (t.detach() for t in inputs((2, 4), (2, 9), kdim=5, vdim=7))
    pad = torch.tensor([[False] * 9, [False] * 6 + [True] * 3])
    out, w = bf(q, k, v, pad, True, average_attn_weights=False)
    out_sf, w_sf = sf(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), pad, True, average_attn_weights=False)
    assert_close(out_sf, out.transpose(0, 1), torch.float64)
    assert_close(w_sf, w, torch.float64)
    out1, w1 = bf(q[1], k[1], v[1], pad[1], True, average_attn_weights=False)
    assert_close(out1, out[1], torch.float64)
    assert_close(w1, w[1], torch.float64)

    def heads(t):
        return t.view(2, -1, H, E // H).transpose(1, 2)

    o = relative_attention(heads(bf.q_proj(q)), heads(bf.k_proj(k)), heads(bf.v_proj(v)), bf.rel_k, bf.rel_v,
                           max_relative_position=2, attn_mask=~pad[:, None, None, :])
    assert_close(out, bf.out_proj(o.transpose(1, 2).reshape(2, 4, E)), torch.float64)


@pytest.mark.parametrize("flag", ["add_bias_kv", "add_zero_attn"])
def test_bias_kv_and_zero_attn_are_refused_by_name(flag):
    with pytest.raises(TypeError, match=flag):  # not a parameter: the key it appends would have no position
        RelativeMultiheadAttention(E, H, 2, **{flag: True})
    with pytest.raises(ValueError, match=rf"mha has {flag}=True"):
        RelativeMultiheadAttention.from_mha(nn.MultiheadAttention(E, H, **{flag: True}), 2)


def test_layout_and_dim_errors():
    with pytest.raises(TypeError, match="mha must be an nn.MultiheadAttention, got Linear"):
        RelativeMultiheadAttention.from_mha(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="kdim must be a positive int, got 0"):
        RelativeMultiheadAttention(E, H, 2, kdim=0)
    sf = RelativeMultiheadAttention(E, H, 2, batch_first=False, kdim=5)
    with pytest.raises(ValueError, match=r"query must be \(N, B, 12\) or unbatched \(N, 12\); got \(3, 2, 5\)"):
        sf(torch.randn(3, 2, 5), torch.randn(3, 2, 5), torch.randn(3, 2, 12))
    with pytest.raises(ValueError, match=r"key must be \(M, B=2, 5\); got \(4, 3, 5\)"):
        sf(torch.randn(3, 2, E), torch.randn(4, 3, 5), torch.randn(4, 3, E))
    with pytest.raises(ValueError, match=r"key must be \(M, B=2, 5\); got \(3, 2, 12\)"):
        sf(torch.randn(3, 2, E))  # self-attention needs kdim == embed_dim
    with pytest.raises(ValueError, match=r"key must be unbatched \(M, 5\) like query; got \(1, 4, 5\)"):
        sf(torch.randn(3, E), torch.randn(1, 4, 5), torch.randn(1, 4, E))
    bf = RelativeMultiheadAttention(E, H, 2)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(M,\) = \(3,\); got \(1, 3\)"):
        bf(torch.randn(3, E), key_padding_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key and value must have the same length; got 4 and 5"):
        bf(torch.randn(1, 3, E), torch.randn(1, 4, E), torch.randn(1, 5, E))


@pytest.mark.parametrize("training", [False, True])
def test_upgrades_torch_transformer_layers_in_place(training):
    # The one-line upgrade inside torch's own layers: same outputs and input gradients while the tables are zero
    # (the encoder layer's inference fast path must not bypass the module), different once a table is not.
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H - 1, 24, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).double().train(training)
    dec = nn.TransformerDecoderLayer(E, H - 1, 24, dropout=0.0).double().train(training)  # seq-first
    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 5, E, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randn(4, 2, E, generator=g, dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)

    def run():
        memory = enc(src, src_key_padding_mask=pad)
        out = dec(tgt, memory.transpose(0, 1), tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
        return out, torch.autograd.grad(out.square().sum(), (src, tgt))

    def inference():  # no grad: where nn.TransformerEncoderLayer would take its fused fast path in eval mode
        with torch.no_grad():
            return enc(src, src_key_padding_mask=pad)

    want, want_grads = run()
    want_inference = inference()
    for layer in enc.layers:
        layer.self_attn = RelativeMultiheadAttention.from_mha(layer.self_attn, 2)
    dec.self_attn = RelativeMultiheadAttention.from_mha(dec.self_attn, 2)
    dec.multihead_attn = RelativeMultiheadAttention.from_mha(dec.multihead_attn, 2)
    got, got_grads = run()
    assert_close(got, want, torch.float64)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b, torch.float64)
    # the encoder's own output at its padded positions differs (the packed self-attention gives zeros there; no
    # real position reads them, so the decoder's output and every gradient above are the same)
    assert_close(inference()[~pad], want_inference[~pad], torch.float64)
    with torch.no_grad():
        enc.layers[0].self_attn.rel_k.normal_()
    assert (run()[0] - want).abs().max() > 1e-3
    assert (inference() - want_inference).abs().max() > 1e-3  # the module ran: no fast path bypassed it


def test_a_row_with_no_key_gives_the_output_bias_where_mha_gives_nan():
    # Difference 6 of the class docstring, as written there.
    mha = make_mha()
    mod = RelativeMultiheadAttention.from_mha(mha, 2)
    x = torch.randn(1, 4, E, dtype=torch.float64)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2] = True  # query 2 may attend to nothing
    want, want_w = mha(x, x, x, attn_mask=mask)
    got, w = mod(x, x, x, attn_mask=mask, need_weights=True)
    assert want[0, 2].isnan().all() and want_w[0, 2].isnan().all()
    torch.testing.assert_close(got[0, 2], mod.out_proj.bias, rtol=0, atol=0)
    assert torch.equal(w[0, 2], torch.zeros(4, dtype=torch.float64))
    keep = torch.tensor([0, 1, 3])
    assert_close(got[0, keep], want[0, keep], torch.float64)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_upgrade_mha_swaps_every_attention_of_a_default_transformer():
    # nn.Transformer with its defaults (nested-tensor fast path on): after upgrade_mha, eval with padding, with and
    # without grad, computes what it did; the names and the other parameters are kept.
    torch.manual_seed(0)
    model = nn.Transformer(E, H - 1, 2, 1, 24, dropout=0.0, batch_first=True).double().eval()
    g = torch.Generator().manual_seed(1)
    src, tgt = (torch.randn(2, n, E, generator=g, dtype=torch.float64) for n in (5, 4))
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def run():
        out = model(src, tgt, src_key_padding_mask=pad, memory_key_padding_mask=pad)
        with torch.no_grad():
            return out, model(src, tgt, src_key_padding_mask=pad, memory_key_padding_mask=pad)

    want, want_no_grad = run()
    names = {n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    assert upgrade_mha(model, 3) is model
    assert names == {n for n, m in model.named_modules() if isinstance(m, RelativeMultiheadAttention)}
    assert len(names) == 2 + 2 * 1 and not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    got, got_no_grad = run()
    assert_close(got, want, torch.float64)
    assert_close(got_no_grad, want_no_grad, torch.float64)
