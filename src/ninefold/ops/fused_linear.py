"""Linear layers fused with the kernel that feeds them: ``add_rms_norm_linear`` and ``silu_and_mul_linear``.

The same results as the unfused pair of operators; the vendor implementation is exactly that
pair (through dispatch, so CPU and multi-row results do not change), the Triton one a single
batch-1 GEMV whose prologue computes the norm or the gate (``ninefold.ops.triton.gemv_pdl_ops``;
one row, CUDA, bf16/fp16). Decode steps at batch 1 read each weight once per token, so dropping
the separate norm/activation kernels and their launch gaps shortens the step.

``weight`` may also be an ``ops.Fp8Weight``: the pair is then the norm or gate followed by
``linear_fp8``, and the Triton GEMVs stream the FP8 codes (1..16 rows, where an FP8 launch table measured
on Hopper lists the call; ``ninefold.ops.triton.gemv_pdl_ops``).
"""

from __future__ import annotations

import torch

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.elementwise import _gated_key, silu_and_mul
from ninefold.ops.fp8 import Fp8Weight, _linear_fp8_key, linear_fp8
from ninefold.ops.linear import _linear_key, linear
from ninefold.ops.norm import _add_rms_norm_key, add_rms_norm
from ninefold.ops.registry import register


def _renamed(op: str, error: Exception, *names: str) -> Exception:
    """``error`` with the unfused operator that raised it (its message's leading ``name:``) renamed ``op``."""
    text = str(error)
    for name in (op, *names):
        if text.startswith(f"{name}:"):
            return type(error)(f"{op}:{text[len(name) + 1:]}")
    return error


def _weight_bucket(bucket: int, weight) -> tuple:
    """The tuning bucket of a fused call: FP8 weights tune apart from dense ones of the same shape (a fourth
    number, the codes' 8 bits: tuning files hold buckets of integers)."""
    n, k = weight.shape
    return (bucket, n, k, 8) if type(weight) is Fp8Weight else (bucket, n, k)


def _check_linear(x, weight, bias) -> None:
    if isinstance(weight, Fp8Weight):
        _linear_fp8_key(x, weight, bias)
    else:
        _linear_key(x, weight, bias)


def _linear_any(x, weight, bias):
    return linear_fp8(x, weight, bias) if type(weight) is Fp8Weight else linear(x, weight, bias)


def _add_rms_norm_linear_key(x, residual, norm_weight, weight, eps=1e-6, bias=None):
    op = "add_rms_norm_linear"
    try:
        device, dtype, (bucket, _), contiguous = _add_rms_norm_key(x, residual, norm_weight, eps)
        _check_linear(x, weight, bias)
    except (TypeError, ValueError) as error:  # name this operator, not the unfused one that checked
        raise _renamed(op, error, "add_rms_norm", "linear_fp8", "linear") from None
    return device, dtype, _weight_bucket(bucket, weight), bias is not None, contiguous


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual, norm_weight, eps), weight, bias), x + residual)``.

    x and residual ``[..., K]``, norm_weight ``[K]``, weight ``[N, K]`` (or an ``Fp8Weight``), bias ``[N]``; the sum is
    rounded to x's dtype before the norm, and the normalised row to x's dtype before the product,
    as ``add_rms_norm`` followed by ``linear`` does. Errors as in those two operators.
    """
    return _ADD_RMS_NORM_LINEAR.call(x, residual, norm_weight, weight, eps, bias)


def _silu_and_mul_linear_key(x, weight, bias=None):
    op = "silu_and_mul_linear"
    try:
        device, dtype, (bucket, d), contiguous = _gated_key(op, x)
        if not isinstance(weight, Fp8Weight):
            spec.tensor(op, "weight", weight, ndim=2)
        if weight.shape[1] != d:
            raise spec.OpError(f"{op}: weight must be [N, {d}] (half of x's last dimension), got {tuple(weight.shape)}")
        _check_linear(x[..., :d], weight, bias)
    except (TypeError, ValueError) as error:
        raise _renamed(op, error, "linear_fp8", "linear") from None
    return device, dtype, _weight_bucket(bucket, weight), bias is not None, contiguous


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)`` for x ``[..., 2K]``, weight ``[N, K]`` (or an ``Fp8Weight``)
    -> ``[..., N]`` (the gated product rounded to x's dtype before the linear layer)."""
    return _SILU_AND_MUL_LINEAR.call(x, weight, bias)


_ADD_RMS_NORM_LINEAR = Operator("add_rms_norm_linear", add_rms_norm_linear, _add_rms_norm_linear_key)
_SILU_AND_MUL_LINEAR = Operator("silu_and_mul_linear", silu_and_mul_linear, _silu_and_mul_linear_key)


@register("add_rms_norm_linear", "vendor", calls=("add_rms_norm", "linear", "linear_fp8"))
def _add_rms_norm_linear_unfused(x, residual, norm_weight, weight, eps, bias):
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    return _linear_any(normed, weight, bias), total


@register("silu_and_mul_linear", "vendor", calls=("silu_and_mul", "linear", "linear_fp8"))
def _silu_and_mul_linear_unfused(x, weight, bias):
    return _linear_any(silu_and_mul(x), weight, bias)
