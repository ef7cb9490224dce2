"""Builds ninefold's CUTLASS GEMM library for Hopper: ``python -m ninefold.ops.cutlass.build``.

Each entry of ``CONFIGS`` (tile shape, cluster, kernel schedule, tile scheduler, operand order)
compiles ``gemm_sm90.cu`` once for ``sm_90a`` with ``nvcc``; a generated dispatch table puts them
behind one C entry point (``nf_cutlass.h``), linked with the CUDA runtime statically, so the library
needs only the driver where it runs and builds on a machine without a GPU. What it needs to build:
``nvcc`` (``$NVCC``, ``$CUDA_HOME/bin``, ``PATH``, or the ``nvidia-cuda-nvcc`` wheel) and CUTLASS 3/4's
headers (``$CUTLASS_DIR`` or the ``nvidia-cutlass`` wheel). The library lands in
``$NINEFOLD_CACHE_DIR/cutlass/`` under a name keyed by the sources, the configurations, the compiler
and CUTLASS's version, where ``ninefold.ops.cutlass.binding`` finds it (``--out`` puts it elsewhere;
``NINEFOLD_CUTLASS_LIB`` then points the binding at it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("gemm_sm90.cu", "nf_cutlass.h")
LIBRARY = "libnf_cutlass_sm90.so"
FLAGS = ("-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr", "-DNDEBUG", "-Xcompiler", "-fPIC")
LINK_FLAGS = ("-shared", "-arch=sm_90a", "-cudart", "static")
SCHEDULES = {"cooperative": "Cooperative", "pingpong": "Pingpong"}
SCHEDULERS = {"stream_k": "StreamK", "persistent": "Persistent"}


@dataclass(frozen=True)
class GemmConfig:
    """One compiled kernel: the tile (M, N, K of the GEMM it runs), cluster rows, schedule, tile scheduler,
    and whether it computes ``y^T = w @ x^T`` (``swapped``: the weight's rows are the GEMM's M)."""

    tile: tuple[int, int, int]
    cluster_m: int
    schedule: str
    scheduler: str
    swapped: bool

    @property
    def name(self) -> str:
        m, n, k = self.tile
        return (f"{'swap_' if self.swapped else ''}{self.schedule}_{m}x{n}x{k}_c{self.cluster_m}"
                f"_{self.scheduler}")

    @property
    def pdl(self) -> bool:
        """Whether it is built to wait for the kernel before it (PDL). CUTLASS 4.2's stream-K scheduler does not
        compile with CUTLASS_ENABLE_GDC_FOR_SM90, so those configurations always launch plainly."""
        return self.scheduler != "stream_k"

    @property
    def modes(self) -> tuple[str, ...]:
        """The decompositions it can run (``binding.MODES``): stream-K's scheduler offers all four."""
        return ("data_parallel", "split_k", "stream_k") if self.scheduler == "stream_k" else ("data_parallel",)

    def macros(self, index: int) -> list[str]:
        m, n, k = self.tile
        return [f"-DNF_CONFIG={index}", f"-DNF_TILE_M={m}", f"-DNF_TILE_N={n}", f"-DNF_TILE_K={k}",
                f"-DNF_CLUSTER_M={self.cluster_m}", f"-DNF_SCHEDULE={SCHEDULES[self.schedule]}",
                f"-DNF_SCHEDULER={SCHEDULERS[self.scheduler]}", f"-DNF_SWAP={int(self.swapped)}"] + (
                    ["-DCUTLASS_ENABLE_GDC_FOR_SM90=1"] if self.pdl else [])


# Chosen for the decode GEMMs of 64-256 rows, where cuBLAS leaves SMs idle. The first set measured on an H200
# (docs/perf/ops.md): 64-row ping-pong tiles won the o and down projections at 112-256 rows, stream-K and
# split-K lost everywhere (their fix-up costs more than the idle SMs at 10-50 us), 256-row tiles and
# 128-row tiles with 64 columns never won and were dropped. Smaller and deeper ping-pong tiles, clusters
# and the plain persistent scheduler are the second set.
CONFIGS = (
    GemmConfig((128, 128, 64), 1, "cooperative", "stream_k", False),
    GemmConfig((64, 128, 64), 1, "pingpong", "persistent", False),
    GemmConfig((128, 64, 64), 1, "cooperative", "stream_k", True),
    GemmConfig((128, 128, 64), 1, "cooperative", "stream_k", True),
    GemmConfig((64, 128, 64), 1, "pingpong", "persistent", True),
    GemmConfig((128, 128, 64), 2, "cooperative", "persistent", True),
    GemmConfig((64, 64, 64), 1, "pingpong", "persistent", False),
    GemmConfig((64, 256, 64), 1, "pingpong", "persistent", False),
    GemmConfig((64, 128, 128), 1, "pingpong", "persistent", False),
    GemmConfig((64, 128, 64), 2, "pingpong", "persistent", False),
    GemmConfig((128, 128, 64), 1, "cooperative", "persistent", False),
    GemmConfig((64, 64, 64), 1, "pingpong", "persistent", True),
    GemmConfig((64, 256, 64), 1, "pingpong", "persistent", True),
)


class BuildError(RuntimeError):
    """The toolchain is missing or a compilation failed; the message says which and how to fix it."""


def find_nvcc() -> str:
    """``$NVCC``, ``$CUDA_HOME/bin/nvcc``, ``nvcc`` on ``PATH``, or the one in the ``nvidia-cuda-nvcc`` wheel."""
    candidates = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels

        for root in nvidia.__path__:
            candidates += [os.path.join(root, sub, "bin", "nvcc") for sub in ("cu13", "cuda_nvcc")]
    except ImportError:
        pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise BuildError("nvcc not found: set $NVCC or $CUDA_HOME, put nvcc on PATH, or pip install nvidia-cuda-nvcc")


def find_cutlass() -> Path:
    """The directory holding ``cutlass/cutlass.h`` and ``cute/``: ``$CUTLASS_DIR[/include]`` or ``nvidia-cutlass``'s."""
    roots = []
    if os.environ.get("CUTLASS_DIR"):
        roots += [Path(os.environ["CUTLASS_DIR"]) / "include", Path(os.environ["CUTLASS_DIR"])]
    try:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.origin:
            roots.append(Path(spec.origin).parent / "source" / "include")
    except (ImportError, ValueError):
        pass
    for root in roots:
        if (root / "cutlass" / "cutlass.h").is_file() and (root / "cute").is_dir():
            return root
    raise BuildError("CUTLASS headers not found: set $CUTLASS_DIR to a CUTLASS checkout or pip install nvidia-cutlass")


def cutlass_version(include: Path) -> str:
    """``major.minor.patch`` from ``cutlass/version.h``."""
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise BuildError(f"{include / 'cutlass' / 'version.h'}: no CUTLASS_MAJOR/MINOR/PATCH")
    version = ".".join(p.group(1) for p in parts)
    if int(parts[0].group(1)) < 3:
        raise BuildError(f"CUTLASS {version} at {include}: the Hopper kernels need CUTLASS 3.0 or newer")
    return version


def nvcc_version(nvcc: str) -> str:
    """The ``release X.Y`` line of ``nvcc --version``."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    if not found:
        raise BuildError(f"{nvcc} --version: no release number in {out!r}")
    if tuple(int(v) for v in found.group(1).split(".")) < (12, 0):
        raise BuildError(f"{nvcc} is CUDA {found.group(1)}: sm_90a needs CUDA 12.0 or newer")
    return found.group(1)


def sources_hash(configs=CONFIGS) -> str:
    """Hex hash of the sources, the generated dispatch table (the C interface) and the configurations and flags:
    a library made from others is stale."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update(dispatch_source(configs).encode())
    h.update(repr(([asdict(c) for c in configs], FLAGS, LINK_FLAGS)).encode())
    return h.hexdigest()[:20]


def build_key(nvcc_release: str, cutlass_release: str, configs=CONFIGS) -> str:
    """Hex key of what the library depends on: sources, configurations, flags, nvcc and CUTLASS versions."""
    text = repr((sources_hash(configs), nvcc_release, cutlass_release))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def default_dir() -> Path:
    """``$NINEFOLD_CACHE_DIR/cutlass`` (default ``~/.cache/ninefold/cutlass``)."""
    root = os.environ.get("NINEFOLD_CACHE_DIR") or Path.home() / ".cache" / "ninefold"
    return Path(root) / "cutlass"


def dispatch_source(configs=CONFIGS) -> str:
    """C++ of the table that maps a configuration index to its objects' entry points."""
    args_ws = "int m, int n, int k, int mode, int splits, int device, size_t* bytes"
    args_run = ("const void* x, const void* w, void* y, int m, int n, int k, int mode, int splits, "
                "void* workspace, size_t workspace_bytes, int device, void* stream, int pdl")
    lines = ['#include "nf_cutlass.h"', ""]
    for i in range(len(configs)):
        lines += [f'extern "C" int nf_cutlass_workspace_{i}({args_ws});',
                  f'extern "C" int nf_cutlass_run_{i}({args_run});']
    lines += ["", "namespace {", "struct Entry {", "  const char* name;",
              f"  int (*workspace)({args_ws});", f"  int (*run)({args_run});", "};",
              "const Entry kConfigs[] = {"]
    lines += [f'    {{"{c.name}", nf_cutlass_workspace_{i}, nf_cutlass_run_{i}}},' for i, c in enumerate(configs)]
    lines += ["};", "const int kCount = sizeof(kConfigs) / sizeof(kConfigs[0]);", "}  // namespace", "",
              'extern "C" int nf_cutlass_count(void) { return kCount; }',
              'extern "C" const char* nf_cutlass_name(int config) {',
              "  return config >= 0 && config < kCount ? kConfigs[config].name : nullptr;", "}",
              f'extern "C" int nf_cutlass_workspace(int config, {args_ws}) {{',
              "  if (config < 0 || config >= kCount) return NF_ERR_CONFIG;",
              "  return kConfigs[config].workspace(m, n, k, mode, splits, device, bytes);", "}",
              f'extern "C" int nf_cutlass_run(int config, {args_run}) {{',
              "  if (config < 0 || config >= kCount) return NF_ERR_CONFIG;",
              "  return kConfigs[config].run(x, w, y, m, n, k, mode, splits, workspace, workspace_bytes, device, stream, pdl);",
              "}", ""]
    return "\n".join(lines)


def _compile(nvcc: str, include: Path, source: Path, out: Path, macros: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    cmd = [nvcc, *FLAGS, f"-I{HERE}", f"-I{include}", *macros, "-c", str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()[-4000:]}")
    return time.perf_counter() - start, out.name


def build(out_dir: str | Path | None = None, *, jobs: int | None = None, configs=CONFIGS, quiet: bool = False) -> Path:
    """Compile every configuration and link the library; returns its path (reused when already built)."""
    nvcc, include = find_nvcc(), find_cutlass()
    nvcc_release, cutlass_release = nvcc_version(nvcc), cutlass_version(include)
    key = build_key(nvcc_release, cutlass_release, configs)
    target_dir = Path(out_dir) if out_dir is not None else default_dir() / key
    target = target_dir / LIBRARY
    manifest = target_dir / "manifest.json"
    if target.is_file() and manifest.is_file() and json.loads(manifest.read_text()).get("key") == key:
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or max(1, min(len(configs), os.cpu_count() or 1))
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"ninefold: building {len(configs)} CUTLASS {cutlass_release} GEMMs for sm_90a with nvcc {nvcc_release} "
        f"({jobs} at a time, about a minute each) into {target_dir}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        tmp_dir = Path(tmp)
        objects = [tmp_dir / f"config_{i}.o" for i in range(len(configs))]
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            futures = [pool.submit(_compile, nvcc, include, HERE / "gemm_sm90.cu", obj, config.macros(i))
                       for i, (config, obj) in enumerate(zip(configs, objects))]
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                seconds, name = future.result()
                say(f"  [{done}/{len(configs)}] {name} in {seconds:.0f} s ({time.perf_counter() - start:.0f} s so far)")
        dispatch = tmp_dir / "dispatch.cu"
        dispatch.write_text(dispatch_source(configs))
        objects.append(tmp_dir / "dispatch.o")
        _compile(nvcc, include, dispatch, objects[-1], [])
        linked = tmp_dir / LIBRARY
        cmd = [nvcc, *LINK_FLAGS, *map(str, objects), "-o", str(linked)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()[-4000:]}")
        os.replace(linked, target)
    manifest.write_text(json.dumps({"key": key, "sources": sources_hash(configs), "nvcc": nvcc_release, "cutlass": cutlass_release,
                                    "configs": [c.name for c in configs]}, indent=1) + "\n")
    say(f"ninefold: {target} built in {time.perf_counter() - start:.0f} s")
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.ops.cutlass.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory for the library (default: keyed under the cache)")
    parser.add_argument("--jobs", type=int, default=None, help="compilations at a time (default: one per core)")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs: expected a positive integer, got {args.jobs}")
    try:
        path = build(args.out, jobs=args.jobs)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
