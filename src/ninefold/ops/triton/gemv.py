"""Triton ``linear`` for a few rows (decode steps): ``x [M, K] @ weight[N, K].T`` with M <= 16.

At M = 1..16 a linear layer is a stream of the weight through the SMs. Each program owns
``BLOCK_N`` output columns and streams their ``[BLOCK_N, K]`` weight rows in ``BLOCK_K`` steps
through a pipelined loop, with the rows of ``x`` (padded to 16 for ``tl.dot``) re-read from L2;
narrow tiles give every SM several programs, so no split-K reduction is needed.

Measured on the H200 (``python -m ninefold.bench.ops_gemv``, Llama-3-8B layers, bf16, M=1): it
matches cuBLAS on q/k/v (15.9 vs 15.4 us, both ~75% of copy bandwidth) and o (10.4 vs 10.7 us)
and trails it on gate_up (58.2 vs 57.2 us), down (34.1 vs 32.1 us) and the 128k-row lm_head. So it
registers below the vendor implementation: dispatch uses it only where a tuning run measured it
faster (e.g. gate_up at M=16: 59.6 vs 62.5 us).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import call

MAX_M = 16
# Launch configuration (the sweep's winners: long rows want long K steps);
# NINEFOLD_TRITON_GEMV="block_n=32,block_k=256" overrides.
CONFIG = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4}
LONG_K = {"block_k": 512, "num_stages": 3}  # K >= 8192
_OVERRIDE = {k: int(v) for k, v in (item.split("=") for item in
                                    filter(None, os.environ.get("NINEFOLD_TRITON_GEMV", "").split(",")))}


@triton.jit
def gemv_rows(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """``x[:M] @ w[n].T`` in float32 for this program's ``BLOCK_N`` columns n, the weight widened to x's dtype
    as it is loaded (a no-op for a weight of x's dtype; FP8 codes for ``fp8_gemv``)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + k) < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    acc = gemv_rows(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def supports(x, weight, bias=None) -> str | None:
    m = x.numel() // max(x.shape[-1], 1)
    if m > MAX_M:
        return f"{m} rows: the Triton GEMV covers at most {MAX_M} (larger calls are matrix multiplies)"
    return layout_reason(x, weight)


def layout_reason(x, weight) -> str | None:
    """Why the Triton linear kernels cannot read ``x`` and ``weight`` as laid out (``None``: they can)."""
    if weight.stride(1) != 1 or x.stride(-1) != 1:
        return "weight rows and x's last dimension must be contiguous"
    if x.dim() > 2 and not x.is_contiguous():
        return "x with more than two dimensions must be contiguous"
    if weight.shape[1] < 16:
        return f"K = {weight.shape[1]} is below 16"
    return None


def config(n: int, k: int) -> dict:
    """The launch configuration for an ``[n, k]`` weight (``CONFIG``, narrowed for short K)."""
    cfg = dict(CONFIG, **(LONG_K if k >= 8192 else {}))
    cfg["block_k"] = min(cfg["block_k"], triton.next_power_of_2(k))
    cfg.update(_OVERRIDE)
    return cfg


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels ``linear`` launches for a model's layer shapes (for ``ninefold.ops.triton.aot``)."""
    qkv = (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim
    found = {}
    for n, k in ((qkv, shapes.hidden), (shapes.hidden, shapes.heads * shapes.head_dim),
                 (2 * shapes.intermediate, shapes.hidden), (shapes.hidden, shapes.intermediate)):
        cfg = config(n, k)
        constexprs = {"HAS_BIAS": False, "BLOCK_M": 16, "BLOCK_N": cfg["block_n"], "BLOCK_K": cfg["block_k"],
                      "EVEN_K": k % cfg["block_k"] == 0, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
        key = (tuple(sorted(constexprs.items())), cfg["num_warps"], cfg["num_stages"])
        found[key] = {"kernel": gemv_kernel, "constexprs": constexprs, "num_warps": cfg["num_warps"],
                      "num_stages": cfg["num_stages"]}
    return list(found.values())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [..., K]`` with at most ``MAX_M`` rows."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        cfg = config(n, k)
        call(gemv_kernel, (triton.cdiv(n, cfg["block_n"]),),
            x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            EVEN_K=k % cfg["block_k"] == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*x.shape[:-1], n)
