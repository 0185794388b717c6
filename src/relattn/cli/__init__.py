"""The ``relattn`` command: thin subcommands over library functions.

Each command lives in its own module, which exposes ``register(subparsers)``; that adds the
subcommand's arguments and sets ``func`` to a function of the parsed arguments returning an exit code.
An output folder that cannot be one (:class:`~relattn._io.OutputPathError`) is one line on stderr and
exit status 2, whichever command meets it. The commands need the ``cli`` extra (matplotlib, safetensors,
tqdm), which the op and the module do not: without it they stop before any work, saying how to install it
(``relattn check`` needs none of it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from .. import __version__
from .._io import OutputPathError

COMMAND_MODULES = ("relattn.cli.check", "relattn.cli.demo", "relattn.bench.cli", "relattn.training.train",
                   "relattn.training.compare")
CLI_EXTRA = ("matplotlib", "safetensors", "tqdm")  # pyproject.toml's "cli" extra


def missing_cli_packages() -> list[str]:
    """The packages of the ``cli`` extra that are not installed."""
    return [name for name in CLI_EXTRA if importlib.util.find_spec(name) is None]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relattn", description="Self-attention with relative position representations (Shaw et al., 2018)."
    )
    parser.add_argument("--version", action="version", version=f"relattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "needs_cli_extra", True) and (missing := missing_cli_packages()):
        print(f"relattn {args.command}: error: needs {', '.join(missing)} (the 'cli' extra): "
              "pip install 'relattn[cli]'", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except OutputPathError as e:
        print(f"relattn {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
