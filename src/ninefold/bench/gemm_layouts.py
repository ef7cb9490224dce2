"""cuBLAS on the decode GEMMs with the weight stored three ways: which layout gets the best kernels at 64-256 rows.

    OUT=DIR python -m ninefold.bench.gemm_layouts [--batches 64,128,...] [--layers qkv,o,down,gate_up]

``y = x W^T`` for Llama-3.1-8B's layer shapes (``decode_gemm.SHAPES``), bfloat16, timed as CUDA graphs over
rotating weight copies (``decode_gemm``'s method), each layout first checked against a float32 product:

* ``tn``: ``F.linear(x, W)``, W ``[N, K]`` row-major (what the engine runs);
* ``nn``: ``x @ Wt``, the weight stored transposed, ``Wt`` ``[K, N]`` contiguous;
* ``swap``: ``(W @ x^T)^T``: cuBLAS computes ``y^T`` ``[N, M]``, the weight's N as its long M side, and the
  timed call includes the copy of ``y^T`` back into a row-major ``[M, N]``.

cuBLAS's heuristics choose kernels per layout; at 128-256 rows the engine's ``tn`` GEMMs for o and qkv run
at about half their bound (docs/perf/llm.md). A diagnostic: prints a table, writes ``$OUT/gemm_layouts.json``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from ninefold.bench.decode_gemm import SHAPES, bound_us, ceilings, decode_cases, relative_error
from ninefold.bench.results import write_json

LAYOUTS = ("tn", "nn", "swap")


def layout_call(layout: str, x: torch.Tensor, w: torch.Tensor):
    """The ``layout`` form of ``x @ w.T`` as a no-argument call, and the weight form it holds."""
    if layout == "tn":
        return lambda: F.linear(x, w)
    if layout == "nn":
        wt = w.t().contiguous()
        return lambda: torch.mm(x, wt)
    if layout == "swap":
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        return lambda: out.copy_(torch.mm(w, x.t()).t())
    raise ValueError(f"layout: got {layout!r}; supported: {', '.join(LAYOUTS)}")


def run(batches: list[int], names: list[str]) -> dict:
    from ninefold.bench.decode_attention import graph_time

    device = torch.device("cuda")
    bw, rate = ceilings(device)
    rows = []
    for layer, m, n, k, x, weights, want in decode_cases(batches, names, device):
        bound = bound_us(m, n, k, bw, rate)
        row = {"layer": layer, "m": m, "n": n, "k": k, "bound_us": round(bound, 2)}
        for layout in LAYOUTS:
            calls = [layout_call(layout, x, w) for w in weights]
            err = relative_error(calls[0](), want)
            if not err < 2e-2:
                row[layout] = f"wrong (relative error {err:.3g})"
                continue
            row[layout] = round(graph_time(calls, device, 50), 2)
        rows.append(row)
        cells = "  ".join(f"{lay} {row[lay]:7.2f} us ({bound / row[lay]:4.0%})" if isinstance(row[lay], float)
                          else f"{lay} {row[lay]}" for lay in LAYOUTS)
        print(f"{layer:8s} M={m:<4d} bound {bound:7.2f} us  {cells}", flush=True)
    return {"device": torch.cuda.get_device_name(device), "copy_GBps": bw / 1e9, "matmul_TFLOPs": rate / 1e12,
            "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.gemm_layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,96,128,160,192,208,224,256")
    parser.add_argument("--layers", default="qkv,o,down,gate_up")
    args = parser.parse_args(argv)
    unknown = [name for name in args.layers.split(",") if name not in SHAPES]
    if unknown:
        parser.error(f"--layers: got {unknown}; known: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("ninefold.bench.gemm_layouts needs a CUDA device; nothing measured.", file=sys.stderr)
        return 2
    results = run([int(b) for b in args.batches.split(",")], args.layers.split(","))
    write_json("gemm_layouts.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
