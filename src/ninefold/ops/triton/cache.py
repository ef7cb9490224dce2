"""Triton ``reshape_and_cache``: one program per token copies its K and V rows into their slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.fp8_operand import saturate
from ninefold.ops.triton.launch import call


@triton.jit
def to_cache(x, cache_ptr):
    """``x`` in the element type of ``cache_ptr``; FP8 codes saturate at +-448 (the conversion alone gives NaN), NaN
    stays NaN (as torch's clamp keeps it)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = saturate(x.to(tl.float32), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


def fp8_cache_refusal(k_cache: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot use ``k_cache`` (FP8 codes on a GPU before compute capability 8.9, where
    Triton has no ``fp8e4nv``), or None."""
    if k_cache.dtype != torch.float8_e4m3fn or k_cache.device.type != "cuda":
        return None
    if torch.cuda.get_device_capability(k_cache.device) < (8, 9):
        return "Triton reads and writes FP8 (fp8e4nv) caches on compute capability 8.9 or later only"
    return None


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr, heads, d, block_size,
                             stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_co, stride_ch,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    e = tl.arange(0, BLOCK_D)[None, :]
    live_heads = tl.where(slot >= 0, heads, 0)  # a skipped token (slot -1) writes nothing
    mask = (h < live_heads) & (e < d)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + h * stride_ch + e
    key = tl.load(key_ptr + t * stride_kt + h * stride_kh + e, mask=mask)
    value = tl.load(value_ptr + t * stride_vt + h * stride_vh + e, mask=mask)
    tl.store(kc_ptr + dst, to_cache(key, kc_ptr), mask=mask)
    tl.store(vc_ptr + dst, to_cache(value, vc_ptr), mask=mask)


def supports(key, value, k_cache, v_cache, slot_mapping) -> str | None:
    if (why := fp8_cache_refusal(k_cache)) is not None:
        return why
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "k_cache/v_cache are not contiguous"
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return "the head dimension of key/value is not contiguous"
    return None


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    t, heads, d = key.shape
    if t:
        call(reshape_and_cache_kernel, (t,), key, value, k_cache, v_cache, slot_mapping, heads, d, k_cache.shape[1],
                                       key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                       k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                       BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d),
                                       num_warps=4)
