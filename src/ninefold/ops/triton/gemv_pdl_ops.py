"""Operator implementations over the batch-1 GEMV (``ninefold.ops.triton.gemv_pdl``).

- :func:`linear` (``triton_row`` of ``ops.linear``): ``x @ weight.T`` for one row;
- :func:`add_rms_norm_linear` (``triton`` of ``ops.add_rms_norm_linear``): the residual add and
  RMSNorm in the GEMV's prologue;
- :func:`silu_and_mul_linear` (``triton`` of ``ops.silu_and_mul_linear``): SwiGLU in the prologue.

Each covers one row on CUDA in bf16/fp16 without bias, K a multiple of the tile (the ``supports_*``
functions name what they refuse); dispatch falls back to the vendor implementations otherwise.
Measured on the H200 (``python -m ninefold.bench.decode_chain``, 8B shapes, 32 layers, context 256,
CUDA graphs, run 2 at 16:21 UTC): the GEMV beats cuBLAS on every shape (q/k/v 12.9 vs 16.7 us, o 9.4
vs 13.1, down 29.3 vs 31.9; gate_up and lm_head by 2-5%), and the decode step through these
operators took 4.290 ms per token without PDL and 4.157 ms with it (85% of the copy-bandwidth
roofline), against 4.653 ms with cuBLAS and the separate norm/activation kernels. PDL is on where
Triton and the GPU support it (sm_90+); ``NINEFOLD_GEMV_PDL=0`` turns it off.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors without PDL (how the CPU tests reach them).
"""

from __future__ import annotations

import functools
import json
import os

import torch

from ninefold.ops.triton import gemv_pdl

# (N, K[, prologue]) -> (block_n, block_k, split_k, num_warps, num_stages, variant): the H200 sweep's
# picks (variant 0: register loop, 1: tl.dot loop, 2: register loop with two tiles in flight).
# Measured 2026-12-03 16:21 UTC by `python -m ninefold.bench.decode_chain` (Llama-3-8B shapes, PDL,
# graphs of 20 back-to-back calls cycling the 32 layers' weights): .notes/gpu10 run 2.
TABLE: dict[tuple, tuple] = {
    (6144, 4096): (16, 512, 1, 4, 2, 0),  # q/k/v: 12.9 us (cuBLAS 16.7)
    (4096, 4096): (16, 512, 1, 4, 2, 2),  # o: 9.4 us (cuBLAS 13.1)
    (28672, 4096): (16, 256, 1, 4, 2, 0),  # gate_up: 54.9 us (cuBLAS 56.0)
    (4096, 14336): (16, 512, 1, 4, 2, 2),  # down: 29.3 us (cuBLAS 31.9)
    (128256, 4096): (32, 256, 1, 4, 2, 0),  # lm_head: 238.1 us (cuBLAS 249.7)
    (6144, 4096, "add_rms_norm"): (16, 512, 1, 4, 2, 0),  # 13.7 us
    (28672, 4096, "add_rms_norm"): (16, 256, 1, 4, 2, 0),  # 56.5 us
    (4096, 14336, "silu_and_mul"): (16, 512, 1, 4, 2, 2),  # 29.3 us
    (128256, 4096, "add_rms_norm"): (32, 256, 1, 4, 2, 0),  # 240.9 us
}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_DTYPES = (torch.bfloat16, torch.float16)
OVERRIDE: dict[tuple[int, int, str], tuple] = {}  # (N, K, prologue) -> config; benchmarks set it


@functools.cache
def _file_table(path: str) -> dict:
    """``NINEFOLD_GEMV_TABLE``: a JSON list of ``{"n", "k", "prologue", "config"}`` (what
    ``python -m ninefold.bench.decode_chain`` writes as ``$OUT/gemv_table.json``)."""
    try:
        with open(path) as f:
            entries = json.load(f)
        table = {(int(e["n"]), int(e["k"]), str(e["prologue"])): tuple(int(v) for v in e["config"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"NINEFOLD_GEMV_TABLE={path!r}: expected a JSON list of {{n, k, prologue, config}} "
                         f"entries with 6-integer configs ({error})") from None
    for key, cfg in table.items():
        if len(cfg) != 6:
            raise ValueError(f"NINEFOLD_GEMV_TABLE={path!r}: config of {key} must have 6 integers "
                             f"(block_n, block_k, split_k, num_warps, num_stages, dot), got {cfg}")
    return table


def config(n: int, k: int, prologue: str = "none") -> tuple:
    """The launch configuration for an ``[n, k]`` weight with ``prologue``: ``OVERRIDE``, then the
    ``NINEFOLD_GEMV_TABLE`` file, then ``TABLE``; else split-K over 2 for narrow outputs (fewer than
    8192 columns leave SMs idle) and one K pass otherwise."""
    key = (n, k, prologue)
    found = OVERRIDE.get(key)
    path = os.environ.get("NINEFOLD_GEMV_TABLE")
    if found is None and path:
        found = _file_table(path).get(key)
    if found is None:
        found = TABLE.get(key) or TABLE.get((n, k))
    if found is not None:
        return found
    block_k = 256 if k % 256 == 0 else 64
    split_k = 2 if n < 8192 and k % (2 * block_k) == 0 else 1
    return 16, block_k, split_k, 4, 2, 0


def _kernel_reason(x: torch.Tensor, weight: torch.Tensor, k: int, prologue: str = "none") -> str | None:
    if x.device.type == "cuda":
        if x.dtype not in _DTYPES:
            return f"dtype {x.dtype}: bfloat16 or float16 only"
    elif not (_INTERPRETED and x.device.type == "cpu"):
        return f"device {x.device.type}: CUDA only (or the CPU under TRITON_INTERPRET=1)"
    if weight.stride(1) != 1 or not x.is_contiguous():
        return "weight rows and x must be contiguous"
    _, block_k, split_k, *_, variant = config(weight.shape[0], k, prologue)
    if k % (block_k * split_k):
        return f"K = {k} is not a multiple of {block_k * split_k}"
    if variant == 2 and k // split_k < 2 * block_k:
        return f"K = {k} is too short for two tiles of {block_k} in flight per split"
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


def pdl_enabled() -> bool:
    """Whether PDL is wanted: yes unless ``NINEFOLD_GEMV_PDL=0`` (read at every call, so at graph
    capture); it is used only where :func:`ninefold.ops.triton.gemv_pdl.pdl_available` says so."""
    return os.environ.get("NINEFOLD_GEMV_PDL", "1") != "0"


def _launch(x, weight, prologue: str = "none", **kw) -> torch.Tensor:
    bn, bk, sk, nw, ns, dot = config(weight.shape[0], weight.shape[1], prologue)
    pdl = x.device.type == "cuda" and pdl_enabled() and gemv_pdl.pdl_available(x.device)
    return gemv_pdl.gemv_pdl(x.reshape(-1), weight, prologue=prologue, split_k=sk, pdl=pdl, block_n=bn,
                             block_k=bk, num_warps=nw, num_stages=ns, dot=dot == 1, depth=2 if dot == 2 else 1, **kw)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x [..., K]`` (``supports`` must have said yes) -> ``[..., N]``."""
    if bias is not None:
        raise ValueError("gemv_pdl_ops.linear: bias is not supported (got a bias tensor); use ops.linear")
    return _launch(x, weight).reshape(*x.shape[:-1], weight.shape[0])


def supports_add_rms_norm_linear(x, residual, norm_weight, weight, eps=1e-6, bias=None) -> str | None:
    """``None`` when :func:`add_rms_norm_linear` runs this call, else the reason it does not."""
    if not (residual.is_contiguous() and norm_weight.is_contiguous()):
        return "residual and norm_weight must be contiguous"
    if bias is not None:
        return "no bias"
    if _rows(x) != 1:
        return f"{_rows(x)} rows: one row only"
    return _kernel_reason(x, weight, weight.shape[1], "add_rms_norm")


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.add_rms_norm_linear`` for one row in one kernel: every program recomputes the row's
    norm (the sum rounded to x's dtype first, as ``ops.add_rms_norm`` does); the first writes the sum."""
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = _launch(x, weight, prologue="add_rms_norm", residual=residual.reshape(-1), norm_weight=norm_weight,
                eps=eps, residual_out=total.reshape(-1))
    return y.reshape(*x.shape[:-1], weight.shape[0]), total


def supports_silu_and_mul_linear(x, weight, bias=None) -> str | None:
    """``None`` when :func:`silu_and_mul_linear` runs this call, else the reason it does not."""
    if bias is not None:
        return "no bias"
    if _rows(x) != 1:
        return f"{_rows(x)} rows: one row only"
    return _kernel_reason(x, weight, weight.shape[1], "silu_and_mul")


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.silu_and_mul_linear`` for one row ``x [..., 2K]`` in one kernel (the gate in the prologue)."""
    return _launch(x, weight, prologue="silu_and_mul").reshape(*x.shape[:-1], weight.shape[0])


def register_all() -> None:
    """Register ``triton_row`` for ``linear`` and ``triton`` for the two fused operators (CUDA, or the
    CPU in float32 under the interpreter, where they only run when pinned)."""
    from ninefold.ops.registry import register

    devices = ("cuda", "cpu") if _INTERPRETED else ("cuda",)
    dtypes = (torch.float32,) if _INTERPRETED else _DTYPES
    priority = {"cuda": 20, "cpu": -10}
    register("linear", "triton_row", devices=devices, dtypes=dtypes, supports=supports, priority=priority)(linear)
    register("add_rms_norm_linear", "triton", devices=devices, dtypes=dtypes, supports=supports_add_rms_norm_linear,
             priority=priority)(add_rms_norm_linear)
    register("silu_and_mul_linear", "triton", devices=devices, dtypes=dtypes, supports=supports_silu_and_mul_linear,
             priority=priority)(silu_and_mul_linear)
