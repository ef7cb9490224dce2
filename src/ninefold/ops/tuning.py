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

import contextlib
import hashlib
import importlib.metadata
import json
import os
import tempfile
import warnings
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
    """Entries of one tuning file as ``{(op, device, dtype, bucket): entry}``.

    ``ValueError`` naming the file and what is wrong when it is not a tuning table of this format.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read the tuning table ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a tuning table (a JSON {type(data).__name__}, expected an object)")
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: tuning table format {data.get('format')!r}, expected {FORMAT}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'entries' must be a list, got {type(entries).__name__}")
    table = {}
    for i, e in enumerate(entries):
        problem = _entry_problem(e)
        if problem:
            raise ValueError(f"{path}: entry {i} {problem}")
        table[_entry_key(e["op"], e["device"], e["dtype"], e["bucket"])] = e
    return table


def _entry_problem(e) -> str | None:
    """What is wrong with one entry of a tuning file (``None``: nothing)."""
    if not isinstance(e, dict):
        return f"must be an object, got {type(e).__name__}"
    for name in ("op", "device", "dtype", "impl"):
        if not isinstance(e.get(name), str) or not e[name]:
            return f"needs a string {name!r}, got {e.get(name)!r}"
    bucket = e.get("bucket")
    if not isinstance(bucket, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bucket):
        return f"needs 'bucket' as a list of integers, got {bucket!r}"
    return None


def write_table(path: Path, entries: dict) -> None:
    """Write ``{(op, device, dtype, bucket): entry}`` as a tuning file (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "versions": versions(), "entries": sorted(
        entries.values(), key=lambda e: (e["op"], e["device"], e["dtype"], e["bucket"]))}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(body, indent=1))
    os.replace(tmp, path)


def table() -> dict:
    """Every known tuned entry: shipped tables, then the user's cache on top.

    A file that cannot be read is skipped with a warning naming it and what is wrong (the
    default order runs instead); it never breaks an operator call.
    """
    global _table
    if _table is None:
        merged = {}
        user = cache_file()
        for path in [*sorted(TABLES_DIR.glob("*.json")), *([user] if user.exists() else [])]:
            try:
                merged.update(read_table(path))
            except ValueError as error:
                warnings.warn(f"ignoring a tuning table: {error}", stacklevel=2)
        _table = merged
    return _table


def lookup(op: str, device: str, dtype: torch.dtype, bucket) -> str | None:
    """The tuned implementation name for this call class, or ``None``."""
    entry = table().get(_entry_key(op, device, dtype_name(dtype), bucket))
    return None if entry is None else entry["impl"]


def record(results: list[dict], path: Path | None = None) -> Path:
    """Merge new entries (dicts shaped like the file's) into the user's cache and reload.

    Writers are serialised by a lock file beside ``path`` and the file is re-read under the lock,
    so processes recording at once keep each other's entries. An existing file that is not a
    readable tuning table is moved aside to ``<name>.bad`` (with a warning), not merged.
    """
    path = Path(path) if path else cache_file()
    results = list(results)
    for i, e in enumerate(results):
        problem = _entry_problem(e)
        if problem:
            raise ValueError(f"tuning.record: entry {i} {problem}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        entries = {}
        if path.exists():
            try:
                entries = read_table(path)
            except ValueError as error:
                bad = path.with_name(path.name + ".bad")
                warnings.warn(f"replacing an unreadable tuning table (kept as {bad}): {error}", stacklevel=2)
                os.replace(path, bad)
        for e in results:
            entries[_entry_key(e["op"], e["device"], e["dtype"], e["bucket"])] = e
        write_table(path, entries)
    reload()
    return path


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``<path>.lock`` (other processes recording into ``path`` wait)."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl
        except ImportError:  # no POSIX locks (Windows): the atomic replace still keeps the file whole
            fcntl = None
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def reload() -> None:
    """Forget loaded tables (and dispatch's cached choices)."""
    global _table
    _table = None
    from ninefold.ops import registry

    registry.changed()
