"""``ninefold bench ...``: benchmarks run from the command line (``bench serve`` so far)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the top-level parser."""
    parser = subparsers.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    benches = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    serve = benches.add_parser(
        "serve",
        help="latency, throughput and goodput of an OpenAI-compatible server",
        description="Benchmark an OpenAI-compatible server (ninefold or any other): TTFT, ITL, TPOT, "
        "end-to-end latency, throughput, and goodput under SLOs.",
    )
    from ninefold.bench.serve_options import add_arguments

    add_arguments(serve)
    serve.set_defaults(func=_run_serve_bench)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _run_serve_bench(args: argparse.Namespace) -> int:
    from ninefold.bench.serve import run_from_args

    return run_from_args(args)
