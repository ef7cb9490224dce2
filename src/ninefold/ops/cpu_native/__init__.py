"""ninefold's native CPU kernels: C sources in this folder, compiled on first use, loaded with ctypes.

``library()`` returns the loaded library (or None). The first call on a machine compiles
``nf_gemm.c``, ``nf_decode.c``, ``nf_attention.c``, ``nf_rows.c`` and ``nf_pack.c`` with the system C compiler (``$CC``, else ``cc``/``gcc``:
``-O3 -march=native -fopenmp -shared -fPIC``, ~2 s, one line on stderr) into
``$NINEFOLD_CACHE_DIR/cpu_native/`` under a name keyed by the sources, the compiler's version,
the flags and the CPU's feature flags, so a changed source, compiler or CPU rebuilds and an
unchanged one loads at once. ``NINEFOLD_CPU_NATIVE=0`` turns them off; without a compiler (or
when the build fails) callers keep their torch paths and the reason is logged once.

The OpenMP runtime is torch's own when torch is loaded (both are ``libgomp.so.1``), so the
kernels use torch's thread count (``torch.set_num_threads``) and its thread pool.

What the kernels compute is in ``nf_cpu.h`` (the block layout, int8 activations) and
``nf_decode.c`` (the fused decode step), ``nf_attention.c`` (causal prefill attention), ``nf_rows.c``
(add + rms_norm, silu * up, rope over many rows), ``nf_pack.c`` (the block records, made at load);
``isa()`` names the instruction tier the build has (AVX-512 VNNI, AVX2 with FMA and F16C, or portable C);
``ninefold.ops.quantized`` (``BlockWeight``, ``linear_blocks``), ``ninefold.ops.cpu_native.attention`` and
``.rows`` (``cpu_native`` implementations of ``attention_prefill``, ``add_rms_norm``, ``silu_and_mul``, ``rope``),
``ninefold.llm.gguf_packed`` (``requantize_q8``) and ``ninefold.llm.models.llama_cpu`` call them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = ("nf_cpu.h", "nf_gemm.c", "nf_decode.c", "nf_attention.c", "nf_rows.c", "nf_pack.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL | None, "reason": str | None


class Mat(ctypes.Structure):
    """``nf_mat``: one weight in the block layout (see nf_cpu.h)."""

    _fields_ = [("data", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("lead", ctypes.c_int64), ("levels", ctypes.c_void_p),
                ("lead_bits", ctypes.c_int64)]


class Lora(ctypes.Structure):
    """``nf_lora``: one projection's LoRA slots, bfloat16 ``a [slots, k, r]`` and ``b [slots, ceil(n / 16), r, 16]``
    (see nf_decode.c)."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("r", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """``nf_layer``: one decoder layer's weights, KV cache and LoRA slots (see nf_decode.c)."""

    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("lqkv", Lora), ("lo", Lora),
                ("lgate_up", Lora), ("ldown", Lora)]


class Model(ctypes.Structure):
    """``nf_model``: the model's shapes and pointers plus one step's inputs (see nf_decode.c)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("n_layers", "dim", "hq", "hk", "hd", "inter", "block_size",
                                                    "table_stride", "cache_bf16", "io_bf16")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double), ("layers", ctypes.c_void_p), ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p), ("m", ctypes.c_int64),
        ("max_ctx", ctypes.c_int64), ("ids", ctypes.c_void_p), ("positions", ctypes.c_void_p),
        ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("threads", ctypes.c_int64),
        ("lora_slots", ctypes.c_void_p), ("lora_r", ctypes.c_int64)]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("NINEFOLD_CACHE_DIR") or Path.home() / ".cache" / "ninefold"
    return Path(root) / "cpu_native"


def build_key(cc: str) -> str:
    """Hex key of what the built library depends on: sources, compiler version, flags, CPU flags."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update(repr((cc, version, FLAGS, _cpu_flags())).encode())
    return h.hexdigest()[:20]


def _build(cc: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"ninefold: compiling the native CPU kernels (once per machine) into {target.parent} ...", file=sys.stderr,
          flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    sources = [str(HERE / n) for n in SOURCES if n.endswith(".c")]
    try:
        proc = subprocess.run([cc, *flags, *sources, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders (test workers) each leave a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.nf_simd.restype = i64
    lib.nf_simd.argtypes = []
    lib.nf_linear_scratch_bytes.restype = i64
    lib.nf_linear_scratch_bytes.argtypes = [i64, i64]
    lib.nf_linear.restype = None
    lib.nf_linear.argtypes = [ctypes.POINTER(Mat), p, i64, i64, i64, p, i64, i64, i64, p]
    lib.nf_decode_scratch_bytes.restype = i64
    lib.nf_decode_scratch_bytes.argtypes = [ctypes.POINTER(Model)]
    lib.nf_decode_step.restype = None
    lib.nf_decode_step.argtypes = [ctypes.POINTER(Model)]
    lib.nf_attention_scratch_floats.restype = i64
    lib.nf_attention_scratch_floats.argtypes = [p, i64, i64, i64]
    lib.nf_add_rms_norm.restype = None
    lib.nf_add_rms_norm.argtypes = [p, i64, p, i64, p, i64, i64, ctypes.c_double, i64, p, p]
    lib.nf_silu_and_mul.restype = None
    lib.nf_silu_and_mul.argtypes = [p, i64, i64, i64, i64, p]
    lib.nf_rope_neox.restype = None
    lib.nf_rope_neox.argtypes = [p, i64, p, i64, p, p, i64, i64, i64, i64, i64, i64, p, p]
    lib.nf_pack_blocks.restype = None
    lib.nf_pack_blocks.argtypes = [p, p, p, i64, i64, i64, p]
    lib.nf_requantize_q8.restype = None
    lib.nf_requantize_q8.argtypes = [p, i64, i64, p, p]
    lib.nf_q4_k_codes.restype = None
    lib.nf_q4_k_codes.argtypes = [p, i64, p, p, p]
    lib.nf_requantize_q6_k.restype = None
    lib.nf_requantize_q6_k.argtypes = [p, i64, p, p]
    lib.nf_dequantize_q6_k.restype = None
    lib.nf_dequantize_q6_k.argtypes = [p, i64, p]
    lib.nf_attention_prefill.restype = None
    lib.nf_attention_prefill.argtypes = [p, i64, p, i64, p, i64, i64, p, p, i64, i64, i64, i64, ctypes.c_double, p, i64,
                                         p]


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("NINEFOLD_CPU_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "NINEFOLD_CPU_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc)"
    try:
        import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share its OpenMP runtime)

        target = _cache_dir() / f"libninefold_cpu-{build_key(cc)}.so"
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"could not build or load them: {e}"
    return lib, None


def library() -> ctypes.CDLL | None:
    """The native kernel library, compiled on first use; None when unavailable (see ``reason()``)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = _load()
                if why is not None:
                    log.warning("ninefold: native CPU kernels off (%s); the torch CPU paths run instead", why)
                _state["reason"] = why
                _state["lib"] = lib
    return _state["lib"]


def available() -> bool:
    """Whether the native kernels can run here (builds them on the first call)."""
    return library() is not None


def reason() -> str | None:
    """Why the native kernels are off (None when they are on or not yet tried)."""
    return _state.get("reason")


ISA_NAMES = {2: "avx512-vnni", 1: "avx2", 0: "portable"}


def isa() -> str | None:
    """The loaded build's instruction tier: "avx512-vnni", "avx2" (with FMA and F16C) or "portable"
    (plain C loops, for correctness); None when the kernels are off."""
    lib = library()
    return None if lib is None else ISA_NAMES[int(lib.nf_simd())]


# x86-64 compiler flags that build each tier whatever this CPU is (tests and benchmarks of the tiers)
TIER_MARCH = {"portable": ("-march=x86-64",), "avx2": ("-march=x86-64-v3",),
              "avx512-vnni": ("-march=x86-64-v4", "-mavx512vnni")}
_TIER_CPU_FLAGS = {"portable": (), "avx2": ("avx2", "fma", "f16c"),
                   "avx512-vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")}


def tiers_runnable_here() -> list[str]:
    """The tiers of ``TIER_MARCH`` this CPU can run (x86-64 Linux; empty elsewhere)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = set(_cpu_flags().split())
    return [tier for tier, need in _TIER_CPU_FLAGS.items() if all(f in have for f in need)]


class TierUnsupported(RuntimeError):
    """The C compiler does not know the flags of the tier asked for."""


def build_tier(tier: str, directory: str | os.PathLike) -> ctypes.CDLL:
    """Compiles the kernels for ``tier`` (a key of ``TIER_MARCH``) into ``directory`` and loads them,
    beside the library ``library()`` uses: to check or time one tier on a CPU that has a higher one."""
    if tier not in TIER_MARCH:
        raise ValueError(f"tier must be one of {sorted(TIER_MARCH)}, not {tier!r}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc)")
    import torch  # noqa: F401  (torch's libgomp first, as in _load)

    flags = tuple(f for f in FLAGS if not f.startswith("-march")) + TIER_MARCH[tier]
    target = Path(directory) / f"libninefold_cpu-{tier}.so"
    try:
        _build(cc, target, flags)
    except RuntimeError as error:
        if "march" in str(error):  # e.g. gcc < 11 knows no x86-64-v3
            raise TierUnsupported(f"{cc} cannot build the {tier} tier ({' '.join(TIER_MARCH[tier])})") from error
        raise
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def fast() -> bool:
    """Whether the loaded build has vector kernels (AVX-512 VNNI or AVX2): the tiers worth dispatching
    to. The portable build is slower than torch's own CPU paths, so callers keep those there."""
    return isa() in ("avx512-vnni", "avx2")


def slow_reason() -> str:
    """Why ``fast()`` is false, for the ``supports`` reasons of the operators that need it."""
    return f"native CPU kernels without AVX2 or AVX-512 VNNI here ({reason() or 'portable build'})"


class enabled:
    """``with cpu_native.enabled(False): ...`` builds models on the torch paths (tests, benchmarks);
    ``enabled(True)`` restores the default. Applies to what is built or dispatched inside the block."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        library()
        self.saved = dict(_state)
        if not self.on:
            _state.update(lib=None, reason="turned off by cpu_native.enabled(False)")
        return self

    def __exit__(self, *exc):
        _state.clear()
        _state.update(self.saved)
        return False
