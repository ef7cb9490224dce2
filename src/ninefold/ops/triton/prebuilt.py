"""Prebuilt Triton binaries of a trimmed build, launched without compiling anything.

``ninefold ops build`` compiles each kernel specialisation the launchers use at the manifest's
shapes (``ninefold.ops.triton.aot``) and writes, per binary, ``<stem>.cubin`` and ``<stem>.json``:
the kernel (module and name, and a hash of its module's source), the specialisation of every
parameter as Triton's JIT computes it (pointer dtype and 16-byte alignment; integers equal to 1,
divisible by 16, 32 or 64 bits; constexpr values), the launch options, and the PTX parameter list.

With ``NINEFOLD_OPS_BUILD=DIR`` the launchers (``ninefold.ops.triton.launch``) ask :func:`find`
for a binary whose assumptions hold for the call: the same dtypes and constexprs, and every
alignment or divisibility the binary was compiled for is true of the call's arguments (an exact
match, the JIT's own specialisation, is preferred). The binary is launched through the CUDA driver
(``ninefold.dsl.backends.cuda_driver``), so a build compiled by one Triton version runs under
another. A call no binary covers is compiled by the JIT, or refused when the manifest says
``uncovered = "error"``.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = 1
UNCOVERED = ("jit", "error")
_I32 = 1 << 31
_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
         torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.\w+\s+\.align\s+\d+)?\s+\w+_param_(\d+)")
_CTYPES = {"u64": ctypes.c_uint64, "b64": ctypes.c_uint64, "s64": ctypes.c_int64, "u32": ctypes.c_uint32,
           "b32": ctypes.c_uint32, "s32": ctypes.c_int32, "u16": ctypes.c_uint16, "b16": ctypes.c_uint16,
           "u8": ctypes.c_uint8, "b8": ctypes.c_uint8, "f32": ctypes.c_float, "f64": ctypes.c_double}
# Launches through prebuilt binaries / calls handed to the JIT while a build is active.
STATS = {"prebuilt": 0, "prebuilt_pdl": 0, "jit": 0}  # launches of prebuilt binaries (those with PDL), JIT compiles
MISSES: list[str] = []  # why each call handed to the JIT was not covered
LOADED: list[dict] = []  # every binary selected: kernel, file, exact (the call's own JIT specialisation) or not


class BuildError(RuntimeError):
    """A trimmed build cannot serve a call (wrong target, missing or corrupt binary, uncovered call)."""


# ------------------------------------------------------------------ specialisation
def _aligned(t: torch.Tensor) -> bool:
    if t.device.type == "meta":  # shapes only: a fresh allocation is aligned, a view by its offset
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def _arg_spec(param, value) -> tuple:
    """``(type, attr)`` of one argument, by the rules of Triton's JIT (3.6 and 3.9)."""
    if param.is_constexpr:
        return ("constexpr", value)
    specialise = not param.do_not_specialize
    align = not getattr(param, "do_not_specialize_on_alignment", False)
    if isinstance(value, torch.Tensor):
        kind = ("*k" if getattr(param, "is_const", False) else "*") + _TYPE[value.dtype]
        if not specialise:
            return (kind, None)
        return (kind, "D" if align and _aligned(value) else "")
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if specialise and value == 1:
            return ("constexpr", 1)
        kind = "i32" if -_I32 <= value < _I32 else "i64"
        if not specialise:
            return (kind, None)
        return (kind, "D" if align and value % 16 == 0 else "")
    if isinstance(value, float):
        return ("fp32", None)
    raise TypeError(f"prebuilt: cannot specialise argument {param.name} of type {type(value).__name__}")


def specialisation(kernel, values) -> tuple:
    """Per parameter of ``kernel`` (a ``triton.jit`` function), the ``(type, attr)`` the JIT would
    compile for ``values`` (every parameter, constexprs included, in order)."""
    if len(values) != len(kernel.params):
        raise TypeError(f"{kernel.fn.__name__} takes {len(kernel.params)} parameters, got {len(values)}")
    return tuple(_arg_spec(p, v) for p, v in zip(kernel.params, values))


def relaxed(spec: tuple, params) -> tuple:
    """``spec`` without integer specialisations (any integer value of the same width): a binary that
    serves other shapes. Pointer alignment and constexpr parameters stay."""
    out = []
    for (kind, attr), param in zip(spec, params):
        if kind == "constexpr" and not param.is_constexpr and isinstance(attr, int) and not isinstance(attr, bool):
            out.append(("i32", ""))  # an integer the JIT made a constant because it was 1
        elif kind in ("i32", "i64") and attr is not None:
            out.append((kind, ""))
        else:
            out.append((kind, attr))
    return tuple(out)


def _weaker(a: tuple, b: tuple, param) -> tuple:
    if a == b:
        return a
    ints = [x for x in (a, b) if x[0] in ("i32", "i64") or (x[0] == "constexpr" and not param.is_constexpr)]
    if len(ints) == 2:
        kind = "i64" if "i64" in (a[0], b[0]) else "i32"
        return (kind, None if None in (a[1], b[1]) and "constexpr" not in (a[0], b[0]) else "")
    if a[0] == b[0] and a[0].startswith("*"):
        return (a[0], "" if a[1] is not None else None)
    raise ValueError(f"{param.name}: {a} and {b} cannot share a binary")


def family(spec: tuple, params) -> tuple:
    """What specialisations must share to be :func:`merged`: constexpr values, pointer dtypes, scalar kinds."""
    return tuple(s if p.is_constexpr else s[0] if s[0].startswith("*") or s[0] in ("fp32", "u1") else "int"
                 for s, p in zip(spec, params))


def merged(specs, params) -> tuple:
    """The strongest specialisation every one of ``specs`` satisfies (same kernel, constexprs and
    dtypes): one binary for all of them, keeping the alignments and divisibilities they share."""
    out = list(specs[0])
    for spec in specs[1:]:
        out = [_weaker(a, b, p) for a, b, p in zip(out, spec, params)]
    return tuple(out)


def kernel_id(kernel) -> str:
    return f"{kernel.fn.__module__}:{kernel.fn.__qualname__}"


def source_hash(kernel) -> str:
    """Hash of the source file that defines ``kernel`` (a changed file makes its binaries stale)."""
    return hashlib.sha256(Path(inspect.getsourcefile(kernel.fn)).read_bytes()).hexdigest()[:16]


def _norm(value):
    return json.loads(json.dumps(value))


def _covers(built: tuple, call: tuple) -> str | None:
    """``None`` when a binary compiled for ``built`` (one parameter) runs ``call`` correctly, else why not."""
    bkind, battr = built
    ckind, cattr = call
    if bkind == "constexpr":
        if ckind != "constexpr" or _norm(cattr) != battr:
            return f"is {cattr!r}, built for {battr!r}" if ckind == "constexpr" else f"built as the constant {battr!r}"
        return None
    if bkind in ("i32", "i64"):
        if ckind == "constexpr" and isinstance(cattr, int) and not isinstance(cattr, bool):
            ckind, cattr = "i32", ""  # the JIT's constant 1: any integer parameter takes it
        if ckind not in ("i32", "i64") or (bkind == "i32" and ckind == "i64"):
            return f"is {ckind}, built for {bkind}"
        if battr == "D" and cattr != "D":
            return "is not a multiple of 16"
        return None
    if bkind != ckind:
        return f"is {ckind}, built for {bkind}"
    if battr == "D" and cattr != "D":
        return "is not 16-byte aligned"
    return None


# ------------------------------------------------------------------ binaries
@dataclass
class Binary:
    """One prebuilt binary: its metadata (the ``.json``) and where its image lives."""

    meta: dict
    path: Path
    spec: tuple = field(init=False)

    def __post_init__(self):
        self.spec = tuple((kind, attr) for kind, attr in self.meta["spec"])

    def covers(self, call: tuple, num_warps: int, num_stages: int) -> str | None:
        """``None`` when this binary runs a call of specialisation ``call``, else the first reason it does not."""
        if (self.meta["num_warps"], self.meta["num_stages"]) != (num_warps, num_stages):
            return f"num_warps/num_stages {num_warps}/{num_stages}, built for {self.meta['num_warps']}/{self.meta['num_stages']}"
        for name, built, got in zip(self.meta["params"], self.spec, call):
            why = _covers(built, got)
            if why:
                return f"{name} {why}"
        return None

    def image(self) -> bytes:
        """The binary's bytes, checked against the hash recorded at build time."""
        file = self.path.parent / self.meta["binary"]
        try:
            data = file.read_bytes()
        except OSError as error:
            raise BuildError(f"trimmed build: binary {file} of {self.meta['kernel']} is missing ({error}); "
                             f"rebuild with `ninefold ops build`") from None
        if hashlib.sha256(data).hexdigest() != self.meta["sha256"]:
            raise BuildError(f"trimmed build: binary {file} of {self.meta['kernel']} is corrupt (sha256 differs from "
                             f"the one recorded at build time); rebuild with `ninefold ops build`")
        return data


def write(out: Path, stem: str, kernel, spec: tuple, num_warps: int, num_stages: int, compiled, target: str,
          exact: bool) -> Path:
    """Write one compiled specialisation (``compiled``: Triton's compiled kernel) as ``stem.cubin`` + ``stem.json``."""
    binary = compiled.asm["cubin"]
    ptx = [kind for kind, _ in sorted(((k, int(n)) for k, n in _PTX_PARAM.findall(compiled.asm["ptx"])),
                                      key=lambda kn: kn[1])]
    runtime = sum(1 for kind, _ in spec if kind != "constexpr")
    if not 0 <= len(ptx) - runtime <= 2:
        raise BuildError(f"{kernel_id(kernel)}: the PTX takes {len(ptx)} parameters for {runtime} run-time "
                         f"arguments (expected up to two scratch pointers more)")
    md = compiled.metadata
    meta = {"format": FORMAT, "kernel": kernel_id(kernel), "source": source_hash(kernel), "function": md.name,
            "target": target, "triton_version": getattr(md, "triton_version", None), "num_warps": num_warps,
            "num_stages": num_stages, "shared": md.shared, "exact": exact,
            "global_scratch_size": getattr(md, "global_scratch_size", 0) or 0,
            "profile_scratch_size": getattr(md, "profile_scratch_size", 0) or 0,
            "params": list(kernel.arg_names), "spec": [list(s) for s in spec], "ptx_params": ptx,
            "binary": f"{stem}.cubin", "sha256": hashlib.sha256(binary).hexdigest()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.cubin").write_bytes(binary)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


class Library:
    """Every binary of a build directory, by kernel; ``find`` picks the one for a call."""

    def __init__(self, directory, target: str, uncovered: str = "jit", pdl: bool = False):
        if uncovered not in UNCOVERED:
            raise ValueError(f"uncovered must be one of {UNCOVERED}, got {uncovered!r}")
        self.directory = Path(directory)
        self.target = target
        self.uncovered = uncovered
        self.pdl = pdl  # the build recorded the launches that use PDL too (their binaries launch with it)
        self.by_kernel: dict[str, list[Binary]] = {}
        self._checked_devices: set = set()
        self._sources: dict[str, str] = {}
        for path in sorted((self.directory / "kernels" / "triton").rglob("*.json")):
            try:
                meta = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise BuildError(f"trimmed build: cannot read {path} ({error}); rebuild with `ninefold ops build`") from None
            if meta.get("format") != FORMAT:
                raise BuildError(f"trimmed build: {path} has format {meta.get('format')!r}, this ninefold reads {FORMAT}")
            found = self.by_kernel.setdefault(meta["kernel"], [])
            if not any(b.meta["spec"] == meta["spec"] and b.meta["num_warps"] == meta["num_warps"]
                       and b.meta["num_stages"] == meta["num_stages"] for b in found):
                found.append(Binary(meta, path))
        for found in self.by_kernel.values():  # the JIT's own specialisations first
            found.sort(key=lambda b: not b.meta["exact"])

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_kernel.values())

    def check_device(self, capability: tuple[int, int]) -> None:
        """``BuildError`` unless the build was compiled for a GPU of ``capability`` (major, minor)."""
        if capability in self._checked_devices:
            return
        here = f"cuda:{capability[0]}{capability[1]}"
        if self.target != here:
            raise BuildError(f"NINEFOLD_OPS_BUILD={self.directory} was built for {self.target}, this GPU is {here}; "
                             f"rebuild with `ninefold ops build --target {here}`")
        self._checked_devices.add(capability)

    def find(self, kernel, values, num_warps: int, num_stages: int) -> tuple[Binary | None, str]:
        """``(binary, "")`` for a call of ``kernel`` with ``values`` (every parameter in order), or
        ``(None, why)`` when no binary of the build covers it."""
        name = kernel_id(kernel)
        found = self.by_kernel.get(name)
        if not found:
            return None, f"the build holds no binary of {name}"
        if name not in self._sources:
            self._sources[name] = source_hash(kernel)
        if any(b.meta["source"] != self._sources[name] for b in found):
            raise BuildError(f"trimmed build {self.directory}: its binaries of {name} were compiled from another "
                             f"version of {Path(inspect.getsourcefile(kernel.fn)).name}; rebuild with `ninefold ops build`")
        call = specialisation(kernel, values)
        for binary in found:
            if binary.spec == call and (binary.meta["num_warps"], binary.meta["num_stages"]) == (num_warps, num_stages):
                return binary, ""
        reasons = []
        for binary in found:
            why = binary.covers(call, num_warps, num_stages)
            if why is None:
                return binary, ""
            reasons.append(why)
        return None, f"none of its {len(found)} binaries of {name} covers the call ({'; '.join(dict.fromkeys(reasons))})"


    def select(self, kernel, values, num_warps: int, num_stages: int) -> Binary | None:
        """The binary for this call; ``None`` when the JIT is to compile it (``uncovered = "jit"``),
        ``BuildError`` when the build refuses uncovered calls."""
        binary, why = self.find(kernel, values, num_warps, num_stages)
        if binary is not None:
            LOADED.append({"kernel": binary.meta["kernel"], "binary": binary.meta["binary"],
                           "exact": binary.spec == specialisation(kernel, values)})
            return binary
        self.uncovered_call(kernel, why)
        return None

    def uncovered_call(self, kernel, why: str) -> None:
        """A call of ``kernel`` no binary serves, for reason ``why``: ``BuildError`` when the build refuses uncovered
        calls, else counted (``STATS["jit"]``, ``MISSES``) before the JIT compiles it."""
        if self.uncovered == "error":
            raise BuildError(f"{kernel.fn.__name__}: {why}; the trimmed build at {self.directory} says "
                             f'uncovered = "error" (build for these shapes, or set uncovered = "jit")')
        STATS["jit"] += 1
        MISSES.append(f"{kernel.fn.__name__}: {why}")
        del MISSES[:-100]


# ------------------------------------------------------------------ launching
class Arguments:
    """The ``void**`` parameter array of a binary's launches: one ctypes value per PTX parameter,
    allocated once and refilled per launch (``fill``); hold ``lock`` from ``fill`` until launched."""

    def __init__(self, binary: Binary):
        ptx = binary.meta["ptx_params"]
        self.runtime = [i for i, (kind, _) in enumerate(binary.spec) if kind != "constexpr"]
        self.holders = [_CTYPES[k]() for k in ptx]
        self.scratch = [(len(self.runtime) + j, size) for j, size in
                        enumerate((binary.meta["global_scratch_size"], binary.meta["profile_scratch_size"])
                                  [:len(ptx) - len(self.runtime)]) if size]
        self.array = (ctypes.c_void_p * len(ptx))(*[ctypes.addressof(h) for h in self.holders])
        self.lock = threading.Lock()

    def fill(self, values, programs: int, device) -> list:
        """Store every run-time parameter of ``values`` (all parameters, constexprs included, in
        order); returns the scratch buffers allocated on ``device`` (keep them until launched)."""
        holders = self.holders
        for j, i in enumerate(self.runtime):
            v = values[i]
            holders[j].value = v.data_ptr() if isinstance(v, torch.Tensor) else v
        buffers = []
        for j, size in self.scratch:
            buffers.append(torch.empty(size * programs, dtype=torch.uint8, device=device))
            holders[j].value = buffers[-1].data_ptr()
        return buffers


class Kernel:
    """A loaded binary with the calling convention of Triton's ``CompiledKernel.run`` (what
    ``ninefold.ops.triton.launch.Launcher`` calls on its warm path)."""

    function = None
    packed_metadata = None

    def __init__(self, binary: Binary, device_index: int, pdl: bool = False):
        from ninefold.dsl.backends.cuda_driver import driver, pdl_config

        self.binary = binary
        self.meta = binary.meta
        self.device = torch.device("cuda", device_index)
        self.driver = driver()
        self.binary.image()  # missing or corrupt: a BuildError naming the file, before the driver sees it
        self.handle = self.driver.function(binary.path.parent / self.meta["binary"], self.meta, self.device)
        self.arguments = Arguments(binary)
        # ``pdl``: launched with programmatic dependent launch (the binary is the same; only the launch differs)
        self.pdl_config = pdl_config(32 * self.meta["num_warps"], self.meta["shared"]) if pdl else None

    def run(self, g0, g1, g2, stream, _function, _metadata, _hook, _enter, _exit, *values):
        """Launch a ``g0 x g1 x g2`` grid on ``stream`` with every parameter's value, in order."""
        with self.arguments.lock:
            buffers = self.arguments.fill(values, g0 * g1 * g2, self.device)  # noqa: F841  (alive until launched)
            if torch.cuda.current_device() != self.device.index:  # the launch needs this device's context current
                with torch.cuda.device(self.device):
                    self._launch(g0, g1, g2, stream)
            else:
                self._launch(g0, g1, g2, stream)
        STATS["prebuilt"] += 1
        if self.pdl_config is not None:
            STATS["prebuilt_pdl"] += 1

    def _launch(self, g0, g1, g2, stream) -> None:
        config = self.pdl_config
        if config is None:
            self.driver.check(self.driver.lib.cuLaunchKernel(
                self.handle, g0, g1, g2, 32 * self.meta["num_warps"], 1, 1, self.meta["shared"],
                ctypes.c_void_p(stream), self.arguments.array, None), "cuLaunchKernel")
            return
        config.grid_x, config.grid_y, config.grid_z, config.stream = g0, g1, g2, stream
        self.driver.check(self.driver.lib.cuLaunchKernelEx(ctypes.byref(config), self.handle, self.arguments.array,
                                                           None), "cuLaunchKernelEx")
