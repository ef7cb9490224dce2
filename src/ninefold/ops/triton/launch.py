"""Direct launches of compiled Triton kernels, for calls whose host time matters.

``kernel[grid](...)`` binds and specialises every argument, builds a cache key string and launch
metadata on each call: tens of microseconds of Python on a GPU host, which is the whole cost of a
small memory-bound call. ``Launcher`` compiles through that path once per specialisation, keeps
the compiled kernel, and later calls its launcher directly (the same ``CompiledKernel.run`` call
``JITFunction.run`` makes in Triton 3.6 and 3.9). The specialisation key is computed here with the
rules Triton specialises on (tensor dtype and 16-byte alignment; integers equal to 1, divisible by
16, and their width; constexpr values), a superset of Triton's own key, so a cached kernel is never
reused for arguments Triton would compile differently.

Disabled under ``TRITON_INTERPRET=1``, when launch hooks are installed (profilers), and with
``NINEFOLD_TRITON_FAST_LAUNCH=0``; then every call goes through ``kernel[grid](...)``.

With a trimmed build active (``NINEFOLD_OPS_BUILD``), a specialisation seen for the first time is
looked up among the build's prebuilt binaries (``ninefold.ops.triton.prebuilt``) before anything is
compiled; kernels launched without a ``Launcher`` go through :func:`call` for the same lookup.
``recording()`` collects the launches instead of running them (how a build learns what to compile;
``recording(pdl=True)`` as the decode kernels launch on a GPU with programmatic dependent launch).
"""

from __future__ import annotations

import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
AVAILABLE = not INTERPRETED and os.environ.get("NINEFOLD_TRITON_FAST_LAUNCH", "1") != "0"
# Read at every call, so benchmarks can compare both paths in one process.
ENABLED = AVAILABLE
_I32 = 1 << 31


def _int_class(v: int) -> int:
    if -_I32 <= v < _I32:
        return 0 if v == 1 else (1 if v % 16 == 0 else 2)
    return 3 if v % 16 == 0 else 4


def _tensor_class(t: torch.Tensor) -> tuple:
    return t.dtype, t.data_ptr() % 16 == 0


def _other_class(a):
    if isinstance(a, torch.Tensor):
        return _tensor_class(a)
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        return _int_class(a)
    return type(a)


_CLASS = {torch.Tensor: _tensor_class, torch.nn.Parameter: _tensor_class, int: _int_class,
          float: lambda a: float, bool: lambda a: ("bool", a), type(None): lambda a: None}


def _hooks_installed() -> bool:
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover  (older Triton)
        return True
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _raw_stream(device_index: int):
    return torch.cuda.current_stream(device_index).cuda_stream


try:
    from torch._C import _cuda_getCurrentRawStream as _raw_stream  # noqa: F811  (what Triton itself uses)
except ImportError:  # CPU-only torch builds
    pass


def pick(override: dict, table: dict, key, n: int, defaults: dict, default_fn) -> dict:
    """A launch configuration: ``override`` when set (benchmarks), else the measured bucket of
    ``table[key]`` (``[(max_rows or None, config), ...]`` in increasing order) for ``n`` rows,
    else ``default_fn(key)`` (memoised in ``defaults``)."""
    if override:
        return override
    buckets = table.get(key)
    if buckets:
        for limit, cfg in buckets:
            if limit is None or n <= limit:
                return cfg
    found = defaults.get(key)
    if found is None:
        found = defaults[key] = default_fn(key)
    return found


def table_configs(table: dict, key, default: dict) -> list[dict]:
    """Every distinct configuration ``table[key]`` can pick (``[default]`` without an entry)."""
    found = [cfg for _, cfg in table.get(key, ())] or [default]
    return [dict(t) for t in dict.fromkeys(tuple(sorted(c.items())) for c in found)]


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last dimension]`` (itself when already 2-D: saves a reshape per call)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def empty(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor shaped like ``x`` (``empty_like`` costs half of ``torch.empty(shape, ...)``)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_UNSET = object()
_library = _UNSET
_direct: dict = {}
_launchers: list = []
_recorded: list | None = None
_recorded_pdl = False


def library():
    """The prebuilt binaries of the active trimmed build (``None``: no build, or nothing prebuilt)."""
    global _library
    if _library is _UNSET:
        from ninefold.ops import build
        from ninefold.ops.triton import prebuilt

        active = build.active()
        _library = None
        if active is not None and not INTERPRETED:
            found = prebuilt.Library(active.path, active.target, active.uncovered, active.pdl)
            _library = found if len(found) else None
    return _library


def pdl_allowed(device: torch.device) -> bool:
    """Whether kernels on ``device`` may launch with programmatic dependent launch (their own switches aside): while
    a build is recorded, as the recording says (its ``meta`` tensors stand for the target GPU); elsewhere on a CUDA
    device where Triton and the GPU support it (``gemv_pdl.pdl_available``), and, while a trimmed build with Triton
    binaries is active, where that build recorded the PDL launches too (``Library.pdl``: builds made before it did
    hold plain launches only). Read at every call, so at CUDA-graph capture."""
    if _recorded is not None:
        return _recorded_pdl
    if device.type != "cuda":
        return False
    lib = library()
    if lib is not None and not lib.pdl:
        return False
    from ninefold.ops.triton import gemv_pdl

    return gemv_pdl.pdl_available(device)


def reset() -> None:
    """Forget loaded binaries and cached specialisations (the active build changed)."""
    global _library
    _library = _UNSET
    _direct.clear()
    for launcher in _launchers:
        launcher.compiled.clear()
        launcher.uncovered.clear()


def recording_pdl() -> bool:
    """Whether a build is being recorded with the launches that use PDL on its target GPU (``recording(pdl=True)``)."""
    return _recorded is not None and _recorded_pdl


class recording:
    """``with recording() as calls:`` launches append ``(kernel, values, num_warps, num_stages)`` to
    ``calls`` (``values``: every parameter in order) instead of running; with ``recording(pdl=True)`` the
    kernels that launch with PDL on a GPU supporting it do so (:func:`pdl_allowed`)."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def __enter__(self) -> list:
        global _recorded, _recorded_pdl
        _recorded, _recorded_pdl = [], self.pdl
        return _recorded

    def __exit__(self, *exc) -> None:
        global _recorded, _recorded_pdl
        _recorded, _recorded_pdl = None, False


def _from_build(lib, kernel, values, num_warps: int, num_stages: int, device_index: int, pdl: bool = False):
    """The build's binary for this call, loaded to launch with PDL or without (``None``: the JIT compiles it)."""
    from ninefold.ops.triton import prebuilt

    lib.check_device(torch.cuda.get_device_capability(device_index))
    binary = lib.select(kernel, values, num_warps, num_stages)
    return None if binary is None else prebuilt.Kernel(binary, device_index, pdl)


def _bind(kernel, args: tuple, constexprs: dict) -> tuple:
    names = kernel.arg_names
    values = list(args)
    for param in kernel.params[len(args):]:
        if param.name in constexprs:
            values.append(constexprs[param.name])
        elif getattr(param, "has_default", False):
            values.append(param.default)
        else:
            raise TypeError(f"{kernel.fn.__name__}: missing argument {param.name} (parameters: {', '.join(names)})")
    return tuple(values)


def call(kernel, grid, *args, num_warps: int = 4, num_stages: int = 2, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=.., num_stages=..)``, served by the active trimmed
    build's binary when it holds one for this call."""
    if _recorded is not None:
        _recorded.append((kernel, _bind(kernel, args, constexprs), num_warps, num_stages))
        return
    lib = None if callable(grid) else library()
    if lib is None:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    values = _bind(kernel, args, constexprs)
    device_index = next(v.get_device() for v in values if isinstance(v, torch.Tensor))
    key = (kernel, device_index, *Launcher.key(values, (), num_warps, num_stages))
    compiled = _direct.get(key, _UNSET)
    if compiled is _UNSET:
        compiled = _direct[key] = _from_build(lib, kernel, values, num_warps, num_stages, device_index)
    if compiled is None:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, _raw_stream(device_index),
                 None, None, None, None, None, *values)


class Launcher:
    """Launch ``kernel`` (a ``triton.jit`` function whose constexpr parameters come last).

    ``launcher(grid, args, consts, num_warps=.., num_stages=.., device_index=..)``: ``args`` holds
    the run-time parameters in order, ``consts`` the constexpr values in order.
    """

    def __init__(self, kernel, constexprs: tuple[str, ...]):
        names = list(kernel.arg_names)
        if tuple(names[len(names) - len(constexprs):]) != tuple(constexprs):
            raise ValueError(f"Launcher: the constexprs of {kernel.fn.__name__} must be its last parameters "
                             f"{tuple(constexprs)}, got parameters {tuple(names)}")
        self.kernel = kernel
        self.compiled: dict = {}
        self.uncovered: set = set()  # specialisations the active build holds no binary for
        self.usable = True  # False once hooks or an unexpected compiled-kernel type were seen
        _launchers.append(self)

    @staticmethod
    def key(args, consts: tuple, num_warps: int, num_stages: int) -> tuple:
        """Everything Triton specialises a compiled kernel on, for these arguments."""
        classes = [(_CLASS.get(type(a)) or _other_class)(a) for a in args]
        return num_warps, num_stages, consts, *classes

    def __call__(self, grid, args, consts, *, num_warps: int = 4, num_stages: int = 2, device_index: int = 0,
                 launch_pdl: bool = False):
        """``launch_pdl``: compile and launch with programmatic dependent launch (Triton's option; the
        compiled kernel remembers it, so direct launches keep it)."""
        if _recorded is not None:
            _recorded.append((self.kernel, (*args, *consts), num_warps, num_stages))
            return
        lib = library()
        extra = {"launch_pdl": True} if launch_pdl else {}
        if not ((ENABLED or lib is not None) and self.usable):
            self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, **extra)
            return
        key = (device_index, *self.key(args, consts, num_warps, num_stages))  # loaded modules are per device
        if launch_pdl:
            key = ("pdl", *key)
            if lib is not None and not lib.pdl:  # (pdl_allowed() keeps the library's own launches plain there)
                if key not in self.uncovered:
                    lib.uncovered_call(self.kernel, "launched with PDL (pdl=True), and the build holds plain "
                                                    "launches only")
                    self.uncovered.add(key)
                lib = None
        compiled = self.compiled.get(key)
        if compiled is None and lib is not None and key not in self.uncovered:
            compiled = _from_build(lib, self.kernel, (*args, *consts), num_warps, num_stages, device_index, launch_pdl)
            if compiled is not None:
                self.compiled[key] = compiled
            else:
                self.uncovered.add(key)  # the JIT serves it from now on
        if compiled is None:
            if not ENABLED:
                self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, **extra)
                return
            compiled = self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, **extra)
            if hasattr(compiled, "result"):  # Triton 3.6 may hand back a future under async compilation
                compiled = compiled.result()
            if _hooks_installed() or not hasattr(compiled, "run"):
                self.usable = False
            else:
                self.compiled[key] = compiled
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, _raw_stream(device_index), compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *consts)
