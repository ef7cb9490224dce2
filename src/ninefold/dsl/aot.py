"""Ahead-of-time compilation: cubins and launch metadata that load without Triton.

``compile(kernel, signatures, target="cuda:90", out=DIR)`` compiles on any machine (no GPU driver:
Triton compiles for a ``GPUTarget``) and writes, per signature, ``<name>_<i>.cubin`` and
``<name>_<i>.json``; ``load(DIR)`` returns a callable that launches the right cubin through the
CUDA driver API (``ctypes`` on ``libcuda``), whatever Triton version is installed (or none).

The artifact is generic in sizes and strides (they are run-time arguments; masks kept wherever a
tile could overhang for some size). What it fixes: dtypes, constexpr sizes and symbols, meta
symbols, the padded power-of-two tile sizes, and the specializations Triton's JIT would make for
the example call (``assume``: 16-byte aligned pointers, unit strides compiled as the constant 1,
strides that are multiples of 16); a call that disagrees is refused with a ValueError.

:func:`register` puts a directory's artifacts in a process-wide table: a CUDA call of a kernel
whose generated source matches an artifact's then launches the artifact (no code generation, no
Triton, no compile) whenever the call matches it, and takes the JIT path otherwise.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from pathlib import Path

import torch

from ninefold.dsl.expr import BinOp, Const, SizeOf, StrideOf, evaluate
from ninefold.dsl.symbol import Symbol

FORMAT = 1  # artifacts gained optional fields ("source_hash", per-argument "divisible") compatibly
DEFAULT_ASSUME = ("pointers", "unit_strides", "strides")
ASSUME = ("pointers", "unit_strides", "strides", "sizes")
_REGISTERED: dict = {}  # kernel source hash -> [Artifact]
COUNTS = {"aot_launchers": 0, "jit_prepared": 0}  # see stats()
_PTX_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.\w+\s+\.align\s+\d+)?\s+\w+_param_(\d+)")


# ------------------------------------------------------------------ expressions as JSON
def expr_to_json(expr, kernel):
    """A JSON tree of an index expression; leaves by their generated-code names."""
    if isinstance(expr, int):
        return expr
    if isinstance(expr, Const):
        return expr.value
    if isinstance(expr, BinOp):
        return [expr.op, expr_to_json(expr.a, kernel), expr_to_json(expr.b, kernel)]
    return {"leaf": kernel.leaf_name(expr)}


def eval_json(tree, env: dict):
    """Evaluate a tree made by :func:`expr_to_json` with ``env[name]``."""
    if isinstance(tree, (int, float, bool)):
        return tree
    if isinstance(tree, dict):
        return env[tree["leaf"]]
    op, a, b = tree
    return evaluate(BinOp(op, Const(eval_json(a, env)), Const(eval_json(b, env))), {})


# ------------------------------------------------------------------ compile half
def _normalize(signature):
    if isinstance(signature, dict):
        return tuple(signature.get("args", ())), dict(signature.get("kwargs", {}))
    return tuple(signature), {}


def assumptions(generated, finished, assume=DEFAULT_ASSUME) -> dict:
    """``{argument name: "one" | "divisible"}``: what the example call lets the artifact assume.

    ``assume`` names the kinds of argument to specialize like Triton's JIT: ``pointers`` (16-byte
    aligned), ``unit_strides`` (strides equal to 1 become the constant 1), ``strides`` and ``sizes``
    (multiples of 16). Example tensors on the ``meta`` device count as aligned.
    """
    from ninefold.dsl.backends.triton_codegen import argument_values

    unknown = set(assume) - set(ASSUME)
    if unknown:
        raise ValueError(f"aot: assume={tuple(assume)!r} names {sorted(unknown)}; accepted: {ASSUME}")
    out = {}
    for (name, kind, payload, constexpr), value in zip(generated.arguments, argument_values(generated, finished)):
        if constexpr:
            continue
        if kind == "pointer":
            aligned = value.device.type == "meta" or value.data_ptr() % 16 == 0
            if "pointers" in assume and aligned:
                out[name] = "divisible"
        elif kind == "leaf" and isinstance(payload, SizeOf) and isinstance(value, int):
            stride = isinstance(payload, StrideOf)
            if stride and "unit_strides" in assume and value == 1:
                out[name] = "one"
            elif ("strides" if stride else "sizes") in assume and value % 16 == 0 and value:
                out[name] = "divisible"
    return out


def compile(kernel, signatures, target="cuda:90", out=None, num_warps=4, num_stages=3, assume=DEFAULT_ASSUME):  # noqa: A001
    """Compile ``kernel`` for each signature (example arguments, or ``{"args": ..., "kwargs": ...}``).

    Example tensors may live on any device (``cpu``, ``meta``); only their dtypes, ndim and, for
    constexpr dimensions, sizes matter, and, through ``assume`` (see :func:`assumptions`), their
    alignment, unit strides and multiples of 16. Writes into ``out`` and returns the JSON paths.
    """
    from ninefold.dsl.backends.cpu import choose_meta
    from ninefold.dsl.backends.launch import prepare
    from ninefold.dsl.backends.triton import compile_for_target
    from ninefold.dsl.backends.triton import signature as triton_signature
    from ninefold.dsl.backends.triton_codegen import specialize
    from ninefold.dsl.tuning import source_hash

    if out is None:
        raise ValueError("aot.compile: out (the output directory) is required")
    if not re.fullmatch(r"cuda:\d+", str(target)):
        raise ValueError(f"aot.compile: target must look like 'cuda:90', got {target!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    generic = specialize(kernel, None)
    for i, signature in enumerate(signatures):
        args, kwargs = _normalize(signature)
        args = tuple(a.new_empty(a.shape, device="cpu") if isinstance(a, torch.Tensor) and a.device.type == "meta" else a for a in args)
        bound = kernel.bind(args, kwargs, backend="triton")
        example = kernel.finish(bound, choose_meta(kernel, bound, gpu=True))
        assumed = assumptions(prepare(kernel, example, generic)[0], example, assume)
        compiled, generated, finished = compile_for_target(
            kernel, args, kwargs, target=target, num_warps=num_warps, num_stages=num_stages, spec=generic,
            assumptions=assumed,
        )
        sig, constexprs = triton_signature(generated, finished)
        for name, kind in assumed.items():
            if kind == "one":
                sig[name], constexprs[name] = "constexpr", 1
        ptx = compiled.asm["ptx"]
        ptx_params = [kind for kind, _ in sorted(((k, int(n)) for k, n in _PTX_PARAM.findall(ptx)), key=lambda kn: kn[1])]
        stem = f"{kernel.name}_{i}"
        cubin = compiled.asm["cubin"]
        (out / f"{stem}.cubin").write_bytes(cubin)
        arguments = []
        for name, kind, payload, constexpr in generated.arguments:
            entry = {"name": name, "kind": kind, "constexpr": constexpr, "type": sig[name]}
            if kind in ("pointer", "scalar"):
                entry["param"] = payload
            elif kind == "leaf":
                entry["leaf"] = _leaf_json(payload, kernel)
            else:
                entry["expr"] = expr_to_json(payload, kernel)
            if constexpr or assumed.get(name) == "one":
                entry["constexpr"] = True
                entry["value"] = constexprs[name]
            if assumed.get(name) == "divisible":
                entry["divisible"] = 16
            arguments.append(entry)
        first = next((p for p in kernel.params if not p.is_scalar), None)
        meta = {
            "format": FORMAT,
            "kernel": kernel.name,
            "source_hash": source_hash(kernel),
            "function": compiled.metadata.name,
            "target": target,
            "cubin": f"{stem}.cubin",
            "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
            "num_warps": compiled.metadata.num_warps,
            "shared": compiled.metadata.shared,
            "global_scratch_size": getattr(compiled.metadata, "global_scratch_size", 0),
            "global_scratch_align": getattr(compiled.metadata, "global_scratch_align", 1),
            "profile_scratch_size": getattr(compiled.metadata, "profile_scratch_size", 0),
            "triton_version": compiled.metadata.triton_version,
            "params": [
                {"name": p.name, "scalar": p.is_scalar, "ndim": p.source.ndim, "passed": p.passed}
                for p in kernel.params
            ],
            "dtypes": {p.name: str(finished.values[p.name].dtype).replace("torch.", "") for p in kernel.params if not p.is_scalar},
            "arguments": arguments,
            "ptx_params": ptx_params,
            "grid": [expr_to_json(s, kernel) for s in (first.arranged._shape if first else ())],
        }
        path = out / f"{stem}.json"
        path.write_text(json.dumps(meta, indent=1))
        written.append(path)
    return written


def _leaf_json(leaf, kernel):
    if isinstance(leaf, SizeOf):
        kind = "stride" if isinstance(leaf, StrideOf) else "size"
        name = kernel.leaf_name(leaf).rsplit(f"_{kind}_", 1)[0]
        return {"tensor": name, "kind": kind, "dim": leaf.dim}
    if isinstance(leaf, Symbol):
        return {"symbol": kernel.symbol_names[leaf]}
    raise TypeError(f"unexpected leaf {leaf!r}")


# ------------------------------------------------------------------ load half
_META_KEYS = ("kernel", "function", "target", "cubin", "num_warps", "shared", "params", "dtypes", "arguments",
              "ptx_params", "grid")
_ELF = b"\x7fELF"


def read_artifact(path, registering: bool = False) -> dict:
    """The metadata of the artifact ``path`` (a ``.json`` written by :func:`compile`), checked: a
    ``ValueError`` names the file and what is wrong (unreadable, another format or target form,
    fields missing, its cubin missing, not a cubin, or not the bytes it was compiled to)."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"AOT artifact {path}: cannot be read ({error})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"AOT artifact {path}: a JSON {type(meta).__name__}, not an artifact's metadata")
    if meta.get("format") != FORMAT:
        raise ValueError(f"AOT artifact {path}: format {meta.get('format')!r}, this ninefold reads format {FORMAT}; "
                         "compile it again")
    if registering and "source_hash" not in meta:
        raise ValueError(f"aot.register: {path} has no source_hash (written by an older ninefold); compile it again")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"AOT artifact {path}: fields {missing} are missing; compile it again")
    if not isinstance(meta["target"], str) or not re.fullmatch(r"cuda:\d+", meta["target"]):
        raise ValueError(f"AOT artifact {path}: target {meta['target']!r} is not a CUDA target like 'cuda:90'")
    cubin = path.parent / str(meta["cubin"])
    if Path(str(meta["cubin"])).name != str(meta["cubin"]):
        raise ValueError(f"AOT artifact {path}: cubin {meta['cubin']!r} must be a file name beside it")
    try:
        image = cubin.read_bytes()
    except OSError as error:
        raise ValueError(f"AOT artifact {path}: its cubin {cubin} is missing or unreadable ({error.strerror})") from None
    if not image.startswith(_ELF):
        raise ValueError(f"AOT artifact {path}: {cubin} is not a cubin (no ELF header); compile it again")
    digest = meta.get("cubin_sha256")
    if digest is not None and hashlib.sha256(image).hexdigest() != digest:
        raise ValueError(f"AOT artifact {path}: {cubin} is corrupt (its SHA-256 differs from the one recorded "
                         "at compile time); compile it again")
    return meta


def target_problem(target: str, capability: tuple[int, int]) -> str | None:
    """Why an artifact compiled for ``target`` cannot run on a GPU of ``capability`` (``None``: it can)."""
    here = f"cuda:{capability[0]}{capability[1]}"
    if target != here:
        return f"compiled for {target}, this GPU is {here}"
    return None


_CAPABILITY: dict = {}
_WARNED_TARGETS: set = set()


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITY[index]


class Artifact:
    """One compiled signature: checks a call against it and builds the launch."""

    def __init__(self, meta: dict, directory: Path):
        if meta.get("format") != FORMAT:
            raise ValueError(f"AOT artifact {meta.get('kernel')!r} in {directory}: format {meta.get('format')!r} "
                             f"is not {FORMAT}")
        self.meta = meta
        self.directory = directory
        self.passed = [p for p in meta["params"] if p["passed"]]
        self._function = None

    def target_problem(self, args) -> str | None:
        """Why this artifact cannot run on the GPU of the call's tensors (``None``: it can, or no GPU)."""
        device = next((v.device for v in args if isinstance(v, torch.Tensor)), None)
        if device is None or device.type != "cuda":
            return None
        problem = target_problem(self.meta["target"], _capability(device))
        if problem is None:
            return None
        return f"{self.meta['kernel']}: {self.directory / self.meta['cubin']} is {problem}"

    def plan(self, args, kwargs):
        """``(grid, [(ptx type, value)])`` for a call, or raise ValueError if it does not match."""
        problem = self.target_problem(args)
        if problem is not None:
            raise ValueError(f"{problem}; compile it for this GPU")
        if len(args) != len(self.passed):
            raise TypeError(f"{self.meta['kernel']} takes {len(self.passed)} arguments, got {len(args)}")
        values = dict(zip((p["name"] for p in self.passed), args))
        env = dict(kwargs)
        for p in self.passed:
            value = values[p["name"]]
            if p["scalar"]:
                continue
            if not isinstance(value, torch.Tensor) or value.ndim != p["ndim"]:
                raise ValueError(f"{self.meta['kernel']}: argument {p['name']} must be a {p['ndim']}-dim tensor")
            if str(value.dtype).replace("torch.", "") != self.meta["dtypes"][p["name"]]:
                raise ValueError(
                    f"{self.meta['kernel']}: argument {p['name']} is {value.dtype}, artifact compiled for {self.meta['dtypes'][p['name']]}"
                )
            for d in range(value.ndim):
                env[f"{p['name']}_size_{d}"] = int(value.shape[d])
                env[f"{p['name']}_stride_{d}"] = int(value.stride(d))
        for a in self.meta["arguments"]:
            if a["kind"] == "leaf" and a["constexpr"] and "symbol" in a["leaf"]:
                env.setdefault(a["leaf"]["symbol"], a["value"])
        launch = []
        for a in self.meta["arguments"]:
            if a["kind"] == "pointer":
                value = values[a["param"]]
                if a.get("divisible") and value.data_ptr() % a["divisible"]:
                    raise ValueError(f"{self.meta['kernel']}: {a['param']} is not {a['divisible']}-byte aligned (the artifact assumes it)")
            elif a["kind"] == "scalar":
                value = values[a["param"]]
            elif a["kind"] == "leaf":
                leaf = a["leaf"]
                key = leaf.get("symbol") or f"{leaf['tensor']}_{leaf['kind']}_{leaf['dim']}"
                if key not in env:
                    raise ValueError(f"{self.meta['kernel']}: missing keyword {key}")
                value = env[key]
            else:
                size = eval_json(a["expr"], env)
                value = 1 if size <= 1 else 1 << (int(size) - 1).bit_length()
            if a.get("divisible") and a["kind"] != "pointer" and value % a["divisible"]:
                raise ValueError(f"{self.meta['kernel']}: {a['name']}={value} is not a multiple of {a['divisible']} (the artifact assumes it)")
            if a["constexpr"]:
                if value != a["value"]:
                    raise ValueError(f"{self.meta['kernel']}: {a['name']} is {value}, artifact compiled for {a['value']}")
                continue
            if a["type"] == "i32" and not -(2**31) <= value < 2**31:
                raise ValueError(f"{self.meta['kernel']}: {a['name']}={value} does not fit the artifact's int32")
            launch.append((a["type"], value))
        grid = math.prod(int(eval_json(g, env)) for g in self.meta["grid"]) if self.meta["grid"] else 1
        return grid, launch

    def matches(self, args, kwargs) -> bool:
        try:
            self.plan(args, kwargs)
            return True
        except (ValueError, TypeError):
            return False

    def __call__(self, *args, **kwargs):
        grid, launch = self.plan(args, kwargs)
        if grid == 0:
            return
        device = next(v.device for v in args if isinstance(v, torch.Tensor))
        from ninefold.dsl.backends.cuda_driver import driver

        driver().launch(self.directory / self.meta["cubin"], self.meta, device, grid, launch)


class AotKernel:
    """Every artifact of one kernel in a directory; a call picks the first that matches."""

    def __init__(self, artifacts):
        self.artifacts = artifacts

    def __call__(self, *args, **kwargs):
        for artifact in self.artifacts:
            if artifact.matches(args, kwargs):
                return artifact(*args, **kwargs)
        reasons = []
        for artifact in self.artifacts:
            try:
                artifact.plan(args, kwargs)
            except (ValueError, TypeError) as error:
                reasons.append(str(error))
        raise ValueError("no AOT artifact matches this call: " + "; ".join(reasons))


def load(directory, kernel_name=None) -> AotKernel:
    """Load the artifacts in ``directory`` (of ``kernel_name``, or of the only kernel there)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"aot.load: {directory} is not a directory of artifacts")
    metas = [read_artifact(p) for p in sorted(directory.glob("*.json"))]
    names = sorted({m["kernel"] for m in metas})
    if kernel_name is None:
        if len(names) != 1:
            raise ValueError(f"{directory} holds kernels {names}; pass kernel_name")
        kernel_name = names[0]
    artifacts = [Artifact(m, directory) for m in metas if m["kernel"] == kernel_name]
    if not artifacts:
        raise ValueError(f"{directory} holds no artifact of {kernel_name!r} (it has {names})")
    return AotKernel(artifacts)


# ------------------------------------------------------------------ registry
def register(directory) -> int:
    """Add every artifact in ``directory`` (as written by :func:`compile`) to the process-wide
    table; CUDA calls of the same kernels launch them when they match. Returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"aot.register: {directory} is not a directory of artifacts")
    count = 0
    for path in sorted(directory.glob("*.json")):
        meta = read_artifact(path, registering=True)
        artifact = Artifact(meta, directory)
        entries = _REGISTERED.setdefault(meta["source_hash"], [])
        if all(a.directory / a.meta["cubin"] != directory / meta["cubin"] for a in entries):
            entries.append(artifact)
            count += 1
    return count


def unregister_all() -> None:
    """Empty the table (tests; a process that switches builds)."""
    _REGISTERED.clear()


def find(kernel, args, kwargs):
    """The registered artifact of ``kernel`` that matches this call, or None."""
    if not _REGISTERED:
        return None
    from ninefold.dsl.tuning import source_hash

    for artifact in _REGISTERED.get(source_hash(kernel), ()):
        problem = artifact.target_problem(args)
        if problem is not None:  # the JIT serves the call; say once why the artifact does not
            if artifact.directory not in _WARNED_TARGETS:
                _WARNED_TARGETS.add(artifact.directory)
                warnings.warn(f"{problem}; such calls compile with the JIT instead", stacklevel=3)
            continue
        if artifact.matches(args, kwargs):
            return artifact
    return None


def launcher(kernel, args, kwargs):
    """A launcher ``f(args)`` for :meth:`Kernel.__call__` when a registered artifact matches."""
    artifact = find(kernel, args, kwargs)
    if artifact is None:
        return None
    COUNTS["aot_launchers"] += 1
    kwargs = dict(kwargs)

    def launch(args):
        artifact(*args, **kwargs)

    return launch


def stats() -> dict:
    """``aot_launchers``: calls served by a registered artifact (once per distinct call key);
    ``jit_prepared``: specializations the triton backend generated for Triton's JIT (each may
    compile, or hit Triton's disk cache)."""
    return dict(COUNTS)
