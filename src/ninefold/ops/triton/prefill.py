"""Triton causal prefill attention over packed variable-length sequences (flash attention).

Program ``(tile, head)``: query tiles of all sequences are numbered one after another
(``tile_starts`` is computed on the device from ``cu_seqlens_q``; a binary search finds the
tile's sequence), so the grid is sized from host-known numbers only. Keys come from packed
k/v or, with ``PAGED``, from the paged caches through the block table.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Half-precision launch configuration per head size; ``NINEFOLD_TRITON_PREFILL="block_m=64,num_warps=4"``
# overrides it (``ninefold.bench.ops`` sweeps a few and reports the fastest).
CONFIG = {64: {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
          128: {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}}
_OVERRIDE = {k: int(v) for k, v in (item.split("=") for item in
                                    filter(None, os.environ.get("NINEFOLD_TRITON_PREFILL", "").split(",")))}


@triton.jit
def _prefill_step(q, n0, k_end, rows, offset, b, kvh, k_start, k_ptr, v_ptr, bt_ptr, stride_kt, stride_kh, stride_vt,
                  stride_vh, stride_kb, stride_vb, stride_btb, scale_log2e, m_i, l_i, acc, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys [n0, n0 + BLOCK_N) (masked at ``k_end`` and causally) into the online softmax."""
    e = tl.arange(0, D)
    cols = n0 + tl.arange(0, BLOCK_N)
    cm = cols < k_end
    if PAGED:
        page = tl.load(bt_ptr + b * stride_btb + cols // PAGE, mask=cm, other=0).to(tl.int64)
        k_offs = page * stride_kb + (cols % PAGE) * stride_kt + kvh * stride_kh
        v_offs = page * stride_vb + (cols % PAGE) * stride_vt + kvh * stride_vh
    else:
        k_offs = (k_start + cols).to(tl.int64) * stride_kt + kvh * stride_kh
        v_offs = (k_start + cols).to(tl.int64) * stride_vt + kvh * stride_vh
    k = tl.load(k_ptr + k_offs[:, None] + e[None, :], mask=cm[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
    visible = (cols[None, :] <= (offset + rows)[:, None]) & cm[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_offs[:, None] + e[None, :], mask=cm[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, tile_starts_ptr, bt_ptr, scale_log2e, batch,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   stride_kb, stride_vb, stride_btb, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                   PRECISION: tl.constexpr, STATIC_ITERS: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    lo = batch * 0
    hi = batch + 0
    for _ in range(SEARCH_STEPS):  # largest b with tile_starts[b] <= tile
        mid = (lo + hi) // 2
        right = tl.load(tile_starts_ptr + mid) <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    b = lo
    total_tiles = tl.load(tile_starts_ptr + batch)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    q_len = tl.where(tile < total_tiles, q_len, 0)
    k_start = tl.load(cu_k_ptr + b)
    k_len = tl.load(cu_k_ptr + b + 1) - k_start
    offset = k_len - q_len  # queries are the last q_len tokens
    m0 = (tile - tl.load(tile_starts_ptr + b)) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    rm = rows < q_len
    e = tl.arange(0, D)
    q = tl.load(q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + e[None, :],
                mask=rm[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_end = tl.minimum(k_len, offset + m0 + BLOCK_M)
    k_end = tl.where(q_len > 0, k_end, 0)
    if STATIC_ITERS > 0:  # Triton's interpreter (3.6) cannot loop to a bound read from memory
        for i in range(STATIC_ITERS):
            m_i, l_i, acc = _prefill_step(q, i * BLOCK_N, k_end, rows, offset, b, kvh, k_start, k_ptr, v_ptr, bt_ptr,
                                          stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb, stride_btb,
                                          scale_log2e, m_i, l_i, acc, D, BLOCK_N, PAGED, PAGE, PRECISION)
    else:
        for n0 in range(0, k_end, BLOCK_N):
            m_i, l_i, acc = _prefill_step(q, n0, k_end, rows, offset, b, kvh, k_start, k_ptr, v_ptr, bt_ptr,
                                          stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb, stride_btb,
                                          scale_log2e, m_i, l_i, acc, D, BLOCK_N, PAGED, PAGE, PRECISION)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + e[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rm[:, None])


def _static_iters(cu_seqlens_k, block_n: int) -> int:
    """Under Triton's interpreter only: the key-tile count of the longest sequence (0: dynamic loop)."""
    if not INTERPRETED:
        return 0
    return max(1, triton.cdiv(int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()), block_n))


def supports(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables) -> str | None:
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"head size {d} is not a power of two >= 16"
    tensors = [q] + ([k_cache, v_cache] if block_tables is not None else [k, v])
    if any(t.stride(-1) != 1 for t in tensors):
        return "the head dimension of q, k or v is not contiguous"
    if block_tables is not None and any(t.stride(1) != t.shape[2] * t.stride(2) for t in (k_cache, v_cache)):
        return "cache blocks are not laid out [block_size, Hk, D]"
    return None


def _blocks(dtype: torch.dtype, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per dtype and head size."""
    if dtype == torch.float32:
        return 32, 32, 4, 1
    config = {**CONFIG[64 if d <= 64 else 128], **_OVERRIDE}
    return config["block_m"], config["block_n"], config["num_warps"], config["num_stages"]


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables):
    tq, hq, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tq == 0:
        return out
    block_m, block_n, warps, stages = _blocks(q.dtype, d)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32)
    tile_starts = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    torch.cumsum((q_lens + block_m - 1) // block_m, 0, out=tile_starts[1:])
    paged = block_tables is not None
    keys, values = (k_cache, v_cache) if paged else (k, v)
    if paged:
        stride_kt, stride_kh, stride_vt, stride_vh = keys.stride(1), keys.stride(2), values.stride(1), values.stride(2)
        stride_kb, stride_vb, stride_bt, page = keys.stride(0), values.stride(0), block_tables.stride(0), keys.shape[1]
    else:
        stride_kt, stride_kh, stride_vt, stride_vh = keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)
        stride_kb = stride_vb = stride_bt = 0
        page = 1
    hk = keys.shape[-2]
    grid = (triton.cdiv(tq, block_m) + batch, hq)
    prefill_kernel[grid](
        q, keys, values, out, cu_seqlens_q, cu_seqlens_k, tile_starts, block_tables if paged else cu_seqlens_q,
        (scale or 1.0 / math.sqrt(d)) * LOG2E, batch, q.stride(0), q.stride(1), stride_kt, stride_kh, stride_vt,
        stride_vh, out.stride(0), out.stride(1), stride_kb, stride_vb, stride_bt, GROUP=hq // hk, D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, PAGE=page, SEARCH_STEPS=max(1, math.ceil(math.log2(batch + 1))),
        STATIC_ITERS=_static_iters(cu_seqlens_k, block_n),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out
