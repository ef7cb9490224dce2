"""Triton ``argmax`` over the last dimension of ``[B, V]`` rows (greedy decoding over a vocabulary).

torch's reduction gives one long row (B = 1, V = 128k) to few threads and takes ~27 us on the
H200 for what is a 256-512 KB read. Here program ``(b, chunk)`` reduces ``CHUNK`` columns of row
``b`` with a whole CTA, writes its (value, index) to a scratch row, and the last program of the
row to arrive (an arrival counter per row, left at zero again for the next call, so CUDA graphs
replay it) reduces those partials. Ties go to the smallest index, as torch's. Rows holding NaN
are outside the contract (torch returns the NaN's index; this kernel does not).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import Launcher

CHUNK = 8192  # columns per program: 16-32 KB of half-precision logits
BLOCK = 2048  # columns per loop step
MAX_CHUNKS = 64  # the final reduction reads all of a row's partials at once


@triton.jit
def argmax_chunk_kernel(x_ptr, index_ptr, val_ptr, idx_ptr, count_ptr, n, stride_x, chunks,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.full([BLOCK], 0, tl.int32)
    start = chunk * CHUNK
    for offset in range(0, CHUNK, BLOCK):
        c = start + offset + cols
        v = tl.load(x_ptr + row * stride_x + c, mask=c < n, other=float("-inf")).to(tl.float32)
        better = v > best  # strict: an earlier column keeps a tie
        best = tl.where(better, v, best)
        where = tl.where(better, c, where)
    top = tl.max(best, 0)
    # the smallest column among the lanes holding the maximum (a lane of -inf only when all are)
    first = tl.min(tl.where(best == top, where, n), 0)
    first = tl.where(top == float("-inf"), start, first)
    tl.store(val_ptr + row * MAX_CHUNKS + chunk, top)
    tl.store(idx_ptr + row * MAX_CHUNKS + chunk, first)
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")  # orders the stores above before it
    if arrived == chunks - 1:
        k = tl.arange(0, MAX_CHUNKS)
        live = k < chunks
        vals = tl.load(val_ptr + row * MAX_CHUNKS + k, mask=live, other=float("-inf"), volatile=True)
        idxs = tl.load(idx_ptr + row * MAX_CHUNKS + k, mask=live, other=0, volatile=True)
        top = tl.max(vals, 0)
        first = tl.min(tl.where(live & (vals == top), idxs, n), 0)
        first = tl.where(top == float("-inf"), 0, first)
        tl.store(index_ptr + row, first.to(tl.int64))
        tl.store(count_ptr + row, 0)  # ready for the next call (and the next replay of a graph)


@functools.cache
def _scratch(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-device partial values, indices and zeroed arrival counters for ``rows`` rows (grown in
    powers of two, so a CUDA graph captured at one size keeps its buffers)."""
    return (torch.empty(rows * MAX_CHUNKS, dtype=torch.float32, device=device),
            torch.empty(rows * MAX_CHUNKS, dtype=torch.int32, device=device),
            torch.zeros(rows, dtype=torch.int32, device=device))


def supports(x, dim=-1) -> str | None:
    if x.dim() != 2 or dim not in (-1, 1):
        return "rows of a 2-D tensor, along the last dimension only"
    if x.stride(1) != 1:
        return "the last dimension is not contiguous"
    if triton.cdiv(x.shape[1], CHUNK) > MAX_CHUNKS:
        return f"rows longer than {CHUNK * MAX_CHUNKS} columns"
    if x.shape[1] >= 2**31:
        return "rows of 2^31 columns or more"
    return None


_LAUNCH = Launcher(argmax_chunk_kernel, ("CHUNK", "BLOCK", "MAX_CHUNKS"))  # the engine's one launch per step: kept short


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    b, n = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    chunks = triton.cdiv(n, CHUNK)
    values, indices, counters = _scratch(x.device, triton.next_power_of_2(b))
    _LAUNCH((b, chunks), (x, out, values, indices, counters, n, x.stride(0), chunks), (CHUNK, BLOCK, MAX_CHUNKS),
            num_warps=8, device_index=x.get_device())
    return out


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernel the launcher runs (one specialisation) for ``ninefold.ops.triton.aot``."""
    return [{"kernel": argmax_chunk_kernel, "num_warps": 8,
             "constexprs": {"CHUNK": CHUNK, "BLOCK": BLOCK, "MAX_CHUNKS": MAX_CHUNKS}}]
