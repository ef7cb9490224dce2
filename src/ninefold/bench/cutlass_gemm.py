"""CUTLASS's Hopper GEMMs against cuBLAS at the decode step's shapes (Llama-3.1-8B, bfloat16).

    python -m ninefold.ops.cutlass.build            # once: nvcc + CUTLASS headers, no GPU needed
    OUT=DIR python -m ninefold.bench.cutlass_gemm   # one Hopper GPU, about a minute

For each layer (``decode_gemm.SHAPES``) and row count, every configuration of ``ninefold.ops.cutlass``
with every decomposition it offers (data-parallel; split-K in 2, 3, 4; stream-K) is checked against a
float32 product, then timed like ``decode_gemm`` times cuBLAS (a CUDA graph over rotating weight
copies, so the weight streams from memory). Prints, per shape, cuBLAS, the best CUTLASS candidate and
both against the bound (max(weight bytes / copy bandwidth, FLOPs / cuBLAS rate)), and writes every
candidate's time to ``$OUT/cutlass_gemm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ninefold.bench.decode_gemm import BATCHES, SHAPES, bound_us, ceilings, decode_cases, relative_error
from ninefold.bench.results import pyplot


def time_candidate(fn, x, weights, want, device) -> float | str:
    """Microseconds per call of ``fn(x, w)`` over ``weights`` in a CUDA graph, or why it was not timed."""
    from ninefold.bench.decode_attention import graph_time

    try:
        err = relative_error(fn(x, weights[0]), want)
    except Exception as e:  # a configuration that cannot run this shape: say why, keep going
        return f"{type(e).__name__}: {str(e)[:100]}"
    if not err < 2e-2:
        return f"wrong (relative error {err:.3g})"
    return round(graph_time([lambda w=w: fn(x, w) for w in weights], device, 50), 2)


def run(batches, layers) -> dict:
    from ninefold.ops.cutlass import binding, build
    from ninefold.ops.cutlass.tuning import candidates, describe

    device = torch.device("cuda")
    bw, rate = ceilings(device)
    configs = build.CONFIGS
    cands = candidates()
    rows = []
    for layer, m, n, k, x, weights, want in decode_cases(batches, layers, device):
        bound = bound_us(m, n, k, bw, rate)
        vendor = time_candidate(lambda a, w: F.linear(a, w), x, weights, want, device)

        def cutlass(a, w, c=None):
            out = torch.empty(a.shape[0], w.shape[0], device=a.device, dtype=a.dtype)
            return binding.matmul(a, w, out, *c)

        times = {describe(c): time_candidate(lambda a, w, c=c: cutlass(a, w, c), x, weights, want, device)
                 for c in cands}
        timed = {name: t for name, t in times.items() if isinstance(t, float)}
        best = min(timed, key=timed.get) if timed else None
        rows.append({"layer": layer, "m": m, "n": n, "k": k, "bound_us": round(bound, 2), "cublas_us": vendor,
                     "best": best, "best_us": timed.get(best), "candidates": times})
        cublas = f"{vendor:7.2f} us ({bound / vendor:4.0%})" if isinstance(vendor, float) else str(vendor)
        mine = (f"{timed[best]:7.2f} us ({bound / timed[best]:4.0%}) {best}; "
                f"{vendor / timed[best]:.2f}x cuBLAS" if best and isinstance(vendor, float) else "none ran")
        print(f"{layer:8s} M={m:<4d} bound {bound:7.2f} us  cuBLAS {cublas}  CUTLASS best {mine}", flush=True)
    return {"device": torch.cuda.get_device_name(device), "copy_GBps": bw / 1e9, "matmul_TFLOPs": rate / 1e12,
            "configs": [c.name for c in configs], "rows": rows}


def plot(results: dict, path: str | Path) -> None:
    """Per layer, cuBLAS and the best CUTLASS candidate as a fraction of the bound, against the row count."""
    plt = pyplot()
    if plt is None:
        return
    layers = list(dict.fromkeys(row["layer"] for row in results["rows"]))
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.2), sharey=True, squeeze=False)
    for ax, layer in zip(axes[0], layers):
        rows = [r for r in results["rows"] if r["layer"] == layer]
        for key, label in (("cublas_us", "cuBLAS"), ("best_us", "CUTLASS, best configuration")):
            points = [(r["m"], r["bound_us"] / r[key]) for r in rows if isinstance(r.get(key), float)]
            ax.plot(*zip(*points), marker="o", label=label)
        n, k = rows[0]["n"], rows[0]["k"]
        ax.set_title(f"{layer} ({n} x {k})", fontsize=9)
        ax.set_xlabel("rows (sequences in the step)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of the bound")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"bf16 decode GEMMs on {results['device']} (bound: max(weight bytes / copy bandwidth, "
                 "FLOPs / cuBLAS rate))", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.cutlass_gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help=f"comma-separated row counts (default {','.join(map(str, BATCHES))})")
    parser.add_argument("--layers", default=",".join(SHAPES), help=f"comma-separated of {','.join(SHAPES)}")
    parser.add_argument("--plot-from", metavar="JSON", default=None,
                        help="draw the plot of an earlier run's cutlass_gemm.json next to it; measures nothing")
    args = parser.parse_args(argv)
    if args.plot_from:
        source = Path(args.plot_from)
        plot(json.loads(source.read_text()), source.with_suffix(".png"))
        print(source.with_suffix(".png"))
        return 0
    layers = args.layers.split(",")
    unknown = [name for name in layers if name not in SHAPES]
    if unknown:
        parser.error(f"--layers: unknown {unknown}; expected names from {list(SHAPES)}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("ninefold.bench.cutlass_gemm needs a Hopper (sm_90) GPU; nothing measured.", file=sys.stderr)
        return 2
    from ninefold.ops.cutlass import binding

    reason = binding.unavailable()
    if reason:
        print(f"ninefold.bench.cutlass_gemm: {reason}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = run(batches, layers)
    results["seconds"] = round(time.perf_counter() - start, 1)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "cutlass_gemm.json").write_text(json.dumps(results, indent=1))
        plot(results, Path(out) / "cutlass_gemm.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
