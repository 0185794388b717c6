"""The scripts under benchmarks/ run at tiny sizes, and what they print is what their JSON holds: the rows they
claim, with ratios against SDPA from the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import require_backend
from relattn import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--lengths", "48", "96", "--heads", "2", "--head-dim", "8", "--repeats", "1", "--threads", "1"]
K4 = ["--max-relative-position", "4"]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _check_ratios(rows: list[dict]) -> None:
    for r in rows:
        if r["status"] != "ok":
            assert r["reason"], r
            continue
        sdpa = next(s for s in rows if s["n"] == r["n"] and s["implementation"] == "sdpa")
        assert r["fwdbwd_ms"] > 0 and len(r["fwdbwd_all_ms"]) == 1
        assert r["fwdbwd_ratio"] == pytest.approx(r["fwdbwd_ms"] / sdpa["fwdbwd_ms"], rel=1e-12)


def _printed(stdout: str, first: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.split()[:1] == [first]]


@pytest.mark.slow
def test_fast_vs_sdpa(tmp_path):
    out = _run("fast_vs_sdpa.py", *TINY, *K4, "--backends", "auto", "blocked", "--json", str(tmp_path / "r.json"))
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [run["config"]["causal"] for run in runs] == [False, True]
    for run in runs:
        rows = run["rows"]
        assert [(r["n"], r["implementation"]) for r in rows] == [
            (n, name) for n in (48, 96) for name in ("sdpa", "relattn:auto", "relattn:blocked")]
        _check_ratios(rows)
        assert all(r["status"] == "ok" and r["memory_ratio"] > 0 for r in rows)
        for cells in _printed(out, "96"):  # N causal sdpa_ms name ms ratio ...
            if cells[1] == str(run["config"]["causal"]):
                row = next(r for r in rows if r["n"] == 96 and r["implementation"] == cells[3])
                assert float(cells[5]) == pytest.approx(row["fwdbwd_ratio"], abs=0.006)


@pytest.mark.slow
def test_masked(tmp_path):
    out = _run("masked.py", *TINY, *K4, "--json", str(tmp_path / "r.json"))
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["padded_keys"] == 0.25 and result["config"]["batch"] == 2
    rows = result["rows"]
    names = ["sdpa", *(f"relattn:{b}" for b in BACKENDS), "relattn:auto"]
    assert [(r["n"], r["implementation"]) for r in rows] == [(n, name) for n in (48, 96) for name in names]
    _check_ratios(rows)
    for cells in _printed(out, "96"):
        row = next(r for r in rows if r["n"] == 96 and r["implementation"] == cells[1])
        if row["status"] == "ok":
            assert float(cells[3]) == pytest.approx(row["fwdbwd_ratio"], abs=0.006)
        else:
            assert " ".join(cells[2:]) == f"{row['status']}: {row['reason']}"


@pytest.mark.slow
def test_crossover(tmp_path):
    out = _run("crossover.py", *TINY, "--ks", "2", "4", "--json", str(tmp_path / "r.json"))
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [run["config"]["max_relative_position"] for run in runs] == [2, 4]
    for run, kk in zip(runs, (2, 4), strict=True):
        rows = run["rows"]
        assert {r["implementation"] for r in rows} == {"sdpa", *(f"relattn:{b}" for b in BACKENDS)}
        _check_ratios(rows)
        for n in (48, 96):
            ok = [r for r in rows if r["n"] == n and r["kind"] == "relattn" and r["status"] == "ok"]
            best = min(ok, key=lambda r: r["fwdbwd_ms"])["implementation"].removeprefix("relattn:")
            assert [cells[-1] for cells in _printed(out, str(kk)) if cells[1] == str(n)] == [best]


@pytest.mark.slow
def test_variants(tmp_path):
    out = _run("variants.py", "--n", "24", "--heads", "2", "--reps", "1", "--threads", "1",
               "--json", str(tmp_path / "v.json"))
    medians = json.loads((tmp_path / "v.json").read_text())["median_ms"]
    assert set(medians) == {"K=36 (73 rows)", "(64, 8) (73 rows)", "K=64 (129 rows)", "(64, 8) keys only", "K=4",
                            "K=4 zero beyond"}
    assert all(ms > 0 for ms in medians.values())
    for name, ms in medians.items():  # every case printed with its ratio to the symmetric 73-row window
        assert f"{name:>20}: {ms:9.1f} ms  {ms / medians['K=36 (73 rows)']:5.2f}x K=36" in out


@pytest.mark.slow
def test_log_buckets(tmp_path):
    out = _run("log_buckets.py", "--n", "40", "--heads", "2", "--reps", "1", "--threads", "1",
               "--json", str(tmp_path / "lb.json"))
    result = json.loads((tmp_path / "lb.json").read_text())
    medians = result["median_ms"]
    assert result["K"] == 39  # N = 40: offsets up to 39, all inside the buckets' identity range
    assert set(medians) == {"log buckets (expanded)", "clipped, 511 rows", "expansion only"}
    for name, ms in medians.items():
        assert ms > 0 and f"{name:>24}: {ms:9.1f} ms  {ms / medians['clipped, 511 rows']:5.2f}x" in out


@pytest.mark.slow
def test_padding(tmp_path):
    """benchmarks/padding.py: packed against masked at a padded fraction, the lengths giving that fraction."""
    out = _run("padding.py", "--fractions", "0.3", "--embed", "16", "--heads", "2", "--batch", "3", "--length", "24",
               "--reps", "1", "--threads", "1", "--json", str(tmp_path / "p.json"))
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert sum(24 - n for n in row["lengths"]) == round(0.3 * 3 * 24)
    assert row["fraction"] == pytest.approx(0.3, abs=0.02)
    assert row["ratio"] == pytest.approx(row["masked_ms"] / row["packed_ms"], rel=1e-12)
    assert f"masked/packed {row['ratio']:.2f}" in out


def test_decode_overhead(tmp_path):
    require_backend("native")
    out = _run("decode_overhead.py", "--quick", "--threads", "1", "--keys", "5", "40", "--out",
               str(tmp_path / "d.json"))
    result = json.loads((tmp_path / "d.json").read_text())
    assert [r["keys"] for r in result["rows"]] == [5, 40] and result["meta"]["calls"] == 3
    for row in result["rows"]:
        assert all(len(row[f"{n}_all_ms"]) == 2 for n in ("relattn", "op", "sdpa"))
        for stat, pick in (("median", None), ("fastest", min)):
            got = row[stat]
            times = {n: row[f"{n}_all_ms"] for n in ("relattn", "op", "sdpa")}
            us = {n: (pick(t) if pick else sorted(t)[0] / 2 + sorted(t)[1] / 2) * 1e3 / 3 for n, t in times.items()}
            assert got["relattn_us"] == pytest.approx(us["relattn"]) and got["op_us"] == pytest.approx(us["op"])
            assert got["overhead_us"] == pytest.approx(us["relattn"] - us["op"])
            assert got["ratio"] == pytest.approx(us["relattn"] / us["sdpa"])
            assert f"{row['keys']:6d} {stat:>8} {got['relattn_us']:9.1f}" in out


@pytest.mark.slow
def test_dropout(tmp_path):
    require_backend("native")
    out = _run("dropout.py", "--lengths", "48", "--repeats", "1", "--threads", "1", "--json", str(tmp_path / "d.json"))
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [48] and rows[0]["dropout_p"] == 0.1 and rows[0]["backend"] == "native"
    r = rows[0]
    assert r["dropout / no dropout"] == pytest.approx(r["dropout ms"] / r["no dropout ms"], rel=1e-12)
    assert r["sdpa dropout / dropout"] == pytest.approx(r["sdpa dropout ms"] / r["dropout ms"], rel=1e-12)
    cells = _printed(out, "48")[0]  # N dropout none sdpa ratio ratio
    assert float(cells[4]) == pytest.approx(r["dropout / no dropout"], abs=0.006)
    assert float(cells[5]) == pytest.approx(r["sdpa dropout / dropout"], abs=0.006)


@pytest.mark.slow
def test_training(tmp_path):
    """benchmarks/training.py --quick: every model case in its four variants, the native kernel serving every
    attention call of the patched step at the config's dropout, the ratios those of the medians, the table printing
    them; and the op's row."""
    require_backend("native")
    pytest.importorskip("transformers")
    pytest.importorskip("eole")
    out = _run("training.py", "--quick", "--memory", "--threads", "1", "--out", str(tmp_path / "t.json"))
    result = json.loads((tmp_path / "t.json").read_text())
    rows = result["rows"]
    assert [r["case"] for r in rows] == ["deberta", "speecht5", "parakeet", "w2v-conformer", "eole"]
    for r in rows:
        ms = r["ms"]
        assert set(ms) == set(r["peak_mb"]) == {f"{s} @ {d}" for s in ("unpatched", "relattn") for d in ("config",
                                                                                                          "zero")}
        assert all(len(t) == 1 for t in r["all_ms"].values()) and r["attention_dropout"] == 0.1
        assert r["speedup"] == pytest.approx(ms["unpatched @ config"] / ms["relattn @ config"], rel=1e-12)
        assert r["speedup_at_0"] == pytest.approx(ms["unpatched @ zero"] / ms["relattn @ zero"], rel=1e-12)
        assert r["kept"] == pytest.approx(r["speedup"] / r["speedup_at_0"], rel=1e-12)
        assert r["backend_calls"] == r["backward_calls"] == {"native": r["expected_calls"]}, r["case"]
        assert f"| {r['shape']} | 0.1 | {r['unpatched_runs']} | **{r['speedup']:.2f}×**" in out
        assert f"| {r['speedup_at_0']:.2f}× | {r['kept']:.0%} |" in out
    (op,) = result["op"]
    assert op["n"] == 48 and op["dropout_p"] == 0.1 and op["backend"] == "native"
    assert f"| 48 | {op['dropout ms']:.0f} ms | {op['no dropout ms']:.0f} ms | {op['dropout / no dropout']:.2f}×" in out


@pytest.mark.slow
def test_gemm16():
    """benchmarks/gemm16.py: MKL's 16-bit GEMM against torch's brgemm on the kernel's tile shapes, both giving the
    same result, or the line saying this CPU runs no such pair."""
    out = _run("gemm16.py", "--reps", "3")
    if "nothing to compare" in out:
        return
    lines = out.strip().splitlines()
    assert lines[0].startswith("CPU ") and len(lines) == 3 + 5 + 1 + 5 and lines[8].startswith("float32")
    for line in lines[9:]:
        assert len(line.split()) == 8 and float(line.split()[5]) > 0, line
    for line in lines[3:8]:
        cells = line.split()  # M x N x K, MKL, brgemm, MKL / brgemm, pack, equal
        mkl, brgemm, ratio = float(cells[5]), float(cells[6]), float(cells[7])
        assert mkl > 0 and brgemm > 0 and ratio == pytest.approx(mkl / brgemm, rel=0.03) and cells[-1] == "yes"
