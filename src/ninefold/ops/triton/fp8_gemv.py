"""Triton ``linear_fp8`` for a few rows (decode steps): ``(x [M, K] @ codes[N, K].T) * scales[N]`` with M <= 16.

At M = 1..16 the layer is a stream of the weight, which FP8 halves. The main loop is ``gemv``'s
(``gemv_rows``: each program streams ``BLOCK_N`` rows of codes in ``BLOCK_K`` steps, widened to x's dtype
as they are loaded, float32 accumulation); the row scales and the bias are applied once at the end. x stays in its precision (weight-only FP8, unlike the ``scaled_mm``
implementation for more rows, which rounds x to FP8 too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.fp8 import GEMV_MAX_ROWS as MAX_M
from ninefold.ops.triton import launch
from ninefold.ops.triton.gemv import gemv_rows

BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 32, 256, 4, 4
LONG_K = {"block_k": 512, "num_stages": 3}  # K >= 8192


@triton.jit(do_not_specialize=["M"])
def fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
    acc = gemv_rows(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, "tf32")
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    acc *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & n_ok[None, :])


def supports(x, weight, bias=None) -> str | None:
    """A reason this kernel does not apply, or None."""
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):  # (meta: a build recording)
        return "Triton converts FP8 (fp8e4nv) only on compute capability 8.9 or later"
    m = x.numel() // max(weight.shape[1], 1)
    if not 1 <= m <= MAX_M:
        return f"x has {m} rows; this kernel takes 1 to {MAX_M}"
    return None


def linear_fp8(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear_fp8`` for 1..16 rows of a float16/bfloat16 x."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    long_k = k >= 8192
    block_k = LONG_K["block_k"] if long_k else BLOCK_K
    launch.call(fp8_gemv_kernel, (triton.cdiv(n, BLOCK_N),),
                x2, weight.codes, weight.scales, bias if bias is not None else weight.scales, y, m, n, k, x2.stride(0),
                weight.codes.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=BLOCK_N,
                BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=NUM_WARPS,
                num_stages=LONG_K["num_stages"] if long_k else NUM_STAGES)
    return y.reshape(*x.shape[:-1], n)
