"""Triton gated activations: ``silu_and_mul`` and ``gelu_and_mul`` over rows of ``[..., 2d]``.

A 2-D grid: (row, block of ``BLOCK`` output columns); float32 math, evict-first streaming loads.
Launch configurations: ``CONFIGS`` (per ``d``, measured on the H200 with
``python -m ninefold.bench.ops_memory``), else ``BLOCK`` with 4 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import Launcher

BLOCK = 1024


@triton.jit
def gated_kernel(x_ptr, out_ptr, d, stride_x, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if ACT == 0:  # silu
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:  # exact gelu
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:  # tanh gelu, tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * z)))
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


_LAUNCH = Launcher(gated_kernel, ("ACT", "BLOCK"))

# Measured winners: {d: {"block": BLOCK, "num_warps": w}}.
CONFIGS: dict[int, dict] = {}
# Set by benchmarks to force a configuration.
OVERRIDE: dict = {}


def config(d: int) -> dict:
    """Block of output columns per program and warps for ``d`` outputs per row."""
    return OVERRIDE or CONFIGS.get(d) or {"block": BLOCK, "num_warps": 4}


def supports(x, *rest) -> str | None:
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def _gated(x: torch.Tensor, act: int) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        cfg = config(d)
        _LAUNCH((x2.shape[0], triton.cdiv(d, cfg["block"])), (x2, out, d, x2.stride(0), out.stride(0)),
                (act, cfg["block"]), num_warps=cfg["num_warps"], device_index=x2.get_device())
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x):
    """``silu(x[..., :d]) * x[..., d:]``."""
    return _gated(x, 0)


def gelu_and_mul(x, approximate):
    """``gelu(x[..., :d]) * x[..., d:]`` (exact, or the tanh form with ``approximate="tanh"``)."""
    return _gated(x, 1 if approximate == "none" else 2)


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (for ``ninefold.ops.triton.aot``)."""
    cfg = config(shapes.intermediate)
    acts = [0] if op == "silu_and_mul" else [1, 2]
    return [{"kernel": gated_kernel, "constexprs": {"ACT": a, "BLOCK": cfg["block"]}, "num_warps": cfg["num_warps"]}
            for a in acts]
