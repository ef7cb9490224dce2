"""Entry point of the ``ninefold`` command.

Each subcommand lives in its own module under ``ninefold.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the
parsed arguments and returning an exit code. Modules are imported only when listed here, so
adding a subcommand is one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES: tuple[str, ...] = ("bench", "serve", "profile", "generate", "chat", "models", "ops", "dsl")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="ninefold", description="ninefold: AI system stack")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"ninefold.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def _version() -> str:
    from ninefold import __version__

    return f"ninefold {__version__}"


if __name__ == "__main__":
    sys.exit(main())
