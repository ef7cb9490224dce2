"""Triton RMS norm, with and without the fused residual add: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_D = 32768


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, d, stride_x, stride_res, stride_out,
                    stride_res_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < d
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / d + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def supports(x, *rest) -> str | None:
    """Rows must have unit stride along the normalised dimension and fit one program."""
    if x.shape[-1] > MAX_D:
        return f"last dimension {x.shape[-1]} > {MAX_D}"
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, d, x2.stride(0), 0, out.stride(0), 0, eps,
                                        HAS_RESIDUAL=False, BLOCK_D=block, num_warps=_warps(block))
    return out.view(x.shape)


def add_rms_norm(x, residual, weight, eps):
    d = x.shape[-1]
    x2, r2 = x.reshape(-1, d), residual.reshape(-1, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out)
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, total, d, x2.stride(0), r2.stride(0), out.stride(0),
                                        total.stride(0), eps, HAS_RESIDUAL=True, BLOCK_D=block,
                                        num_warps=_warps(block))
    return out.view(x.shape), total.view(x.shape)
