"""Benchmark results as JSON files under ``$OUT`` (or a directory given instead)."""

import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any


def write_json(name: str, results: Any, out: str | os.PathLike | None = None, *, indent: int = 1,
               default: Callable[[Any], Any] | None = None, announce: bool = False) -> pathlib.Path | None:
    """Write ``results`` as indented JSON to ``out/name``; ``out`` defaults to ``$OUT``, and nothing is
    written when neither is set. Creates the directory; ``default`` serializes what JSON cannot (as
    ``json.dumps``'s); ``announce`` prints ``wrote PATH``. Returns the path written, or None."""
    out = out or os.environ.get("OUT")
    if not out:
        return None
    path = pathlib.Path(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent, default=default))
    if announce:
        print(f"wrote {path}")
    return path


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (said on stderr) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt
