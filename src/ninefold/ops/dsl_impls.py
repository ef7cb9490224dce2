"""``ninefold.dsl`` kernels (``ninefold.ops.kernels``) registered as the "dsl" implementations.

They run on CPUs (the DSL's vectorised cpu backend) and on CUDA (generated Triton). Kernel
modules are imported on first use, so ``import ninefold.ops`` stays light. By default they rank
below the vendor implementation; tuning or a pin (``NINEFOLD_OPS=rms_norm=dsl``) selects them.
"""

from __future__ import annotations

import importlib

import torch

from ninefold.ops.registry import register
from ninefold.ops.spec import FLOAT_DTYPES

PRIORITY = {"cuda": -5, "cpu": -5}


def _lazy(module: str, attr: str):
    """A function that imports ``ninefold.ops.kernels.<module>.<attr>`` on its first call."""
    resolved = []

    def call(*args):
        if not resolved:
            resolved.append(getattr(importlib.import_module(f"ninefold.ops.kernels.{module}"), attr))
        return resolved[0](*args)

    call.__name__ = f"dsl_{attr}"
    return call


def _linear(x, weight, bias):
    mm = importlib.import_module("ninefold.ops.kernels.mm")
    x2 = x.reshape(-1, x.shape[-1])
    out = mm.mm(x2, weight.T) if bias is None else mm.addmm(bias, x2, weight.T)
    return out.view(*x.shape[:-1], weight.shape[0])


def _linear_supports(x, weight, bias) -> str | None:
    if x.dtype == torch.float32 and x.device.type == "cuda":
        return "float32 dot products run as TF32 on CUDA (not float32 accuracy)"
    return _rows_not_empty(x)


def _rows_not_empty(x, *rest) -> str | None:
    """The row kernels take ``x`` as rows of its last dimension, which they cannot do when it is 0."""
    return "x's last dimension is 0" if x.ndim and x.shape[-1] == 0 else None


def _softmax_supports(x, dim=-1) -> str | None:
    return f"x's dimension {dim} is 0" if x.shape[dim] == 0 else None


KERNELS = {
    "rms_norm": _lazy("rms_norm", "rms_norm"),
    "add_rms_norm": _lazy("rms_norm", "add_rms_norm"),
    "silu_and_mul": _lazy("activation", "silu_and_mul"),
    "softmax": _lazy("softmax", "softmax"),
    "rope": _lazy("rope", "rope"),
    "add": _lazy("add", "add"),
    "linear": _linear,
}

SUPPORTS = {"linear": _linear_supports, "rms_norm": _rows_not_empty, "add_rms_norm": _rows_not_empty,
            "silu_and_mul": _rows_not_empty, "softmax": _softmax_supports}

for _op, _fn in KERNELS.items():
    register(_op, "dsl", devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, supports=SUPPORTS.get(_op), priority=PRIORITY)(_fn)
