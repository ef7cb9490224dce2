"""Triton softmax over the last dimension: one program per row, float32 inside.

Rows up to ``MAX_SINGLE`` wide are held in registers (one read, one write); wider rows stream
twice (running max and sum, then the normalised write).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_SINGLE = 16384
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 4096


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n, stride_x, stride_out, SINGLE: tl.constexpr, BLOCK: tl.constexpr,
                   STATIC_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    dst = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        x = tl.load(src + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, 0))
        tl.store(dst + cols, (e / tl.sum(e, 0)).to(out_ptr.dtype.element_ty), mask=cols < n)
    else:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        # Triton's interpreter (3.6) cannot loop to a run-time bound: it gets the width as STATIC_N.
        for start in range(0, STATIC_N if STATIC_N > 0 else n, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(
                x == float("-inf"), 0.0, tl.exp(x - m_new))
            m = m_new
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - row_max), 0)
        for start in range(0, STATIC_N if STATIC_N > 0 else n, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
            tl.store(dst + start + cols, (tl.exp(x - row_max) / total).to(out_ptr.dtype.element_ty),
                     mask=start + cols < n)


def supports(x, dim) -> str | None:
    if dim % x.dim() != x.dim() - 1:
        return "only the last dimension"
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def config(n: int) -> tuple[bool, int, int]:
    """(SINGLE, BLOCK, num_warps) for rows of ``n``."""
    if n <= MAX_SINGLE:
        block = triton.next_power_of_2(max(n, 1))
        return True, block, max(1, min(16, block // 256))
    return False, CHUNK, 8


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        single, block, warps = config(n)
        softmax_kernel[(x2.shape[0],)](x2, out, n, x2.stride(0), out.stride(0), SINGLE=single, BLOCK=block,
                                       STATIC_N=n if INTERPRETED and not single else 0, num_warps=warps)
    return out.view(x.shape)
