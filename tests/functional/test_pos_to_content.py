"""Conformance of the position-to-content term ``rel_q`` (``k_j . a^Q[idx_ij]``) and of DeBERTa's log-bucket
positions: the numpy reference, every backend that serves the term and the patched DeBERTa attention, each
against an independent float64 implementation of the formula written here, outputs and all gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import assert_close, backend_params, np64, require_backend
from relattn import BACKENDS, relative_attention, relative_attention_weights
from relattn import functional as fn
from relattn import reference as ref
from relattn.backends import Backend, Serves, blocked, choose, not_supported_reasons
from relattn.backends.blocked import blocked_backward, blocked_forward
from relattn.positions import LogBuckets, log_bucket_position
from relattn.schemes import Disentangled

SERVING = [name for name, b in BACKENDS.items() if b.serves.pos_to_content]
REFUSING = [name for name, b in BACKENDS.items() if not b.serves.pos_to_content]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- the formula, written independently


def bucket64(r: int, buckets: int, max_position: int) -> int:
    """DeBERTa's log bucket of a signed position ``r``, in Python floats (float64)."""
    mid = buckets // 2
    if buckets <= 0 or abs(r) <= mid:
        return r
    log_pos = math.ceil(math.log(abs(r) / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    return log_pos if r > 0 else -log_pos  # sign(r) * log_pos (negative when the map folds back)


def shaw_rows(n, m, left, right, *, query_offset=0, beyond="clip"):
    """(N, M) rows of a window's table, None where ``beyond="zero"`` gives no embedding."""
    rows = []
    for i in range(n):
        row = []
        for j in range(m):
            r = j - (i + query_offset)
            row.append(None if beyond == "zero" and not -left <= r <= right else min(max(r, -left), right) + left)
        rows.append(row)
    return rows


def deberta_rows(n, span, buckets, max_position):
    """(N, N) DeBERTa rows ``t(i, j) = clamp(delta(i - j) + span, 0, 2 span - 1)``."""
    return [[min(max(bucket64(i - j, buckets, max_position) + span, 0), 2 * span - 1) for j in range(n)]
            for i in range(n)]


def formula(q, k, v, rel_k, rel_q, rows, *, scale, mask=None, causal_offset=None):
    """Float64 torch: ``softmax((q.k + q.a^K[t] + k.a^Q[t]) * scale + mask) @ v``, t from ``rows`` (None: no
    term), tables (R, D) or (H, R, D). Rows with nothing to attend to give zeros."""
    b, h, n, d = q.shape
    m = k.shape[2]
    s = q @ k.transpose(-1, -2)
    for table, side in ((rel_k, "q"), (rel_q, "k")):
        if table is None:
            continue
        table = table.expand(h, *table.shape[-2:])
        gathered = torch.stack([torch.stack([table[:, r] if r is not None else table.new_zeros(h, d)
                                             for r in row], 1) for row in rows], 1)  # (H, N, M, D)
        if side == "q":
            s = s + torch.einsum("bhid,hijd->bhij", q, gathered)
        else:
            s = s + torch.einsum("bhjd,hijd->bhij", k, gathered)
    s = s * scale
    if mask is not None:
        s = s + (torch.zeros(mask.shape, dtype=s.dtype).masked_fill(~mask, -math.inf) if mask.dtype == torch.bool
                 else mask)
    if causal_offset is not None:
        future = torch.arange(m)[None, :] > torch.arange(n)[:, None] + causal_offset
        s = s.masked_fill(future, -math.inf)
    peak = s.amax(-1, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    e = torch.exp(s - peak)
    total = e.sum(-1, keepdim=True)
    return (e / torch.where(total == 0, torch.ones_like(total), total)) @ v


def draw(b, h, n, m, d, dv, rows, *, shared_q=False, with_k=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = rnd(b, h, n, d), rnd(b, h, m, d), rnd(b, h, m, dv)
    rel_k = rnd(h, rows, d) if with_k else None
    rel_q = rnd(rows, d) if shared_q else rnd(h, rows, d)
    return q, k, v, rel_k, rel_q


def all_grads(out, inputs, seed=1):
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    present = [t for t in inputs if t is not None]
    return torch.autograd.grad(out, present, go)


# Cases: (b, h, n, m, d, dv, window, beyond, causal, query_offset, shared_q, with_k, mask kind)
CASES = [
    (2, 3, 9, 9, 5, 4, 3, "clip", False, 0, False, True, None),
    (1, 2, 9, 9, 5, 5, 3, "clip", False, 0, True, False, "bool"),  # p2c alone, a shared table, a padded row
    (1, 2, 7, 12, 4, 3, 2, "clip", True, 5, False, True, "float"),  # decoding: N != M, offset M - N
    (1, 2, 12, 7, 4, 4, (3, 1), "clip", False, -3, False, True, None),  # asymmetric window
    (1, 2, 8, 8, 3, 3, (2, 4), "zero", True, 0, False, True, "bool"),
    (1, 1, 5, 5, 4, 4, 9, "clip", False, 0, False, True, None),  # K >= N
    (1, 2, 1, 1, 3, 3, 0, "clip", False, 0, True, True, None),  # N = 1, K = 0
    (1, 2, 97, 97, 59, 7, 8, "clip", False, 0, False, True, "bool"),  # awkward N, D
]
IDS = [f"n{c[2]}m{c[3]}w{c[6]}-{c[7]}-{'causal' if c[8] else 'full'}-off{c[9]}-{c[12]}" for c in CASES]


def case(c):
    b, h, n, m, d, dv, window, beyond, causal, off, shared_q, with_k, mask_kind = c
    left, right = (window, window) if isinstance(window, int) else window
    inputs = draw(b, h, n, m, d, dv, left + right + 1, shared_q=shared_q, with_k=with_k)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, n, m, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[..., 0, :] = False  # a query with nothing to attend to
    elif mask_kind == "float":
        mask = torch.randn(b, h, n, m, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kw = dict(max_relative_position=window, beyond=beyond, attn_mask=mask, is_causal=causal, query_offset=off)
    want = formula(*inputs[:2], inputs[2], inputs[3], inputs[4],
                   shaw_rows(n, m, left, right, query_offset=off, beyond=beyond), scale=1 / math.sqrt(d),
                   mask=mask, causal_offset=off if causal else None)
    return inputs, kw, want


# ------------------------------------------------------------------------------------ reference and backends


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_reference_is_the_formula(c):
    (q, k, v, rel_k, rel_q), kw, want = case(c)
    kw["attn_mask"] = np64(kw["attn_mask"])
    got = ref.relative_attention(np64(q), np64(k), np64(v), np64(rel_k), None, rel_q=np64(rel_q), **kw)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=0, atol=1e-12)


def test_reference_loops_equal_the_vectorised_scores():
    rng = np.random.RandomState(0)
    emb = ref.RelativePositionEmbedding.from_tables(rng.randn(7, 4), rng.randn(7, 3), (2, 4), a_Q=rng.randn(7, 4))
    queries, keys = rng.randn(6, 4), rng.randn(9, 4)
    loops = ref.relative_attention_scores(queries, keys, emb, query_offset=2)
    np.testing.assert_allclose(ref.relative_attention_scores_vectorized(queries, keys, emb, query_offset=2), loops,
                               atol=1e-12)
    without = ref.relative_attention_scores(queries, keys, ref.RelativePositionEmbedding.from_tables(
        emb.a_K, emb.a_V, (2, 4)), query_offset=2)
    assert np.abs(loops - without).max() > 0.1  # the term is there


@pytest.mark.parametrize("backend", backend_params([*SERVING, "auto"]))
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_backends_are_the_formula_outputs_and_gradients(backend, c):
    inputs, kw, want = case(c)
    q, k, v, rel_k, rel_q = inputs
    got = relative_attention(q, k, v, rel_k, None, rel_q=rel_q, backend=backend, **kw)
    assert_close(got, want, torch.float64, "out")
    for name, a, w in zip(("q", "k", "v", "rel_k", "rel_q"), all_grads(got, inputs), all_grads(want, inputs),
                          strict=False):
        assert_close(a, w, torch.float64, f"d{name}")


@pytest.mark.parametrize("backend", backend_params(SERVING))
def test_float32_within_the_dtype_tolerance(backend):
    inputs, kw, want = case(CASES[0])
    low = [t.detach().float().requires_grad_() if t is not None else None for t in inputs]
    got = relative_attention(*low[:4], None, rel_q=low[4], backend=backend, **kw)
    assert_close(got, want, torch.float32, "out")
    for a, w in zip(all_grads(got, low), all_grads(want, inputs), strict=True):
        assert_close(a, w, torch.float32, "grad")


@pytest.mark.parametrize("block", [1, 3, 128])
def test_blocked_any_key_block_and_deterministic_backward(block):
    (q, k, v, rel_k, rel_q), kw, _ = case(CASES[2])
    call = fn.validate(q, k, v, rel_k, None, rel_q=rel_q, dropout_p=0.0, scale=None, **kw)
    args = (call.q, call.k, call.v, call.rel_k, None, call.mask, torch.tensor(0))
    opts = dict(max_relative_position=call.max_relative_position, is_causal=call.is_causal, dropout_p=0.0,
                scale=call.scale, query_offset=call.query_offset, rel_q=call.rel_q)
    out, lse = blocked_forward(*args, **opts, block=block)
    whole, _ = blocked_forward(*args, **opts, block=1000)
    assert_close(out, whole, torch.float64, "out")
    go = torch.randn_like(out)
    first = blocked_backward(go, *args, out, lse, **opts, block=block)
    again = blocked_backward(go, *args, out, lse, **opts, block=block)
    assert len(first) == 6 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True) if a is not None)


@pytest.mark.parametrize("c", [CASES[0], CASES[2], CASES[7]], ids=[IDS[0], IDS[2], IDS[7]])
def test_native_bins_across_tiles_key_segments_and_grouped_heads(c, small_tiles):
    """Rows cross several key blocks and the backward splits each head's keys into segments (each owning its
    keys' bins); k and v grouped (two query heads per key/value head). Two runs give the same bits."""
    require_backend("native")
    small_tiles(native=(3, 5), native_splits=2)
    (q, k, v, rel_k, rel_q), kw, _ = case(c)
    kw.pop("attn_mask")
    k, v = (t.detach()[:, :1].requires_grad_() for t in (k, v))
    q = q.detach().repeat(1, 2, 1, 1)[:, : max(2, q.shape[1] - q.shape[1] % 2)].requires_grad_()
    h = q.shape[1]
    rel_k, rel_q = (t.detach()[:1].expand(h, *t.shape[1:]).contiguous().requires_grad_() for t in (rel_k, rel_q))
    inputs = (q, k, v, rel_k, rel_q)
    got = relative_attention(*inputs[:4], None, rel_q=rel_q, enable_gqa=True, backend="native", **kw)
    want = relative_attention(*inputs[:4], None, rel_q=rel_q, enable_gqa=True, backend="blocked", **kw)
    assert_close(got, want, torch.float64, "out")
    first = all_grads(got, inputs)
    for name, a, w in zip("q k v rel_k rel_q".split(), first, all_grads(want, inputs), strict=True):
        assert_close(a, w, torch.float64, f"d{name}")
    again = relative_attention(*inputs[:4], None, rel_q=rel_q, enable_gqa=True, backend="native", **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, all_grads(again, inputs), strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemm16", [True, False], ids=["gemm16", "float32-copies"])
def test_native_16_bit_within_twice_plain_pytorch(dtype, gemm16, kernel_settings):
    """16-bit inputs on both of the kernel's paths (16-bit GEMMs forced, and the float32 copies a CPU without 16-bit
    instructions takes): within 2x the error of the formula run in plain 16-bit PyTorch, outputs and gradients."""
    require_backend("native")
    from relattn.backends import native

    if gemm16 and not torch.ops.relattn_native.has_gemm16(dtype):
        pytest.skip(f"this libtorch exports no {dtype} GEMM")
    kernel_settings(native, gemm16=gemm16)
    inputs, kw, want = case(CASES[4])  # an asymmetric zero-beyond window, causal, a bool mask
    low = [t.detach().to(dtype).requires_grad_() for t in inputs]
    got = relative_attention(*low[:4], None, rel_q=low[4], backend="native", **kw)
    n, m = got.shape[2], inputs[1].shape[2]
    rows = shaw_rows(n, m, 2, 4, beyond="zero")
    plain = formula(*low[:4], low[4], rows, scale=1 / math.sqrt(low[0].shape[-1]), mask=kw["attn_mask"],
                    causal_offset=0)
    assert_close(got, want, dtype, "out", yardstick=plain)
    for name, a, w, y in zip("q k v rel_k rel_q".split(), all_grads(got, low), all_grads(want, inputs),
                             all_grads(plain, low), strict=True):
        assert_close(a, w, dtype, f"d{name}", yardstick=y)


def test_gradcheck_blocked_with_rel_q_and_dropout():
    q, k, v, rel_k, rel_q = draw(1, 2, 5, 6, 3, 3, 5)
    seed = torch.tensor(7)

    def f(q, k, v, rel_k, rel_q):
        return blocked.OPS.fwd_op(q, k, v, rel_k, None, None, seed, 2, False, 0.3, 0.5, 0, rel_q)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, rel_k, rel_q), fast_mode=True)


def test_weights_include_the_term():
    (q, k, v, rel_k, rel_q), kw, _ = case(CASES[0])
    kw.pop("attn_mask")
    w = relative_attention_weights(q, k, rel_k, rel_q=rel_q, **kw)
    out = relative_attention(q, k, v, rel_k, None, rel_q=rel_q, backend="blocked", **kw)
    assert_close(w @ v, out, torch.float64, "weights @ v")


def test_backends_without_the_term_refuse_it_by_declaration():
    (q, k, v, rel_k, rel_q), kw, _ = case(CASES[0])
    call = fn.validate(q, k, v, rel_k, None, rel_q=rel_q, dropout_p=0.0, scale=None, **kw)
    assert {"dense", "blocked", "native", "triton"} <= set(SERVING)
    without = Backend("without", lambda c: c.q, Serves(), "a backend declaring no position-to-content term")
    assert any("rel_q" in r for r in not_supported_reasons(without, call))
    for name in REFUSING:
        assert any("rel_q" in r for r in not_supported_reasons(BACKENDS[name], call)), name
        with pytest.raises(ValueError, match="rel_q"):
            relative_attention(q, k, v, rel_k, None, rel_q=rel_q, backend=name, **kw)
    big = torch.zeros(1, 1, 700, 4, dtype=torch.float64)
    call = fn.validate(big, big, big, None, None, rel_q=torch.zeros(7, 4, dtype=torch.float64),
                       max_relative_position=3, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None,
                       query_offset=0)
    # past dense's crossover: a kernel with no (N, M) tensor
    assert choose(call).name == ("blocked" if BACKENDS["native"].unavailable() else "native")


def test_rel_q_is_validated_like_the_key_table():
    (q, k, v, rel_k, rel_q), kw, _ = case(CASES[0])
    with pytest.raises(ValueError, match="rel_q"):
        relative_attention(q, k, v, rel_k, None, rel_q=rel_q[:, :-1], **kw)
    with pytest.raises(TypeError, match="rel_q"):
        relative_attention(q, k, v, rel_k, None, rel_q=rel_q.float(), **kw)
    with pytest.raises(TypeError, match="rel_q"):
        relative_attention(q, k, v, rel_k, None, rel_q=rel_q.tolist(), **kw)


# ------------------------------------------------------------------------------------------ log buckets


# (256, 64): a small config's buckets wider than its positions, where transformers' map folds back
@pytest.mark.parametrize(("buckets", "max_position"), [(8, 20), (16, 64), (256, 512), (256, 64)])
def test_log_buckets_are_transformers_and_the_float64_formula(buckets, max_position):
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    r = torch.arange(-2000, 2001)
    got = log_bucket_position(r, buckets, max_position)
    assert torch.equal(got, make_log_bucket_position(r, buckets, max_position).long())
    assert got.tolist() == [bucket64(x, buckets, max_position) for x in r.tolist()]


@pytest.mark.parametrize("positions", [LogBuckets(4, 8, 20), LogBuckets(6), LogBuckets(8, 16, 64),
                                       LogBuckets(16, 16, 5)])
@pytest.mark.parametrize("length", [1, 3, 30, 200])
def test_expanded_table_gives_each_offset_its_row(positions, length):
    kk = positions.max_relative_position(-(length - 1), length - 1)
    assert kk <= length - 1
    table = torch.randn(positions.rows, 3, dtype=torch.float64)
    expanded = positions.expand(table, kk)
    span = positions.span
    for r in range(-(length - 1), length):
        row = min(max(bucket64(-r, positions.buckets, positions.max_position) + span, 0), 2 * span - 1)
        assert torch.equal(expanded[min(max(r, -kk), kk) + kk], table[row]), r


def test_log_buckets_are_checked():
    with pytest.raises(ValueError, match="span"):
        LogBuckets(0)
    with pytest.raises(TypeError, match="buckets"):
        LogBuckets(4, 2.0, 20)
    with pytest.raises(ValueError, match="max_position"):
        LogBuckets(4, 8, 5)  # max_position = buckets // 2 + 1: the log divides by log(1) = 0
    q = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="beyond"):
        relative_attention(q, q, q, torch.zeros(8, 2, dtype=torch.float64), max_relative_position=LogBuckets(4),
                           beyond="zero")
    with pytest.raises(ValueError, match="rel_k"):
        relative_attention(q, q, q, torch.zeros(9, 2, dtype=torch.float64), max_relative_position=LogBuckets(4))


@pytest.mark.parametrize("backend", backend_params([*SERVING, "auto"]))
@pytest.mark.parametrize(("positions", "n"), [(LogBuckets(4, 8, 20), 37), (LogBuckets(5), 13), (LogBuckets(3), 2)])
def test_log_bucket_positions_are_the_deberta_formula(backend, positions, n):
    """DeBERTa's rows t(i, j) = clamp(delta(i - j) + span, 0, 2 span - 1) over compact tables of 2 span rows:
    outputs and gradients back to the compact tables, both terms, a padding mask."""
    q, k, v, rel_k, rel_q = draw(2, 2, n, n, 4, 3, positions.rows, seed=n)
    mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
    mask[1, ..., n // 2:] = False
    scale = 1 / math.sqrt(3 * 4)
    got = relative_attention(q, k, v, rel_k, None, rel_q=rel_q, max_relative_position=positions, attn_mask=mask,
                             scale=scale, backend=backend)
    rows = deberta_rows(n, positions.span, positions.buckets, positions.max_position)
    want = formula(q, k, v, rel_k, rel_q, rows, scale=scale, mask=mask)
    assert_close(got, want, torch.float64, "out")
    inputs = (q, k, v, rel_k, rel_q)
    for name, a, w in zip("q k v rel_k rel_q".split(), all_grads(got, inputs), all_grads(want, inputs),
                          strict=True):
        assert_close(a, w, torch.float64, f"d{name}")


# ------------------------------------------------------------------------------------ DeBERTa's attention


def _deberta_attention(pos_att_type, *, buckets, share, heads=2, hidden=8, max_relative=12):
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    config = DebertaV2Config(hidden_size=hidden, num_attention_heads=heads, relative_attention=True,
                             pos_att_type=pos_att_type, position_buckets=buckets, max_relative_positions=max_relative,
                             share_att_key=share, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return DisentangledSelfAttention(config).double().eval()


def _deberta_formula(att, x, rel_embeddings, mask):
    """The issue's formula from the module's own weights, float64, independently of both implementations."""
    b, n, _ = x.shape
    h = att.num_attention_heads

    def heads(t):
        return t.view(*t.shape[:-1], h, -1).transpose(-2, -3)

    q, k, v = heads(att.query_proj(x)), heads(att.key_proj(x)), heads(att.value_proj(x))
    c2p, p2c = "c2p" in att.pos_att_type, "p2c" in att.pos_att_type
    table = rel_embeddings[: 2 * att.pos_ebd_size]
    a_k = heads(att.key_proj(table) if att.share_att_key else att.pos_key_proj(table)) if c2p else None
    a_q = heads(att.query_proj(table) if att.share_att_key else att.pos_query_proj(table)) if p2c else None
    rows = deberta_rows(n, att.pos_ebd_size, att.position_buckets, att.max_relative_positions)
    scale = 1 / float(np.sqrt(np.float32(q.shape[-1] * (1 + c2p + p2c))))  # transformers' sqrt is float32
    out = formula(q, k, v, a_k, a_q, rows, scale=scale, mask=mask[:, None, None, :])
    return out.transpose(1, 2).flatten(2)


KINDS = [(["c2p", "p2c"], 8, True), (["c2p", "p2c"], -1, False), (["p2c"], 8, False), (["c2p"], -1, True)]


@pytest.mark.parametrize(("pos_att_type", "buckets", "share"), KINDS)
def test_transformers_attention_and_reference_are_the_formula(pos_att_type, buckets, share):
    """transformers' own DisentangledSelfAttention, and the numpy reference on its expanded tables, against the
    formula (the reference is checked against transformers, not only against relattn)."""
    from relattn.integrations.deberta import positions as deberta_positions

    att = _deberta_attention(pos_att_type, buckets=buckets, share=share)
    n = 29
    x = torch.randn(2, n, 8, dtype=torch.float64)
    rel_embeddings = torch.randn(2 * att.pos_ebd_size, 8, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 20:] = False
    want = _deberta_formula(att, x, rel_embeddings, mask)
    pair = (mask[:, None, :, None] & mask[:, None, None, :]).long()
    hf, _ = att(x, pair, rel_embeddings=rel_embeddings)
    assert_close(hf[0], want[0], torch.float64, "transformers")
    assert_close(hf[1, :20], want[1, :20], torch.float64, "transformers, real tokens")

    positions = deberta_positions(att)
    kk = positions.max_relative_position(-(n - 1), n - 1)
    heads = att.num_attention_heads
    table = rel_embeddings[: positions.rows]
    with torch.no_grad():
        proj = [(att.key_proj if share else getattr(att, "pos_key_proj", None), "c2p"),
                (att.query_proj if share else getattr(att, "pos_query_proj", None), "p2c")]
        tables = [positions.expand(p(table).view(-1, heads, 4).transpose(0, 1), kk).numpy()
                  if kind in pos_att_type else None for p, kind in proj]
        q, k, v = (t(x).view(2, n, heads, 4).transpose(1, 2).numpy()
                   for t in (att.query_proj, att.key_proj, att.value_proj))
    out = ref.relative_attention(q, k, v, tables[0], None, rel_q=tables[1], max_relative_position=kk,
                                 attn_mask=mask[:, None, None, :].numpy(),
                                 scale=1 / float(np.sqrt(np.float32(4 * (1 + len(pos_att_type))))))
    got = torch.from_numpy(out).transpose(1, 2).flatten(2)
    assert_close(got, want, torch.float64, "reference")


@pytest.mark.parametrize("backend", backend_params([*SERVING, "auto"]))
@pytest.mark.parametrize(("pos_att_type", "buckets", "share"), KINDS)
def test_patched_module_is_the_formula(backend, pos_att_type, buckets, share):
    """The patched DisentangledSelfAttention, outputs and gradients of every parameter and input."""
    from relattn.integrations.transformers import patch

    att = _deberta_attention(pos_att_type, buckets=buckets, share=share)
    patch(att, backend=backend)
    n = 23
    x = torch.randn(2, n, 8, dtype=torch.float64, requires_grad=True)
    rel_embeddings = torch.randn(2 * att.pos_ebd_size, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, 15:] = False
    got, _ = att(x, mask, rel_embeddings=rel_embeddings)
    want = _deberta_formula(att, x, rel_embeddings, mask)
    assert_close(got, want, torch.float64, "out")
    inputs = [x, rel_embeddings, *att.parameters()]
    go = torch.randn(got.shape, dtype=torch.float64)
    for i, (a, w) in enumerate(zip(torch.autograd.grad(got, inputs, go, allow_unused=True),
                                   torch.autograd.grad(want, inputs, go, allow_unused=True), strict=True)):
        if w is None:
            assert a is None or not a.abs().any(), i
        else:
            assert_close(a, w, torch.float64, f"grad {i}")


# ------------------------------------------------------------------------------------------------ the module


@pytest.mark.parametrize("backend", backend_params([*SERVING, "auto"]))
@pytest.mark.parametrize("positions", [LogBuckets(4, 8, 20), 3], ids=["log-buckets", "clip-3"])
def test_module_with_position_to_content_is_the_formula(backend, positions):
    """RelativeMultiheadAttention(position_to_content=True) against the float64 formula on its own projections:
    outputs and the gradients of every parameter (both tables, the projections), with a key padding mask."""
    from relattn import RelativeMultiheadAttention

    torch.manual_seed(5)
    n, e, h = 19, 12, 3
    mod = RelativeMultiheadAttention(e, h, Disentangled(positions, share_heads=False), backend=backend,
                                     dtype=torch.float64)
    assert mod.rel_q.shape == mod.rel_k.shape == (h, table_rows_of(positions), e // h)
    x = torch.randn(2, n, e, dtype=torch.float64)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, 13:] = True
    got = mod(x, key_padding_mask=pad)[0]

    def heads(t):
        return t.view(2, n, h, e // h).transpose(1, 2)

    q, k, v = heads(mod.q_proj(x)), heads(mod.k_proj(x)), heads(mod.v_proj(x))
    if isinstance(positions, LogBuckets):
        rows = deberta_rows(n, positions.span, positions.buckets, positions.max_position)
    else:
        rows = shaw_rows(n, n, positions, positions)
    ctx = formula(q, k, v, mod.rel_k, mod.rel_q, rows, scale=1 / math.sqrt(e // h), mask=~pad[:, None, None, :])
    want = mod.out_proj(ctx.transpose(1, 2).flatten(2)).masked_fill(pad[..., None], 0.0)  # zeros at padding
    assert_close(got, want, torch.float64, "out")
    params = [p for _, p in mod.named_parameters()]
    go = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for (name, _), a, w in zip(mod.named_parameters(), torch.autograd.grad(got, params, go),
                               torch.autograd.grad(want, params, go), strict=True):
        assert_close(a, w, torch.float64, f"d{name}")


def table_rows_of(positions):
    return positions.rows if isinstance(positions, LogBuckets) else 2 * positions + 1


def test_module_position_to_content_options(monkeypatch):
    from relattn import RelativeMultiheadAttention, backends
    from relattn.schemes import Shaw

    mod = RelativeMultiheadAttention(8, 2, Shaw(3, position_to_content=True))
    assert mod.rel_q.shape == (7, 4) and "position_to_content=True" in repr(mod)
    assert RelativeMultiheadAttention(8, 2, 3).rel_q is None
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    up = RelativeMultiheadAttention.from_mha(mha, Shaw(3, position_to_content=True))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(up(x)[0], mha(x, x, x)[0])  # zero tables: mha's own output
    assert up.rel_q.abs().sum() == 0
    with pytest.raises(ValueError, match="beyond"):
        Shaw(LogBuckets(4), beyond="zero")
    # a backend declaring no position-to-content term is refused at construction, naming rel_q
    monkeypatch.setitem(backends.BACKENDS, "without",
                        backends.Backend("without", lambda c: c.q, Serves(), "declares no rel_q"))
    with pytest.raises(ValueError, match="rel_q"):
        RelativeMultiheadAttention(8, 2, Disentangled(3), backend="without")
