"""Triton ``linear`` for batched decode steps: ``x [M, K] @ weight[N, K].T`` with 17 <= M <= 512.

At these sizes a linear layer sits between streaming the weight and filling the tensor cores, and
cuBLAS loses most where the output has few tiles: a 4096-wide output at 192 rows is 64 tiles of
128x128 for 132 SMs, so half the card idles while the other half runs a long K loop (measured on the
H200: o_proj 17.2 us against a bound of 8.4, ``python -m ninefold.bench.decode_gemm``). This kernel
splits K evenly across ``split_k`` programs per output tile. Each writes its float32 partial tile to a
workspace and bumps the tile's arrival counter; the last program to arrive adds the partials in split
order (so the result does not depend on arrival order), applies the bias, stores the output and
resets the counter for the next call. One launch, no separate reduction kernel. Operands load either
through pointers (out-of-range rows re-read a valid row, masked at the store) or, on cards with a TMA
engine, through tensor descriptors (``gemm_tma_kernel``).

Which tile shape, split and pipeline depth to use is measured per (device, dtype, M rounded up to 16,
N, K) by ``ninefold.ops.triton.gemm_tuning``, with cuBLAS timed in the same run as one of the
candidates: where it wins, or where the shape was never tuned, ``linear`` calls cuBLAS. Counters live
in one zeroed buffer per (device, stream), so concurrent calls on two streams do not share counters.

Measured on the H200 (``python -m ninefold.bench.decode_gemm --impls vendor,triton_gemm``, Llama-3-8B
layers, bf16): the tuned kernel beats cuBLAS by more than 2% only at a few shapes (lm_head at 32-64 rows
by 3-8%, gate_up at 64 and 128 rows by 2-4%, down at 64 rows by 4%). Where cuBLAS is furthest from its
bound (o and down at 160-224 rows) nothing beat it: splitting K fills the SMs, but each program's tile
runs well below cuBLAS's per-SM rate. With every decode size tuned in the engine and PDL on, offline
throughput (``python -m ninefold.bench.llm``, runs interleaved with cuBLAS-only runs in one call) read
21283 and 21204 total tok/s against 21257 and 21164: no difference (docs/perf/llm.md, seventh session).
So it registers below cuBLAS: it runs where pinned (``NINEFOLD_OPS=linear=triton_gemm``, with
``NINEFOLD_GEMM_AUTOTUNE=1`` to tune shapes on their first call) or chosen by a tuning table.

With PDL (:func:`ninefold.ops.triton.pdl.wanted`, switch ``NINEFOLD_GEMM_PDL``) each program lets the
next kernel launch, requests its first weight tile, and only then waits for the kernel that wrote x:
the weight stream starts while the kernel before finishes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninefold.ops.triton import gemv
from ninefold.ops.triton import pdl as pdl_module
from ninefold.ops.triton.launch import call

MIN_M, MAX_M = 17, 512
COUNTERS = 1 << 16


@triton.jit
def _tile_of(M, BLOCK_M: tl.constexpr):
    # Programs next to each other share a weight tile (different row tiles), so it comes from DRAM once.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    return tile, tile % tiles_m, tile // tiles_m


@triton.jit
def _finish(acc, tile, tile_m, tile_n, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, SPLIT_K, stride_ym,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a program's float32 tile: directly without a split, else through the last-arrival reduction."""
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    out_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn % N).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        cell = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_ws = ws_ptr + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N
        tl.store(tile_ws + tl.program_id(1) * BLOCK_M * BLOCK_N + cell, acc, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(tile_ws + s * BLOCK_M * BLOCK_N + cell, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn % N).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, SPLIT_K, SPLIT_STEPS,
                stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tile, tile_m, tile_n = _tile_of(M, BLOCK_M)
    first = tl.program_id(1) * SPLIT_STEPS  # every split has SPLIT_STEPS steps of BLOCK_K (the host checks)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows and columns read a valid row instead (masked at the store): loads stay unmasked.
    xm = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    wn = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    x_ptrs = x_ptr + xm[:, None] * stride_xm + (first * BLOCK_K + rk)[None, :]
    w_ptrs = w_ptr + wn.to(tl.int64)[:, None] * stride_wn + (first * BLOCK_K + rk)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = 0
    if USE_GDC:  # the first weight tile is requested before waiting for the kernel that wrote x
        k_ok = (first * BLOCK_K + rk) < K
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        start = 1
    for i in range(start, SPLIT_STEPS):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            k_ok = ((first + i) * BLOCK_K + rk) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _finish(acc, tile, tile_m, tile_n, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, SPLIT_K, stride_ym,
            HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def gemm_tma_kernel(x_desc, w_desc, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, SPLIT_K, SPLIT_STEPS, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, USE_GDC: tl.constexpr = False):
    """``gemm_kernel`` with both operands loaded by the TMA engine (rows and K past the end read zeros)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tile, tile_m, tile_n = _tile_of(M, BLOCK_M)
    first = tl.program_id(1) * SPLIT_STEPS
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = 0
    if USE_GDC:
        w = w_desc.load([tile_n * BLOCK_N, first * BLOCK_K])
        tl.extra.cuda.gdc_wait()
        x = x_desc.load([tile_m * BLOCK_M, first * BLOCK_K])
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        start = 1
    for i in range(start, SPLIT_STEPS):
        x = x_desc.load([tile_m * BLOCK_M, (first + i) * BLOCK_K])
        w = w_desc.load([tile_n * BLOCK_N, (first + i) * BLOCK_K])
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    _finish(acc, tile, tile_m, tile_n, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, SPLIT_K, stride_ym,
            HAS_BIAS, BLOCK_M, BLOCK_N)


def supports(x, weight, bias=None) -> str | None:
    m = x.numel() // max(x.shape[-1], 1)
    if not MIN_M <= m <= MAX_M:
        return f"{m} rows: the split-K GEMM covers {MIN_M}..{MAX_M} (fewer: the GEMV; more: cuBLAS)"
    return gemv.layout_reason(x, weight)


_counters: dict = {}


def counters(device: torch.device) -> torch.Tensor:
    """The arrival counters of ``device``'s current stream (zero between calls)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _counters.get(key)
    if buf is None:  # during graph capture the zeroing is captured too, and kernels reset what they use
        buf = _counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def tma_ready(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether both operands can be read through TMA descriptors (16-byte aligned bases and row strides)."""
    size = x2.element_size()
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0 for t in (x2, weight))


def launch(x2: torch.Tensor, weight: torch.Tensor, bias, y: torch.Tensor, cfg: dict, count: torch.Tensor) -> None:
    """Run the GEMM with configuration ``cfg`` (block_m, block_n, block_k, split_k, num_warps, num_stages,
    and ``tma``: load through tensor descriptors) on 2-D ``x2`` into ``y``."""
    m, k = x2.shape
    n = weight.shape[0]
    bm, bn, split = cfg["block_m"], cfg["block_n"], cfg["split_k"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split > 1 and tiles > COUNTERS:
        raise ValueError(f"split-K GEMM: {tiles} output tiles exceed the {COUNTERS} arrival counters")
    ws = torch.empty(tiles * split * bm * bn if split > 1 else 1, dtype=torch.float32, device=x2.device)
    bk, b = cfg["block_k"], bias if bias is not None else weight
    steps = triton.cdiv(k, bk)
    if steps % split:
        raise ValueError(f"split-K GEMM: split_k={split} must divide the {steps} steps of block_k={bk} over K={k}")
    split_steps = steps // split
    precision = "ieee" if x2.dtype == torch.float32 else "tf32"
    pdl = pdl_module.wanted(x2.device, "NINEFOLD_GEMM_PDL")
    # PDL launches go to the JIT (trimmed builds hold plain launches only)
    run = (lambda kernel, grid, *args, **kw: kernel[grid](*args, **kw, USE_GDC=True, launch_pdl=True)) if pdl else call
    if cfg.get("tma") and tma_ready(x2, weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor(x2, [m, k], [x2.stride(0), 1], [bm, bk])
        w_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [bn, bk])
        run(gemm_tma_kernel, (tiles, split), x_desc, w_desc, b, y, ws, count, m, n, k, split, split_steps,
            y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return
    run(gemm_kernel, (tiles, split), x2, weight, b, y, ws, count, m, n, k, split, split_steps,
        x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [..., K]`` with ``MIN_M..MAX_M`` rows, with the configuration
    measured fastest for this shape (cuBLAS where it measured faster)."""
    from ninefold.ops.triton import gemm_tuning

    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    cfg = gemm_tuning.choice(m, n, k, x2.dtype, x2.device, bias is not None)
    if cfg is None:
        return F.linear(x, weight, bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    launch(x2, weight, bias, y, cfg, counters(x2.device))
    return y.reshape(*x.shape[:-1], n)
