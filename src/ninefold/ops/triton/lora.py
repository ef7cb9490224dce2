"""The deltas of LoRA adapters held in slots, added to a projection's output in two Triton launches.

``LoRASlots`` keeps, per fused matrix, the slots' ``A`` side by side (``[K, W]``, ``W = slots * R``) and their
``B`` one above the other (``[W, N]``); row ``t`` of a step uses slot ``row_slots[t]`` (-1: none), i.e. columns
``[slot * R, (slot + 1) * R)`` of ``x @ A``. torch needs three kernels for that (``x @ A``, the slot mask, the
expand GEMM); here:

1. ``lora_shrink_kernel``: ``x @ A`` for every slot, ``K`` divided among ``splits`` programs per tile of rows and
   adapter columns (a step has few rows, so without the division a handful of SMs would read all of ``A``), each
   writing its float32 partial sum; the tile's last program to arrive (an arrival counter per tile, left at zero
   again) adds the partials in split order (so results repeat bit for bit), zeroes every column outside the
   row's slot and stores ``down`` rounded to the weights' dtype (as torch's ``x @ A`` rounds);
2. ``lora_expand_kernel``: per tile of rows and output columns, ``down @ B`` added to ``y`` in place (one
   rounding of the sum).

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
MAX_SPLITS = 16  # K divided among at most this many programs per tile
MAX_ROWS = 512  # where they pay: the launches they save matter in decode steps; prefill chunks keep cuBLAS


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, down_ptr, count_ptr, T, K, W, per_slot, stride_x,
                       stride_a, k_per_split, splits, BT: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(2) * BW + tl.arange(0, BW)
    split = tl.program_id(1)
    live = (rows[:, None] < T) & (cols[None, :] < W)
    acc = tl.zeros([BT, BW], tl.float32)
    for step in range(0, k_per_split, BK):
        ks = split * k_per_split + step + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=(rows[:, None] < T) & (ks[None, :] < K), other=0.0)
        a = tl.load(a_ptr + ks[:, None].to(tl.int64) * stride_a + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < W), other=0.0)
        acc = tl.dot(x, a, acc)
    tl.store(part_ptr + (split * T + rows[:, None]).to(tl.int64) * W + cols[None, :], acc, mask=live)
    tile = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")  # orders the store above before it
    if arrived == splits - 1:
        total = tl.zeros([BT, BW], tl.float32)
        for s in range(splits):
            total += tl.load(part_ptr + (s * T + rows[:, None]).to(tl.int64) * W + cols[None, :], mask=live,
                             other=0.0, volatile=True)
        slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1)
        total = tl.where((cols[None, :] // per_slot) == slot[:, None], total, 0.0)
        tl.store(down_ptr + rows[:, None].to(tl.int64) * W + cols[None, :], total.to(down_ptr.dtype.element_ty),
                 mask=live)
        tl.store(count_ptr + tile, 0)  # ready for the next call (and the next replay of a graph)


@triton.jit
def lora_expand_kernel(down_ptr, b_ptr, y_ptr, T, N, W, stride_b, stride_y,
                       BT: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    outs = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BT, BN], tl.float32)
    for w0 in range(0, W, BW):
        cols = w0 + tl.arange(0, BW)
        d = tl.load(down_ptr + rows[:, None].to(tl.int64) * W + cols[None, :],
                    mask=(rows[:, None] < T) & (cols[None, :] < W), other=0.0)
        b = tl.load(b_ptr + cols[:, None].to(tl.int64) * stride_b + outs[None, :],
                    mask=(cols[:, None] < W) & (outs[None, :] < N), other=0.0)
        acc = tl.dot(d, b, acc)
    where = rows[:, None].to(tl.int64) * stride_y + outs[None, :]
    live = (rows[:, None] < T) & (outs[None, :] < N)
    y = tl.load(y_ptr + where, mask=live, other=0.0)
    tl.store(y_ptr + where, (y.to(tl.float32) + acc).to(y.dtype), mask=live)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed arrival counters for ``tiles`` tiles on ``device`` (the kernel leaves them at zero). A larger call
    gets a new buffer, and the smaller ones stay allocated: CUDA graphs captured with them keep their address.
    One set per device: calls on two streams at once would share them (the engine runs one stream)."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < tiles:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("ninefold.ops.triton.lora: run lora_add once at this size before capturing it")
        kept.append(torch.zeros(1 << max(tiles - 1, 1).bit_length(), dtype=torch.int32, device=device))
    return kept[-1]


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def supports(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why ``lora_add`` cannot take these operands (None: it can)."""
    def shapes() -> str:
        return f"x {tuple(x.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}, y {tuple(y.shape)}"

    if x.dim() != 2 or a.dim() != 2 or b.dim() != 2 or y.dim() != 2:
        return f"2-D x, A, B and y only; got {shapes()}"
    dtypes = (x.dtype, a.dtype, b.dtype, y.dtype)
    if len(set(dtypes)) != 1 or x.dtype not in (torch.float16, torch.bfloat16):
        return (f"one dtype for x, A, B and y: float16 or bfloat16 (float32 products would run in TF32); got "
                f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    if x.shape[1] != a.shape[0] or a.shape[1] != b.shape[0] or y.shape != (x.shape[0], b.shape[1]) or x.shape[1] == 0:
        return f"shapes x [T, K], A [K, W], B [W, N], y [T, N] with K >= 1; got {shapes()}"
    if any(t.stride(1) != 1 for t in (x, a, b, y)):
        return "rows with contiguous columns only"
    if x.shape[0] > MAX_ROWS:
        return f"at most {MAX_ROWS} rows (more: cuBLAS's GEMMs); got {x.shape[0]}"
    return None


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, per_slot: int,
             y: torch.Tensor) -> torch.Tensor:
    """``y += ((x @ a) * mask) @ b`` in place, where ``mask[t, c]`` is 1 when ``c // per_slot == row_slots[t]``;
    returns ``y``. Operands as ``supports`` says; ``row_slots`` ``[T]`` integers (-1: no adapter)."""
    T, K = x.shape
    W, N = b.shape
    if row_slots.shape != (T,) or row_slots.device != x.device:
        raise ValueError(f"row_slots: expected [{T}] on {x.device}; got {list(row_slots.shape)} on {row_slots.device}")
    if T == 0 or W == 0 or N == 0:
        return y
    BT = 16 if T <= 16 else 32 if T <= 32 else 64
    row_tiles, w_tiles = triton.cdiv(T, BT), triton.cdiv(W, BW)
    # enough programs to keep the SMs reading A, few enough partials for the last program of a tile to add up
    want = min(MAX_SPLITS, max(1, 2 * _num_sms(x.device) // (row_tiles * w_tiles)))
    k_per_split = BK * triton.cdiv(triton.cdiv(K, min(want, triton.cdiv(K, BK))), BK)
    splits = triton.cdiv(K, k_per_split)
    part = torch.empty((splits, T, W), dtype=torch.float32, device=x.device)
    down = torch.empty((T, W), dtype=x.dtype, device=x.device)
    counts = _counters(x.device, row_tiles * w_tiles)
    lora_shrink_kernel[(row_tiles, splits, w_tiles)](x, a, row_slots, part, down, counts, T, K, W, per_slot,
                                                     x.stride(0), a.stride(0), k_per_split, splits,
                                                     BT=BT, BK=BK, BW=BW)
    lora_expand_kernel[(row_tiles, triton.cdiv(N, BN))](down, b, y, T, N, W, b.stride(0), y.stride(0),
                                                        BT=BT, BN=BN, BW=BW)
    return y
