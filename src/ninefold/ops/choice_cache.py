"""Per-shape choices of a self-tuning implementation, persisted beside the operator tuning cache.

``ninefold.ops.triton.gemm_tuning`` and ``ninefold.ops.cublaslt.tuning`` each keep one: a JSON file
``$NINEFOLD_CACHE_DIR/ops/<name>-<fingerprint>.json`` (the fingerprint of ``ninefold.ops.tuning``,
so a new torch, Triton or ninefold starts afresh), read on first use and rewritten atomically after
every tuning run, and a switch saying whether untuned shapes may be tuned now (``with
autotune():`` or the environment variable ``env``).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings

from ninefold.dsl.cache import write_atomic
from ninefold.ops import tuning


class ChoiceCache:
    """The persisted ``{shape key: choice}`` of one implementation and its autotune switch."""

    def __init__(self, name: str, env: str):
        self.name, self.env = name, env
        self._choices: dict | None = None
        self._depth = 0

    def path(self):
        """The cache file (next to ``ninefold.ops.tuning.cache_file()``)."""
        ops_file = tuning.cache_file()
        return ops_file.with_name(ops_file.name.replace("tuning-", f"{self.name}-", 1))

    def choices(self) -> dict:
        """Every persisted choice (read from the file on first use)."""
        if self._choices is None:
            self._choices = self._read(self.path(), warn=True)
        return self._choices

    def _read(self, path, warn: bool) -> dict:
        if not path.exists():
            return {}
        try:
            choices = json.loads(path.read_text())["choices"]
            if not isinstance(choices, dict):
                raise TypeError(f"'choices' is a {type(choices).__name__}, not an object")
            return choices
        except (OSError, ValueError, KeyError, TypeError) as error:
            if warn:
                warnings.warn(f"ignoring the unreadable {self.name} tuning cache {path} ({error!r})", stacklevel=4)
            return {}

    def store(self, key: str, choice) -> None:
        """Remember ``choice`` for ``key`` and rewrite the file.

        Under a lock beside the file, what other processes stored meanwhile is read back and kept.
        """
        self.choices()[key] = choice
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with tuning._locked(path):
            merged = {**self._read(path, warn=False), **self._choices}
            self._choices.update(merged)
            write_atomic(path, json.dumps({"versions": tuning.versions(), "choices": merged}, indent=1))

    def forget(self) -> None:
        """Drop the in-memory choices (the file is re-read on the next lookup)."""
        self._choices = None

    @contextlib.contextmanager
    def autotune(self):
        """Inside this block, shapes without a persisted choice are tuned on their first call."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def autotune_on(self) -> bool:
        """Whether an untuned shape may be tuned now."""
        return self._depth > 0 or os.environ.get(self.env) == "1"
