"""CPU implementations of ``rms_norm`` / ``add_rms_norm`` for one row (a batch-1 decode step).

The composite ``torch.rms_norm`` costs half a dozen tensor ops; for one row on a CPU the mean
square is taken as a Python number (reading it is free there) and one fused multiply
(``addcmul``) scales, applies the weight and rounds to x's dtype. Same float32 formula as the
vendor implementation: ``x * rsqrt(mean(x^2) + eps) * weight``.

Registered below ``vendor`` in the default order (so existing choices and tuning tables stand);
the CPU decode step (``llm/models/llama_cpu.py``) picks it from ``ops.candidates`` for one-row
steps, and ``ops.use(rms_norm="cpu_row")`` pins it anywhere else.
"""

from __future__ import annotations

import math

import torch

from ninefold.ops.registry import register

_ZEROS: dict[int, torch.Tensor] = {}


def _one_row(x, *rest) -> str | None:
    rows = math.prod(x.shape[:-1])
    if rows > 1:
        return f"more than one row ({rows})"
    if rows == 0:
        return "no row"
    if x.shape[-1] == 0:
        return "an empty row (last dimension 0)"
    return None


def _normalize(total: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = total.shape[-1]
    xf = total.float().reshape(1, n)
    row = xf[0]
    inv = 1.0 / math.sqrt(float(torch.dot(row, row)) / n + eps)
    zero = _ZEROS.get(n)
    if zero is None:
        zero = _ZEROS[n] = torch.zeros((1, n))
    out = torch.empty(total.shape, dtype=total.dtype)
    # weight promotes to float32 exactly; the product is rounded once, into out's dtype
    return torch.addcmul(zero, xf, weight.reshape(1, n), value=inv, out=out.view(1, n)).view(total.shape)


@register("rms_norm", "cpu_row", devices=("cpu",), supports=_one_row)
def _rms_norm_row(x, weight, eps):
    return _normalize(x, weight, eps)


@register("add_rms_norm", "cpu_row", devices=("cpu",), supports=_one_row)
def _add_rms_norm_row(x, residual, weight, eps):
    total = x + residual
    return _normalize(total, weight, eps), total
