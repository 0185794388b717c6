"""Attention dropout, one mask on every backend (``relattn.backends._common.dropout_keep``, docs/backends.md):

* the mask is the specification's formula (checked against plain Python integers), keeps 1 - p of the weights
  within 5 sigma over a million draws, and shows no correlation between neighbouring rows, keys, heads, batch
  entries or successive calls;
* each backend draws exactly that mask (read back from its output: zero scores and identity values), at the same
  (b, h, i, j) whatever the call's B, H, N, M, tiles and threads, and a packed call draws sequence s as batch entry s;
* dense, blocked and native agree to 1e-12 in float64 with dropout on, outputs and every gradient, combined with
  grouped heads, rel_q, Transformer-XL's biases, LogBuckets, windows, masks, causal and query offsets; dense's
  output is the formula with the dropped weights; gradcheck with a fixed seed; the mean over seeds is the output
  without dropout; a packed call equals the padded masked call;
* the module (packed and masked paths) and patched DeBERTa, Parakeet and eole models in train mode with dropout run
  the native kernel, and "auto" picks it.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import unavailable_here
from relattn import RelativeMultiheadAttention, relative_attention, relative_attention_varlen
from relattn.backends import choose
from relattn.backends._common import AttentionCall, dropout_keep, dropout_seed
from relattn.positions import LogBuckets

FUSED = [name for name in ("native", "blocked") if unavailable_here(name) is None]
EVERY = ["dense", *FUSED]
needs_native = pytest.mark.skipif(unavailable_here("native") is not None, reason="native kernel unavailable")

M32 = 0xFFFFFFFF


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x45D9F3B) & M32
    x ^= x >> 16
    x = (x * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def _keep_int(seed: int, b: int, h: int, i: int, j: int, p: float) -> bool:
    """The specification of the mask in plain Python integers."""
    key = _mix32_int(_mix32_int(_mix32_int((seed & M32) ^ 0x243F6A88) ^ b) ^ h)
    row = _mix32_int(key ^ 0x85A308D3 ^ i)
    col = _mix32_int(((key + 0x9E3779B9) & M32) ^ j)
    return _mix32_int(row ^ col) >= math.floor(p * 2**32)


def _grid(b, h, n, m):
    return (torch.arange(b).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1), torch.arange(n).view(-1, 1),
            torch.arange(m).view(1, -1))


def _seed_of(manual_seed: int) -> int:
    """The seed a call draws right after ``torch.manual_seed(manual_seed)``."""
    torch.manual_seed(manual_seed)
    return int(dropout_seed(torch.device("cpu"))[0])


# ------------------------------------------------------------------------------------------- the mask itself


def test_the_mask_is_the_specification():
    g = torch.Generator().manual_seed(0)
    pts = torch.randint(0, 5000, (200, 4), generator=g)
    for seed in (0, 12345, 2**31 - 2, 2**40 + 7):
        for p in (0.1, 0.5, 0.93):
            got = dropout_keep(seed, pts[:, 0], pts[:, 1], pts[:, 2], pts[:, 3], p)
            want = [_keep_int(seed, *map(int, row), p) for row in pts]
            assert got.tolist() == want


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_five_sigma_over_a_million_draws(p):
    keep = dropout_keep(1234, *_grid(4, 4, 256, 256), p)
    n = keep.numel()
    assert n >= 10**6
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.double().mean().item() - (1 - p)) < 5 * sigma


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_no_correlation_between_neighbours_heads_batch_entries_or_calls():
    keep = dropout_keep(99, *_grid(4, 4, 256, 256), 0.5)
    other = dropout_keep(100, *_grid(4, 4, 256, 256), 0.5)  # the next seed
    upper = torch.ones(256, 256, dtype=torch.bool).triu(1)  # (i, j) against (j, i), i < j
    pairs = {"j, j+1": (keep[..., :-1], keep[..., 1:]), "i, i+1": (keep[..., :-1, :], keep[..., 1:, :]),
             "i, j swapped": (keep[..., upper], keep.transpose(-1, -2)[..., upper]),
             "h, h+1": (keep[:, :-1], keep[:, 1:]), "b, b+1": (keep[:-1], keep[1:]), "seed, seed+1": (keep, other)}
    for what, (a, b) in pairs.items():
        assert abs(_corr(a, b)) < 5 / math.sqrt(a.numel()), what
    torch.manual_seed(0)
    first, second = dropout_seed(torch.device("cpu")), dropout_seed(torch.device("cpu"))
    assert first[0] != second[0] and first[1:].tolist() == [0, 0, 0]  # successive calls draw different seeds


# ----------------------------------------------------------------------- each backend draws exactly that mask


def _probe(backend, b, h, n, m, p, manual_seed, *, packed_lengths=None):
    """The keep mask a backend drew, read from its output: zero scores make every weight 1 / m, identity values make
    out[b, h, i, j] = keep_ij / ((1 - p) m)."""
    if packed_lengths is not None:  # one packed call: sequence s of length L_s, (T, H, .) tensors
        t = sum(packed_lengths)
        cu = torch.tensor([0, *torch.tensor(packed_lengths).cumsum(0).tolist()])
        q, k = torch.zeros(t, h, 2, dtype=torch.float64), torch.zeros(t, h, 2, dtype=torch.float64)
        v = torch.zeros(t, h, m, dtype=torch.float64)
        for s, length in enumerate(packed_lengths):
            v[cu[s]:cu[s] + length] = torch.eye(length, m, dtype=torch.float64)[:, None, :]
        torch.manual_seed(manual_seed)
        out = relative_attention_varlen(q, k, v, max_relative_position=1, cu_seqlens_q=cu, dropout_p=p,
                                        backend=backend)
        return [out[cu[s]:cu[s] + length, :, :length].transpose(0, 1) * length * (1 - p) > 0.5
                for s, length in enumerate(packed_lengths)]
    q, k = torch.zeros(b, h, n, 2, dtype=torch.float64), torch.zeros(b, h, m, 2, dtype=torch.float64)
    v = torch.eye(m, dtype=torch.float64).expand(b, h, m, m)
    torch.manual_seed(manual_seed)
    out = relative_attention(q, k, v, max_relative_position=1, dropout_p=p, backend=backend)
    return out * m * (1 - p) > 0.5


@pytest.mark.parametrize("backend", EVERY)
def test_each_backend_draws_the_mask_at_the_same_positions_whatever_the_shape(backend, small_tiles):
    """The mask of (b, h, i, j) in calls of different B, H, N, M (and tiles crossing them) is dropout_keep's: not
    a function of the shapes (blocked's former hash indexed rows by N and columns by M)."""
    seed = _seed_of(7)
    for b, h, n, m in ((2, 3, 5, 7), (3, 4, 9, 11), (1, 2, 13, 150)):
        got = _probe(backend, b, h, n, m, 0.3, 7)
        assert torch.equal(got, dropout_keep(seed, *_grid(b, h, n, m), 0.3)), (b, h, n, m)


@pytest.mark.parametrize("backend", EVERY)
def test_a_packed_call_draws_sequence_s_as_batch_entry_s(backend, small_tiles):
    seed = _seed_of(3)
    lengths = [5, 1, 8, 3]
    got = _probe(backend, None, 2, None, 8, 0.4, 3, packed_lengths=lengths)
    for s, length in enumerate(lengths):
        want = dropout_keep(seed, torch.tensor(s), *_grid(1, 2, length, length)[1:], 0.4)
        assert torch.equal(got[s], want[0]), s


@needs_native
def test_the_native_mask_is_the_same_on_one_thread_and_two(small_tiles):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _probe("native", 2, 3, 40, 33, 0.2, 5)
        torch.set_num_threads(2)
        two = _probe("native", 2, 3, 40, 33, 0.2, 5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


# --------------------------------------------------------------------------- the backends agree, with features

H, D, DV = 4, 5, 3

# name: (Hkv, rel_q, biases, tables, mask, is_causal, positions, beyond, N, M, query_offset)
CASES = {
    "gqa-relq-causal-offset": (2, True, False, "shared", None, True, 3, "clip", 9, 12, 3),
    "mqa-biases-float-mask": (1, False, True, "per_head", "float", False, 4, "clip", 7, 7, 0),
    "gqa-buckets-bool-mask": (2, True, False, "per_head", "bool", False, LogBuckets(4, 6, 9), "clip", 8, 10, 2),
    "mha-window-zero-causal": (4, False, True, "shared", "bool", True, (2, 4), "zero", 11, 11, 0),
    "mha-relq-biases-offset": (4, True, True, "per_head", None, False, 2, "clip", 6, 9, -2),
}


def _rows(positions):
    if isinstance(positions, LogBuckets):
        return positions.rows
    left, right = (positions, positions) if isinstance(positions, int) else positions
    return left + right + 1


def _case(name, b=2):
    hkv, rel_q, biases, tables, mask, causal, positions, beyond, n, m, off = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    lead = () if tables == "shared" else (H,)
    rows = _rows(positions)
    inputs = [draw(b, H, n, D), draw(b, hkv, m, D), draw(b, hkv, m, DV), draw(*lead, rows, D), draw(*lead, rows, DV),
              draw(*lead, rows, D) if rel_q else None, draw(H, D) if biases else None, draw(H, D) if biases else None]
    if mask == "bool":
        attn_mask = torch.ones(b, 1, 1, m, dtype=torch.bool)
        attn_mask[-1, ..., m // 2:] = False
    elif mask == "float":
        attn_mask = torch.randn(1, H, n, m, generator=g, dtype=torch.float64)
        attn_mask[..., 1] = float("-inf")
    else:
        attn_mask = None
    kw = dict(max_relative_position=positions, beyond=beyond, attn_mask=attn_mask, is_causal=causal,
              query_offset=off, enable_gqa=True)
    return inputs, kw, torch.randn(b, H, n, DV, generator=g, dtype=torch.float64)


def _run(backend, inputs, kw, go, *, manual_seed=11, p=0.3):
    q, k, v, rel_k, rel_v, rel_q, cb, pb = inputs
    torch.manual_seed(manual_seed)
    out = relative_attention(q, k, v, rel_k, rel_v, rel_q=rel_q, content_bias=cb, position_bias=pb, dropout_p=p,
                             backend=backend, **kw)
    present = [t for t in inputs if t is not None]
    return out, torch.autograd.grad(out, present, go)


def _rel_err(a, b):
    return float((a - b).abs().max() / (b.abs().max() + 1e-300))


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("name", list(CASES))
def test_the_fused_backends_equal_dense_with_dropout(name, backend, small_tiles):
    inputs, kw, go = _case(name)
    want, want_grads = _run("dense", inputs, kw, go)
    got, got_grads = _run(backend, inputs, kw, go)
    assert _rel_err(got, want) <= 1e-12
    for n, (a, w) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert _rel_err(a, w) <= 1e-12, n
    assert _rel_err(want, _run("dense", inputs, kw, go, p=0.0)[0]) > 1e-2  # dropout did something


def test_dense_with_dropout_is_the_formula_with_the_dropped_weights():
    """out_i = sum_j (keep_ij / (1 - p)) w_ij (v_j + a^V_{clip(j - i, -K, K) + K}), w the weights without dropout."""
    from relattn import relative_attention_weights

    g = torch.Generator().manual_seed(4)
    b, h, n, m, kk, p = 2, 3, 6, 8, 2, 0.35
    q, k, v = (torch.randn(b, h, x, 4, generator=g, dtype=torch.float64) for x in (n, m, m))
    rel_k, rel_v = torch.randn(2 * kk + 1, 4, generator=g, dtype=torch.float64), torch.randn(
        2 * kk + 1, 4, generator=g, dtype=torch.float64)
    w = relative_attention_weights(q, k, rel_k, max_relative_position=kk)
    z = dropout_keep(_seed_of(8), *_grid(b, h, n, m), p).double() / (1 - p)
    idx = (torch.arange(m)[None, :] - torch.arange(n)[:, None]).clamp(-kk, kk) + kk
    want = torch.einsum("bhij,bhijd->bhid", w * z, v[:, :, None, :, :] + rel_v[idx])
    torch.manual_seed(8)
    got = relative_attention(q, k, v, rel_k, rel_v, max_relative_position=kk, dropout_p=p, backend="dense")
    assert _rel_err(got, want) <= 1e-12


@pytest.mark.parametrize("backend", FUSED)
def test_gradcheck_with_a_fixed_seed(backend, small_tiles):
    inputs, kw, _ = _case("mha-relq-biases-offset", b=1)
    q, k, v, rel_k, rel_v, rel_q, cb, pb = inputs

    def f(q, k, v, rel_k, rel_v, rel_q, cb, pb):
        torch.manual_seed(21)
        return relative_attention(q, k, v, rel_k, rel_v, rel_q=rel_q, content_bias=cb, position_bias=pb,
                                  dropout_p=0.4, backend=backend, **kw)

    assert torch.autograd.gradcheck(f, tuple(inputs), fast_mode=True)


@pytest.mark.parametrize("backend", FUSED)
def test_the_mean_over_seeds_is_the_output_without_dropout(backend):
    inputs, kw, go = _case("gqa-relq-causal-offset", b=1)
    inputs = [None if t is None else t.detach() for t in inputs]
    q, k, v, rel_k, rel_v, rel_q, _, _ = inputs
    clean = relative_attention(q, k, v, rel_k, rel_v, rel_q=rel_q, backend=backend, **kw)
    torch.manual_seed(0)
    outs = torch.stack([relative_attention(q, k, v, rel_k, rel_v, rel_q=rel_q, dropout_p=0.3, backend=backend, **kw)
                        for _ in range(400)])
    assert not torch.equal(outs[0], outs[1])
    stderr = outs.std(0) / math.sqrt(len(outs))
    assert ((outs.mean(0) - clean).abs() <= 5 * stderr + 1e-12).all()


@pytest.mark.parametrize("backend", EVERY)
def test_a_packed_call_equals_the_padded_masked_call(backend, small_tiles):
    """Sequence s of the packed call is batch entry s of the padded call, right-padded and masked: the same mask,
    outputs and gradients on the real rows (grouped heads, rel_q, causal)."""
    g = torch.Generator().manual_seed(2)
    lengths, hkv, kk, p = [6, 2, 9, 4], 2, 3, 0.3
    t, longest = sum(lengths), max(lengths)
    q, k, v = (torch.randn(t, hh, d, generator=g, dtype=torch.float64).requires_grad_()
               for hh, d in ((H, D), (hkv, D), (hkv, DV)))
    rel_k, rel_v, rel_q = (torch.randn(2 * kk + 1, d, generator=g, dtype=torch.float64).requires_grad_()
                           for d in (D, DV, D))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    torch.manual_seed(5)
    packed = relative_attention_varlen(q, k, v, rel_k, rel_v, rel_q=rel_q, max_relative_position=kk,
                                       cu_seqlens_q=cu, is_causal=True, dropout_p=p, enable_gqa=True, backend=backend)
    go = torch.randn(packed.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(packed, (q, k, v, rel_k, rel_v, rel_q), go)

    def padded(x):
        out = x.new_zeros(len(lengths), longest, *x.shape[1:])
        for s, length in enumerate(lengths):
            out[s, :length] = x[cu[s]:cu[s] + length]
        return out.transpose(1, 2)  # (S, heads, L, d)

    keep = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    torch.manual_seed(5)
    out = relative_attention(padded(q), padded(k), padded(v), rel_k, rel_v, rel_q=rel_q, max_relative_position=kk,
                             attn_mask=keep[:, None, None, :], is_causal=True, dropout_p=p, enable_gqa=True,
                             backend=backend).transpose(1, 2)
    real = torch.cat([out[s, :length] for s, length in enumerate(lengths)])
    assert _rel_err(real, packed) <= 1e-12
    got = torch.autograd.grad(real, (q, k, v, rel_k, rel_v, rel_q), go)
    for n, (a, w) in enumerate(zip(got, want, strict=True)):
        assert _rel_err(a, w) <= 1e-12, n


# ------------------------------------------------------------------------------ what a trainer runs: native


def test_auto_picks_native_for_dropout_on_the_cpu():
    if unavailable_here("native") is not None:
        pytest.skip("native kernel unavailable")
    q = torch.randn(1, 2, 300, 8)
    for n in (9, 300):
        call = AttentionCall(q[:, :, :n], q[:, :, :n], q[:, :, :n], None, None, 2, None, False, 0.1, 0.5, 0)
        assert choose(call).name == "native"


class _Counted:
    """Counts the native kernel's forward and backward calls (dense and packed ops), by wrapping its StatsOps."""

    def __init__(self, monkeypatch):
        from relattn.backends import native

        self.calls = {"fwd": 0, "bwd": 0, "dropout": 0}
        for ops in (native.OPS, native.VARLEN_OPS):
            for which, attr in (("fwd", "kernel_forward"), ("bwd", "kernel_backward")):
                monkeypatch.setattr(ops, attr, self._wrap(getattr(ops, attr), which))

    def _wrap(self, fn, which):
        def counted(*args, **kw):
            self.calls[which] += 1
            self.calls["dropout"] += which == "fwd" and kw.get("dropout_p", 0.0) > 0
            return fn(*args, **kw)

        return counted


def _seeded_runs(model, step) -> None:
    """``step()`` (a train-mode forward+backward of ``model``, returning its output) reproduces its output and every
    gradient under ``torch.manual_seed``, and another seed draws another mask (the output changes)."""

    def run(seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        out = step().detach()
        return out, [prm.grad.clone() for prm in model.parameters() if prm.grad is not None]

    (first, first_grads), (again, again_grads), (other, _) = run(7), run(7), run(8)
    assert first_grads and len(first_grads) == len(again_grads)
    assert torch.equal(first, again) and all(torch.equal(a, b) for a, b in zip(first_grads, again_grads, strict=True))
    assert _rel_err(other, first) > 1e-3


@needs_native
def test_the_module_in_train_mode_runs_native_and_its_packed_and_masked_paths_agree(monkeypatch):
    """Right-padded keys with 40% padding take the packed call; with packing switched off (``PACK_FROM`` 1) the same
    batch takes the masked call: the same dropout mask, the same outputs and gradients on the real rows."""
    import relattn.padding

    torch.manual_seed(0)
    mod = RelativeMultiheadAttention(16, 4, 3, dropout=0.2, batch_first=True,
                                     dtype=torch.float64).train()
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 6:], pad[2, 3:] = True, True
    real = ~pad
    results = []
    for pack_from in (relattn.padding.PACK_FROM, 1.0):
        monkeypatch.setattr(relattn.padding, "PACK_FROM", pack_from)
        counted = _Counted(monkeypatch)
        mod.zero_grad()
        torch.manual_seed(1)
        out = mod(x, x, x, key_padding_mask=pad.clone(), need_weights=False)[0]
        (out[real] ** 2).sum().backward()
        assert counted.calls == {"fwd": 1, "bwd": 1, "dropout": 1}, pack_from
        results.append((out[real].detach(), [prm.grad.clone() for prm in mod.parameters()]))
    (packed, packed_grads), (masked, masked_grads) = results
    assert _rel_err(packed, masked) <= 1e-12
    for a, w in zip(packed_grads, masked_grads, strict=True):  # (some are 0 up to rounding: k's bias)
        assert (a - w).abs().max() <= 1e-12 * (1 + w.abs().max())
    mod.eval()
    assert _rel_err(mod(x, x, x, key_padding_mask=pad, need_weights=False)[0][real], packed) > 1e-2


@needs_native
def test_a_patched_deberta_in_train_mode_with_dropout_runs_native(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from relattn.integrations.transformers import patch

    cfg = transformers.DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.1,
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=32,
        share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False)
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(cfg)
    patch(model)
    model.train()
    ids = torch.randint(1, 40, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 12:] = 0
    counted = _Counted(monkeypatch)
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert counted.calls["fwd"] == 2 and counted.calls["bwd"] == 2 and counted.calls["dropout"] == 2

    def step():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state * mask[..., None]
        (out ** 2).sum().backward()
        return out

    _seeded_runs(model, step)


@needs_native
def test_a_patched_parakeet_in_train_mode_with_dropout_runs_native(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from relattn.integrations.transformers import patch

    cfg = transformers.ParakeetEncoderConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, conv_kernel_size=3,
        subsampling_factor=4, subsampling_conv_channels=8, num_mel_bins=16, dropout=0.0, layerdrop=0.0,
        activation_dropout=0.0, attention_dropout=0.1, dropout_positions=0.0)
    torch.manual_seed(0)
    model = transformers.ParakeetEncoder(cfg)
    patch(model)
    model.train()
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0
    counted = _Counted(monkeypatch)
    features = torch.randn(2, 40, 16)
    out = model(input_features=features, attention_mask=mask).last_hidden_state
    out.sum().backward()
    assert counted.calls["fwd"] == 2 and counted.calls["bwd"] == 2 and counted.calls["dropout"] == 2

    def step():
        out = model(input_features=features, attention_mask=mask).last_hidden_state
        (out ** 2).sum().backward()
        return out

    _seeded_runs(model, step)


@needs_native
def test_a_patched_eole_model_in_train_mode_with_dropout_runs_native(monkeypatch):
    pytest.importorskip("eole")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        from eole.config.models import TransformerModelConfig
        from eole.config.training import TrainingConfig
        from eole.models.model import EncoderDecoderModel
    from relattn.integrations.eole import patch

    class Vocab(dict):
        pass

    vocab = Vocab({f"t{i}": i for i in range(22)}, **{"<blank>": 22})
    cfg = TransformerModelConfig(hidden_size=32, heads=4, heads_kv=2, transformer_ff=40, layers=2,
                                 max_position_embeddings=24,
                                 embeddings={"word_vec_size": 32, "position_encoding_type": "Relative",
                                             "n_positions": 3})
    running = TrainingConfig(attention_dropout=[0.1], dropout=[0.0])
    model = EncoderDecoderModel.build_blocks(cfg, {"specials": {"pad_token": "<blank>"}, "src": vocab, "tgt": vocab},
                                             running_config=running)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    patch(model)
    model.train()
    src = torch.randint(0, 22, (2, 9), generator=g)
    tgt = torch.randint(0, 22, (2, 8), generator=g)
    src[1, 6:] = 22
    counted = _Counted(monkeypatch)
    model(src, tgt, (src != 22).sum(1)).dec_out.sum().backward()
    # the encoder's and the decoder's self-attention layers (cross-attention has no relative positions)
    assert counted.calls["dropout"] == 4 and counted.calls["fwd"] == 4 and counted.calls["bwd"] == 4

    def step():
        out = model(src, tgt, (src != 22).sum(1)).dec_out
        (out ** 2).sum().backward()
        return out

    _seeded_runs(model, step)


@needs_native
@pytest.mark.parametrize("gemm16", [True, False], ids=["16-bit-gemms", "float32-copies"])
def test_native_bfloat16_with_dropout_draws_the_same_mask(gemm16, kernel_settings):
    """16-bit inputs drop the same weights as float64 (the mask does not depend on the dtype): the bfloat16 output
    and gradients within bfloat16's error of the float64 ones (the dropped weights' error would be of order 1)."""
    from relattn.backends import native

    assert native.unavailable() is None  # loaded
    if gemm16 and not torch.ops.relattn_native.has_gemm16(torch.bfloat16):
        pytest.skip("this libtorch exports no bfloat16 GEMM")
    kernel_settings(native, gemm16=gemm16, tile_q=8, tile_k=16)
    inputs, kw, go = _case("gqa-relq-causal-offset")
    want, want_grads = _run("native", inputs, kw, go)
    low = [None if t is None else t.detach().bfloat16().requires_grad_() for t in inputs]
    got, got_grads = _run("native", low, kw, go.bfloat16())
    assert _rel_err(got.double(), want) < 3e-2
    for a, w in zip(got_grads, want_grads, strict=True):
        assert _rel_err(a.double(), w) < 5e-2
