"""Dispatch: from a validated call to the implementation that runs it.

Each public operator computes a *key* from its arguments, ``(device, dtype, bucket, *features)``:
the device and primary dtype, the shape bucket used by tuning, and whatever else an
implementation's ``supports`` looks at. The first call with a key resolves it:

1. keep the implementations that run on the device, take the dtype and say yes to ``supports``;
2. choose by the user's pin (``NINEFOLD_OPS=rms_norm=dsl,linear=vendor`` or
   ``with ops.use(rms_norm="dsl"):``), else the tuned choice for (operator, device model, dtype,
   bucket), else the highest default priority.

Validation and choice are cached per argument *signature* (shapes, dtypes, devices, layouts
and scalar values), so the warm path computes the signature and does one dict lookup. What a signature
does not hold, the values inside tensors (lengths, offsets, positions, sampling parameters), an operator
checks with its ``values`` function on every call, on CPUs only (on GPUs reading them would synchronise).

A pinned implementation that cannot run the inputs (another device's, one that registers only where CUDA
is, one whose ``supports`` says no) falls back to the unpinned choice with a warning, once per reason; a pin
naming no implementation of the operator is an error.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
import weakref

import torch

from ninefold.ops import registry, tuning
from ninefold.ops.registry import Impl
from ninefold.ops.spec import OpError, UnsupportedError, dtype_name, dtype_names
from ninefold.runtime import Device

_OPERATORS: dict[str, Operator] = {}
_pin_stack: list[dict[str, str]] = []
_env_pins: dict[str, str] | None = None


_Tensor = torch.Tensor
_VALUE_TYPES = frozenset((bool, int, float, complex, str, bytes, torch.dtype, torch.device))
MAX_SIGNATURES = 4096


def signature(args: tuple) -> tuple:
    """What the key function's checks and the choice depend on: each tensor's shape, dtype, device and
    layout, and each other argument's type and value. Equal signatures pass those checks alike and choose
    alike (the values inside the tensors are an operator's ``values`` check, made on every call)."""
    sig = []
    for a in args:
        if isinstance(a, _Tensor):
            sig.append((a.shape, a.dtype, a.device, a.is_contiguous() or a.stride()))
        elif a is None or type(a) in _VALUE_TYPES:
            sig.append((type(a), a))
        else:  # an object (a quantized weight): by identity, without keeping it alive in the cache
            try:
                sig.append((type(a), weakref.ref(a)))
            except TypeError:  # no weak references (tuples, lists): by value, hashable or not
                sig.append((type(a), a))
    return tuple(sig)


class Operator:
    """A public operator: calls are validated and routed.

    ``keyfn(*args)`` checks what the argument signature holds (shapes, dtypes, devices, layouts, scalars)
    and returns the dispatch key; it runs and the choice is made once per signature. ``values(*args)``,
    where given, checks the contents of the tensors (on CPUs) and runs on every call, after ``keyfn`` has
    accepted the signature.
    """

    __slots__ = ("name", "public", "keyfn", "values", "cache")

    def __init__(self, name: str, public, keyfn, values=None):
        self.name = name
        self.public = public
        self.keyfn = keyfn
        self.values = values
        self.cache: dict = {}
        _OPERATORS[name] = self

    def call(self, *args):
        """Validate ``args`` (the signature once, the values every call) and run the implementation chosen."""
        sig = signature(args)
        try:
            fn = self.cache.get(sig)
        except TypeError:  # an unhashable argument (a list of generators): validate every call
            sig, fn = None, None
        if fn is None:
            fn = resolve(self.name, self.validate(*args), args).fn
            if sig is not None:
                if len(self.cache) >= MAX_SIGNATURES:
                    self.cache.clear()
                self.cache[sig] = fn
        elif self.values is not None:
            self.values(*args)
        return fn(*args)

    def validate(self, *args) -> tuple:
        """Every check of a call (signature and values); returns its dispatch key."""
        key = self.keyfn(*args)
        if self.values is not None:
            self.values(*args)
        return key

    def bind(self, *args, **kwargs) -> tuple:
        """Normalise a public call to the positional argument tuple the implementations take."""
        bound = inspect.signature(self.public).bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())


def operator(name: str) -> Operator:
    """The operator called ``name`` (``ValueError`` listing the known ones otherwise)."""
    try:
        return _OPERATORS[name]
    except KeyError:
        raise OpError(f"unknown operator {name!r}; known: {', '.join(sorted(_OPERATORS))}") from None


def operators() -> list[str]:
    """Names of every public operator."""
    return sorted(_OPERATORS)


_warned: set = set()  # tuning-table problems warned about (once per process)
_warned_pins: set = set()  # pin fallbacks warned about, until the pins or the implementations change


def clear_caches() -> None:
    """Forget every cached choice (after pins, tables, builds or the registry change)."""
    for op in _OPERATORS.values():
        op.cache.clear()


def _pins_or_registry_changed() -> None:
    clear_caches()
    _warned_pins.clear()  # under new pins or implementations, each fallback warns once again


registry.on_change(_pins_or_registry_changed)


@functools.cache
def device_model(device: torch.device) -> str:
    """The model name of a device, the unit tuning results are stored under.

    Devices the runtime cannot open (``meta`` while tracing, say) go by their type.
    """
    try:
        return Device(device).name
    except ValueError:
        return device.type


def parse_pins(text: str, source: str = "NINEFOLD_OPS") -> dict[str, str]:
    """Parse ``"rms_norm=dsl,linear=vendor"`` into ``{"rms_norm": "dsl", "linear": "vendor"}``.

    Whitespace around names and empty entries are ignored; an operator pinned twice to different
    implementations is refused (which one was meant cannot be told).
    """
    pins = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, sep, impl = item.partition("=")
        op, impl = op.strip(), impl.strip()
        if not sep or not op or not impl or "=" in impl:
            raise OpError(f"{source}: expected entries like 'rms_norm=dsl', got {item!r}")
        if pins.get(op, impl) != impl:
            raise OpError(f"{source}: {op} is pinned twice, to {pins[op]!r} and to {impl!r}; keep one")
        pins[op] = impl
    return pins


def _check_pins(pins: dict[str, str], source: str) -> None:
    for op, impl in pins.items():
        operator(op)
        if not isinstance(impl, str):
            raise TypeError(f"{source}: the pin of {op} must be an implementation name (str), got {impl!r}")
        names = sorted({i.name for i in registry.all_implementations(op)})
        if impl not in names and impl not in registry.cuda_only(op):
            elsewhere = [name for name in registry.cuda_only(op) if name not in names]
            more = f"; where CUDA is, also: {', '.join(elsewhere)}" if elsewhere else ""
            raise OpError(f"{source}: {op} has no implementation {impl!r}; it has: {', '.join(names)}{more}")


def _pins() -> dict[str, str]:
    global _env_pins
    if _env_pins is None:
        parsed = parse_pins(os.environ.get("NINEFOLD_OPS", ""))
        _check_pins(parsed, "NINEFOLD_OPS")
        _env_pins = parsed
    pins = dict(_env_pins)
    for layer in _pin_stack:
        pins.update(layer)
    return pins


def reload_environment() -> None:
    """Re-read ``NINEFOLD_OPS`` (it is otherwise read once, on the first dispatch)."""
    global _env_pins
    _env_pins = None
    _pins_or_registry_changed()


@contextlib.contextmanager
def use(**pins: str):
    """Pin implementations inside a ``with`` block: ``with ops.use(rms_norm="dsl"): ...``.

    Pins apply process-wide (not per thread) while the block runs; blocks nest.
    """
    _check_pins(pins, "ops.use")
    layer = dict(pins)
    _pin_stack.append(layer)
    _pins_or_registry_changed()
    try:
        yield
    finally:
        for i in range(len(_pin_stack) - 1, -1, -1):  # by identity: equal layers may nest
            if _pin_stack[i] is layer:
                del _pin_stack[i]
                break
        _pins_or_registry_changed()


def resolve(op: str, key: tuple, args: tuple) -> Impl:
    """Choose the implementation of ``op`` for a call with ``key`` and ``args`` (see module doc)."""
    device, dtype = key[0], key[1]
    candidates = supporting(op, device, dtype, args)
    pinned = _pins().get(op)
    if pinned is None:
        return _unpinned(op, key, candidates)
    for impl in candidates:
        if impl.name == pinned:
            return impl
    chosen = _unpinned(op, key, candidates)
    message = (f"{op}: pinned implementation {pinned!r} cannot run these inputs "
               f"({_pin_reason(op, pinned, device, dtype, args)}); using {chosen.name!r} instead")
    if message not in _warned_pins:
        _warned_pins.add(message)
        warnings.warn(message, stacklevel=4)
    return chosen


def _unpinned(op: str, key: tuple, candidates: list[Impl]) -> Impl:
    """The tuned choice for ``key`` among ``candidates``, else the first in default order."""
    device, dtype = key[0], key[1]
    tuned = tuning.lookup(op, device_model(device), dtype, key[2])
    if tuned is not None:
        for impl in candidates:
            if impl.name == tuned:
                return impl
        known = {i.name for i in registry.all_implementations(op)}
        if tuned not in known and (op, tuned, "unknown") not in _warned:  # a typo or a stale table, not a trim
            _warned.add((op, tuned, "unknown"))
            warnings.warn(f"{op}: the tuning table chooses {tuned!r}, which is not an implementation of {op} "
                          f"(known: {', '.join(sorted(known))}); using {candidates[0].name!r}", stacklevel=5)
    return candidates[0]


def _pin_reason(op: str, name: str, device: torch.device, dtype: torch.dtype, args: tuple) -> str:
    """Why the pinned implementation ``name`` cannot run this call (for the fallback warning)."""
    impl = next((i for i in registry.implementations(op) if i.name == name), None)
    if impl is None:  # trimmed out of the build, or one of registry.cuda_only(op) that did not register here
        registered = any(i.name == name for i in registry.all_implementations(op))
        return f"not available in this process{_build_note(op)}" if registered else _cuda_only_reason()
    if device.type not in impl.devices:
        return f"it runs on {', '.join(impl.devices)}, not {device.type}"
    if dtype not in impl.dtypes:
        return f"it takes {dtype_names(impl.dtypes)}{_build_note(op)}, not {dtype_name(dtype)}"
    return impl.reason(args) or "its supports() said no"


def _cuda_only_reason() -> str:
    if not torch.cuda.is_available():
        return "it runs only on cuda, and this process has no CUDA device"
    return "it runs only on cuda and did not register in this process (Triton could not be imported)"


def supporting(op: str, device: torch.device, dtype: torch.dtype, args: tuple) -> list[Impl]:
    """Implementations able to run ``args``, in default order; ``UnsupportedError`` when none is."""
    impls = registry.implementations(op)
    if not impls and registry.all_implementations(op):
        from ninefold.ops import build

        active = build.active()
        entry = active.ops.get(op)
        if entry is not None:  # kept, but none of its kept implementations exists in this process
            registered = sorted({i.name for i in registry.all_implementations(op)})
            raise UnsupportedError(f"{op}: the trimmed build at {active.path} (NINEFOLD_OPS_BUILD) keeps its "
                                   f"implementations {', '.join(entry['impls'])} for {', '.join(entry['dtypes'])}, "
                                   f"and none of them is available in this process (available: "
                                   f"{', '.join(registered)}; Triton kernels register only where CUDA is)")
        kept = ", ".join(o for o in registry.operators() if registry.implementations(o))
        raise UnsupportedError(f"{op}: not part of the trimmed build at {active.path} "
                               f"(NINEFOLD_OPS_BUILD); it holds: {kept or 'nothing'}")
    on_device = [i for i in impls if device.type in i.devices]
    if not on_device:
        raise UnsupportedError(f"{op}: no implementation runs on {device.type}"
                               f"{_build_note(op)}; available on: "
                               f"{', '.join(sorted({d for i in impls for d in i.devices})) or 'nothing'}")
    with_dtype = [i for i in on_device if dtype in i.dtypes]
    if not with_dtype:
        supported = dtype_names(d for i in on_device for d in i.dtypes)
        raise UnsupportedError(f"{op}: {dtype_name(dtype)} is not supported on {device.type}{_build_note(op)}; "
                               f"supported: {supported}")
    ok, reasons = [], []
    for impl in with_dtype:
        reason = impl.reason(args)
        if reason is None:
            ok.append(impl)
        else:
            reasons.append(f"{impl.name}: {reason}")
    if not ok:
        raise UnsupportedError(f"{op}: no implementation supports these inputs on {device.type} "
                               f"({'; '.join(reasons)})")
    return sorted(ok, key=lambda i: -i.rank(device.type))


def _build_note(op: str) -> str:
    from ninefold.ops import build

    active = build.active()
    return "" if active is None else f" in the trimmed build at {active.path}"


def choose(op: str, *args, **kwargs) -> str:
    """The name of the implementation dispatch would run for ``ops.<op>(*args, **kwargs)``."""
    operator_ = operator(op)
    bound = operator_.bind(*args, **kwargs)
    return resolve(op, operator_.validate(*bound), bound).name


def implementation(op: str, *args, **kwargs):
    """The function dispatch would run for ``ops.<op>(*args, **kwargs)``, to call directly.

    It takes the public function's arguments positionally (in its order, defaults included) and
    skips validation and dispatch: for hot loops whose later calls keep the example's shapes,
    dtypes, devices and layouts (re-fetch it when those change, or when pins/tables change).
    """
    operator_ = operator(op)
    bound = operator_.bind(*args, **kwargs)
    return resolve(op, operator_.validate(*bound), bound).fn


def candidates(op: str, *args, **kwargs) -> list[Impl]:
    """Every implementation able to run ``ops.<op>(*args, **kwargs)``, in default order."""
    operator_ = operator(op)
    bound = operator_.bind(*args, **kwargs)
    key = operator_.validate(*bound)
    return supporting(op, key[0], key[1], bound)


def run(op: str, impl: str, *args, **kwargs):
    """Call implementation ``impl`` of ``op`` directly (validated, no dispatch)."""
    operator_ = operator(op)
    bound = operator_.bind(*args, **kwargs)
    key = operator_.validate(*bound)
    for candidate in supporting(op, key[0], key[1], bound):
        if candidate.name == impl:
            return candidate.fn(*bound)
    names = [i.name for i in registry.implementations(op)]
    raise UnsupportedError(f"{op}: implementation {impl!r} cannot run these inputs (implementations: {names})")
