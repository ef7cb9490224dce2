"""Trimmed builds on the GPU: the first call into a built kernel compiles nothing, and runs as fast.

    python -m ninefold.bench.ops_build --write aot_ops_build_triton39   # here (no GPU): build for cuda:90
    OUT=DIR python -m ninefold.bench.ops_build --build aot_ops_build_triton39   # GPU, < 3 min
    python -m ninefold.bench.ops_build --build DIR --dry-run    # any machine: which binary serves each call

Without ``--build`` (or when the directory is missing) the GPU run builds the manifest itself for
the local GPU first. Then, in a fresh process with ``NINEFOLD_OPS_BUILD`` set and an empty
``TRITON_CACHE_DIR``, it calls every built Triton operator (and the DSL implementations of
``DSL_OPS``, whose kernels ``ninefold.dsl.aot`` compiled) once at a Llama-3-8B shape (bfloat16)
and reports per operator and implementation: the first call's wall time, the compilations it caused (``triton.compile``
calls and Triton JIT cache misses, counted by wrapping ``triton.compile`` and through
``knobs.runtime.jit_cache_hook``, and the DSL's JIT specialisations: all must be 0), which binary served it (the JIT's exact
specialisation or a merged/relaxed one), the result against the float64 reference, and the warm
device time of the build's binary vs the same operator JIT-compiled in that process (CUDA events
around back-to-back calls queued behind a sleep kernel, so host time is hidden) and host time per
call (the build's binaries launch through ctypes, the JIT's through Triton's launcher). A second fresh
process without the build and with another empty Triton cache gives the cold JIT first call for
comparison. Table to stdout, everything to ``$OUT/ops_build.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "gelu_and_mul", "softmax", "rope", "reshape_and_cache",
       "attention_decode", "attention_prefill", "linear")
# Operators whose "dsl" implementation is built too (ninefold.dsl kernels compiled by ninefold.dsl.aot).
DSL_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "softmax")
# Which representative call (``ninefold.ops.workloads`` label) each operator is measured at.
CASE = {"attention_decode": "B=16 ctx=4096", "attention_prefill": "B=4 L=1024", "linear": "qkv T=16"}
SHAPES = "llama-8b"
DTYPE = "bfloat16"


def entries(ops=OPS, dsl=DSL_OPS) -> list[tuple[str, str]]:
    """``(operator, implementation)`` pairs the benchmark builds and calls."""
    return [(op, "triton") for op in ops] + [(op, "dsl") for op in dsl if op in ops]


def manifest_text(target: str, ops=OPS, dsl=DSL_OPS) -> str:
    """The benchmark's manifest: the Triton (and for ``dsl``, DSL) implementations of ``ops`` at
    Llama-3-8B shapes, bfloat16."""
    lines = [f'target = "{target}"', f'shapes = "{SHAPES}"', 'fallback = "error"', 'uncovered = "jit"']
    for op in ops:
        impls = ", ".join(f'"{i}"' for o, i in entries(ops, dsl) if o == op)
        lines += [f"[ops.{op}]", f'dtypes = ["{DTYPE}"]', f"impls = [{impls}]"]
    return "\n".join(lines) + "\n"


def write_build(out: Path, target: str = "cuda:90", ops=OPS, dsl=DSL_OPS):
    """Build the benchmark's manifest for ``target`` into ``out`` (works without a GPU)."""
    from ninefold.ops import build

    out.mkdir(parents=True, exist_ok=True)
    manifest = out.parent / f"{out.name}.toml"
    manifest.write_text(manifest_text(target, ops, dsl))
    report = build.build(manifest, out)
    manifest.unlink()
    return report


def pick_case(op: str, device, dtype):
    """The representative call of ``op`` the benchmark measures."""
    from ninefold.ops import workloads

    want = CASE.get(op, "T=16 ")
    for case in workloads.cases(op, workloads.shapes(SHAPES), device, dtype):
        if case.label.startswith(want) or want in case.label + " ":
            return case
    raise ValueError(f"{op}: no workload case labelled {want!r}")


# ------------------------------------------------------------------ compile counting
class CompileCounter:
    """Counts ``triton.compile`` calls and Triton JIT cache misses from now on (in this process)."""

    def __init__(self):
        import triton
        import triton.compiler
        import triton.compiler.compiler as compiler

        self.compiles = 0
        self.jit_misses = 0
        original = compiler.compile

        def counted(*args, **kwargs):
            self.compiles += 1
            return original(*args, **kwargs)

        for module in (triton, triton.compiler, compiler):
            if getattr(module, "compile", None) is original:
                module.compile = counted
        try:
            from triton import knobs

            previous = knobs.runtime.jit_cache_hook

            def hook(*args, **kwargs):
                self.jit_misses += 1
                return previous(*args, **kwargs) if previous is not None else False

            knobs.runtime.jit_cache_hook = hook
            self.hooked = True
        except (ImportError, AttributeError):
            self.hooked = False

    def total(self) -> int:
        return max(self.compiles, self.jit_misses)


# ------------------------------------------------------------------ child process
def _relative_error(got, want) -> float:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.double().cpu(), w.double().cpu()
        worst = max(worst, ((g - w).abs() / (w.abs() + 1)).max().item())
    return worst


def _call(op: str, case, name: str = "triton"):
    """``(run, reference)``: a function calling implementation ``name`` directly, and the float64
    reference result."""
    from ninefold.ops import dispatch, references, registry

    bound = dispatch.operator(op).bind(*case.args, **case.kwargs)
    impl = next(i for i in registry.implementations(op) if i.name == name)
    if op == "reshape_and_cache":
        want = references.reshape_and_cache(*bound)

        def run():
            impl.fn(*bound)
            return bound[2], bound[3]
        return run, want
    if op == "rope":
        want = references.rope(*[b.clone() if isinstance(b, torch.Tensor) else b for b in bound])
    else:
        want = getattr(references, op)(*case.args, **case.kwargs)
    return (lambda: impl.fn(*bound)), want


def _timings(fn, reps: int = 50) -> tuple[float, float]:
    """``(device ms, host us)`` per call of ``fn`` run ``reps`` times back to back: device time with
    the calls queued behind a sleep kernel (host time hidden), host time as wall time per call."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    host_s = time.perf_counter() - start
    times = []
    for _ in range(3):
        torch.cuda._sleep(int(2e9 * (host_s * 1.5 + 1e-3)))  # ~2 GHz: longer than queueing the calls takes
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / reps)
    return min(times), host_s / reps * 1e6


def _dsl_stat(key: str) -> int:
    """``ninefold.dsl.aot.stats()[key]`` ("jit_prepared": specialisations the DSL's Triton backend
    generated for Triton's JIT; "aot_launchers": calls served by registered artifacts)."""
    try:
        from ninefold.dsl import aot
    except ImportError:
        return 0
    return aot.stats().get(key, 0)


def _dsl_prepared() -> int:
    return _dsl_stat("jit_prepared")


def child(pairs, json_path: str, built: bool) -> None:
    """One fresh process: first calls of every ``(operator, implementation)`` in ``pairs`` (and, with
    the build, warm times vs the JIT)."""
    counter = CompileCounter()
    import ninefold.ops  # noqa: F401
    import ninefold.ops.triton  # noqa: F401
    from ninefold.ops import build
    from ninefold.ops.triton import prebuilt

    dtype = getattr(torch, DTYPE)
    rows, runs = [], {}
    for op, name in pairs:
        row = {"op": op, "impl": name}
        rows.append(row)
        try:
            case = pick_case(op, "cuda", dtype)
            row["case"] = case.label
            run, want = _call(op, case, name)
            torch.cuda.synchronize()
            before = (counter.compiles, counter.jit_misses, prebuilt.STATS["prebuilt"], len(prebuilt.LOADED),
                      len(prebuilt.MISSES), _dsl_prepared(), _dsl_stat("aot_launchers"))
            start = time.perf_counter()
            got = run()
            torch.cuda.synchronize()
            row["first_call_ms"] = (time.perf_counter() - start) * 1e3
            row["triton_compile_calls"] = counter.compiles - before[0]
            row["jit_cache_misses"] = counter.jit_misses - before[1]
            row["dsl_jit_prepared"] = _dsl_prepared() - before[5]
            row["dsl_aot_launchers"] = _dsl_stat("aot_launchers") - before[6]
            row["compiles"] = max(row["triton_compile_calls"], row["jit_cache_misses"], row["dsl_jit_prepared"])
            row["prebuilt_launches"] = prebuilt.STATS["prebuilt"] - before[2]
            row["binaries"] = prebuilt.LOADED[before[3]:]
            row["uncovered"] = prebuilt.MISSES[before[4]:]
            row["max_rel_error"] = _relative_error(got, want)
            row["correct"] = row["max_rel_error"] <= 5e-2
            runs[op, name] = run
        except Exception as error:  # noqa: BLE001  (one operator's failure is reported, the others still run)
            row["error"] = f"{type(error).__name__}: {error}"
    if built:
        for row in rows:
            if (row["op"], row["impl"]) in runs:
                row["built_device_ms"], row["built_host_us"] = _timings(runs[row["op"], row["impl"]])
        build.activate(None)  # the same implementations JIT-compiled, in the same process
        for row in rows:
            if (row["op"], row["impl"]) not in runs:
                continue
            if row["impl"] == "dsl":  # the DSL kernel's call cache keeps the artifact's launcher: no JIT here
                row["jit_note"] = "no in-process JIT comparison for DSL kernels (see the cold columns)"
                continue
            try:
                run, _ = _call(row["op"], pick_case(row["op"], "cuda", dtype), row["impl"])
                before = counter.total() + _dsl_prepared()
                run()
                row["jit_compiles_after_build_off"] = counter.total() + _dsl_prepared() - before
                row["jit_device_ms"], row["jit_host_us"] = _timings(run)
                row["built_over_jit"] = row["built_device_ms"] / row["jit_device_ms"]
            except Exception as error:  # noqa: BLE001
                row["jit_error"] = f"{type(error).__name__}: {error}"
    Path(json_path).write_text(json.dumps({"rows": rows, "counter_hooked": counter.hooked}, indent=1, default=str))


def _spawn(pairs, env: dict, built: bool, workdir: Path) -> dict:
    path = workdir / f"child-{'built' if built else 'cold'}.json"
    code = f"from ninefold.bench.ops_build import child; child({list(pairs)!r}, {str(path)!r}, {built!r})"
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    result = {"returncode": run.returncode, "wall_s": time.perf_counter() - start, "stderr_tail": run.stderr[-3000:]}
    if path.exists():
        result.update(json.loads(path.read_text()))
    return result


# ------------------------------------------------------------------ dry run (no GPU needed)
def dry_run(directory: Path, ops) -> list[dict]:
    """Which binary of the build would serve each benchmark call (recorded on ``meta`` tensors)."""
    import ninefold.ops  # noqa: F401
    import ninefold.ops.triton  # noqa: F401
    from ninefold.ops import build, dispatch, registry
    from ninefold.ops.triton import aot, launch, prebuilt

    active = build.Build.load(directory)
    lib = prebuilt.Library(directory, active.target, active.uncovered)
    rows = []
    with aot.sized_as(aot.TARGET_SMS.get(active.target, 132)):
        for op in ops:
            case = pick_case(op, "meta", getattr(torch, DTYPE))
            impl = next(i for i in registry.all_implementations(op) if i.name == "triton")
            with launch.recording() as calls:
                impl.fn(*dispatch.operator(op).bind(*case.args, **case.kwargs))
            for kernel, values, warps, stages in calls:
                binary, why = lib.find(kernel, values, warps, stages)
                rows.append({"op": op, "case": case.label, "kernel": kernel.fn.__name__,
                             "binary": binary.meta["binary"] if binary else None,
                             "exact": binary.meta["exact"] if binary else None, "why": why})
    return rows


def stale(directory: Path) -> list[str]:
    """Kernels whose binaries in the build at ``directory`` were compiled from another source."""
    import importlib

    from ninefold.ops import build
    from ninefold.ops.triton import prebuilt

    active = build.Build.load(directory)
    found = []
    for name, binaries in prebuilt.Library(directory, active.target).by_kernel.items():
        module, _, attr = name.partition(":")
        kernel = getattr(importlib.import_module(module), attr)
        if any(b.meta["source"] != prebuilt.source_hash(kernel) for b in binaries):
            found.append(name)
    return found


# ------------------------------------------------------------------ main
def _table(built: dict, cold: dict) -> str:
    cold_rows = {(r["op"], r["impl"]): r for r in cold.get("rows", [])}

    def fmt(value, spec, scale=1):
        return format(value * scale, spec) if isinstance(value, (int, float)) else "-"

    lines = [f"{'operator/impl':25s} {'case':14s} {'1st call ms':>11s} {'compiles':>8s} {'binary':>7s} {'rel err':>8s} "
             f"{'built us':>9s} {'jit us':>8s} {'built/jit':>9s} {'host us b/j':>11s} {'jit compiles':>12s} "
             f"{'cold 1st ms':>11s} {'cold compiles':>13s}"]
    for r in built.get("rows", []):
        label = f"{r['op']}/{r['impl']}"
        if "error" in r:
            lines.append(f"{label:25s} ERROR {r['error'][:160]}")
            continue
        used = r.get("binaries") or []
        kind = "none" if not r.get("prebuilt_launches") else ("exact" if all(b["exact"] for b in used) else "merged")
        if r.get("dsl_aot_launchers"):
            kind = "dsl aot"
        c = cold_rows.get((r["op"], r["impl"]), {})
        lines.append(f"{label:25s} {r.get('case', ''):14s} {fmt(r.get('first_call_ms'), '11.1f')} "
                     f"{fmt(r.get('compiles'), '8d')} {kind:>7s} {fmt(r.get('max_rel_error'), '8.1e')} "
                     f"{fmt(r.get('built_device_ms'), '9.1f', 1e3)} {fmt(r.get('jit_device_ms'), '8.1f', 1e3)} "
                     f"{fmt(r.get('built_over_jit'), '9.3f')} "
                     f"{fmt(r.get('built_host_us'), '5.0f') + '/' + fmt(r.get('jit_host_us'), '<5.0f'):>11s} "
                     f"{fmt(r.get('jit_compiles_after_build_off'), '12d')} "
                     f"{fmt(c.get('first_call_ms'), '11.1f')} {fmt(c.get('compiles'), '13d')}")
        if r.get("jit_error"):
            lines.append(f"{'':25s} JIT comparison failed: {r['jit_error'][:160]}")
        elif r.get("jit_note"):
            lines.append(f"{'':25s} note: {r['jit_note']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.ops_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, help="a build of this benchmark's manifest (default: build one here)")
    parser.add_argument("--write", type=Path, metavar="DIR", help="only build the manifest for --target into DIR")
    parser.add_argument("--target", default="cuda:90", help="target of --write (default cuda:90)")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, metavar="OP")
    parser.add_argument("--dsl", nargs="*", default=list(DSL_OPS), choices=DSL_OPS, metavar="OP",
                        help="operators whose DSL implementation is built and measured too (none: --dsl)")
    parser.add_argument("--dry-run", action="store_true", help="only show which Triton binary serves each call")
    args = parser.parse_args(argv)
    if args.write:
        print(write_build(args.write, args.target, args.ops, args.dsl).summary())
        return 0
    if args.dry_run:
        if args.build is None:
            parser.error("--dry-run needs --build DIR")
        rows = dry_run(args.build, args.ops)
        for r in rows:
            print(f"{r['op']:18s} {r['kernel']:24s} {r['binary'] or 'JIT: ' + r['why']} {'(exact)' if r['exact'] else ''}")
        return 0 if all(r["binary"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("ops_build: needs a CUDA GPU (use --write or --dry-run here)", file=sys.stderr)
        return 2
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    pairs = entries(args.ops, args.dsl)
    result = {"entries": pairs, "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    import triton

    result["triton"] = triton.__version__
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        directory = args.build
        if directory is not None and directory.exists() and stale(directory):
            result["stale_build"] = {"dir": str(directory), "kernels": stale(directory)}
            print(f"ops_build: {directory} is stale (kernel sources changed since it was built: "
                  f"{', '.join(result['stale_build']['kernels'])}); building here instead", file=sys.stderr)
            directory = None
        if directory is None or not directory.exists():
            major, minor = torch.cuda.get_device_capability()
            directory = tmp / "build"
            start = time.perf_counter()
            write_build(directory, f"cuda:{major}{minor}", args.ops, args.dsl)
            result["built_here_s"] = time.perf_counter() - start
        manifest = json.loads((directory / "manifest.json").read_text())
        result["build"] = {"dir": str(directory), "target": manifest["target"], "versions": manifest.get("versions")}
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "NINEFOLD_OPS_BUILD")}
        # Each child with its own empty Triton cache and ninefold cache (DSL tuning choices, stored keys).
        result["built"] = _spawn(pairs, {**env, "NINEFOLD_OPS_BUILD": str(directory),
                                         "TRITON_CACHE_DIR": str(tmp / "cache-built"),
                                         "NINEFOLD_CACHE_DIR": str(tmp / "nf-built")}, True, tmp)
        result["cold"] = _spawn(pairs, {**env, "TRITON_CACHE_DIR": str(tmp / "cache-cold"),
                                        "NINEFOLD_CACHE_DIR": str(tmp / "nf-cold")}, False, tmp)
    table = _table(result["built"], result["cold"])
    print(f"trimmed build {result['build']['dir']} (target {result['build']['target']}, built with "
          f"{(result['build'].get('versions') or {}).get('triton', '?')}) on {result['device']}, Triton {result['triton']}")
    print(table)
    rows = result["built"].get("rows", [])
    ok = bool(rows)
    for name in sorted({r["impl"] for r in rows}):
        mine = [r for r in rows if r["impl"] == name]
        good = all(r.get("compiles") == 0 and r.get("correct") for r in mine)
        ok = ok and good
        print(f"{name}: compiles: " + (f"0 on every first call, all {len(mine)} correct" if good else
                                       "NOT all zero or not all correct (see the table)"))
    for name in ("built", "cold"):
        if result[name]["returncode"]:
            print(f"{name} process failed:\n{result[name]['stderr_tail']}", file=sys.stderr)
            ok = False
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ops_build.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "ops_build.md").write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
