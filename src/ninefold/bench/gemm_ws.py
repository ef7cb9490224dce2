"""Warp-specialized split-K GEMM for the decode step's linear layers (GPU experiment).

    OUT=DIR python -m ninefold.bench.gemm_ws        # one CUDA device with TMA (sm_90), a few minutes

Question (issue 6, offline throughput): the decode GEMMs at 128-256 rows run at 46-80% of their bound
under cuBLAS, and no Triton GEMM tried so far (split-K over 64-256-row tiles, pointer or host-TMA
loads, PDL) beats cuBLAS there: each program's pipeline runs below cuBLAS's rate per SM. Does
Triton's warp specialization on sm_90 (``tl.range(..., warp_specialize=True)`` over descriptors made
in the kernel, 4 warps: a producer warpgroup issuing the TMA loads and two consumer warpgroups that
each take half of the tile's rows, as CUTLASS's cooperative kernels) close that gap? For each layer
shape (``bench.decode_gemm.SHAPES``) and row count, every configuration (tile, stages, K split, with
and without warp specialization) is checked against a float32 product, then timed as a CUDA graph
over rotating weight copies (the weight streams from memory, as in a model step) beside cuBLAS.
Prints the best configurations per shape and writes ``$OUT/gemm_ws.json``. A diagnostic, not a
benchmark with targets; results in docs/perf/llm.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton
import triton.language as tl

from ninefold.bench.results import write_json

COUNTERS = 1 << 14


@triton.jit(do_not_specialize=["M"])
def gemm_ws_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, SPLIT_STEPS,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr, WS: tl.constexpr, PARTIALS: tl.constexpr = False):
    """``y = x @ w.T`` for row-major ``x [M, K]``, ``w [N, K]``, ``y [M, N]`` (bfloat16 or float16). Program
    (tile, split) accumulates ``SPLIT_STEPS`` steps of ``BLOCK_K``; with ``SPLIT_K`` > 1 the partial
    tiles meet in ``ws_ptr`` and the last program to arrive at a tile adds them up and stores it."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    tile_m = tile % tiles_m  # neighbours share a weight tile
    tile_n = tile // tiles_m
    first = tl.program_id(1) * SPLIT_STEPS
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in tl.range(0, SPLIT_STEPS, num_stages=STAGES, warp_specialize=WS):
        x = x_desc.load([tile_m * BLOCK_M, (first + i) * BLOCK_K])
        w = w_desc.load([tile_n * BLOCK_N, (first + i) * BLOCK_K])
        acc = tl.dot(x, w.T, acc)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    out = y_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif PARTIALS:
        # float32 partial products into ws [SPLIT_K, M, N]; reduce_kernel adds them up (no counters: with warp
        # specialization each consumer warpgroup runs this epilogue for its own rows)
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ws = ws_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N
        tl.store(tile_ws + tl.program_id(1) * BLOCK_M * BLOCK_N + cell, acc, cache_modifier=".cg")
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(tile_ws + s * BLOCK_M * BLOCK_N + cell, cache_modifier=".cg")
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (also inside a CUDA graph)


@triton.jit
def reduce_kernel(ws_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """``y = sum(ws[s] for s in range(SPLIT_K))`` over ``MN`` elements, cast to ``y``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, w, y, cfg, ws, count):
    """Run ``gemm_ws_kernel`` with ``cfg`` = (block_m, block_n, block_k, stages, split_k, ws[, partials]) (and
    with ``partials``, ``reduce_kernel`` after it); the GEMM's CompiledKernel."""
    bm, bn, bk, stages, split, spec = cfg[:6]
    partials = len(cfg) > 6 and cfg[6]
    m, k = x.shape
    n = w.shape[0]
    steps = triton.cdiv(k, bk)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    compiled = gemm_ws_kernel[(tiles, split)](x, w, y, ws, count, m, n, k, steps // split, SPLIT_K=split,
                                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, WS=spec, PARTIALS=partials,
                                          num_warps=4, num_stages=stages)
    if partials:
        reduce_kernel[(triton.cdiv(m * n, 1024),)](ws, y, m * n, SPLIT_K=split, BLOCK=1024, num_warps=4)
    return compiled


def configs(k: int, mode: str = "all") -> list[tuple]:
    """``all``: 128- and 256-row tiles (two consumer warpgroups share the rows) x stages x K splits dividing
    K's steps, warp-specialized where the shared memory fits, and each tile without specialization.
    ``split``: K splits whose partial products a second kernel adds up (warp specialization cannot use the
    per-tile arrival counter: each consumer warpgroup would count), with and without specialization, next to
    the per-tile counter without it."""
    out = []
    bk = 64
    if mode == "split":
        for bm, bn in ((128, 64), (128, 128), (256, 64)):
            for split in (2, 4, 8, 16):
                if (k // bk) % split:
                    continue
                out.append((bm, bn, bk, 3, split, False))
                out.append((bm, bn, bk, 3, split, False, True))
                for stages in (3, 4):
                    if stages * (bm + bn) * bk * 2 + bm * bn * 4 <= 227 * 1024:
                        out.append((bm, bn, bk, stages, split, True, True))
        return out
    for bm, bn in ((128, 64), (128, 128), (128, 256), (256, 64), (256, 128)):
        out.append((bm, bn, bk, 3, 1, False))
        for stages in (2, 3, 4):
            for split in (1, 2, 4, 8):
                # staged x and w tiles, plus the epilogue's tile (float32 partials with a split), in bytes
                smem = stages * (bm + bn) * bk * 2 + (bm * bn * 4 if split > 1 else 20 * 1024)
                if (k // bk) % split == 0 and smem <= 227 * 1024:
                    out.append((bm, bn, bk, stages, split, True))
    return out


def describe(cfg) -> str:
    bm, bn, bk, stages, split, spec = cfg[:6]
    partials = " partials" if len(cfg) > 6 and cfg[6] else ""
    return f"{bm}x{bn}x{bk} s{stages} split{split}{partials}{' ws' if spec else ''}"


def run(batches, names, limit_s: float, mode: str = "all") -> dict:
    from ninefold.bench.decode_attention import graph_time
    from ninefold.bench.decode_gemm import bound_us, ceilings, decode_cases, relative_error

    device = torch.device("cuda")
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
    bw, rate = ceilings(device)
    count = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    start = time.perf_counter()
    rows = []
    for layer, m, n, k, x, weights, want in decode_cases(batches, names, device):
        bound = bound_us(m, n, k, bw, rate)
        vendor = graph_time([lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in weights], device, 50)
        row = {"layer": layer, "m": m, "n": n, "k": k, "bound_us": bound, "cublas_us": vendor, "configs": {}}
        for cfg in configs(k, mode):
            if time.perf_counter() - start > limit_s:
                row["cut_short"] = True
                break
            bm, bn = cfg[0], cfg[1]
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            ws = torch.empty(max(1, tiles * cfg[4] * bm * bn if cfg[4] > 1 else 1), dtype=torch.float32,
                             device=device)
            y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            try:
                compiled = launch(x, weights[0], y, cfg, ws, count)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (a configuration that does not compile is a row)
                row["configs"][describe(cfg)] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            err = relative_error(y, want)
            if not err < 2e-2:
                row["configs"][describe(cfg)] = f"wrong (relative error {err:.3g})"
                continue
            us = graph_time([lambda w=w, a=(x, y, cfg, ws): launch(a[0], w, a[1], a[2], a[3], count) for w in weights],
                            device, 50)
            row["configs"][describe(cfg)] = {"us": us, "warps": compiled.metadata.num_warps,
                                             "setmaxnreg": compiled.asm["ptx"].count("setmaxnreg")}
        timed = sorted((v["us"], c, v) for c, v in row["configs"].items() if isinstance(v, dict))
        best = "; ".join(f"{c} {us:.1f} ({v['warps']}w)" for us, c, v in timed[:3])
        best_ws = next(((us, c) for us, c, v in timed if c.endswith(" ws") and v["warps"] > 4), None)
        row["best"] = timed[0][1] if timed else None
        print(f"{layer:8s} M={m:<4d} bound {bound:7.1f} us  cuBLAS {vendor:7.1f}  best: {best}"
              + (f"  | best warp-specialized: {best_ws[1]} {best_ws[0]:.1f}" if best_ws else
                 "  | no warp-specialized variant compiled to 12 warps"), flush=True)
        rows.append(row)
    return {"device": torch.cuda.get_device_name(device), "triton": triton.__version__, "copy_GBps": bw / 1e9,
            "matmul_TFLOPs": rate / 1e12, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.gemm_ws", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="128,192,256")
    parser.add_argument("--layers", default="qkv,o,gate_up,down")
    parser.add_argument("--mode", choices=("all", "split"), default="all", help="which configurations (see configs)")
    parser.add_argument("--limit", type=float, default=420.0, help="stop trying configurations after this many s")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("ninefold.bench.gemm_ws needs a CUDA device with TMA (sm_90+); nothing measured.", file=sys.stderr)
        return 2
    results = run([int(b) for b in args.batches.split(",")], args.layers.split(","), args.limit, args.mode)
    write_json(f"gemm_ws_{args.mode}.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
