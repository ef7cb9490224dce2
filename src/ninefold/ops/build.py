"""Trimmed builds: a deployable subset of the operator library (see ``ninefold ops build``).

A build directory holds ``manifest.json`` (the operators, dtypes and implementations it
keeps, and what a call outside them does) plus ahead-of-time compiled kernels. With
``NINEFOLD_OPS_BUILD=DIR`` only that subset is registered.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ninefold.ops.registry import Impl

_UNSET = object()
_active = _UNSET


@dataclass(frozen=True)
class Build:
    """A loaded build manifest: ``ops`` maps operator -> {"dtypes": [...], "impls": [...]}."""

    path: Path
    ops: dict
    fallback: str = "error"

    def restrict(self, impl: Impl) -> Impl | None:
        """``impl`` limited to the build's dtypes, or ``None`` when the build leaves it out."""
        entry = self.ops.get(impl.op)
        if entry is None:
            return impl if self.fallback == "vendor" and impl.name == "vendor" else None
        if impl.name not in entry["impls"]:
            return impl if self.fallback == "vendor" and impl.name == "vendor" else None
        dtypes = impl.dtypes & {getattr(torch, d) for d in entry["dtypes"]}
        return replace(impl, dtypes=frozenset(dtypes)) if dtypes else None

    @classmethod
    def load(cls, directory) -> Build:
        """Read ``DIR/manifest.json``."""
        path = Path(directory)
        manifest = path / "manifest.json"
        if not manifest.exists():
            raise ValueError(f"NINEFOLD_OPS_BUILD: {path} holds no manifest.json (build it with `ninefold ops build`)")
        data = json.loads(manifest.read_text())
        return cls(path, data["ops"], data.get("fallback", "error"))


def active() -> Build | None:
    """The build named by ``NINEFOLD_OPS_BUILD`` (``None``: the full library)."""
    global _active
    if _active is _UNSET:
        directory = os.environ.get("NINEFOLD_OPS_BUILD")
        _active = Build.load(directory) if directory else None
    return _active


def activate(directory) -> None:
    """Switch this process to the build at ``directory`` (``None``: the full library)."""
    global _active
    _active = Build.load(directory) if directory is not None else None
    from ninefold.ops import registry

    registry.changed()
