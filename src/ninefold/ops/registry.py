"""The registry of operator implementations.

An implementation registers under an operator name and an implementation name ("vendor" for
torch and the libraries behind it, "triton" for the hand-written Triton kernels, "dsl" for
``ninefold.dsl`` kernels), with the device types and dtypes it covers, a ``supports(*args)``
check that returns ``None`` when it can run the arguments or a short reason when it cannot,
and a priority per device type (the default order when nothing is pinned or tuned).

Implementations take the operator's arguments positionally, in the public function's order,
after the public function has validated and normalised them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ninefold.ops.spec import FLOAT_DTYPES


@dataclass(frozen=True)
class Impl:
    """One implementation of one operator."""

    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...]
    dtypes: frozenset
    supports: Callable | None = None
    priority: dict = field(default_factory=dict)
    calls: tuple[str, ...] = ()  # public operators it calls through dispatch

    def rank(self, device_type: str) -> int:
        """Default-order rank on a device type (higher runs first)."""
        return self.priority.get(device_type, 0)

    def reason(self, args: tuple) -> str | None:
        """Why this implementation cannot run ``args`` (``None`` when it can)."""
        return None if self.supports is None else self.supports(*args)


_IMPLS: dict[str, list[Impl]] = {}
_listeners: list[Callable[[], None]] = []

# Implementations that register only where CUDA is (ops/__init__.py: the Triton kernels, also under
# TRITON_INTERPRET=1, cuBLASLt and CUTLASS). Elsewhere a pin naming one falls back with a warning, while a pin naming
# no implementation at all is refused. tests/ops/test_dispatch.py checks this against what registers with CUDA.
_TRITON_OPS = ("add_rms_norm", "add_rms_norm_linear", "argmax", "attention_decode", "attention_prefill",
               "gelu_and_mul", "reshape_and_cache", "rms_norm", "rope", "rope_and_cache", "rope_cache_attention_decode",
               "sample", "silu_and_mul", "silu_and_mul_linear", "softmax")
CUDA_ONLY: dict[str, tuple[str, ...]] = {op: ("triton",) for op in _TRITON_OPS}
CUDA_ONLY["linear"] = ("triton", "triton_gemm", "triton_row", "cublaslt", "cutlass")
CUDA_ONLY["linear_fp8"] = ("triton_gemv", "triton_pdl")


def register(op: str, name: str, *, devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, supports=None,
             priority: dict | None = None, calls: tuple[str, ...] = ()):
    """Decorator registering ``fn`` as implementation ``name`` of operator ``op``.

    ``devices``: torch device types it runs on; ``dtypes``: dtypes of the operator's primary
    tensor it accepts; ``supports(*args) -> str | None``: any further restriction (a reason
    string when it says no); ``priority``: ``{device_type: int}``, higher first by default;
    ``calls``: the public operators ``fn`` calls through dispatch (a trimmed build keeping it
    keeps them too).
    """

    where = f"register({op!r}, {name!r})"
    if isinstance(devices, str):
        devices = (devices,)
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    devices, dtypes = tuple(devices), frozenset(dtypes)
    for device in devices:
        if not isinstance(device, str) or not _NAME.fullmatch(device):
            raise ValueError(f"{where}: devices must be torch device types like ('cpu', 'cuda'), got {device!r}")
    if not devices:
        raise ValueError(f"{where}: devices is empty; name the device types it runs on, e.g. ('cpu', 'cuda')")
    bad = [d for d in dtypes if not isinstance(d, torch.dtype)]
    if bad or not dtypes:
        raise ValueError(f"{where}: dtypes must be torch dtypes like (torch.float16, torch.bfloat16), "
                         f"got {bad[0] if bad else 'none'}")
    if supports is not None and not callable(supports):
        raise TypeError(f"{where}: supports must be callable (args -> reason or None), got {supports!r}")
    for key, rank in (priority or {}).items():
        if not isinstance(key, str) or isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{where}: priority must map device types to ints, got {key!r}: {rank!r}")
    _check_names(op, name)
    calls = _check_calls(where, calls)

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"{where}: the implementation must be callable, got {fn!r}")
        add(Impl(op, name, fn, devices, dtypes, supports, dict(priority or {}), calls))
        return fn

    return decorate


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_names(op, name) -> None:
    """An implementation name usable in ``NINEFOLD_OPS`` and manifests, of an operator that exists."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"register({op!r}, {name!r}): the implementation name must be a Python-identifier-like "
                         f"word (letters, digits, '_'; it is written in NINEFOLD_OPS=op=name), got {name!r}")
    from ninefold.ops import dispatch

    known = dispatch.operators()
    if op not in known:
        raise ValueError(f"register({op!r}, {name!r}): unknown operator {op!r}; known: {', '.join(known)}")


def _check_calls(where: str, calls) -> tuple[str, ...]:
    """``calls`` as a tuple of known operator names."""
    from ninefold.ops import dispatch

    if isinstance(calls, str) or not all(isinstance(c, str) for c in calls):
        raise TypeError(f"{where}: calls must be a tuple of operator names, got {calls!r}")
    known = dispatch.operators()
    unknown = [c for c in calls if c not in known]
    if unknown:
        raise ValueError(f"{where}: calls names unknown operator {unknown[0]!r}; known: {', '.join(known)}")
    return tuple(calls)


def add(impl: Impl) -> None:
    """Register an ``Impl`` (replacing one of the same operator and name)."""
    _check_names(impl.op, impl.name)
    impls = _IMPLS.setdefault(impl.op, [])
    impls[:] = [i for i in impls if i.name != impl.name] + [impl]
    changed()


def unregister(op: str, name: str) -> None:
    """Remove implementation ``name`` of ``op`` (used by tests and trimmed builds)."""
    _IMPLS[op] = [i for i in _IMPLS.get(op, []) if i.name != name]
    changed()


def all_implementations(op: str) -> list[Impl]:
    """Every registered implementation of ``op``, whatever the active build holds."""
    return list(_IMPLS.get(op, []))


def implementations(op: str) -> list[Impl]:
    """The implementations of ``op`` that exist in this process (restricted by a trimmed build)."""
    from ninefold.ops import build

    impls = _IMPLS.get(op, [])
    active = build.active()
    if active is None:
        return list(impls)
    return [r for r in (active.restrict(i) for i in impls) if r is not None]


def cuda_only(op: str) -> tuple[str, ...]:
    """Names of the implementations of ``op`` that register only where CUDA is (whether or not they did here)."""
    return CUDA_ONLY.get(op, ())


def operators() -> list[str]:
    """Names of every operator with at least one registered implementation."""
    return sorted(op for op, impls in _IMPLS.items() if impls)


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever the registry changes (dispatch clears its caches)."""
    _listeners.append(listener)


def changed() -> None:
    """Tell listeners that implementations, pins, tables or builds changed."""
    for listener in _listeners:
        listener()
