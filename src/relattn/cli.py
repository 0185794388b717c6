"""The ``relattn`` command: thin subcommands over library functions.

Each command lives in its own module, which exposes ``register(subparsers)``; that adds the
subcommand's arguments and sets ``func`` to a function of the parsed arguments returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ("relattn.demo", "relattn.bench", "relattn.train", "relattn.compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relattn", description="Self-attention with relative position representations (Shaw et al., 2018)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
