"""Triton causal prefill attention over packed variable-length sequences (flash attention).

Program ``(head, tile)``: heads vary fastest, so the query heads of one KV head run side by side
and share its keys in L2, and tiles run in reverse, so the longest causal rows (the last query
tiles) start first and the short ones fill the tail. Sequence ``b`` owns the tiles from
``cu_seqlens_q[b] // BLOCK_M + b`` on (at least ``ceil(Lq_b / BLOCK_M)`` of them; a spare one
exits at once): a binary search over ``cu_seqlens_q`` finds a tile's sequence, so the grid comes
from host-known sizes and nothing else is computed before the launch.

Each program first visits the key tiles entirely at or below its first row's diagonal with no
mask at all, then the few tiles crossing the diagonal with the causal mask; tiles above the
diagonal are never read. Scores use ``exp2`` with ``scale * log2(e)`` applied in the same
multiply-add that subtracts the running maximum; accumulation is float32. ``PAGED`` selects where
keys come from: 0 packed k/v, 1 the paged caches through the block table.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.cache import fp8_cache_refusal
from ninefold.ops.triton.fp8_operand import dot_operand
from ninefold.ops.triton.launch import call

LOG2E = 1.4426950408889634
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Half-precision launch configurations per head size: for long sequences (``CONFIG``), for calls whose
# sequences average at most ``MEDIUM`` new tokens over at most ``MEDIUM_KEYS`` keys (``MEDIUM_CONFIG``, where
# given) and at most ``SHORT`` new tokens (a 128-row query tile would be mostly padding there);
# ``NINEFOLD_TRITON_PREFILL="block_m=64,num_warps=4"`` overrides all (``ninefold.bench.prefill_configs``
# times candidates on engine-step batches).
# Head size 128, measured on the H200 (``python -m ninefold.bench.prefill_configs``, bf16, 32 query / 8 KV
# heads; docs/perf/ops.md): 128x128 w8 s3 takes one 4096-token prompt in 301 us (packed) and 274 us (2048
# new over 2048 cached) against 365 / 342 us for 128x64 w8 s2; 64x32 w4 s3 takes 29 prompts of 100-1024
# tokens in 393 us (packed; 344 us paged, half cached) against 504 / 442 us, and 4 x 1024 in 115 against 136;
# over long cached prefixes the 128-row tiles win again (1024 new over 16384 cached: 754 us against 1203
# for 64x32 w4 s3 and 1068 for 128x64 w8 s2).
CONFIG = {64: {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
          128: {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}}
MEDIUM = 1024
MEDIUM_KEYS = 2048
MEDIUM_CONFIG = {128: {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}}
SHORT = 64
SHORT_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
_OVERRIDE = {k: int(v) for k, v in (item.split("=") for item in
                                    filter(None, os.environ.get("NINEFOLD_TRITON_PREFILL", "").split(",")))}


@triton.jit
def _prefill_step(q, n0, acc, l_i, m_i, pos, k_len, b, kvh, k_start, k_ptr, v_ptr, bt_ptr, stride_kt, stride_kh,
                  stride_vt, stride_vh, stride_kb, stride_vb, stride_btb, scale_log2e, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Keys ``[n0, n0 + BLOCK_N)`` into the online softmax; ``MASKED`` applies the causal mask and
    the sequence end (``pos``: each row's last visible key)."""
    e = tl.arange(0, D)
    cols = n0 + tl.arange(0, BLOCK_N)
    live = cols < k_len
    if PAGED:
        if MASKED:
            page = tl.load(bt_ptr + b * stride_btb + cols // PAGE, mask=live, other=0).to(tl.int64)
        else:
            page = tl.load(bt_ptr + b * stride_btb + cols // PAGE).to(tl.int64)
        k_rows = page * stride_kb + (cols % PAGE) * stride_kt + kvh * stride_kh
        v_rows = page * stride_vb + (cols % PAGE) * stride_vt + kvh * stride_vh
    else:
        k_rows = (k_start + cols).to(tl.int64) * stride_kt + kvh * stride_kh
        v_rows = (k_start + cols).to(tl.int64) * stride_vt + kvh * stride_vh
    if MASKED:
        k = tl.load(k_ptr + k_rows[:, None] + e[None, :], mask=live[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_rows[:, None] + e[None, :])
    k = k.to(q.dtype)  # (FP8 caches: the codes widened; a no-op otherwise)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        # Rows past the sequence (pos >= k_len) see zero keys past the end: harmless, never stored.
        qk = tl.where(cols[None, :] <= pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2e)
    p = tl.math.exp2(qk * scale_log2e - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptr + v_rows[:, None] + e[None, :], mask=live[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + v_rows[:, None] + e[None, :])
    v = v.to(q.dtype)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


# Per-step values (batch size, table width, where the small index tensors start) must not pick a new
# compilation: only shapes of the model and the launch configuration do.
@triton.jit(do_not_specialize=["batch", "search_steps", "stride_btb", "cu_q_ptr", "cu_k_ptr", "bt_ptr"])
def prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, scale_log2e, batch, search_steps,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   stride_kb, stride_vb, stride_btb, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                   PRECISION: tl.constexpr, STATIC_ITERS: tl.constexpr):
    h = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # longest rows first
    kvh = h // GROUP
    lo = batch * 0
    hi = batch + 0
    for _ in range(SEARCH_STEPS if SEARCH_STEPS > 0 else search_steps):  # largest b: cu_q[b] // BLOCK_M + b <= tile
        mid = (lo + hi) // 2
        right = tl.load(cu_q_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    b = lo
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    m0 = (tile - q_start // BLOCK_M - b) * BLOCK_M
    if m0 < q_len:
        k_start = tl.load(cu_k_ptr + b)
        k_len = tl.load(cu_k_ptr + b + 1) - k_start
        offset = k_len - q_len  # queries are the last q_len tokens
        rows = m0 + tl.arange(0, BLOCK_M)
        pos = offset + rows  # each row's last visible key
        e = tl.arange(0, D)
        q_rows = (q_start + rows).to(tl.int64)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        full_end = (offset + m0 + 1) // BLOCK_N * BLOCK_N  # key tiles every row of this tile sees whole
        k_end = tl.minimum(k_len, offset + m0 + BLOCK_M)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + e[None, :],
                    mask=(rows < q_len)[:, None], other=0.0)
        q = dot_operand(q, k_ptr)
        if STATIC_ITERS > 0:  # Triton's interpreter (3.6) cannot loop to a bound read from memory
            for i in range(STATIC_ITERS):
                n0 = i * BLOCK_N
                if n0 < full_end:
                    acc, l_i, m_i = _prefill_step(q, n0, acc, l_i, m_i, pos, k_len, b, kvh, k_start, k_ptr, v_ptr,
                                                  bt_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_kb,
                                                  stride_vb, stride_btb, scale_log2e, D, BLOCK_N, PAGED, PAGE, False,
                                                  PRECISION)
                elif n0 < k_end:
                    acc, l_i, m_i = _prefill_step(q, n0, acc, l_i, m_i, pos, k_len, b, kvh, k_start, k_ptr, v_ptr,
                                                  bt_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_kb,
                                                  stride_vb, stride_btb, scale_log2e, D, BLOCK_N, PAGED, PAGE, True,
                                                  PRECISION)
        else:
            for n0 in range(0, full_end, BLOCK_N):
                acc, l_i, m_i = _prefill_step(q, n0, acc, l_i, m_i, pos, k_len, b, kvh, k_start, k_ptr, v_ptr, bt_ptr,
                                              stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb,
                                              stride_btb, scale_log2e, D, BLOCK_N, PAGED, PAGE, False, PRECISION)
            for n0 in range(full_end, k_end, BLOCK_N):
                acc, l_i, m_i = _prefill_step(q, n0, acc, l_i, m_i, pos, k_len, b, kvh, k_start, k_ptr, v_ptr, bt_ptr,
                                              stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_vb,
                                              stride_btb, scale_log2e, D, BLOCK_N, PAGED, PAGE, True, PRECISION)
        out = acc / l_i[:, None]
        tl.store(o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + e[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(rows < q_len)[:, None])


def _static_iters(cu_seqlens_k, block_n: int) -> int:
    """Under Triton's interpreter only: the key-tile count of the longest sequence (0: dynamic loop)."""
    if not INTERPRETED:
        return 0
    return max(1, triton.cdiv(int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()), block_n))


def supports(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, *_) -> str | None:
    if k_cache is not None and (why := fp8_cache_refusal(k_cache)) is not None:
        return why
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"head size {d} is not a power of two >= 16"
    tensors = [q] + ([k_cache, v_cache] if block_tables is not None else [k, v])
    if any(t.stride(-1) != 1 for t in tensors):
        return "the head dimension of q, k or v is not contiguous"
    if block_tables is not None and any(t.stride(1) != t.shape[2] * t.stride(2) for t in (k_cache, v_cache)):
        return "cache blocks are not laid out [block_size, Hk, D]"
    return None


def config(dtype: torch.dtype, d: int, mean_new_tokens: float = float("inf"), max_keys: int | None = None) -> dict:
    """The launch configuration for ``dtype``, head size ``d``, the call's mean query length and,
    where the caller knows it, its longest key length ``max_keys``."""
    if dtype == torch.float32:
        return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
    size = 64 if d <= 64 else 128
    if mean_new_tokens <= SHORT:
        base = SHORT_CONFIG
    elif mean_new_tokens <= MEDIUM and (max_keys is None or max_keys <= MEDIUM_KEYS) and size in MEDIUM_CONFIG:
        base = MEDIUM_CONFIG[size]
    else:
        base = CONFIG[size]
    return {**base, **_OVERRIDE}


def _blocks(dtype: torch.dtype, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for long sequences (``config``'s default)."""
    c = config(dtype, d)
    return c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (kernel, constexprs, warps, stages) for ``ninefold.ops.triton.aot``."""
    found = {}
    for mean in (float("inf"), MEDIUM, 1):
        c = config(dtype, shapes.head_dim, mean)
        for mode in (0, 1):
            constexprs = {"GROUP": shapes.heads // shapes.kv_heads, "D": shapes.head_dim, "BLOCK_M": c["block_m"],
                          "BLOCK_N": c["block_n"], "PAGED": mode, "PAGE": shapes.block_size if mode == 1 else 1,
                          "SEARCH_STEPS": 0, "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
                          "STATIC_ITERS": 0}
            found[str(sorted(constexprs.items())) + str(c)] = {
                "kernel": prefill_kernel, "constexprs": constexprs, "num_warps": c["num_warps"],
                "num_stages": c["num_stages"]}
    return list(found.values())


def search_steps(batch: int) -> int:
    """Binary-search steps that find a tile's sequence among ``batch``."""
    return max(1, math.ceil(math.log2(batch + 1)))


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables,
                      max_seqlen_q=None, max_seqlen_k=None):
    mean = q.shape[0] / max(1, cu_seqlens_q.shape[0] - 1)  # from shapes and host ints: no device read
    return launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables,
                  config(q.dtype, q.shape[-1], mean, max_seqlen_k))


def launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables, config: dict):
    """``attention_prefill`` under an explicit launch configuration (``block_m``, ``block_n``,
    ``num_warps``, ``num_stages``)."""
    tq, hq, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tq == 0:
        return out
    block_m, block_n, warps, stages = (config[key] for key in ("block_m", "block_n", "num_warps", "num_stages"))
    paged = block_tables is not None
    keys, values = (k_cache, v_cache) if paged else (k, v)
    if paged:
        stride_kt, stride_kh, stride_vt, stride_vh = keys.stride(1), keys.stride(2), values.stride(1), values.stride(2)
        stride_kb, stride_vb, stride_bt, page = keys.stride(0), values.stride(0), block_tables.stride(0), keys.shape[1]
    else:
        stride_kt, stride_kh, stride_vt, stride_vh = keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)
        stride_kb = stride_vb = stride_bt = 0
        page = 1
    mode = 1 if paged else 0
    hk = keys.shape[-2]
    steps = search_steps(batch)
    grid = (hq, tq // block_m + batch)  # every tile start cu_q[b] // BLOCK_M + b is below tq // BLOCK_M + batch
    call(prefill_kernel, grid,
        q, keys, values, out, cu_seqlens_q, cu_seqlens_k, block_tables if paged else cu_seqlens_q,
        (scale or 1.0 / math.sqrt(d)) * LOG2E, batch, steps, q.stride(0), q.stride(1), stride_kt, stride_kh,
        stride_vt, stride_vh, out.stride(0), out.stride(1), stride_kb, stride_vb, stride_bt, GROUP=hq // hk, D=d,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGED=mode, PAGE=page, SEARCH_STEPS=steps if INTERPRETED else 0,
        STATIC_ITERS=_static_iters(cu_seqlens_k, block_n),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out
