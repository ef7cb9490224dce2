"""Batch-1 GEMV for Hopper's programmatic dependent launch (PDL), with fused prologues.

``y[N] = x[K] @ weight[N, K].T`` for one row. Weights never depend on the kernel before, so each
program issues the loads of its first weight tile, then waits for the previous kernel
(``gdc_wait``) and only then reads the activation; ``gdc_launch_dependents`` is called at the start
so the next PDL kernel may become resident while this one streams (its own first weight loads
overlap this kernel's tail). Every program waits unconditionally, so a kernel's completion still
implies its predecessors' (correctness of reads two kernels back).

Prologues (``PROLOGUE``):

- ``0``: ``x`` as given.
- ``1``: residual add + RMSNorm: ``x = rms_norm(h + residual) * g``; every program recomputes the
  norm of the row from L2, the first program writes ``h + residual`` (rounded to h's dtype) to
  ``residual_out`` (a different buffer: other programs still read ``residual``).
- ``2``: SwiGLU: ``x[k] = silu(a[k]) * a[K + k]`` for ``a`` of length ``2K`` (gate_up's output).

The K loop multiplies register-buffered weight tiles with the row (``DEPTH`` 1 or 2 tiles in flight
ahead, all requested before ``gdc_wait``), or with ``DOT`` runs ``tl.dot`` on the row padded to 16 so
Triton pipelines the weight stream. Measured on the H200 it beats cuBLAS at one row on every
Llama-3-8B shape (``docs/perf/ops.md``, ``python -m ninefold.bench.decode_chain``).

FP8 weights (``SCALED``): ``w_ptr`` holds ``float8_e4m3fn`` codes, widened in registers as they are used,
and ``s_ptr`` one float32 scale per output row, applied to each program's sums (``ops.Fp8Weight``; x and y
keep their dtype: weight-only FP8, half the bytes streamed; the ``tl.dot`` loop multiplies a bfloat16 x as
float16, saturating at +-65504, ``fp8_operand``).

Split-K (``SPLIT_K > 1``): programs write float32 partials, the last to arrive at a column block
(atomic counter) sums them, writes ``y`` and resets the counter to 0, so the call needs no separate
reduction kernel and replays in CUDA graphs.

PDL needs Triton's ``gdc_wait``/``launch_pdl`` (Triton 3.6 and 3.9 checked; sm_90+): :func:`pdl_available`.
Without them (or under the interpreter) the same kernel runs with ``USE_GDC=False``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ninefold.ops.triton import launch
from ninefold.ops.triton.fp8_operand import padded_row
from ninefold.ops.triton.launch import Launcher

PROLOGUES = {"none": 0, "add_rms_norm": 1, "silu_and_mul": 2}


def pdl_api() -> bool:
    """Whether this Triton exposes ``gdc_wait``/``gdc_launch_dependents`` and ``launch_pdl``."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def pdl_available(device: torch.device | None = None) -> bool:
    """PDL usable here: the Triton API, a CUDA device of compute capability >= 9, no interpreter (on ``meta``
    tensors: while a build records the PDL launches of its target GPU)."""
    if device is not None and device.type == "meta":
        return launch.recording_pdl()
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    index = (device.index if device is not None and device.index is not None else torch.cuda.current_device())
    return _pdl_on(index)


@functools.cache
def _pdl_on(index: int) -> bool:
    return pdl_api() and torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def rms_normed(h, r, rstd, g, x_ptr):
    """``rms_norm(h + r) * g`` in float32 with the model's roundings to x's dtype (the sum, the normalised
    value, the product): the add+RMSNorm prologue of the GEMVs (``rstd`` broadcasts against ``h``)."""
    s = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
    x = (s * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * g.to(tl.float32)
    return x.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def silu_gated(a, b, x_ptr):
    """``silu(a) * b`` in float32, the gate rounded to x's dtype first and the product after (SwiGLU prologue)."""
    a = a.to(tl.float32)
    x = (a / (1.0 + tl.exp(-a))).to(x_ptr.dtype.element_ty).to(tl.float32) * b.to(tl.float32)
    return x.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _x_chunk(x_ptr, r_ptr, g_ptr, kk, rstd, K, PROLOGUE: tl.constexpr):
    if PROLOGUE == 1:
        x = rms_normed(tl.load(x_ptr + kk), tl.load(r_ptr + kk), rstd, tl.load(g_ptr + kk), x_ptr)
    elif PROLOGUE == 2:
        x = silu_gated(tl.load(x_ptr + kk), tl.load(x_ptr + K + kk), x_ptr)
    else:
        x = tl.load(x_ptr + kk).to(tl.float32)
    return x


@triton.jit
def gemv_pdl_kernel(x_ptr, w_ptr, y_ptr, r_ptr, g_ptr, r_out_ptr, ws_ptr, cnt_ptr, s_ptr, N, K, stride_wn, eps,
                    PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, USE_GDC: tl.constexpr, DOT: tl.constexpr = False,
                    PRECISION: tl.constexpr = "ieee", NORM_BLOCK: tl.constexpr = 1024,
                    DEPTH: tl.constexpr = 1, SCALED: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    k_len = K // SPLIT_K
    k_start = pid_k * k_len
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + (k_start + k)[None, :]
    # The first weight tile(s) are requested before waiting for the kernel that produced x.
    w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
    if DEPTH == 2:
        w1 = tl.load(w_ptrs + BLOCK_K, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if PROLOGUE == 1:
        # The whole row in one or few wide steps: each step is one round trip to L2.
        kn = tl.arange(0, NORM_BLOCK)
        sq = tl.zeros([NORM_BLOCK], tl.float32)
        first = (pid_n == 0) & (pid_k == 0)
        for k0 in range(0, K, NORM_BLOCK):
            ok = k0 + kn < K
            s = (tl.load(x_ptr + k0 + kn, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptr + k0 + kn, mask=ok, other=0.0).to(tl.float32))
            s = s.to(x_ptr.dtype.element_ty)
            if first:
                tl.store(r_out_ptr + k0 + kn, s, mask=ok)
            s = s.to(tl.float32)
            sq += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
    if DOT:
        # The row padded to 16 for tl.dot, so Triton's pipeliner streams the weight tiles (cp.async).
        row0 = tl.arange(0, 16)[:, None] == 0
        x = _x_chunk(x_ptr, r_ptr, g_ptr, k_start + k, rstd, K, PROLOGUE)
        xp = padded_row(x, row0, x_ptr, w_ptr)
        acc2 = tl.dot(xp, tl.trans(w.to(xp.dtype)), input_precision=PRECISION)
        w_base = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
        for k0 in range(k_start + BLOCK_K, k_start + k_len, BLOCK_K):
            w = tl.load(w_base + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            x = _x_chunk(x_ptr, r_ptr, g_ptr, k0 + k, rstd, K, PROLOGUE)
            xp = padded_row(x, row0, x_ptr, w_ptr)
            acc2 = tl.dot(xp, tl.trans(w.to(xp.dtype)), acc2, input_precision=PRECISION)
        out = tl.sum(acc2, 0)
    else:
        # Register double buffering (Triton does not pipeline loads that feed no dot): tile i + 1 is
        # requested before tile i is used.
        # The activation chunk is double-buffered the same way.
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        x = _x_chunk(x_ptr, r_ptr, g_ptr, k_start + k, rstd, K, PROLOGUE)
        if DEPTH == 2:  # two tiles in flight per program (a ring of three)
            x1 = _x_chunk(x_ptr, r_ptr, g_ptr, k_start + BLOCK_K + k, rstd, K, PROLOGUE)
            w_ptrs += BLOCK_K
            for k0 in range(k_start + 2 * BLOCK_K, k_start + k_len, BLOCK_K):
                w_ptrs += BLOCK_K
                w2 = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                x2 = _x_chunk(x_ptr, r_ptr, g_ptr, k0 + k, rstd, K, PROLOGUE)
                acc += w.to(tl.float32) * x[None, :]
                w = w1
                x = x1
                w1 = w2
                x1 = x2
            acc += w1.to(tl.float32) * x1[None, :]
        else:
            for k0 in range(k_start + BLOCK_K, k_start + k_len, BLOCK_K):
                w_ptrs += BLOCK_K
                w_next = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                x_next = _x_chunk(x_ptr, r_ptr, g_ptr, k0 + k, rstd, K, PROLOGUE)
                acc += w.to(tl.float32) * x[None, :]
                w = w_next
                x = x_next
        acc += w.to(tl.float32) * x[None, :]
        out = tl.sum(acc, 1)
    if SCALED:  # FP8 codes: one float32 scale per output row
        out *= tl.load(s_ptr + n, mask=n_ok, other=0.0)
    if SPLIT_K == 1:
        tl.store(y_ptr + n, out.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(ws_ptr + pid_k * N + n, out, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1)
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + s * N + n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + n, total.to(y_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


_LAUNCH = Launcher(gemv_pdl_kernel, ("PROLOGUE", "BLOCK_N", "BLOCK_K", "SPLIT_K", "USE_GDC", "DOT", "PRECISION",
                                      "NORM_BLOCK", "DEPTH", "SCALED"))


class Workspace:
    """Split-K partials and arrival counters per device (counters stay zero between calls)."""

    def __init__(self):
        self._bufs: dict = {}
        self._retired: list = []  # outgrown buffers stay alive: captured CUDA graphs may point at them

    def get(self, device: torch.device, n: int, split_k: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``[split_k * n]`` partials and int32 ``[n_blocks]`` zeroed counters, grown on demand.

        Calls on one stream share them: a call's reducer resets its counters before the next call's
        programs can arrive (stream order), and partials are rewritten before they are read.
        """
        key = (device.type, device.index)
        ws, cnt = self._bufs.get(key, (None, None))
        if ws is None or ws.numel() < split_k * n or cnt.numel() < n_blocks:
            if ws is not None:
                self._retired.append((ws, cnt))
            ws = torch.empty(max(split_k * n, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
            cnt = torch.zeros(max(n_blocks, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=device)
            self._bufs[key] = (ws, cnt)
        return ws, cnt


WORKSPACE = Workspace()
CONFIG = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4}


def check_weight_dtype(kernel: str, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> None:
    """A weight of x's dtype, or FP8 codes with float32 scales per row (``TypeError``/``ValueError`` otherwise)."""
    if weight.dtype == torch.float8_e4m3fn:
        if scales is None or scales.dtype != torch.float32 or scales.shape != weight.shape[:1] or not scales.is_contiguous():
            got = None if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
            raise ValueError(f"{kernel}: FP8 weight codes need scales, a contiguous float32 [{weight.shape[0]}] "
                             f"(one per row), got {got}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{kernel}: x's dtype {x.dtype} must be bfloat16, float16 or float32 for FP8 weights")
    elif scales is not None:
        raise ValueError(f"{kernel}: scales are for float8_e4m3fn weight codes, got a {weight.dtype} weight")
    elif x.dtype != weight.dtype:
        raise TypeError(f"{kernel}: x's dtype {x.dtype} must match weight's {weight.dtype}")


def check(x: torch.Tensor, weight: torch.Tensor, prologue: str, split_k: int, block_k: int,
          scales: torch.Tensor | None = None) -> int:
    """Validate a call; returns K. Raises ``ValueError``/``TypeError`` naming the argument."""
    if prologue not in PROLOGUES:
        raise ValueError(f"gemv_pdl: prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"gemv_pdl: split_k must be a positive int, got {split_k!r}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv_pdl: weight must be a 2-D [N, K] tensor with contiguous rows, got shape "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    k = weight.shape[1]
    want = 2 * k if prologue == "silu_and_mul" else k
    if x.numel() != want or not x.is_contiguous():
        raise ValueError(f"gemv_pdl: x must be one contiguous row of {want} elements for weight "
                         f"{tuple(weight.shape)} and prologue {prologue!r}, got shape {tuple(x.shape)}")
    check_weight_dtype("gemv_pdl", x, weight, scales)
    if k % (split_k * block_k):
        raise ValueError(f"gemv_pdl: K = {k} must be a multiple of split_k * block_k = {split_k * block_k}")
    return k


def gemv_pdl(x: torch.Tensor, weight: torch.Tensor, *, prologue: str = "none", residual: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual_out: torch.Tensor | None = None,
             split_k: int = 1, pdl: bool = False, out: torch.Tensor | None = None, block_n: int | None = None,
             block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             dot: bool = False, depth: int = 1, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``prologue(x) @ weight.T`` for one row ``x``; returns ``y [N]`` (``out`` when given).

    ``weight`` is x's dtype, or ``float8_e4m3fn`` codes with ``scales`` (float32 ``[N]``, one per row:
    ``y = (prologue(x) @ codes.T) * scales``, the codes widened in registers; x keeps its precision, but for
    ``dot=True`` a bfloat16 x meets the codes as float16, saturating at +-65504).

    ``prologue="add_rms_norm"`` needs ``residual``, ``norm_weight`` and ``residual_out`` (receives
    ``x + residual``); ``"silu_and_mul"`` takes gate_up's ``[2K]`` output as ``x``. ``pdl=True``
    launches with programmatic dependent launch (only where :func:`pdl_available`). ``dot=True``
    runs the K loop as ``tl.dot`` on the row padded to 16 (pipelined by Triton) instead of
    register double-buffered multiply-adds; ``depth=2`` keeps two weight tiles in flight in the
    register loop (both requested before ``gdc_wait``).
    """
    block_n = block_n or CONFIG["block_n"]
    block_k = min(block_k or CONFIG["block_k"], weight.shape[1])
    k = check(x, weight, prologue, split_k, block_k, scales)
    if depth not in (1, 2) or (depth == 2 and (dot or k // split_k < 2 * block_k)):
        raise ValueError(f"gemv_pdl: depth must be 1, or 2 without dot and with K / split_k >= 2 * block_k, "
                         f"got depth={depth!r} (dot={dot}, K={k}, split_k={split_k}, block_k={block_k})")
    n = weight.shape[0]
    if prologue == "add_rms_norm":
        for name, t in (("residual", residual), ("norm_weight", norm_weight), ("residual_out", residual_out)):
            if t is None or t.numel() != k or not t.is_contiguous():
                raise ValueError(f"gemv_pdl: prologue 'add_rms_norm' needs a contiguous {name} of {k} elements, "
                                 f"got {None if t is None else tuple(t.shape)}")
        if residual_out.data_ptr() == residual.data_ptr() and residual.device.type != "meta":  # (meta: all at 0)
            raise ValueError("gemv_pdl: residual_out must not alias residual (other programs still read it)")
    if pdl and not pdl_available(x.device):
        raise ValueError("gemv_pdl: pdl=True needs Triton's launch_pdl/gdc API and a CUDA device of sm_90+")
    y = out if out is not None else torch.empty(n, dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, block_n)
    ws, cnt = (WORKSPACE.get(x.device, n, split_k, n_blocks) if split_k > 1 else (y, y))
    args = (x, weight, y, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
            residual_out if residual_out is not None else x, ws, cnt, scales if scales is not None else y, n, k,
            weight.stride(0), float(eps))
    consts = (PROLOGUES[prologue], block_n, block_k, split_k, pdl, dot,
              "ieee" if x.dtype == torch.float32 else "tf32", min(triton.next_power_of_2(k), 8192), depth,
              scales is not None)
    _LAUNCH((n_blocks, split_k), args, consts, num_warps=num_warps or CONFIG["num_warps"],
            num_stages=num_stages or CONFIG["num_stages"], device_index=x.device.index or 0, launch_pdl=pdl)
    return y
