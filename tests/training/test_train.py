"""relattn train / compare: resume determinism, checkpoints that survive SIGKILL, DDP, bad inputs, outputs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import relattn.training.compare as compare_lib
from relattn import cli
from relattn._io import OutputPathError
from relattn.training.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint
from relattn.training.compare import COMPARE_DEFAULTS
from relattn.training.data import ByteData, DataError, eval_windows, get_batch, load_corpus
from relattn.training.model import TransformerConfig
from relattn.training.plots import UNIFORM_LOSS, context_figure, key_table_figure
from relattn.training.recipe import fresh_model
from relattn.training.train import TrainOptions, eval_plan, evaluate, key_table_stats, lr_at, train

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[2] / "src")
TINY = TransformerConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32, max_relative_position=4, context=16)
TINY_ARGS = ["--d-model", "16", "--heads", "2", "--layers", "2", "--d-ff", "32", "--max-relative-position", "4",
             "--context", "16", "--batch-size", "8", "--eval-tokens", "512", "--eval-every", "5",
             "--sample-bytes", "20", "--no-plots", "--no-progress"]
COMPARE_ARGS = [a for a in TINY_ARGS if a not in ("--sample-bytes", "20")]  # compare sets its own sample size


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared: one thread is faster and is what the subprocesses use
    yield
    torch.set_num_threads(before)


def opts(out, **kw):
    base = dict(out=str(out), steps=12, batch_size=8, eval_tokens=512, eval_every=5, checkpoint_every=100,
                sample_bytes=0, plots=False, progress=False)
    base.update(kw)
    return TrainOptions(**base)


def env1():
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ resume


def test_resume_replays_the_uninterrupted_run_exactly(tmp_path, one_thread, capsys):
    cfg = replace(TINY, dropout=0.1)  # dropout exercises the RNG handling too
    full = train(cfg, opts(tmp_path / "full", sample_bytes=30, plots=True))
    assert [s for s, _ in full.train_loss] == list(range(1, 13))
    mean_12 = sum(v for _, v in full.train_loss) / 12
    assert f"train loss {mean_12:.4f} (mean of the last 12 steps)" in capsys.readouterr().out

    part = train(cfg, opts(tmp_path / "part", checkpoint_every=4, keep_checkpoints=10))
    ckpts = tmp_path / "part" / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-00000012.json", "step-00000008.json",
                                                         "step-00000004.json"]
    for p in list_checkpoints(ckpts)[:2]:  # as if killed right after step 4's checkpoint
        p.unlink()
        p.with_suffix(".safetensors").unlink()
    capsys.readouterr()
    resumed = train(cfg, opts(tmp_path / "part", checkpoint_every=4, resume="latest"))
    said = capsys.readouterr().out
    assert "continuing from" in said and "step-00000004.json (step 4)" in said
    assert resumed.metrics["resumed_from"].endswith("step-00000004.json")
    assert resumed.train_loss == full.train_loss == part.train_loss  # bitwise, every step
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    # The outputs of a finished run.
    out = tmp_path / "full"
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 12 and m["train_loss"] == [[s, v] for s, v in full.train_loss]
    assert list(m["val_loss_by_context"]) == ["16", "32", "64", "128"]
    assert m["final_train_loss"] == mean_12 and m["final_train_loss_steps"] == 12
    # Evaluation scores the returned model, and training helped: the same bytes scored the same way by the
    # untrained model of the same seed lose clearly more (12 tiny steps: about 5.2 -> 5.0 nats/byte).
    val = ByteData.from_bytes(load_corpus(None)[0], context=16).val
    untrained = fresh_model(cfg, seed=0)
    for n, v in m["val_loss_by_context"].items():
        assert v == evaluate(full.model, val, int(n), 512)
        assert v < evaluate(untrained, val, int(n), 512) - 0.1, n
    assert m["tokens_per_s"] > 0 and m["val_eval_bytes"] == 512
    assert set(m["key_table"]) >= {"trained", "initial", "prediction_holds"}
    assert m["key_table"]["future_rows_max_change"] == 0.0  # a causal LM never touches offsets > 0
    for png in ("loss_curve.png", "val_loss_vs_context.png", "key_table.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "sample.txt").read_text(encoding="utf-8")) >= 30


def test_resume_refuses_a_different_model_or_run(tmp_path, one_thread):
    train(TINY, opts(tmp_path, steps=2))
    with pytest.raises(CheckpointError, match="d_model=16"):
        train(replace(TINY, d_model=32), opts(tmp_path, steps=4, resume="latest"))
    with pytest.raises(CheckpointError, match="seed"):
        train(TINY, opts(tmp_path, steps=4, resume="latest", seed=3))
    rc = cli.main(["train", "--out", str(tmp_path), "--steps", "2", *TINY_ARGS])  # no --resume: refuse to mix runs
    assert rc == 2


# ------------------------------------------------------------------------------------------------ checkpoints


def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path, one_thread, capsys):
    train(TINY, opts(tmp_path, steps=4, checkpoint_every=2))
    ckpts = tmp_path / "checkpoints"
    newest = ckpts / "step-00000004.json"
    assert load_checkpoint(newest).step == 4

    tensors = newest.with_suffix(".safetensors")
    raw = tensors.read_bytes()
    tensors.write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"step-00000004\.safetensors.*truncated"):
        load_checkpoint(newest)
    tensors.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # one bit flipped
    with pytest.raises(CheckpointError, match=r"step-00000004\.safetensors.*corrupt"):
        load_checkpoint(newest)
    ckpt, refused = latest_checkpoint(ckpts)
    assert ckpt.step == 2 and len(refused) == 1 and "step-00000004" in refused[0]

    text = newest.read_text()
    newest.write_text(text[: len(text) // 3])
    with pytest.raises(CheckpointError, match=r"step-00000004\.json.*JSON"):
        load_checkpoint(newest)

    capsys.readouterr()
    assert cli.main(["train", "--out", str(tmp_path), "--resume", str(newest), *TINY_ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-00000004.json" in err[0]

    # --resume without a path: warn about the damaged newest one and continue from step 2.
    # (settings come from the newest readable record, step 2's: the run's sizes are not the defaults)
    (ckpts / ".step-00000006.safetensors.abc123.safetensors").write_bytes(b"half")  # a killed writer's leftovers
    (ckpts / "step-00000006.safetensors").write_bytes(b"no record")
    assert cli.main(["train", "--out", str(tmp_path), "--resume", "--no-progress", "--no-plots"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002.json", "step-00000002.safetensors",
                                                       "step-00000004.json", "step-00000004.safetensors"]
    captured = capsys.readouterr()
    assert "refusing" in captured.err and "step-00000004" in captured.err
    assert "continuing from" in captured.out and "step-00000002.json (step 2)" in captured.out
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_sigkill_after_the_first_checkpoint_then_resume(tmp_path, one_thread):
    out = tmp_path / "run"
    cmd = [PY, "-m", "relattn", "train", "--steps", "60", "--checkpoint-every", "10", "--out", str(out), *TINY_ARGS]
    proc = subprocess.Popen(cmd, env=env1(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while not list_checkpoints(out / "checkpoints"):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "metrics.json").exists(), "the run finished before it could be killed"
    killed_at = load_checkpoint(list_checkpoints(out / "checkpoints")[0]).step
    assert 10 <= killed_at < 60

    res = subprocess.run([*cmd, "--resume"], env=env1(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"(step {killed_at})" in res.stdout
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 60 and [s for s, _ in m["train_loss"]] == list(range(1, 61))

    # ... and the losses are those of a run that was never interrupted.
    ref = train(TINY, opts(tmp_path / "ref", steps=60, checkpoint_every=10, eval_every=5))
    assert m["train_loss"] == [[s, v] for s, v in ref.train_loss]


# ------------------------------------------------------------------------------------------------ DDP


def _ddp_worker(rank: int, world: int, port: int, out: str, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    result = train(TINY, opts(out, steps=6, checkpoint_every=3, eval_every=3, device="cpu"))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in result.model.state_dict().items() if k != "head.weight"},
              f"{result_dir}/rank{rank}.safetensors")
    Path(f"{result_dir}/rank{rank}.json").write_text(json.dumps(result.metrics["train_loss"]))


@pytest.mark.slow
def test_ddp_two_processes_match_a_single_process_run(tmp_path, one_thread):
    from safetensors.torch import load_file

    torch.multiprocessing.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path / "ddp"), str(tmp_path)), nprocs=2)
    r0, r1 = (load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1))
    for name in r0:
        assert torch.equal(r0[name], r1[name]), name  # replicas never drift apart
    single = train(TINY, opts(tmp_path / "single", steps=6, checkpoint_every=3, eval_every=3))
    ddp_loss = json.loads((tmp_path / "rank0.json").read_text())
    assert ddp_loss == json.loads((tmp_path / "rank1.json").read_text())
    torch.testing.assert_close(torch.tensor(ddp_loss, dtype=torch.float64),
                               torch.tensor(single.train_loss, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    # Parameters agree to rounding, except the key-projection biases: softmax ignores a score shift that is
    # constant along a row, so their exact gradient is 0 and Adam turns rounding noise into lr-sized steps.
    for name, p in single.model.state_dict().items():
        if name != "head.weight" and not name.endswith("k_proj.bias"):
            assert (r0[name] - p).norm() <= 1e-6 * p.norm() + 1e-7, name
    # only rank 0 wrote: one set of checkpoints and metrics
    assert [p.name for p in list_checkpoints(tmp_path / "ddp" / "checkpoints")] == ["step-00000006.json",
                                                                                  "step-00000003.json"]
    assert json.loads((tmp_path / "ddp" / "metrics.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path, one_thread):
    out = tmp_path / "tr"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "relattn", "train",
           "--steps", "10", "--checkpoint-every", "5", "--out", str(out), "--device", "cpu", *TINY_ARGS]
    res = subprocess.run(cmd, env=env1(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 10 and m["world_size"] == 2
    assert res.stdout.count("saved") >= 1 and res.stdout.count("relattn train:") == 1  # rank 0 speaks alone
    # ... and it is the single-process run with the same global batch: the same losses, to rounding.
    single = train(TINY, opts(tmp_path / "single", steps=10, checkpoint_every=5, eval_every=5))
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(m["train_loss"], dtype=torch.float64),
                               torch.tensor(single.train_loss, dtype=torch.float64), **close)
    torch.testing.assert_close(m["val_loss_by_context"], single.metrics["val_loss_by_context"], **close)


# ------------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("case", ["missing", "empty", "not-utf8", "directory", "short", "heads", "context", "lr",
                                  "weight-decay"])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, case, capsys):
    data = tmp_path / "data.txt"
    args = ["train", "--out", str(tmp_path / "o"), "--steps", "2"]
    expect = {"missing": "no such file", "empty": "empty", "not-utf8": "not UTF-8", "directory": "directory",
              "short": "too short", "heads": "divisible", "context": "--context", "lr": "--lr",
              "weight-decay": "--weight-decay must be >= 0, got -1.0"}[case]
    if case == "empty":
        data.write_bytes(b"")
    elif case == "not-utf8":
        data.write_bytes("caf\u00e9 ".encode("latin-1") * 100)
    elif case == "directory":
        data = tmp_path
    elif case == "short":
        data.write_text("hello world " * 10)  # 120 bytes: validation split of 12 < context + 1
    if case in ("missing", "empty", "not-utf8", "directory", "short"):
        args += ["--data", str(data)]
    args += {"heads": ["--d-model", "30", "--heads", "4"], "context": ["--context", "0"], "lr": ["--lr", "-1"],
             "weight-decay": ["--weight-decay", "-1"]}.get(case, [])
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relattn train: error:") and expect in err[0], err
    assert "--grad-clip" not in err[0]  # (no such flag)


@pytest.mark.slow
def test_torchrun_prints_a_bad_input_once(tmp_path):
    """Two ranks under torchrun meet the same bad input: one line says it, and both exit 2 (torchrun's own report
    of the failed ranks follows, as for any failing command)."""
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "relattn", "train",
           "--out", str(tmp_path / "o"), "--weight-decay", "-1"]
    res = subprocess.run(cmd, env=env1(), capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if line.startswith("relattn train: error:")]
    assert said == ["relattn train: error: --weight-decay must be >= 0, got -1.0"], res.stderr[-2000:]


def test_under_torchrun_a_bad_input_is_said_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    """Every rank meets the same bad input (setup checks it before any process group) and exits 2; only rank 0
    prints the line."""
    args = ["train", "--out", str(tmp_path / "o"), "--steps", "2", "--lr", "-1"]
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(args) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == lines, rank


@pytest.mark.slow
def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    res = subprocess.run([PY, "-m", "relattn", "train", "--data", str(tmp_path / "nope.txt")], env=env1(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"relattn train: error: --data {tmp_path / 'nope.txt'}: no such file"


# ------------------------------------------------------------------------------------------------ pieces


def test_default_corpus_and_split():
    raw, name = load_corpus(None)
    assert name == "pydoc_data.topics" and 400_000 < len(raw) < 600_000
    raw.decode("utf-8")
    data = ByteData.from_bytes(raw, context=64)
    assert len(data.val) == len(raw) // 10 and bytes(data.train.tolist()[:50]) == raw[:50]
    with pytest.raises(DataError, match="too short"):
        ByteData.from_bytes(b"x" * 100, context=64)


def test_batches_are_a_function_of_the_step_and_shard_by_rank():
    train_bytes = torch.arange(1000) % 251
    x, y = get_batch(train_bytes.to(torch.uint8), step=3, seed=1, batch_size=6, context=10)
    assert x.shape == y.shape == (6, 10) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, (x + 1) % 251)  # targets are the next byte
    shards = [get_batch(train_bytes.to(torch.uint8), step=3, seed=1, batch_size=6, context=10, rank=r,
                        world_size=3)[0] for r in range(3)]
    assert torch.equal(torch.cat(shards), x)
    other = get_batch(train_bytes.to(torch.uint8), step=4, seed=1, batch_size=6, context=10)[0]
    assert not torch.equal(other, x)


def test_evaluation_scores_the_same_bytes_at_every_length():
    val = torch.arange(200, dtype=torch.uint8)
    total, lengths, skipped = eval_plan(len(val), 8, 10_000)
    assert lengths == [8, 16, 32, 64] and skipped == [] and total == 192
    for n in lengths:
        x, y = eval_windows(val, n, total)
        assert x.shape == (total // n, n) and torch.equal(y.flatten(), val[1:total + 1].long())
    total, lengths, skipped = eval_plan(40, 8, 10_000)
    assert lengths == [8, 16, 32] and skipped == [64] and total == 32


def test_learning_rate_schedule():
    o = TrainOptions(steps=1000, lr=1.0)
    assert lr_at(0, o) == pytest.approx(0.01) and lr_at(99, o) == pytest.approx(1.0)
    assert lr_at(999, o) == pytest.approx(0.1, abs=1e-4) and lr_at(550, o) == pytest.approx(0.55)


def test_key_table_stats_detects_sharper_rows_near_zero():
    k, d = 8, 4
    g = torch.Generator().manual_seed(0)
    initial = torch.randn(2 * k + 1, d, generator=g)
    trained = initial.clone()
    trained[k - 3: k + 1] += 5 * torch.randn(4, d, generator=g)  # offsets -3..0 move a lot
    s = key_table_stats(trained, initial, k)
    assert s["prediction_holds"] and s["trained"]["ratio"] > 2 * s["initial"]["ratio"]
    assert s["future_rows_max_change"] == 0.0
    assert not key_table_stats(initial, initial, k)["prediction_holds"]  # untrained: nothing to see


def test_compare_runs_three_models_and_tabulates(tmp_path, one_thread, capsys):
    args = ["compare", "--out", str(tmp_path), "--steps", "3", *COMPARE_ARGS]
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert list(summary["results"]) == ["relative", "absolute", "none"]
    table = (tmp_path / "compare.md").read_text().splitlines()
    assert len(table) == 5 and table[0].count("val @") == 4
    assert summary["results"]["relative"]["parameters"] > summary["results"]["none"]["parameters"]
    assert not (tmp_path / "compare.png").exists() and "compare.png" not in capsys.readouterr().out  # --no-plots
    assert compare_lib.plot(summary, tmp_path / "plots.png").read_bytes()[:4] == b"\x89PNG"  # what it would write
    # The table reports the runs compare made: each run differs from the others in its positions only, and
    # every cell is that run's own metric (bold: the column's best).
    runs = {pos: json.loads((tmp_path / pos / "metrics.json").read_text()) for pos in summary["results"]}
    for pos, run in runs.items():
        assert run["config"] == {**summary["config"], "positions": pos} and run["steps"] == 3
        assert run["options"]["seed"] == 0 and run["options"]["batch_size"] == 8
        r = summary["results"][pos]
        assert r["val_loss_by_context"] == run["val_loss_by_context"]
        assert r["final_train_loss"] == sum(v for _, v in run["train_loss"]) / 3
        row = next(line for line in table if line.startswith(f"| {pos} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{run['parameters']:,}" and float(cells[2]) == round(r["final_train_loss"], 4)
        for cell, (n, v) in zip(cells[3:], run["val_loss_by_context"].items(), strict=True):
            best = min(x["val_loss_by_context"][n] for x in runs.values())
            assert cell == (f"**{v:.4f}**" if v == best else f"{v:.4f}")
    assert len({json.dumps(run["val_loss_by_context"]) for run in runs.values()}) == 3
    assert cli.main(args) == 0  # rerunning reuses the finished runs
    again = json.loads((tmp_path / "compare.json").read_text())
    for pos, run in runs.items():
        assert again["results"][pos]["val_loss_by_context"] == run["val_loss_by_context"]
        assert json.loads((tmp_path / pos / "metrics.json").read_text())["train_loss"] == run["train_loss"]


# ------------------------------------------------------------------------------------------------ trip-ups


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize("where", ["file", "below-a-file"])
def test_out_naming_a_file_is_refused_before_any_work(tmp_path, command, where, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("keep me")
    out = taken if where == "file" else taken / "run"
    assert cli.main([command, "--out", str(out), "--steps", "2", *COMPARE_ARGS]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing trained, nothing printed
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"relattn {command}: error: --out {out}") and "not a folder" in err[0]
    assert taken.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [taken]
    with pytest.raises(OutputPathError, match="not a folder"):
        train(TINY, opts(out))


def _parser(command):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return sub.choices[command]


@pytest.mark.parametrize("command", ["train", "compare"])
def test_help_states_the_defaults_the_command_uses(command):
    """Every "default: X" in a command's help is the value a run without that option gets."""
    from relattn.training.arguments import MODEL_ARGS, configs_from_args

    parser = _parser(command)
    args = parser.parse_args([])
    args.command = command
    defaults = TrainOptions() if command == "train" else COMPARE_DEFAULTS
    config, options = configs_from_args(args, defaults)
    checked = 0
    for action in parser._actions:
        said = re.search(r"default: ([^)]+)\)?$", action.help or "")
        if not said or action.dest in ("data", "warmup", "out", "help"):
            continue
        value = getattr(config, MODEL_ARGS[action.dest]) if action.dest in MODEL_ARGS else getattr(options, action.dest)
        assert said.group(1) in (str(value), repr(value)), (action.dest, said.group(1), value)
        checked += 1
    assert checked >= 18
    assert options.steps == (1000 if command == "train" else 700)
    text = " ".join(parser.format_help().split())
    assert f"--steps STEPS default: {options.steps}" in text
    assert args.out == options.out and f"(default: {options.out})" in text


def test_compare_does_not_offer_positions(capsys):
    assert "--positions" not in _parser("compare").format_help()
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--positions", "none"])
    assert e.value.code == 2 and "unrecognized arguments: --positions" in capsys.readouterr().err


def test_context_plot_shows_the_loss_scale():
    # a short run's losses differ in the third decimal; the axis must not magnify that into structure
    metrics = {"val_loss_by_context": {"16": 2.301, "32": 2.305, "64": 2.309, "128": 2.310}}
    fig = context_figure(metrics, TINY)
    bottom, top = fig.axes[0].get_ylim()
    assert bottom == 0.0 and UNIFORM_LOSS <= top < 1.2 * UNIFORM_LOSS
    assert any(list(line.get_ydata()) == [UNIFORM_LOSS, UNIFORM_LOSS] for line in fig.axes[0].get_lines())
    plt.close(fig)
    fig = context_figure({"val_loss_by_context": {"16": 7.5}}, TINY)  # worse than guessing: still on the axis
    assert fig.axes[0].get_ylim()[1] >= 7.5
    plt.close(fig)


@pytest.mark.parametrize("per_head", [False, True])
def test_key_table_plot_has_integer_ticks(per_head):
    k, d = 4, 5
    g = torch.Generator().manual_seed(0)
    shape = (2, 2 * k + 1, d) if per_head else (2 * k + 1, d)
    initial = torch.randn(shape, generator=g)
    fig = key_table_figure(initial + 0.1 * torch.randn(shape, generator=g), initial, k)
    tables, curve = fig.axes[:2], fig.axes[2]
    for ax in (*tables, curve):
        lo, hi = sorted(ax.get_xlim())
        xs = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(xs) >= 2 and all(float(t).is_integer() for t in xs), (ax.get_title(), xs)
    for ax in tables:
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"{o:+d}" for o in range(-k, k + 1)]
    assert [float(t) for t in curve.get_lines()[0].get_xdata()] == [-3.0, -2.0, -1.0, 0.0]
    plt.close(fig)
