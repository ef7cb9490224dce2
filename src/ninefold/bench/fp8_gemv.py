"""The one-row GEMV over FP8 weights against what FP8 decode ran before: ``python -m ninefold.bench.fp8_gemv`` (GPU).

For each Llama-3.1-8B decode layer (q/k/v and gate_up with the residual add + RMSNorm before them, o, down
with the SwiGLU gate before it; the first layer's bare q/k/v takes the one-row table's q/k/v entry) at ``--rows`` rows (1, 4 and
16 by default), the time per call of:

- ``before``: the norm or gate as its own kernel, then ``linear_fp8``'s few-rows GEMV (``triton_gemv``):
  what an FP8 model ran at 1..16 rows until the GEMVs with fused prologues took FP8 codes;
- ``bf16`` (one row): the one-row GEMV on bfloat16 weights with its shipped launch configuration and fused
  prologue (twice the bytes: the step FP8 is meant to halve);
- each candidate configuration of the one-row GEMV (``gemv_pdl(..., scales=)``) or, at 2..16 rows, the
  few-rows GEMV (``gemv_rows(..., scales=)``) on the FP8 codes, the prologue fused, with PDL where available,

as CUDA graphs of back-to-back calls cycling through copies of the weight so that L2 does not serve it.
Every configuration is checked against a float32 product of the dequantized weight before it is timed.

Prints a table; writes ``$OUT/fp8_gemv.json`` (every timing; ``--plot-from`` draws it: ``fp8_gemv.png``), ``$OUT/fp8_gemv_table.json`` (the fastest
one-row configuration of each layer where it beat ``before``, ``NINEFOLD_GEMV_TABLE`` format with
``"weight": "fp8"``) and ``$OUT/fp8_gemv_rows_table.json`` (per layer and row count, the fastest configuration
or ``[]`` where ``before`` was faster, ``NINEFOLD_GEMV_ROWS_TABLE`` format). FP8 GEMVs run only where such a
table (or ``gemv_pdl_ops.FP8_TABLE`` / ``FP8_ROWS_TABLE``) lists the call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from ninefold.bench.decode_chain import _tuning_inputs
from ninefold.bench.gemv_rows import graph_us, time_configs
from ninefold.bench.results import pyplot, write_json

# (name, N, K, prologue) of the Llama-3.1-8B layer matrices an FP8 model stores as FP8.
LAYERS = (("qkv", 6144, 4096, "add_rms_norm"), ("o", 4096, 4096, "none"), ("gate_up", 28672, 4096, "add_rms_norm"),
          ("down", 4096, 14336, "silu_and_mul"))
EPS = 1e-5
# (block_n, block_k, split_k, num_warps, num_stages, variant) as in ``gemv_pdl_ops.TABLE``: variant 0 the
# register loop, 1 tl.dot on the row padded to 16, 2 the register loop with two tiles in flight. FP8 tiles
# hold half the bytes of bfloat16 ones, so longer K steps are tried too. The tl.dot loop multiplies float16 (the codes
# widen to it in one conversion per pair: ``fp8_operand``), so it has more candidates.
CANDIDATES = [(16, 512, 1, 4, 2, 0), (16, 1024, 1, 4, 2, 0), (32, 512, 1, 4, 2, 0), (32, 1024, 1, 8, 2, 0),
              (16, 512, 2, 4, 2, 0), (16, 512, 1, 4, 2, 2), (16, 1024, 1, 4, 2, 2), (32, 512, 1, 4, 2, 2),
              (32, 512, 1, 4, 3, 1), (64, 256, 1, 4, 3, 1), (16, 512, 1, 4, 3, 1), (32, 256, 1, 4, 4, 1),
              (64, 512, 1, 8, 3, 1), (128, 256, 1, 4, 3, 1), (64, 256, 1, 4, 4, 1), (64, 128, 1, 4, 4, 1),
              (128, 128, 1, 4, 4, 1), (64, 256, 1, 8, 3, 1), (128, 256, 1, 8, 3, 1), (64, 256, 2, 4, 3, 1),
              (32, 256, 2, 4, 4, 1)]
# (block_n, block_k, split_k, num_warps, num_stages) of the few-rows GEMV (2..16 rows, tl.dot loop).
ROWS_CANDIDATES = [(32, 256, 1, 4, 4), (32, 512, 1, 4, 3), (16, 512, 1, 4, 3), (64, 256, 1, 4, 3), (32, 256, 2, 4, 4)]


def candidates(k: int, rows: int = 1) -> list[tuple]:
    """The configurations that fit K (a multiple of block_k * split_k; two tiles per split for variant 2)
    for the one-row GEMV, or the few-rows GEMV's when ``rows`` > 1."""
    if rows > 1:
        return [c for c in ROWS_CANDIDATES if k % (c[1] * c[2]) == 0]
    return [c for c in CANDIDATES if k % (c[1] * c[2]) == 0 and (c[5] != 2 or k // c[2] >= 2 * c[1])]


def _launch_args(cfg: tuple, rows: int, pdl: bool) -> dict:
    if rows > 1:
        bn, bk, sk, nw, ns = cfg
        return dict(split_k=sk, pdl=pdl, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    bn, bk, sk, nw, ns, variant = cfg
    return dict(split_k=sk, pdl=pdl, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, dot=variant == 1,
                depth=2 if variant == 2 else 1)


def _before(kw: dict, weight, prologue: str) -> torch.Tensor:
    """What FP8 decode ran at one row before: the prologue's operator, then the few-rows FP8 GEMV."""
    import ninefold.ops as ops
    from ninefold.ops.triton.fp8_gemv import linear_fp8

    if prologue == "add_rms_norm":
        x, _ = ops.add_rms_norm(kw["x"], kw["residual"], kw["norm_weight"], EPS)
    elif prologue == "silu_and_mul":
        x = ops.silu_and_mul(kw["x"])
    else:
        x = kw["x"]
    return linear_fp8(x.reshape(-1, x.shape[-1]), weight)


def bench_layer(name: str, n: int, k: int, prologue: str, rows: int, copies: list, dense: list[torch.Tensor],
                pdl: bool, bandwidth: float) -> dict:
    """``before``, ``bf16`` and every FP8 candidate for one layer at ``rows`` rows."""
    from ninefold.ops.triton import gemv_pdl_ops
    from ninefold.ops.triton.gemv_pdl import gemv_pdl
    from ninefold.ops.triton.gemv_rows import gemv_rows

    gemv = gemv_rows if rows > 1 else gemv_pdl
    w0 = copies[0]
    kw, xin = _tuning_inputs(torch.empty(0, k, dtype=torch.bfloat16, device="cuda"), prologue, EPS,
                             rows if rows > 1 else None)
    want = (xin @ w0.dequantize(torch.float32).T).reshape(-1)
    calls = 2 * len(copies)
    row = {"layer": name, "n": n, "k": k, "prologue": prologue, "rows": rows, "bound_us": w0.nbytes / bandwidth * 1e6,
           "bf16_bound_us": n * k * 2 / bandwidth * 1e6}
    got = _before(kw, w0, prologue).float().reshape(-1)
    row["before_error"] = ((got - want).abs().max() / want.abs().max()).item()
    row["before_us"] = graph_us(lambda i: _before(kw, copies[i % len(copies)], prologue), calls)
    if rows == 1:
        bf16_args = {key: v for key, v in kw.items() if key != "x"}
        bf16_args.update(_launch_args(gemv_pdl_ops.config(n, k, prologue), 1, pdl))
        row["bf16_us"] = graph_us(lambda i: gemv_pdl(kw["x"], dense[i % len(dense)], **bf16_args), 2 * len(dense))
    def args_of(cfg):
        return {**{key: v for key, v in kw.items() if key != "x"}, **_launch_args(cfg, rows, pdl)}

    def call(args, i):
        weight = copies[i % len(copies)]
        return gemv(kw["x"], weight.codes, scales=weight.scales, **args)

    row.update(time_configs(candidates(k, rows), args_of, call, want, calls))
    return row


def plot(results: dict, path: str | Path) -> None:
    """Per layer and row count, microseconds per call of each arm (what FP8 decode ran before, the bfloat16 GEMV,
    the fastest FP8 GEMV configuration) beside the FP8 bound (weight codes / copy bandwidth)."""
    plt = pyplot()
    if plt is None:
        return
    rows = results["results"]
    arms = (("before_us", "before (norm/gate kernel + FP8 GEMV)"), ("bf16_us", "bfloat16 GEMV"),
            ("best_us", "FP8 GEMV, fastest configuration"))
    labels = [f"{r['layer']}\n{r['rows']} row{'s' if r['rows'] > 1 else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 3.4))
    width = 0.8 / len(arms)
    for i, (key, label) in enumerate(arms):
        points = [(j + (i - 1) * width, r[key]) for j, r in enumerate(rows) if isinstance(r.get(key), float)]
        if points:
            ax.bar(*zip(*points), width=width, label=label)
    ax.scatter(range(len(rows)), [r["bound_us"] for r in rows], marker="_", s=600, color="black", zorder=3,
               label="FP8 bound (codes / copy bandwidth)")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("us per call")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"FP8 decode GEMVs, Llama-3.1-8B layers, on {results['device']} "
                 f"(copy {results['copy_bandwidth'] / 1e9:.0f} GB/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.fp8_gemv", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16", help="row counts to time (1: the one-row GEMV; 2..16: the "
                                                          "few-rows GEMV; default 1,4,16)")
    parser.add_argument("--plot-from", metavar="JSON", default=None,
                        help="draw the plot of an earlier run's fp8_gemv.json next to it; measures nothing")
    args = parser.parse_args(argv)
    if args.plot_from:
        source = Path(args.plot_from)
        plot(json.loads(source.read_text()), source.with_suffix(".png"))
        print(source.with_suffix(".png"))
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    if not all(1 <= r <= 16 for r in rows_list):
        parser.error(f"--rows: got {args.rows!r}; expected row counts from 1 to 16")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("ninefold.bench.fp8_gemv needs a CUDA device of compute capability 8.9 or later (FP8); nothing "
              "measured.", file=sys.stderr)
        return 2
    import ninefold.ops as ops
    from ninefold.ops.triton import gemv_pdl
    from ninefold.runtime.profile import profile_device

    pdl = gemv_pdl.pdl_available()
    bandwidth = profile_device("cuda").bandwidth["copy"]
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s, PDL {'on' if pdl else 'off'}")
    torch.manual_seed(0)
    results, table, rows_table, t0 = [], [], [], time.perf_counter()
    for name, n, k, prologue in LAYERS:
        count = max(2, math.ceil((256 << 20) / (n * k)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(count)]
        copies = [ops.Fp8Weight.quantize(w) for w in dense]
        for rows in rows_list:
            row = bench_layer(name, n, k, prologue, rows, copies, dense[: max(2, count // 2)], pdl, bandwidth)
            results.append(row)
            faster = row.get("best_us", float("inf")) < row["before_us"]
            if faster or rows > 1:  # (a rows entry of [] declines the call: the unfused pair measured faster)
                entry = {"n": n, "k": k, "prologue": prologue, "weight": "fp8", "config": row["best"] if faster else []}
                if rows > 1:
                    entry["rows"] = rows
                # q/k/v's bare form (the first layer's, after the embedding) runs as often as one layer in 32
                entries = [entry, {**entry, "prologue": "none"}] if name == "qkv" else [entry]
                (table if rows == 1 else rows_table).extend(entries)
            best = row.get("best_us", float("nan"))
            bf16 = f"bf16 {row['bf16_us']:6.1f} (bound {row['bf16_bound_us']:.1f}) | " if "bf16_us" in row else ""
            print(f"{name:8s} {prologue:13s} rows {rows:2d}: bound {row['bound_us']:6.1f} us | before "
                  f"{row['before_us']:6.1f} | {bf16}FP8 GEMV {best:6.1f} ({row['before_us'] / best:.2f}x before, "
                  f"{row['bound_us'] / best:.0%} of bound) {row.get('best')} [{time.perf_counter() - t0:.0f} s]",
                  flush=True)
        del copies, dense
        torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "pdl": pdl, "results": results}
    written = write_json("fp8_gemv.json", summary)
    if written is not None:
        plot(summary, written.with_suffix(".png"))
    write_json("fp8_gemv_table.json", table)
    write_json("fp8_gemv_rows_table.json", rows_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
