"""Every path a user can take runs the same cases against the one oracle (``helpers.attention_ref``, float64,
outputs and gradients): the op on every backend that runs here, the module, and the module decoding through a
growing and a static ``KVCache``. The cases combine the features pairwise (grouped k/v heads with 1 < Hkv < H, one
and H, the position-to-content table ``rel_q``, shared and per-head tables, bool and float masks, causal, query
offsets, windows, zero beyond them and DeBERTa's ``LogBuckets``), so an argument dropped on one path, or a feature
miscomputed only where it meets another, fails here. A backend refusing a case must do so by its declaration (a
``ValueError`` naming the backend). The patched Hugging Face attention runs the same oracle's formula in
``test_pos_to_content.py`` (DeBERTa: rel_k, rel_q, LogBuckets, padding) and against the unpatched models in
``tests/integrations/``; the context-parallel ring in ``test_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, attention_ref, reference_output, unavailable_here
from relattn import BACKENDS, KVCache, RelativeMultiheadAttention, relative_attention
from relattn.positions import LogBuckets
from relattn.schemes import Shaw

RUNNABLE = [name for name in ["auto", *BACKENDS] if unavailable_here(name) is None]

pytestmark = pytest.mark.usefixtures("small_tiles", "one_thread")

H, D, DV, B = 4, 4, 3, 2
E = H * D

# name: (Hkv, rel_q, tables, mask, is_causal, positions, beyond, N, M, query_offset) -- pairwise over the first six
CASES = {
    "gqa-relq-shared-causal": (2, True, "shared", None, True, 3, "clip", 7, 7, 0),
    "gqa-relq-per-head-bool-zero": (2, True, "per_head", "bool", False, (2, 4), "zero", 5, 9, 4),
    "gqa-per-head-float-causal-buckets": (2, False, "per_head", "float", True, LogBuckets(4, 6, 9), "clip", 9, 9, 0),
    "gqa-relq-shared-bool-buckets": (2, True, "shared", "bool", False, LogBuckets(3), "clip", 6, 8, 2),
    "mqa-relq-per-head-float": (1, True, "per_head", "float", False, 3, "clip", 6, 6, -2),
    "mqa-shared-bool-causal-buckets": (1, False, "shared", "bool", True, LogBuckets(4, 6, 9), "clip", 4, 9, 5),
    "mqa-relq-shared-window": (1, True, "shared", None, False, (3, 1), "clip", 7, 7, 0),
    "mha-relq-shared-float-causal-window": (4, True, "shared", "float", True, (2, 4), "clip", 7, 7, 0),
    "mha-per-head-buckets": (4, False, "per_head", None, False, LogBuckets(3), "clip", 8, 8, 0),
    "mha-shared-bool-causal": (4, False, "shared", "bool", True, 2, "zero", 7, 7, 0),
}


def _rows(positions):
    if isinstance(positions, LogBuckets):
        return positions.rows
    left, right = (positions, positions) if isinstance(positions, int) else positions
    return left + right + 1


def _draw(shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def _op_mask(kind, n, m, g):
    """The op's form: a (B, 1, 1, M) bool key padding mask (True = may attend), or a (1, H, N, M) float one with a
    forbidden key in every row."""
    if kind == "bool":
        keep = torch.ones(B, 1, 1, m, dtype=torch.bool)
        keep[1, ..., m // 2:] = False
        return keep
    if kind == "float":
        mask = torch.randn(1, H, n, m, generator=g, dtype=torch.float64)
        mask[..., 1] = float("-inf")
        return mask
    return None


def _op_case(name):
    hkv, rel_q, tables, mask, causal, positions, beyond, n, m, off = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    rows = _rows(positions)
    lead = () if tables == "shared" else (H,)
    q, k, v = _draw((B, H, n, D), g), _draw((B, hkv, m, D), g), _draw((B, hkv, m, DV), g)
    rel_k, rel_v = _draw((*lead, rows, D), g), _draw((*lead, rows, DV), g)
    rq = _draw((*lead, rows, D), g) if rel_q else None
    kw = dict(max_relative_position=positions, beyond=beyond, attn_mask=_op_mask(mask, n, m, g), is_causal=causal,
              query_offset=off)
    return [q, k, v, rel_k, rel_v, rq], kw, torch.randn(B, H, n, DV, generator=g, dtype=torch.float64)


def _present(inputs):
    return [t for t in inputs if t is not None]


@pytest.mark.parametrize("name", list(CASES))
def test_the_oracle_is_the_specification_on_every_case(name):
    """Where the numpy specification takes the case (a window, not LogBuckets; k and v repeated to H heads), the
    oracle's output is the specification's."""
    inputs, kw, _ = _op_case(name)
    if isinstance(kw["max_relative_position"], LogBuckets):
        pytest.skip("the specification takes windows; LogBuckets are checked against transformers' map elsewhere")
    q, k, v, rel_k, rel_v, rel_q = inputs
    k, v = (t.repeat_interleave(H // t.shape[1], 1) for t in (k, v))
    want = reference_output(q, k, v, rel_k, rel_v, rel_q=None if rel_q is None else rel_q.detach().numpy(), **kw)
    assert_close(attention_ref(*inputs[:5], rel_q=rel_q, **kw), want, torch.float64, "oracle")


def _op_params():
    """(case, backend) for every backend that runs here and "auto"; interpreted Triton (about a second a case) on the
    cases with 1 < Hkv < H in the fast part, on the others among the slow tests."""
    for name in CASES:
        for backend in RUNNABLE:
            slow = backend == "triton" and not 1 < CASES[name][0] < H
            yield pytest.param(name, backend, id=f"{name}-{backend}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize(("name", "backend"), list(_op_params()))
def test_the_op_on_every_backend(name, backend):
    """The output and the gradients of q, k, v and every table, or a refusal by the backend's declaration."""
    inputs, kw, go = _op_case(name)
    try:
        out = relative_attention(*inputs[:5], rel_q=inputs[5], enable_gqa=True, backend=backend, **kw)
    except ValueError as exc:
        assert backend not in ("auto", "dense") and f"backend {backend!r} cannot serve these inputs" in str(exc)
        return
    want = attention_ref(*inputs[:5], rel_q=inputs[5], **kw)
    assert_close(out, want, torch.float64, f"{backend} out")
    got = torch.autograd.grad(out, _present(inputs), go)
    for which, a, w in zip("q k v rel_k rel_v rel_q".split(), got, torch.autograd.grad(want, _present(inputs), go),
                           strict=False):
        assert_close(a, w, torch.float64, f"{backend} d{which}")


# ------------------------------------------------------------------------------------------ the module and the cache


def _module(name):
    hkv, rel_q, tables, _, _, positions, beyond, *_ = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    scheme = Shaw(positions, beyond=beyond, position_to_content=rel_q, share_heads=tables == "shared")
    mod = RelativeMultiheadAttention(E, H, scheme, num_kv_heads=hkv, dtype=torch.float64)
    with torch.no_grad():
        for proj in (mod.q_proj, mod.k_proj, mod.v_proj, mod.out_proj):
            proj.bias.normal_()  # (zero at init: a dropped bias would pass)
    return mod


def _module_masks(name, n, g):
    """The case's mask as nn.MultiheadAttention takes it (``key_padding_mask`` True = padding, a float
    ``attn_mask`` (N, M)) and in the op's form."""
    kind = CASES[name][3]
    mask = _op_mask(kind, n, n, g)
    if kind == "bool":
        return dict(key_padding_mask=~mask[:, 0, 0]), mask
    if kind == "float":
        mask = mask[0, :1]  # one (N, M) mask for all heads
        return dict(attn_mask=mask[0]), mask[None]
    return {}, None


def _heads(x, heads):
    return x.unflatten(-1, (heads, D)).transpose(1, 2)


def _module_oracle(mod, x, op_mask, causal, start, stop):
    """Queries ``start:stop`` of self-attention on ``x`` (B, N, E) against keys ``:stop``, the plain way: the
    module's projections and tables, the attention by the oracle."""
    q = _heads(mod.q_proj(x[:, start:stop]), H)
    k, v = (_heads(p(x[:, :stop]), mod.num_kv_heads) for p in (mod.k_proj, mod.v_proj))
    mask = None if op_mask is None else op_mask[..., :stop] if op_mask.shape[-2] == 1 else \
        op_mask[..., start:stop, :stop]
    out = attention_ref(q, k, v, mod.rel_k, mod.rel_v, rel_q=mod.rel_q,
                        max_relative_position=mod.positions.max_relative_position, beyond=mod.positions.beyond,
                        attn_mask=mask, is_causal=causal, query_offset=start)
    return mod.out_proj(out.transpose(1, 2).flatten(2))


def _step_masks(masks, start, stop):
    if "key_padding_mask" in masks:
        return dict(key_padding_mask=masks["key_padding_mask"][:, :stop])
    if "attn_mask" in masks:
        return dict(attn_mask=masks["attn_mask"][start:stop, :stop])
    return {}


STEPS = ((0, 3), (3, 4), (4, 7))


@pytest.mark.parametrize("name", list(CASES))
def test_the_module_whole_and_decoding_through_both_caches(name):
    """The module on the whole sequence, then one chunk at a time through a growing KVCache (outputs and the
    gradients of every parameter and of the input) and a static one (outputs, under no_grad): each chunk's queries
    against the keys so far, at their positions. (With a key padding mask the whole call is packed, zeros at the
    padded positions; the cached calls attend each padded query to the real keys, as nn.MultiheadAttention.)"""
    causal = CASES[name][4]
    n = STEPS[-1][1]
    mod = _module(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, n, E, generator=g, dtype=torch.float64, requires_grad=True)
    masks, op_mask = _module_masks(name, n, g)
    go = torch.randn(B, n, E, generator=g, dtype=torch.float64)
    params = [x, *mod.parameters()]

    want = _module_oracle(mod, x, op_mask, causal, 0, n)
    if "key_padding_mask" in masks:  # right-aligned: the whole call runs packed, zeros at padded positions
        want = want.masked_fill(masks["key_padding_mask"][..., None], 0.0)
    want_grads = torch.autograd.grad(want, params, go)
    got = mod(x, **masks, is_causal=causal)[0]
    assert_close(got, want, torch.float64, "module")
    for i, (a, w) in enumerate(zip(torch.autograd.grad(got, params, go), want_grads, strict=True)):
        assert_close(a, w, torch.float64, f"module grad {i}")

    want = torch.cat([_module_oracle(mod, x, op_mask, causal, a, b) for a, b in STEPS], 1)
    want_grads = torch.autograd.grad(want, params, go)
    cache = KVCache()
    got = torch.cat([mod(x[:, a:b], **_step_masks(masks, a, b), is_causal=causal, kv_cache=cache)[0]
                     for a, b in STEPS], 1)
    assert_close(got, want, torch.float64, "growing cache")
    for i, (a, w) in enumerate(zip(torch.autograd.grad(got, params, go), want_grads, strict=True)):
        assert_close(a, w, torch.float64, f"growing cache grad {i}")
    with torch.no_grad():
        static = KVCache(max_len=n)
        got = torch.cat([mod(x[:, a:b], **_step_masks(masks, a, b), is_causal=causal, kv_cache=static)[0]
                         for a, b in STEPS], 1)
    assert_close(got, want, torch.float64, "static cache")
