"""RMS norm and the fused residual add + RMS norm: one row per program, float32 arithmetic."""

import torch

import ninefold.dsl as nd
import ninefold.dsl.language as nl
from ninefold.dsl import Symbol, Tensor
from ninefold.ops.kernels._checks import check_same, check_tensor, rows

ROW = Symbol("ROW", constexpr=True)


def _weight_per_row(w, x_rows):
    """The 1-D weight as one tile, repeated for every row program."""
    return w.tile((ROW,)).unsqueeze(0).expand((x_rows.shape[0], -1))


def arrangement(x, w, eps, y, ROW=ROW):
    x_rows = x.tile((1, ROW))
    return x_rows, _weight_per_row(w, x_rows), eps, y.tile((1, ROW))


def application(x, w, eps, y):
    v = x
    v = v.to(nl.float32)
    inv_rms = nl.rsqrt(nl.sum(v * v) / x.source.shape[-1] + eps)
    y = v * inv_rms * w  # noqa: F841


def arrangement_fused(x, residual, w, eps, y, residual_out, ROW=ROW):
    x_rows = x.tile((1, ROW))
    tiles = (x_rows, residual.tile((1, ROW)), _weight_per_row(w, x_rows), eps)
    return (*tiles, y.tile((1, ROW)), residual_out.tile((1, ROW)))


def application_fused(x, residual, w, eps, y, residual_out):
    s = x + residual
    residual_out = s  # noqa: F841
    v = s.to(nl.float32)
    inv_rms = nl.rsqrt(nl.sum(v * v) / x.source.shape[-1] + eps)
    y = v * inv_rms * w  # noqa: F841


kernel = nd.make(arrangement, application, (Tensor(2), Tensor(1), Tensor(0), Tensor(2)))
fused_kernel = nd.make(
    arrangement_fused,
    application_fused,
    (Tensor(2), Tensor(2), Tensor(1), Tensor(0), Tensor(2), Tensor(2)),
)


def _check(x, weight, eps):
    check_tensor("x", x)
    check_tensor("weight", weight, 1)
    if x.ndim == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match x of shape {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight: on {weight.device}, but x is on {x.device}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps: expected a non-negative number, got {eps!r}")


def rms_norm(x, weight, eps=1e-6):
    """``x / sqrt(mean(x^2, -1) + eps) * weight``, computed in float32, returned in x's dtype."""
    _check(x, weight, eps)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    kernel(rows(x), weight, float(eps), rows(y), ROW=x.shape[-1])
    return y


def add_rms_norm(x, residual, weight, eps=1e-6):
    """Return ``(rms_norm(x + residual), x + residual)`` with the sum rounded to x's dtype."""
    _check(x, weight, eps)
    check_tensor("residual", residual)
    check_same(("x", "residual"), (x, residual))
    if residual.shape != x.shape:
        raise ValueError(f"residual: shape {tuple(residual.shape)}, expected {tuple(x.shape)} like x")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    fused_kernel(rows(x), rows(residual), weight, float(eps), rows(y), rows(summed), ROW=x.shape[-1])
    return y, summed
