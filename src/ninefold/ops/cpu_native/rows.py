"""``cpu_native`` implementations of ``add_rms_norm``, ``silu_and_mul`` and ``rope`` for many rows on
CPUs (``nf_rows.c``): one pass per row on all threads instead of torch's several whole-tensor ops.

A 512-token SmolLM2 prefill spends ~70 ms of ~500 in these three through torch (13:34 UTC, 2 threads).
They take float32 or bfloat16, round where the ``vendor`` formulas round, and step aside (a reason
from ``supports``) for single rows (``norm_row``'s ``cpu_row`` and the native decode step cover those),
other dtypes, non-contiguous rows and CPUs where the kernels build without vector code (no AVX2).
"""

from __future__ import annotations

import math

import torch

from ninefold.ops import spec
from ninefold.ops.registry import register

_DTYPES = (torch.float32, torch.bfloat16)


def _common(x: torch.Tensor) -> str | None:
    from ninefold.ops import cpu_native

    if x.dtype not in _DTYPES:
        return f"takes float32 or bfloat16, not {spec.dtype_name(x.dtype)}"
    if x.shape[-1] == 0:
        return "x's last dimension is 0"
    if x.numel() <= x.shape[-1]:
        return "one row (cpu_row / the native decode step cover it)"
    if not cpu_native.fast():
        return cpu_native.slow_reason()
    return None


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, last]`` with unit last stride and a single row stride, or None."""
    flat = t.reshape(math.prod(t.shape[:-1]), t.shape[-1]) if t.dim() != 2 else t  # (-1 is ambiguous for 0 values)
    return flat if flat.stride(-1) == 1 else None


def _norm_supports(x, residual, weight, eps) -> str | None:
    if residual.dtype != x.dtype or _rows(x) is None or _rows(residual) is None:
        return "x and residual need one dtype and contiguous rows"
    return _common(x)


@register("add_rms_norm", "cpu_native", devices=("cpu",), supports=_norm_supports, priority={"cpu": 5})
def _add_rms_norm_native(x, residual, weight, eps):
    from ninefold.ops import cpu_native

    d = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    out, total = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    w = weight.float().contiguous()
    cpu_native.library().nf_add_rms_norm(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), w.data_ptr(),
                                         x2.shape[0], d, eps, int(x.dtype == torch.bfloat16), out.data_ptr(),
                                         total.data_ptr())
    return out, total


def _silu_supports(x) -> str | None:
    if _rows(x) is None:
        return "x needs contiguous rows"
    return _common(x)


@register("silu_and_mul", "cpu_native", devices=("cpu",), supports=_silu_supports, priority={"cpu": 5})
def _silu_and_mul_native(x):
    from ninefold.ops import cpu_native

    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    cpu_native.library().nf_silu_and_mul(x2.data_ptr(), x2.stride(0), x2.shape[0], d,
                                         int(x.dtype == torch.bfloat16), out.data_ptr())
    return out


def _rope_supports(q, k, positions, cos_sin_cache, is_neox) -> str | None:
    if not is_neox:
        return "neox (halves) layout only"
    if k.dtype != q.dtype or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        return "q and k of one dtype, a contiguous float32 cos/sin cache"
    d = q.shape[-1]
    for t in (q, k):
        if t.stride(-1) != 1 or t.stride(-2) != d:
            return "the heads of q and k must be contiguous rows"
    return _common(q)


@register("rope", "cpu_native", devices=("cpu",), supports=_rope_supports, priority={"cpu": 5})
def _rope_native(q, k, positions, cos_sin_cache, is_neox):
    from ninefold.ops import cpu_native

    t, hq, d = q.shape
    pos = positions.to(torch.int64).contiguous()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cos_sin_cache.shape[0]):
        raise spec.OpError(f"rope: positions must lie in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache rows), got "
                           f"values from {int(pos.min())} to {int(pos.max())}")
    qo, ko = torch.empty((t, hq, d), dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    cpu_native.library().nf_rope_neox(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), pos.data_ptr(),
                                      cos_sin_cache.data_ptr(), cos_sin_cache.shape[1], t, hq, k.shape[1], d,
                                      int(q.dtype == torch.bfloat16), qo.data_ptr(), ko.data_ptr())
    return qo, ko
