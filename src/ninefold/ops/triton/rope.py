"""Triton rotary embedding.

``rope_qk_kernel`` rotates q and k in one launch: each program takes ``BLOCK_T`` tokens, gathers
their cos/sin rows once and rotates every head of q and of k with them (float32 math). The neox
layout loads the two contiguous halves of each head; the interleaved layout loads whole heads
contiguously and splits even/odd features in registers. Features past the rotary dimension are
copied. Launch configurations: ``CONFIGS`` (measured on the H200 with
``python -m ninefold.bench.ops_memory``), else ``default_config``.

``rope_kernel`` (one tensor per launch) is the form ``aot.variants`` compiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import Launcher, empty


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, tok, tmask, cos, sin, heads, d, stride_t, stride_h, HALF: tl.constexpr,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    # tok/tmask: [BLOCK_T, 1, 1]; cos/sin: [BLOCK_T, 1, BLOCK_HALF] float32.
    h = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    hmask = tmask & (h < heads)
    src = src_ptr + tok * stride_t + h * stride_h
    dst = dst_ptr + (tok * heads + h) * d
    if IS_NEOX:
        mask = hmask & (i < HALF)
        x1 = tl.load(src + i, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(dst + i, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        j = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
        mask = hmask & (j < 2 * HALF)
        x = tl.load(src + j, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], BLOCK_HALF, 2]))
        y = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), [x.shape[0], x.shape[1], 2 * BLOCK_HALF])
        tl.store(dst + j, y.to(dst_ptr.dtype.element_ty), mask=mask)
    if BLOCK_TAIL > 0:
        k = 2 * HALF + tl.arange(0, BLOCK_TAIL)[None, None, :]
        tail_mask = hmask & (k < d)
        tl.store(dst + k, tl.load(src + k, mask=tail_mask, other=0.0), mask=tail_mask)


@triton.jit(do_not_specialize=["n_tokens"])
def rope_qk_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, n_tokens, hq, hk, d, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_cache, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_TAIL: tl.constexpr):
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    tmask = tok < n_tokens
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    cmask = tmask & (i < HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=cmask, other=0.0, eviction_policy="evict_last")
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=cmask, other=0.0, eviction_policy="evict_last")
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, tok, tmask, cos, sin, hq, d, stride_qt, stride_qh, HALF, IS_NEOX, BLOCK_HQ,
                  BLOCK_HALF, BLOCK_TAIL)
    _rotate_heads(k_ptr, k_out_ptr, tok, tmask, cos, sin, hk, d, stride_kt, stride_kh, HALF, IS_NEOX, BLOCK_HK,
                  BLOCK_HALF, BLOCK_TAIL)


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


_QK = Launcher(rope_qk_kernel, ("HALF", "IS_NEOX", "BLOCK_T", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "BLOCK_TAIL"))

# Measured winners: {(hq, hk, d): {"tokens": BLOCK_T, "num_warps": w}}.
CONFIGS: dict[tuple, dict] = {}
# Set by benchmarks to force a configuration.
OVERRIDE: dict = {}


def default_config(hq: int, hk: int, d: int) -> dict:
    """Tokens per program and warps: about 8192 features of q and k per program, 16 per thread."""
    per_token = triton.next_power_of_2((hq + hk) * d)
    tokens = max(1, min(16, 8192 // per_token))
    return {"tokens": tokens, "num_warps": max(1, min(8, tokens * per_token // 1024))}


_DEFAULTS: dict[tuple, dict] = {}


def config(hq: int, hk: int, d: int) -> dict:
    """The launch configuration for ``hq``/``hk`` heads of ``d``: override, measured table, or default."""
    found = OVERRIDE or CONFIGS.get((hq, hk, d)) or _DEFAULTS.get((hq, hk, d))
    if found is None:
        found = _DEFAULTS[hq, hk, d] = default_config(hq, hk, d)
    return found


def supports(q, k, positions, cos_sin_cache, is_neox) -> str | None:
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        return "the head dimension of q, k or cos_sin_cache is not contiguous"
    return None


def _constexprs(hq, hk, d, half, is_neox, cfg):
    p2 = triton.next_power_of_2
    tail = d - 2 * half
    return (half, is_neox, cfg["tokens"], p2(hq), p2(hk), p2(half), p2(tail) if tail else 0)


def rope(q, k, positions, cos_sin_cache, is_neox):
    """Rotated copies of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` at ``positions`` (one launch)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out, k_out = empty(q), empty(k)
    if t:
        cfg = config(hq, hk, d)
        _QK((triton.cdiv(t, cfg["tokens"]),),
            (q, k, q_out, k_out, positions, cos_sin_cache, t, hq, hk, d, q.stride(0), q.stride(1), k.stride(0),
             k.stride(1), cos_sin_cache.stride(0)), _constexprs(hq, hk, d, cos_sin_cache.shape[1] // 2, is_neox, cfg),
            num_warps=cfg["num_warps"], device_index=q.get_device())
    return q_out, k_out


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (for ``ninefold.ops.triton.aot``)."""
    hq, hk, d = shapes.heads, shapes.kv_heads, shapes.head_dim
    cfg = config(hq, hk, d)
    names = ("HALF", "IS_NEOX", "BLOCK_T", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "BLOCK_TAIL")
    return [{"kernel": rope_qk_kernel, "num_warps": cfg["num_warps"],
             "constexprs": dict(zip(names, _constexprs(hq, hk, d, d // 2, neox, cfg)))} for neox in (True, False)]
