"""Benchmark of the DSL example kernels: ``python -m ninefold.bench.dsl`` (GPU) or ``--cpu``.

GPU mode, in one run: the card's ceilings (device copy bandwidth, cuBLAS fp16/bf16 matmul rate),
then every workload at NineToothed's paper shapes (fp16) and at large bf16 shapes with ninefold,
torch and NineToothed 0.26 (the same kernel sources with ``ninefold.dsl`` renamed to
``ninetoothed``; "n/a" when it does not import). Outputs are checked against torch before any
timing. Times are medians of ``triton.testing.do_bench``. The first call of every ninefold kernel
runs on empty caches (compile + tune), a second process then measures the first call again
(cache hits). A table goes to stdout; JSON and a PNG plot to ``$OUT`` (or ``--out``).

CPU mode: the ``cpu`` backend against torch CPU ops for add, softmax, rms_norm and mm.
"""

import argparse
import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import ninefold.dsl.language as nl
from ninefold.bench.results import write_json
from ninefold.dsl import Symbol

KERNEL_MODULES = ("add", "activation", "mm", "conv2d", "softmax", "rms_norm", "rope", "attention", "pool")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Workload:
    """One benchmark row: how to build inputs, call ninefold/NineToothed (``run(kernels, *x)``) and torch."""

    name: str
    group: str  # "paper", "large" or "cpu"
    dtype: torch.dtype
    shape: str
    make: object  # (device) -> tuple of inputs
    run: object  # (kernel namespace, *inputs) -> output
    torch: object  # (*inputs) -> output
    bytes: float = 0.0  # bytes read + written (memory-bound rows)
    flops: float = 0.0  # floating-point operations (compute-bound rows)
    copy_same_s: float | None = None  # a device copy of the same bytes (memory-bound rows, GPU)
    results: dict = field(default_factory=dict)

    @property
    def key(self):
        return f"{self.name}/{self.group}/{str(self.dtype).replace('torch.', '')}"


def _randn(shape, dtype, device):
    return torch.randn(shape, dtype=dtype, device=device)


def _rope_tables(t, half, dtype, device):
    angles = torch.rand((t, half), device=device, dtype=torch.float32) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rope_torch(x, cos, sin):
    half = cos.shape[1]
    a, b = x[..., :half], x[..., half : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half :]], dim=-1)


def _elementwise(name, group, dtype, n_rows, n_cols, elem):
    shape = (n_rows, n_cols)
    size = n_rows * n_cols * elem
    if name == "add":
        return Workload(
            "add",
            group,
            dtype,
            "x".join(map(str, shape)),
            lambda d: (_randn(shape, dtype, d), _randn(shape, dtype, d)),
            lambda k, x, y: k.add.add(x, y),
            torch.add,
            bytes=3 * size,
        )
    if name == "silu":
        return Workload(
            "silu",
            group,
            dtype,
            "x".join(map(str, shape)),
            lambda d: (_randn(shape, dtype, d),),
            lambda k, x: k.activation.silu(x),
            torch.nn.functional.silu,
            bytes=2 * size,
        )
    if name == "softmax":
        return Workload(
            "softmax",
            group,
            dtype,
            "x".join(map(str, shape)),
            lambda d: (_randn(shape, dtype, d),),
            lambda k, x: k.softmax.softmax(x),
            lambda x: torch.softmax(x, -1),
            bytes=2 * size,
        )
    if name == "rms_norm":
        return Workload(
            "rms_norm",
            group,
            dtype,
            "x".join(map(str, shape)),
            lambda d: (_randn(shape, dtype, d), _randn((n_cols,), dtype, d)),
            lambda k, x, w: k.rms_norm.rms_norm(x, w, 1e-6),
            lambda x, w: torch.nn.functional.rms_norm(x, (n_cols,), w, 1e-6),
            bytes=2 * size,
        )
    raise ValueError(name)


def _mm(group, dtype, m, n, k):
    return Workload(
        "mm",
        group,
        dtype,
        f"{m}x{k}x{n}",
        lambda d: (_randn((m, k), dtype, d), _randn((k, n), dtype, d)),
        lambda kk, a, b: kk.mm.mm(a, b),
        torch.mm,
        flops=2.0 * m * n * k,
    )


def _sdpa(group, dtype, b, h, s, d, causal):
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return Workload(
        "sdpa_causal" if causal else "sdpa",
        group,
        dtype,
        f"B{b} H{h} S{s} D{d}",
        lambda dev: tuple(_randn((b, h, s, d), dtype, dev) for _ in range(3)),
        lambda k, q, kk, v: k.attention.scaled_dot_product_attention(q, kk, v, is_causal=causal),
        lambda q, kk, v: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=causal),
        flops=flops,
    )


def gpu_workloads(shrink=1):
    """NineToothed's paper shapes in float16, then the large bfloat16 shapes.

    ``shrink`` divides the large sizes (not head dims or channels) for a quick smoke run.
    """
    h, b16 = torch.float16, torch.bfloat16

    def n(size):
        return max(1, size // shrink)

    rope_shape = (n(4 * 1024), 48, 64)  # (batch 4 x seq 1024) tokens, 48 heads, head dim 64
    conv_x, conv_w = (4, 512, 14, 14), (n(512), 512, 3, 3)
    bmm_n = n(2048)
    return [
        _elementwise("add", "paper", h, n(4096), 4096, 2),
        _mm("paper", h, n(4096), n(4096), n(4096)),
        Workload(
            "bmm",
            "paper",
            h,
            f"4x{bmm_n}x{bmm_n}x{bmm_n}",
            lambda d: (_randn((4, bmm_n, bmm_n), h, d), _randn((4, bmm_n, bmm_n), h, d)),
            lambda k, a, b: k.mm.bmm(a, b),
            torch.bmm,
            flops=2.0 * 4 * bmm_n**3,
        ),
        Workload(
            "conv2d",
            "paper",
            h,
            f"{conv_x}*{conv_w}".replace(" ", ""),
            lambda d: (_randn(conv_x, h, d), _randn(conv_w, h, d)),
            lambda k, x, w: k.conv2d.conv2d(x, w),
            torch.nn.functional.conv2d,
            flops=2.0 * 4 * conv_w[0] * 12 * 12 * 512 * 9,
        ),
        _elementwise("rms_norm", "paper", h, n(4096), 4096, 2),
        _elementwise("softmax", "paper", h, n(4096), 4096, 2),
        Workload(
            "rope",
            "paper",
            h,
            f"({rope_shape[0]},48,64)",
            lambda d: (_randn(rope_shape, h, d), *_rope_tables(rope_shape[0], 32, h, d)),
            lambda k, x, c, s: k.rope.rotate(x, c, s),
            _rope_torch,
            bytes=2 * math.prod(rope_shape) * 2 + 2 * rope_shape[0] * 32 * 2,
        ),
        _sdpa("paper", h, 4, 48, n(1024), 64, causal=False),
        _elementwise("silu", "paper", h, n(4096), 4096, 2),
        _elementwise("add", "large", b16, n(2**14), 2**14, 2),
        _elementwise("softmax", "large", b16, n(16384), 8192, 2),
        _elementwise("rms_norm", "large", b16, n(16384), 8192, 2),
        _mm("large", b16, n(8192), n(8192), n(8192)),
        _sdpa("large", b16, 4, 32, n(4096), 128, causal=True),
    ]


def cpu_workloads():
    """Moderate sizes for the 2-core development machine."""
    f = torch.float32
    return [
        _elementwise("add", "cpu", f, 2048, 2048, 4),
        _elementwise("softmax", "cpu", f, 2048, 2048, 4),
        _elementwise("rms_norm", "cpu", f, 2048, 2048, 4),
        _mm("cpu", f, 1024, 1024, 1024),
        _mm("cpu", torch.bfloat16, 1024, 1024, 1024),
    ]


def ninefold_kernels():
    """The kernel modules as a namespace: ``ns.mm.mm(a, b)``."""
    return _namespace("ninefold.ops.kernels")


def ninetoothed_kernels(workdir):
    """The same kernel sources compiled by NineToothed (imports renamed), or an error string."""
    try:
        importlib.import_module("ninetoothed")
    except Exception as error:  # any import failure means the column is "n/a"
        return f"n/a ({type(error).__name__}: {error})"
    source_dir = pathlib.Path(importlib.import_module("ninefold.ops.kernels").__file__).parent
    package = pathlib.Path(workdir) / "ninetoothed_kernels"
    package.mkdir(parents=True, exist_ok=True)
    for path in source_dir.glob("*.py"):
        text = path.read_text()
        for old, new in (
            ("ninefold.dsl.language", "ninetoothed.language"),
            ("ninefold.dsl", "ninetoothed"),
            ("ninefold.ops.kernels", "ninetoothed_kernels"),
        ):
            text = text.replace(old, new)
        (package / path.name).write_text(text)
    sys.path.insert(0, str(workdir))
    try:
        return _namespace("ninetoothed_kernels")
    except Exception as error:
        return f"n/a ({type(error).__name__}: {error})"


def _namespace(package):
    class Kernels:
        pass

    ns = Kernels()
    for name in KERNEL_MODULES:
        setattr(ns, name, importlib.import_module(f"{package}.{name}"))
    return ns


def relative_error(got, want):
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _gpu_time(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def _cpu_time(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _call_wall(fn, sync, calls=100):
    """Wall time per call of back-to-back calls without synchronizing: the host's cost per call
    when it exceeds the kernel's (the launch queue never fills at these counts)."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls


def _first_call(fn, sync):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def measure_ceilings(device):
    """Copy bandwidth (bytes read + written per second) and torch.mm rate per dtype."""
    if device == "cuda":
        src = torch.empty(2**30, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        copy = 2 * src.numel() * 2 / _gpu_time(lambda: dst.copy_(src))
        del src, dst
        rates = {}
        for dtype in (torch.float16, torch.bfloat16):
            a, b = (torch.randn(8192, 8192, dtype=dtype, device=device) for _ in range(2))
            rates[str(dtype)] = 2 * 8192**3 / _gpu_time(lambda a=a, b=b: torch.mm(a, b))
        return {"copy_bytes_per_s": copy, "mm_flops_per_s": rates}
    src = torch.empty(2**24, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / _cpu_time(lambda: dst.copy_(src))
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(1024, 1024, dtype=dtype) for _ in range(2))
        rates[str(dtype)] = 2 * 1024**3 / _cpu_time(lambda a=a, b=b: torch.mm(a, b))
    return {"copy_bytes_per_s": copy, "mm_flops_per_s": rates}


def _fraction(w, seconds, ceilings):
    if seconds is None:
        return None
    if w.flops:
        return w.flops / seconds / ceilings["mm_flops_per_s"].get(str(w.dtype), float("nan"))
    return w.bytes / seconds / ceilings["copy_bytes_per_s"]


def copy_same_bytes(w, device):
    """Device-to-device copy moving the row's bytes (half read, half written), timed like the rows."""
    if not w.bytes or device != "cuda":
        return None
    src = torch.empty(int(w.bytes) // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _gpu_time(lambda: dst.copy_(src))


def tuning_records():
    """``{(file, key): entry}`` of every tuning result under ``$NINEFOLD_CACHE_DIR`` (with timings)."""
    from ninefold.dsl.cache import cache_dir, read_json
    from ninefold.dsl.tuning import TIMINGS

    records = {}
    for path in sorted(cache_dir("tuning").glob("*.json")):
        data = read_json(path)
        timings = data.get(TIMINGS, {})
        for key, best in data.items():
            if key != TIMINGS:
                records[(path.name, key)] = {"key": key, "best": best, "timings": timings.get(key, [])}
    return records


def run_impl(w, impl, fn, inputs, reference, device, sync):
    """First call (compile + tune), check against torch, then time. Fills ``w.results[impl]``."""
    res = {}
    try:
        first, out = _first_call(lambda: fn(*inputs), sync)
        res["first_call_s"] = first
        err = relative_error(out, reference)
        res["rel_error"] = err
        res["rel_error_warm"] = relative_error(fn(*inputs), reference)  # through the cached launcher
        res["ok"] = max(err, res["rel_error_warm"]) <= TOLERANCE[w.dtype]
        if res["ok"]:
            res["seconds"] = (
                _gpu_time(lambda: fn(*inputs)) if device == "cuda" else _cpu_time(lambda: fn(*inputs))
            )
            if device == "cuda":
                res["call_wall_s"] = _call_wall(lambda: fn(*inputs), sync)
    except Exception as error:  # a failing implementation is a result, not a crash of the run
        res["error"] = f"{type(error).__name__}: {error}"[:300]
        res["ok"] = False
    w.results[impl] = res


PROFILED = (  # (file suffix, function) whose cumulative time the profiled probe reports
    ("triton/runtime/cache.py", "triton_key", "Triton: triton_key() (hashes libtriton)"),
    ("ninefold/dsl/backends/triton_startup.py", "install", "ninefold: stored Triton key (stat walk)"),
    ("triton/backends/nvidia/compiler.py", "get_ptxas_version", "Triton: ptxas --version"),
    ("triton/backends/nvidia/driver.py", "libcuda_dirs", "Triton: ldconfig -p (libcuda dirs)"),
    ("triton/backends/nvidia/driver.py", "__init__", "Triton: CUDA driver objects"),
    ("triton/runtime/build.py", "compile_module_from_src", "Triton: C modules (launcher, utils) load/build"),
    ("triton/compiler/compiler.py", "compile", "Triton: compile() on a cache hit"),
    ("triton/compiler/compiler.py", "_init_handles", "Triton: cubin load + launcher"),
    ("triton/runtime/jit.py", "warmup", "Triton: JITFunction.warmup"),
    ("triton/runtime/jit.py", "run", "Triton: JITFunction.run"),
    ("ninefold/dsl/backends/launch.py", "prepare", "ninefold: code generation + import"),
    ("ninefold/dsl/tuning.py", "tune", "ninefold: tuning result lookup"),
    ("ninefold/dsl/backends/triton.py", "launcher", "ninefold: launcher build"),
    ("ninefold/dsl/kernel.py", "__call__", "ninefold: whole first call"),
)


def _profile_table(stats):
    """Cumulative seconds of the PROFILED functions, and the 15 largest entries for context."""
    picked, top = {}, []
    for (filename, line, func), (_, _, _, cumulative, _) in stats.stats.items():
        path = filename.replace("\\", "/")
        for suffix, name, label in PROFILED:
            if path.endswith(suffix) and func == name:
                picked[label] = picked.get(label, 0.0) + cumulative
        top.append((cumulative, f"{path.rsplit('site-packages/', 1)[-1]}:{line}({func})"))
    top.sort(reverse=True)
    modules = sorted(((c, name) for c, name in top if name.endswith("(<module>)")), reverse=True)
    return {"functions": picked, "top": [[name, round(c, 4)] for c, name in top[:15]],
            "modules_imported": [[name, round(c, 4)] for c, name in modules[:12]]}


def probe_cache(names, device, shrink=1, profile=False):
    """Second process: first-call time of each ninefold kernel with warm caches (JSON to stdout).

    Also reports the import time of the kernels, CUDA's initialisation (context creation, which every
    torch program pays once; it is done here before any kernel is timed), how the Triton key was
    obtained, and with ``profile`` the cProfile breakdown of the first kernel's first call.
    """
    start = time.perf_counter()
    kernels = ninefold_kernels()
    info = {"import_s": time.perf_counter() - start}
    if device == "cuda":
        start = time.perf_counter()
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize()
        info["cuda_init_s"] = time.perf_counter() - start
    workloads = {w.key: w for w in (gpu_workloads(shrink) if device == "cuda" else cpu_workloads())}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {}
    for name in names[:1] if profile else names:
        w = workloads[name]
        inputs = w.make(device)
        sync()
        call = lambda w=w, inputs=inputs: w.run(kernels, *inputs)  # noqa: E731
        try:
            if profile:
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                times[name], _ = profiler.runcall(_first_call, call, sync)
                info["profile"] = _profile_table(pstats.Stats(profiler))
            else:
                times[name], _ = _first_call(call, sync)
        except Exception as error:
            times[name] = f"{type(error).__name__}: {error}"[:200]
        del inputs
    from ninefold.dsl.backends import triton_startup

    info["triton_key"] = triton_startup._STATE.get("how")
    info["triton_libcuda_path"] = os.environ.get("TRITON_LIBCUDA_PATH")
    info["first_call_s"] = times
    print("PROBE " + json.dumps(info))


def run(device, out_dir, deadline_s, only=None, shrink=1):
    start = time.perf_counter()
    workloads = gpu_workloads(shrink) if device == "cuda" else cpu_workloads()
    if only:
        workloads = [w for w in workloads if w.name in only.split(",")]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ceilings = measure_ceilings(device)
    kernels = ninefold_kernels()
    with tempfile.TemporaryDirectory() as scratch:
        nt = ninetoothed_kernels(scratch) if device == "cuda" else "n/a (GPU only)"
        for w in tqdm(workloads, desc="ninefold + torch", file=sys.stderr):
            torch.manual_seed(0)
            inputs = w.make(device)
            reference = w.torch(*inputs)
            run_impl(w, "torch", w.torch, inputs, reference, device, sync)
            before = tuning_records()
            run_impl(w, "ninefold", lambda *x, w=w: w.run(kernels, *x), inputs, reference, device, sync)
            w.results["ninefold"]["tuning"] = [v for k, v in tuning_records().items() if k not in before]
            w.copy_same_s = copy_same_bytes(w, device)
            del inputs, reference
            if device == "cuda":
                torch.cuda.empty_cache()
        for w in tqdm(sorted(workloads, key=_ninetoothed_priority), desc="NineToothed", file=sys.stderr):
            if isinstance(nt, str):
                w.results["ninetoothed"] = {"error": nt, "ok": False}
                continue
            if time.perf_counter() - start > deadline_s:
                w.results["ninetoothed"] = {"error": "skipped: time budget spent", "ok": False}
                continue
            torch.manual_seed(0)
            inputs = w.make(device)
            reference = w.torch(*inputs)
            run_impl(w, "ninetoothed", lambda *x, w=w: w.run(nt, *x), inputs, reference, device, sync)
            del inputs, reference
            if device == "cuda":
                torch.cuda.empty_cache()
    probes = _second_process(workloads, device, shrink)
    cached = probes["all"].get("first_call_s", {})
    for w in workloads:
        w.results["ninefold"]["cached_first_call_s"] = cached.get(w.key)
        for res in w.results.values():
            res["fraction_of_ceiling"] = _fraction(w, res.get("seconds"), ceilings)
            if w.copy_same_s and res.get("seconds"):
                res["fraction_of_copy_same"] = w.copy_same_s / res["seconds"]
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "ninetoothed": _version("ninetoothed"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ceilings": ceilings,
        "second_process": probes,
        "wall_s": time.perf_counter() - start,
        "workloads": [
            {
                k: (str(v) if k == "dtype" else v)
                for k, v in vars(w).items()
                if k not in ("make", "run", "torch")
            }
            for w in workloads
        ],
    }
    print(table(workloads, ceilings))
    print(tuning_summary(workloads))
    print(probe_summary(probes))
    if out_dir:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = "dsl_bench_cpu" if device == "cpu" else "dsl_bench"
        (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
        plot(workloads, out / f"{name}.png", report["device"])
        print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return report


def _ninetoothed_priority(w):
    """NineToothed re-tunes every shape; the headline rows go first in case the budget runs out."""
    order = (
        "mm/large",
        "mm/paper",
        "sdpa_causal/large",
        "add/large",
        "softmax/large",
        "rms_norm/large",
        "add/paper",
        "rms_norm/paper",
        "softmax/paper",
        "silu/paper",
        "rope/paper",
    )
    name = f"{w.name}/{w.group}"
    return order.index(name) if name in order else len(order)


def _second_process(workloads, device, shrink):
    """First calls in new processes on the filled caches: every kernel; the first kernel profiled;
    the first kernel without ninefold's stored Triton key (what a new process paid before)."""
    names = [w.key for w in workloads]
    full = _probe(names, device, shrink)
    out = {"all": full}
    if device == "cuda" and names:
        out["profiled"] = _probe(names[:1], device, shrink, "--profile")
        out["without_stored_triton_key"] = _probe(names[:1], device, shrink, env={"NINEFOLD_DSL_TRITON_KEY": "off"})
    return out


def _probe(names, device, shrink, *extra, env=None):
    cmd = [sys.executable, "-m", "ninefold.bench.dsl", "--probe-cache", ",".join(names), "--shrink", str(shrink), *extra]
    if device == "cpu":
        cmd.append("--cpu")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 120 s"}
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :])
    return {"error": done.stderr[-300:]}


def _config_label(config):
    meta = ",".join(f"{k}={v}" for k, v in sorted(config.get("meta", {}).items())) or "-"
    flags = [" persistent" if config.get("persistent") else "", f" tma={config['tma']}" if config.get("tma") else "",
             " hoist" if config.get("hoist") else "", " row-major" if config.get("grouped") is False else "",
             " ws" if config.get("ws") else ""]
    if config.get("schedule"):  # e.g. the Gluon fa3 schedule: ping-pong, heads per group (0: row-major)
        flags.append(f" {config['schedule']}{' pingpong' if config.get('pingpong') else ''} group={config.get('group')}")
    return f"{meta} w{config.get('num_warps')} s{config.get('num_stages')}{''.join(flags)}"


def tuning_summary(workloads) -> str:
    """Lines for stdout: each tuned kernel's pick and the device-time medians it was chosen from."""
    lines = ["tuner picks (device time, cold L2; * = chosen):"]
    for w in workloads:
        for record in w.results.get("ninefold", {}).get("tuning", []):
            timed = sorted((t for t in record["timings"] if t.get("median_ms")), key=lambda t: t["median_ms"])
            cells = [
                f"{'*' if t['config'] == record['best'] else ''}{_config_label(t['config'])} {t['median_ms'] * 1e3:.1f}us"
                for t in timed[:4]
            ]
            lines.append(f"  {w.key}: {_config_label(record['best'])}" + (f"  [{'; '.join(cells)}]" if cells else ""))
    return "\n".join(lines)


def probe_summary(probes) -> str:
    """Lines for stdout: where a new process's first kernel call goes."""
    full = probes.get("all", {})
    lines = ["second process (filled caches):"]
    if "error" in full:
        return "\n".join(lines + [f"  probe failed: {full['error']}"])
    firsts = full.get("first_call_s", {})
    first_name = next(iter(firsts), None)
    lines.append(
        f"  import of the kernels {full.get('import_s', 0):.2f} s; CUDA init (context; excluded) {full.get('cuda_init_s', 0):.2f} s;"
        f" Triton key {full.get('triton_key')}"
    )
    if first_name:
        value = firsts[first_name]
        lines.append(f"  first kernel ({first_name}) first call: {value:.3f} s" if isinstance(value, float) else f"  {first_name}: {value}")
    old = probes.get("without_stored_triton_key", {}).get("first_call_s", {})
    if first_name in old and isinstance(old[first_name], float):
        lines.append(f"  the same without the stored Triton key: {old[first_name]:.3f} s")
    prof = probes.get("profiled", {}).get("profile", {})
    for label, seconds in sorted(prof.get("functions", {}).items(), key=lambda kv: -kv[1]):
        lines.append(f"    {label:<50}{seconds:7.3f} s (profiled)")
    for name, seconds in prof.get("modules_imported", [])[:6]:
        lines.append(f"    import {name[:-len('(<module>)')]:<43}{seconds:7.3f} s (profiled)")
    return "\n".join(lines)


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return None


def _cell(res):
    if not res.get("ok"):
        return "n/a" if "error" in res else "FAIL"
    frac = res.get("fraction_of_ceiling")
    return f"{res['seconds'] * 1e3:8.3f} ms {frac * 100:5.1f}%"


def _ratio(mine, peer):
    """ninefold time over the peer's time (below 1: ninefold is faster)."""
    if mine.get("seconds") and peer.get("seconds"):
        return f"{mine['seconds'] / peer['seconds']:>8.2f}x"
    return f"{'-':>9}"


def table(workloads, ceilings):
    """A short text table: time and fraction of the ceiling per implementation."""
    rates = ", ".join(
        f"{k.replace('torch.', '')} {v / 1e12:.0f} TFLOP/s"
        if v > 1e12
        else f"{k.replace('torch.', '')} {v / 1e9:.0f} GFLOP/s"
        for k, v in ceilings["mm_flops_per_s"].items()
    )
    lines = [
        f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s; torch.mm {rates}",
        f"{'workload':<22}{'dtype':<10}{'ninefold':>20}{'torch':>20}{'NineToothed':>20}{'nf/torch':>9}{'1st call':>10}{'cached':>9}{'NT 1st':>9}{'nf us/call':>11}{'NT us/call':>11}{'nf/copy@size':>13}{'torch/copy@size':>16}",
    ]
    for w in workloads:
        nf = w.results.get("ninefold", {})
        first = nf.get("first_call_s")
        nt_first = w.results.get("ninetoothed", {}).get("first_call_s")
        cached = nf.get("cached_first_call_s")
        lines.append(
            f"{w.name + '/' + w.group:<22}{str(w.dtype).replace('torch.', ''):<10}"
            + "".join(f"{_cell(w.results.get(i, {})):>20}" for i in ("ninefold", "torch", "ninetoothed"))
            + _ratio(nf, w.results.get("torch", {}))
            + (f"{first:>9.2f}s" if isinstance(first, float) else f"{'-':>10}")
            + (f"{cached:>8.2f}s" if isinstance(cached, float) else f"{'-':>9}")
            + (f"{nt_first:>8.2f}s" if isinstance(nt_first, float) else f"{'-':>9}")
            + "".join(
                f"{w.results.get(i, {})['call_wall_s'] * 1e6:>11.1f}" if w.results.get(i, {}).get("call_wall_s") else f"{'-':>11}"
                for i in ("ninefold", "ninetoothed")
            )
            + "".join(
                f"{w.results.get(i, {})['fraction_of_copy_same'] * 100:>{width}.1f}%"
                if w.results.get(i, {}).get("fraction_of_copy_same") else f"{'-':>{width + 1}}"
                for i, width in (("ninefold", 12), ("torch", 15))
            )
        )
    for w in workloads:
        for impl, res in w.results.items():
            if "error" in res or not res.get("ok", True):
                why = res.get("error") or f"relative error {res.get('rel_error'):.3g}"
                lines.append(f"  {w.key} {impl}: {why}")
    return "\n".join(lines)


def plot(workloads, path, device_name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ("ninefold", "torch", "ninetoothed")
    labels = [f"{w.name}\n{w.group} {str(w.dtype).replace('torch.', '')}" for w in workloads]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(workloads)), 4.5))
    width = 0.27
    for i, impl in enumerate(impls):
        values = [w.results.get(impl, {}).get("fraction_of_ceiling") or 0.0 for w in workloads]
        ax.bar([x + (i - 1) * width for x in range(len(workloads))], values, width, label=impl)
    for i, impl in enumerate(impls[:2]):  # memory-bound rows: the same-bytes copy as the ceiling
        points = [(x + (i - 1) * width, w.results.get(impl, {}).get("fraction_of_copy_same")) for x, w in enumerate(workloads)]
        points = [(x, y) for x, y in points if y]
        if points:
            ax.scatter(*zip(*points), marker="_", s=120, color="black", zorder=3,
                       label="of a same-bytes copy" if i == 0 else None)
    ax.set_xticks(range(len(workloads)), labels, fontsize=7)
    ax.set_ylabel("fraction of measured ceiling")
    ax.set_title(f"DSL kernels on {device_name} (2 GiB copy bandwidth or torch.mm rate = 1)")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax.set_ylim(0, 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- focused sweeps
SWEEP_DEVICE = "cuda"  # tests run the sweeps' code on cpu tensors under TRITON_INTERPRET=1
MM_SWEEP = (  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, "persistent"]
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (256, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 4, 5),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 32, 8, 4),
    (64, 256, 64, 4, 4),
    (128, 128, 32, 4, 4),
    (128, 256, 64, 8, 3, "persistent"),
    (128, 128, 64, 8, 3, "persistent"),
    (128, 128, 64, 4, 4, "persistent"),
)
SDPA_SWEEP = (  # BLOCK_M, BLOCK_N, num_warps, num_stages[, "persistent"]: the ops kernel with pointer loads
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
    (128, 128, 4, 3),
    (64, 64, 4, 2),
    (128, 128, 8, 3, "persistent"),
)


def _fixed(arrangement, application, tensors, warps, stages, *flags):
    import ninefold.dsl as nd

    kernel = nd.make(arrangement, application, tensors, num_warps=warps, num_stages=stages)
    kernel.persistent = "persistent" in flags
    kernel.tma = "rows" if "rows" in flags else "tma" in flags
    kernel.grouped = "row-major" not in flags
    kernel.hoist = "hoist" in flags
    kernel.warp_specialize = "ws" in flags
    return kernel


PROGRESS_LINES = True


def _sweep_row(label, fn, reference, dtype, flops, ceiling):
    row = {"config": label}
    try:
        start = time.perf_counter()
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - start  # compile (and tune) included
        out = fn()  # the warm call (cached launcher) is the one checked
        row["rel_error"] = relative_error(out, reference)
        row["ok"] = row["rel_error"] <= TOLERANCE[dtype]
        if row["ok"]:
            row["seconds"] = _gpu_time(fn)
            row["tflops"] = flops / row["seconds"] / 1e12
            if ceiling:
                row["fraction_of_cublas"] = flops / row["seconds"] / ceiling
    except Exception as error:  # a config that does not compile or fit is a row, not a crash
        row["error"] = f"{type(error).__name__}: {error}"[:300]
        row["ok"] = False
    if PROGRESS_LINES:  # each row as soon as it is measured (a run cut short keeps what it had)
        print("  ." + _row_line(row)[1:], flush=True)
    return row


def sweep_mm(shrink=1):
    """mm at 4096^3 fp16 and 8192^3 bf16: ninefold's tuner, every MM_SWEEP config, a plain Triton kernel."""
    results = []
    for size, dtype in ((4096 // shrink, torch.float16), (8192 // shrink, torch.bfloat16)):
        rows = _sweep_mm_shape(size, dtype)
        results.append({"workload": f"mm {size}^3 {str(dtype).replace('torch.', '')}", "rows": rows})
        if SWEEP_DEVICE == "cuda":
            torch.cuda.empty_cache()
    return results


def _sweep_mm_shape(size, dtype):
    from ninefold.dsl import Tensor
    from ninefold.ops.kernels import mm

    torch.manual_seed(0)
    a, b = _randn((size, size), dtype, SWEEP_DEVICE), _randn((size, size), dtype, SWEEP_DEVICE)
    reference = torch.mm(a, b)
    flops = 2.0 * size**3
    ceiling = flops / _gpu_time(lambda: torch.mm(a, b))
    rows = [_sweep_row("tuned (mm.mm)", lambda: mm.mm(a, b), reference, dtype, flops, ceiling)]
    for attempt in range(1, TUNE_REPEATS + 1):  # is the tuner's pick stable? (fresh tuning caches)
        label = f"re-tuned #{attempt}"
        rows.append(_sweep_row(label, lambda: _retuned(mm.mm_kernel, lambda: mm.mm(a, b)), reference, dtype, flops, ceiling))
        rows[-1]["picked"] = _picked(mm.mm_kernel)
    for bm, bn, bk, w, st, *flags in tqdm(MM_SWEEP, desc=f"mm {size} {dtype}", file=sys.stderr):
        kernel = _fixed(mm.arrangement, mm.application, (Tensor(2), Tensor(2), Tensor(2)), w, st, *flags)
        c = torch.empty((size, size), dtype=dtype, device=SWEEP_DEVICE)

        def call(kernel=kernel, c=c, bm=bm, bn=bn, bk=bk):
            kernel(a, b, c, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            return c

        label = " ".join([f"{bm}x{bn}x{bk} w{w} s{st}", *flags])
        rows.append(_sweep_row(label, call, reference, dtype, flops, ceiling))
    plain_configs = ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3))
    for bm, bn, bk, w, st in plain_configs if size % 256 == 0 else ():

        def plain(bm=bm, bn=bn, bk=bk, w=w, st=st):
            return _plain_matmul(a, b, bm, bn, bk, w, st)

        rows.append(_sweep_row(f"plain triton {bm}x{bn}x{bk} w{w} s{st}", plain, reference, dtype, flops, ceiling))
    return rows


TUNE_REPEATS = 3


def _retuned(kernel, call):
    """``call()`` after forgetting every tuning result of ``kernel`` (memory and disk)."""
    from ninefold.dsl import tuning

    state = kernel.__dict__.setdefault("_sweep_retuned", {})
    if not state.get("done"):  # once per row: the row's timed calls reuse the new choice
        previous = os.environ.get("NINEFOLD_CACHE_DIR")
        os.environ["NINEFOLD_CACHE_DIR"] = tempfile.mkdtemp(prefix="nf-retune-")
        try:
            tuning._MEMO.clear()
            kernel._cache.clear()
            kernel._launchers.clear()
            state["done"] = True
            return call()
        finally:
            if previous is None:
                os.environ.pop("NINEFOLD_CACHE_DIR", None)
            else:
                os.environ["NINEFOLD_CACHE_DIR"] = previous
    return call()


def _picked(kernel):
    """The configuration(s) ``kernel`` chose (from its per-call config cache); resets the re-tune flag."""
    kernel.__dict__.pop("_sweep_retuned", None)
    configs = [v for k, v in kernel._cache.items() if isinstance(k, tuple) and k and k[0] == "config"]
    return configs


def sweep_sdpa(shrink=1):
    """sdpa: causal B4 H32 S4096 D128 bf16 and the paper's B4 H48 S1024 D64 fp16, every SDPA_SWEEP config."""
    results = []
    for b, h, s, d, dtype, causal in (
        (4, 32, 4096 // shrink, 128, torch.bfloat16, True),
        (4, 48, 1024 // shrink, 64, torch.float16, False),
    ):
        rows = _sweep_sdpa_shape(b, h, s, d, dtype, causal)
        label = f"sdpa{' causal' if causal else ''} B{b} H{h} S{s} D{d} {str(dtype).replace('torch.', '')}"
        results.append({"workload": label, "rows": rows})
        if SWEEP_DEVICE == "cuda":
            torch.cuda.empty_cache()
    return results


def _sdpa_float64(q, k, v, causal):
    """Attention in float64 on the inputs' device, one batch entry at a time (the sweep's reference)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i in range(q.shape[0]):
        out[i] = sdpa(q[i : i + 1].double(), k[i : i + 1].double(), v[i : i + 1].double(), is_causal=causal)[0]
    return out


def _torch_sdpa_rows(q, k, v, causal, reference, dtype, flops):
    """torch SDPA as dispatched, then each fused backend forced (flash, efficient, cuDNN)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    choice = None
    if hasattr(torch, "_fused_sdp_choice"):
        try:
            choice = SDPBackend(int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))).name
        except Exception as error:  # private API: report, do not fail
            choice = f"unknown ({type(error).__name__})"
    rows = [_sweep_row(f"torch sdpa (dispatch: {choice})", lambda: sdpa(q, k, v, is_causal=causal), reference, dtype, flops, None)]
    rows[-1]["backend"] = choice
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):

        def forced(backend=backend):
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, is_causal=causal)

        rows.append(_sweep_row(f"torch sdpa {backend.name.lower()}", forced, reference, dtype, flops, None))
    return rows


def _attention_loads_first(q, k, v, scale, is_causal, o):
    """The ops kernel's application with each key and value tile read at the top of its iteration
    (as hand-written kernels do: one barrier for both TMA copies)."""
    q_scaled = (q * (scale * 1.4426950408889634)).to(q.dtype)
    shift = k.source.shape[-2] - q.source.shape[-2]
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    n_tiles = k.shape[0]
    n_full = k.source.shape[-2] // k[0].shape[0]
    if is_causal:
        n_tiles = nl.minimum(n_tiles, nl.cdiv(nl.max(q.offsets(-2)) + shift + 1, k[0].shape[0]))
        n_full = nl.minimum(n_full, (nl.min(q.offsets(-2)) + shift + 1) // k[0].shape[0])
    for j in range(n_full):
        key = k[j]
        value = v[j]
        scores = nl.dot(q_scaled, nl.trans(key))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), value)
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
    for j in range(n_full, n_tiles):
        key = k[j]
        value = v[j]
        scores = nl.dot(q_scaled, nl.trans(key))
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), value)
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
    o = acc / row_sum[:, None]  # noqa: F841


def _attention_pipelined(q, k, v, scale, is_causal, o):
    """Attention whose loop computes the next key tile's scores before this tile's softmax (the
    software-pipelined form FlashAttention-3 uses inside a warpgroup); the last tile is peeled."""
    q_scaled = (q * (scale * 1.4426950408889634)).to(q.dtype)
    shift = k.source.shape[-2] - q.source.shape[-2]
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    n_tiles = k.shape[0]
    n_full = k.source.shape[-2] // k[0].shape[0]
    if is_causal:
        n_tiles = nl.minimum(n_tiles, nl.cdiv(nl.max(q.offsets(-2)) + shift + 1, k[0].shape[0]))
        n_full = nl.minimum(n_full, (nl.min(q.offsets(-2)) + shift + 1) // k[0].shape[0])
    n_full = nl.minimum(n_full, n_tiles - 1)  # the last tile always goes through the peeled, masked step
    scores = nl.dot(q_scaled, nl.trans(k[0]))
    for j in range(n_full):
        following = nl.dot(q_scaled, nl.trans(k[j + 1]))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
        scores = following
    for j in range(n_full, n_tiles - 1):
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        following = nl.dot(q_scaled, nl.trans(k[j + 1]))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
        scores = following
    for j in range(n_tiles - 1, n_tiles):  # the last tile (one iteration; a loop keeps j uniform on the cpu backend)
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
    o = acc / row_sum[:, None]  # noqa: F841


def _attention_one_loop(q, k, v, scale, is_causal, o):
    """Attention in one loop over the key tiles, every tile masked: the form Triton's sm_90
    warp-specialization pass accepts (one loop with a ``dot`` per kernel; ``Kernel.warp_specialize``)."""
    q_scaled = (q * (scale * 1.4426950408889634)).to(q.dtype)
    shift = k.source.shape[-2] - q.source.shape[-2]
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    n_tiles = k.shape[0]
    if is_causal:
        n_tiles = nl.minimum(n_tiles, nl.cdiv(nl.max(q.offsets(-2)) + shift + 1, k[0].shape[0]))
    for j in range(n_tiles):
        key = k[j]
        value = v[j]
        scores = nl.dot(q_scaled, nl.trans(key))
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        new_max = nl.maximum(row_max, nl.max(scores, 1))
        p = nl.exp2(scores - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q_scaled.dtype), value)
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
    o = acc / row_sum[:, None]  # noqa: F841


def _lpt_arrangement(q, k, v, scale, is_causal, o, BLOCK_M=None, BLOCK_N=None):
    """The ops kernel's arrangement with the query-block level outermost: programs walk the blocks
    with the most keys first over all heads (longest-processing-time order), heads inner."""
    from ninefold.ops.kernels import attention

    blocks = {"BLOCK_M": BLOCK_M or attention.BLOCK_M, "BLOCK_N": BLOCK_N or attention.BLOCK_N}
    arranged = attention.arrangement(q, k, v, scale, is_causal, o, **blocks)
    return tuple(t.permute((2, 0, 1, 3)) if t.ndim == 4 else t for t in arranged)


def _sweep_sdpa_shape(b, h, s, d, dtype, causal):
    from ninefold.ops.kernels import attention

    torch.manual_seed(0)
    q, k, v = (_randn((b, h, s, d), dtype, SWEEP_DEVICE) for _ in range(3))
    reference = _sdpa_float64(q, k, v, causal)  # every row is checked against float64 first
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    rows = _torch_sdpa_rows(q, k, v, causal, reference, dtype, flops)
    torch_s = rows[0].get("seconds")
    ceiling = flops / torch_s if torch_s else None  # fractions here are of torch SDPA's rate (as dispatched)
    for row in rows:
        if row.get("seconds") and ceiling:
            row["fraction_of_cublas"] = flops / row["seconds"] / ceiling

    def tuned():
        return attention.scaled_dot_product_attention(q, k, v, is_causal=causal)

    rows.append(_sweep_row("tuned", tuned, reference, dtype, flops, ceiling))
    rows[-1]["picked"] = _picked(attention.kernel)
    scale = 1.0 / math.sqrt(d)

    def dsl_rows(configs, arrangement=attention.arrangement, application=attention.application, prefix=""):
        for bm, bn, w, st, *flags in tqdm(configs, desc=f"sdpa S{s} D{d} {prefix}", file=sys.stderr):
            kernel = _fixed(arrangement, application, attention.tensors(), w, st, *flags)
            o = torch.empty_like(q)

            def call(kernel=kernel, o=o, bm=bm, bn=bn):
                kernel(q, k, v, scale, causal, o, BLOCK_M=bm, BLOCK_N=bn)
                return o

            label = " ".join([prefix, f"{bm}x{bn} w{w} s{st}", *flags]).strip()
            rows.append(_sweep_row(label, call, reference, dtype, flops, ceiling))

    dsl_rows(SDPA_SWEEP)
    if causal and s % 128 == 0 and SWEEP_DEVICE == "cuda":  # what hand-written Triton reaches here
        for mode, bm, bn, w, st in PLAIN_SDPA:
            def plain(mode=mode, bm=bm, bn=bn, w=w, st=st):
                return _plain_attention(q, k, v, mode, bm, bn, w, st)

            rows.append(_sweep_row(f"plain triton {mode} {bm}x{bn} w{w} s{st}", plain, reference, dtype, flops, ceiling))
        for bm, bn, w, st, flags in tqdm(FA_VARIANTS, desc="hand-written FA tricks", file=sys.stderr):
            def fa(bm=bm, bn=bn, w=w, st=st, flags=flags):
                return _fa_attention_call(q, k, v, bm, bn, w, st, flags)

            rows.append(_sweep_row(" ".join(["triton tma", f"{bm}x{bn} w{w} s{st}", *flags]), fa, reference, dtype, flops, ceiling))
        rows += _ws_rows(q, k, v, reference, dtype, flops, ceiling)
    # the DSL: three applications x launch order (grouped / row-major) x loads (pointers / TMA rows)
    for name, application in (("ops", attention.application), ("loads-first", _attention_loads_first),
                              ("pipelined", _attention_pipelined)):
        tiles = SDPA_VARIANT_TILES if causal else SDPA_VARIANT_TILES_PAPER
        configs = [(*tile, *flags) for flags in SDPA_VARIANT_FLAGS for tile in tiles
                   if (flags or name != "ops") and ("hoist" not in flags or name != "loads-first")]
        dsl_rows(configs, application=application, prefix=f"dsl {name}")
    if SWEEP_DEVICE == "cuda":
        rows.append(_tuned_without_tma(attention.kernel, tuned, reference, dtype, flops, ceiling))
    return rows


SDPA_VARIANT_TILES = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3))
SDPA_VARIANT_TILES_PAPER = ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 4, 3))
SDPA_VARIANT_FLAGS = ((), ("row-major",), ("rows",), ("rows", "row-major"), ("rows", "hoist"), ("rows", "hoist", "row-major"))


def _tuned_without_tma(kernel, call, reference, dtype, flops, ceiling):
    """The tuner re-run on a fresh cache without its TMA candidates (``NINEFOLD_DSL_TUNE_TMA=0``)."""
    previous = os.environ.get("NINEFOLD_DSL_TUNE_TMA")
    os.environ["NINEFOLD_DSL_TUNE_TMA"] = "0"
    try:
        row = _sweep_row("re-tuned without TMA candidates", lambda: _retuned(kernel, call), reference, dtype, flops, ceiling)
        row["picked"] = _picked(kernel)
    finally:
        if previous is None:
            os.environ.pop("NINEFOLD_DSL_TUNE_TMA", None)
        else:
            os.environ["NINEFOLD_DSL_TUNE_TMA"] = previous
    return row


PLAIN_SDPA = (  # load mode (pointers, or TMA through host descriptors), BLOCK_M, BLOCK_N, warps, stages
    ("pointers", 128, 128, 8, 3),
    ("tma", 128, 128, 8, 3),
    ("tma", 128, 64, 8, 4),
)


def _plain_attention(q, k, v, mode, bm, bn, warps, stages):
    """Causal attention by a hand-written Triton kernel (contiguous [B, H, S, D], S % BLOCK_M == 0)."""
    b, h, s, d = q.shape
    o = torch.empty_like(q)
    grid = (s // bm, b * h)
    scale = 1.0 / math.sqrt(d)
    if mode == "pointers":
        _ref_attention_ptr[grid](q, k, v, o, s, scale, BM=bm, BN=bn, D=d, num_warps=warps, num_stages=stages)
        return o
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = [TensorDescriptor(t.view(-1, d), [b * h * s, d], [d, 1], [rows, d]) for t, rows in ((q, bm), (k, bn), (v, bn))]
    _ref_attention_tma[grid](*descs, o, s, scale, BM=bm, BN=bn, D=d, num_warps=warps, num_stages=stages)
    return o


def sweep_memory(shrink=1):
    """The memory-bound kernels at the paper shapes (fp16): fixed block sizes and warps, the tuned
    call, torch, and a device copy of the same bytes (fractions here are of that copy's rate)."""
    from ninefold.dsl import Tensor
    from ninefold.ops.kernels import activation, add, rms_norm, rope, softmax

    h, n = torch.float16, 4096 // shrink
    results = []
    flat3, flat2 = tuple(Tensor(1) for _ in range(3)), (Tensor(1), Tensor(1))
    for name, w in (("add", _elementwise("add", "paper", h, n, 4096, 2)), ("silu", _elementwise("silu", "paper", h, n, 4096, 2)),
                    ("rms_norm", _elementwise("rms_norm", "paper", h, n, 4096, 2)),
                    ("softmax", _elementwise("softmax", "paper", h, n, 4096, 2))):
        torch.manual_seed(0)
        inputs = w.make(SWEEP_DEVICE)
        reference = w.torch(*inputs)
        fixed = []
        if name in ("add", "silu"):
            arrangement, application, tensors = (
                (add.arrangement_flat, add.application, flat3) if name == "add"
                else (activation.arrangement_silu_flat, activation.application_silu, flat2)
            )
            for block in (1024, 2048, 4096, 8192):
                for warps in (4, 8):
                    fixed.append((f"BLOCK {block} w{warps}", _fixed(arrangement, application, tensors, warps, 1), {"BLOCK": block}))
            for block in (2048, 4096, 8192):
                kernel = _fixed(arrangement, application, tensors, 4, 1)
                kernel.cache_hints = STREAMING
                fixed.append((f"BLOCK {block} w4 evict_first/.cs", kernel, {"BLOCK": block}))
        else:
            module = rms_norm if name == "rms_norm" else softmax
            tensors = (Tensor(2), Tensor(1), Tensor(0), Tensor(2)) if name == "rms_norm" else (Tensor(2, other=float("-inf")), Tensor(2))
            for warps in (2, 4, 8, 16):
                fixed.append((f"row w{warps}", _fixed(module.arrangement, module.application, tensors, warps, 1), {}))
            for warps in (4, 8):
                kernel = _fixed(module.arrangement, module.application, tensors, warps, 1)
                kernel.cache_hints = STREAMING
                fixed.append((f"row w{warps} evict_first/.cs", kernel, {}))
            arrangement, application = MULTI_ROW[name]
            for rows_per_program, warps in ((2, 4), (2, 8), (4, 8), (4, 16), (8, 8), (8, 16)):
                kernel = _fixed(arrangement, application, tensors, warps, 1)
                fixed.append((f"{rows_per_program} rows w{warps}", kernel, {"ROWS": rows_per_program}))
        results.append(_memory_rows(w, name, inputs, reference, fixed))
    t = n
    x = _randn((t, 48, 64), h, SWEEP_DEVICE)
    cos, sin = _rope_tables(t, 32, h, SWEEP_DEVICE)
    w = Workload("rope", "paper", h, f"({t},48,64)", None, lambda k, x, c, s: k.rope.rotate(x, c, s), _rope_torch,
                 bytes=2 * x.numel() * 2 + 2 * t * 32 * 2)
    fixed = []
    for bt, bh in ((1, 16), (2, 16), (4, 16), (8, 16)):
        for warps in (4, 8):
            kernel = _fixed(rope.arrangement, rope.application, rope._tensors, warps, 1)
            fixed.append((f"T{bt} H{bh} w{warps}", kernel, {"BLOCK_T": bt, "BLOCK_H": bh, "HALF": 32}))
    results.append(_memory_rows(w, "rope", (x, cos, sin), _rope_torch(x, cos, sin), fixed))
    return results


_ROWS = Symbol("ROWS", constexpr=True)
_ROW = Symbol("ROW", constexpr=True)


def _rms_norm_rows(x, w, eps, y, ROWS=_ROWS, ROW=_ROW):
    """rms_norm with ``ROWS`` rows per program (a sweep candidate)."""
    x_rows = x.tile((ROWS, ROW))
    weight = w.tile((ROW,)).unsqueeze(0).expand((x_rows.shape[0], -1))
    return x_rows, weight, eps, y.tile((ROWS, ROW))


def _rms_norm_rows_app(x, w, eps, y):
    v = x
    v = v.to(nl.float32)
    inv_rms = nl.rsqrt(nl.sum(v * v, 1) / x.source.shape[-1] + eps)
    y = v * inv_rms[:, None] * w  # noqa: F841


def _softmax_rows(x, y, ROWS=_ROWS, ROW=_ROW):
    """softmax with ``ROWS`` rows per program (a sweep candidate)."""
    return x.tile((ROWS, ROW)), y.tile((ROWS, ROW))


def _softmax_rows_app(x, y):
    v = x
    v = v.to(nl.float32)
    e = nl.exp(v - nl.max(v, 1)[:, None])
    y = e / nl.sum(e, 1)[:, None]  # noqa: F841


STREAMING = {"load": "evict_first", "store": ".cs"}  # data read once, written once
MULTI_ROW = {"rms_norm": (_rms_norm_rows, _rms_norm_rows_app), "softmax": (_softmax_rows, _softmax_rows_app)}


def _memory_rows(w, name, inputs, reference, fixed):
    copy_s = copy_same_bytes(w, SWEEP_DEVICE) if SWEEP_DEVICE == "cuda" else None
    ceiling = w.bytes / copy_s if copy_s else 1.0  # bytes per second of the same-size copy
    rows = [{"config": "copy of the same bytes", "ok": True, "seconds": copy_s}] if copy_s else []
    rows.append(_sweep_row("torch", lambda: w.torch(*inputs), reference, w.dtype, w.bytes, ceiling))
    namespace = ninefold_kernels()
    rows.append(_sweep_row("tuned", lambda: w.run(namespace, *inputs), reference, w.dtype, w.bytes, ceiling))
    rows[-1]["picked"] = _picked(_tuned_kernel(name))
    for label, kernel, blocks in tqdm(fixed, desc=f"{name} paper", file=sys.stderr):
        rows.append(_sweep_row(label, _fixed_call(name, kernel, inputs, blocks), reference, w.dtype, w.bytes, ceiling))
    for row in rows:
        if row.get("seconds") and copy_s:
            row["fraction_of_copy_same"] = copy_s / row["seconds"]
    return {"workload": f"{name} {w.shape} float16 (of a same-bytes copy)", "rows": rows}


def _tuned_kernel(name):
    """The module-level kernel that the public function of workload ``name`` calls at the paper shape."""
    from ninefold.ops.kernels import activation, add, rms_norm, rope, softmax

    return {"add": add.kernel_flat, "silu": activation.silu_flat_kernel, "rms_norm": rms_norm.kernel,
            "softmax": softmax.kernel, "rope": rope.neox_kernel}[name]


def _fixed_call(name, kernel, inputs, blocks):
    """A call of ``kernel`` (fixed warps) on ``inputs`` with the workload's argument layout."""
    out = torch.empty_like(inputs[0])
    if name == "add":
        x, y = inputs
        return lambda: (kernel(x.view(-1), y.view(-1), out.view(-1), **blocks), out)[1]
    if name == "silu":
        return lambda: (kernel(inputs[0].view(-1), out.view(-1), **blocks), out)[1]
    if name == "rms_norm":
        x, weight = inputs
        return lambda: (kernel(x, weight, 1e-6, out, ROW=x.shape[-1], **blocks), out)[1]
    if name == "softmax":
        return lambda: (kernel(inputs[0], out, ROW=inputs[0].shape[-1], **blocks), out)[1]
    x, cos, sin = inputs
    return lambda: (kernel(x[..., :64], cos, sin, out[..., :64], **blocks), out)[1]


def _plain_matmul(a, b, bm, bn, bk, warps, stages):
    """A hand-written Triton matmul (pointer increments, grouped order): what Triton itself reaches."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _plain_matmul_kernel[grid](
        a, b, c, m, n, k, a.stride(0), b.stride(0), c.stride(0), bm, bn, bk, num_warps=warps, num_stages=stages
    )
    return c


try:
    import triton
    import triton.language as tl
except ImportError:  # the --cpu benchmark runs without Triton
    triton = None
else:

    @triton.jit
    def _plain_matmul_kernel(a, b, c, m, n, k, lda, ldb, ldc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # contiguous rows, sizes multiples of the blocks (the sweep's shapes): no masks
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(n, BN)
        per_group = 8 * tiles_n
        first = (pid // per_group) * 8
        rows_in_group = tl.minimum(tl.cdiv(m, BM) - first, 8)
        tile_m = first + (pid % per_group) % rows_in_group
        tile_n = (pid % per_group) // rows_in_group
        rm = tile_m * BM + tl.arange(0, BM)
        rn = tile_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        pa = a + rm[:, None] * lda + rk[None, :]
        pb = b + rk[:, None] * ldb + rn[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, tl.cdiv(k, BK)):
            acc = tl.dot(tl.load(pa), tl.load(pb), acc)
            pa += BK
            pb += BK * ldb
        tl.store(c + rm[:, None] * ldc + rn[None, :], acc.to(c.dtype.element_ty))

    @triton.jit
    def _ref_attention_update(q, k, v, acc, m_i, l_i, keep, MASK: tl.constexpr):
        s = tl.dot(q, tl.trans(k))
        if MASK:
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, m_new, l_i * alpha + tl.sum(p, 1)


    @triton.jit
    def _ref_attention_ptr(q_ptr, k_ptr, v_ptr, o_ptr, seq, scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        # causal, contiguous [B, H, S, D], S a multiple of BM; query blocks with the most keys first
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        base = tl.program_id(1).to(tl.int64) * seq * D
        rows = block * BM + tl.arange(0, BM)
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + base + rows[:, None] * D + cols[None, :])
        q = (q * (scale * 1.4426950408889634)).to(q.dtype)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        for start in range(0, block * BM, BN):
            keys = start + tl.arange(0, BN)
            k = tl.load(k_ptr + base + keys[:, None] * D + cols[None, :])
            v = tl.load(v_ptr + base + keys[:, None] * D + cols[None, :])
            acc, m_i, l_i = _ref_attention_update(q, k, v, acc, m_i, l_i, None, False)
        for start in range(block * BM, (block + 1) * BM, BN):
            keys = start + tl.arange(0, BN)
            k = tl.load(k_ptr + base + keys[:, None] * D + cols[None, :])
            v = tl.load(v_ptr + base + keys[:, None] * D + cols[None, :])
            keep = keys[None, :] <= rows[:, None]
            acc, m_i, l_i = _ref_attention_update(q, k, v, acc, m_i, l_i, keep, True)
        tl.store(o_ptr + base + rows[:, None] * D + cols[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


    @triton.jit
    def _ref_attention_tma(q_desc, k_desc, v_desc, o_ptr, seq, scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        # the same with K/V (and Q) read through host-built TMA descriptors of the [B*H*S, D] views.
        # (tl.range(..., warp_specialize=True) around the first loop changes nothing on sm_90 with
        # 8 warps and fails in Triton 3.6/3.9's NVGPUWarpSpecialization pass with 4.)
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        first = tl.program_id(1) * seq
        rows = block * BM + tl.arange(0, BM)
        q = q_desc.load([first + block * BM, 0])
        q = (q * (scale * 1.4426950408889634)).to(q.dtype)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        for start in range(0, block * BM, BN):
            k = k_desc.load([first + start, 0])
            v = v_desc.load([first + start, 0])
            acc, m_i, l_i = _ref_attention_update(q, k, v, acc, m_i, l_i, None, False)
        for start in range(block * BM, (block + 1) * BM, BN):
            keys = start + tl.arange(0, BN)
            k = k_desc.load([first + start, 0])
            v = v_desc.load([first + start, 0])
            keep = keys[None, :] <= rows[:, None]
            acc, m_i, l_i = _ref_attention_update(q, k, v, acc, m_i, l_i, keep, True)
        out = o_ptr + (first + rows).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
        tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))

    @triton.jit
    def _fa_softmax_step(s, v, acc, m_i, l_i, LAZY: tl.constexpr):
        # one online-softmax step on scores s (base 2, already scaled); LAZY keeps a stale row max
        # (and skips the rescale of acc) until some row's max grows by more than 2**8
        m_cur = tl.max(s, 1)
        if LAZY:
            if tl.max(m_cur - m_i) > 8.0:
                m_new = tl.maximum(m_i, m_cur)
                alpha = tl.math.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.math.exp2(s - m_i[:, None])
        else:
            m_new = tl.maximum(m_i, m_cur)
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, m_i, l_i + tl.sum(p, 1)

    @triton.jit
    def _fa_tile(q_desc, k_desc, v_desc, o_ptr, first, block, m_i, l_i, acc, scale,
                 BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PIPE: tl.constexpr, LAZY: tl.constexpr):
        rows = block * BM + tl.arange(0, BM)
        q = q_desc.load([first + block * BM, 0])
        q = (q * (scale * 1.4426950408889634)).to(q.dtype)
        n_full = block * (BM // BN)
        if PIPE:  # the next tile's q k^T is issued before this tile's softmax (FA3's intra-warpgroup overlap)
            s = tl.dot(q, tl.trans(k_desc.load([first, 0])))
            for j in range(0, n_full):
                s_next = tl.dot(q, tl.trans(k_desc.load([first + (j + 1) * BN, 0])))
                acc, m_i, l_i = _fa_softmax_step(s, v_desc.load([first + j * BN, 0]), acc, m_i, l_i, LAZY)
                s = s_next
            for i in tl.static_range(BM // BN):
                j = n_full + i
                if i > 0:
                    s = tl.dot(q, tl.trans(k_desc.load([first + j * BN, 0])))
                keys = j * BN + tl.arange(0, BN)
                s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
                acc, m_i, l_i = _fa_softmax_step(s, v_desc.load([first + j * BN, 0]), acc, m_i, l_i, LAZY)
        else:
            for j in range(0, n_full):
                s = tl.dot(q, tl.trans(k_desc.load([first + j * BN, 0])))
                acc, m_i, l_i = _fa_softmax_step(s, v_desc.load([first + j * BN, 0]), acc, m_i, l_i, LAZY)
            for i in tl.static_range(BM // BN):
                j = n_full + i
                s = tl.dot(q, tl.trans(k_desc.load([first + j * BN, 0])))
                keys = j * BN + tl.arange(0, BN)
                s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
                acc, m_i, l_i = _fa_softmax_step(s, v_desc.load([first + j * BN, 0]), acc, m_i, l_i, LAZY)
        out = o_ptr + (first + rows).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
        tl.store(out, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))

    @triton.jit
    def _fa_place(tile, n_blocks, heads, LPT: tl.constexpr):
        # (first row of the head in the [B*H*S, D] view / seq, query block) of a tile index: heads
        # in turn with their blocks longest-first (as _ref_attention_tma), or (LPT) block nb-1 of
        # every head, then nb-2, ... over all heads
        if LPT:
            return tile % heads, n_blocks - 1 - tile // heads
        return tile // n_blocks, n_blocks - 1 - tile % n_blocks

    @triton.jit
    def _fa_attention(q_desc, k_desc, v_desc, o_ptr, seq, heads, scale, BM: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr, PIPE: tl.constexpr, LAZY: tl.constexpr, PERSIST: tl.constexpr,
                      LPT: tl.constexpr):
        # causal, [B*H*S, D] descriptors, S % BM == 0; one 1-D grid (PERSIST: one program per SM
        # walking the tiles with a stride of the grid)
        n_blocks = seq // BM
        total = n_blocks * heads
        if PERSIST:
            for tile in range(tl.program_id(0), total, tl.num_programs(0)):
                head, block = _fa_place(tile, n_blocks, heads, LPT)
                _fa_tile(q_desc, k_desc, v_desc, o_ptr, head * seq, block, tl.full((BM,), float("-inf"), tl.float32),
                         tl.zeros((BM,), tl.float32), tl.zeros((BM, D), tl.float32), scale, BM, BN, D, PIPE, LAZY)
        else:
            head, block = _fa_place(tl.program_id(0), n_blocks, heads, LPT)
            _fa_tile(q_desc, k_desc, v_desc, o_ptr, head * seq, block, tl.full((BM,), float("-inf"), tl.float32),
                     tl.zeros((BM,), tl.float32), tl.zeros((BM, D), tl.float32), scale, BM, BN, D, PIPE, LAZY)


    @triton.jit
    def _ws_step(q, k, v, acc, m_i, l_i, keep, MASK: tl.constexpr):
        s = tl.dot(q, tl.trans(k))
        if MASK:
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _ws_attention(q_ptr, k_ptr, v_ptr, o_ptr, seq, total, scale, BM: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr, WS: tl.constexpr, ONE_LOOP: tl.constexpr):
        # causal, contiguous [B*H*S, D] rows, S % BM == 0, TMA descriptors made on the device. With
        # WS and 4 warps, sm_90's NVGPUWarpSpecialization pass (Triton 3.6 and 3.9) turns the key loop
        # into a producer warpgroup (TMA) and two consumer warpgroups that each take BM/2 query rows
        # (data partitioning: it splits device-made descriptors' tiles, not host-made ones). It takes one
        # warp-specialized loop per function, so ONE_LOOP masks every tile (two loops fail the pass).
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        first = tl.program_id(1) * seq
        q_desc = tl.make_tensor_descriptor(q_ptr, [total, D], [D, 1], [BM, D])
        k_desc = tl.make_tensor_descriptor(k_ptr, [total, D], [D, 1], [BN, D])
        v_desc = tl.make_tensor_descriptor(v_ptr, [total, D], [D, 1], [BN, D])
        o_desc = tl.make_tensor_descriptor(o_ptr, [total, D], [D, 1], [BM, D])
        rows = block * BM + tl.arange(0, BM)
        q = q_desc.load([first + block * BM, 0])
        q = (q * (scale * 1.4426950408889634)).to(q.dtype)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        if ONE_LOOP:
            for start in tl.range(0, (block + 1) * BM, BN, warp_specialize=WS):
                keys = start + tl.arange(0, BN)
                acc, m_i, l_i = _ws_step(q, k_desc.load([first + start, 0]), v_desc.load([first + start, 0]), acc,
                                         m_i, l_i, keys[None, :] <= rows[:, None], True)
        else:
            for start in tl.range(0, block * BM, BN, warp_specialize=WS):
                acc, m_i, l_i = _ws_step(q, k_desc.load([first + start, 0]), v_desc.load([first + start, 0]), acc,
                                         m_i, l_i, None, False)
            for start in tl.range(block * BM, (block + 1) * BM, BN, warp_specialize=WS):
                keys = start + tl.arange(0, BN)
                acc, m_i, l_i = _ws_step(q, k_desc.load([first + start, 0]), v_desc.load([first + start, 0]), acc,
                                         m_i, l_i, keys[None, :] <= rows[:, None], True)
        o_desc.store([first + block * BM, 0], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


FA_VARIANTS = (  # hand-written TMA attention with FlashAttention-3 tricks: BM, BN, warps, stages, flags
    (128, 128, 8, 3, ()),
    (128, 128, 8, 3, ("pipe",)),
    (128, 64, 8, 3, ("pipe",)),
    (128, 64, 8, 4, ("pipe",)),
    (128, 64, 8, 4, ()),
    (128, 128, 8, 3, ("lazy",)),
    (128, 128, 8, 3, ("persist",)),
    (64, 64, 4, 3, ()),
    (64, 64, 4, 3, ("pipe",)),
    (128, 128, 8, 3, ("lpt",)),  # run 1: longest-first over all heads loses L2 reuse of K/V
    (128, 128, 8, 3, ("pipe", "lpt")),
)


def _fa_attention_call(q, k, v, bm, bn, warps, stages, flags=()):
    """Causal attention by the hand-written FA-trick kernel (contiguous [B, H, S, D], S % bm == 0)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, s, d = q.shape
    if bm % bn or s % bm:
        raise ValueError(f"bn must divide bm and bm the sequence length, got bm={bm}, bn={bn}, S={s}")
    o = torch.empty_like(q)
    descs = [TensorDescriptor(t.view(-1, d), [b * h * s, d], [d, 1], [rows, d]) for t, rows in ((q, bm), (k, bn), (v, bn))]
    total = (s // bm) * b * h
    persist = "persist" in flags
    grid = (min(total, torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4),) if persist else (total,)
    _fa_attention[grid](
        *descs, o, s, b * h, 1.0 / math.sqrt(d), BM=bm, BN=bn, D=d, PIPE="pipe" in flags, LAZY="lazy" in flags,
        PERSIST=persist, LPT="lpt" in flags, num_warps=warps, num_stages=stages,
    )
    return o


WS_VARIANTS = (  # hand-written warp-specialized attention: BM, BN, warps, stages, flags
    (128, 128, 4, 2, ("ws",)),
    (128, 64, 4, 2, ("ws",)),
    (64, 64, 4, 2, ("ws",)),  # 64 rows: nothing to split, both consumer warpgroups compute the whole tile
    (256, 64, 4, 2, ("ws",)),  # two consumer warpgroups of 128 rows (FA3 gives each 64)
    (128, 128, 8, 2, ()),  # the same kernel without warp specialization
    (128, 64, 8, 3, ()),
    (64, 64, 4, 3, ()),
)
DSL_WS_SWEEP = (  # the DSL's one-loop attention: BM, BN, warps, stages, flags ("ws": Kernel.warp_specialize)
    (128, 128, 4, 2, "ws"),
    (128, 64, 4, 2, "ws"),
    (128, 128, 4, 2, "ws", "row-major"),
    (128, 64, 4, 2, "ws", "row-major"),
    # (run of session 5: 3-4 stages computed NaN, DSL and hand-written alike; the DSL now refuses them)
    (128, 128, 8, 3, "rows", "hoist"),  # the same application without warp specialization
    (64, 64, 4, 3, "rows", "hoist"),
)
_ALLOCATOR_SET = []


def _device_descriptor_scratch():
    """Triton needs an allocator for descriptors made on the device (``tl.make_tensor_descriptor``)."""
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=SWEEP_DEVICE))
        _ALLOCATOR_SET.append(True)


def _ws_attention_call(q, k, v, bm, bn, warps, stages, flags=(), info=None):
    """Causal attention by ``_ws_attention`` (contiguous [B, H, S, D], S % bm == 0). ``info``, a dict,
    receives what the compiler made of it: warps in all (12 = producer + two consumer warpgroups),
    registers and spills per thread."""
    b, h, s, d = q.shape
    if s % bm or bm % bn:
        raise ValueError(f"bn must divide bm and bm the sequence length, got bm={bm}, bn={bn}, S={s}")
    _device_descriptor_scratch()
    o = torch.empty_like(q)
    compiled = _ws_attention[(s // bm, b * h)](
        q, k, v, o, s, b * h * s, 1.0 / math.sqrt(d), BM=bm, BN=bn, D=d, WS="ws" in flags,
        ONE_LOOP="two-loops" not in flags, num_warps=warps, num_stages=stages,
    )
    if info is not None:
        info.update(_compiled_info(compiled))
    return o


def _compiled_info(compiled):
    """Warps, registers, spills and shared memory of a Triton ``CompiledKernel`` (what is known)."""
    info = {}
    metadata = getattr(compiled, "metadata", None)
    for key in ("num_warps", "shared"):
        if metadata is not None and hasattr(metadata, key):
            info[key] = getattr(metadata, key)
    for key in ("n_regs", "n_spills"):
        if getattr(compiled, key, None) is not None:
            info[key] = getattr(compiled, key)
    asm = getattr(compiled, "asm", {}) or {}
    if "ptx" in asm:
        info["setmaxnreg"] = asm["ptx"].count("setmaxnreg")
    return info


def _ws_rows(q, k, v, reference, dtype, flops, ceiling, variants=WS_VARIANTS):
    """Rows of the hand-written warp-specialized kernel; a variant that fails to compile is a row."""
    rows = []
    for bm, bn, w, st, flags in tqdm(variants, desc="warp-specialized attention", file=sys.stderr):
        info = {}

        def call(bm=bm, bn=bn, w=w, st=st, flags=flags, info=info):
            return _ws_attention_call(q, k, v, bm, bn, w, st, flags, info)

        label = " ".join(["triton device-tma", f"{bm}x{bn} w{w} s{st}", *flags])
        rows.append(_sweep_row(label, call, reference, dtype, flops, ceiling))
        rows[-1]["compiled"] = info
        if info:
            print(f"    compiled: {info}", flush=True)
    return rows


def sweep_sdpa_ws(shrink=1):
    """Causal B4 H32 S4096 D128 bf16 only: torch SDPA, session 4's best DSL row, the hand-written TMA
    kernel, then the warp-specialized rows (hand-written, and the DSL's)."""
    from ninefold.ops.kernels import attention

    b, h, s, d, dtype = 4, 32, 4096 // shrink, 128, torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (_randn((b, h, s, d), dtype, SWEEP_DEVICE) for _ in range(3))
    reference = _sdpa_float64(q, k, v, True)
    flops = 4.0 * b * h * s * s * d * 0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = [_sweep_row("torch sdpa (as dispatched)", lambda: sdpa(q, k, v, is_causal=True), reference, dtype, flops, None)]
    torch_s = rows[0].get("seconds")
    ceiling = flops / torch_s if torch_s else None
    if ceiling:
        rows[0]["fraction_of_cublas"] = 1.0
    scale = 1.0 / math.sqrt(d)

    def dsl_row(label, application, bm, bn, w, st, *flags):
        kernel = _fixed(attention.arrangement, application, attention.tensors(), w, st, *flags)
        o = torch.empty_like(q)

        def call():
            kernel(q, k, v, scale, True, o, BLOCK_M=bm, BLOCK_N=bn)
            return o

        rows.append(_sweep_row(label, call, reference, dtype, flops, ceiling))

    dsl_row("dsl pipelined 64x64 w4 s3 rows hoist (session 4 best)", _attention_pipelined, 64, 64, 4, 3, "rows", "hoist")
    for bm, bn, w, st, *flags in tqdm(DSL_WS_SWEEP, desc="dsl one-loop", file=sys.stderr):
        dsl_row(" ".join(["dsl one-loop", f"{bm}x{bn} w{w} s{st}", *flags]), _attention_one_loop, bm, bn, w, st, *flags)
    if SWEEP_DEVICE == "cuda" and s % 256 == 0:
        rows.append(_sweep_row("triton tma 128x128 w8 s3 (host descriptors)",
                               lambda: _plain_attention(q, k, v, "tma", 128, 128, 8, 3), reference, dtype, flops, ceiling))
        rows += _ws_rows(q, k, v, reference, dtype, flops, ceiling)
    # the tuner on the one-loop application: its candidates include the warp-specialized ones on sm_90
    import ninefold.dsl as nd

    tuned_kernel = nd.make(attention.arrangement, _attention_one_loop, attention.tensors())
    o_tuned = torch.empty_like(q)

    def tuned_one_loop():
        tuned_kernel(q, k, v, scale, True, o_tuned)
        return o_tuned

    previous = os.environ.get("NINEFOLD_DSL_TUNE_WS")
    os.environ["NINEFOLD_DSL_TUNE_WS"] = "1"  # opt-in candidates
    try:
        rows.append(_sweep_row("dsl one-loop tuned (with warp-specialized candidates)", tuned_one_loop, reference, dtype, flops, ceiling))
    finally:
        if previous is None:
            os.environ.pop("NINEFOLD_DSL_TUNE_WS", None)
        else:
            os.environ["NINEFOLD_DSL_TUNE_WS"] = previous
    rows[-1]["picked"] = _picked(tuned_kernel)
    for record in tuning_records().values():  # every candidate's device time (the sweep's own fresh cache)
        timed = sorted((t for t in record["timings"] if t.get("median_ms")), key=lambda t: t["median_ms"])
        rows[-1].setdefault("tuner", []).extend((_config_label(t["config"]), round(t["median_ms"] * 1e3, 1)) for t in timed)
        for t in timed:
            print(f"    tuner: {_config_label(t['config'])} {t['median_ms'] * 1e3:.1f} us", flush=True)
    return [{"workload": f"sdpa causal B{b} H{h} S{s} D{d} bfloat16: warp specialization", "rows": rows}]


def rms_norm_timers(shrink=1, repeats=3):
    """rms_norm at the paper shape (fp16 4096^2) timed several ways in one process, next to torch and
    a same-bytes copy: do_bench (the bench's timer: L2 flushed, host launch path included when it
    outlasts the flush), do_bench of a CUDA graph holding the same call (no host path), and the
    tuner's device-time sampler (launches queued behind a spin). Where do_bench alone is slower,
    the host's launch path, not the kernel, set the bench's figure."""
    from ninefold.dsl import timing
    from ninefold.ops.kernels import rms_norm

    n = 4096 // shrink
    x, w = _randn((n, 4096), torch.float16, SWEEP_DEVICE), _randn((4096,), torch.float16, SWEEP_DEVICE)
    y = torch.empty_like(x)
    reference = torch.nn.functional.rms_norm(x.double(), (4096,), w.double(), 1e-6)
    from ninefold.dsl import Tensor

    tensors = (Tensor(2), Tensor(1), Tensor(0), Tensor(2))
    fixed = {f"one row per program w{warps}": _fixed(rms_norm.arrangement, rms_norm.application, tensors, warps, 1) for warps in (4, 8)}
    src = torch.empty(2 * x.numel(), dtype=torch.uint8, device=SWEEP_DEVICE)  # half the bytes read, half written
    dst = torch.empty_like(src)
    calls = {
        "ninefold rms_norm (tuned)": lambda: rms_norm.rms_norm(x, w, 1e-6),
        **{label: (lambda k=k: (k(x, w, 1e-6, y, ROW=4096), y)[1]) for label, k in fixed.items()},
        "torch F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6),
        "copy of the same bytes": lambda: dst.copy_(src),
    }
    rows = []
    for label, fn in calls.items():
        row = {"config": label}
        try:
            out = fn()
            fn()
            if label != "copy of the same bytes":
                row["rel_error"] = relative_error(out, reference)
                row["ok"] = row["rel_error"] <= TOLERANCE[torch.float16]
                if not row["ok"]:
                    rows.append(row)
                    continue
            row["ok"] = True
            row["do_bench_s"] = [_gpu_time(fn) for _ in range(repeats)]
            row["host_s_per_call"] = _call_wall(fn, torch.cuda.synchronize if SWEEP_DEVICE == "cuda" else (lambda: None))
            if SWEEP_DEVICE == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                row["graph_do_bench_s"] = _gpu_time(graph.replay)
                samples = timing.sample([fn], SWEEP_DEVICE)[0]
                row["device_time_s"] = sorted(samples)[len(samples) // 2] * 1e-3
            row["seconds"] = min(row["do_bench_s"])
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            row["ok"] = False
        rows.append(row)
    return [{"workload": f"rms_norm {n}x4096 float16: timers", "rows": rows}]


def _timer_line(row):
    parts = [f"do_bench {' '.join(f'{t * 1e3:.4f}' for t in row['do_bench_s'])} ms"]
    if "graph_do_bench_s" in row:
        parts.append(f"graph {row['graph_do_bench_s'] * 1e3:.4f}")
    if "device_time_s" in row:
        parts.append(f"sampler {row['device_time_s'] * 1e3:.4f}")
    parts.append(f"host {row['host_s_per_call'] * 1e6:.1f} us/call")
    return f"  {row['config']:<52}" + ", ".join(parts)


def _row_line(row) -> str:
    """One sweep row as printed."""
    picked = f"  {row['picked']}" if row.get("picked") else ""
    if row.get("do_bench_s"):
        return _timer_line(row)
    if row.get("seconds") and "fraction_of_copy_same" in row:
        return f"  {row['config']:<52}{row['seconds'] * 1e3:9.4f} ms {row['fraction_of_copy_same'] * 100:6.1f}% of the copy{picked}"
    if row.get("seconds"):
        share = f"{row['fraction_of_cublas'] * 100:6.1f}%" if "fraction_of_cublas" in row else "     -"
        first = f"  first call {row['first_call_s']:.1f} s" if row.get("first_call_s", 0) > 1 else ""
        return f"  {row['config']:<52}{row['seconds'] * 1e3:9.3f} ms {row['tflops']:7.1f} TFLOP/s {share}{first}{picked}"
    why = row.get("error") or f"FAIL rel_error {row.get('rel_error', float('nan')):.3g}"
    return f"  {row['config']:<52}{why}"


def run_sweep(which, out_dir, shrink=1):
    """Run the focused sweeps (``mm``, ``sdpa`` or ``all``), print them and write ``dsl_sweep.json``."""
    start = time.perf_counter()
    results = []
    if which in ("mm", "all"):
        results += sweep_mm(shrink)
    if which in ("sdpa", "all"):
        results += sweep_sdpa(shrink)
        results += rms_norm_timers(shrink)
    if which in ("memory", "all"):
        results += sweep_memory(shrink)
    if which == "sdpa-ws":
        results += sweep_sdpa_ws(shrink)
    lines = []
    for block in results:
        lines.append(block["workload"])
        lines += [_row_line(row) for row in block["rows"]]
    print("\n".join(lines))
    report = {
        "device": torch.cuda.get_device_name() if SWEEP_DEVICE == "cuda" else SWEEP_DEVICE,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "wall_s": time.perf_counter() - start,
        "sweeps": results,
    }
    if out_dir:
        write_json("dsl_sweep.json", report, out_dir, default=str, announce=True)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.dsl", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the cpu backend against torch CPU ops")
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="directory for JSON and PNG (default $OUT)"
    )
    parser.add_argument(
        "--deadline", type=float, default=120.0, help="seconds after which NineToothed is skipped"
    )
    parser.add_argument("--warm", action="store_true", help="keep the existing caches (default: empty ones)")
    parser.add_argument("--only", help="comma-separated workload names (e.g. mm,sdpa_causal); default all")
    parser.add_argument("--shrink", type=int, default=1, help="divide the GPU sizes by this (smoke runs)")
    parser.add_argument(
        "--sweep", choices=("mm", "sdpa", "sdpa-ws", "memory", "all"),
        help="time fixed configurations of mm / sdpa (GPU; dsl_sweep.json); sdpa-ws: warp-specialized attention rows only",
    )
    parser.add_argument("--probe-cache", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; use --cpu for the cpu backend")
    if args.sweep:
        with tempfile.TemporaryDirectory() as caches:  # own tuning cache: no picks from other runs
            os.environ["NINEFOLD_CACHE_DIR"] = os.path.join(caches, "ninefold")
            run_sweep(args.sweep, args.out, args.shrink)
        return
    if args.probe_cache:
        probe_cache(args.probe_cache.split(","), device, args.shrink, args.profile)
        return
    if device == "cpu":
        os.environ["NINEFOLD_DSL_BACKEND"] = "cpu"
    if args.warm:
        run(device, args.out, args.deadline, args.only, args.shrink)
        return
    with tempfile.TemporaryDirectory() as caches:  # cold caches, shared with the probe process
        os.environ["NINEFOLD_CACHE_DIR"] = os.path.join(caches, "ninefold")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
        run(device, args.out, args.deadline, args.only, args.shrink)


if __name__ == "__main__":
    main()
