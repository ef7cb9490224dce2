"""Triton paged decode attention (split-K, "flash decoding") in one launch.

Program ``(b * Hk + kv_head, split)`` (or sequences fastest) streams its slice of sequence
``b``'s keys from the paged cache once, for all the query heads of that KV head (GQA rows
padded to 16 for ``tl.dot``), with an online softmax. The number of splits comes from the
shapes (batch, KV heads, block-table capacity, SM count), never from the context lengths, so
nothing is read back from the device; on the device each sequence's real length is divided
among its splits, so a table much wider than the context (CUDA graphs size it for the longest
sequence) costs empty programs (they read no keys), not long ones.

Merging in the same launch: a split holding keys stores its partial result and log-sum-exp, then
bumps an atomic counter of its (sequence, KV head) (release, after a CTA barrier); the program
that arrives last among the splits holding keys (acquire) merges them, writes the output and
resets the counter to 0, so the next launch or CUDA-graph replay finds it zeroed without a
memset. The counters live in a persistent zeroed buffer per device (``counters``), so launches on
one device must be stream-ordered (they are in the engine). A sequence whose keys fit one split
writes the output directly; a launch with one split per sequence (large batches) runs the
specialisation without the merge code (``MERGE=0``: it needs fewer registers). With
``one_kernel=0`` a second kernel merges instead (the previous design, kept for comparison and
for the benchmark's "old" column).

Programmatic dependent launch (``USE_GDC``; where :func:`pdl_wanted`): the split kernel lets the
next PDL kernel (the o-projection GEMV, which streams its weights before it waits) launch at once,
reads the context length and the first block-table entries (copied from the host before the step)
while the kernel before it (``rope_and_cache``, which writes this step's keys) finishes, and then
waits for it (``gdc_wait``, in every program) before it reads q or the cache or writes anything.
The merge kernel of the two-kernel path is launched plainly after it (it waits for the whole split
kernel). The arrival counters are touched only after the wait, so PDL does not change the merge.

Rope and the cache write folded in (``ROPE``; ``ops.rope_cache_attention_decode``): q arrives unrotated
and is rotated as it is loaded (``rope``'s float32 math and rounding); the program whose split holds a
row's last position rotates that token's keys for its KV heads, writes them and the values to the
row's slot, and passes a CTA barrier before its loop reads the cache, so no other kernel of the step
writes the cache and the results equal ``rope_and_cache`` followed by this kernel bit for bit.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninefold.ops.triton import gemv_pdl
from ninefold.ops.triton import launch as launch_module
from ninefold.ops.triton.cache import fp8_cache_refusal, to_cache
from ninefold.ops.triton.fp8_operand import dot_operand
from ninefold.ops.triton.launch import Launcher, call

LOG2E = 1.4426950408889634
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Launch configuration: keys per loop step, warps, pipeline stages, split sizing (float32 halves the keys per
# step). ``NINEFOLD_TRITON_DECODE="block_n=128,num_warps=8"`` overrides it (``ninefold.bench.ops``
# and ``ninefold.bench.ops_attention`` sweep candidates and report the fastest).
# ``per_sm``: programs per SM the split count aims at; ``min_tiles``: fewest key tiles per split.
# ``heads_fastest``: launch order with the KV heads of one sequence adjacent (else sequences adjacent).
# ``one_kernel``: the last split of a (sequence, KV head) merges (1), or a second kernel does (0);
# ``merge_rows``: partial rows (query heads x splits) the in-place merge reads per step;
# ``min_split``: fewest keys per split (rounded up to block_n): short contexts take fewer, longer splits;
# ``split_config``: keys that replace these when the launch splits the context (few programs: small batches);
# ``heads_per_program``: adjacent KV heads one program reads (a token's heads are contiguous in the cache).
# Defaults measured on the H200 (bf16, Llama-3-8B heads, ``python -m ninefold.bench.decode_attention``, .notes/gpu10):
# unsplit (batch 256, contexts 600/1200) 32 keys x 2 KV heads per step, KV heads of a sequence adjacent:
# 150.5 / 291.7 us vs 157.7 / 293.5 us for the previous 64/4/2; split (batch 1 and 64) 64 keys, 16-row merge steps.
CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2, "per_sm": 4, "min_tiles": 2, "heads_fastest": 1,
          "one_kernel": 1, "merge_rows": 64, "min_split": 0, "heads_per_program": 2}
SPLIT_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2, "heads_fastest": 0, "heads_per_program": 1,
                "merge_rows": 16, "min_split": 0}
CONFIG["split_config"] = SPLIT_CONFIG
CONFIG.update({k: int(v) for k, v in (item.split("=") for item in
                                      filter(None, os.environ.get("NINEFOLD_TRITON_DECODE", "").split(",")))})


@triton.jit
def _decode_step(q, n0, end, page, b, kvh, kc_ptr, vc_ptr, bt_ptr, stride_cb, stride_co, stride_ch, stride_btb,
                 scale_log2e, m_i, l_i, acc, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr, HEADS: tl.constexpr):
    """Keys ``[n0, n0 + BLOCK_N)`` of KV heads ``kvh .. kvh + HEADS`` (masked at ``end``; at least
    one is live; ``page``: their blocks) into the online softmax; also returns the next tile's
    blocks (read a tile ahead). Tile row ``j`` is token ``n0 + j // HEADS`` of head ``kvh + j % HEADS``
    (a token's heads are adjacent in the cache); query row ``g`` belongs to head ``kvh + g // GROUP``."""
    e = tl.arange(0, D)
    j = tl.arange(0, BLOCK_N * HEADS)
    n = n0 + j // HEADS
    nm = n < end
    offs = page.to(tl.int64) * stride_cb + (n % PAGE) * stride_co + (kvh + j % HEADS) * stride_ch
    k = tl.load(kc_ptr + offs[:, None] + e[None, :], mask=nm[:, None], other=0.0)
    v = tl.load(vc_ptr + offs[:, None] + e[None, :], mask=nm[:, None], other=0.0)
    return _decode_tile(q, k, v, n0, end, b, bt_ptr, stride_btb, scale_log2e, m_i, l_i, acc, GROUP, BLOCK_G, BLOCK_N,
                        PAGE, PRECISION, HEADS)


@triton.jit
def _decode_tile(q, k, v, n0, end, b, bt_ptr, stride_btb, scale_log2e, m_i, l_i, acc, GROUP: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
                 HEADS: tl.constexpr):
    """The online-softmax update of ``_decode_step`` for a tile whose keys ``k`` and values ``v`` are
    loaded (by ``_decode_step``, or before ``gdc_wait`` under ``EARLY_KV``); also reads the next tile's blocks."""
    j = tl.arange(0, BLOCK_N * HEADS)
    n = n0 + j // HEADS
    nm = n < end
    nxt = n + BLOCK_N
    page = tl.load(bt_ptr + b * stride_btb + nxt // PAGE, mask=nxt < end, other=0)
    k = k.to(q.dtype)  # (FP8 caches: the codes widened; a no-op for caches of q's dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HEADS == 1:
        s = tl.where(nm[None, :], s, float("-inf"))
    else:  # a query row sees its own head's keys (padding rows, beyond GROUP * HEADS, see all: no -inf rows)
        g = tl.arange(0, BLOCK_G)
        own = ((g // GROUP)[:, None] == (j % HEADS)[None, :]) | (g >= GROUP * HEADS)[:, None]
        s = tl.where(nm[None, :] & own, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2e - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc, page


@triton.jit
def _merge_splits(part_ptr, lse_ptr, out_ptr, row0, out_base, stride_oh, num_splits, n_live, GROUP: tl.constexpr,
                  G2: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Combine the first ``n_live`` of the ``num_splits`` partial results of query heads
    ``row0 .. row0 + GROUP`` (rows of ``[B, Hq]``) by their log-sum-exp, ``BLOCK_S`` splits at a
    time, and store the output. Partials written by other programs are read through L2 (``.cg``),
    never from a stale L1 line."""
    g = tl.arange(0, G2)[:, None, None]
    s = tl.arange(0, BLOCK_S)[None, :, None]
    e = tl.arange(0, D)[None, None, :]
    gm = g < GROUP
    m = tl.full([G2, 1, 1], float("-inf"), tl.float32)
    total = tl.zeros([G2, 1, 1], tl.float32)
    acc = tl.zeros([G2, 1, D], tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        sm = gm & (s0 + s < n_live)
        rows = (row0 + g) * num_splits + s0 + s
        lse = tl.load(lse_ptr + rows, mask=sm, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_ptr + rows * D + e, mask=sm, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1, keep_dims=True))
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # padding rows (g >= GROUP) stay -inf
        alpha = tl.exp2(m - safe)
        w = tl.exp2(lse - safe)
        acc = acc * alpha + tl.sum(part * w, 1, keep_dims=True)
        total = total * alpha + tl.sum(w, 1, keep_dims=True)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + out_base + g * stride_oh + e, out.to(out_ptr.dtype.element_ty), mask=gm)


@triton.jit
def _rope_factors(row_ptr, e, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per feature ``e`` of a head: (cos, sin) of the position's row of the cos/sin cache (float32;
    1 and 0 past the rotary dimension), the feature it pairs with, and whether it is the first of
    its pair; NeoX pairs ``i`` with ``i + HALF``, the interleaved form ``2i`` with ``2i + 1``."""
    rotated = e < 2 * HALF
    if IS_NEOX:
        r = e % HALF
        partner = tl.where(e < HALF, e + HALF, e - HALF)
        first = e < HALF
    else:
        r = e // 2
        partner = e ^ 1
        first = (e % 2) == 0
    cos = tl.load(row_ptr + r, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(row_ptr + HALF + r, mask=rotated, other=0.0).to(tl.float32)
    return cos, sin, tl.where(rotated, partner, e), first & rotated, rotated


@triton.jit
def _rotated(x, partner, cos, sin, first, rotated):
    """``x`` rotated as ``rope`` does (float32 math, rounded to x's dtype); ``partner``: the paired features."""
    xf = x.to(tl.float32)
    pf = partner.to(tl.float32)
    y = tl.where(first, xf * cos - pf * sin, xf * cos + pf * sin)
    return tl.where(rotated, y.to(x.dtype), x)


@triton.jit(do_not_specialize=["num_splits", "batch", "kv_heads", "heads_fastest", "min_split", "stride_btb", "bt_ptr",
                              "lens_ptr"])
def decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, part_ptr, lse_ptr, out_ptr, counters_ptr,
                        k_ptr, v_ptr, pos_ptr, slot_ptr, cs_ptr,
                        scale_log2e, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_co, stride_ch,
                        stride_btb, stride_kb, stride_kh, stride_vb, stride_vh, stride_cs, num_splits, batch,
                        kv_heads, heads_fastest, min_split, GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                        PRECISION: tl.constexpr, STATIC_ITERS: tl.constexpr, MERGE: tl.constexpr,
                        G2: tl.constexpr, BLOCK_S: tl.constexpr, HEADS: tl.constexpr, USE_GDC: tl.constexpr = False,
                        EARLY_KV: tl.constexpr = False, ROPE: tl.constexpr = False, HALF: tl.constexpr = 1,
                        IS_NEOX: tl.constexpr = True):
    # A program takes HEADS adjacent KV heads (their GROUP * HEADS query heads are its rows).
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    kv_groups = kv_heads // HEADS
    if heads_fastest:  # the KV heads of one block run side by side (they share its DRAM pages)
        b = (pid // kv_groups).to(tl.int64)
        kvh = (pid % kv_groups) * HEADS
    else:
        b = (pid % batch).to(tl.int64)
        kvh = (pid // batch) * HEADS
    split = tl.program_id(1)
    heads = kv_heads * GROUP
    length = tl.load(lens_ptr + b)
    # Splits share the sequence's real length (not the table's capacity): whole tiles, the last ones empty.
    # ``min_split`` (a multiple of BLOCK_N): fewer, longer splits for short contexts.
    per_split = tl.maximum(tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N, min_split)
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP * HEADS
    e = tl.arange(0, D)
    q_row = q_ptr + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh
    q_ptrs = q_row + e[None, :]
    if ROPE:  # the step's token: position and slot (copied from the host before the step), its cos/sin row
        slot = tl.load(slot_ptr + b).to(tl.int64)
        cos, sin, partner, first_of_pair, rotated = _rope_factors(
            cs_ptr + tl.load(pos_ptr + b).to(tl.int64) * stride_cs, e, HALF, IS_NEOX)
    if not USE_GDC:
        q = tl.load(q_ptrs, mask=gm[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    first = start + tl.arange(0, BLOCK_N * HEADS) // HEADS
    page = tl.load(bt_ptr + b * stride_btb + first // PAGE, mask=first < end, other=0)
    if EARLY_KV:  # the first tile's keys before this step's token, written by earlier steps
        jj = tl.arange(0, BLOCK_N * HEADS)
        kv_offs = (page.to(tl.int64) * stride_cb + (first % PAGE) * stride_co + (kvh + jj % HEADS) * stride_ch)[:, None] \
            + e[None, :]
        old = ((first < end) & (first < length - 1))[:, None]
        k_first = tl.load(kc_ptr + kv_offs, mask=old, other=0.0)
        v_first = tl.load(vc_ptr + kv_offs, mask=old, other=0.0)
    if USE_GDC:  # q and this step's keys come from the kernels before; nothing is written before this point
        tl.extra.cuda.gdc_wait()
        q = tl.load(q_ptrs, mask=gm[:, None], other=0.0)
    if ROPE:
        q = _rotated(q, tl.load(q_row + partner[None, :], mask=gm[:, None], other=0.0), cos[None, :], sin[None, :],
                     first_of_pair[None, :], rotated[None, :])
        if (start < end) & (end == length) & (slot >= 0):  # this split holds the step's token: cache it first
            h = tl.arange(0, HEADS)[:, None]
            k_row = k_ptr + b * stride_kb + (kvh + h) * stride_kh
            k_new = _rotated(tl.load(k_row + e[None, :]), tl.load(k_row + partner[None, :]), cos[None, :],
                             sin[None, :], first_of_pair[None, :], rotated[None, :])
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_co + (kvh + h) * stride_ch + e[None, :]
            # (through the model's dtype, as rope then reshape_and_cache round it: FP8 caches get the same codes)
            tl.store(kc_ptr + dst, to_cache(k_new.to(k_ptr.dtype.element_ty), kc_ptr))
            v_new = tl.load(v_ptr + b * stride_vb + (kvh + h) * stride_vh + e[None, :])
            tl.store(vc_ptr + dst, to_cache(v_new, vc_ptr))
            tl.debug_barrier()  # the program's own reads of that row below see it
    q = dot_operand(q, kc_ptr)
    tiles_from = start
    if EARLY_KV:
        tiles_from = start + BLOCK_N
        if start < end:  # this step's token (position length - 1), read after the wait
            new = ((first < end) & (first == length - 1))[:, None]
            k_first = tl.where(new, tl.load(kc_ptr + kv_offs, mask=new, other=0.0), k_first)
            v_first = tl.where(new, tl.load(vc_ptr + kv_offs, mask=new, other=0.0), v_first)
            m_i, l_i, acc, page = _decode_tile(q, k_first, v_first, start, end, b, bt_ptr, stride_btb,
                                                      scale_log2e, m_i, l_i, acc, GROUP, BLOCK_G, BLOCK_N, PAGE,
                                                      PRECISION, HEADS)
    if STATIC_ITERS > 0:  # Triton's interpreter (3.6) cannot loop to a bound read from memory
        for i in range(STATIC_ITERS):
            n0 = tiles_from + i * BLOCK_N
            if n0 < end:
                m_i, l_i, acc, page = _decode_step(q, n0, end, page, b, kvh, kc_ptr, vc_ptr, bt_ptr, stride_cb,
                                                   stride_co, stride_ch, stride_btb, scale_log2e, m_i, l_i, acc,
                                                   GROUP, BLOCK_G, D, BLOCK_N, PAGE, PRECISION, HEADS)
    else:
        for n0 in range(tiles_from, end, BLOCK_N):  # every tile holds at least one key: finite maxima
            m_i, l_i, acc, page = _decode_step(q, n0, end, page, b, kvh, kc_ptr, vc_ptr, bt_ptr, stride_cb, stride_co,
                                               stride_ch, stride_btb, scale_log2e, m_i, l_i, acc, GROUP, BLOCK_G, D,
                                               BLOCK_N, PAGE, PRECISION, HEADS)
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out_offs = b * stride_ob + (kvh * GROUP + g)[:, None] * stride_oh + e[None, :]
    if MERGE:
        # Splits holding keys: the first n_live (none for a context of 0 keys: padded CUDA-graph rows).
        n_live = tl.where(length > 0, tl.cdiv(length, tl.maximum(per_split, 1)), 0)
        if start < end:
            if n_live == 1:  # this program saw the whole context: the output itself
                tl.store(out_ptr + out_offs, (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None])
            else:
                row = (b * heads + kvh * GROUP + g) * num_splits + split  # partials are [B, Hq, splits]
                tl.store(part_ptr + row[:, None] * D + e[None, :], acc / safe_l[:, None], mask=gm[:, None])
                tl.store(lse_ptr + row, m_i + tl.log2(safe_l), mask=gm)
                tl.debug_barrier()  # every thread's stores precede the release below
                counter = counters_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + b * kv_heads + kvh
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == n_live - 1:  # the last live split of this (sequence, KV head) to finish
                    tl.debug_barrier()
                    tl.store(counter, 0)  # ready for the next launch (a CUDA-graph replay) without a memset
                    _merge_splits(part_ptr, lse_ptr, out_ptr, b * heads + kvh * GROUP, b * stride_ob +
                                  kvh * GROUP * stride_oh, stride_oh, num_splits, n_live, GROUP * HEADS, G2, D,
                                  BLOCK_S)
        elif split == 0:  # no keys at all: zeros (what the unsplit program writes)
            tl.store(out_ptr + out_offs, tl.zeros([BLOCK_G, D], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=gm[:, None])
    elif num_splits == 1:  # the whole context in one program: the output itself, no merge
        tl.store(out_ptr + out_offs, (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None])
    else:
        row = (b * heads + kvh * GROUP + g) * num_splits + split  # [B, Hq, splits] flattened
        live = gm[:, None] & (e[None, :] < tl.where(start < end, D, 0))  # an empty split writes no partial
        tl.store(part_ptr + row[:, None] * D + e[None, :], acc / safe_l[:, None], mask=live)
        lse = tl.where(start < end, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=gm)


@triton.jit(do_not_specialize=["num_splits", "stride_ob", "stride_oh"])
def decode_merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, stride_ob, stride_oh, heads,
                        D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    sm = s < num_splits
    base = (b * heads + h) * num_splits
    lse = tl.load(lse_ptr + base + s, mask=sm, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    e = tl.arange(0, D)
    live = sm & (lse > float("-inf"))  # empty splits wrote no partial result
    parts = tl.load(part_ptr + (base + s)[:, None] * D + e[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + e, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs at ``shapes`` (kernel, constexprs, warps, stages) for
    ``ninefold.ops.triton.aot``: the split kernel unsplit under ``CONFIG`` (MERGE 0: large batches;
    also with one KV head per program: medium batches, see :func:`plan`) and under its
    ``split_config`` with the in-place merge (MERGE 1, unless ``one_kernel=0``) or without, and the
    merge kernel of the two-kernel path."""
    group = shapes.heads // shapes.kv_heads
    split = {"GROUP": group, "D": shapes.head_dim, "PAGE": shapes.block_size,
             "PRECISION": "ieee" if dtype == torch.float32 else "tf32", "STATIC_ITERS": 0}
    found = []
    # Unsplit launches under CONFIG; split ones under its split_config, merging (or, one split after all, not).
    for cfg, merges in ((CONFIG, (0,)), ({**CONFIG, "heads_per_program": 1}, (0,)),
                        ({**CONFIG, **CONFIG.get("split_config", {})}, (0, _merges_in_place(CONFIG)))):
        block_n = cfg["block_n"] if dtype != torch.float32 else min(32, cfg["block_n"])
        heads = _heads_per_program(shapes.kv_heads, cfg)
        for merge in sorted(set(merges)):
            variant = {"kernel": decode_split_kernel, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                       "constexprs": {**split, "BLOCK_N": block_n, "MERGE": merge, "HEADS": heads, "USE_GDC": False,
                                      "EARLY_KV": False, "ROPE": False, "HALF": 1, "IS_NEOX": True,
                                      "BLOCK_G": max(16, triton.next_power_of_2(group * heads)),
                                      **_merge_tile(group * heads, cfg)}}
            if variant not in found:
                found.append(variant)
    return [*found, {"kernel": decode_merge_kernel, "num_warps": 4, "constexprs": {"D": shapes.head_dim, "BLOCK_S": 16}}]


@functools.cache
def _unused(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A placeholder for pointers a launch never follows (the partial results of an unsplit launch,
    the new tokens' arguments of one that does not rope them)."""
    return torch.empty(1, dtype=dtype, device=device)


# Arrival counters of the one-kernel merge, per device: int32, zero between launches. Every buffer
# ever made is kept, since a captured CUDA graph holds its address.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 1 << 16  # (sequence, KV head) pairs: 8192 sequences of 8 KV heads before it grows


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters on ``device`` (persistent: the merging program
    of every launch leaves its counter at 0). Growing it inside CUDA-graph capture is refused:
    run the batch size once eagerly before capturing it (``ninefold.llm.cuda_graphs`` does)."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attention_decode: {n} split counters needed on {device} during CUDA-graph capture "
                               f"(have {kept[-1].numel() if kept else 0}); run this batch size once before capture")
        kept.append(torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device))
    return kept[-1]


def _merges_in_place(config: dict) -> int:
    return int(config.get("one_kernel", 1))


def _merge_tile(group: int, config: dict) -> dict:
    """The in-place merge's tile: the group's query heads (padded to a power of two) x ``BLOCK_S``
    splits, about ``merge_rows`` (default 64) partial rows of D floats at a time."""
    g2 = triton.next_power_of_2(group)
    return {"G2": g2, "BLOCK_S": max(1, config.get("merge_rows", 64) // g2)}


def supports(q, k_cache, v_cache, block_tables, context_lens, scale) -> str | None:
    if (why := fp8_cache_refusal(k_cache)) is not None:
        return why
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        return f"head size {d} is not a power of two >= 16"
    if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "q's head dimension or the caches are not contiguous"
    return None


def _split(capacity: int, programs: int, sms: int, block_n: int, per_sm: int, min_tiles: int) -> tuple[int, int]:
    """(most tokens per split, number of splits): about ``per_sm`` programs per SM (many short
    programs leave a short tail in the last wave), at least ``min_tiles`` key tiles each when the
    table is full."""
    want = max(1, min(math.ceil(per_sm * sms / max(programs, 1)), math.ceil(capacity / (min_tiles * block_n))))
    per_split = triton.cdiv(triton.cdiv(capacity, want), block_n) * block_n
    return per_split, triton.cdiv(capacity, per_split)


def _heads_per_program(kv_heads: int, config: dict) -> int:
    """KV heads one program takes (``heads_per_program``: a power of two dividing them, else 1)."""
    n = int(config.get("heads_per_program", 1))
    return n if n >= 1 and n & (n - 1) == 0 and kv_heads % n == 0 else 1


def _sizing(capacity: int, programs: int, sms: int, dtype: torch.dtype, config: dict) -> tuple[int, int, int]:
    """(keys per loop step, most keys per split, number of splits) under ``config``."""
    block_n = config["block_n"] if dtype != torch.float32 else min(32, config["block_n"])
    return (block_n, *_split(capacity, programs, sms, block_n, config.get("per_sm", 4), config.get("min_tiles", 2)))


def plan(batch: int, kv_heads: int, capacity: int, sms: int, dtype: torch.dtype, config: dict) -> tuple:
    """``(config, KV heads per program, keys per step, most keys per split, splits)`` of a launch:
    ``config`` with its ``split_config`` applied when the context is split (few programs). When
    ``config`` would split only because it packs several KV heads per program, and the split
    configuration's one head per program leaves a single split, the launch keeps ``config`` with one
    head per program (H200, ragged batch 128 longest context first: 167.2 us vs 178.7 us with the
    split configuration run unsplit, .notes/gpu12/decode-attention-ragged.log)."""
    heads = _heads_per_program(kv_heads, config)
    block_n, per_split, splits = _sizing(capacity, batch * kv_heads // heads, sms, dtype, config)
    if splits > 1 and config.get("split_config"):
        split = {**config, **config["split_config"]}
        heads = _heads_per_program(kv_heads, split)
        block_n, per_split, splits = _sizing(capacity, batch * kv_heads // heads, sms, dtype, split)
        if splits > 1:
            config = split
        else:  # more programs, yet one split each: the unsplit settings with one KV head per program
            config = {**config, "heads_per_program": 1}
            heads = 1
            block_n, per_split, splits = _sizing(capacity, batch * kv_heads, sms, dtype, config)
    return config, heads, block_n, per_split, splits


def pdl_wanted(device: torch.device) -> bool:
    """Whether the attention-side decode kernels (``rope_and_cache``, the split kernel) launch with
    programmatic dependent launch on ``device``: where ``launch.pdl_allowed`` (a CUDA device where
    :func:`ninefold.ops.triton.gemv_pdl.pdl_available` holds; under a trimmed build, one holding PDL
    launches; while a build is recorded, as its recording says), unless ``NINEFOLD_GEMV_PDL=0`` (PDL
    off everywhere) or ``NINEFOLD_DECODE_PDL=0`` (off for these kernels only). Read at every call, so
    at CUDA-graph capture."""
    if os.environ.get("NINEFOLD_GEMV_PDL", "1") == "0" or os.environ.get("NINEFOLD_DECODE_PDL", "1") == "0":
        return False
    return launch_module.pdl_allowed(device)


def check_pdl(pdl, device: torch.device, op: str) -> bool:
    """``pdl`` as a bool, refusing ``True`` where PDL is not available on ``device``."""
    if not isinstance(pdl, bool):
        raise TypeError(f"{op}: pdl must be a bool or None, got {type(pdl).__name__}")
    if pdl and not (device.type == "cuda" and gemv_pdl.pdl_available(device)):
        raise ValueError(f"{op}: pdl=True needs a CUDA device of compute capability >= 9 and a Triton with "
                         f"launch_pdl/gdc_wait (not the interpreter); got device {device}")
    return pdl


_SPLIT_CONSTEXPRS = ("GROUP", "BLOCK_G", "D", "BLOCK_N", "PAGE", "PRECISION", "STATIC_ITERS", "MERGE", "G2", "BLOCK_S",
                     "HEADS", "USE_GDC", "EARLY_KV", "ROPE", "HALF", "IS_NEOX")
_SPLIT_PDL = Launcher(decode_split_kernel, _SPLIT_CONSTEXPRS)


def attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    return launch(q, k_cache, v_cache, block_tables, context_lens, scale, CONFIG)


def rope_cache_attention_decode(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                                context_lens, scale, is_neox):
    """``ops.rope_cache_attention_decode`` in one launch of the split kernel (see :func:`launch`'s ``rope``)."""
    return launch(q, k_cache, v_cache, block_tables, context_lens, scale, CONFIG,
                  rope=NewTokens(k, v, positions, cos_sin_cache, slot_mapping, is_neox))


def rope_cache_supports(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                        scale, is_neox) -> str | None:
    """What ``rope_and_cache``'s kernel and this one each refuse."""
    from ninefold.ops.triton import rope_cache  # (it imports this module)

    return (rope_cache.supports(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox)
            or supports(q, k_cache, v_cache, block_tables, context_lens, scale))


def early_kv_wanted() -> bool:
    """``NINEFOLD_DECODE_EARLY_KV=1``: PDL launches read the first key tile before ``gdc_wait`` (off by default).

    Sound only when the kernels of the step before attention wrote no key or value of a decoded
    sequence other than its newest token (position ``length - 1``, read after the wait): true in
    the engine's decode steps (``rope_and_cache`` writes the step's new tokens; prefill rows write
    their own blocks), not for a caller that rewrites older cache rows in the same step."""
    return os.environ.get("NINEFOLD_DECODE_EARLY_KV", "0") == "1"


class NewTokens(NamedTuple):
    """The step's token of every row, for a launch that ropes and caches it itself (``rope`` of :func:`launch`):
    its unrotated keys and values ``[B, Hk, D]``, position ``[B]``, the cos/sin cache, its cache slot ``[B]``
    (negative: not cached), the pairing of ``rope``."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    is_neox: bool


def launch(q, k_cache, v_cache, block_tables, context_lens, scale, config: dict, pdl=None, early_kv=None,
           rope: NewTokens | None = None):
    """``attention_decode`` under an explicit launch configuration (keys as in ``CONFIG``); ``pdl``:
    launch the split kernel with programmatic dependent launch (``None``: where :func:`pdl_wanted`);
    ``early_kv``: load the first key/value tile before waiting (``None``: with PDL where
    :func:`early_kv_wanted`; the same result either way). With ``rope``, ``q`` is unrotated: the
    kernel rotates it and the new tokens' keys, and the program holding a row's last position writes
    that token's key and value to its slot before reading the cache (the row's slot must address
    position ``context_lens[b] - 1`` of its own table)."""
    b, hq, d = q.shape
    _, page, hk, _ = k_cache.shape
    group = hq // hk
    scale = scale or 1.0 / math.sqrt(d)
    capacity = block_tables.shape[1] * page
    config, heads, block_n, per_split, splits = plan(b, hk, capacity, _sm_count(q.device), q.dtype, config)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    merge = _merges_in_place(config) if splits > 1 else 0  # one split: nothing to merge (the lighter kernel)
    min_split = triton.cdiv(config.get("min_split", 0), block_n) * block_n
    if splits > 1:
        scratch = torch.empty(b * hq * splits * (d + 1), dtype=torch.float32, device=q.device)  # one allocation
        part, lse = scratch[: b * hq * splits * d], scratch[b * hq * splits * d:]
        arrivals = counters(q.device, b * hk) if merge else _unused(q.device)
    else:  # the split kernel writes ``out`` itself
        part = lse = arrivals = _unused(q.device)
    pdl = pdl_wanted(q.device) if pdl is None else check_pdl(pdl, q.device, "attention_decode")
    if rope is None:  # (unused pointers and strides, of the types the kernel declares for them)
        new_k = new_v = q
        positions = slots = _unused(q.device, torch.int64)
        cos_sin = _unused(q.device)
        rope_strides = (0, 0, 0, 0, 0)
    else:
        new_k, new_v, positions, cos_sin, slots = rope.k, rope.v, rope.positions, rope.cos_sin_cache, rope.slot_mapping
        rope_strides = (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), cos_sin.stride(0))
    args = (q, k_cache, v_cache, block_tables, context_lens, part, lse, out, arrivals, new_k, new_v, positions, slots,
            cos_sin, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *rope_strides, splits, b, hk,
            int(config.get("heads_fastest", 0)), min_split)
    consts = dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group * heads)), D=d, BLOCK_N=block_n,
                  PAGE=page, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  STATIC_ITERS=triton.cdiv(max(per_split, min_split), block_n) if INTERPRETED else 0, MERGE=merge,
                  **_merge_tile(group * heads, config), HEADS=heads, USE_GDC=pdl,
                  EARLY_KV=bool(pdl and early_kv_wanted()) if early_kv is None else bool(early_kv),
                  ROPE=rope is not None, HALF=1 if rope is None else rope.cos_sin_cache.shape[1] // 2,
                  IS_NEOX=True if rope is None else bool(rope.is_neox))
    if pdl:
        _SPLIT_PDL((b * hk // heads, splits), args, tuple(consts[n] for n in _SPLIT_CONSTEXPRS),
                   num_warps=config["num_warps"], num_stages=config["num_stages"], device_index=q.get_device(),
                   launch_pdl=True)
    else:
        call(decode_split_kernel, (b * hk // heads, splits), *args, **consts, num_warps=config["num_warps"],
             num_stages=config["num_stages"])
    if splits > 1 and not merge:
        call(decode_merge_kernel, (b, hq), part, lse, out, splits, out.stride(0), out.stride(1), hq, D=d,
             BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
    return out
