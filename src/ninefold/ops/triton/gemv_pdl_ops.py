"""Op-level entry points of the batch-1 PDL GEMV (``ninefold.ops.triton.gemv_pdl``).

- :func:`linear`: ``x @ weight.T`` for one row, a ``linear`` implementation (:func:`supports` says
  when: one row, CUDA sm_90+ with Triton's PDL API, bf16/fp16, no bias, K a multiple of the tile).
- :func:`add_rms_norm_linear`: ``(rms_norm(x + residual) * w) @ weight.T`` and ``x + residual`` in one
  kernel (replaces ``ops.add_rms_norm`` followed by ``ops.linear``).
- :func:`silu_and_mul_linear`: ``(silu(x[:K]) * x[K:]) @ weight.T`` in one kernel (replaces
  ``ops.silu_and_mul`` followed by ``ops.linear``).

The fused functions fall back to the separate ``ninefold.ops`` calls wherever the kernel does not
apply, so a model can call them unconditionally. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU
tensors without PDL (how the CPU tests reach it).
"""

from __future__ import annotations

import os

import torch

from ninefold.ops.triton import gemv_pdl

# (N, K) -> (block_n, block_k, split_k, num_warps, num_stages, dot); measured picks go here.
TABLE: dict[tuple[int, int], tuple] = {}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.bfloat16, torch.float16)


def config(n: int, k: int) -> tuple:
    """The launch configuration for an ``[n, k]`` weight: ``TABLE``'s entry, else split-K over 2 for
    narrow outputs (fewer than 8192 columns leave SMs idle) and one K pass otherwise."""
    found = TABLE.get((n, k))
    if found is not None:
        return found
    block_k = 256 if k % 256 == 0 else 64
    split_k = 2 if n < 8192 and k % (2 * block_k) == 0 else 1
    return 32, block_k, split_k, 4, 2, 0


def _kernel_reason(x: torch.Tensor, weight: torch.Tensor, k: int) -> str | None:
    if x.device.type == "cuda":
        if not gemv_pdl.pdl_available(x.device):
            return "needs Triton's PDL API (launch_pdl, gdc_wait) and a GPU of sm_90+"
        if x.dtype not in _DTYPES:
            return f"dtype {x.dtype}: bfloat16 or float16 only"
    elif not (_INTERPRETED and x.device.type == "cpu"):
        return f"device {x.device.type}: CUDA only (or the CPU under TRITON_INTERPRET=1)"
    if weight.stride(1) != 1 or not x.is_contiguous():
        return "weight rows and x must be contiguous"
    _, block_k, split_k, *_ = config(weight.shape[0], k)
    if k % (block_k * split_k):
        return f"K = {k} is not a multiple of {block_k * split_k}"
    return None


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """``None`` when :func:`linear` runs this call, else the reason it does not."""
    if bias is not None:
        return "no bias"
    if _rows(x) != 1:
        return f"{_rows(x)} rows: one row only"
    return _kernel_reason(x, weight, weight.shape[1])


def _launch(x, weight, **kw) -> torch.Tensor:
    bn, bk, sk, nw, ns, dot = config(weight.shape[0], weight.shape[1])
    return gemv_pdl.gemv_pdl(x.reshape(-1), weight, split_k=sk, pdl=x.device.type == "cuda", block_n=bn,
                             block_k=bk, num_warps=nw, num_stages=ns, dot=bool(dot), **kw)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x [..., K]`` (``supports`` must have said yes) -> ``[..., N]``."""
    if bias is not None:
        raise ValueError("gemv_pdl_ops.linear: bias is not supported (got a bias tensor); use ops.linear")
    return _launch(x, weight).reshape(*x.shape[:-1], weight.shape[0])


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual, norm_weight, eps), weight, bias), x + residual)``.

    One fused kernel for one row (every program recomputes the row's norm; the sum is rounded to
    x's dtype first, as ``ops.add_rms_norm`` does); otherwise ``ops.add_rms_norm`` then ``ops.linear``.
    """
    from ninefold import ops

    k = x.shape[-1]
    if (bias is None and _rows(x) == 1 and residual.shape == x.shape and residual.dtype == x.dtype
            and norm_weight.numel() == k and norm_weight.dtype == x.dtype and residual.is_contiguous()
            and norm_weight.is_contiguous() and weight.shape[1] == k and weight.dtype == x.dtype
            and _kernel_reason(x, weight, k) is None):
        total = torch.empty_like(x)
        y = _launch(x, weight, prologue="add_rms_norm", residual=residual.reshape(-1),
                    norm_weight=norm_weight, eps=eps, residual_out=total.reshape(-1))
        return y.reshape(*x.shape[:-1], weight.shape[0]), total
    normed, total = ops.add_rms_norm(x, residual, norm_weight, eps)
    return ops.linear(normed, weight, bias), total


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu(x[..., :K]) * x[..., K:], weight, bias)`` for ``x [..., 2K]``: one fused kernel
    for one row, otherwise ``ops.silu_and_mul`` then ``ops.linear``."""
    from ninefold import ops

    k = weight.shape[1]
    if (bias is None and x.shape[-1] == 2 * k and _rows(x) == 1 and weight.dtype == x.dtype
            and _kernel_reason(x, weight, k) is None):
        return _launch(x, weight, prologue="silu_and_mul").reshape(*x.shape[:-1], weight.shape[0])
    return ops.linear(ops.silu_and_mul(x), weight, bias)
