"""Tuned choices: which implementation is fastest per (operator, device model, dtype, bucket).

Two sources, later ones winning: the tables shipped in ``ninefold/ops/tables/*.json``
(pre-tuned on known cards, e.g. the H200) and the user's cache file
``$NINEFOLD_CACHE_DIR/ops/tuning-<fingerprint>.json`` written by ``ninefold ops tune``. The
fingerprint hashes what invalidates a measurement: the ninefold, torch and Triton versions and
the source of ``ninefold.ops``.

File format (JSON)::

    {"format": 1, "versions": {...}, "entries": [
        {"op": "rms_norm", "device": "NVIDIA H200", "dtype": "bfloat16", "bucket": [1024, 4096],
         "impl": "triton", "times_us": {"triton": 8.1, "vendor": 14.2}}, ...]}
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import torch

from ninefold.ops.spec import dtype_name

FORMAT = 1
TABLES_DIR = Path(__file__).with_name("tables")
_table: dict | None = None


def cache_dir() -> Path:
    """``$NINEFOLD_CACHE_DIR`` (default ``~/.cache/ninefold``)."""
    return Path(os.environ.get("NINEFOLD_CACHE_DIR") or Path.home() / ".cache" / "ninefold")


def versions() -> dict:
    """The versions a tuning measurement depends on."""
    import ninefold

    try:  # the installed version, without importing triton (slow)
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {"ninefold": ninefold.__version__, "torch": torch.__version__, "triton": triton_version,
            "ops_source": _source_hash()}


def _source_hash() -> str:
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_file() -> Path:
    """The user's tuning cache file for this installation."""
    fingerprint = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "ops" / f"tuning-{fingerprint}.json"


def _entry_key(op: str, device: str, dtype: str, bucket) -> tuple:
    return (op, device, dtype, tuple(bucket))


def read_table(path: Path) -> dict:
    """Entries of one tuning file as ``{(op, device, dtype, bucket): entry}``."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: tuning table format {data.get('format')!r}, expected {FORMAT}")
    return {_entry_key(e["op"], e["device"], e["dtype"], e["bucket"]): e for e in data["entries"]}


def write_table(path: Path, entries: dict) -> None:
    """Write ``{(op, device, dtype, bucket): entry}`` as a tuning file (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "versions": versions(), "entries": sorted(
        entries.values(), key=lambda e: (e["op"], e["device"], e["dtype"], e["bucket"]))}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)


def table() -> dict:
    """Every known tuned entry: shipped tables, then the user's cache on top."""
    global _table
    if _table is None:
        merged = {}
        for path in sorted(TABLES_DIR.glob("*.json")):
            merged.update(read_table(path))
        user = cache_file()
        if user.exists():
            merged.update(read_table(user))
        _table = merged
    return _table


def lookup(op: str, device: str, dtype: torch.dtype, bucket) -> str | None:
    """The tuned implementation name for this call class, or ``None``."""
    entry = table().get(_entry_key(op, device, dtype_name(dtype), bucket))
    return None if entry is None else entry["impl"]


def record(results: list[dict], path: Path | None = None) -> Path:
    """Merge new entries (dicts shaped like the file's) into the user's cache and reload."""
    path = Path(path) if path else cache_file()
    entries = read_table(path) if path.exists() else {}
    for e in results:
        entries[_entry_key(e["op"], e["device"], e["dtype"], e["bucket"])] = e
    write_table(path, entries)
    reload()
    return path


def reload() -> None:
    """Forget loaded tables (and dispatch's cached choices)."""
    global _table
    _table = None
    from ninefold.ops import registry

    registry.changed()
