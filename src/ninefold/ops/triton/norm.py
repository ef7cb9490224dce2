"""Triton RMS norm, with and without the fused residual add.

Each program normalises ``BLOCK_R`` whole rows held in registers (``BLOCK_D = next_pow2(d)``),
float32 inside. ``add_rms_norm`` reads x and the residual once and writes both outputs once; the
sum is rounded to x's dtype before the norm, as an unfused model does. Streaming loads are marked
evict-first and the weight evict-last, so the weight stays in L2 while rows stream through.

``rms_norm_kernel`` takes one row per program, ``rms_norm_rows_kernel`` several (short rows, or
many rows where measured faster). Launch configurations come from ``CONFIGS`` (per row width,
residual or not, and token-count bucket; measured on the H200 with
``python -m ninefold.bench.ops_memory``), else from ``default_config``. A persistent grid (programs
per SM looping over rows, with and without pipelining) measured 4-13 points slower there and was
dropped.

With PDL (:func:`ninefold.ops.triton.pdl.wanted`, switch ``NINEFOLD_ROWS_PDL``) each program lets the
next kernel launch and waits for the previous one before it reads anything, so a batched decode
step's norm overlaps the launch of the projection after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton import pdl as pdl_module
from ninefold.ops.triton.launch import Launcher, empty, pick, table_configs
from ninefold.ops.triton.launch import rows as as_rows

MAX_D = 32768


@triton.jit
def _rows(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row0, n_rows, d, stride_x, stride_res, stride_out,
          stride_res_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
          STORE: tl.constexpr, LOAD: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = (row0 + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < n_rows) & (cols < d)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0, eviction_policy=LOAD)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_res + cols, mask=mask, other=0.0, eviction_policy=LOAD)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows * stride_res_out + cols, x, mask=mask, cache_modifier=STORE)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / d + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask,
             cache_modifier=STORE)


@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, d, stride_x, stride_res, stride_out,
                    stride_res_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr,
                    LOAD: tl.constexpr, USE_GDC: tl.constexpr = False):
    _rows(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, tl.program_id(0), n_rows, d, stride_x, stride_res,
          stride_out, stride_res_out, eps, HAS_RESIDUAL, 1, BLOCK_D, STORE, LOAD, USE_GDC)


@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_rows_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, d, stride_x, stride_res, stride_out,
                         stride_res_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr, STORE: tl.constexpr, LOAD: tl.constexpr,
                         USE_GDC: tl.constexpr = False):
    _rows(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, tl.program_id(0) * BLOCK_R, n_rows, d, stride_x, stride_res,
          stride_out, stride_res_out, eps, HAS_RESIDUAL, BLOCK_R, BLOCK_D, STORE, LOAD, USE_GDC)


_ONE = Launcher(rms_norm_kernel, ("HAS_RESIDUAL", "BLOCK_D", "STORE", "LOAD", "USE_GDC"))
_MANY = Launcher(rms_norm_rows_kernel, ("HAS_RESIDUAL", "BLOCK_R", "BLOCK_D", "STORE", "LOAD", "USE_GDC"))

# Measured winners: {(d, has_residual): [(max_rows or None, {"rows": BLOCK_R, "num_warps": w}), ...]};
# optional "store": a cache modifier for the stores (".cs": streaming) and "load": the eviction
# policy of the streamed loads (default "evict_first"; "" for none).
CONFIGS: dict[tuple, list] = {
    (4096, False): [(4096, {"rows": 1, "num_warps": 8}), (None, {"rows": 4, "num_warps": 16})],
    (4096, True): [(None, {"rows": 1, "num_warps": 4})],
}
# Set by benchmarks to force a configuration.
OVERRIDE: dict = {}
_DEFAULTS: dict = {}


def default_config(key: tuple) -> dict:
    """Rows per program and warps for rows of ``d``: about 4096 elements per program, 8 per thread."""
    block = triton.next_power_of_2(key[0])
    rows = max(1, min(16, 4096 // block))
    return {"rows": rows, "num_warps": max(1, min(16, rows * block // 512))}


def config(d: int, n_rows: int, residual: bool) -> dict:
    """The launch configuration for ``n_rows`` rows of ``d``: an override, the measured table, or the default."""
    return pick(OVERRIDE, CONFIGS, (d, residual), n_rows, _DEFAULTS, default_config)


def supports(x, *rest) -> str | None:
    """Rows must have unit stride along the normalised dimension and fit one program."""
    if x.shape[-1] > MAX_D:
        return f"last dimension {x.shape[-1]} > {MAX_D}"
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def _launch(x2, r2, weight, out, total, eps, has_residual):
    n, d = x2.shape
    cfg = config(d, n, has_residual)
    block, rows = triton.next_power_of_2(d), cfg["rows"]
    args = (x2, r2, weight, out, total, n, d, x2.stride(0), r2.stride(0), out.stride(0), total.stride(0), eps)
    pdl = pdl_module.wanted(x2.device, "NINEFOLD_ROWS_PDL")
    hints = (cfg.get("store", ""), cfg.get("load", "evict_first"), pdl)
    if rows == 1:
        _ONE((n,), args, (has_residual, block, *hints), num_warps=cfg["num_warps"], device_index=x2.get_device(),
             launch_pdl=pdl)
    else:
        _MANY((triton.cdiv(n, rows),), args, (has_residual, rows, block, *hints), num_warps=cfg["num_warps"],
              device_index=x2.get_device(), launch_pdl=pdl)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    x2, out = as_rows(x), empty(x)
    if x2.shape[0]:
        out2 = as_rows(out)
        _launch(x2, x2, weight, out2, out2, float(eps), False)
    return out


def add_rms_norm(x, residual, weight, eps):
    """``(rms_norm(x + residual), x + residual)`` in one pass over x and the residual."""
    x2, out, total = as_rows(x), empty(x), empty(x)
    if x2.shape[0]:
        _launch(x2, as_rows(residual), weight, as_rows(out), as_rows(total), float(eps), True)
    return out, total


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (kernel, constexprs, num_warps) for ``ninefold.ops.triton.aot``."""
    d, residual = shapes.hidden, op == "add_rms_norm"
    block = triton.next_power_of_2(d)
    found = []
    for cfg in (OVERRIDE,) if OVERRIDE else table_configs(CONFIGS, (d, residual), default_config((d, residual))):
        if cfg["rows"] == 1:
            found.append({"kernel": rms_norm_kernel, "num_warps": cfg["num_warps"],
                          "constexprs": {"HAS_RESIDUAL": residual, "BLOCK_D": block, "STORE": cfg.get("store", ""),
                                         "LOAD": cfg.get("load", "evict_first"), "USE_GDC": False}})
        else:
            found.append({"kernel": rms_norm_rows_kernel, "num_warps": cfg["num_warps"],
                          "constexprs": {"HAS_RESIDUAL": residual, "BLOCK_R": cfg["rows"], "BLOCK_D": block,
                                         "STORE": cfg.get("store", ""), "LOAD": cfg.get("load", "evict_first"),
                                         "USE_GDC": False}})
    return found
