"""``ninefold dsl show MODULE:KERNEL``: print a DSL kernel's generated Triton source."""

from __future__ import annotations

import argparse
import importlib
import sys


def register(subparsers) -> None:
    """Add the ``dsl`` subcommand."""
    parser = subparsers.add_parser("dsl", help="tile DSL tools", description="Tools of the tile DSL (ninefold.dsl).")
    commands = parser.add_subparsers(dest="dsl_command", metavar="COMMAND")
    show = commands.add_parser("show", help="print the generated Triton source of a kernel",
                               description="Print the Triton source ninefold generates for a DSL kernel.")
    show.add_argument("target", metavar="MODULE:KERNEL", help="e.g. ninefold.ops.kernels.add:add_kernel")
    show.set_defaults(func=_show)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def load_kernel(target: str):
    """Import ``MODULE:KERNEL`` and return the kernel object (ValueError/TypeError when it is not one)."""
    from ninefold.dsl.kernel import Kernel

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:KERNEL, got {target!r}")
    module = importlib.import_module(module_name)
    kernel = module
    for part in attr.split("."):
        if not hasattr(kernel, part):
            raise ValueError(f"{module_name} has no attribute {attr!r}")
        kernel = getattr(kernel, part)
    if not isinstance(kernel, Kernel):
        raise TypeError(f"{target} is a {type(kernel).__name__}, not a ninefold.dsl kernel (made by make or jit)")
    return kernel


def _show(args: argparse.Namespace) -> int:
    try:
        kernel = load_kernel(args.target)
    except (ImportError, ValueError, TypeError) as error:
        print(f"ninefold dsl show: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(kernel.source)
    return 0
