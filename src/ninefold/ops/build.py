"""Trimmed builds: a deployable subset of the operator library (``ninefold ops build``).

A manifest (``ops.toml``) lists the operators to keep, with their dtypes and implementations::

    target = "cuda:90"        # what to compile for ("cpu": nothing to compile)
    fallback = "error"        # or "vendor": calls outside the build use the vendor implementation (an
                              # operator with none, linear_fp8, its dequantize one)
    uncovered = "jit"         # or "error": a kept Triton kernel called with a specialisation the
                              # build holds no binary for (other shapes, misaligned views)
    shapes = "llama-8b"       # the shapes whose kernel specialisations are compiled ahead of time
    kv_cache_dtypes = ["fp8"] # the cache operators' kernels are built over the model's dtype ("auto", the
                              # default) and, with "fp8", over FP8 codes too (an engine with kv_cache_dtype="fp8"
                              # also runs model-dtype caches while it profiles its memory)
    block_sizes = [16, 32]    # the KV cache block sizes the paged kernels are built for (default [16], the
                              # engine's default --block-size)

    [ops.rms_norm]
    dtypes = ["bfloat16"]
    impls = ["triton", "vendor"]

``build`` writes ``DIR/manifest.json`` and, per kept Triton implementation and dtype, the binaries
of every kernel specialisation its launchers use at the manifest's shapes
(``DIR/kernels/triton/<op>/<dtype>/<kernel>-<hash>.cubin`` + ``.json``; see
``ninefold.ops.triton.prebuilt``): the JIT's exact specialisation (16-byte aligned pointers,
integers divisible by 16 where the shapes make them so) and a relaxed one that serves any integer
values. It needs no GPU: the launch parameters are recorded on ``meta`` tensors and compiled for
the target; for sm_90 and later each call is recorded a second time as launched with programmatic
dependent launch (PDL: the kernels that use it take other constexprs), ``manifest.json`` says
``"pdl": true``, and those binaries are launched with PDL. With ``NINEFOLD_OPS_BUILD=DIR`` only that subset is registered and the Triton launchers
run the build's binaries through the CUDA driver, compiling nothing (whatever Triton version is
installed there). DSL kernels of kept "dsl" implementations are compiled to
``DIR/kernels/dsl/<op>/<dtype>`` by ``ninefold.dsl.aot`` (aligned pointers, unit strides, strides
divisible by 16 assumed, as the JIT specialises) and registered with it under
``NINEFOLD_OPS_BUILD``, so their matching CUDA calls compile nothing either.

A kept implementation that calls other operators through dispatch (``register(..., calls=...)``: the
vendor ``rope_and_cache`` runs ``rope`` and ``reshape_and_cache``) brings them into the build, for its
dtypes, with their vendor implementation (``dequantize`` for ``linear_fp8``, which has no vendor one); where the manifest lists such an operator itself, its
dtypes must cover the caller's. (With ``fallback = "vendor"`` every such portable implementation is there.)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ninefold.ops.registry import Impl
from ninefold.runtime.kv_pool import KV_CACHE_DTYPES

_UNSET = object()
_active = _UNSET
FALLBACKS = ("error", "vendor")
UNCOVERED = ("jit", "error")


@dataclass(frozen=True)
class Build:
    """A loaded build: ``ops`` maps operator -> {"dtypes": [...], "impls": [...]}."""

    path: Path
    ops: dict
    fallback: str = "error"
    target: str = "cpu"
    uncovered: str = "jit"
    kv_cache_dtypes: tuple = ("auto",)
    block_sizes: tuple = (16,)
    pdl: bool = False  # its binaries include the launches that use PDL on the target (builds of sm_90+)

    def engine_gap(self, block_size: int, kv_cache_dtype: str) -> str | None:
        """What an engine with ``block_size`` and ``kv_cache_dtype`` runs that this build compiled no paged kernels
        for (``None``: nothing); such calls go to the JIT, or fail with ``uncovered = "error"``."""
        from ninefold.ops.workloads import CACHE_OPS  # (the paged kernels, specialised on the block size)

        if not any(op in self.ops and "triton" in self.ops[op]["impls"] for op in CACHE_OPS):
            return None
        if block_size not in self.block_sizes:
            return (f"block_size {block_size} (the build's paged kernels are for block_sizes "
                    f"{list(self.block_sizes)})")
        fp8 = KV_CACHE_DTYPES.get(kv_cache_dtype) is not None
        if fp8 and "fp8" not in self.kv_cache_dtypes and _fp8_target(self.target):  # (before sm_89: torch reads them)
            return f"kv_cache_dtype {kv_cache_dtype!r} (the build's cache kernels are for {list(self.kv_cache_dtypes)})"
        return None

    def missing_for(self, quantization: str) -> str | None:
        """The operator an engine run with ``quantization`` calls that this build keeps no implementation of
        (``None``: nothing missing): ``linear_fp8`` for ``"fp8"``."""
        if quantization == "fp8" and "linear_fp8" not in self.ops and self.fallback != "vendor":
            return "linear_fp8"
        return None

    def restrict(self, impl: Impl) -> Impl | None:
        """``impl`` limited to the build's dtypes, or ``None`` when the build leaves it out."""
        if self.fallback == "vendor" and impl.name == portable(impl.op):
            return impl
        entry = self.ops.get(impl.op)
        if entry is None or impl.name not in entry["impls"]:
            return None
        dtypes = impl.dtypes & {getattr(torch, d) for d in entry["dtypes"]}
        return replace(impl, dtypes=frozenset(dtypes)) if dtypes else None

    @classmethod
    def load(cls, directory) -> Build:
        """Read ``DIR/manifest.json``."""
        path = Path(directory)
        manifest = path / "manifest.json"
        if not manifest.exists():
            raise ValueError(f"NINEFOLD_OPS_BUILD: {path} holds no manifest.json (build it with `ninefold ops build`)")
        try:
            data = json.loads(manifest.read_text())
            problem = _manifest_problem(data)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            problem = f"cannot be read ({error})"
        if problem:
            raise ValueError(f"NINEFOLD_OPS_BUILD: {manifest} is not a build manifest: {problem}; "
                             f"rebuild with `ninefold ops build`")
        return cls(path, data["ops"], data.get("fallback", "error"), data.get("target", "cpu"),
                   data.get("uncovered", "jit"), tuple(data.get("kv_cache_dtypes", ["auto"])),
                   tuple(data.get("block_sizes", [16])), data.get("pdl") is True)


def _manifest_problem(data) -> str | None:
    """What is wrong with a parsed ``manifest.json`` (``None``: nothing)."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    ops = data.get("ops")
    if not isinstance(ops, dict):
        return f"'ops' must be an object, got {ops!r}"
    for op, entry in ops.items():
        if not isinstance(entry, dict):
            return f"ops.{op} must be an object, got {entry!r}"
        for key, accepted in (("impls", None), ("dtypes", DTYPES)):
            value = entry.get(key)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                return f"ops.{op}.{key} must be a list of names, got {value!r}"
            if accepted is not None and any(v not in accepted for v in value):
                return f"ops.{op}.dtypes lists {value!r}; accepted: {', '.join(accepted)}"
    for key, accepted in (("fallback", FALLBACKS), ("uncovered", UNCOVERED)):
        if key in data and data[key] not in accepted:
            return f"{key} must be one of {accepted}, got {data[key]!r}"
    caches = data.get("kv_cache_dtypes", ["auto"])
    if not isinstance(caches, list) or any(c not in KV_CACHE_DTYPES for c in caches):
        return f"kv_cache_dtypes must be a list of {', '.join(KV_CACHE_DTYPES)}, got {caches!r}"
    if not isinstance(data.get("pdl", False), bool):
        return f"pdl must be true or false, got {data['pdl']!r}"
    sizes = data.get("block_sizes", [16])
    if not _block_sizes_ok(sizes):
        return f"block_sizes must be a non-empty list of positive integers, got {sizes!r}"
    if not isinstance(data.get("target", "cpu"), str) or not _TARGET.fullmatch(data.get("target", "cpu")):
        return f"target {data.get('target')!r} is not 'cpu' or a GPU like 'cuda:90'"
    return None


def _register_dsl(build: Build | None) -> None:
    """Hand the build's DSL binaries to ``ninefold.dsl.aot`` (matching CUDA calls launch them)."""
    root = None if build is None else build.path / "kernels" / "dsl"
    if root is None or not root.is_dir():
        return
    from ninefold.dsl import aot

    for folder in sorted({p.parent for p in root.rglob("*.json")}):
        aot.register(folder)


def active() -> Build | None:
    """The build named by ``NINEFOLD_OPS_BUILD`` (``None``: the full library)."""
    global _active
    if _active is _UNSET:
        directory = os.environ.get("NINEFOLD_OPS_BUILD")
        _active = Build.load(directory) if directory else None
        _register_dsl(_active)
    return _active


def activate(directory) -> None:
    """Switch this process to the build at ``directory`` (``None``: the full library)."""
    global _active
    _active = Build.load(directory) if directory is not None else None
    from ninefold.dsl import aot
    from ninefold.ops import registry

    aot.unregister_all()
    _register_dsl(_active)
    registry.changed()
    try:
        from ninefold.ops.triton import launch
    except ImportError:  # no Triton: nothing prebuilt to forget
        return
    launch.reset()


def read_manifest(path) -> dict:
    """Parse and check an ``ops.toml``; errors name the file, the entry and what is accepted."""
    import tomllib

    import ninefold.ops  # noqa: F401  (registers every implementation)
    from ninefold.ops import registry, workloads

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"--manifest: cannot read {path}: {error}") from None
    where = f"manifest {path}"
    unknown = sorted(set(data) - set(MANIFEST_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(MANIFEST_KEYS)}")
    target = check_target(data.get("target", "cpu"), where)
    if target != "cpu":
        import ninefold.ops.triton  # noqa: F401  (the GPU kernels, registered even without a local GPU)
    fallback = data.get("fallback", "error")
    if fallback not in FALLBACKS:
        raise ValueError(f"{where}: fallback must be one of {FALLBACKS}, got {fallback!r}")
    uncovered = data.get("uncovered", "jit")
    if uncovered not in UNCOVERED:
        raise ValueError(f"{where}: uncovered must be one of {UNCOVERED}, got {uncovered!r}")
    shapes = data.get("shapes", "llama-8b")
    if not isinstance(shapes, str) or shapes not in workloads.SHAPES:
        raise ValueError(f"{where}: shapes must be one of {', '.join(workloads.SHAPES)}, got {shapes!r}")
    kv_cache_dtypes = _names_list(data.get("kv_cache_dtypes", ["auto"]), f"{where}: kv_cache_dtypes", KV_CACHE_DTYPES)
    bad = [d for d in kv_cache_dtypes if d not in KV_CACHE_DTYPES]
    if bad:
        raise ValueError(f"{where}: kv_cache_dtypes lists {bad[0]!r}; accepted: {', '.join(KV_CACHE_DTYPES)}")
    block_sizes = data.get("block_sizes", [16])
    if not _block_sizes_ok(block_sizes):
        raise ValueError(f"{where}: block_sizes must be a non-empty list of positive integers (KV cache block sizes "
                         f"like [16, 32]), got {block_sizes!r}")
    ops = data.get("ops")
    if not isinstance(ops, dict) or not ops:
        raise ValueError(f"{where}: needs at least one [ops.<name>] table")
    known = registry.operators()
    resolved = {}
    for op, entry in ops.items():
        if op not in known:
            raise ValueError(f"{where}: unknown operator {op!r}; known: {', '.join(known)}")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: ops.{op} must be a table ([ops.{op}] with dtypes and impls), got {entry!r}")
        bad_keys = sorted(set(entry) - {"dtypes", "impls"})
        if bad_keys:
            raise ValueError(f"{where}: [ops.{op}] has unknown key {bad_keys[0]!r}; accepted: dtypes, impls")
        # with the ones that register only where CUDA is (cuBLASLt): a build for a GPU is made on a CPU machine
        names = sorted({i.name for i in registry.all_implementations(op)} | set(registry.cuda_only(op)))
        impls = _names_list(entry.get("impls", names), f"{where}: [ops.{op}] impls", names)
        bad = [i for i in impls if i not in names]
        if bad:
            raise ValueError(f"{where}: {op} has no implementation {bad[0]!r}; it has: {', '.join(names)}")
        dtypes = _names_list(entry.get("dtypes", list(DTYPES)), f"{where}: [ops.{op}] dtypes", DTYPES)
        bad = [d for d in dtypes if d not in DTYPES]
        if bad:
            raise ValueError(f"{where}: {op} lists dtype {bad[0]!r}; accepted: {', '.join(DTYPES)}")
        resolved[op] = {"dtypes": list(dict.fromkeys(dtypes)), "impls": list(dict.fromkeys(impls))}
    if fallback != "vendor":
        _keep_called_operators(resolved, where)
    caches = list(dict.fromkeys("auto" if KV_CACHE_DTYPES[c] is None else "fp8" for c in kv_cache_dtypes))
    return {"target": target, "fallback": fallback, "uncovered": uncovered, "shapes": shapes,
            "kv_cache_dtypes": caches, "block_sizes": sorted(set(block_sizes)), "ops": resolved}


def portable(op: str) -> str:
    """The implementation of ``op`` that runs anywhere: ``vendor``; ``dequantize`` for a quantized linear that has no
    vendor one (``linear_fp8``)."""
    from ninefold.ops import registry

    names = {i.name for i in registry.all_implementations(op)}
    return "vendor" if "vendor" in names or "dequantize" not in names else "dequantize"


def _keep_called_operators(ops: dict, where: str) -> None:
    """Add to ``ops`` (operator -> entry) the operators its kept implementations call through dispatch, for the
    callers' dtypes, with their ``portable`` implementation; an operator listed in the manifest must cover them."""
    from ninefold.ops import registry

    added: set[str] = set()
    todo = list(ops)
    while todo:
        op = todo.pop(0)
        entry = ops[op]
        for impl in registry.all_implementations(op):
            if impl.name not in entry["impls"]:
                continue
            for called in impl.calls:
                if called not in ops:
                    ops[called] = {"dtypes": [], "impls": [portable(called)]}
                    added.add(called)
                missing = [d for d in entry["dtypes"] if d not in ops[called]["dtypes"]]
                if missing and called not in added:
                    raise ValueError(f"{where}: {op}'s {impl.name!r} implementation calls {called}, and "
                                     f"[ops.{called}] leaves out {op}'s dtypes {', '.join(missing)}; add them to "
                                     f"[ops.{called}] dtypes (or drop [ops.{called}]: {called} is then kept with its "
                                     f"{portable(called)} implementation for {op}'s dtypes)")
                if missing:
                    ops[called]["dtypes"] += missing
                    todo.append(called)


MANIFEST_KEYS = ("target", "fallback", "uncovered", "shapes", "kv_cache_dtypes", "block_sizes", "ops")
DTYPES = ("float16", "bfloat16", "float32")
_TARGET = re.compile(r"cpu|cuda:\d+|hip:gfx\w+")


def _cuda_sm(target: str) -> int:
    """The compute capability a ``cuda:NN`` target names, as ``NN`` (0 for other targets)."""
    return int(target[5:]) if target.startswith("cuda:") else 0


def _fp8_target(target: str) -> bool:
    """Whether a build for ``target`` can hold FP8-cache kernels: nothing is compiled for the CPU; Triton compiles
    FP8 (fp8e4nv) for CUDA of compute capability 8.9 or later."""
    return target == "cpu" or _cuda_sm(target) >= 89


def _pdl_target(target: str) -> bool:
    """Whether a build for ``target`` records the launches that use programmatic dependent launch as well: CUDA of
    compute capability 9.0 or later, with a Triton that has the API (``gemv_pdl.pdl_api``)."""
    if _cuda_sm(target) < 90:
        return False
    from ninefold.ops.triton import gemv_pdl

    return gemv_pdl.pdl_api()


def _block_sizes_ok(value) -> bool:
    """A non-empty list of positive integers (booleans are not integers here)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)


def check_target(target, where: str) -> str:
    """``target`` if it names something a build can be compiled for, else a ``ValueError``."""
    if not isinstance(target, str) or not _TARGET.fullmatch(target):
        raise ValueError(f"{where}: target must be 'cpu' or a GPU like 'cuda:90' (or 'hip:gfx942'), got {target!r}")
    return target


def _names_list(value, where: str, accepted) -> list:
    """A non-empty list of strings (not a bare string, which would read as its letters)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not value:
        raise ValueError(f"{where} must be a non-empty list of names like [{', '.join(map(repr, accepted))}], "
                         f"got {value!r}")
    return value


@dataclass
class Report:
    """What a build wrote: bytes per operator, notes, and where."""

    out: Path
    target: str
    sizes: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        width = max([20, *map(len, self.sizes)])
        lines = [f"ninefold ops build -> {self.out} (target {self.target})",
                 f"{'operator':{width}s} {'files':>5s} {'bytes':>10s}"]
        for op, (files, size) in sorted(self.sizes.items()):
            lines.append(f"{op:{width}s} {files:5d} {size:10d}")
        total_files = sum(f for f, _ in self.sizes.values())
        total = sum(s for _, s in self.sizes.values())
        lines.append(f"{'total':{width}s} {total_files:5d} {total:10d}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


BUILD_MARKER = ".ninefold-build"


def build(manifest_path, out, target: str | None = None) -> Report:
    """Build the subset described by ``manifest_path`` into ``out`` (see the module doc)."""
    from ninefold.ops import tuning

    manifest = read_manifest(manifest_path)
    target = check_target(target, "--target") if target is not None else manifest["target"]
    manifest["target"] = target
    if "fp8" in manifest["kv_cache_dtypes"] and not _fp8_target(target):
        raise ValueError(f"manifest {manifest_path}: kv_cache_dtypes names 'fp8', which target {target!r} cannot "
                         f"build: Triton's FP8 cache kernels need CUDA of compute capability 8.9 or later (cuda:89, "
                         f"cuda:90, ...); older CUDA GPUs read FP8 caches with the torch implementations (drop 'fp8')")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = out / BUILD_MARKER  # written before compiling: a failed first build is recognisably ours
    if (out / "manifest.json").exists() or started.exists():  # rebuilding: no stale binaries stay, and a
        import shutil  # failed rebuild leaves no loadable manifest pointing at half-written kernels

        (out / "manifest.json").unlink(missing_ok=True)
        if (out / "kernels").is_dir():
            shutil.rmtree(out / "kernels")
    started.write_text("ninefold ops build output; a rebuild replaces kernels/ and manifest.json\n")
    report = Report(out, target)
    pdl = _pdl_target(target)
    if target != "cpu":
        _compile_triton(manifest, target, out, report, pdl)
        _compile_dsl(manifest, target, out, report)
    (out / "manifest.json").write_text(json.dumps({**manifest, "pdl": pdl, "versions": tuning.versions()}, indent=1))
    report.sizes["(manifest)"] = (1, (out / "manifest.json").stat().st_size)
    return report


def _compile_triton(manifest: dict, target: str, out: Path, report: Report, pdl: bool = False) -> None:
    """Compile every specialisation the kept Triton implementations launch at the manifest's shapes (with ``pdl``,
    also those they launch with programmatic dependent launch)."""
    import hashlib

    from tqdm import tqdm

    from ninefold.ops import workloads
    from ninefold.ops.triton import aot, prebuilt

    gpu = aot.parse_target(target)
    shapes = workloads.shapes(manifest["shapes"])
    jobs = []
    for op, entry in manifest["ops"].items():
        paged = op in workloads.CACHE_OPS  # (over the cache's dtype and block size)
        caches = [None]  # the model's dtype, always; FP8 codes as well where the manifest names them
        if paged and "fp8" in manifest["kv_cache_dtypes"]:
            caches.append(KV_CACHE_DTYPES["fp8"])
        sized = [replace(shapes, block_size=b) for b in manifest["block_sizes"]] if paged else [shapes]
        seen = set()
        for impl, dtype_name, cache_dtype, at in ((i, d, c, a) for i in entry["impls"] if i in aot.TRITON_IMPLS
                                                  for d in entry["dtypes"] for c in caches for a in sized):
            found, notes = aot.launches(op, getattr(torch, dtype_name), at, aot.TARGET_SMS.get(target, 132),
                                        cache_dtype, impl, pdl)
            report.notes += notes
            # Per kernel, constexprs, dtypes and launch options: the JIT's exact specialisations, one
            # merged over them (other shapes of the same kind), one relaxed (any integers).
            groups: dict = {}
            for kernel, spec, warps, stages in found:
                groups.setdefault((kernel, prebuilt.family(spec, kernel.params), warps, stages), []).append(spec)
            for (kernel, _, warps, stages), specs in groups.items():
                candidates = [(True, s) for s in specs] + [(False, prebuilt.merged(specs, kernel.params))]
                candidates.append((False, prebuilt.relaxed(candidates[-1][1], kernel.params)))
                for exact, s in candidates:
                    if (kernel, s, warps, stages) not in seen:
                        seen.add((kernel, s, warps, stages))
                        jobs.append((op, dtype_name, kernel, s, warps, stages, exact))
    for op, dtype_name, kernel, spec, warps, stages, exact in tqdm(jobs, desc=f"compiling for {target}", unit="kernel",
                                                                     disable=not jobs):
        digest = hashlib.sha256(repr((spec, warps, stages)).encode()).hexdigest()[:10]
        compiled = aot.compile_spec(kernel, spec, warps, stages, gpu)
        prebuilt.write(out / "kernels" / "triton" / op / dtype_name, f"{kernel.fn.__name__}-{digest}", kernel, spec,
                       warps, stages, compiled, target, exact)
    for op in dict.fromkeys(job[0] for job in jobs):
        files = [p for p in (out / "kernels" / "triton" / op).rglob("*") if p.is_file()]
        report.sizes[op] = (len(files), sum(p.stat().st_size for p in files))


def _dsl_signatures(op: str, dtype: torch.dtype, shapes) -> list:
    """``(kernel, signatures)`` of the DSL kernels ``op`` launches at ``shapes`` (example CPU tensors)."""
    from ninefold.ops.kernels import activation, add, rms_norm, softmax

    rows = 16
    x, w = torch.empty(rows, shapes.hidden, dtype=dtype), torch.empty(shapes.hidden, dtype=dtype)
    if op == "rms_norm":
        return [(rms_norm.kernel, [{"args": (x, w, 1e-5, x), "kwargs": {"ROW": shapes.hidden}}])]
    if op == "add_rms_norm":
        return [(rms_norm.fused_kernel, [{"args": (x, x, w, 1e-5, x, x), "kwargs": {"ROW": shapes.hidden}}])]
    if op == "softmax":
        s = torch.empty(rows, shapes.softmax_width, dtype=dtype)
        return [(softmax.kernel, [{"args": (s, s), "kwargs": {"ROW": shapes.softmax_width}}])]
    if op == "silu_and_mul":
        g = torch.empty(rows, shapes.intermediate, dtype=dtype)
        return [(activation.swiglu_kernel, [{"args": (g, g, g)}])]
    if op == "add":
        flat = torch.empty(rows * shapes.hidden, dtype=dtype)
        return [(add.kernel_flat, [{"args": (flat, flat, flat)}])]
    return []


def _compile_dsl(manifest: dict, target: str, out: Path, report: Report) -> None:
    """AOT-compile the DSL kernels of the kept "dsl" implementations through ``ninefold.dsl.aot``."""
    wanted = [op for op, e in manifest["ops"].items() if "dsl" in e["impls"]]
    if not wanted:
        return
    try:
        from ninefold.dsl import aot
    except ImportError:
        report.notes.append("ninefold.dsl.aot is not available: DSL kernels compile on their first call")
        return
    from ninefold.ops import workloads

    shapes = workloads.shapes(manifest["shapes"])
    for op in wanted:
        compiled_any = False
        for dtype_name in manifest["ops"][op]["dtypes"]:
            for kernel, signatures in _dsl_signatures(op, getattr(torch, dtype_name), shapes):
                aot.compile(kernel, signatures, target=target, out=out / "kernels" / "dsl" / op / dtype_name)
                compiled_any = True
        if compiled_any:
            files = [p for p in (out / "kernels" / "dsl" / op).rglob("*") if p.is_file()]
            report.sizes[f"{op} (dsl)"] = (len(files), sum(p.stat().st_size for p in files))
        else:
            report.notes.append(f"{op}: no ahead-of-time DSL signatures yet; its DSL kernel compiles on first call")
    report.notes.append("DSL binaries are registered with ninefold.dsl.aot under NINEFOLD_OPS_BUILD: CUDA calls "
                        "that match one launch it (its block sizes are the compile-time defaults, not the tuner's)")
