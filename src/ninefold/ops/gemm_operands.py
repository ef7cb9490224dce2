"""Operand checks shared by the ``linear`` implementations that call a GEMM library directly (``cublaslt``,
``cutlass``): what they take, and when they hand a call to ``F.linear`` instead."""

from __future__ import annotations

import torch


def unsupported(x, weight, dtypes: tuple[torch.dtype, ...]) -> str | None:
    """Why such an implementation cannot take ``x`` and ``weight`` (for ``supports``), or None."""
    if x.device.type != "cuda":
        return "CUDA tensors only"
    if x.dtype not in dtypes:
        return f"dtype {x.dtype}: {' or '.join(str(d).removeprefix('torch.') for d in dtypes)} only"
    if not weight.is_contiguous():
        return "the weight must be contiguous"
    return None


def plain_product(x: torch.Tensor, weight: torch.Tensor, bias, dtypes: tuple[torch.dtype, ...], alignment: int) -> bool:
    """Whether ``x @ weight.T`` is a bias-free product of contiguous, non-empty operands of one dtype in
    ``dtypes`` on one device, starting at ``alignment``-byte addresses; anything else goes to ``F.linear``
    (whose errors name what is wrong)."""
    return (bias is None and x.numel() > 0 and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 2
            and weight.shape[1] == x.shape[-1] and weight.dtype == x.dtype and weight.device == x.device
            and x.dtype in dtypes and x.data_ptr() % alignment == 0 and weight.data_ptr() % alignment == 0)
