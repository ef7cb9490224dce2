"""Triton ``rope_and_cache``: rotary embedding of q and k fused with the paged KV-cache write.

One launch replaces ``rope`` + ``reshape_and_cache``: each program takes ``BLOCK_T`` tokens,
gathers their cos/sin rows once, rotates every head of q (to ``q_out``) and of k (to ``k_out``
and into ``k_cache`` at the token's slot), and copies v into ``v_cache`` (float32 math, the
rounding of ``rope``). Caches are contiguous ``[num_blocks, block_size, Hk, D]``, so slot ``s``
starts at element ``s * Hk * D``; slot ``-1`` writes nothing to the caches. Launch
configurations follow ``rope``'s (``ninefold.ops.triton.rope.config``).

Programmatic dependent launch (``USE_GDC``, CUDA sm_90+, see :func:`ninefold.ops.triton.decode.pdl_wanted`):
the kernel lets the next PDL kernel launch at once (``gdc_launch_dependents``), reads what the host
copied before the step (positions, slots) and the constant cos/sin table while the kernel before it
(the qkv projection) finishes, and waits for that kernel (``gdc_wait``, in every program) before it
reads q, k, v or writes anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton import decode
from ninefold.ops.triton import rope as rope_module
from ninefold.ops.triton.cache import fp8_cache_refusal, to_cache
from ninefold.ops.triton.launch import Launcher, empty


@triton.jit
def _rotate_heads_to(src_ptr, dst_ptr, cache_ptr, tok, tmask, slot_off, smask, cos, sin, heads, d, stride_t,
                     stride_h, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, TO_CACHE: tl.constexpr):
    # tok/tmask/slot_off/smask: [BLOCK_T, 1, 1]; cos/sin: [BLOCK_T, 1, BLOCK_HALF] float32.
    h = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    hmask = tmask & (h < heads)
    cmask = smask & (h < heads)
    src = src_ptr + tok * stride_t + h * stride_h
    dst = dst_ptr + (tok * heads + h) * d
    cdst = cache_ptr + slot_off + h * d
    if IS_NEOX:
        mask = hmask & (i < HALF)
        x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty)
        y2 = (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty)
        tl.store(dst + i, y1, mask=mask)
        tl.store(dst + HALF + i, y2, mask=mask)
        if TO_CACHE:
            tl.store(cdst + i, to_cache(y1, cache_ptr), mask=cmask & (i < HALF))
            tl.store(cdst + HALF + i, to_cache(y2, cache_ptr), mask=cmask & (i < HALF))
    else:
        j = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        mask = hmask & (j < 2 * HALF)
        x = tl.load(src + j, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], BLOCK_HALF, 2]))
        y = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), [x.shape[0], x.shape[1], 2 * BLOCK_HALF])
        y = y.to(dst_ptr.dtype.element_ty)
        tl.store(dst + j, y, mask=mask)
        if TO_CACHE:
            tl.store(cdst + j, to_cache(y, cache_ptr), mask=cmask & (j < 2 * HALF))
    if BLOCK_TAIL > 0:  # features past the rotary dimension are copied
        k = 2 * HALF + tl.arange(0, BLOCK_TAIL)[None, None, :]
        tail = tl.load(src + k, mask=hmask & (k < d), other=0.0)
        tl.store(dst + k, tail, mask=hmask & (k < d))
        if TO_CACHE:
            tl.store(cdst + k, to_cache(tail, cache_ptr), mask=cmask & (k < d))


@triton.jit(do_not_specialize=["n_tokens"])
def rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cache_ptr,
                          n_tokens, hq, hk, d, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cache, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    tmask = tok < n_tokens
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    smask = tmask & (slot >= 0)  # slot -1: the token is not cached
    slot_off = slot * hk * d
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    cmask = tmask & (i < HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=cmask, other=0.0).to(tl.float32)
    if USE_GDC:  # q, k, v come from the kernel before; nothing is written before this point
        tl.extra.cuda.gdc_wait()
    _rotate_heads_to(q_ptr, q_out_ptr, q_out_ptr, tok, tmask, slot_off, smask, cos, sin, hq, d, stride_qt, stride_qh,
                     HALF, IS_NEOX, BLOCK_HQ, BLOCK_HALF, BLOCK_TAIL, False)
    _rotate_heads_to(k_ptr, k_out_ptr, kc_ptr, tok, tmask, slot_off, smask, cos, sin, hk, d, stride_kt, stride_kh,
                     HALF, IS_NEOX, BLOCK_HK, BLOCK_HALF, BLOCK_TAIL, True)
    h = tl.arange(0, BLOCK_HK)[None, :, None]
    e = tl.arange(0, BLOCK_D)[None, None, :]
    vmask = smask & (h < hk) & (e < d)
    v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + e, mask=vmask)
    tl.store(vc_ptr + slot_off + h * d + e, to_cache(v, vc_ptr), mask=vmask)


_NAMES = ("HALF", "IS_NEOX", "BLOCK_T", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "BLOCK_TAIL", "BLOCK_D", "USE_GDC")
_KERNEL = Launcher(rope_and_cache_kernel, _NAMES)


def supports(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox) -> str | None:
    if (why := fp8_cache_refusal(k_cache)) is not None:
        return why
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        return "the head dimension of q, k, v or cos_sin_cache is not contiguous"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "k_cache/v_cache are not contiguous"
    return None


def _constexprs(hq, hk, d, half, is_neox, cfg, use_gdc: bool = False) -> tuple:
    p2 = triton.next_power_of_2
    tail = d - 2 * half
    return (half, is_neox, cfg["tokens"], p2(hq), p2(hk), p2(half), p2(tail) if tail else 0, p2(d), use_gdc)


def pdl_wanted(device: torch.device) -> bool:
    """Whether this kernel launches with PDL on ``device`` (the decode kernels' switch,
    :func:`ninefold.ops.triton.decode.pdl_wanted`; a name of its own so benchmarks can set it apart)."""
    return decode.pdl_wanted(device)


def rope_and_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, pdl=None):
    """Rotated copies of q ``[T, Hq, D]`` and k ``[T, Hk, D]``; rotated k and v written to the caches (one launch).

    ``pdl``: launch with programmatic dependent launch (``None``: where :func:`pdl_wanted` says so;
    ``True`` needs it available)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out, k_out = empty(q), empty(k)
    if t:
        pdl = pdl_wanted(q.device) if pdl is None else decode.check_pdl(pdl, q.device, "rope_and_cache")
        cfg = rope_module.config(hq, hk, d, t)
        _KERNEL((triton.cdiv(t, cfg["tokens"]),),
                (q, k, v, q_out, k_out, k_cache, v_cache, positions, slot_mapping, cos_sin_cache, t, hq, hk, d,
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0)),
                _constexprs(hq, hk, d, cos_sin_cache.shape[1] // 2, is_neox, cfg, pdl), num_warps=cfg["num_warps"],
                device_index=q.get_device(), launch_pdl=pdl)
    return q_out, k_out


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (for ``ninefold.ops.triton.aot``)."""
    hq, hk, d = shapes.heads, shapes.kv_heads, shapes.head_dim
    configs = rope_module.aot_configs(hq, hk, d)
    return [{"kernel": rope_and_cache_kernel, "num_warps": cfg["num_warps"],
             "constexprs": dict(zip(_NAMES, _constexprs(hq, hk, d, d // 2, neox, cfg)))}
            for cfg in configs for neox in (True, False)]
