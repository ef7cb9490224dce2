"""Elementwise operators: ``add``, ``mul`` (broadcasting) and the gated activations
``silu_and_mul`` / ``gelu_and_mul`` (x ``[..., 2d]`` -> ``act(x[..., :d]) * x[..., d:]``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninefold.ops import spec
from ninefold.ops.dispatch import Operator
from ninefold.ops.registry import register


def _binary_key(op: str, a, b) -> tuple:
    spec.tensor(op, "a", a)
    spec.tensor(op, "b", b)
    spec.same_device(op, "a", a, b=b)
    spec.same_dtype(op, "a", a, b=b)
    if a.shape != b.shape:
        try:
            out_shape = torch.broadcast_shapes(a.shape, b.shape)
        except RuntimeError:
            raise spec.OpError(f"{op}: shapes of a {tuple(a.shape)} and b {tuple(b.shape)} do not broadcast") from None
        return a.device, a.dtype, (spec.pow2(out_shape.numel()),), False
    return a.device, a.dtype, (spec.pow2(a.numel()),), a.is_contiguous() and b.is_contiguous()


def _add_key(a, b):
    return _binary_key("add", a, b)


def _mul_key(a, b):
    return _binary_key("mul", a, b)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` with broadcasting; both tensors share dtype and device."""
    return _ADD.call(a, b)


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` with broadcasting; both tensors share dtype and device."""
    return _MUL.call(a, b)


_ADD = Operator("add", add, _add_key)
_MUL = Operator("mul", mul, _mul_key)


def _gated_key(op: str, x) -> tuple:
    spec.tensor(op, "x", x, min_ndim=1)
    if x.shape[-1] % 2:
        raise spec.OpError(f"{op}: the last dimension of x must be even ([..., 2d]), got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    rows = x.numel() // max(x.shape[-1], 1)
    return x.device, x.dtype, (spec.pow2(rows), d), x.stride(-1) == 1


def _silu_key(x):
    return _gated_key("silu_and_mul", x)


_GELU_APPROXIMATIONS = ("none", "tanh")


def _gelu_key(x, approximate="none"):
    if approximate not in _GELU_APPROXIMATIONS:
        raise spec.OpError(f"gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
    return (*_gated_key("gelu_and_mul", x), approximate)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]`` (the SwiGLU gate), x's dtype out."""
    return _SILU.call(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` for x ``[..., 2d]`` (GeGLU), x's dtype out."""
    return _GELU.call(x, approximate)


_SILU = Operator("silu_and_mul", silu_and_mul, _silu_key)
_GELU = Operator("gelu_and_mul", gelu_and_mul, _gelu_key)


register("add", "vendor")(torch.add)
register("mul", "vendor")(torch.mul)


@register("silu_and_mul", "vendor")
def _silu_and_mul_torch(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@register("gelu_and_mul", "vendor")
def _gelu_and_mul_torch(x, approximate):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]
