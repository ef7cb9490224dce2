"""Entry point of the ``ninefold`` command.

Each subcommand lives in its own module under ``ninefold.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the
parsed arguments and returning an exit code. Modules are imported only when listed here, so
adding a subcommand is one line.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import signal
import sys

SUBCOMMAND_MODULES: tuple[str, ...] = ("bench", "serve", "profile", "generate", "chat", "models", "ops", "dsl",
                                        "launch")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="ninefold", description="ninefold: AI system stack")
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"ninefold.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code.

    Ctrl-C anywhere (loading a model, generating) ends the command with exit code 130 and one line
    on stderr, not a traceback; a closed stdout (``ninefold generate ... | head``, or started with
    fd 1 closed) ends it quietly with 141, as a program killed by SIGPIPE, at its first write; a closed
    stdin reads as empty.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if sys.stdin is None:  # started with fd 0 closed
        sys.stdin = open(os.devnull)
    if sys.stdout is None:
        sys.stdout = _ClosedOutput()
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe prints a traceback
        return code
    except KeyboardInterrupt:
        _say(f"\nninefold {args.command}: interrupted")
        return 128 + signal.SIGINT
    except BrokenPipeError:
        _silence_stdout()
        return 128 + signal.SIGPIPE


class _ClosedOutput(io.TextIOBase):
    """stdout when the process started with fd 1 closed: writing to it is writing to a closed pipe."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise BrokenPipeError("stdout is closed")


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed too
        pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush has nowhere to fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor behind sys.stdout (tests)
        pass


def _version() -> str:
    from ninefold import __version__

    return f"ninefold {__version__}"


if __name__ == "__main__":
    sys.exit(main())
