"""Operator benchmark: every implementation of every operator at a model's shapes.

    python -m ninefold.bench.ops                      # GPU: Llama-3-8B shapes, bfloat16
    python -m ninefold.bench.ops --device cpu --shapes smollm2

For each call it first checks every implementation (and peer) against the vendor one, then
times them: microseconds, GB/s or TFLOP/s, the fraction of this card's measured ceiling (copy
bandwidth, bf16 matmul rate), which implementation dispatch chooses and how far that is from
the fastest. GPU times are device time (``ninefold.ops.timing``: calls queued back to back, as
the engine's CUDA-graph replays run them), so a small call is measured by its kernels, not by the
host time of launching it; the dispatch overhead is measured separately. FlagGems and Liger run as peers where they are importable and have the operator.
Also measures dispatch's warm-path overhead per operator. Writes results.json, results.md, a
tuning table in the shipped format (``tuning-<device>.json``) and roofline.png under $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import ninefold.ops as ops
from ninefold.ops import dispatch, timing, workloads
from ninefold.ops.spec import dtype_name

ORDER = ["attention_decode", "attention_prefill", "rms_norm", "add_rms_norm", "softmax", "silu_and_mul", "rope",
         "reshape_and_cache", "rope_and_cache", "rope_cache_attention_decode", "add", "mul", "gelu_and_mul", "embedding",
         "argmax", "sample", "linear", "add_rms_norm_linear", "silu_and_mul_linear"]
COMPUTE_BOUND = {"linear", "attention_prefill"}


def ceilings(device: torch.device) -> dict:
    """Measured copy bandwidth (bytes read + written per second) and bf16 matmul rate on ``device``."""
    n = (1 << 29) if device.type == "cuda" else (1 << 25)
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_us = timing.measure(lambda: dst.copy_(src), device, repeats=20)
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_us = timing.measure(lambda: a @ a, device, repeats=10)
    return {"copy_GBps": 2 * n * 2 / copy_us / 1e3, "mm_TFLOPs": 2 * size**3 / mm_us / 1e6}


def peers(op: str) -> dict:
    """FlagGems / Liger callables taking the operator's bound arguments, where they exist."""
    found = {}
    try:
        from flag_gems import fused
        from flag_gems import ops as gems

        direct = {
            "add": gems.add, "mul": gems.mul, "argmax": lambda x, dim: gems.argmax(x, dim),
            "rms_norm": lambda x, w, eps: gems.rms_norm(x, (x.shape[-1],), w, eps),
            "softmax": lambda x, dim: gems.softmax(x, dim),
            "embedding": lambda ids, weight: gems.embedding(weight, ids),
            "linear": lambda x, w, bias: gems.mm(x.reshape(-1, x.shape[-1]), w.T),
            "silu_and_mul": lambda x: fused.silu_and_mul(*x.chunk(2, -1)),
            "add_rms_norm": lambda x, r, w, eps: fused.fused_add_rms_norm(x, r, (x.shape[-1],), w, eps),
        }
        if op in direct:
            found["flaggems"] = direct[op]
    except Exception:  # noqa: BLE001  (a peer that fails to import is simply absent)
        pass
    try:
        from liger_kernel.ops import fused_add_rms_norm, rms_norm, softmax, swiglu

        if op == "rms_norm":
            found["liger"] = lambda x, w, eps: rms_norm.LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        elif op == "add_rms_norm":
            found["liger"] = lambda x, r, w, eps: fused_add_rms_norm.LigerFusedAddRMSNormFunction.apply(
                x, r, w, eps, 0.0, "llama", False)
        elif op == "silu_and_mul":
            found["liger"] = lambda x: swiglu.LigerSiLUMulFunction.apply(*x.chunk(2, -1))
        elif op == "softmax":
            found["liger"] = lambda x, dim: softmax.LigerSoftmaxFunction.apply(x)
    except Exception:  # noqa: BLE001
        pass
    return found


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def check(op: str, fn, bound, want) -> str | None:
    """``None`` when ``fn(*bound)`` matches the vendor output ``want``, else what differs."""
    if op in ("sample", "reshape_and_cache") or want is None:
        return None
    got = _first(fn(*bound))
    if op == "argmax":
        x = bound[0]
        return None if torch.equal(x.gather(-1, got[..., None]), x.gather(-1, want[..., None])) else "different maxima"
    tol = 5e-2 if got.dtype != torch.float32 else 2e-3
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.float() - want.float()).abs() / (want.float().abs() + 1)).max().item()
    return None if err <= tol else f"max relative error {err:.3g}"


def overhead(device: torch.device, dtype: torch.dtype) -> dict:
    """Warm-path dispatch overhead per operator: public call minus direct call, microseconds."""
    result = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny CPU ops: keep thread-pool wake-ups out of a Python-overhead measurement
    shapes = workloads.shapes("tiny")
    for op in ORDER:
        case = next(workloads.cases(op, shapes, device, dtype))
        bound = dispatch.operator(op).bind(*case.args, **case.kwargs)
        impl = dispatch.resolve(op, dispatch.operator(op).keyfn(*bound), bound)
        public = getattr(ops, op)

        direct = _per_call(lambda fn=impl.fn, bound=bound: fn(*bound), device)
        routed = _per_call(lambda fn=public, case=case: fn(*case.args, **case.kwargs), device)
        operator = dispatch.operator(op)
        public(*case.args, **case.kwargs)  # warm: the key's choice is cached
        # What dispatch adds on the warm path, timed alone (free of the kernel's own noise): the
        # argument signature and one lookup (validation ran once, when the signature was new).
        assert dispatch.signature(bound) in operator.cache, f"{op}: the warm call missed the cache"
        added = _per_call(lambda o=operator, b=bound: o.cache.get(dispatch.signature(b)), torch.device("cpu"), n=1000)
        result[op] = {"impl": impl.name, "direct_us": round(direct, 2), "dispatch_us": round(routed, 2),
                      "overhead_us": round(added, 2)}
    torch.set_num_threads(threads)
    return result


FIRST_CALL = """
import time, torch, ninefold.ops as ops
x, w = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16), torch.ones(4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
start = time.perf_counter()
with ops.use(rms_norm="triton"):
    ops.rms_norm(x, w, 1e-5)
torch.cuda.synchronize()
print((time.perf_counter() - start) * 1e3)
"""


def first_call() -> dict:
    """First ``rms_norm`` call (ms) in a fresh process: from a trimmed build vs a cold Triton cache."""
    import subprocess
    import sys
    import tempfile

    from ninefold.ops import build

    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "ops.toml"
        manifest.write_text(f'target = "cuda:{major}{minor}"\n[ops.rms_norm]\ndtypes = ["bfloat16"]\nimpls = ["triton"]\n')
        build.build(manifest, Path(tmp) / "build")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
        built = subprocess.run([sys.executable, "-c", FIRST_CALL], env={**env, "NINEFOLD_OPS_BUILD": f"{tmp}/build"},
                               capture_output=True, text=True, check=True)
        cold = subprocess.run([sys.executable, "-c", FIRST_CALL], env={**env, "TRITON_CACHE_DIR": f"{tmp}/cold"},
                              capture_output=True, text=True, check=True)
    return {"built_ms": float(built.stdout.split()[-1]), "cold_ms": float(cold.stdout.split()[-1])}


def _per_call(fn, device: torch.device, n: int = 100) -> float:
    """Best-of-5 average microseconds per call of ``fn`` (GPU work included once queued)."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    shapes_name = args.shapes or ("llama-8b" if device.type == "cuda" else "smollm2")
    shapes = workloads.shapes(shapes_name)
    model = dispatch.device_model(device)
    deadline = time.perf_counter() + args.budget
    print(f"ninefold.bench.ops on {model} ({device}), {shapes_name}, {dtype_name(dtype)}")
    ceiling = ceilings(device)
    print(f"ceilings: copy {ceiling['copy_GBps']:.4g} GB/s, bf16 matmul {ceiling['mm_TFLOPs']:.4g} TFLOP/s")
    rows, skipped = [], []
    for op in [o for o in ORDER if not args.ops or o in args.ops]:
        for case in workloads.cases(op, shapes, device, dtype):
            if time.perf_counter() > deadline:
                skipped.append(f"{op} {case.label}")
                continue
            rows.append(bench_case(case, device, ceiling, set(args.skip)))
            print_row(rows[-1])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results = {"device": model, "torch": torch.__version__, "shapes": shapes_name, "dtype": dtype_name(dtype),
               "ceilings": ceiling, "rows": rows, "skipped_for_time": skipped,
               "overhead": overhead(device, dtype), "command": "python -m ninefold.bench.ops " + " ".join(args.argv)}
    if device.type == "cuda" and time.perf_counter() < deadline + 80:
        try:
            results["first_call"] = first_call()
            print(f"first rms_norm call in a fresh process: trimmed build {results['first_call']['built_ms']:.1f} ms, "
                  f"cold Triton cache {results['first_call']['cold_ms']:.1f} ms")
        except Exception as error:  # noqa: BLE001  (reported, not fatal)
            results["first_call"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    print("dispatch warm-path overhead (us):",
          ", ".join(f"{k} {v['overhead_us']:.1f}" for k, v in results["overhead"].items()))
    return results


def bench_case(case, device, ceiling, skip=frozenset()) -> dict:
    operator = dispatch.operator(case.op)
    bound = operator.bind(*case.args, **case.kwargs)
    key = operator.keyfn(*bound)
    impls = {i.name: i.fn for i in dispatch.supporting(case.op, key[0], key[1], bound)}
    candidates = {n: f for n, f in {**impls, **peers(case.op)}.items() if f"{case.op}:{n}" not in skip}
    want = _first(impls["vendor"](*bound)) if "vendor" in impls else None
    row = {"op": case.op, "case": case.label, "bytes": case.bytes, "flops": case.flops, "bucket": list(key[2]),
           "choice": dispatch.resolve(case.op, key, bound).name, "impls": {}}
    for name, fn in candidates.items():
        entry = {"peer": name not in impls}
        args = bound
        if entry["peer"]:  # peers may work in place (FlagGems' fused_add_rms_norm): give them copies
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in bound)
        try:
            problem = check(case.op, fn, args, want)
            if problem:
                entry["wrong"] = problem
            us = timing.measure(lambda fn=fn, args=args: fn(*args), device, repeats=20, max_seconds=0.5)
        except Exception as error:  # noqa: BLE001  (a failing peer or kernel is reported, not fatal)
            entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            row["impls"][name] = entry
            continue
        entry["us"] = round(us, 3)
        if case.flops:
            entry["TFLOPs"] = case.flops / us / 1e6
        if case.bytes:
            entry["GBps"] = case.bytes / us / 1e3
        bound_by = "TFLOPs" if case.op in COMPUTE_BOUND and case.flops else "GBps"
        peak = ceiling["mm_TFLOPs"] if bound_by == "TFLOPs" else ceiling["copy_GBps"]
        if bound_by in entry:
            entry["fraction"] = entry[bound_by] / peak
        row["impls"][name] = entry
    ours = {n: e["us"] for n, e in row["impls"].items() if not e["peer"] and "us" in e and "wrong" not in e}
    if ours:
        row["fastest"] = min(ours, key=ours.get)
        row["choice_vs_fastest"] = ours.get(row["choice"], float("nan")) / ours[row["fastest"]]
    return row


def print_row(row: dict) -> None:
    parts = []
    for name, e in sorted(row["impls"].items(), key=lambda kv: kv[1].get("us", 1e18)):
        if "us" not in e:
            parts.append(f"{name} ERROR")
            continue
        rate = f"{e['TFLOPs']:.0f}TF/s" if row["op"] in COMPUTE_BOUND and "TFLOPs" in e else (
            f"{e['GBps']:.0f}GB/s" if "GBps" in e else "")
        frac = f" {e['fraction'] * 100:.0f}%" if "fraction" in e else ""
        parts.append(f"{name} {e['us']:.1f}us {rate}{frac}{' WRONG' if 'wrong' in e else ''}")
    ratio = row.get("choice_vs_fastest")
    print(f"{row['op']:18s} {row['case']:32s} choice={row['choice']:7s}"
          f"{'' if ratio is None else f' ({ratio:.2f}x best)'} | " + " | ".join(parts))


def markdown(results: dict) -> str:
    """The results as a Markdown table (for docs/perf/ops.md)."""
    names = sorted({n for r in results["rows"] for n in r["impls"]})
    lines = [f"Device: {results['device']}, torch {results['torch']}, shapes {results['shapes']}, {results['dtype']}. "
             f"Ceilings: copy {results['ceilings']['copy_GBps']:.0f} GB/s, bf16 matmul "
             f"{results['ceilings']['mm_TFLOPs']:.0f} TFLOP/s.", "",
             "| op | case | choice | choice / best | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in results["rows"]:
        cells = []
        for n in names:
            e = r["impls"].get(n)
            if e is None:
                cells.append("")
            elif "us" not in e:
                cells.append("error")
            else:
                frac = f" ({e['fraction'] * 100:.0f}%)" if "fraction" in e else ""
                cells.append(f"{e['us']:.1f} us{frac}{' WRONG' if 'wrong' in e else ''}")
        ratio = r.get("choice_vs_fastest")
        lines.append(f"| {r['op']} | {r['case']} | {r['choice']} | {'' if ratio is None else f'{ratio:.2f}'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Dispatch warm-path overhead on tiny inputs: a direct call of the chosen implementation, the public call, "
              "and what dispatch adds on the warm path timed alone (argument signature + cached lookup):",
              "", "| op | impl | direct us | via dispatch us | dispatch work us |", "|---|---|---|---|---|"]
    for op, o in results["overhead"].items():
        lines.append(f"| {op} | {o['impl']} | {o['direct_us']} | {o['dispatch_us']} | {o['overhead_us']} |")
    if "first_call" in results:
        lines += ["", f"First call into a built kernel (fresh process): {results['first_call']}"]
    return "\n".join(lines) + "\n"


def tuning_entries(results: dict) -> list[dict]:
    """Winners among ninefold's own implementations, in the tuning-table format."""
    entries = []
    for r in results["rows"]:
        times = {n: e["us"] for n, e in r["impls"].items() if not e["peer"] and "us" in e and "wrong" not in e}
        if times:
            entries.append({"op": r["op"], "device": results["device"], "dtype": results["dtype"], "bucket": r["bucket"],
                            "impl": min(times, key=times.get), "times_us": times, "case": r["case"]})
    return entries


def roofline(results: dict, path: Path) -> None:
    """Two panels: compute-bound calls on the roofline, memory-bound calls against copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw, peak = results["ceilings"]["copy_GBps"], results["ceilings"]["mm_TFLOPs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6))
    xs = [2**i for i in range(-4, 13)]
    left.plot(xs, [min(peak, bw * x / 1e3) for x in xs], "k-", label="roofline (copy BW, bf16 mm)")
    labels = sorted({f"{r['op']}:{n}" for r in results["rows"] for n in r["impls"]})
    colors = {label: plt.cm.tab20(i % 20) for i, label in enumerate(labels)}
    markers = {label: "os^vD"[i // 20 % 5] for i, label in enumerate(labels)}
    for r in results["rows"]:
        for name, e in r["impls"].items():
            if "us" not in e:
                continue
            label = f"{r['op']}:{name}"
            style = {"s": 16, "color": colors[label], "marker": markers[label], "label": label}
            if r["op"] in COMPUTE_BOUND and r["flops"]:
                intensity = r["flops"] / r["bytes"] if r["bytes"] else peak * 1e3 / bw * 4
                left.scatter(intensity, e["TFLOPs"], **style)
            elif r["bytes"]:
                right.scatter(r["bytes"], e["GBps"], **style)
    right.axhline(bw, color="k", label="copy bandwidth")
    for ax, title in ((left, "FLOP-bound calls (TFLOP/s vs FLOP/byte)"), (right, "memory-bound calls (GB/s vs bytes)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=5, ncol=2)
    fig.suptitle(f"ninefold.ops on {results['device']} ({results['shapes']}, {results['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.ops", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--shapes", default=None, help="llama-8b (GPU default), smollm2 (CPU default), tiny")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--ops", nargs="+", default=None)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds before remaining cases are skipped")
    parser.add_argument("--skip", nargs="*", default=["linear:dsl", "linear:flaggems"],
                        help="op:impl pairs not to run (default linear:dsl and linear:flaggems, whose autotuning "
                             "over 15 shapes takes minutes; pass --skip with nothing to run everything)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="results directory (default $OUT)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    results = run(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(markdown(results))
        slug = "".join(c if c.isalnum() else "-" for c in results["device"].lower()).strip("-")
        table = {"format": 1, "versions": ops.tuning.versions(), "entries": tuning_entries(results)}
        (out / f"tuning-{slug}.json").write_text(json.dumps(table, indent=1))
        roofline(results, out / "roofline.png")
        print(f"wrote {out}/results.json, results.md, tuning-{slug}.json, roofline.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
