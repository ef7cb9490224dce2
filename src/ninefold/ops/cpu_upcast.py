"""CPU ``linear`` in bfloat16/float16 where torch has no fast kernel for them: compute in float32.

On CPUs without AVX-512 (AVX2 desktops and servers) torch's bfloat16 GEMM costs about one matrix-vector
product per row: measured on a 2-core AMD EPYC with AVX2 (torch 2.13), SmolLM2's 3072 x 576 gate/up
projection took 2.9 ms for 16 rows and 95 ms for 512, against 2.5 and 13.8 ms for converting both
operands to float32, multiplying there and rounding the result back (7x at 512 rows); at 1-8 rows the
conversion of the weight costs more than it saves (0.2-0.8x). This implementation takes calls of more
than ``MIN_ROWS`` rows (the dispatcher buckets rows by powers of two: 16 and up) on such CPUs; the
result is the float32 product rounded once, closer to the exact product than a bfloat16 GEMM's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_ROWS = 8
_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}


@functools.cache
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM has a fast kernel for ``dtype`` (bfloat16 or float16) on this CPU."""
    check = getattr(torch.ops.mkldnn, _CHECKS[dtype], None)
    try:
        return bool(check()) if check is not None else True
    except RuntimeError:
        return True


def supports(x, weight, bias=None) -> str | None:
    """Why this implementation does not take the call, or None."""
    if x.dtype not in _CHECKS:
        return f"takes bfloat16 or float16, not {str(x.dtype).removeprefix('torch.')}"
    if native_half_gemm(x.dtype):
        return f"torch has a fast {str(x.dtype).removeprefix('torch.')} CPU GEMM here"
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= MIN_ROWS:
        return f"{rows} rows: converting the weight costs more than the float32 GEMM saves up to {MIN_ROWS}"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` computed in float32 and rounded to x's dtype."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
