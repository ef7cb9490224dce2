"""Triton rotary embedding.

``rope_qk_kernel`` rotates q and k in one launch: each program takes ``BLOCK_T`` tokens, gathers
their cos/sin rows once and rotates every head of q and of k with them (float32 math). The neox
layout loads the two contiguous halves of each head; the interleaved layout loads whole heads
contiguously and splits even/odd features in registers. Features past the rotary dimension are
copied. Launch configurations: ``CONFIGS`` (measured on the H200 with
``python -m ninefold.bench.ops_memory``), else ``default_config``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import Launcher, empty, pick, table_configs


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


_QK = Launcher(rope_qk_kernel, ("HALF", "IS_NEOX", "BLOCK_T", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "BLOCK_TAIL"))

# Measured winners: {(hq, hk, d): [(max_tokens or None, {"tokens": BLOCK_T, "num_warps": w}), ...]}
# (H200, bench.ops_memory).
CONFIGS: dict[tuple, list] = {(32, 8, 128): [(4096, {"tokens": 2, "num_warps": 8}), (None, {"tokens": 4, "num_warps": 8})]}
# Set by benchmarks to force a configuration.
OVERRIDE: dict = {}
_DEFAULTS: dict = {}


def default_config(key: tuple) -> dict:
    """Tokens per program and warps: about 8192 features of q and k per program, 16 per thread."""
    hq, hk, d = key
    per_token = triton.next_power_of_2((hq + hk) * d)
    tokens = max(1, min(16, 8192 // per_token))
    return {"tokens": tokens, "num_warps": max(1, min(8, tokens * per_token // 1024))}


def config(hq: int, hk: int, d: int, tokens: int) -> dict:
    """The launch configuration for ``tokens`` tokens of ``hq``/``hk`` heads of ``d``: override, table, default."""
    return pick(OVERRIDE, CONFIGS, (hq, hk, d), tokens, _DEFAULTS, default_config)


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
        cfg = config(hq, hk, d, t)
        _QK((triton.cdiv(t, cfg["tokens"]),),
            (q, k, q_out, k_out, positions, cos_sin_cache, t, hq, hk, d, q.stride(0), q.stride(1), k.stride(0),
             k.stride(1), cos_sin_cache.stride(0)), _constexprs(hq, hk, d, cos_sin_cache.shape[1] // 2, is_neox, cfg),
            num_warps=cfg["num_warps"], device_index=q.get_device())
    return q_out, k_out


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (for ``ninefold.ops.triton.aot``)."""
    hq, hk, d = shapes.heads, shapes.kv_heads, shapes.head_dim
    names = ("HALF", "IS_NEOX", "BLOCK_T", "BLOCK_HQ", "BLOCK_HK", "BLOCK_HALF", "BLOCK_TAIL")
    return [{"kernel": rope_qk_kernel, "num_warps": cfg["num_warps"],
             "constexprs": dict(zip(names, _constexprs(hq, hk, d, d // 2, neox, cfg)))}
            for cfg in aot_configs(hq, hk, d) for neox in (True, False)]


def aot_configs(hq: int, hk: int, d: int) -> list[dict]:
    """Every launch configuration ``config`` can pick for these heads (``rope_cache`` shares them)."""
    return [OVERRIDE] if OVERRIDE else table_configs(CONFIGS, (hq, hk, d), default_config((hq, hk, d)))
