"""``relattn bench``: relattn's backends against the floor and the peers, side by side in one process.

This module holds the command line (whose defaults are the presets' values, :mod:`.config`), and the table and
plot of a result. What runs is :mod:`relattn.bench.run`; how it is
measured is :mod:`relattn.bench.measure`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path

import torch

from .._io import atomic_write_text, save_figure
from ..backends import check_name
from .config import PRESET_OUT, PRESETS, BenchConfig
from .measure import DTYPES, fmt_bytes, relattn_names
from .peers import PEERS
from .run import run_bench

__all__ = ["add_arguments", "config_from_args", "format_table", "plot", "write_results"]


# ---------------------------------------------------------------------------------------------- reporting


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _title(cfg: dict, m: dict) -> str:
    pad = f", key padding {cfg['padded_keys']:g} of the last entry" if cfg.get("padded_keys") else ""
    return (f"{cfg['dtype']}, B={cfg['batch']}, H={cfg['heads']}, D={cfg['head_dim']}, "
            f"K={cfg['max_relative_position']}, {'per-head' if cfg['per_head_tables'] else 'shared'} key+value "
            f"tables, {'causal' if cfg['causal'] else 'not causal'}{pad}, {cfg['device']} "
            f"({m.get('gpu', m['cpu'])}), {m['torch_threads']} thread{'s' if m['torch_threads'] != 1 else ''}, "
            f"torch {m['torch']}")


def format_table(result: dict) -> str:
    """The terminal table: one line per implementation and length."""
    head = ["N", "implementation", "fwd ms", "x SDPA", "fwd+bwd ms", "x SDPA", "peak fwd+bwd", "x SDPA", "note"]
    lines = []
    for r in result["rows"]:
        if r["status"] == "ok":
            note = "; ".join(s for s in (r["detail"], r["diff_vs"] and f"max|diff| vs {r['diff_vs']} "
                                         f"{r['max_abs_diff']:.1e}") if s)
            lines.append([str(r["n"]), r["implementation"], _fmt_ms(r["forward_ms"]), _fmt_ratio(r["forward_ratio"]),
                          _fmt_ms(r["fwdbwd_ms"]), _fmt_ratio(r["fwdbwd_ratio"]), fmt_bytes(r["peak_fwdbwd_bytes"]),
                          _fmt_ratio(r["memory_ratio"]), note])
        else:
            lines.append([str(r["n"]), r["implementation"], "-", "-", "-", "-", "-", "-",
                          f"{r['status']}: {r['reason']}"])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    widths[-1] = 0

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in (0, 2, 3, 4, 5, 6, 7) else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    notes = {r["implementation"]: r["note"] for r in result["rows"]}
    return "\n".join([f"relattn bench: {_title(result['config'], result['machine'])}", "", fmt(head),
                      fmt(["-" * w for w in widths]), *map(fmt, lines), "", f"time: {result['timing_method']}",
                      f"peak: {result['memory_method']}",
                      *(f"{label}: {result['machine'][key]}" for key, label in (("cpu_features", "cpu"),
                                                                                ("native_choice", "native kernel"))
                        if key in result["machine"]),
                      "implementations:",
                      *(f"  {name}: {note}" for name, note in notes.items())])


def plot(result: dict, path: str | os.PathLike) -> Path:
    """Log-log time vs N per implementation (forward, forward+backward) and peak memory; saved atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), layout="constrained")
    names = list(dict.fromkeys(r["implementation"] for r in result["rows"]))
    lengths = sorted({r["n"] for r in result["rows"]})
    for ax, key, scale, label in ((axes[0], "forward_ms", 1.0, "forward: median ms"),
                                  (axes[1], "fwdbwd_ms", 1.0, "forward + backward: median ms"),
                                  (axes[2], "peak_fwdbwd_bytes", 1e-6, "forward + backward: peak extra MB")):
        for name in names:
            pts = [(r["n"], r[key] * scale) for r in result["rows"]
                   if r["implementation"] == name and r["status"] == "ok" and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name,
                        linewidth=2.5 if name == "sdpa" else 1.5, linestyle="--" if name == "sdpa" else "-")
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", title=label)
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(result["config"], result["machine"]))
    return save_figure(fig, path)


def write_results(result: dict, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``bench.json`` and ``bench.png`` in ``out_dir``, both written atomically."""
    out_dir = Path(out_dir)
    json_path = out_dir / "bench.json"
    atomic_write_text(json_path, json.dumps(result, indent=1) + "\n")
    return json_path, plot(result, out_dir / "bench.png")


# ---------------------------------------------------------------------------------------------- command line


def _bounded(convert: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse ``type``: ``convert(text)``, refused with "expected {what}" unless ``ok(value)``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value if convert is int else repr(text)}")
        return value

    return parse


def _checked(check: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse ``type`` from a check that raises ValueError: its message becomes the one-line error."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


_positive_int = _bounded(int, "a positive integer", lambda x: x >= 1)
_non_negative_int = _bounded(int, "an integer >= 0", lambda x: x >= 0)
_positive_float = _bounded(float, "a positive number", lambda x: x > 0 and math.isfinite(x))
_fraction = _bounded(float, "a number in [0, 1)", lambda x: 0 <= x < 1)

# BenchConfig field -> (flag, argparse keywords, help); defaults are never written here: they come from PRESETS
_OPTIONS: dict[str, tuple[str, dict, str]] = {
    "lengths": ("--lengths", {"nargs": "+", "type": _positive_int, "metavar": "N"}, "sequence lengths N = M"),
    "causal": ("--causal", {"action": argparse.BooleanOptionalAction}, "is_causal=True everywhere"),
    "batch": ("--batch", {"type": _positive_int}, "B"),
    "heads": ("--heads", {"type": _positive_int}, "H"),
    "head_dim": ("--head-dim", {"type": _positive_int}, "D"),
    "max_relative_position": ("--max-relative-position", {"type": _non_negative_int}, "K: tables of 2K+1 rows"),
    "per_head_tables": ("--per-head-tables", {"action": argparse.BooleanOptionalAction},
                        "(H, 2K+1, D) tables instead of one shared by all heads"),
    "padded_keys": ("--padded-keys", {"type": _fraction, "metavar": "FRACTION"},
                    "mask out this fraction of keys at the end of the last batch entry (a key padding mask)"),
    "dtype": ("--dtype", {"choices": tuple(DTYPES)}, "dtype of every tensor"),
    "device": ("--device", {"choices": ("cpu", "cuda")}, "device"),
    "threads": ("--threads", {"type": _positive_int}, "torch threads"),
    "repeats": ("--repeats", {"type": _positive_int}, "timed calls per measurement"),
    "warmup": ("--warmup", {"type": _non_negative_int}, "untimed calls first"),
    "forward": ("--forward", {"action": argparse.BooleanOptionalAction},
                "time the forward alone (inference under torch.no_grad) too"),
    "memory": ("--memory", {"action": argparse.BooleanOptionalAction}, "measure peak memory"),
    "backends": ("--backends", {"nargs": "+", "type": _checked(check_name), "metavar": "NAME"},
                 f"relattn backends: any of {', '.join(relattn_names())}"),
    "peers": ("--peers", {"nargs": "*", "choices": PEERS}, "peers besides SDPA (give none for none)"),
    "memory_limit_bytes": ("--memory-limit", {"type": _positive_float, "metavar": "GB"},
                           "skip what is predicted to need more than this"),
    "time_limit_s": ("--time-limit", {"type": _positive_float, "metavar": "S"},
                     "skip a measurement (one implementation at one length) predicted to take longer, from the "
                     "times at shorter lengths"),
    "seed": ("--seed", {"type": int}, "seed of the inputs"),
}


def _show(name: str, value) -> str:
    if value is None:
        return {"backends": "all and auto", "memory_limit_bytes": "half the free memory"}.get(name, "none")
    if name == "memory_limit_bytes":
        return f"{value / 1e9:g}"
    if isinstance(value, tuple):
        return " ".join(map(str, value)) if value else "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default_help(name: str, presets: dict[str, BenchConfig]) -> str:
    """ "default X" from the first preset, then "--<preset> Y" for every other preset that differs."""
    (_, base), *others = presets.items()
    parts = [f"default {_show(name, getattr(base, name))}"]
    parts += [f"--{key} {_show(name, getattr(c, name))}" for key, c in others
              if getattr(c, name) != getattr(base, name)]
    return "; ".join(parts)


def add_arguments(p: argparse.ArgumentParser, presets: dict[str, BenchConfig], names: Sequence[str] | None = None,
                  ) -> None:
    """Add the options of :data:`_OPTIONS` (``names``, or all) to ``p``; their help shows the presets' values.

    Every one defaults to None, so :func:`config_from_args` can tell what was given from what was not.
    """
    for name in names or _OPTIONS:
        flag, kwargs, text = _OPTIONS[name]
        text = f"{text} ({_default_help(name, presets)})".replace("%", "%%")
        p.add_argument(flag, dest=name, default=None, help=text, **kwargs)


def config_from_args(args: argparse.Namespace, presets: dict[str, BenchConfig], command: str = "") -> BenchConfig:
    """The preset ``args.preset`` (else the first), with every option that was given put in its place."""
    given = {name: getattr(args, name) for name in _OPTIONS if getattr(args, name, None) is not None}
    for name in ("lengths", "backends", "peers"):
        if name in given:
            given[name] = tuple(given[name])
    if "memory_limit_bytes" in given:
        given["memory_limit_bytes"] *= 1e9
    return replace(presets[getattr(args, "preset", None) or next(iter(presets))], **given, command=command)


def _command_line(argv: Sequence[str] | None) -> str:
    if argv is None:
        if not sys.argv or not sys.argv[0].endswith(("relattn", "__main__.py")):
            return ""
        argv = sys.argv[1:]
    return " ".join(["relattn", *argv])


def out_dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be the output folder (it, or a folder above it, is an existing file), else None."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is" if p == path else f"is inside {str(p)!r}, which is"
                return f"{str(path)!r} {what} an existing file, not a folder"
            return None if os.access(p, os.W_OK) else f"{str(p)!r} is not writable"
    return None


def _main(args: argparse.Namespace) -> int:
    config = config_from_args(args, PRESETS, _command_line(None))
    out = args.out or (PRESET_OUT[args.preset] + ("-causal" if config.causal and args.preset != "memory-check"
                                                  else ""))
    problem = out_dir_problem(out)
    if problem is not None:
        print(f"relattn bench: error: --out: {problem}", file=sys.stderr)
        return 2
    if config.device == "cuda" and not torch.cuda.is_available():
        print("relattn bench: error: --device cuda: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    result = run_bench(config, progress=not args.no_progress)
    print(format_table(result))
    json_path, png_path = write_results(result, out)
    print(f"\nsaved {json_path} and {png_path}")
    return 0


def _one_line_error(prog: str) -> Callable[[str], None]:
    def error(message: str) -> None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    return error


def _preset_help(key: str) -> str:
    base, preset = PRESETS["full"], PRESETS[key]
    return ", ".join(f"{_OPTIONS[f.name][0]} {_show(f.name, getattr(preset, f.name))}" for f in fields(BenchConfig)
                     if f.name in _OPTIONS and getattr(preset, f.name) != getattr(base, f.name))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time and memory of relattn's backends against SDPA and the peers",
                       description="Time and peak memory of relattn's backends against PyTorch's SDPA (no "
                                   "positions) and the peers' formulations, side by side in one process, "
                                   "on the same q, k, v. Writes bench.json and bench.png to --out.")
    p.error = _one_line_error("relattn bench")  # one line, not the usage block
    mode = p.add_mutually_exclusive_group()
    for key in PRESETS:
        if key != "full":
            mode.add_argument(f"--{key}", dest="preset", action="store_const", const=key,
                              help=f"preset: {_preset_help(key)}")
    add_arguments(p, PRESETS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", metavar="DIR",
                   help="folder for bench.json and bench.png (default relattn-bench, relattn-bench-causal or "
                        "relattn-bench-memory)")
    p.set_defaults(func=_main, preset="full")
