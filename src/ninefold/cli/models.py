"""``ninefold models``: list known and cached models; ``--fetch NAME`` downloads one into the cache."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    """Add the ``models`` subcommand."""
    p = subparsers.add_parser("models", help="list known and cached models, or fetch one",
                              description="List the models ninefold knows by name and the .gguf files in its "
                                          "cache (NINEFOLD_CACHE_DIR/models); --fetch downloads a known model.")
    p.add_argument("--fetch", metavar="NAME", default=None, help="download this known model into the cache")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the model list (or fetch one model first)."""
    from ninefold.llm import hub

    if args.fetch is not None:
        known = hub.find_known(args.fetch)
        if known is None:
            names = ", ".join(m.name for m in hub.KNOWN_MODELS)
            print(f"ninefold models: error: --fetch: {args.fetch!r} is not a known model; known: {names}", file=sys.stderr)
            return 2
        try:
            path = hub.resolve_model(known.name)
        except ValueError as error:
            print(f"ninefold models: error: {error}", file=sys.stderr)
            return 1
        print(f"{known.name}: {path}")
        return 0
    rows = hub.list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("NAME", "CACHED", "SIZE", "SOURCE", "PATH")]
    for row in rows:
        name = row["name"] + (" (default)" if row["default"] else "")
        size = f"{row['bytes'] / 1e6:.0f} MB" if row["bytes"] else "-"
        table.append((name, "yes" if row["cached"] else "no", size, row["source"], row["path"]))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    print(f"\ncache: {hub.cache_dir()}  (set NINEFOLD_CACHE_DIR to move it)")
    return 0
