"""Triton gated activations: ``silu_and_mul`` and ``gelu_and_mul`` over rows of ``[..., 2d]``.

One program per (row, block of ``BLOCK`` output columns): a 2-D grid, or with ``FLAT`` a 1-D one
whose consecutive programs walk along a row. Float32 math, evict-first streaming loads. The exact
GELU takes erf from a rational approximation (Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7, within
a few float32 ulps of libdevice's erff) because libdevice's erff costs ~44 instructions per element,
which made the kernel compute-bound on the H200 (84% of copy bandwidth against silu's 89%).
Launch configurations: ``CONFIGS`` (per ``d``, measured on the H200 with
``python -m ninefold.bench.ops_memory``), else ``BLOCK`` with 4 warps. With PDL
(:func:`ninefold.ops.triton.pdl.wanted`, switch ``NINEFOLD_ROWS_PDL``) each program lets the next
kernel launch and waits for the previous one before it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton import pdl as pdl_module
from ninefold.ops.triton.launch import Launcher, pick, table_configs

BLOCK = 1024


@triton.jit
def _erf(x):
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * tl.exp(-a * a)
    return tl.where(x < 0, -y, y)


@triton.jit
def gated_kernel(x_ptr, out_ptr, d, stride_x, stride_out, ACT: tl.constexpr, BLOCK: tl.constexpr,
                 FLAT: tl.constexpr, STORE: tl.constexpr, LOAD: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if FLAT:
        blocks = tl.cdiv(d, BLOCK)
        row = (tl.program_id(0) // blocks).to(tl.int64)
        cols = (tl.program_id(0) % blocks) * BLOCK + tl.arange(0, BLOCK)
    else:
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0, eviction_policy=LOAD).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0, eviction_policy=LOAD).to(tl.float32)
    if ACT == 0:  # silu
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:  # exact gelu
        act = 0.5 * gate * (1.0 + _erf(gate * 0.7071067811865476))
    elif ACT == 3:  # exact gelu with libdevice's erf (kept for comparison in the benchmark)
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:  # tanh gelu, tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 / (1.0 + tl.exp(-2.0 * z)))
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask,
             cache_modifier=STORE)


_LAUNCH = Launcher(gated_kernel, ("ACT", "BLOCK", "FLAT", "STORE", "LOAD", "USE_GDC"))

# Measured winners: {(d, act): [(max_rows or None, {"block": BLOCK, "num_warps": w}), ...]} with act
# "silu" or "gelu", optionally "flat": True (1-D grid), "libdevice_erf": True (exact GELU through
# libdevice's erf), "store": a cache modifier for the stores (".cs": streaming) and "load": the loads
# eviction policy (default "evict_first"; "" for none). H200, bench.ops_memory.
CONFIGS: dict[tuple, list] = {(14336, "silu"): [(None, {"block": 2048, "num_warps": 8})],
                              (14336, "gelu"): [(None, {"block": 2048, "num_warps": 4})]}
# Set by benchmarks to force a configuration.
OVERRIDE: dict = {}
_DEFAULTS: dict = {}


def _default(key) -> dict:
    return {"block": BLOCK, "num_warps": 4}


def config(d: int, n_rows: int, act: str) -> dict:
    """Block of output columns per program and warps for ``n_rows`` rows of ``d`` outputs."""
    return pick(OVERRIDE, CONFIGS, (d, act), n_rows, _DEFAULTS, _default)


def supports(x, *rest) -> str | None:
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def _gated(x: torch.Tensor, act: int) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        cfg = config(d, x2.shape[0], "silu" if act == 0 else "gelu")
        blocks, flat = triton.cdiv(d, cfg["block"]), cfg.get("flat", False)
        if act == 1 and cfg.get("libdevice_erf"):
            act = 3
        pdl = pdl_module.wanted(x2.device, "NINEFOLD_ROWS_PDL")
        _LAUNCH((x2.shape[0] * blocks,) if flat else (x2.shape[0], blocks), (x2, out, d, x2.stride(0), out.stride(0)),
                (act, cfg["block"], flat, cfg.get("store", ""), cfg.get("load", "evict_first"), pdl),
                num_warps=cfg["num_warps"], device_index=x2.get_device(), launch_pdl=pdl)
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x):
    """``silu(x[..., :d]) * x[..., d:]``."""
    return _gated(x, 0)


def gelu_and_mul(x, approximate):
    """``gelu(x[..., :d]) * x[..., d:]`` (exact, or the tanh form with ``approximate="tanh"``)."""
    return _gated(x, 1 if approximate == "none" else 2)


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (for ``ninefold.ops.triton.aot``)."""
    name = "silu" if op == "silu_and_mul" else "gelu"
    found = []
    for cfg in (OVERRIDE,) if OVERRIDE else table_configs(CONFIGS, (shapes.intermediate, name), _default(None)):
        acts = [0] if op == "silu_and_mul" else [3 if cfg.get("libdevice_erf") else 1, 2]
        found += [{"kernel": gated_kernel, "num_warps": cfg["num_warps"],
                   "constexprs": {"ACT": a, "BLOCK": cfg["block"], "FLAT": cfg.get("flat", False),
                                  "STORE": cfg.get("store", ""), "LOAD": cfg.get("load", "evict_first"),
                                  "USE_GDC": False}}
                  for a in acts]
    return found
