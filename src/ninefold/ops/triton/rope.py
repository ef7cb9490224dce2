"""Triton rotary embedding: one program per token rotates every head of q (or k)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rope_kernel(x_ptr, out_ptr, pos_ptr, cache_ptr, heads, d, stride_xt, stride_xh, stride_cache,
                HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_TAIL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=im, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & im[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh
    dst = out_ptr + t * heads * d + h[:, None] * d
    if IS_NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    x1 = tl.load(src + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + i1[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + i2[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    if BLOCK_TAIL > 0:  # features past the rotary dimension are copied
        j = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tail_mask = (h < heads)[:, None] & (j < d)[None, :]
        tl.store(dst + j[None, :], tl.load(src + j[None, :], mask=tail_mask, other=0.0), mask=tail_mask)


def supports(q, k, positions, cos_sin_cache, is_neox) -> str | None:
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        return "the head dimension of q, k or cos_sin_cache is not contiguous"
    return None


def _rotate(x, positions, cache, is_neox):
    t, heads, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = cache.shape[1] // 2
    if t:
        tail = d - 2 * half
        rope_kernel[(t,)](x, out, positions, cache, heads, d, x.stride(0), x.stride(1), cache.stride(0),
                          HALF=half, IS_NEOX=is_neox, BLOCK_H=triton.next_power_of_2(heads),
                          BLOCK_HALF=triton.next_power_of_2(half),
                          BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0, num_warps=4)
    return out


def rope(q, k, positions, cos_sin_cache, is_neox):
    return _rotate(q, positions, cos_sin_cache, is_neox), _rotate(k, positions, cos_sin_cache, is_neox)
