"""``ninefold launch``: start N ranks of a program on this host (``ninefold.comm.launch.launch``).

Also run as ``python -m ninefold.comm.launch``, through :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys

from ninefold.cli._common import checked_type, fail, port_type, seconds_type

DESCRIPTION = ("Start --nproc processes of PROGRAM on this host, each with the rendezvous environment "
               "torch.distributed and ninefold.comm read (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
               "MASTER_ADDR, MASTER_PORT). Everything after PROGRAM goes to it unchanged; a PROGRAM ending in "
               ".py runs with this Python. The first rank to fail stops the others and its exit code is the "
               "launcher's; Ctrl-C reaches every rank.")
USAGE = ("%(prog)s [-h] -n/--nproc N [--master-addr ADDR] [--master-port PORT] [--no-tag-output] [--grace SECONDS] "
         "[--] PROGRAM [ARGS...]")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``launch`` to the top-level parser."""
    parser = subparsers.add_parser("launch", help="start N processes of a program (torchrun-style rendezvous)",
                                   usage=USAGE, description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def main(argv: list[str] | None = None) -> int:
    """``python -m ninefold.comm.launch ARGS``: the same options as ``ninefold launch``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m ninefold.comm.launch", usage=USAGE, description=DESCRIPTION)
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args(argv))
    except KeyboardInterrupt:  # before the launcher took over SIGINT
        return 128 + signal.SIGINT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ninefold launch``."""
    parser.add_argument("-n", "--nproc", required=True, metavar="N", type=checked_type(int, lambda v: v >= 1, "an integer >= 1"),
                        help="number of processes (ranks) to start on this host")
    parser.add_argument("--master-addr", default="127.0.0.1", metavar="ADDR",
                        help="address of this host where rank 0 listens for the others (default: 127.0.0.1)")
    parser.add_argument("--master-port", default=None, metavar="PORT",
                        type=port_type,
                        help="TCP port for the rendezvous (default: a free one)")
    parser.add_argument("--no-tag-output", dest="tag_output", action="store_false",
                        help="let the ranks write to the terminal directly instead of as '[rank N] line'")
    parser.add_argument("--grace", metavar="SECONDS", type=seconds_type, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: 5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="PROGRAM [ARGS...]",
                        help="the program every rank runs and its arguments (a '--' before PROGRAM is allowed)")


def run_from_args(args: argparse.Namespace) -> int:
    """Launch the ranks described by parsed arguments; returns the launcher's exit code."""
    from ninefold.comm.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return fail("launch", "the following arguments are required: PROGRAM")
    program = command[0]
    if program.endswith(".py"):
        if not os.path.isfile(program):
            return fail("launch", f"argument PROGRAM: got {program!r}; expected a Python file that exists")
        command = [sys.executable, *command]
    elif shutil.which(program) is None:
        return fail("launch", f"argument PROGRAM: got {program!r}; expected a program on PATH, the path of an "
                              f"executable file or a .py file")
    return launch(command, args.nproc, master_addr=args.master_addr, master_port=args.master_port,
                  tag_output=args.tag_output, grace_s=args.grace)
