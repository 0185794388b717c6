"""``relattn bench``, the measurement module under it and the peers it measures: peers against the numpy reference,
the timing loop's order, presets and options, the bench's output files."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

import relattn
from helpers import assert_close, oracle_grads
from relattn import BACKENDS, relative_attention
from relattn import reference as ref
from relattn.backends import Backend, Serves, cpu, native
from relattn.backends.dense import dense_attention
from relattn.bench import PRESETS, BenchConfig, format_table, run_bench, write_results
from relattn.bench.measure import (
    BackendCalls,
    Problem,
    Runner,
    make_inputs,
    measure,
    peak_extra_bytes,
    sdpa_runner,
)
from relattn.bench.peers import HFWav2Vec2BertRelativeKey, materialised_attention, transformers_version
from relattn.bench.run import _extrapolate
from relattn.cli import main

F64 = torch.float64
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HF_MISSING = "transformers>=5 is not installed (optional `peers` extra): no Hugging Face peer to test"


def _inputs(b, h, n, m, d, kk, *, table_heads, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, length, d, generator=g, dtype=dtype) for length in (n, m, m))
    shape = (2 * kk + 1, d) if table_heads == 0 else (table_heads, 2 * kk + 1, d)
    rel_k, rel_v = torch.randn(*shape, generator=g, dtype=dtype), torch.randn(*shape, generator=g, dtype=dtype)
    return q, k, v, rel_k, rel_v


@pytest.mark.parametrize(("n", "m", "kk", "table_heads", "causal"), [
    (5, 5, 2, 0, False),   # one table shared by all heads, as tensor2tensor
    (5, 5, 2, 2, True),    # per-head tables, causal
    (4, 6, 7, 0, False),   # K >= N and M != N
])
def test_materialised_matches_reference_outputs_and_gradients(n, m, kk, table_heads, causal):
    q, k, v, rel_k, rel_v = _inputs(1, 2, n, m, 3, kk, table_heads=table_heads)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, rel_k, rel_v)]
    out = materialised_attention(*leaves, max_relative_position=kk, is_causal=causal)

    def reference(qq, kk_, vv, rk, rv):
        return ref.relative_attention(qq, kk_, vv, rk, rv, max_relative_position=kk, is_causal=causal)

    arrays = [t.numpy() for t in (q, k, v, rel_k, rel_v)]
    assert_close(out, torch.from_numpy(reference(*arrays)), F64, "out")

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad(out, leaves, grad_out)
    _, expected = oracle_grads((q, k, v, rel_k, rel_v), grad_out, max_relative_position=kk, is_causal=causal)
    for name, g, e in zip(("q", "k", "v", "rel_k", "rel_v"), got, expected, strict=True):
        assert_close(g, e, F64, f"gradient of {name}")


def test_materialised_awkward_sizes_match_reference():
    q, k, v, rel_k, rel_v = _inputs(2, 3, 97, 97, 59, 16, table_heads=0, seed=3)
    out = materialised_attention(q, k, v, rel_k, rel_v, max_relative_position=16, is_causal=True)
    expected = ref.relative_attention(q.numpy(), k.numpy(), v.numpy(), rel_k.numpy(), rel_v.numpy(),
                                      max_relative_position=16, is_causal=True)
    assert_close(out, torch.from_numpy(expected), F64)


def test_materialised_with_key_padding_mask_and_causal_matches_reference():
    q, k, v, rel_k, rel_v = _inputs(2, 2, 9, 9, 5, 3, table_heads=0, seed=8)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    for causal in (False, True):
        out = materialised_attention(q, k, v, rel_k, rel_v, max_relative_position=3, attn_mask=mask, is_causal=causal)
        expected = ref.relative_attention(q.numpy(), k.numpy(), v.numpy(), rel_k.numpy(), rel_v.numpy(),
                                          max_relative_position=3, attn_mask=mask.numpy(), is_causal=causal)
        assert_close(out, torch.from_numpy(expected), F64)


def test_materialised_float32_within_dtype_tolerance():
    q, k, v, rel_k, rel_v = _inputs(1, 2, 33, 33, 16, 8, table_heads=0, seed=4, dtype=torch.float32)
    out = materialised_attention(q, k, v, rel_k, rel_v, max_relative_position=8)
    expected = ref.relative_attention(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                      rel_k.double().numpy(), rel_v.double().numpy(), max_relative_position=8)
    assert_close(out, torch.from_numpy(expected), torch.float32)


@pytest.mark.skipif(transformers_version() is None, reason=HF_MISSING)
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_hf_peer_is_shaw_key_term_with_clipped_shared_table(attn_implementation):
    b, h, n, d, kk = 2, 2, 7, 4, 2  # N > 2K + 1: offsets beyond the window are clipped to the edge rows
    q, k, v, _, _ = _inputs(b, h, n, n, d, 1, table_heads=0, seed=5)
    peer = HFWav2Vec2BertRelativeKey(h, d, kk, attn_implementation=attn_implementation, dtype=F64)
    assert peer.table.shape == (2 * kk + 1, d)
    with torch.no_grad():
        peer.table.copy_(torch.randn(peer.table.shape, generator=torch.Generator().manual_seed(6), dtype=F64))
    table = peer.table.detach().numpy().copy()  # row r is offset j - i = r - K, as relattn's rel_k
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[1, ..., 5:] = False
    for attn_mask in (None, mask):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = peer(*leaves, attn_mask=attn_mask)
        expected = ref.relative_attention(q.numpy(), k.numpy(), v.numpy(), table, None, max_relative_position=kk,
                                          attn_mask=None if attn_mask is None else attn_mask.numpy())
        assert_close(out, torch.from_numpy(expected), F64)

    # gradients agree with relattn's dense path on the same table, table gradient included
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    got = torch.autograd.grad(out, [*leaves, peer.table], grad_out)
    dense_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, torch.from_numpy(table))]
    dense_out = relative_attention(*dense_leaves[:3], dense_leaves[3], None, max_relative_position=kk,
                                   attn_mask=mask, backend="dense")
    want = torch.autograd.grad(dense_out, dense_leaves, grad_out)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, F64)


def test_peak_extra_bytes_counts_live_allocations():
    cpu = torch.device("cpu")

    def two_then_one():
        a = torch.empty(250_000)  # 1 MB
        b = torch.empty(250_000)
        del a
        c = torch.empty(125_000)  # 0.5 MB: live peak stays at 2 MB
        return b, c

    assert peak_extra_bytes(lambda: torch.empty(1_000_000), cpu) == 4_000_000
    assert peak_extra_bytes(two_then_one, cpu) == 2_000_000


@pytest.mark.parametrize("backend", ["native", "blocked", "dense"])
def test_backend_calls_counts_each_kernel_call_by_backend(backend):
    """Each forward and backward kernel call shows under the backend that ran it, packed calls under
    ``<name>_varlen``; dense (plain torch ops) shows nothing, and calls outside the mode are not counted."""
    if backend == "native" and (why := native.BACKEND.unavailable()):
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 8, generator=g, requires_grad=True) for _ in range(3))
    table = torch.randn(7, 8, generator=g, requires_grad=True)
    kw = dict(max_relative_position=3, backend=backend, dropout_p=0.1)
    relative_attention(q, k, v, table, table, **kw).sum().backward()  # not counted
    with BackendCalls() as calls:
        for _ in range(3):
            relative_attention(q, k, v, table, table, **kw).sum().backward()
        with torch.no_grad():
            relative_attention(q, k, v, table, table, **kw)
        packed = [t[0].transpose(0, 1) for t in (q, k, v)]
        relattn.relative_attention_varlen(*packed, table, table, cu_seqlens_q=torch.tensor([0, 3, 7]), **kw)
    if backend == "dense":
        assert not calls.forward and not calls.backward
    else:
        varlen = {"native": {"native_varlen": 1}, "blocked": {"blocked": 2}}[backend]  # blocked: one per sequence
        assert calls.forward == Counter({backend: 4}) + Counter(varlen)
        assert calls.backward == Counter({backend: 3})


def test_extrapolate_power_law():
    assert _extrapolate([(100, 1.0), (200, 4.0)], 400, lo=1, hi=2, single=1) == pytest.approx(16.0)
    assert _extrapolate([(100, 1.0), (200, 16.0)], 400, lo=1, hi=2, single=1) == pytest.approx(64.0)  # clamped
    assert _extrapolate([(100, 3.0)], 300, lo=1, hi=2, single=2) == pytest.approx(27.0)
    assert _extrapolate([], 300, lo=1, hi=2, single=2) is None


ROW_FIELDS = {"n", "implementation", "kind", "status", "reason", "note", "detail", "forward_ms", "fwdbwd_ms",
              "forward_ratio", "fwdbwd_ratio", "peak_forward_bytes", "peak_fwdbwd_bytes", "memory_ratio",
              "max_abs_diff", "diff_vs", "forward_all_ms", "fwdbwd_all_ms"}


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_cli_bench_writes_json_and_png(tmp_path, capsys, causal):
    args = ["bench", "--lengths", "32", "64", "--repeats", "2", "--heads", "2", "--head-dim", "16",
            "--max-relative-position", "8", "--threads", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(args + (["--causal"] if causal else [])) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "bench.json").read_text())

    assert {"cpu", "torch", "torch_threads", "date_utc", "python"} <= set(result["machine"])
    assert result["machine"]["native_choice"] == native.choice().describe()  # and printed: the CPU, the choice
    assert f"cpu: {cpu.features().describe()}" in printed and f"native kernel: {native.choice().describe()}" in printed
    assert result["machine"]["torch_threads"] == 1
    assert result["config"]["causal"] is causal and result["config"]["lengths"] == [32, 64]
    assert "profiler" in result["memory_method"]
    rows = result["rows"]
    names = ["sdpa", "materialised", "hf-w2v-bert:eager", "hf-w2v-bert:sdpa", *(f"relattn:{b}" for b in BACKENDS),
             "relattn:auto"]
    assert [(r["n"], r["implementation"]) for r in rows] == [(n, name) for n in (32, 64) for name in names]
    for r in rows:
        assert set(r) == ROW_FIELDS
        assert r["implementation"] in printed
        if r["implementation"].startswith("hf-") and transformers_version() is None:
            assert r["status"] == "skipped" and "transformers" in r["reason"]
            continue
        if r["implementation"] == "relattn:native" and native.toolchain_missing() is not None:
            assert r["status"] == "skipped" and "no C++ compiler" in r["reason"]  # and auto took another backend
            continue
        assert r["status"] == "ok", r
        assert len(r["forward_all_ms"]) == len(r["fwdbwd_all_ms"]) == 2
        assert r["forward_ms"] == pytest.approx(float(np.median(r["forward_all_ms"])), rel=1e-12)
        sdpa = next(s for s in rows if s["n"] == r["n"] and s["implementation"] == "sdpa")
        assert r["forward_ratio"] == pytest.approx(r["forward_ms"] / sdpa["forward_ms"], rel=1e-12)
        assert r["fwdbwd_ratio"] == pytest.approx(r["fwdbwd_ms"] / sdpa["fwdbwd_ms"], rel=1e-12)
        assert r["memory_ratio"] == pytest.approx(r["peak_fwdbwd_bytes"] / sdpa["peak_fwdbwd_bytes"], rel=1e-12)
        assert r["peak_fwdbwd_bytes"] > 0
        if r["kind"] == "relattn":  # every backend gives the peers' answer (float32)
            assert r["diff_vs"] == "materialised" and r["max_abs_diff"] < 1e-4
    # the materialised form holds two (N, M, D) tables: more memory than SDPA's O(N)
    mat = next(r for r in rows if r["n"] == 64 and r["implementation"] == "materialised")
    assert mat["peak_fwdbwd_bytes"] > 2 * 64 * 64 * 16 * 4 > next(
        r for r in rows if r["n"] == 64 and r["implementation"] == "sdpa")["peak_fwdbwd_bytes"]

    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "bench.png").ndim == 3
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def _broken(*args, **kwargs):
    raise RuntimeError("boom\nsecond line")


@pytest.mark.slow
def test_refused_inputs_and_memory_limit_are_skipped_with_reasons(monkeypatch, tmp_path):
    monkeypatch.setitem(BACKENDS, "refuser", Backend("refuser", dense_attention, Serves(), "t",
                                                                  unavailable=lambda: "refuses all"))
    monkeypatch.setitem(BACKENDS, "broken", Backend("broken", _broken, Serves(), "raises"))
    threads = torch.get_num_threads()
    config = BenchConfig(lengths=(16, 32), heads=2, head_dim=8, max_relative_position=4, threads=1, repeats=1,
                         warmup=0, peers=("materialised",), memory_limit_bytes=40_000)
    result = run_bench(config, progress=False)
    by = {(r["n"], r["implementation"]): r for r in result["rows"]}
    assert by[(16, "relattn:refuser")]["status"] == "skipped"
    assert by[(16, "relattn:refuser")]["reason"] == "refuses all"
    assert by[(16, "sdpa")]["status"] == "ok"
    assert by[(16, "relattn:broken")]["status"] == "failed"
    assert by[(16, "relattn:broken")]["reason"] == "RuntimeError: boom"
    assert torch.get_num_threads() == threads  # run_bench's thread count does not leak out
    # the materialised form needs 4 (N, M, D) tensors: 4 * 16 * 16 * 8 * 4 B = 32 kB + scores > 40 kB at N=32
    assert by[(32, "materialised")]["status"] == "skipped"
    assert by[(32, "materialised")]["reason"].startswith("predicted peak")
    table = format_table(result)
    assert "refuses all" in table and "predicted peak" in table
    json_path, png_path = write_results(result, tmp_path)
    assert json.loads(json_path.read_text())["rows"] == result["rows"]
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("bad", [
    ["--lengths", "0"],
    ["--lengths", "abc"],
    ["--backends", "nope"],
    ["--repeats", "-1"],
    ["--device", "tpu"],
    ["--memory-limit", "0"],
    ["--quick", "--memory-check"],
    ["--padded-keys", "1"],
])
def test_bad_arguments_one_line_error_exit_2(capsys, bad):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("relattn bench: error:")


def test_bad_backend_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--backends", "nope"])
    err = capsys.readouterr().err
    assert "'nope'" in err and all(name in err for name in [*BACKENDS, "auto"])


@pytest.mark.parametrize("inside", [False, True])
def test_out_naming_an_existing_file_fails_before_any_work(tmp_path, capsys, monkeypatch, inside):
    existing = tmp_path / "results"
    existing.write_text("keep me")

    def no_work(*args, **kwargs):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr("relattn.bench.cli.run_bench", no_work)
    out = existing / "sub" if inside else existing
    assert main(["bench", "--lengths", "16", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("relattn bench: error: --out:") and "existing file" in err
    assert existing.read_text() == "keep me"


def _bench_parser():
    import argparse

    from relattn.bench.cli import register

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p, p._subparsers._group_actions[0].choices["bench"]


def test_presets_are_config_values_and_options_replace_their_fields():
    from dataclasses import replace

    from relattn.bench.cli import config_from_args

    p, _ = _bench_parser()
    assert config_from_args(p.parse_args(["bench"]), PRESETS) == PRESETS["full"]
    assert config_from_args(p.parse_args(["bench", "--quick", "--repeats", "7", "--causal"]), PRESETS) == replace(
        PRESETS["quick"], repeats=7, causal=True)
    got = config_from_args(p.parse_args(["bench", "--memory-check", "--peers", "--memory-limit", "2"]), PRESETS)
    assert got == replace(PRESETS["memory-check"], peers=(), memory_limit_bytes=2e9)
    assert PRESETS["quick"].lengths != PRESETS["full"].lengths and PRESETS["memory-check"].backends == ("auto",)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'dense'.*; got 'nope'"):
        BenchConfig(backends=("auto", "nope"))
    with pytest.raises(ValueError, match="peers must be among"):
        BenchConfig(peers=("hf-bert",))


def test_options_have_no_defaults_of_their_own_and_help_shows_the_presets():
    from dataclasses import fields

    _, bench = _bench_parser()
    by_dest = {a.dest: a for a in bench._actions}
    config_fields = {f.name for f in fields(BenchConfig)}
    options = [dest for dest in by_dest if dest in config_fields]
    assert len(options) >= 15
    for dest in options:
        assert by_dest[dest].default is None, dest  # the value comes from the preset, never from argparse
    full, quick, check = PRESETS["full"], PRESETS["quick"], PRESETS["memory-check"]
    assert by_dest["repeats"].help.endswith(
        f"(default {full.repeats}; --quick {quick.repeats}; --memory-check {check.repeats})")
    assert f"default {full.heads})" in by_dest["heads"].help
    assert " ".join(map(str, quick.lengths)) in by_dest["lengths"].help


@pytest.mark.slow
def test_measure_interleaves_rounds_and_drops_a_runner_that_fails():
    inp = make_inputs(Problem(heads=1, head_dim=2, max_relative_position=1), 3)
    log = []

    def runner(name, fail_at=None):
        calls = [0]

        def fn():
            log.append(name)
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("boom\nsecond line")
            return inp.q * 2.0

        return Runner(fn, (inp.q,))

    got = measure({"a": runner("a"), "b": runner("b"), "c": runner("c", fail_at=4)}, inp, repeats=3, warmup=2)
    # first forward of each; 1 more forward warm-up each; 3 interleaved forward rounds (c fails in the second);
    # 2 fwd+bwd warm-ups each; 3 interleaved fwd+bwd rounds; then one forward and one fwd+bwd each for the peaks
    assert "".join(log) == "abc" + "abc" + "abc" + "abc" + "ab" + "aabb" + "ababab" + "aabb"
    for name in "ab":
        assert len(got[name].forward_ms) == len(got[name].fwdbwd_ms) == 3 and got[name].error is None
        assert got[name].forward_median == sorted(got[name].forward_ms)[1]
        assert got[name].peak_fwdbwd_bytes > 0  # the doubled output and its gradient, at least
        torch.testing.assert_close(got[name].output, 2 * inp.q.detach())
    assert got["c"].error == "RuntimeError: boom"
    assert got["c"].forward_ms == got["c"].fwdbwd_ms == [] and got["c"].peak_fwdbwd_bytes is None


def test_make_inputs_is_seeded_and_pads_the_last_entry():
    from dataclasses import replace

    problem = Problem(batch=2, heads=2, head_dim=4, max_relative_position=3, per_head_tables=True, padded_keys=0.25)
    a, b = make_inputs(problem, 8), make_inputs(problem, 8)
    for x, y in zip(a.params, b.params, strict=True):
        assert torch.equal(x, y) and x.requires_grad
    assert not torch.equal(a.q, make_inputs(replace(problem, seed=1), 8).q)
    assert a.q.shape == (2, 2, 8, 4) and a.rel_k.shape == a.rel_v.shape == (2, 7, 4)
    assert a.mask.shape == (2, 1, 1, 8) and bool(a.mask[0].all())
    assert a.mask[1, 0, 0].tolist() == [True] * 6 + [False] * 2
    assert make_inputs(replace(problem, padded_keys=0.0), 8).mask is None


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_floor_is_plain_attention_with_the_same_mask(causal):
    problem = Problem(batch=2, heads=2, head_dim=4, max_relative_position=2, causal=causal, padded_keys=0.5,
                      dtype="float64")
    inp = make_inputs(problem, 6)
    out = sdpa_runner(inp).fn()
    expected = ref.relative_attention(*(t.detach().numpy() for t in (inp.q, inp.k, inp.v)), None, None,
                                      max_relative_position=2, attn_mask=inp.mask.numpy(), is_causal=causal)
    assert_close(out, torch.from_numpy(expected), F64)


def test_a_long_first_length_is_skipped_from_probed_memory_growth():
    # no shorter length to extrapolate from: the peaks at 128 and 256 predict dense's (B, H, N, M) tensors
    config = BenchConfig(lengths=(1024,), heads=2, head_dim=8, max_relative_position=4, threads=1, repeats=1,
                         warmup=0, forward=False, peers=(), backends=("dense",), memory_limit_bytes=4e6)
    rows = {r["implementation"]: r for r in run_bench(config, progress=False)["rows"]}
    assert rows["relattn:dense"]["status"] == "skipped"
    assert rows["relattn:dense"]["reason"].startswith("predicted peak")
    assert rows["sdpa"]["status"] == "ok" and rows["sdpa"]["forward_ms"] is None  # forward=False: fwd+bwd only
    assert rows["sdpa"]["fwdbwd_ms"] > 0 and rows["sdpa"]["forward_ratio"] is None


def test_hf_peer_is_skipped_with_the_reason_without_transformers_5(monkeypatch):
    import sys
    import types

    from relattn.bench.peers import hf_missing_reason

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.57.6"))
    assert transformers_version() is None
    assert hf_missing_reason() == "transformers 4.57.6 installed; the peer needs transformers>=5"
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert hf_missing_reason() == "transformers>=5 not installed (pip install 'relattn[hf]')"
    with pytest.raises(ImportError, match="transformers>=5 not installed"):
        HFWav2Vec2BertRelativeKey(2, 4, 1)
    config = BenchConfig(lengths=(16,), heads=2, head_dim=8, max_relative_position=2, threads=1, repeats=1,
                         warmup=0, peers=("hf",), backends=("auto",))
    rows = {r["implementation"]: r for r in run_bench(config, progress=False)["rows"]}
    for attn in ("eager", "sdpa"):
        assert rows[f"hf-w2v-bert:{attn}"]["status"] == "skipped"
        assert rows[f"hf-w2v-bert:{attn}"]["reason"] == hf_missing_reason()
    assert rows["relattn:auto"]["status"] == rows["sdpa"]["status"] == "ok"
