"""On-disk caches of ninefold.dsl: generated modules and tuning results under ``NINEFOLD_CACHE_DIR``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

_MODULES: dict = {}


def cache_dir(*parts: str) -> Path:
    """``$NINEFOLD_CACHE_DIR/dsl/<parts>`` (default ``~/.cache/ninefold``), created."""
    root = Path(os.environ.get("NINEFOLD_CACHE_DIR") or Path.home() / ".cache" / "ninefold")
    path = root.joinpath("dsl", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_module(source: str, key: str):
    """Import generated source (written once to ``generated/<key>.py``; Triton needs a real file)."""
    path = cache_dir("generated") / f"{key}.py"
    if key in _MODULES and _MODULES[key][0] == str(path):
        return _MODULES[key][1]
    if not path.exists() or path.read_text() != source:
        write_atomic(path, source)
    name = f"ninefold_dsl_generated_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = (str(path), module)
    return module


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
