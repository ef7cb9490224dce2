"""A ctypes binding to the parts of cuBLASLt that ``linear`` needs: plans, candidate algorithms, matmul.

torch calls cuBLAS with the algorithm its heuristic ranks first; cuBLASLt can list the others
(``cublasLtMatmulAlgoGetHeuristic`` with a count), and any of them can be launched with an explicit
``cublasLtMatmulAlgo_t``. That is what ``ninefold.ops.cublaslt.tuning`` measures. The library is
the one torch already loaded (found in this process's memory map), so the two never disagree on
versions. Every handle and descriptor lives as long as the process.

``y = x @ w.T`` with row-major ``x [M, K]``, ``w [N, K]``, ``y [M, N]`` is, in cuBLAS's
column-major terms, ``y^T [N, M] = op_T(w^T [K, N]) @ x^T [K, M]``: A is the weight (transposed),
B the activations, and the output's leading dimension is N.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from dataclasses import dataclass

import torch

# cudaDataType_t, cublasComputeType_t, cublasOperation_t and attribute ids (cublasLt.h, library_types.h)
CUDA_TYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
# name: (attribute id, bytes): the inner and cluster shape ids are uint16_t, the others 32-bit
ALGO_CONFIG = {"id": (0, 4), "tile": (1, 4), "splitk": (2, 4), "reduction": (3, 4), "swizzle": (4, 4),
               "custom": (5, 4), "stages": (6, 4), "inner": (7, 2), "cluster": (8, 2)}
# cublasLtMatmulAlgoCapAttributes_t ids used by ``enumerated``
CAP_SPLITK, CAP_REDUCTION_MASK, CAP_TILE_IDS, CAP_STAGES_IDS = 0, 1, 6, 13
REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE = 1, 2
WORKSPACE_BYTES = 32 << 20


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS."""


class Algo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: opaque, 8 x uint64, valid for the cuBLASLt version that made it."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_P = ctypes.c_void_p
_SIGNATURES = {
    "cublasLtCreate": [ctypes.POINTER(_P)],
    "cublasLtGetVersion": [],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_P), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_P)],
    "cublasLtMatmulPreferenceSetAttribute": [_P, ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulPreferenceDestroy": [_P],
    "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.POINTER(_Heuristic),
                                       ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, _P, ctypes.c_size_t,
                                             ctypes.POINTER(ctypes.c_size_t)],
    "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(Algo), _P, ctypes.c_size_t, _P],
    "cublasLtMatmulAlgoGetIds": [_P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmulAlgoInit": [_P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.POINTER(Algo)],
    "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, _P, ctypes.c_size_t,
                                          ctypes.POINTER(ctypes.c_size_t)],
    "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(Algo), ctypes.c_int, _P, ctypes.c_size_t],
    "cublasLtMatmulAlgoCheck": [_P, _P, _P, _P, _P, _P, ctypes.POINTER(Algo), ctypes.POINTER(_Heuristic)],
}

_lock = threading.Lock()
_lib = None
_handles: dict[int, _P] = {}
_workspaces: dict[int, torch.Tensor] = {}
_plans: dict[tuple, Plan] = {}
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _library_path() -> str | None:
    """The cuBLASLt that this process has loaded (torch loads it on its first CUDA matmul)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("cublasLt")


def library():
    """The loaded cuBLASLt (``ctypes.CDLL``) with argument types set; raises ``CublasLtError`` if absent."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                path = _library_path()
                if path is None and torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
                    a = torch.ones(8, 8, device="cuda", dtype=torch.float16)
                    (a @ a).sum().item()  # makes torch load cuBLAS(Lt)
                    path = _library_path()
                if path is None:
                    raise CublasLtError("cuBLASLt is not loaded in this process and no libcublasLt was found")
                lib = ctypes.CDLL(path)
                for name, argtypes in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes = argtypes
                    fn.restype = ctypes.c_size_t if name == "cublasLtGetVersion" else ctypes.c_int
                _lib = lib
    return _lib


def available() -> bool:
    """Whether cuBLASLt can be called here (a CUDA device and the library)."""
    if not torch.cuda.is_available():
        return False
    try:
        library()
    except (CublasLtError, OSError, AttributeError):
        return False
    return True


@functools.cache
def version() -> int:
    """``cublasLtGetVersion()``, e.g. 130100 (algorithms are only valid within one version)."""
    return int(library().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cuBLAS status {status}")


def _index(device: torch.device) -> int:
    """The CUDA device ordinal of ``device`` (``cuda`` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle(device: torch.device) -> _P:
    index = _index(device)
    if index not in _handles:
        with torch.cuda.device(index):
            handle = _P()
            _check(library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _handles[index] = handle
    return _handles[index]


def _workspace(device: torch.device) -> torch.Tensor:
    """The device's scratch memory. One per device, kept for the process (CUDA graphs captured with it
    point at it): matmuls through this binding on two streams of one device must not run at once."""
    index = _index(device)
    if index not in _workspaces:
        _workspaces[index] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
    return _workspaces[index]


def _layout(dtype: torch.dtype, rows: int, cols: int, ld: int) -> _P:
    layout = _P()
    _check(library().cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_TYPES[dtype], rows, cols, ld),
           "cublasLtMatrixLayoutCreate")
    return layout


@dataclass(frozen=True)
class Plan:
    """Descriptors of one ``[m, k] x [n, k]^T`` product in one dtype on one device."""

    m: int
    n: int
    k: int
    dtype: torch.dtype
    device_index: int
    desc: _P
    a: _P
    b: _P
    d: _P


def plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Plan:
    """The (cached) descriptors for this product."""
    if dtype not in CUDA_TYPES:
        raise CublasLtError(f"cuBLASLt linear: dtype {dtype} not supported (float16, bfloat16, float32)")
    index = _index(device)
    key = (m, n, k, dtype, index)
    found = _plans.get(key)
    if found is None:
        lib = library()
        desc = _P()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), 4), "cublasLtMatmulDescSetAttribute")
        found = Plan(m, n, k, dtype, index, desc, _layout(dtype, k, n, k), _layout(dtype, k, m, k), _layout(dtype, n, m, n))
        _plans[key] = found
    return found


@dataclass(frozen=True)
class Candidate:
    """One algorithm the heuristic offers for a plan, with its needs and its configuration."""

    algo: Algo
    workspace_bytes: int
    waves: float
    config: dict

    def name(self) -> str:
        """A short label: ``id66 tile20 split1 red0 sw0 stages35 inner0 cluster2 custom1``."""
        c = self.config
        return (f"id{c['id']} tile{c['tile']} split{c['splitk']} red{c['reduction']} sw{c['swizzle']} "
                f"stages{c['stages']} inner{c['inner']} cluster{c['cluster']} custom{c['custom']}")


def _config(algo: Algo) -> dict:
    lib = library()
    out = {}
    for name, (attr, size) in ALGO_CONFIG.items():
        value, written = (ctypes.c_uint32 if size == 4 else ctypes.c_uint16)(0), ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), size,
                                                          ctypes.byref(written))
        out[name] = int(value.value) if status == 0 else None
    return out


def candidates(p: Plan, count: int = 32) -> list[Candidate]:
    """Up to ``count`` algorithms cuBLASLt's heuristic proposes for ``p``, its favourite first."""
    lib = library()
    pref = _P()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    results = (_Heuristic * count)()
    found = ctypes.c_int(0)
    try:
        limit = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
               "cublasLtMatmulPreferenceSetAttribute")
        with torch.cuda.device(p.device_index):
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(torch.device("cuda", p.device_index)), p.desc, p.a,
                                                      p.b, p.d, p.d, pref, count, results, ctypes.byref(found)),
                   "cublasLtMatmulAlgoGetHeuristic")
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    out = []
    for r in results[: found.value]:
        if r.state == 0:
            algo = Algo()
            ctypes.memmove(ctypes.byref(algo), ctypes.byref(r.algo), ctypes.sizeof(Algo))
            out.append(Candidate(algo, int(r.workspace_size), float(r.waves_count), _config(algo)))
    return out


def _cap_array(algo: Algo, attr: int) -> list[int]:
    """A uint32 array capability of ``algo`` (its length asked first, with a zero-sized buffer)."""
    lib = library()
    size = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) != 0:
        return []
    count = size.value // 4
    if count == 0:
        return []
    values = (ctypes.c_uint32 * count)()
    _check(lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, size.value, ctypes.byref(size)),
           "cublasLtMatmulAlgoCapGetAttribute")
    return [int(v) for v in values]


def _cap_int(algo: Algo, attr: int) -> int:
    value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
    status = library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                          ctypes.byref(written))
    return int(value.value) if status == 0 else 0


def _set(algo: Algo, name: str, value: int) -> None:
    attr, size = ALGO_CONFIG[name]
    buf = (ctypes.c_uint32 if size == 4 else ctypes.c_uint16)(value)
    _check(library().cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), size),
           "cublasLtMatmulAlgoConfigSetAttribute")


def enumerated(p: Plan, splits=(1, 2, 3, 4, 6, 8), limit: int = 4000) -> list[Candidate]:
    """Every configuration cuBLASLt accepts for ``p`` (``cublasLtMatmulAlgoCheck``), beyond the heuristic's
    few: each algorithm id x the tiles and stages it lists x split-K counts (``splits``, where the
    algorithm splits K and each part keeps at least 256 of it). At most ``limit`` are checked."""
    lib = library()
    device = torch.device("cuda", p.device_index)
    handle = _handle(device)
    types = (CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_TYPES[p.dtype], CUDA_TYPES[p.dtype], CUDA_TYPES[p.dtype],
             CUDA_TYPES[p.dtype])
    ids = (ctypes.c_int * 256)()
    count = ctypes.c_int(0)
    _check(lib.cublasLtMatmulAlgoGetIds(handle, *types, 256, ids, ctypes.byref(count)), "cublasLtMatmulAlgoGetIds")
    out, checked = [], 0
    with torch.cuda.device(p.device_index):
        for algo_id in ids[: count.value]:
            base = Algo()
            if lib.cublasLtMatmulAlgoInit(handle, *types, algo_id, ctypes.byref(base)) != 0:
                continue
            tiles = _cap_array(base, CAP_TILE_IDS) or [0]
            stages = _cap_array(base, CAP_STAGES_IDS) or [0]
            split_ok = _cap_int(base, CAP_SPLITK)
            reduction = REDUCTION_COMPUTE_TYPE if _cap_int(base, CAP_REDUCTION_MASK) & REDUCTION_COMPUTE_TYPE \
                else REDUCTION_INPLACE
            for tile in tiles:
                for stage in stages:
                    for split in splits:
                        if split > 1 and (not split_ok or p.k // split < 256):
                            continue
                        if checked >= limit:
                            return out
                        checked += 1
                        algo = Algo()
                        ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
                        try:
                            _set(algo, "tile", tile)
                            _set(algo, "stages", stage)
                            _set(algo, "splitk", split)
                            if split > 1:
                                _set(algo, "reduction", reduction)
                        except CublasLtError:
                            continue
                        result = _Heuristic()
                        if lib.cublasLtMatmulAlgoCheck(handle, p.desc, p.a, p.b, p.d, p.d, ctypes.byref(algo),
                                                       ctypes.byref(result)) != 0:
                            continue
                        if result.workspace_size > WORKSPACE_BYTES:
                            continue
                        out.append(Candidate(algo, int(result.workspace_size), float(result.waves_count),
                                             _config(algo)))
    return out


def algo_from_words(words: list[int]) -> Algo:
    """An ``Algo`` from its 8 words (as persisted by the tuner)."""
    if len(words) != 8:
        raise ValueError(f"a cuBLASLt algorithm is 8 words, got {len(words)}")
    algo = Algo()
    for i, word in enumerate(words):
        algo.data[i] = word
    return algo


def algo_words(algo: Algo) -> list[int]:
    """The 8 words of an ``Algo`` (JSON-friendly)."""
    return [int(w) for w in algo.data]


def matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: Algo) -> torch.Tensor:
    """``out = x @ w.T`` with ``algo`` on the current stream. x ``[M, K]``, w ``[N, K]``, out ``[M, N]``,
    all contiguous, one dtype, one CUDA device (the caller checks)."""
    m, k = x.shape
    n = w.shape[0]
    p = plan(m, n, k, x.dtype, x.device)
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _check(library().cublasLtMatmul(_handle(x.device), p.desc, ctypes.byref(_ONE), w.data_ptr(), p.a,
                                        x.data_ptr(), p.b, ctypes.byref(_ZERO), out.data_ptr(), p.d, out.data_ptr(),
                                        p.d, ctypes.byref(algo), _workspace(x.device).data_ptr(), WORKSPACE_BYTES,
                                        stream),
               "cublasLtMatmul")
    return out
