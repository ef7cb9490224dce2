"""The deltas of LoRA adapters held in slots, added to a projection's output in two Triton launches.

``LoRASlots`` keeps, per fused matrix, the slots' ``A`` side by side (``[K, W]``, ``W = slots * R``) and their
``B`` one above the other (``[W, N]``); row ``t`` of a step uses slot ``row_slots[t]`` (-1: none), i.e. columns
``[slot * R, (slot + 1) * R)`` of ``x @ A``. torch needs three kernels for that (``x @ A``, the slot mask, the
expand GEMM); here:

1. ``lora_shrink_kernel``: ``x @ A`` for every slot, ``K`` divided among ``splits`` programs per row tile
   (a step has few rows, so without the division a handful of SMs would read all of ``A``), each writing its
   float32 partial sum to ``part[split]``;
2. ``lora_expand_kernel``: per tile of rows and output columns, the partials summed, every column outside the
   row's slot zeroed, rounded to the weights' dtype (as torch's ``x @ A`` rounds), times ``B``, added to ``y`` in
   place (one rounding of the sum).

Both are plain launches of fixed work for a shape, so CUDA graphs capture them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BK = 64  # K per loop step of the shrink
BW = 64  # adapter columns per tile
BN = 128  # output columns per expand program


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, part_ptr, T, K, W, stride_x, stride_a, k_per_split,
                       BT: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(2) * BW + tl.arange(0, BW)
    split = tl.program_id(1)
    acc = tl.zeros([BT, BW], tl.float32)
    for step in range(0, k_per_split, BK):
        ks = split * k_per_split + step + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=(rows[:, None] < T) & (ks[None, :] < K), other=0.0)
        a = tl.load(a_ptr + ks[:, None].to(tl.int64) * stride_a + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < W), other=0.0)
        acc = tl.dot(x, a, acc)
    tl.store(part_ptr + (split * T + rows[:, None]).to(tl.int64) * W + cols[None, :], acc,
             mask=(rows[:, None] < T) & (cols[None, :] < W))


@triton.jit
def lora_expand_kernel(part_ptr, slot_ptr, b_ptr, y_ptr, T, N, W, splits, per_slot, stride_b, stride_y,
                       BT: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    outs = tl.program_id(1) * BN + tl.arange(0, BN)
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1)
    acc = tl.zeros([BT, BN], tl.float32)
    for w0 in range(0, W, BW):
        cols = w0 + tl.arange(0, BW)
        d = tl.zeros([BT, BW], tl.float32)
        for s in range(splits):
            d += tl.load(part_ptr + (s * T + rows[:, None]).to(tl.int64) * W + cols[None, :],
                         mask=(rows[:, None] < T) & (cols[None, :] < W), other=0.0)
        d = tl.where((cols[None, :] // per_slot) == slot[:, None], d, 0.0)
        b = tl.load(b_ptr + cols[:, None].to(tl.int64) * stride_b + outs[None, :],
                    mask=(cols[:, None] < W) & (outs[None, :] < N), other=0.0)
        acc = tl.dot(d.to(b.dtype), b, acc)
    where = rows[:, None].to(tl.int64) * stride_y + outs[None, :]
    live = (rows[:, None] < T) & (outs[None, :] < N)
    y = tl.load(y_ptr + where, mask=live, other=0.0)
    tl.store(y_ptr + where, (y.to(tl.float32) + acc).to(y.dtype), mask=live)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def supports(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why ``lora_add`` cannot take these operands (None: it can)."""
    if x.dim() != 2 or a.dim() != 2 or b.dim() != 2 or y.dim() != 2:
        return "2-D x, A, B and y only"
    if not (x.dtype == a.dtype == b.dtype == y.dtype) or x.dtype not in (torch.float16, torch.bfloat16):
        return "one dtype for x, A, B and y: float16 or bfloat16 (float32 products would run in TF32)"
    if x.shape[1] != a.shape[0] or a.shape[1] != b.shape[0] or y.shape != (x.shape[0], b.shape[1]):
        return "shapes x [T, K], A [K, W], B [W, N], y [T, N]"
    if any(t.stride(1) != 1 for t in (x, a, b, y)):
        return "rows with contiguous columns only"
    return None


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, per_slot: int,
             y: torch.Tensor) -> torch.Tensor:
    """``y += ((x @ a) * mask) @ b`` in place, where ``mask[t, c]`` is 1 when ``c // per_slot == row_slots[t]``;
    returns ``y``. Operands as ``supports`` says; ``row_slots`` ``[T]`` integers (-1: no adapter)."""
    T, K = x.shape
    W, N = b.shape
    if T == 0 or W == 0 or N == 0:
        return y
    BT = 16 if T <= 16 else 64
    row_tiles, w_tiles = triton.cdiv(T, BT), triton.cdiv(W, BW)
    want = max(1, 2 * _num_sms(x.device) // (row_tiles * w_tiles))  # enough programs to keep the SMs reading A
    k_per_split = BK * triton.cdiv(triton.cdiv(K, min(want, triton.cdiv(K, BK))), BK)
    splits = triton.cdiv(K, k_per_split)
    part = torch.empty((splits, T, W), dtype=torch.float32, device=x.device)
    lora_shrink_kernel[(row_tiles, splits, w_tiles)](x, a, part, T, K, W, x.stride(0), a.stride(0), k_per_split,
                                                     BT=BT, BK=BK, BW=BW)
    lora_expand_kernel[(row_tiles, triton.cdiv(N, BN))](part, row_slots, b, y, T, N, W, splits, per_slot,
                                                        b.stride(0), y.stride(0), BT=BT, BN=BN, BW=BW)
    return y
