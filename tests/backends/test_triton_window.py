"""The "triton" backend's compact windows: a call whose tables are wide (Transformer-XL's ``K = N - 1``) runs in
chunks of query rows, each chunk's per-row table scores and bins holding only the table rows its pairs meet
(``C + M - 1`` of them for C rows, not ``2K + 1``), so the memory they take grows as N, not N^2.

Interpreted (tests/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA) with small tiles and chunks
(``window_rows``) so that a call crosses several chunks and every window kind occurs (with and without the table's
edge rows, clipped or not). Outputs and every gradient against the float64 oracle (T5's scalar bias ``rel_bias`` too:
each chunk adds its window's rows of the bias, and its gradient lands in those rows); with dropout, the same bits as the
call whole and as ``blocked`` (one mask of (seed, b, h, i, j)); the memory test records the launches on meta
tensors as a GPU would make them (no memory, no compute).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_close, oracle_grads, random_inputs
from relattn import functional as fn
from relattn.backends import triton as tb
from relattn.backends._triton_args import windows
from relattn.positions import T5Buckets

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NO_TRITON = tb.unavailable()
pytestmark = pytest.mark.skipif(NO_TRITON is not None or not (INTERPRETED or CUDA),
                                reason=f"triton backend: {NO_TRITON or 'neither interpreted nor CUDA'}")
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def triton_tiles(small_tiles, kernel_settings):
    small_tiles(triton=((16, 16), (16, 16)))
    kernel_settings(tb, band_split=1, window_rows=16)  # chunks of 16 query rows


def _inputs(n, m, kk, *, hkv=2, tables="per_head", seed=0):
    b, h, d = 2, 2, 8
    q, k, v, rk, rv = random_inputs(b, h, n, m, d, d, kk, tables=tables, seed=seed)
    return q, k[:, :hkv].contiguous(), v[:, :hkv].contiguous(), rk, rv


def _check(inputs, kw):
    """Output and every gradient of the triton backend (in chunks) against the float64 oracle."""
    g = torch.Generator().manual_seed(5)
    q = inputs[0]
    go = torch.randn(*q.shape[:3], inputs[2].shape[-1], generator=g, dtype=torch.float64)
    want_out, want = oracle_grads(inputs, go, **kw)
    x = [None if t is None else t.to(DEVICE).requires_grad_() for t in inputs]
    extra = {name: kw[name].to(DEVICE).requires_grad_() for name in ("content_bias", "position_bias", "rel_bias")
             if name in kw}
    mask = kw.get("attn_mask")
    out = fn.relative_attention(*x, backend="triton", **{**kw, **extra,
                                                          "attn_mask": None if mask is None else mask.to(DEVICE)})
    got = torch.autograd.grad(out, [t for t in x if t is not None] + list(extra.values()), go.to(DEVICE))
    assert_close(out, want_out, torch.float64, "out")
    names = [name for name, t in zip("q k v rel_k rel_v".split(), inputs, strict=True) if t is not None]
    for name, a, w in zip(names + list(extra), got, want, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_transformer_xl_in_windows_matches_the_oracle(causal):
    """Transformer-XL (the key table per head read by q_pos = q + position_bias, content_bias on q), K = N - 1 and
    wider, grouped k/v, a key-padding mask: 45 rows in chunks of 16 (the last one short), each reading its window."""
    n = 45
    for kk in (n - 1, n + 7):
        q, k, v, rk, _ = _inputs(n, n, kk, hkv=1, seed=kk)
        g = torch.Generator().manual_seed(kk)
        kw = dict(max_relative_position=kk, is_causal=causal, enable_gqa=True,
                  content_bias=torch.randn(2, 8, generator=g, dtype=torch.float64),
                  position_bias=torch.randn(2, 8, generator=g, dtype=torch.float64),
                  attn_mask=(torch.arange(n)[None, :] < torch.tensor([n, n - 9])[:, None])[:, None, None, :])
        assert len(windows(n, n, kk, 8, 0, causal, 16)) == 3
        _check([q, k, v, rk, None], kw)


@pytest.mark.slow
@pytest.mark.parametrize(("n", "m", "kk", "off", "causal"), [(40, 40, 30, 0, False), (37, 50, 11, 5, True),
                                                           (33, 20, 60, -4, False)],
                         ids=["edges-in-some-windows", "causal-offset-M>N", "wide-M<N"])
def test_shaw_tables_in_windows_match_the_oracle(n, m, kk, off, causal):
    """Both tables (rel_k read by q, rel_v's per-row bins) forced into chunks: windows that hold the edge rows 0
    and 2K (clipped offsets) and windows that hold neither, a per-pair mask, causal with a query offset."""
    q, k, v, rk, rv = _inputs(n, m, kk, seed=n)
    mask = torch.randn(2, 1, n, m, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kw = dict(max_relative_position=kk, is_causal=causal, query_offset=off, attn_mask=mask)
    chunks = windows(n, m, kk, 8, off, causal, 16)
    assert len(chunks) >= 2 and any(w.rows < 2 * kk + 1 for w in chunks), chunks
    if kk == 30:  # windows without table row 0, without row 2K, and with both
        assert {(w.row0 == 0, w.row0 + w.rows == 2 * kk + 1) for w in chunks} >= {(False, True), (True, False)}
    _check([q, k, v, rk, rv], kw)


@pytest.mark.slow
@pytest.mark.parametrize("encoder", [True, False], ids=["encoder-key-table-gqa-mask", "decoder-causal"])
def test_t5_bias_in_windows_matches_the_oracle(encoder, monkeypatch):
    """T5's scalar bias (``T5Buckets``, one per head, expanded to 2K + 1 rows, K = 33) in a call run in chunks of
    16 of its 45 rows: each chunk adds only its window's rows of rel_bias (``row0 ... row0 + rows``) to the key
    term's scores, and d rel_bias gathers each chunk's row sums of dS into those rows. Outputs and every gradient,
    d rel_bias's included, against the float64 oracle, with windows that hold neither end row of the bias (a chunk
    that read or wrote the bias's first rows instead would fail); the encoder with a shared key table, grouped k/v
    and a padding mask, the decoder causal without tables."""
    n, h, d, buckets = 45, 2, 8, 32 if encoder else 16  # both saturate at K = 33 over 45 rows
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, h, n, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 1 if encoder else h, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    rk = torch.randn(buckets, d, generator=g, dtype=torch.float64) * 0.5 if encoder else None
    kw = dict(max_relative_position=T5Buckets(buckets, 40, bidirectional=encoder), is_causal=not encoder,
              enable_gqa=encoder, scale=None if encoder else 1.0,
              rel_bias=torch.randn(h, buckets, generator=g, dtype=torch.float64) * 2)
    if encoder:
        kw["attn_mask"] = (torch.arange(n)[None, :] < torch.tensor([n, n - 9])[:, None])[:, None, None, :]
    seen = []

    def spy(run_rows):
        def run(*args, window=None, rel_bias=None, **kwargs):
            seen.append((window, rel_bias.shape[-1]))
            return run_rows(*args, window=window, rel_bias=rel_bias, **kwargs)
        return run

    monkeypatch.setattr(tb, "_forward_rows", spy(tb._forward_rows))
    monkeypatch.setattr(tb, "_backward_rows", spy(tb._backward_rows))
    _check([q, k, v, rk, None], kw)
    assert len(seen) == 6 and all(w is not None for w, _ in seen), seen  # 3 chunks forward, 3 backward
    assert any(w.row0 > 0 and w.row0 + w.rows < width for w, width in seen), seen  # windows inside the bias


@pytest.mark.slow
def test_dropout_in_windows_is_the_mask_of_the_whole_call():
    """With dropout, the chunks draw the whole call's mask (their seed offsets move to their first row): output and
    gradients equal to the call whole (no chunks) and to ``blocked``'s, the same seed."""
    n, kk = 40, 39
    q, k, v, rk, _ = _inputs(n, n, kk, hkv=2, seed=1)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(2, 8, generator=g, dtype=torch.float64)
    go = torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64)

    def run(backend, rows):
        x = [t.to(DEVICE).requires_grad_() for t in (q, k, v, rk)]
        with tb.SETTINGS.override(window_rows=rows):
            torch.manual_seed(11)
            out = fn.relative_attention(*x, None, max_relative_position=kk, position_bias=bias.to(DEVICE),
                                        dropout_p=0.3, backend=backend, is_causal=True)
            return [out, *torch.autograd.grad(out, x, go.to(DEVICE))]

    windowed, whole, blocked = run("triton", 16), run("triton", 0), run("blocked", 0)
    for a, b, c in zip(windowed, whole, blocked, strict=True):
        assert torch.allclose(a.cpu(), b.cpu(), rtol=1e-12, atol=1e-12)
        assert torch.allclose(a.cpu(), c.cpu(), rtol=1e-12, atol=1e-12)


def _largest_launch_tensor(n: int, d: int = 64) -> tuple[int, list]:
    """The most entries of any tensor a Transformer-XL forward and backward (bf16, K = N - 1, B = 1, H = 2) pass to
    a launch, recorded as on an A100 (meta tensors: no memory, no compute), and the windows' widths."""
    launches = []
    saved = tb._launch, tb._arch, tb._sm_count
    tb._launch = lambda kernel, grid, **kw: launches.append(kw)
    tb._arch, tb._sm_count = (lambda device: 80), (lambda device: 108)
    try:
        meta = dict(device="meta", dtype=torch.bfloat16)
        q, k, v, q_pos = (torch.empty(1, 2, n, d, **meta) for _ in range(4))
        rk = torch.empty(2, 2 * n - 1, d, **meta)
        kw = dict(max_relative_position=n - 1, is_causal=False, scale=d ** -0.5, query_offset=0, q_pos=q_pos)
        with tb.SETTINGS.override(window_rows=0, fwd_tiles=None, bwd_tiles=None):
            out, lse = tb.forward(q, k, v, rk, None, None, **kw)
            tb.backward(torch.empty_like(out), q, k, v, rk, None, None, None, out, lse, **kw)
    finally:
        tb._launch, tb._arch, tb._sm_count = saved
    sizes = [t.numel() for kw in launches for t in kw.values() if isinstance(t, torch.Tensor)]
    return max(sizes), sorted({kw["ROWS"] for kw in launches if "ROWS" in kw})


def test_wide_tables_take_memory_linear_in_n():
    """A Transformer-XL call (K = N - 1) never passes a launch the (N, 2N - 1) table scores per head: at N = 2048
    and 8192 the largest tensor any launch takes stays within a constant times N D entries per head (the q, k, v
    themselves and the chunks' windows), while the whole table scores would be N (2N - 1)."""
    d = 64
    for n in (2048, 8192):
        largest, widths = _largest_launch_tensor(n, d)
        assert largest <= 2 * 4 * n * d + 2 * 2 * (2 * n - 1) * d, (n, largest)  # the tables (2, 2N-1, D) included
        assert largest < 2 * n * (2 * n - 1) // 2, (n, largest)
        assert max(widths) < 2 * n - 1 and all(w <= 128 * 4 + n for w in widths), widths


def test_narrow_tables_run_whole():
    """Shaw's usual tables (2K + 1 <= 4 D) and packed or rel_q calls are never chunked; the chunk rule's numbers."""
    assert windows(4096, 4096, 64, 64, 0, False) is None
    assert windows(4096, 4096, 63, 32, 0, True) is None
    chunks = windows(4096, 4096, 4095, 64, 0, False)
    assert [w.i0 for w in chunks][:3] == [0, 128, 256] and chunks[-1].i1 == 4096
    assert chunks[0].row0 == 4095 - 127 and chunks[0].rows == 128 + 4096 - 1
    assert windows(120, 120, 119, 16, 0, False) is None  # fewer rows than one chunk's 128: the call whole
    q = torch.empty(1, 2, 4096, 64, device="meta")
    assert tb._windows(q, q, 4095, 0, False, None, None) is not None
    assert tb._windows(q, q, 4095, 0, False, torch.empty(2, 8191, 64, device="meta"), None) is None  # rel_q
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    assert tb._windows(q, q, 4095, 0, False, None, tb.Packed(cu, cu, 2048, 2048)) is None
