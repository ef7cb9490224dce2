"""GEMV for a few rows (2..32) with programmatic dependent launch and fused prologues.

``y[M, N] = prologue(x)[M, K] @ weight[N, K].T`` for the decode steps of 2 to 32 sequences, the
multi-row sibling of the one-row ``ninefold.ops.triton.gemv_pdl``: at these sizes a linear layer is
still a stream of its weight, so each program owns ``BLOCK_N`` output columns and streams their
weight rows through a pipelined ``tl.dot`` loop (the rows of ``x`` padded to ``BLOCK_M``, 16 or 32,
and re-read from L2). With PDL (``USE_GDC``) a program lets the next kernel launch at once, requests its
first weight tile, and only then waits for the kernel that wrote ``x``; every program waits, so a
kernel's completion still implies its predecessors'.

Prologues (``PROLOGUE``), as the one-row kernel's:

- ``0``: ``x`` as given (``[M, K]``, row stride ``stride_x``);
- ``1``: residual add + RMSNorm per row: ``x = rms_norm(h + residual) * g``; every program computes
  the rows' norms from L2 and the first one writes ``h + residual`` (rounded to h's dtype) to
  ``residual_out`` (another buffer: the other programs still read ``residual``);
- ``2``: SwiGLU: ``x[m, k] = silu(a[m, k]) * a[m, K + k]`` for gate_up's ``[M, 2K]`` output.

FP8 weights (``SCALED``): ``w_ptr`` holds ``float8_e4m3fn`` codes, widened to x's dtype per tile, and
``s_ptr`` one float32 scale per output row, applied to the sums (weight-only FP8, as the one-row kernel).

Split-K (``SPLIT_K > 1``): float32 partials, the last program to arrive at a column block (atomic
counter) sums them in split order, stores ``y`` and resets its counter, so a call is one launch and
replays in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.gemv_pdl import (
    PROLOGUES,
    WORKSPACE,
    check_weight_dtype,
    pdl_available,
    rms_normed,
    silu_gated,
)
from ninefold.ops.triton.launch import Launcher

MIN_ROWS, MAX_ROWS = 2, 32
NORM_BLOCK = 256  # columns per step of the norm's pass over the rows (BLOCK_M x NORM_BLOCK floats in registers)


def block_m(rows: int) -> int:
    """The padded row count of the tile: 16 up to 16 rows, else 32."""
    return 16 if rows <= 16 else 32
CONFIG = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3}


@triton.jit
def _rows_chunk(x_ptr, r_ptr, g_ptr, rows, rows_ok, kk, rstd, stride_x, K, PROLOGUE: tl.constexpr):
    """Columns ``kk`` of the rows' prologue output, in x's dtype ``[BLOCK_M, BLOCK_K]`` (zero rows past M)."""
    offs = rows[:, None] * stride_x + kk[None, :]
    ok = rows_ok[:, None]
    if PROLOGUE == 1:
        x = rms_normed(tl.load(x_ptr + offs, mask=ok, other=0.0), tl.load(r_ptr + offs, mask=ok, other=0.0),
                       rstd[:, None], tl.load(g_ptr + kk)[None, :], x_ptr).to(x_ptr.dtype.element_ty)
    elif PROLOGUE == 2:
        x = silu_gated(tl.load(x_ptr + offs, mask=ok, other=0.0), tl.load(x_ptr + offs + K, mask=ok, other=0.0),
                       x_ptr).to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    return x


@triton.jit(do_not_specialize=["M"])
def gemv_rows_kernel(x_ptr, w_ptr, y_ptr, r_ptr, g_ptr, r_out_ptr, ws_ptr, cnt_ptr, s_ptr, M, N, K, stride_x,
                     stride_wn, eps, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_GDC: tl.constexpr, PRECISION: tl.constexpr,
                     NORM_BLOCK: tl.constexpr, SCALED: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    w_base = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    # The first weight tile is requested before waiting for the kernel that produced x.
    w = tl.load(w_base + k_start, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, BLOCK_M)
    rows_ok = rows < M
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == 1:
        kn = tl.arange(0, NORM_BLOCK)
        sq = tl.zeros([BLOCK_M, NORM_BLOCK], tl.float32)
        first = (pid_n == 0) & (pid_k == 0)
        for k0 in range(0, K, NORM_BLOCK):
            ok = rows_ok[:, None] & ((k0 + kn) < K)[None, :]
            offs = rows[:, None] * stride_x + (k0 + kn)[None, :]
            s = (tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if first:
                tl.store(r_out_ptr + offs, s, mask=ok)
            s = s.to(tl.float32)
            sq += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / K + eps)
    x = _rows_chunk(x_ptr, r_ptr, g_ptr, rows, rows_ok, k_start + k, rstd, stride_x, K, PROLOGUE)
    acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
    for k0 in range(k_start + BLOCK_K, k_start + k_len, BLOCK_K):
        w = tl.load(w_base + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        x = _rows_chunk(x_ptr, r_ptr, g_ptr, rows, rows_ok, k0 + k, rstd, stride_x, K, PROLOGUE)
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc, input_precision=PRECISION)
    if SCALED:  # FP8 codes: one float32 scale per output row
        acc *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    out_ok = rows_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(ws_ptr + (pid_k * BLOCK_M + rows)[:, None] * N + n[None, :], acc, mask=n_ok[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1)
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + (s * BLOCK_M + rows)[:, None] * N + n[None, :], mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + rows[:, None] * N + n[None, :], total.to(y_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


_LAUNCH = Launcher(gemv_rows_kernel, ("PROLOGUE", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_GDC", "PRECISION",
                                       "NORM_BLOCK", "SCALED"))


def _check(x: torch.Tensor, weight: torch.Tensor, prologue: str, split_k: int, block_k: int,
           scales: torch.Tensor | None = None) -> tuple[int, int]:
    """Validate a call; returns (M, K). Raises ``ValueError``/``TypeError`` naming the argument."""
    if prologue not in PROLOGUES:
        raise ValueError(f"gemv_rows: prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"gemv_rows: split_k must be a positive int, got {split_k!r}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv_rows: weight must be a 2-D [N, K] tensor with contiguous rows, got shape "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    k = weight.shape[1]
    width = 2 * k if prologue == "silu_and_mul" else k
    if x.dim() != 2 or x.shape[1] != width or not x.is_contiguous() or not MIN_ROWS <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv_rows: x must be a contiguous [M, {width}] tensor with {MIN_ROWS} <= M <= {MAX_ROWS} "
                         f"for weight {tuple(weight.shape)} and prologue {prologue!r}, got shape {tuple(x.shape)}")
    check_weight_dtype("gemv_rows", x, weight, scales)
    if k % (split_k * block_k):
        raise ValueError(f"gemv_rows: K = {k} must be a multiple of split_k * block_k = {split_k * block_k}")
    return x.shape[0], k


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, *, prologue: str = "none", residual: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual_out: torch.Tensor | None = None,
              split_k: int = 1, pdl: bool = False, out: torch.Tensor | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """``prologue(x) @ weight.T`` for ``x [M, K]`` (``[M, 2K]`` for ``"silu_and_mul"``), 2 <= M <= 32;
    returns ``y [M, N]`` (``out`` when given). ``weight`` is x's dtype, or ``float8_e4m3fn`` codes with
    ``scales`` (float32 ``[N]``, one per row), as for ``gemv_pdl``.

    ``prologue="add_rms_norm"`` needs ``residual`` and ``residual_out`` (``[M, K]``, contiguous; the
    latter receives ``x + residual``) and ``norm_weight`` (``[K]``). ``pdl=True`` launches with
    programmatic dependent launch (only where :func:`ninefold.ops.triton.gemv_pdl.pdl_available`).
    """
    block_n = block_n or CONFIG["block_n"]
    block_k = min(block_k or CONFIG["block_k"], weight.shape[1])
    m, k = _check(x, weight, prologue, split_k, block_k, scales)
    n = weight.shape[0]
    if prologue == "add_rms_norm":
        for name, t in (("residual", residual), ("residual_out", residual_out)):
            if t is None or tuple(t.shape) != (m, k) or not t.is_contiguous():
                raise ValueError(f"gemv_rows: prologue 'add_rms_norm' needs a contiguous [{m}, {k}] {name}, "
                                 f"got {None if t is None else tuple(t.shape)}")
        if norm_weight is None or norm_weight.numel() != k or not norm_weight.is_contiguous():
            raise ValueError(f"gemv_rows: prologue 'add_rms_norm' needs a contiguous norm_weight of {k} elements, "
                             f"got {None if norm_weight is None else tuple(norm_weight.shape)}")
        if residual_out.data_ptr() == residual.data_ptr():
            raise ValueError("gemv_rows: residual_out must not alias residual (other programs still read it)")
    if pdl and not pdl_available(x.device):
        raise ValueError("gemv_rows: pdl=True needs Triton's launch_pdl/gdc API and a CUDA device of sm_90+")
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, block_n)
    bm = block_m(m)
    ws, cnt = (WORKSPACE.get(x.device, n * bm, split_k, n_blocks) if split_k > 1 else (y, y))
    args = (x, weight, y, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
            residual_out if residual_out is not None else x, ws, cnt, scales if scales is not None else y, m, n, k,
            x.stride(0), weight.stride(0), float(eps))
    consts = (PROLOGUES[prologue], bm, block_n, block_k, split_k, pdl,
              "ieee" if x.dtype == torch.float32 else "tf32", NORM_BLOCK, scales is not None)
    _LAUNCH((n_blocks, split_k), args, consts, num_warps=num_warps or CONFIG["num_warps"],
            num_stages=num_stages or CONFIG["num_stages"], device_index=x.device.index or 0, launch_pdl=pdl)
    return y
