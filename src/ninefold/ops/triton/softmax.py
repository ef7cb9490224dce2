"""Triton softmax over the last dimension, float32 inside.

Rows up to ``MAX_SINGLE`` wide are held in registers (one read, one write): one row per program
(``softmax_kernel`` with ``SINGLE``), or ``BLOCK_R`` rows per program for short rows
(``softmax_rows_kernel``). Wider rows stream twice (running max and sum, then the normalised
write). Launch configurations: ``CONFIGS`` (measured on the H200 with
``python -m ninefold.bench.ops_memory``), else ``default_config``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import Launcher, empty, pick, table_configs
from ninefold.ops.triton.launch import rows as as_rows

MAX_SINGLE = 16384
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 4096


@triton.jit
def _rows(x_ptr, out_ptr, row0, n_rows, n, stride_x, stride_out, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = (row0 + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows) & (cols < n)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=float("-inf"),
                eviction_policy="evict_first").to(tl.float32)
    # Rows past the end are all -inf: their max is replaced by 0 so no NaN is computed (nor stored).
    row_max = tl.max(x, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.exp(x - row_max[:, None])
    tl.store(out_ptr + rows * stride_out + cols, (e / tl.sum(e, 1)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def softmax_rows_kernel(x_ptr, out_ptr, n_rows, n, stride_x, stride_out, BLOCK_R: tl.constexpr,
                        BLOCK: tl.constexpr):
    _rows(x_ptr, out_ptr, tl.program_id(0) * BLOCK_R, n_rows, n, stride_x, stride_out, BLOCK_R, BLOCK)


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n, stride_x, stride_out, SINGLE: tl.constexpr, BLOCK: tl.constexpr,
                   STATIC_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    dst = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        x = tl.load(src + cols, mask=cols < n, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
        e = tl.exp(x - tl.max(x, 0))
        tl.store(dst + cols, (e / tl.sum(e, 0)).to(out_ptr.dtype.element_ty), mask=cols < n)
    else:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        # Triton's interpreter (3.6) cannot loop to a run-time bound: it gets the width as STATIC_N.
        for start in range(0, STATIC_N if STATIC_N > 0 else n, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(
                x == float("-inf"), 0.0, tl.exp(x - m_new))
            m = m_new
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - row_max), 0)
        for start in range(0, STATIC_N if STATIC_N > 0 else n, BLOCK):
            x = tl.load(src + start + cols, mask=start + cols < n, other=float("-inf"),
                        eviction_policy="evict_first").to(tl.float32)
            tl.store(dst + start + cols, (tl.exp(x - row_max) / total).to(out_ptr.dtype.element_ty),
                     mask=start + cols < n)


_SINGLE = Launcher(softmax_kernel, ("SINGLE", "BLOCK", "STATIC_N"))
_ROWS = Launcher(softmax_rows_kernel, ("BLOCK_R", "BLOCK"))

# Measured winners for register-resident rows:
# {n: [(max_rows or None, {"rows": BLOCK_R, "num_warps": w}), ...]} (H200, bench.ops_memory).
CONFIGS: dict[int, list] = {8192: [(None, {"rows": 1, "num_warps": 16})]}
# Set by benchmarks to force a configuration.
OVERRIDE: dict = {}
_DEFAULTS: dict = {}


def supports(x, dim) -> str | None:
    if dim % x.dim() != x.dim() - 1:
        return "only the last dimension"
    return None if x.stride(-1) == 1 else "last dimension is not contiguous"


def default_config(n: int) -> dict:
    """Rows per program and warps for register-resident rows of ``n``: ~16 elements per thread."""
    block = triton.next_power_of_2(max(n, 1))
    rows = max(1, min(16, 2048 // block))
    return {"rows": rows, "num_warps": max(1, min(16, rows * block // 512))}


def row_config(n: int, n_rows: int) -> dict:
    """The register-resident configuration for ``n_rows`` rows of ``n``: override, measured table, or default."""
    return pick(OVERRIDE, CONFIGS, n, n_rows, _DEFAULTS, default_config)


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over the last dimension of ``x``."""
    n = x.shape[-1]
    x2, result = as_rows(x), empty(x)
    out = as_rows(result)
    rows = x2.shape[0]
    if rows and n:
        dev = x2.get_device()
        if n <= MAX_SINGLE:
            cfg, block = row_config(n, rows), triton.next_power_of_2(n)
            if cfg["rows"] > 1:
                _ROWS((triton.cdiv(rows, cfg["rows"]),), (x2, out, rows, n, x2.stride(0), out.stride(0)),
                      (cfg["rows"], block), num_warps=cfg["num_warps"], device_index=dev)
            else:
                _SINGLE((rows,), (x2, out, n, x2.stride(0), out.stride(0)), (True, block, 0),
                        num_warps=cfg["num_warps"], device_index=dev)
        else:
            _SINGLE((rows,), (x2, out, n, x2.stride(0), out.stride(0)), (False, CHUNK, n if INTERPRETED else 0),
                    num_warps=8, device_index=dev)
    return result


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (for ``ninefold.ops.triton.aot``)."""
    found = []
    for n in (shapes.softmax_width, shapes.vocab):
        if n > MAX_SINGLE:
            found.append({"kernel": softmax_kernel, "num_warps": 8,
                          "constexprs": {"SINGLE": False, "BLOCK": CHUNK, "STATIC_N": 0}})
            continue
        block = triton.next_power_of_2(n)
        for cfg in (OVERRIDE,) if OVERRIDE else table_configs(CONFIGS, n, default_config(n)):
            if cfg["rows"] > 1:
                found.append({"kernel": softmax_rows_kernel, "num_warps": cfg["num_warps"],
                              "constexprs": {"BLOCK_R": cfg["rows"], "BLOCK": block}})
            else:
                found.append({"kernel": softmax_kernel, "num_warps": cfg["num_warps"],
                              "constexprs": {"SINGLE": True, "BLOCK": block, "STATIC_N": 0}})
    return found
