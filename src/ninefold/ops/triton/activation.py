"""Triton gated activations: ``silu_and_mul`` and ``gelu_and_mul`` over rows of ``[..., 2d]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def gated_kernel(x_ptr, out_ptr, d, stride_x, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:  # exact gelu
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:  # tanh gelu, tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * z)))
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def supports(x, *rest) -> str | None:
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def _gated(x: torch.Tensor, act: int) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        gated_kernel[(x2.shape[0], triton.cdiv(d, BLOCK))](x2, out, d, x2.stride(0), out.stride(0), ACT=act,
                                                           BLOCK=BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x):
    return _gated(x, 0)


def gelu_and_mul(x, approximate):
    return _gated(x, 1 if approximate == "none" else 2)
