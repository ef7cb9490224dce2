"""The one-row GEMV over FP8 weights against what FP8 decode ran before: ``python -m ninefold.bench.fp8_gemv`` (GPU).

For each Llama-3.1-8B decode layer at one row (q/k/v and gate_up with the residual add + RMSNorm before
them, q/k/v also bare as the first layer runs it, o, down with the SwiGLU gate before it), the time per
call of:

- ``before``: the norm or gate as its own kernel, then ``linear_fp8``'s few-rows GEMV (``triton_gemv``):
  what an FP8 model ran at batch 1 until the one-row GEMV took FP8 codes;
- ``bf16``: the one-row GEMV on bfloat16 weights with its shipped launch configuration and fused prologue
  (twice the bytes: the step FP8 is meant to halve);
- each candidate configuration of the one-row GEMV on the FP8 codes (``gemv_pdl(..., scales=)``, its
  prologue fused, with PDL where available),

as CUDA graphs of back-to-back calls cycling through copies of the weight so that L2 does not serve it.
Every configuration is checked against a float32 product of the dequantized weight before it is timed.

Prints a table; writes ``$OUT/fp8_gemv.json`` (every timing) and ``$OUT/fp8_gemv_table.json`` (the fastest
configuration per layer, ``NINEFOLD_GEMV_TABLE`` format with ``"weight": "fp8"``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from ninefold.bench.decode_chain import _tuning_inputs
from ninefold.bench.gemv_rows import graph_us
from ninefold.bench.results import write_json

# (name, N, K, prologue) of the Llama-3.1-8B layer matrices an FP8 model stores as FP8.
LAYERS = (("qkv", 6144, 4096, "add_rms_norm"), ("qkv", 6144, 4096, "none"), ("o", 4096, 4096, "none"),
          ("gate_up", 28672, 4096, "add_rms_norm"), ("down", 4096, 14336, "silu_and_mul"))
EPS = 1e-5
# (block_n, block_k, split_k, num_warps, num_stages, variant) as in ``gemv_pdl_ops.TABLE``: variant 0 the
# register loop, 1 tl.dot on the row padded to 16, 2 the register loop with two tiles in flight. FP8 tiles
# hold half the bytes of bfloat16 ones, so longer K steps are tried too.
CANDIDATES = [(16, 512, 1, 4, 2, 0), (16, 1024, 1, 4, 2, 0), (32, 512, 1, 4, 2, 0), (32, 256, 1, 4, 2, 0),
              (32, 1024, 1, 8, 2, 0), (64, 512, 1, 8, 2, 0), (16, 512, 2, 4, 2, 0), (32, 512, 2, 4, 2, 0),
              (16, 512, 1, 4, 2, 2), (16, 1024, 1, 4, 2, 2), (32, 256, 1, 4, 2, 2), (32, 512, 1, 4, 2, 2),
              (16, 512, 2, 4, 2, 2), (32, 256, 1, 4, 4, 1), (32, 512, 1, 4, 3, 1), (64, 256, 1, 4, 3, 1),
              (16, 512, 1, 4, 4, 1), (32, 1024, 1, 8, 3, 1)]


def candidates(k: int) -> list[tuple]:
    """The configurations that fit K (a multiple of block_k * split_k; two tiles per split for variant 2)."""
    return [c for c in CANDIDATES if k % (c[1] * c[2]) == 0 and (c[5] != 2 or k // c[2] >= 2 * c[1])]


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
    return linear_fp8(x.reshape(1, -1), weight)


def bench_layer(name: str, n: int, k: int, prologue: str, copies: list, dense: list[torch.Tensor], pdl: bool,
                bandwidth: float) -> dict:
    """``before``, ``bf16`` and every FP8 candidate for one layer."""
    from ninefold.ops.triton import gemv_pdl_ops
    from ninefold.ops.triton.gemv_pdl import gemv_pdl

    w0 = copies[0]
    kw, xin = _tuning_inputs(torch.empty(0, k, dtype=torch.bfloat16, device="cuda"), prologue, EPS)
    want = w0.dequantize(torch.float32) @ xin
    calls = 2 * len(copies)
    row = {"layer": name, "n": n, "k": k, "prologue": prologue, "bound_us": w0.nbytes / bandwidth * 1e6,
           "bf16_bound_us": n * k * 2 / bandwidth * 1e6}
    got = _before(kw, w0, prologue).float().reshape(-1)
    row["before_error"] = ((got - want).abs().max() / want.abs().max()).item()
    row["before_us"] = graph_us(lambda i: _before(kw, copies[i % len(copies)], prologue), calls)
    bn, bk, sk, nw, ns, variant = gemv_pdl_ops.config(n, k, prologue)
    bf16_args = {key: v for key, v in kw.items() if key != "x"}
    bf16_args.update(split_k=sk, pdl=pdl, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, dot=variant == 1,
                     depth=2 if variant == 2 else 1)
    row["bf16_us"] = graph_us(lambda i: gemv_pdl(kw["x"], dense[i % len(dense)], **bf16_args), 2 * len(dense))
    row["configs"] = []
    for cfg in candidates(k):
        bn, bk, sk, nw, ns, variant = cfg
        args = {key: v for key, v in kw.items() if key != "x"}
        args.update(split_k=sk, pdl=pdl, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, dot=variant == 1,
                    depth=2 if variant == 2 else 1)
        entry = {"config": list(cfg)}
        try:
            y = gemv_pdl(kw["x"], w0.codes, scales=w0.scales, **args)
            err = ((y.float() - want).abs().max() / want.abs().max()).item()
            if not err < 2e-2:
                raise AssertionError(f"relative error {err:.3g}")
            entry["us"] = graph_us(lambda i, a=args: gemv_pdl(kw["x"], copies[i % len(copies)].codes,
                                                              scales=copies[i % len(copies)].scales, **a), calls)
        except Exception as error:  # reported per configuration; the others still run
            entry["error"] = repr(error)[:300]
        row["configs"].append(entry)
    timed = [c for c in row["configs"] if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        row["best"], row["best_us"] = best["config"], best["us"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.fp8_gemv", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
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
    results, table, t0 = [], [], time.perf_counter()
    for name, n, k, prologue in LAYERS:
        count = max(2, math.ceil((256 << 20) / (n * k)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(count)]
        copies = [ops.Fp8Weight.quantize(w) for w in dense]
        row = bench_layer(name, n, k, prologue, copies, dense[: max(2, count // 2)], pdl, bandwidth)
        results.append(row)
        if "best" in row:
            table.append({"n": n, "k": k, "prologue": prologue, "weight": "fp8", "config": row["best"]})
        best = row.get("best_us", float("nan"))
        print(f"{name:8s} {prologue:13s} bound {row['bound_us']:6.1f} us | before {row['before_us']:6.1f} | bf16 "
              f"{row['bf16_us']:6.1f} (bound {row['bf16_bound_us']:.1f}) | FP8 GEMV {best:6.1f} "
              f"({row['before_us'] / best:.2f}x before, {row['bound_us'] / best:.0%} of bound) {row.get('best')} "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        del copies, dense
        torch.cuda.empty_cache()
    write_json("fp8_gemv.json", {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "pdl": pdl,
                                 "results": results})
    write_json("fp8_gemv_table.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
