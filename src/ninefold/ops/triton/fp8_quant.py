"""Per-row FP8 quantization of activations for ``ops.linear_fp8``'s ``scaled_mm`` implementation.

One program per row: a first pass over the row finds its absolute maximum, a second writes
``x / scale`` as ``float8_e4m3fn`` with ``scale = max(amax / 448, 1e-12)`` (float32, one per row). A
row of up to ``BLOCK`` values is read once and held in registers; longer rows are read twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton import launch

FP8_MAX = 448.0
MAX_BLOCK = 4096


@triton.jit(do_not_specialize=["k"])
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, FP8_LIMIT: tl.constexpr,
                         BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        amax = 0.0
        for start in range(0, k, BLOCK):
            part = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < k, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(part.to(tl.float32)), axis=0))
    scale = tl.maximum(amax / FP8_LIMIT, 1e-12)
    tl.store(s_ptr + row, scale)
    if ONE_BLOCK:
        q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < k)
    else:
        for start in range(0, k, BLOCK):
            part = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < k, other=0.0)
            q = tl.minimum(tl.maximum(part.to(tl.float32) / scale, -FP8_LIMIT), FP8_LIMIT)
            tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=start + cols < k)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` for a 2-D CUDA tensor whose rows are contiguous: ``float8_e4m3fn`` ``[M, K]`` and
    float32 ``[M, 1]`` (the form ``torch._scaled_mm`` takes for row-wise scaling)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(max(k, 16)), MAX_BLOCK)
    launch.call(quantize_rows_kernel, (m,), x, codes, scales, k, x.stride(0), codes.stride(0), FP8_LIMIT=FP8_MAX,
                BLOCK=block, ONE_BLOCK=block >= k, num_warps=8 if block >= 2048 else 4, num_stages=3)
    return codes, scales
