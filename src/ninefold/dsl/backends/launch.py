"""Shared by the triton and interpret backends: generate (cached) and load a specialization."""

from __future__ import annotations

import math

import torch

from ninefold.dsl.backends.triton_codegen import argument_values, collapsible, generate, specialize
from ninefold.dsl.cache import load_module


def prepare(kernel, bound, spec=None, interpret=False, persistent=False, tma=False, grouped=True, hoist=False, ws=False):
    """Generated code and loaded ``triton.jit`` function for this call's specialization.

    ``spec`` overrides the mask specialization (AOT compiles the generic one); ``interpret`` makes
    every integer argument a constexpr (Triton 3.6's interpreter hands other ints over as arrays,
    which ``range`` rejects); ``persistent`` generates the persistent form, ``tma`` the descriptor
    loads (see ``generate``; ``"rows"``: 2-D-style descriptors where the call's strides allow);
    ``grouped`` False visits the programs in row-major order (the last grid dimension fastest);
    ``hoist`` moves descriptor loads to the top of their loop iteration; ``ws`` warp-specializes the
    dot loop, with descriptors made in the kernel.
    """
    spec = specialize(kernel, bound.env) if spec is None else spec
    wide = any(
        isinstance(v, torch.Tensor) and v.numel() > 0 and _span(v) >= 2**30 for v in bound.values.values()
    )
    collapse = ()
    if tma == "rows":  # which tensors' leading dimensions can be read as one (part of the key)
        collapse = tuple((n, collapsible(v)) for n, v in sorted(bound.values.items()) if isinstance(v, torch.Tensor) and v.dim() > 1)
    hints = repr(sorted((kernel.cache_hints or {}).items()))
    hoist = bool(hoist and tma)
    ws = bool(ws and tma)
    key = ("triton", spec, wide, interpret, persistent, tma, collapse, grouped, hoist, hints) + (("ws",) if ws else ())
    if key not in kernel._cache:
        generated = generate(
            kernel, spec, wide=wide, interpret=interpret, persistent=persistent, tma=tma, collapse=collapse,
            grouped=grouped, hoist=hoist, ws=ws,
        )
        module = load_module(generated.source, generated.key)
        kernel._cache[key] = (generated, getattr(module, generated.function_name))
    return kernel._cache[key]


def _span(tensor):
    return 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))


def grid_size(bound) -> int:
    """Number of programs (0 when a grid dimension is empty: nothing to launch)."""
    return math.prod(bound.grid) if bound.grid else 1


__all__ = ["prepare", "grid_size", "argument_values"]
