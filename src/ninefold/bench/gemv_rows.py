"""The few-rows GEMV against cuBLAS and the unfused pair: ``python -m ninefold.bench.gemv_rows`` (GPU).

For each Llama-3.1-8B decode layer (q/k/v and gate_up with the residual add + RMSNorm before them, o,
down with the SwiGLU gate before it, the output layer) at 2, 4, 8, 16 and 32 rows: the time per call of
what the engine runs without the few-rows GEMV (the operators' norm or activation kernel, then
``F.linear``) and of each ``ninefold.ops.triton.gemv_rows`` configuration (with PDL where available),
as CUDA graphs of back-to-back calls that cycle through copies of the weight so that L2 does not
serve it. Every configuration is checked against a float32 product before it is timed.

Prints a table; writes ``$OUT/gemv_rows.json`` (every timing) and ``$OUT/gemv_rows_table.json`` (per
layer and rows bucket, the fastest configuration, or ``[]`` where the unfused pair was faster), which
``NINEFOLD_GEMV_ROWS_TABLE`` reads.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch
import torch.nn.functional as F

from ninefold.bench.decode_chain import _tuning_inputs
from ninefold.bench.results import write_json

# (name, N, K, prologue) of the Llama-3.1-8B layers a decode step runs.
LAYERS = (("qkv", 6144, 4096, "add_rms_norm"), ("o", 4096, 4096, "none"), ("gate_up", 28672, 4096, "add_rms_norm"),
          ("down", 4096, 14336, "silu_and_mul"), ("lm_head", 128256, 4096, "none"))
ROWS = (2, 4, 8, 16, 32)
EPS = 1e-5


def candidates(n: int, k: int) -> list[tuple]:
    """(block_n, block_k, split_k, num_warps, num_stages) tried for an ``[n, k]`` weight."""
    splits = (1, 2, 4) if n < 8192 else (1,)
    widths = (32, 64) if n > 100_000 else (16, 32, 64)
    return [(bn, 256, sk, 4, ns) for bn, sk, ns in itertools.product(widths, splits, (3, 4)) if k % (256 * sk) == 0]


def _unfused(kw: dict, w: torch.Tensor, prologue: str) -> torch.Tensor:
    """What the engine runs without the few-rows GEMV: the operator before the product, then cuBLAS."""
    import ninefold.ops as ops

    if prologue == "add_rms_norm":
        x, _ = ops.add_rms_norm(kw["x"], kw["residual"], kw["norm_weight"], EPS)
    elif prologue == "silu_and_mul":
        x = ops.silu_and_mul(kw["x"])
    else:
        x = kw["x"]
    return F.linear(x, w)


def graph_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds per call of ``fn`` (``calls`` back-to-back calls captured in one CUDA graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return best


def bench_layer(name: str, n: int, k: int, prologue: str, rows: int, copies: list[torch.Tensor], pdl: bool,
                bandwidth: float) -> dict:
    """The unfused pair and every candidate for one layer at ``rows`` rows."""
    from ninefold.ops.triton.gemv_rows import gemv_rows

    w0 = copies[0]
    kw, xin = _tuning_inputs(w0, prologue, EPS, rows)
    want = xin @ w0.float().T
    calls = 2 * len(copies)
    row = {"layer": name, "n": n, "k": k, "prologue": prologue, "rows": rows,
           "bound_us": n * k * w0.element_size() / bandwidth * 1e6}
    row["unfused_us"] = graph_us(lambda i: _unfused(kw, copies[i % len(copies)], prologue), calls)
    x = kw["x"]

    def args_of(cfg):
        bn, bk, sk, nw, ns = cfg
        args = {key: v for key, v in kw.items() if key != "x"}
        args.update(split_k=sk, pdl=pdl, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        return args

    row.update(time_configs(candidates(n, k), args_of, lambda a, i: gemv_rows(x, copies[i % len(copies)], **a),
                            want, calls))
    return row


def time_configs(configs, args_of, call, want: torch.Tensor, calls: int) -> dict:
    """Each launch configuration checked, then timed: ``call(args_of(cfg), i)`` runs it on copy ``i`` of the weight
    (copy 0 is checked against ``want``, relative error below 2e-2), then ``calls`` back-to-back calls are timed as a
    graph. Returns ``{"configs": [...], "best": config, "best_us": us}`` (no best when none ran)."""
    out: dict = {"configs": []}
    for cfg in configs:
        args = args_of(cfg)
        entry = {"config": list(cfg)}
        try:
            y = call(args, 0)
            err = ((y.float().reshape(-1) - want.reshape(-1)).abs().max() / want.abs().max()).item()
            if not err < 2e-2:
                raise AssertionError(f"relative error {err:.3g}")
            entry["us"] = graph_us(lambda i, a=args: call(a, i), calls)
        except Exception as error:  # reported per configuration; the others still run
            entry["error"] = repr(error)[:300]
        out["configs"].append(entry)
    timed = [c for c in out["configs"] if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        out["best"], out["best_us"] = best["config"], best["us"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.gemv_rows", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default=",".join(name for name, *_ in LAYERS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--plain", action="store_true",
                        help="every layer without its prologue (the norm or gate left to its own kernel)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ninefold.bench.gemv_rows needs a CUDA device; nothing measured.", file=sys.stderr)
        return 2
    from ninefold.ops.triton import gemv_pdl
    from ninefold.runtime.profile import profile_device

    wanted = set(args.layers.split(","))
    rows_list = [int(r) for r in args.rows.split(",")]
    pdl = gemv_pdl.pdl_available()
    bandwidth = profile_device("cuda").bandwidth["copy"]
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s, PDL {'on' if pdl else 'off'}")
    torch.manual_seed(0)
    results, table, t0 = [], [], time.perf_counter()
    for name, n, k, prologue in LAYERS:
        if name not in wanted:
            continue
        if args.plain and prologue != "none":  # the fused form is declined: its norm or gate runs on its own
            table.extend({"n": n, "k": k, "prologue": prologue, "rows": r, "config": []} for r in rows_list)
            prologue = "none"
        count = max(2, math.ceil((256 << 20) / (n * k * 2)))
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(count)]
        for rows in rows_list:
            row = bench_layer(name, n, k, prologue, rows, copies, pdl, bandwidth)
            results.append(row)
            best = row.get("best_us", float("nan"))
            faster = best < row["unfused_us"]
            table.append({"n": n, "k": k, "prologue": prologue, "rows": rows, "config": row["best"] if faster else []})
            print(f"{name:8s} rows {rows:2d}: bound {row['bound_us']:7.1f} us | unfused {row['unfused_us']:7.1f} | "
                  f"few-rows GEMV {best:7.1f} ({row['unfused_us'] / best:.2f}x) {row.get('best')} "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        del copies
        torch.cuda.empty_cache()
    write_json("gemv_rows.json", {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "pdl": pdl,
                                  "results": results})
    write_json("gemv_rows_table.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
