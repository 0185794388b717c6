"""The "triton" backend against the numpy reference: outputs and all five gradients.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` before relattn is imported); with CUDA the same tests run compiled on the GPU (the
interpreted variant cannot share a process with compiled kernels, so it is skipped there). Tiles are set small
and unequal (forward 16 x 32, backward 32 x 16) so that rows cross several key tiles, tiles end mid-sequence
and every kind of tile (left of the band, band, right) occurs. Outputs are compared with the numpy reference,
gradients with the float64 oracle's autograd (``helpers.oracle_grads``, itself checked against the reference's
finite differences in test_conformance.py).

Tolerances are the one policy of ``helpers.assert_close``: float32 within ``TOL_EPS * eps * (1 + max|want|)``;
16-bit results within twice plain PyTorch's own error at that dtype (``attention_ref(..., upcast=False)``, the
yardstick) against the float64 truth for the same rounded inputs (flash-attention's rule).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import assert_close, attention_ref, oracle_grads, random_inputs, reference_output
from relattn import functional as fn
from relattn.backends import BACKENDS, choose, not_supported_reasons, why_not
from relattn.backends import triton as tb
from relattn.backends._common import AttentionCall

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NO_TRITON = tb.unavailable()
pytestmark = pytest.mark.skipif(NO_TRITON is not None, reason=f"triton backend: {NO_TRITON}")
DEVICES = [
    pytest.param("cpu", id="interpreted", marks=[pytest.mark.skipif(
        not INTERPRETED, reason="interpreted only where TRITON_INTERPRET=1 (tests/conftest.py: without CUDA)"),
        pytest.mark.slow]),  # (the interpreter: seconds a test)
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def triton_tiles(small_tiles, kernel_settings):
    small_tiles(triton=((16, 32), (32, 16)))  # forward, backward (queries, keys)
    kernel_settings(tb, band_split=2)  # band tiles 16 wide in the forward and dkdv, as on a GPU narrower


def run(backend, inputs, kk, go, *, dtype, device, **kw):
    """Output and gradients of every input that is not None, the inputs cast to dtype on device."""
    x = [None if t is None else t.detach().to(device, dtype).requires_grad_() for t in inputs]
    mask = kw.pop("attn_mask", None)
    mask = None if mask is None else mask.to(device) if mask.dtype == torch.bool else mask.to(device, dtype)
    out = fn.relative_attention(*x, max_relative_position=kk, attn_mask=mask, backend=backend, **kw)
    grads = torch.autograd.grad(out, [t for t in x if t is not None], go.to(device, dtype))
    return out, grads


# (b, h, n, m, d, dv, K, tables, is_causal, query_offset)
CASES = [
    (1, 2, 17, 17, 8, 8, 3, "shared", False, 0),
    (1, 2, 97, 97, 16, 16, 5, "per_head", True, 0),
    (1, 1, 130, 130, 8, 8, 1, "shared", False, 0),
    (1, 2, 1, 77, 8, 8, 5, "per_head", True, 76),  # decoding: one query against a cache
    (1, 2, 17, 40, 8, 4, 0, "shared", True, 23),  # K = 0, M != N, D != Dv
    (1, 2, 30, 20, 12, 12, 45, "keys_only", False, -4),  # K > N, D not a power of two
    (2, 1, 40, 40, 8, 8, 5, "values_only", True, 0),
    (1, 2, 33, 33, 8, 8, 2, "none", False, 0),
    (1, 1, 40, 50, 8, 8, 511, "shared", False, 0),  # BERT's K = 511: every tile is in the band
]
IDS = [f"n{c[2]}m{c[3]}d{c[4]}K{c[6]}-{c[7]}-{'causal' if c[8] else 'full'}-off{c[9]}" for c in CASES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_output_and_gradients_match_reference(device, case):
    b, h, n, m, d, dv, kk, tables, causal, off = case
    inputs = random_inputs(b, h, n, m, d, dv, kk, tables=tables, seed=3)
    go = torch.randn(b, h, n, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    kw = dict(is_causal=causal, query_offset=off)
    got_out, got = run("triton", inputs, kk, go, dtype=torch.float32, device=device, **kw)
    _, want = oracle_grads(inputs, go, max_relative_position=kk, **kw)
    assert got_out.dtype == torch.float32 and got_out.shape == (b, h, n, dv)
    assert_close(got_out, reference_output(*inputs, max_relative_position=kk, **kw), torch.float32, "out")
    names = [nm for nm, t in zip(("q", "k", "v", "rel_k", "rel_v"), inputs, strict=True) if t is not None]
    for name, a, w in zip(names, got, want, strict=True):
        assert a.shape == w.shape, name
        assert_close(a, w, torch.float32, f"d{name}")
        assert torch.count_nonzero(w) == 0 or torch.count_nonzero(a) > 0, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,m,off,kind", [(1, 77, 76, None), (20, 90, 20, "bool")])
def test_keys_split_across_programs_match_reference(device, n, m, off, kind, kernel_settings):
    """Decoding's split of the keys: three splits merged by their log-sum-exp (a causal row sees one or two of
    them, the last split nothing at all for the early rows; row 3 of the mask sees no key anywhere)."""
    kernel_settings(tb, kv_splits=3)
    inputs = random_inputs(1, 2, n, m, 8, 8, 5, tables="per_head", seed=19)
    mask = None if kind is None else _masks(1, 2, n, m)["bool"]
    kw = dict(is_causal=True, query_offset=off, attn_mask=mask)
    x = [t.to(device, torch.float32) for t in inputs]
    out = fn.relative_attention(*x, max_relative_position=5, backend="triton", **kw)
    assert_close(out, reference_output(*inputs, max_relative_position=5, **kw), torch.float32, "out")
    go = torch.randn(1, 2, n, 8, dtype=torch.float64)
    got = run("triton", inputs, 5, go, dtype=torch.float32, device=device, **kw)
    want = oracle_grads(inputs, go, max_relative_position=5, **kw)
    for name, a, w in zip("q k v rel_k rel_v".split(), got[1], want[1], strict=True):  # lse merged right
        assert_close(a, w, torch.float32, f"d{name}")


def _seed(device):
    """The ops' dropout seed without dropout (dropout_p = 0: never read)."""
    return torch.zeros((), dtype=torch.int64, device=device)


def _masks(b, h, n, m):
    """A bool key-padding mask (B, 1, 1, M) with row 3 fully masked by a (N, M) part, and a float per-head mask."""
    g = torch.Generator().manual_seed(7)
    pad = torch.ones(b, 1, 1, m, dtype=torch.bool)
    pad[0, ..., m - 5:] = False
    rows = torch.rand(n, m, generator=g) > 0.3
    rows[3] = False
    return {"bool": pad & rows, "float": torch.randn(b, h, n, m, generator=g, dtype=torch.float64),
            "padding": pad}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_masks_match_reference_and_empty_rows_give_zeros(device, kind):
    b, h, n, m, kk = 2, 2, 37, 45, 4
    inputs = random_inputs(b, h, n, m, 8, 8, kk, tables="per_head", seed=5)
    mask = _masks(b, h, n, m)[kind]
    go = torch.randn(b, h, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    kw = dict(attn_mask=mask, is_causal=kind == "float", query_offset=8 if kind == "float" else 0)
    got_out, got = run("triton", inputs, kk, go, dtype=torch.float32, device=device, **dict(kw))
    _, want = oracle_grads(inputs, go, max_relative_position=kk, **kw)
    assert torch.isfinite(got_out).all()
    assert_close(got_out, reference_output(*inputs, max_relative_position=kk, **kw), torch.float32, "out")
    for name, a, w in zip("q k v rel_k rel_v".split(), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close(a, w, torch.float32, f"d{name}")
    if kind == "bool":  # row 3 sees no key: zeros, and no gradient reaches its query
        assert torch.equal(got_out[:, :, 3], torch.zeros_like(got_out[:, :, 3]))
        assert torch.equal(got[0][:, :, 3], torch.zeros_like(got[0][:, :, 3]))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_before_every_key_give_zeros_and_lse_minus_inf(device):
    """Causal with a negative offset: queries 0..2 sit before key 0, so they attend to nothing."""
    q, k, v, rk, rv = (t.to(device, torch.float32) for t in random_inputs(1, 2, 20, 20, 8, 8, 2, seed=9))
    out, lse = tb.OPS.fwd_op(q, k, v, rk[None], rv[None], None, _seed(device), 2, True, 0.0, 0.5, -3)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert out[:, :, 3:].abs().min() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_head_dims_up_to_128_padded(device):
    b, h, n, m, d, dv, kk = 1, 1, 20, 24, 128, 72, 3
    inputs = random_inputs(b, h, n, m, d, dv, kk, seed=10)
    go = torch.randn(b, h, n, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    got_out, got = run("triton", inputs, kk, go, dtype=torch.float32, device=device, is_causal=True)
    want_out, want = oracle_grads(inputs, go, max_relative_position=kk, is_causal=True)
    assert_close(got_out, want_out, torch.float32, "out")
    for name, a, w in zip("q k v rel_k rel_v".split(), got, want, strict=True):
        assert_close(a, w, torch.float32, f"d{name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,causal", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)])
def test_16_bit_within_2x_of_plain_pytorch(device, dtype, causal, small_tiles):
    """Output and every gradient: error against the float64 oracle (on the same rounded inputs) at most twice
    plain PyTorch's at the same dtype."""
    small_tiles(triton=((64, 64), (64, 64)))  # cheaper under the interpreter; small tiles are tested above
    q, k, v, rk, rv = random_inputs(1, 2, 150, 150, 32, 32, 16, seed=12)
    x = [t.to(dtype).requires_grad_() for t in (q, k, v, rk * 0.3, rv * 0.3)]
    go = torch.randn(1, 2, 150, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(13)).to(dtype)
    kw = dict(max_relative_position=16, is_causal=causal)
    ours = run("triton", x, 16, go, dtype=dtype, device=device, is_causal=causal)
    want = oracle_grads(x, go, **kw)  # the truth for the rounded inputs
    plain_out = attention_ref(*x, upcast=False, **kw)
    plain = (plain_out, torch.autograd.grad(plain_out, x, go))
    assert ours[0].dtype == dtype and plain_out.dtype == dtype
    for name, a, p, w in zip(["out", "dq", "dk", "dv", "drel_k", "drel_v"], [ours[0], *ours[1]],
                             [plain[0], *plain[1]], [want[0], *want[1]], strict=True):
        assert_close(a, w, dtype, f"{dtype} {name}", yardstick=p)


def _grouped(inputs, hkv):
    """The inputs with k and v cut to their first ``hkv`` heads (grouped-query attention)."""
    q, k, v, rk, rv = inputs
    return q, k[:, :hkv].contiguous(), v[:, :hkv].contiguous(), rk, rv


def run_grouped(inputs, kk, go, *, dtype, device, mask=None, is_causal=False, query_offset=0):
    """The backend's run on an AttentionCall built here, k and v with fewer heads than q: output and gradients."""
    x = [None if t is None else t.detach().to(device, dtype).requires_grad_() for t in inputs]
    q, k, v, rk, rv = x
    tables = [None if t is None else (t if t.dim() == 3 else t[None]) for t in (rk, rv)]
    call = AttentionCall(q, k, v, *tables, kk, None if mask is None else mask.to(device, dtype), is_causal, 0.0,
                         q.shape[-1] ** -0.5, query_offset)
    out = BACKENDS["triton"].run(call)
    return out, torch.autograd.grad(out, [t for t in x if t is not None], go.to(device, dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,hkv,tables,causal,off", [(4, 2, "per_head", True, 3), (3, 1, "shared", False, 0)],
                         ids=["H4-Hkv2-per_head-causal", "H3-Hkv1-shared"])
def test_grouped_kv_matches_repeated_reference(device, heads, hkv, tables, causal, off):
    """k, v with Hkv < H heads, read in place: output and gradients equal the reference with k, v repeated to H
    heads (query head h reads key/value head h // (H // Hkv)), dk and dv summed over each group."""
    assert BACKENDS["triton"].serves.grouped_kv
    b, n, m, kk = 2, 37, 45, 4
    inputs = _grouped(random_inputs(b, heads, n, m, 8, 8, kk, tables=tables, seed=21), hkv)
    mask = torch.where(torch.rand(b, 1, n, m, generator=torch.Generator().manual_seed(22)) > 0.2, 0.0,
                       float("-inf")).double()
    mask[..., 0] = 0.0
    go = torch.randn(b, heads, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(23))
    got_out, got = run_grouped(inputs, kk, go, dtype=torch.float32, device=device, mask=mask, is_causal=causal,
                               query_offset=off)
    q, k, v, rk, rv = inputs
    g = heads // hkv
    kw = dict(max_relative_position=kk, attn_mask=mask, is_causal=causal, query_offset=off)
    _, want = oracle_grads(inputs, go, **kw)  # the oracle reads grouped k, v as repeated: dk, dv summed per group
    assert got_out.shape == (b, heads, n, 8)
    assert_close(got_out, reference_output(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), rk, rv,
                                           **kw), torch.float32, "out")
    for name, a, w in zip("q k v rel_k rel_v".split(), got, want, strict=True):
        assert a.shape == w.shape, name
        assert_close(a, w, torch.float32, f"d{name}")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_fake_kernels(device):
    q, k, v, rk, rv = random_inputs(1, 2, 7, 9, 4, 4, 2, tables="per_head", seed=15, dtype=torch.float32)
    q, k, v, rk = (t.to(device).requires_grad_() for t in (q, k, v, rk))
    rv = rv[:1].to(device).requires_grad_()  # shared, as the op takes it: (1, 2K+1, Dv)
    mask = torch.randn(1, 2, 7, 9, device=device)
    seed = _seed(device)
    torch.library.opcheck(tb.OPS.fwd_op.default, (q, k, v, rk, rv, mask, seed, 2, True, 0.0, 0.5, 2))
    torch.library.opcheck(tb.OPS.fwd_op.default, (q, k, v, None, rv, None, seed, 2, False, 0.0, 0.5, 0))
    drawn = torch.full((), 1234, dtype=torch.int64, device=device)  # with dropout: the same mask every time
    torch.library.opcheck(tb.OPS.fwd_op.default, (q, k, v, rk, rv, mask, drawn, 2, True, 0.3, 0.5, 2))
    real = [t.detach().bfloat16() for t in (q, k, v)]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in real)
        fs = mode.from_tensor(seed)
        out, lse = tb.OPS.fwd_op(fq, fk, fv, None, None, None, fs, 2, False, 0.0, 0.5, 0)
        grads = tb.OPS.bwd_op(out, fq, fk, fv, None, None, None, fs, out, lse, 2, False, 0.0, 0.5, 0)
    assert out.shape == (1, 2, 7, 4) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # the tables, rel_q, q_pos, rel_bias: empty without their inputs
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, (0,), (0,), (0,), (0,), (0,)]


def _call(device="cpu", dtype=torch.float32, **kw):
    q, k, v, rk, rv = random_inputs(1, 2, 9, 9, 4, 4, 2, dtype=dtype, seed=16)
    return fn.validate(q.to(device), k.to(device), v.to(device), rk.to(device), rv.to(device),
                       max_relative_position=2, attn_mask=kw.get("mask"), is_causal=False,
                       dropout_p=kw.get("dropout_p", 0.0), scale=None, query_offset=0)


def test_refusals_name_the_reason(monkeypatch):
    backend = BACKENDS["triton"]
    assert not_supported_reasons(backend, _call(dropout_p=0.1)) == []  # dropout served (test_triton_dropout.py)
    wide = fn.validate(*random_inputs(1, 1, 3, 3, 160, 4, 1), max_relative_position=1, attn_mask=None,
                       is_causal=False, dropout_p=0.0, scale=None, query_offset=0)
    assert not_supported_reasons(backend, wide) == ["head dim 160 (at most 128)"]
    grad_mask = _call(mask=torch.zeros(9, 9, requires_grad=True))
    assert not_supported_reasons(backend, grad_mask) == [
        "attn_mask requires grad (only 'dense' differentiates the mask)"]
    monkeypatch.setitem(sys.modules, "triton", None)  # importlib finds no triton
    try:
        assert tb.unavailable(recheck=True).startswith("triton is not installed")
        with pytest.raises(ValueError, match="backend 'triton' cannot serve.*triton is not installed"):
            fn.relative_attention(*random_inputs(1, 1, 3, 3, 4, 4, 1, dtype=torch.float32), max_relative_position=1,
                                  backend="triton")
    finally:
        monkeypatch.undo()
        assert tb.unavailable(recheck=True) is None


@pytest.mark.slow
def test_relattn_imports_and_falls_back_without_a_working_triton(tmp_path):
    """A triton that fails to import: relattn imports, "auto" works, backend="triton" names the failure."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('no libcuda here')\n")
    code = """
import torch, relattn
from relattn import relative_attention
q = torch.randn(1, 1, 4, 8)
assert relative_attention(q, q, q, max_relative_position=2).shape == (1, 1, 4, 8)
try:
    relative_attention(q, q, q, max_relative_position=2, backend="triton")
except ValueError as exc:
    print(exc)
"""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), src]), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "backend 'triton' cannot serve these inputs: triton cannot be imported (ImportError: no libcuda here)" \
        in done.stdout


@pytest.mark.skipif(not INTERPRETED, reason="checks the CPU route the interpreter opens")
def test_auto_never_picks_triton_on_the_cpu():
    call = _call()
    assert not not_supported_reasons(BACKENDS["triton"], call)  # it could, interpreted...
    assert choose(call).name != "triton" and "triton" not in why_not(call)  # ...but "auto" does not


@needs_cuda
def test_auto_picks_triton_on_cuda():
    call = _call("cuda", torch.bfloat16)
    assert choose(call).name == "triton"
    dropout = _call("cuda", torch.bfloat16, dropout_p=0.1)  # training as configured keeps the kernel
    assert choose(dropout).name == "triton"


@needs_cuda
def test_compile_fullgraph_and_export_on_cuda():
    q, k, v, rk, rv = (t.cuda().requires_grad_() for t in random_inputs(1, 2, 70, 70, 16, 16, 4,
                                                                           dtype=torch.float32, seed=17))

    def f(q, k, v, rk, rv):
        return fn.relative_attention(q, k, v, rk, rv, max_relative_position=4, is_causal=True, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    got, want = compiled(q, k, v, rk, rv), f(q, k, v, rk, rv)
    assert torch.equal(got, want)
    g1 = torch.autograd.grad(got.sum(), (q, k, v, rk, rv))
    g2 = torch.autograd.grad(want.sum(), (q, k, v, rk, rv))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, rk, rv):
            return f(q, k, v, rk, rv)

    args = tuple(t.detach() for t in (q, k, v, rk, rv))
    exported = torch.export.export(Attn(), args)
    assert torch.equal(exported.module()(*args), f(*args))


@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_on_cuda_within_2x_of_plain_pytorch(causal, small_tiles):
    """The GPU tiles (64 x 64 forward), N = 2048, K = 64, D = 64, bfloat16: the forward's error."""
    small_tiles(triton=((64, 64), (64, 64)))
    inputs = [t.cuda() for t in random_inputs(1, 4, 2048, 2048, 64, 64, 64, seed=18)]
    inputs[3:] = [t * 0.3 for t in inputs[3:]]
    lo = [t.bfloat16() for t in inputs]
    kw = dict(max_relative_position=64, is_causal=causal)
    got = fn.relative_attention(*lo, backend="triton", **kw)
    want = fn.relative_attention(*(t.double() for t in lo), backend="dense", **kw)  # truth for the rounded inputs
    assert_close(got, want, torch.bfloat16, "out", yardstick=attention_ref(*lo, upcast=False, **kw))


# ----------------------------------------------------- the position-to-content term rel_q (k_j . a^Q[t(i, j)])


def _rel_q_run(backend, inputs, kk, go, *, dtype, device, mask=None, **kw):
    """Output and the six gradients with a rel_q table (k, v may have fewer heads: enable_gqa)."""
    x = [t.detach().to(device, dtype).requires_grad_() for t in inputs]
    q, k, v, rk, rv, rq = x
    mask = None if mask is None else mask.to(device)
    out = fn.relative_attention(q, k, v, rk, rv, rel_q=rq, max_relative_position=kk, attn_mask=mask,
                                enable_gqa=k.shape[1] != q.shape[1], backend=backend, **kw)
    return out, torch.autograd.grad(out, x, go.to(device, dtype))


def _rel_q_inputs(b, h, hkv, n, m, d, kk, shared, seed):
    g = torch.Generator().manual_seed(seed)
    hr = 1 if shared else h
    shapes = [(b, h, n, d), (b, hkv, m, d), (b, hkv, m, d), (hr, 2 * kk + 1, d), (hr, 2 * kk + 1, d),
              (hr, 2 * kk + 1, d)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


# (b, h, hkv, n, m, d, K, shared, is_causal, query_offset, mask)
REL_Q_CASES = [
    (1, 2, 2, 45, 45, 8, 3, False, False, 0, False),  # every stage: left, band, right
    (2, 2, 2, 37, 50, 8, 4, True, True, 5, True),  # a shared table, a mask, causal with an offset
    (1, 4, 2, 33, 40, 8, 2, False, True, 3, False),  # grouped k, v with per-head tables
    (1, 3, 1, 30, 30, 12, 2, True, False, -4, True),  # grouped k, v with a shared table, D not a power of two
    # K = 0 and K > N: test_pos_to_content.py's cases, on triton too
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", REL_Q_CASES, ids=[f"H{c[1]}-Hkv{c[2]}-n{c[3]}m{c[4]}K{c[6]}-"
                                                   f"{'shared' if c[7] else 'per_head'}-"
                                                   f"{'causal' if c[8] else 'full'}-off{c[9]}" for c in REL_Q_CASES])
def test_rel_q_output_and_gradients_match_dense(device, case):
    """Small unequal tiles (every kind of tile for the key scores KA and the per-key bins of dS), float64:
    output and all six gradients against the dense backend (itself the formula: test_pos_to_content.py)."""
    b, h, hkv, n, m, d, kk, shared, causal, off, with_mask = case
    inputs = _rel_q_inputs(b, h, hkv, n, m, d, kk, shared, seed=31)
    mask = torch.rand(b, 1, n, m, generator=torch.Generator().manual_seed(32)) > 0.3 if with_mask else None
    go = torch.randn(b, h, n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(33))
    kw = dict(mask=mask, is_causal=causal, query_offset=off)
    got_out, got = _rel_q_run("triton", inputs, kk, go, dtype=torch.float64, device=device, **kw)
    want_out, want = _rel_q_run("dense", inputs, kk, go, dtype=torch.float64, device="cpu", **kw)
    assert_close(got_out, want_out, torch.float64, "out")
    for name, a, w in zip("q k v rel_k rel_v rel_q".split(), got, want, strict=True):
        assert a.shape == w.shape, name
        assert_close(a, w, torch.float64, f"d{name}")
    assert want[5].abs().max() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_rel_q_float32_within_the_dtype_tolerance(device):
    inputs = _rel_q_inputs(1, 4, 2, 40, 40, 8, 3, False, seed=34)
    go = torch.randn(1, 4, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(35))
    got_out, got = _rel_q_run("triton", inputs, 3, go, dtype=torch.float32, device=device, is_causal=True)
    want_out, want = _rel_q_run("dense", inputs, 3, go, dtype=torch.float64, device="cpu", is_causal=True)
    assert got_out.dtype == torch.float32
    assert_close(got_out, want_out, torch.float32, "out")
    for name, a, w in zip("q k v rel_k rel_v rel_q".split(), got, want, strict=True):
        assert_close(a, w, torch.float32, f"d{name}")


@pytest.mark.parametrize("device", DEVICES)
def test_rel_q_backward_is_bitwise_deterministic(device):
    """Two backward passes equal bit for bit, with all three tables and grouped key/value heads: dk, dv and the
    per-key bins of dS are written once each by the program owning the keys, and summed over a group of query heads
    in a fixed order (tests/modules/test_toolchain.py checks the path without rel_q, through the LM)."""
    inputs = _rel_q_inputs(1, 4, 2, 40, 40, 8, 4, False, seed=36)
    go = torch.randn(1, 4, 40, 8, dtype=torch.float64)
    first = _rel_q_run("triton", inputs, 4, go, dtype=torch.float32, device=device, is_causal=True)[1]
    second = _rel_q_run("triton", inputs, 4, go, dtype=torch.float32, device=device, is_causal=True)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_rel_q_gradcheck_fast_mode(device):
    q, k, v, rk, rv, rq = (t.to(device).requires_grad_() for t in _rel_q_inputs(1, 2, 2, 7, 9, 4, 2, True, seed=37))
    mask = torch.randn(1, 1, 7, 9, dtype=torch.float64, device=device)

    def f(q, k, v, rk, rv, rq):
        return tb.OPS.fwd_op(q, k, v, rk, rv, mask, _seed(device), 2, True, 0.0, 0.5, 2, rq)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, rk, rv, rq), fast_mode=True)


@pytest.mark.parametrize("device", DEVICES)
def test_rel_q_bfloat16_within_2x_of_dense(device, small_tiles):
    """bfloat16 with rel_q: output and every gradient within twice the dense backend's own bfloat16 error against
    float64 on the same rounded inputs."""
    small_tiles(triton=((64, 64), (64, 64)))  # cheaper under the interpreter; small tiles are tested above
    inputs = _rel_q_inputs(1, 2, 2, 100, 100, 32, 8, False, seed=38)
    inputs = [t if i < 3 else t * 0.3 for i, t in enumerate(inputs)]
    lo = [t.bfloat16() for t in inputs]
    go = torch.randn(1, 2, 100, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(39)).bfloat16()
    ours = _rel_q_run("triton", lo, 8, go, dtype=torch.bfloat16, device=device)
    plain = _rel_q_run("dense", lo, 8, go, dtype=torch.bfloat16, device="cpu")
    want = _rel_q_run("dense", lo, 8, go, dtype=torch.float64, device="cpu")  # the truth for the rounded inputs
    assert ours[0].dtype == torch.bfloat16
    for name, a, p, w in zip("out dq dk dv drel_k drel_v drel_q".split(), [ours[0], *ours[1]], [plain[0], *plain[1]],
                             [want[0], *want[1]], strict=True):
        assert_close(a, w, torch.bfloat16, f"bf16 {name}", yardstick=p)


@pytest.mark.parametrize("device", DEVICES)
def test_rel_q_keys_split_across_programs(device, kernel_settings):
    """Decoding's split of the keys with rel_q: three splits merged by their log-sum-exp, against dense."""
    kernel_settings(tb, kv_splits=3)
    inputs = _rel_q_inputs(1, 4, 2, 1, 77, 8, 5, False, seed=40)
    go = torch.randn(1, 4, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(41))
    kw = dict(is_causal=True, query_offset=76)
    got_out, got = _rel_q_run("triton", inputs, 5, go, dtype=torch.float32, device=device, **kw)
    want_out, want = _rel_q_run("dense", inputs, 5, go, dtype=torch.float64, device="cpu", **kw)
    assert_close(got_out, want_out, torch.float32, "out")
    for name, a, w in zip("q k v rel_k rel_v rel_q".split(), got, want, strict=True):
        assert_close(a, w, torch.float32, f"d{name}")


# ------------------------------------------ Transformer-XL: position queries q_pos (content and position biases)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("hkv", "kk", "with_rel_q", "causal"), [(1, 19, False, False), (2, 30, True, True)],
                         ids=["mqa-K=N-1", "gqa-wide-rel_q-causal"])
def test_transformer_xl_biases_match_the_oracle(device, hkv, kk, with_rel_q, causal):
    """content_bias and position_bias through the op (the key table read by q_pos, its gradient apart from dq's), a
    window as long as the sequence and wider, with grouped k/v, rel_q, a padding mask and causal: outputs and every
    gradient (q, k, v, the tables, rel_q, both biases) against the float64 oracle; two backwards, the same bits."""
    b, h, n, d = 2, 2, 20, 8
    q, k, v, rk, rv = random_inputs(b, h, n, n, d, d, kk, tables="per_head", seed=kk)
    k, v = k[:, :hkv].contiguous(), v[:, :hkv].contiguous()
    g = torch.Generator().manual_seed(kk)
    kw = dict(max_relative_position=kk, is_causal=causal, enable_gqa=hkv < h,
              content_bias=torch.randn(h, d, generator=g, dtype=torch.float64),
              position_bias=torch.randn(h, d, generator=g, dtype=torch.float64),
              attn_mask=(torch.arange(n)[None, :] < torch.tensor([n, n - 5])[:, None])[:, None, None, :])
    if with_rel_q:
        kw["rel_q"] = torch.randn(h, 2 * kk + 1, d, generator=g, dtype=torch.float64)
    go = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    want_out, want = oracle_grads([q, k, v, rk, rv], go, **kw)
    names = ("content_bias", "position_bias", "rel_q")
    x = [t.to(device).requires_grad_() for t in (q, k, v, rk, rv)]
    extra = {name: kw[name].to(device).requires_grad_() for name in names if name in kw}

    def once():
        out = fn.relative_attention(*x, backend="triton", **{**kw, **extra, "attn_mask": kw["attn_mask"].to(device)})
        leaves = [*x, *(extra[name] for name in ("rel_q", "content_bias", "position_bias") if name in extra)]
        return out, torch.autograd.grad(out, leaves, go.to(device))

    got_out, got = once()
    assert_close(got_out, want_out, torch.float64, "out")
    labels = ["q", "k", "v", "rel_k", "rel_v", *(name for name in ("rel_q", "content_bias", "position_bias")
                                                 if name in extra)]
    for name, a, w in zip(labels, got, want, strict=True):
        assert_close(a, w, torch.float64, f"d{name}")
    assert all(torch.equal(a, b) for a, b in zip(got, once()[1], strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_position_queries_through_the_backend(device):
    """The kernels' q_pos on an AttentionCall (no biases: any q_pos), float32: output, dq (the content term's share
    only) and d_q_pos (the key table's) against the float64 formula written as dense's plain autograd."""
    b, h, n, m, d, kk = 1, 2, 9, 13, 8, 12
    q, k, v, rk, rv = random_inputs(b, h, n, m, d, d, kk, tables="per_head", seed=3, dtype=torch.float32)
    q_pos = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(4))
    go = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(5))

    def grads_of(backend, dtype, dev):
        x = [t.detach().to(dev, dtype).requires_grad_() for t in (q, k, v, rk, rv, q_pos)]
        call = AttentionCall(x[0], x[1], x[2], x[3], x[4], kk, None, True, 0.0, d ** -0.5, 4, q_pos=x[5])
        out = BACKENDS[backend].run(call)
        return out, torch.autograd.grad(out, x, go.to(dev, dtype))

    want_out, want = grads_of("dense", torch.float64, "cpu")
    got_out, got = grads_of("triton", torch.float32, device)
    assert_close(got_out, want_out, torch.float32, "out")
    for name, a, w in zip(("q", "k", "v", "rel_k", "rel_v", "q_pos"), got, want, strict=True):
        assert_close(a, w, torch.float32, f"d{name}")
