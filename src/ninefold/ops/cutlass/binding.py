"""A ctypes binding to the CUTLASS GEMM library that ``ninefold.ops.cutlass.build`` makes.

``matmul(x, w, out, config, mode, splits)`` runs ``out = x @ w.T`` (bfloat16, row-major ``x [M, K]``,
``w [N, K]``, ``out [M, N]``) with configuration ``config`` (an index into ``build.CONFIGS``) on the
current CUDA stream; it can be captured in a CUDA graph, and with ``pdl=True`` it launches as a
programmatic dependent launch (its set-up may overlap the kernel before it; it waits for that kernel
before reading). The library is ``$NINEFOLD_CUTLASS_LIB`` (a file, or a directory holding one) or the
newest build under ``build.default_dir()`` made from these sources; a library built from other sources
is refused, so the configuration table never disagrees with the compiled one.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path

import torch

from ninefold.ops.cutlass import build

MODES = {"heuristic": 0, "data_parallel": 1, "split_k": 2, "stream_k": 3}
_ERRORS = {1: "no configuration of that index", 2: "this configuration has no such decomposition",
           3: "CUTLASS cannot run this shape (sizes or alignment)", 4: "the workspace is too small",
           5: "initialising the kernel's parameters failed", 6: "the launch failed",
           7: "its CUDA runtime found no usable device of that index (no such device, or a driver older than the "
              "CUDA version the library was built with)"}
WORKSPACE_BYTES = 32 << 20
ALIGNMENT = 16

_lock = threading.Lock()
_state: dict = {}
_workspaces: dict[int, list[torch.Tensor]] = {}


class CutlassError(RuntimeError):
    """The library is missing or stale, or one of its calls failed; the message says which."""


def library_path() -> Path | None:
    """The library to load: ``$NINEFOLD_CUTLASS_LIB`` or the newest matching build in the cache, else None."""
    env = os.environ.get("NINEFOLD_CUTLASS_LIB")
    if env:
        path = Path(env)
        return path / build.LIBRARY if path.is_dir() else path
    want = build.sources_hash()
    found = []
    for manifest in build.default_dir().glob("*/manifest.json"):
        try:
            if json.loads(manifest.read_text()).get("sources") == want and (manifest.parent / build.LIBRARY).is_file():
                found.append(manifest.parent / build.LIBRARY)
        except (OSError, ValueError):
            continue
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def library_key() -> str:
    """The loaded library's build key (its ``manifest.json``), or its file's size and time without one."""
    library()
    return _state["key"]


def _key_of(path: Path) -> str:
    try:
        return json.loads((path.parent / "manifest.json").read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        stat = path.stat()
        return f"{stat.st_size}-{int(stat.st_mtime)}"


def _load() -> ctypes.CDLL:
    path = library_path()
    if path is None or not path.is_file():
        where = f"{path} does not exist" if path is not None else f"no build under {build.default_dir()}"
        raise CutlassError(f"the CUTLASS GEMM library is not built ({where}); run python -m ninefold.ops.cutlass.build")
    try:
        built_from = json.loads((path.parent / "manifest.json").read_text()).get("sources")
    except (OSError, ValueError, AttributeError):
        built_from = None  # a library without its manifest: the configuration names below are all there is to check
    if built_from is not None and built_from != build.sources_hash():
        raise CutlassError(f"{path} was built from other sources than these; rebuild it with "
                           "python -m ninefold.ops.cutlass.build")
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.nf_cutlass_count.restype, lib.nf_cutlass_count.argtypes = i, []
    lib.nf_cutlass_name.restype, lib.nf_cutlass_name.argtypes = ctypes.c_char_p, [i]
    lib.nf_cutlass_workspace.restype = i
    lib.nf_cutlass_workspace.argtypes = [i, i, i, i, i, i, i, ctypes.POINTER(ctypes.c_size_t)]
    lib.nf_cutlass_run.restype = i
    lib.nf_cutlass_run.argtypes = [i, p, p, p, i, i, i, i, i, p, ctypes.c_size_t, i, p, i]
    names = [lib.nf_cutlass_name(c).decode() for c in range(lib.nf_cutlass_count())]
    want = [c.name for c in build.CONFIGS]
    if names != want:
        raise CutlassError(f"{path} holds configurations {names}, these sources expect {want}: rebuild it with "
                           "python -m ninefold.ops.cutlass.build")
    _state["key"] = _key_of(path)
    return lib


def library() -> ctypes.CDLL:
    """The loaded library; raises ``CutlassError`` (saying how to build it) when there is none."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _load()
                except (CutlassError, OSError) as error:
                    _state["lib"] = None
                    _state["error"] = CutlassError(str(error))
    if _state["lib"] is None:
        raise _state["error"]
    return _state["lib"]


def unavailable() -> str | None:
    """Why the library cannot be used here, or None when it can."""
    try:
        library()
    except CutlassError as error:
        return str(error)
    return None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CutlassError(f"{what}: {_ERRORS.get(status, f'status {status}')}")


def _mode(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode: got {mode!r}; expected one of {sorted(MODES)}")
    return MODES[mode]


def _checked(config: int, mode: str, splits: int) -> tuple[int, int]:
    """``config``, ``mode`` and ``splits`` checked (ValueErrors naming the argument); the mode's and splits' codes."""
    if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config < len(build.CONFIGS):
        raise ValueError(f"config: got {config!r}; expected an index 0..{len(build.CONFIGS) - 1} into build.CONFIGS")
    code = _mode(mode)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or (splits > 1 and mode != "split_k"):
        raise ValueError(f"splits: got {splits!r}; expected 1, or an integer > 1 with mode 'split_k'")
    if mode not in ("heuristic",) + build.CONFIGS[config].modes:
        raise ValueError(f"mode: {build.CONFIGS[config].name} runs {build.CONFIGS[config].modes}, not {mode!r}")
    return code, splits


def workspace_bytes(config: int, m: int, n: int, k: int, mode: str = "heuristic", splits: int = 1,
                    device: int | None = None) -> int:
    """Bytes of workspace configuration ``config`` needs for ``[m, k] @ [n, k].T``."""
    code, splits = _checked(config, mode, splits)
    device = torch.cuda.current_device() if device is None else device
    with torch.cuda.device(device):  # the library's own CUDA runtime follows the thread's current device
        return _workspace_need(config, m, n, k, code, splits, device)


def _workspace_need(config: int, m: int, n: int, k: int, code: int, splits: int, device: int) -> int:
    # (arguments checked, ``device`` current)
    out = ctypes.c_size_t(0)
    status = library().nf_cutlass_workspace(config, m, n, k, code, splits, device, ctypes.byref(out))
    _check(status, f"workspace of {build.CONFIGS[config].name} at {m}x{n}x{k}")
    return out.value


def _workspace(device: int, nbytes: int) -> torch.Tensor:
    # One buffer per device, kept for the process (a CUDA graph captured with one keeps its address); calls on
    # one device run in stream order (the engine's single stream, graph replays included), so they may share it.
    # A buffer first needed while capturing comes from the graph's pool, and is kept all the same.
    held = _workspaces.setdefault(device, [])
    if not held or held[-1].numel() < nbytes:
        held.append(torch.empty(max(nbytes, WORKSPACE_BYTES), dtype=torch.uint8, device=f"cuda:{device}"))
    return held[-1]


def matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: int, mode: str = "heuristic",
           splits: int = 1, pdl: bool = False) -> torch.Tensor:
    """``out = x @ w.T`` with ``build.CONFIGS[config]`` on the current stream; bfloat16, contiguous 2-D tensors on
    one CUDA device, each starting at a 16-byte aligned address (what TMA reads and writes). ``pdl``: launch with
    programmatic stream serialization (sm_90), so the kernel may start before the one before it ends."""
    for name, t in (("x", x), ("w", w), ("out", out)):
        if t.dtype != torch.bfloat16 or t.device.type != "cuda" or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous 2-D bfloat16 CUDA tensor, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")
        if t.data_ptr() % ALIGNMENT:
            raise ValueError(f"{name}: starts at an address {t.data_ptr() % ALIGNMENT} bytes past a {ALIGNMENT}-byte "
                             "boundary; TMA needs aligned operands")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x on {x.device}; expected one device")
    (m, k), n = x.shape, w.shape[0]
    if w.shape[1] != k or tuple(out.shape) != (m, n):
        raise ValueError(f"shapes: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}; expected "
                         f"x [M, K], w [N, K], out [M, N]")
    code, splits = _checked(config, mode, splits)
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):  # (the library sets its runtime's device; torch's is restored on leaving)
        space = _workspace(device, _workspace_need(config, m, n, k, code, splits, device))
        status = library().nf_cutlass_run(config, x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k, code, splits,
                                          space.data_ptr(), space.numel(), device, stream, int(bool(pdl)))
    _check(status, f"{build.CONFIGS[config].name} at {m}x{n}x{k} ({mode}, splits {splits})")
    return out
