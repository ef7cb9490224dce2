"""Normalisations: ``rms_norm``, ``add_rms_norm`` (fused residual add) and ``softmax``.

All accumulate in float32 and return the input's dtype. ``weight`` may have another floating
dtype than ``x`` (float32 norm weights with bfloat16 activations are common).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register


def _norm_checks(op: str, x, weight, eps) -> None:
    spec.tensor(op, "x", x, min_ndim=1)
    spec.tensor(op, "weight", weight, ndim=1)
    spec.floating(op, "weight", weight)
    if weight.shape[0] != x.shape[-1]:
        raise spec.OpError(f"{op}: weight must have shape ({x.shape[-1]},) to match x's last dimension, "
                           f"got {tuple(weight.shape)}")
    spec.same_device(op, "x", x, weight=weight)
    spec.positive_float(op, "eps", eps)


def _rms_norm_key(x, weight, eps=1e-6):
    _norm_checks("rms_norm", x, weight, eps)
    d = x.shape[-1]
    return x.device, x.dtype, (spec.pow2(x.numel() // max(d, 1)), d), x.stride(-1) == 1


def _add_rms_norm_key(x, residual, weight, eps=1e-6):
    _norm_checks("add_rms_norm", x, weight, eps)
    spec.tensor("add_rms_norm", "residual", residual)
    if residual.shape != x.shape:
        raise spec.OpError(f"add_rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    spec.same_device("add_rms_norm", "x", x, residual=residual)
    spec.same_dtype("add_rms_norm", "x", x, residual=residual)
    d = x.shape[-1]
    contiguous = x.stride(-1) == 1 and residual.stride(-1) == 1
    return x.device, x.dtype, (spec.pow2(x.numel() // max(d, 1)), d), contiguous


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dimension (float32 inside)."""
    return _RMS_NORM.call(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add then norm: returns ``(rms_norm(x + residual), x + residual)``.

    The sum is rounded to x's dtype before the norm, as an unfused model would do it.
    """
    return _ADD_RMS_NORM.call(x, residual, weight, eps)


def _softmax_key(x, dim=-1):
    spec.tensor("softmax", "x", x, min_ndim=1)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise spec.OpError(f"softmax: dim must be an int in [{-x.dim()}, {x.dim() - 1}], got {dim!r}")
    n = x.shape[dim]
    last = dim % x.dim() == x.dim() - 1
    return x.device, x.dtype, (spec.pow2(x.numel() // max(n, 1)), n), last and x.stride(-1) == 1


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim`` accumulated in float32, x's dtype out."""
    return _SOFTMAX.call(x, dim)


_RMS_NORM = Operator("rms_norm", rms_norm, _rms_norm_key)
_ADD_RMS_NORM = Operator("add_rms_norm", add_rms_norm, _add_rms_norm_key)
_SOFTMAX = Operator("softmax", softmax, _softmax_key)


@register("rms_norm", "vendor")
def _rms_norm_torch(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


@register("add_rms_norm", "vendor")
def _add_rms_norm_torch(x, residual, weight, eps):
    total = x + residual
    return F.rms_norm(total.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype), total


@register("softmax", "vendor")
def _softmax_torch(x, dim):
    if x.dtype == torch.float32:
        return torch.softmax(x, dim)
    return torch.softmax(x, dim, dtype=torch.float32).to(x.dtype)
