"""``ninefold ops``: list the operator library, tune it, build trimmed subsets."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    """Add ``ops list|tune|build`` to the top-level parser."""
    parser = subparsers.add_parser("ops", help="operator library: list, tune, build trimmed subsets",
                                   description="The operator library: list its operators and implementations, "
                                               "tune the choice per shape, build trimmed ahead-of-time subsets.")
    commands = parser.add_subparsers(dest="ops_command", metavar="ACTION", required=True)

    listing = commands.add_parser("list", help="operators and their implementations (devices, dtypes)",
                                  description="List every operator and its implementations (devices, dtypes).")
    listing.set_defaults(func=_list)

    tune = commands.add_parser("tune", help="benchmark candidates and store the fastest in the tuning cache",
                               description="Time every implementation of the operators on a shape set and store "
                                           "the fastest per shape in the tuning cache (or --out).")
    tune.add_argument("--ops", nargs="+", metavar="OP", help="operators to tune (default: all)")
    tune.add_argument("--shapes", default=None,
                      help="shape set: llama-8b, smollm2, tiny (default: llama-8b on GPUs, smollm2 on the CPU)")
    tune.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    tune.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["float16", "bfloat16", "float32"],
                      help="dtypes to tune (default: bfloat16)")
    tune.add_argument("--out", default=None, help="tuning file to write (default: the user's tuning cache)")
    tune.set_defaults(func=_tune)

    build = commands.add_parser("build", help="build a trimmed, ahead-of-time compiled subset from a manifest",
                                description="Build a trimmed, ahead-of-time compiled subset of the operator "
                                            "library from an ops.toml manifest.")
    build.add_argument("--manifest", required=True, help="ops.toml listing operators, dtypes and implementations")
    build.add_argument("--target", default=None, help="compile target, e.g. cuda:90 or cpu (default: the manifest's)")
    build.add_argument("--out", required=True, help="output directory (use it with NINEFOLD_OPS_BUILD=DIR)")
    build.set_defaults(func=_build)


def _list(args: argparse.Namespace) -> int:
    import ninefold.ops  # noqa: F401  (registers every implementation)
    from ninefold.ops import build, registry
    from ninefold.ops.spec import dtype_names

    active = build.active()
    if active is not None:
        print(f"trimmed build: {active.path} (target {active.target}; paged kernels for KV caches "
              f"{', '.join(active.kv_cache_dtypes)}, block sizes {', '.join(map(str, active.block_sizes))}; "
              f"{'launches with and without PDL' if active.pdl else 'plain launches only'})")
    for op in registry.operators():
        impls = registry.implementations(op)
        if impls:
            described = "; ".join(f"{i.name} [{', '.join(i.devices)}: {dtype_names(i.dtypes)}]" for i in impls)
            print(f"{op:18s} {described}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    import torch

    from ninefold.cli._common import device_error
    from ninefold.ops.tune import tune

    problem = device_error(args.device)
    if problem is not None:
        print(f"ninefold ops tune: error: {problem}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        shapes = args.shapes or ("smollm2" if torch.device(device).type == "cpu" else "llama-8b")
        entries = tune(args.ops, shapes, device, [getattr(torch, d) for d in args.dtype], path=args.out)
    except ValueError as error:
        print(f"ninefold ops tune: error: {error}", file=sys.stderr)
        return 2
    for e in entries:
        times = ", ".join(f"{k} {v:.1f}" for k, v in sorted(e["times_us"].items(), key=lambda kv: kv[1]))
        print(f"{e['op']:18s} {e['dtype']:9s} {e['case']:34s} -> {e['impl']:7s} ({times} us)")
    from ninefold.ops import tuning

    print(f"stored {len(entries)} choices in {args.out or tuning.cache_file()}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from ninefold.ops import build

    try:
        report = build.build(args.manifest, args.out, target=args.target)
    except ValueError as error:
        print(f"ninefold ops build: error: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0
