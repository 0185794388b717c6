"""Silent wrong answers found by trying the library as a new user would (issue 35), each pinned here: expanded
(row stride 0) inputs on the native kernel, the module's remembered padding, compiled against eager at padded
positions, a NaN in a table row only masked pairs use, and the mutation survivors (cross-length windows wider
than the queries, finite float padding masks; dropout in eval mode on patched models is in
``tests/integrations/test_padding_hf.py``)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, attention_ref, backend_params, oracle_grads, reference_output
from relattn import BACKENDS, RelativeMultiheadAttention, relative_attention, relative_attention_varlen
from relattn.positions import LogBuckets
from relattn.schemes import TransformerXL

B, H, N, D, K = 2, 4, 7, 8, 3


def _expanded(which: str, dtype, *, seed=0):
    """q, k, v (B, H, N, D) float64 leaves, ``which`` of them a (B, H, 1, D) row expanded to N rows (stride 0), and
    shared tables."""
    g = torch.Generator().manual_seed(seed)
    x = []
    for name in ("q", "k", "v"):
        rows = 1 if name == which else N
        t = torch.randn(B, H, rows, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        x.append(t)
    rk, rv = (torch.randn(2 * K + 1, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
              for _ in range(2))
    return x, rk, rv


@pytest.mark.parametrize("backend", backend_params(["native", "triton"]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_kernels_read_expanded_rows_as_the_oracle(which, dtype, backend):
    """A broadcast row (``expand()``: row stride 0, a memory token or a null key) on the kernels: the oracle's
    output and gradients, and planned (a repeated no-grad call handing the user's tensors to the kernel)."""
    leaves, rk, rv = _expanded(which, dtype)
    q, k, v = (t.expand(B, H, N, D) for t in leaves)
    assert min(t.stride(-2) for t in (q, k, v)) == 0
    go = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    kw = dict(max_relative_position=K, is_causal=True)
    want, want_grads = oracle_grads((q, k, v, rk, rv), go, **kw)
    out = relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    assert_close(out, want, dtype, "out")
    got = torch.autograd.grad(out, [*leaves, rk, rv], go)
    wants = [w.sum(-2, keepdim=True) if t.shape[-2] == 1 else w for w, t in zip(want_grads, leaves, strict=False)]
    for name, a, w in zip(("dq", "dk", "dv", "drk", "drv"), got, [*wants, *want_grads[3:]], strict=True):
        assert_close(a, w, dtype, name)
    with torch.no_grad():  # the plan's direct kernel call: the first call plans, the second runs the plan
        for _ in range(2):
            assert_close(relative_attention(q, k, v, rk, rv, backend=backend, **kw), want, dtype, "planned out")


@pytest.mark.parametrize("backend", backend_params(["native", "triton"]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_kernels_packed_read_expanded_rows_as_the_oracle(which, dtype, backend):
    """The packed op on the kernels with ``which`` a (1, H, D) row expanded to all T rows (stride 0): each sequence
    the oracle's, outputs and gradients."""
    lengths = (N, 4)
    t_all = sum(lengths)
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(1 if name == which else t_all, H, D, generator=g, dtype=torch.float64).to(dtype)
              .requires_grad_() for name in ("q", "k", "v")]
    rk, rv = (torch.randn(2 * K + 1, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
              for _ in range(2))
    q, k, v = (t.expand(t_all, H, D) for t in leaves)
    cu = torch.tensor([0, lengths[0], t_all])
    out = relative_attention_varlen(q, k, v, rk, rv, cu_seqlens_q=cu, max_relative_position=K, is_causal=True,
                                    backend=backend)
    want = torch.cat([attention_ref(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), rk, rv,
                                    max_relative_position=K, is_causal=True)[0].transpose(0, 1)
                      for a, b in ((0, lengths[0]), (lengths[0], t_all))])
    assert_close(out, want.detach(), dtype, "out")
    go = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = torch.autograd.grad(out, [*leaves, rk, rv], go)
    wants = torch.autograd.grad(want, [*leaves, rk, rv], go.double())
    for name, a, w in zip(("dq", "dk", "dv", "drk", "drv"), got, wants, strict=True):
        assert_close(a, w, dtype, name)


# ------------------------------------------------------------------------------ the module's remembered padding


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_the_module_reads_a_padding_mask_changed_without_a_version_bump(how):
    """A key_padding_mask whose values change through ``.data`` or a numpy view (neither bumps ``_version``): the
    next call reads the new lengths, as a fresh mask of those values gives."""
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(16, 4, 3, dtype=torch.float64)
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    mask = torch.arange(8)[None, :] >= torch.tensor([8, 5, 2])[:, None]
    first = mod(x, key_padding_mask=mask)[0]
    assert torch.equal(first[1, 5:], torch.zeros(3, 16, dtype=torch.float64))
    version = mask._version
    if how == "data":
        mask.data[1, 3:] = True
    else:
        mask.numpy()[1, 3:] = True
    assert mask._version == version
    got = mod(x, key_padding_mask=mask)[0]
    want = mod(x, key_padding_mask=mask.clone())[0]
    assert torch.equal(got[1, 3:], torch.zeros(5, 16, dtype=torch.float64))
    assert_close(got, want, torch.float64)


# ------------------------------------------------------------------------------ compiled against eager at padding


@pytest.mark.slow
@pytest.mark.parametrize("config", [dict(positions=3), dict(positions=TransformerXL(), num_kv_heads=2)],
                         ids=["shaw", "transformer-xl"])
def test_the_compiled_module_gives_eager_zeros_and_gradients_at_padding(config):
    """torch.compile(fullgraph=True) of the module with a key_padding_mask (right-aligned bool and -inf, enough
    padding to pack eagerly; left-aligned, which neither zeroes): eager's outputs, zeros at the padded positions of
    right padding, and eager's gradients (none into padded positions)."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    mod = RelativeMultiheadAttention(16, 4, dtype=torch.float64, **config)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.3)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, 16, generator=g, dtype=torch.float64)
    go = torch.randn(3, 8, 16, generator=g, dtype=torch.float64)
    right = torch.arange(8)[None, :] >= torch.tensor([8, 5, 2])[:, None]
    masks = {"bool": right, "-inf": torch.zeros(3, 8, dtype=torch.float64).masked_fill(right, float("-inf")),
             "left": right.flip(1)}
    for name, mask in masks.items():
        outs = []
        for run in (mod, compiled):
            xin = x.clone().requires_grad_()
            out = run(xin, key_padding_mask=mask, is_causal=True)[0]
            outs.append((out, *torch.autograd.grad(out, [xin, *mod.parameters()], go, allow_unused=True)))
        if name != "left":
            zeros = torch.zeros(int(right.sum()), 16, dtype=torch.float64)
            for out, dx, *_ in outs:
                assert torch.equal(out[right], zeros) and torch.equal(dx[right], zeros), name
        for (pname, _), a, w in zip([("out", None), ("dx", None), *mod.named_parameters()], outs[1], outs[0],
                                    strict=True):
            if w is None:
                assert a is None or not a.any(), f"{name} {pname}"
            else:
                assert_close(a, w, torch.float64, f"{name} {pname}")


# ------------------------------------------------------------------------------ a NaN in a row no allowed pair meets


def _nan_table_case(where: str, *, nan: bool):
    """q, k, v (1, 2, 6, 4), per-head rel_k and rel_bias, shared rel_v and rel_q (K = 2) float64 leaves; with
    ``nan``, row ``K + 1`` (offset +1, met only by pairs that is_causal masks) of table ``where`` is NaN, else
    zero."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    tables = {"rel_k": torch.randn(2, 5, 4, generator=g, dtype=torch.float64),
              "rel_v": torch.randn(5, 4, generator=g, dtype=torch.float64),
              "rel_q": torch.randn(5, 4, generator=g, dtype=torch.float64),
              "rel_bias": torch.randn(2, 5, 1, generator=g, dtype=torch.float64)}
    tables[where][..., 3, :] = float("nan") if nan else 0.0
    tables["rel_bias"] = tables["rel_bias"][..., 0]
    return [t.requires_grad_() for t in (q, k, v, tables["rel_k"], tables["rel_v"], tables["rel_q"],
                                         tables["rel_bias"])]


@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
@pytest.mark.parametrize("where", ["rel_k", "rel_v", "rel_q", "rel_bias"])
def test_a_nan_in_a_table_row_only_masked_pairs_meet_reaches_nothing(backend, where):
    """is_causal=True with a NaN in row K + 1 (offset +1: only future keys meet it) of a table or of the scalar bias
    rel_bias: on every backend, and in the reference, the answer of that row at zero, outputs and gradients; the
    row's own gradient is zero."""
    kw = dict(max_relative_position=2, is_causal=True)
    clean = _nan_table_case(where, nan=False)
    want = relative_attention(*clean[:5], rel_q=clean[5], rel_bias=clean[6], backend="dense", **kw)
    want_grads = torch.autograd.grad(want.square().sum(), clean)
    spec = reference_output(*clean[:5], rel_q=clean[5], rel_bias=clean[6], **kw)
    assert_close(want, spec, torch.float64, "dense, no NaN")
    x = _nan_table_case(where, nan=True)
    assert_close(reference_output(*x[:5], rel_q=x[5], rel_bias=x[6], **kw), spec, torch.float64, "reference")
    out = relative_attention(*x[:5], rel_q=x[5], rel_bias=x[6], backend=backend, **kw)
    assert_close(out, want, torch.float64, f"{backend} out")
    got = torch.autograd.grad(out.square().sum(), x)
    names = ("q", "k", "v", "rel_k", "rel_v", "rel_q", "rel_bias")
    for name, a, w in zip(names, got, want_grads, strict=True):
        assert_close(a, w, torch.float64, f"{backend} d{name}")
    row = got[names.index(where)]
    assert not (row[..., 3] if where == "rel_bias" else row[..., 3, :]).any(), row.shape


# ------------------------------------------------------------------------------ stale compile caches


def test_the_ops_names_carry_their_schemas_so_a_stale_compile_cache_never_calls_them():
    """torch.compile's caches are keyed by the traced graph, which names the custom ops it calls. An upgrade that
    changes an op's arguments (simulated: the same kernel name registered again with a dropout seed and rate) gets
    ops of other names, registered beside the old ones: a graph the old code traced (what a stale cache holds)
    names only the old ops, whose schema is the one it was traced against, and the new code's graph names none of
    them. The real backends' forward and backward carry one shared version."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from relattn.backends import BACKENDS
    from relattn.backends._common import StatsOps

    def forward(q, k, v, rel_k, rel_v, mask, seed=None, **kw):
        return v * 2, q.new_zeros(q.shape[:-1])

    def backward(grad_out, q, k, v, *rest, **kw):
        return torch.zeros_like(q), torch.zeros_like(k), 2 * grad_out, None, None

    old = StatsOps("stale_cache_probe", forward, backward)
    new = StatsOps("stale_cache_probe", forward, backward, dropout=True)
    assert old.fwd_name != new.fwd_name and old.bwd_name != new.bwd_name
    assert all(n.startswith("relattn::stale_cache_probe_") for n in (old.fwd_name, new.fwd_name))
    q = torch.randn(1, 1, 3, 2)
    traced_old = make_fx(lambda q: old.fwd_op(q, q, q, None, None, None, 1, False, 1.0, 0)[0])(q)
    seed = torch.zeros(2, dtype=torch.int64)
    traced_new = make_fx(lambda q: new.fwd_op(q, q, q, None, None, None, seed, 1, False, 0.0, 1.0, 0)[0])(q)
    short = lambda name: name.split("::")[1]  # noqa: E731
    assert short(old.fwd_name) in traced_old.code and short(old.fwd_name) not in traced_new.code
    assert torch.equal(traced_old(q), 2 * q)  # the stale graph still finds the op it was traced against
    for backend in BACKENDS.values():
        for ops in (backend.stats, backend.packed):
            if ops is not None:
                version = ops.fwd_name.rsplit("_", 1)[1]
                assert ops.fwd_name == f"relattn::{ops.name}_fwd_{version}" and len(version) == 8
                assert ops.bwd_name == f"relattn::{ops.name}_bwd_{version}"


# ------------------------------------------------------------------------------ packed: a window wider than the queries

LENGTHS_Q, LENGTHS_K = (2, 3, 1, 0), (6, 9, 4, 3)  # fewer queries than keys: each sequence a step after a cache
PACKED_OPTIONS = {
    "tables": dict(max_relative_position=5),
    "rel_q": dict(max_relative_position=5, rel_q=True),
    "transformer-xl": dict(max_relative_position=6, biases=True, rel_v=False),
    "beyond-zero": dict(max_relative_position=5, beyond="zero"),
    "window": dict(max_relative_position=(7, 4)),
    "log-buckets": dict(max_relative_position=LogBuckets(4, 6, 12), rel_q=True),
    "gqa": dict(max_relative_position=5, heads_kv=1),
}


@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("option", list(PACKED_OPTIONS))
def test_packed_cross_lengths_with_a_window_wider_than_the_queries(backend, option, causal):
    """The packed op with fewer queries than keys per sequence and a window wider than the longest query length
    (the tables must serve the keys' offsets, down to ``-(M - 1)``): each sequence is the oracle's on its own rows
    (its queries at the end of its keys), outputs and every gradient, for each option of the op."""
    opt = dict(PACKED_OPTIONS[option])
    window = opt.pop("max_relative_position")
    h, hkv, d = 2, opt.pop("heads_kv", 2), 4
    rows = 2 * window.span if isinstance(window, LogBuckets) else sum(window) + 1 if isinstance(window, tuple) \
        else 2 * window + 1
    g = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = rnd(sum(LENGTHS_Q), h, d), rnd(sum(LENGTHS_K), hkv, d), rnd(sum(LENGTHS_K), hkv, d)
    kw = dict(max_relative_position=window, is_causal=causal, beyond=opt.pop("beyond", "clip"),
              enable_gqa=hkv != h)
    rel_k = rnd(h, rows, d)
    rel_v = rnd(rows, d) if opt.pop("rel_v", True) else None
    if opt.pop("rel_q", False):
        kw["rel_q"] = rnd(rows, d)
    if opt.pop("biases", False):
        kw.update(content_bias=rnd(h, d), position_bias=rnd(h, d))
    assert not opt
    leaves = [t for t in (q, k, v, rel_k, rel_v, kw.get("rel_q"), kw.get("content_bias"), kw.get("position_bias"))
              if t is not None]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in (LENGTHS_Q, LENGTHS_K))
    out = relative_attention_varlen(q, k, v, rel_k, rel_v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend,
                                    **kw)
    parts = []
    for s, (n, m) in enumerate(zip(LENGTHS_Q, LENGTHS_K, strict=True)):
        one = [t[a:a + length].transpose(0, 1)[None] for t, a, length in
               ((q, cu_q[s], n), (k, cu_k[s], m), (v, cu_k[s], m))]
        ref_kw = {key: val for key, val in kw.items() if key != "enable_gqa"}
        parts.append(attention_ref(*one, rel_k, rel_v, query_offset=m - n, **ref_kw)[0].transpose(0, 1))
    want = torch.cat(parts)
    assert_close(out, want.detach(), torch.float64, f"{backend} {option} out")
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, go)
    wants = torch.autograd.grad(want, leaves, go)
    for i, (a, w) in enumerate(zip(got, wants, strict=True)):
        assert_close(a, w, torch.float64, f"{backend} {option} grad {i}")


# ------------------------------------------------------------------ every mask convention on every path that packs


def test_the_module_packs_a_float_padding_mask_only_when_it_is_padding_alone():
    """A float key_padding_mask of right-aligned ``-inf`` padding packs (zeros at the padding, the masked call's
    answer elsewhere); one that also adds finite values to real keys (or pads with a large finite value) is no
    padding mask alone: the masked call, nn.MultiheadAttention's answer, everywhere."""
    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(16, 4, 3, dtype=torch.float64)
    x = torch.randn(3, 8, 16, dtype=torch.float64)
    pad = torch.arange(8)[None, :] >= torch.tensor([8, 5, 2])[:, None]
    inf = torch.zeros(3, 8, dtype=torch.float64).masked_fill(pad, float("-inf"))
    finite = inf.clone()
    finite[0, 1], finite[1, 3] = -2.0, 0.7
    large = torch.zeros(3, 8, dtype=torch.float64).masked_fill(pad, -1e4)
    for mask in (pad, inf):
        got = mod(x, key_padding_mask=mask)[0]
        masked = mod(x, key_padding_mask=mask, need_weights=True)[0]  # weights asked for: the masked call
        assert torch.equal(got[pad], torch.zeros(int(pad.sum()), 16, dtype=torch.float64))
        assert_close(got[~pad], masked[~pad], torch.float64)
    for mask in (finite, large):
        got = mod(x, key_padding_mask=mask)[0]
        assert_close(got, mod(x, key_padding_mask=mask, need_weights=True)[0], torch.float64)
        assert got[1, 5:].abs().min() > 0


def test_transformers_masks_pack_only_when_they_are_right_padding_alone():
    """The "transformers" mask rule: 2-D keep masks, 4-D bool, and 4-D float masks of 0 and
    ``finfo.min`` or ``-inf`` pack; a 4-D float mask with any other value (a finite bias on a real key, a
    large-but-not-min pad), rows that differ, or left padding does not (the masked call runs it)."""
    from relattn.padding import packing_of

    lengths = torch.tensor([6, 3, 1])
    keep = torch.arange(6)[None, :] < lengths[:, None]
    low = torch.finfo(torch.float32).min
    additive = torch.zeros(3, 1, 1, 6).masked_fill(~keep[:, None, None], low)
    packs = {"2-D": keep.long(), "4-D bool": keep[:, None, None].expand(3, 1, 6, 6),
             "4-D min": additive, "4-D -inf": torch.zeros(3, 1, 1, 6).masked_fill(~keep[:, None, None], -torch.inf)}
    for name, mask in packs.items():
        packing = packing_of(mask, "transformers")
        assert packing is not None and packing.lengths.tolist() == [6, 3, 1], name
    biased = additive.clone()
    biased[1, 0, 0, 0] = -2.0
    rows = additive.expand(3, 1, 6, 6).clone()
    rows[0, 0, 2, 1] = low
    refused = {"finite bias": biased, "large pad": torch.zeros(3, 1, 1, 6).masked_fill(~keep[:, None, None], -1e4),
               "rows differ": rows, "left": additive.flip(-1)}
    for name, mask in refused.items():
        assert packing_of(mask, "transformers") is None, name
