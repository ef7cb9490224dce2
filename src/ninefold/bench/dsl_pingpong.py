"""Causal attention with two query halves per program: ``python -m ninefold.bench.dsl_pingpong`` (GPU).

FlashAttention-3 overlaps, inside one warpgroup, the tensor-core work of one query tile with the
softmax of another. Here a program owns two independent query sub-tiles ("halves", ``BM`` rows
each, adjacent in the sequence) and walks the key tiles once: each key and value tile is read once
for both halves (half the K/V traffic per query row of a one-tile program), and each iteration
issues ``q_a k^T`` and ``q_b k^T`` before either softmax, so the scheduler has two independent
``wgmma`` chains to overlap with the exponentials. Causal programs run three loops: key tiles both
halves see whole (no mask), the tiles of the first half's diagonal (masked for both), and the
second half's diagonal (second half only). Programs run longest first within each head.

Rows (causal B4 H32 S4096 D128 bf16): torch SDPA as dispatched; session 4's best DSL kernel (the
``pipelined`` application of ``ninefold.bench.dsl``, 64x64 w4 s3, TMA rows + hoist); the
hand-written two-half Triton kernel (``pair_attention``) at a few configurations; the same idea as
a ``ninefold.dsl`` kernel (``pair_arrangement`` cuts the query rows into programs of two
``BLOCK_M`` tiles, a middle level the application indexes as ``q[0]``/``q[1]``). Every row is
checked against attention in float64 first (``FAIL`` rows are not timed), then timed as
``ninefold.bench.dsl``'s sweeps are (``do_bench`` median, L2 flushed). Writes
``$OUT/dsl_pingpong.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
from tqdm import tqdm

import ninefold.dsl.language as nl
from ninefold.bench import dsl as bench
from ninefold.bench.results import write_json
from ninefold.ops.kernels import attention

DEVICE = "cuda"  # tests run the rows' code on cpu tensors under TRITON_INTERPRET=1

# ---------------------------------------------------------------------------------------- the DSL


def pair_arrangement(q, k, v, scale, is_causal, o, BLOCK_M=attention.BLOCK_M, BLOCK_N=attention.BLOCK_N):
    """Programs (B, H, Sq / (2 BLOCK_M), 1) in longest-first order, each owning two adjacent
    ``(BLOCK_M, D)`` query tiles (a middle level of 2: ``q[0]``, ``q[1]``); every program sees all
    ``(BLOCK_N, D)`` key and value tiles of its head."""

    def query_pairs(t):
        t = t.tile((1, 1, 2 * BLOCK_M, -1))
        t.dtype = t.dtype.tile((1, 1, BLOCK_M, -1))
        t.dtype = t.dtype.squeeze((0, 1, 3))  # the two halves
        t.dtype.dtype = t.dtype.dtype.squeeze((0, 1))  # (BLOCK_M, D)
        return t[:, :, ::-1]

    # the ops kernel's key and value tiles for programs of 2 BLOCK_M query rows
    _, keys, values, *_ = attention.arrangement(q, k, v, scale, is_causal, o, BLOCK_M=2 * BLOCK_M, BLOCK_N=BLOCK_N)
    return query_pairs(q), keys, values, scale, is_causal, query_pairs(o)


def pair_application(q, k, v, scale, is_causal, o):
    """Online softmax (base 2) for two query halves in one walk over the key tiles."""
    q_a = q[0]  # unscaled: the tiles stay in shared memory as read; the scores are scaled instead
    q_b = q[1]
    factor = scale * 1.4426950408889634  # log2(e): softmax in base 2
    shift = k.source.shape[-2] - q.source.shape[-2]
    max_a = nl.full((q_a.shape[0],), float("-inf"), dtype=nl.float32)
    sum_a = nl.zeros((q_a.shape[0],), dtype=nl.float32)
    acc_a = nl.zeros((q_a.shape[0], q_a.shape[1]), dtype=nl.float32)
    max_b = nl.full((q_b.shape[0],), float("-inf"), dtype=nl.float32)
    sum_b = nl.zeros((q_b.shape[0],), dtype=nl.float32)
    acc_b = nl.zeros((q_b.shape[0], q_b.shape[1]), dtype=nl.float32)
    n_a = k.shape[0]  # key tiles the first half sees (the second half sees them too)
    n_b = k.shape[0]  # key tiles the second half sees
    n_full = k.source.shape[-2] // k[0].shape[0]  # tiles both halves see whole: no mask
    if is_causal:
        n_a = nl.minimum(n_a, nl.cdiv(nl.max(q[0].offsets(-2)) + shift + 1, k[0].shape[0]))
        n_b = nl.minimum(n_b, nl.cdiv(nl.max(q[1].offsets(-2)) + shift + 1, k[0].shape[0]))
        n_full = nl.minimum(n_full, (nl.min(q[0].offsets(-2)) + shift + 1) // k[0].shape[0])
    for j in range(n_full):  # both scores first, then both softmaxes: two independent chains
        key = k[j]
        value = v[j]
        scores_a = nl.dot(q_a, nl.trans(key))
        scores_b = nl.dot(q_b, nl.trans(key))
        new_a = nl.maximum(max_a, nl.max(scores_a, 1) * factor)
        p_a = nl.exp2(scores_a * factor - new_a[:, None])
        alpha_a = nl.exp2(max_a - new_a)
        acc_a = acc_a * alpha_a[:, None] + nl.dot(p_a.to(q.dtype), value)
        sum_a = sum_a * alpha_a + nl.sum(p_a, 1)
        max_a = new_a
        new_b = nl.maximum(max_b, nl.max(scores_b, 1) * factor)
        p_b = nl.exp2(scores_b * factor - new_b[:, None])
        alpha_b = nl.exp2(max_b - new_b)
        acc_b = acc_b * alpha_b[:, None] + nl.dot(p_b.to(q.dtype), value)
        sum_b = sum_b * alpha_b + nl.sum(p_b, 1)
        max_b = new_b
    for j in range(n_full, n_a):  # the first half's diagonal (and the keys' last partial tile): masked
        key = k[j]
        value = v[j]
        scores_a = nl.dot(q_a, nl.trans(key))
        scores_b = nl.dot(q_b, nl.trans(key))
        keep_a = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        keep_b = keep_a
        if is_causal:
            keep_a = keep_a & (k[j].offsets(-2)[None, :] <= q[0].offsets(-2)[:, None] + shift)
            keep_b = keep_b & (k[j].offsets(-2)[None, :] <= q[1].offsets(-2)[:, None] + shift)
        scores_a = nl.where(keep_a, scores_a, float("-inf"))
        scores_b = nl.where(keep_b, scores_b, float("-inf"))
        new_a = nl.maximum(max_a, nl.max(scores_a, 1) * factor)
        p_a = nl.exp2(scores_a * factor - new_a[:, None])
        alpha_a = nl.exp2(max_a - new_a)
        acc_a = acc_a * alpha_a[:, None] + nl.dot(p_a.to(q.dtype), value)
        sum_a = sum_a * alpha_a + nl.sum(p_a, 1)
        max_a = new_a
        new_b = nl.maximum(max_b, nl.max(scores_b, 1) * factor)
        p_b = nl.exp2(scores_b * factor - new_b[:, None])
        alpha_b = nl.exp2(max_b - new_b)
        acc_b = acc_b * alpha_b[:, None] + nl.dot(p_b.to(q.dtype), value)
        sum_b = sum_b * alpha_b + nl.sum(p_b, 1)
        max_b = new_b
    for j in range(n_a, n_b):  # the second half's diagonal: the first half sees none of these keys
        scores_b = nl.dot(q_b, nl.trans(k[j]))
        keep_b = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep_b = keep_b & (k[j].offsets(-2)[None, :] <= q[1].offsets(-2)[:, None] + shift)
        scores_b = nl.where(keep_b, scores_b, float("-inf"))
        new_b = nl.maximum(max_b, nl.max(scores_b, 1) * factor)
        p_b = nl.exp2(scores_b * factor - new_b[:, None])
        alpha_b = nl.exp2(max_b - new_b)
        acc_b = acc_b * alpha_b[:, None] + nl.dot(p_b.to(q.dtype), v[j])
        sum_b = sum_b * alpha_b + nl.sum(p_b, 1)
        max_b = new_b
    o[0] = acc_a / sum_a[:, None]
    o[1] = acc_b / sum_b[:, None]


def pipelined_unscaled_application(q, k, v, scale, is_causal, o):
    """``ninefold.bench.dsl._attention_pipelined`` (the next key tile's scores before this tile's
    softmax, last tile peeled) with the scale applied to the scores instead of ``q``: the query tile
    stays in shared memory as read instead of taking registers (64 per thread at 64x128 bf16, 4 warps)."""
    q_tile = q
    factor = scale * 1.4426950408889634
    shift = k.source.shape[-2] - q.source.shape[-2]
    row_max = nl.full((q.shape[-2],), float("-inf"), dtype=nl.float32)
    row_sum = nl.zeros((q.shape[-2],), dtype=nl.float32)
    acc = nl.zeros((q.shape[-2], q.shape[-1]), dtype=nl.float32)
    n_tiles = k.shape[0]
    n_full = k.source.shape[-2] // k[0].shape[0]
    if is_causal:
        n_tiles = nl.minimum(n_tiles, nl.cdiv(nl.max(q.offsets(-2)) + shift + 1, k[0].shape[0]))
        n_full = nl.minimum(n_full, (nl.min(q.offsets(-2)) + shift + 1) // k[0].shape[0])
    n_full = nl.minimum(n_full, n_tiles - 1)  # the last tile always goes through the peeled, masked step
    scores = nl.dot(q_tile, nl.trans(k[0]))
    for j in range(n_full):
        following = nl.dot(q_tile, nl.trans(k[j + 1]))
        new_max = nl.maximum(row_max, nl.max(scores, 1) * factor)
        p = nl.exp2(scores * factor - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
        scores = following
    for j in range(n_full, n_tiles - 1):
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        following = nl.dot(q_tile, nl.trans(k[j + 1]))
        new_max = nl.maximum(row_max, nl.max(scores, 1) * factor)
        p = nl.exp2(scores * factor - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
        row_max = new_max
        scores = following
    for j in range(n_tiles - 1, n_tiles):  # the last tile
        keep = k[j].offsets(-2)[None, :] < k.source.shape[-2]
        if is_causal:
            keep = keep & (k[j].offsets(-2)[None, :] <= q.offsets(-2)[:, None] + shift)
        scores = nl.where(keep, scores, float("-inf"))
        new_max = nl.maximum(row_max, nl.max(scores, 1) * factor)
        p = nl.exp2(scores * factor - new_max[:, None])
        alpha = nl.exp2(row_max - new_max)
        acc = acc * alpha[:, None] + nl.dot(p.to(q.dtype), v[j])
        row_sum = row_sum * alpha + nl.sum(p, 1)
    o = acc / row_sum[:, None]  # noqa: F841


def pair_kernel(warps, stages, *flags):
    """The two-half DSL attention with fixed warps/stages and the lowering ``flags`` of
    ``ninefold.bench.dsl._fixed`` (``rows``, ``hoist``, ``row-major``)."""
    return bench._fixed(pair_arrangement, pair_application, attention.tensors(), warps, stages, *flags)


# ----------------------------------------------------------------------------- hand-written Triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is a dependency of every GPU run
    triton = None
else:

    @triton.jit
    def _pair_update(s, v, acc, m_i, l_i, factor):
        # scores scaled here (one FMA with the max), so q stays unscaled in shared memory as read
        m_new = tl.maximum(m_i, tl.max(s, 1) * factor)
        p = tl.math.exp2(s * factor - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return acc, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _pair_keep(rows, keys, seq, CAUSAL: tl.constexpr):
        keep = keys[None, :] < seq
        if CAUSAL:
            keep = keep & (keys[None, :] <= rows[:, None])
        return keep

    @triton.jit
    def _pair_attention(q_desc, k_desc, v_desc, o_ptr, seq, scale, BM: tl.constexpr, BN: tl.constexpr,
                        D: tl.constexpr, CAUSAL: tl.constexpr, EVEN: tl.constexpr, ISSUE_BOTH: tl.constexpr):
        # [B*H*S, D] descriptors (rows past a head's end belong to the next head or read zeros: masked
        # here by key and, at the store, by query row); BN divides BM; a program owns query rows
        # [r0, r0 + 2 BM) as halves a and b, pairs longest first. EVEN: S % (2 BM) == 0 and S % BN == 0.
        pair = tl.num_programs(0) - 1 - tl.program_id(0)
        first = tl.program_id(1) * seq
        r0 = pair * (2 * BM)
        rows_a = r0 + tl.arange(0, BM)
        rows_b = rows_a + BM
        factor = scale * 1.4426950408889634
        q_a = q_desc.load([first + r0, 0])
        q_b = q_desc.load([first + r0 + BM, 0])
        m_a = tl.full((BM,), float("-inf"), tl.float32)
        l_a = tl.zeros((BM,), tl.float32)
        acc_a = tl.zeros((BM, D), tl.float32)
        m_b = tl.full((BM,), float("-inf"), tl.float32)
        l_b = tl.zeros((BM,), tl.float32)
        acc_b = tl.zeros((BM, D), tl.float32)
        if CAUSAL:
            n_full = r0 // BN  # keys before the pair's first row: every row sees them
            end_a = tl.minimum(r0 + BM, seq)
            end_b = tl.minimum(r0 + 2 * BM, seq)
        else:
            n_full = seq // BN
            end_a = seq
            end_b = seq
        for j in range(0, n_full):
            k = k_desc.load([first + j * BN, 0])
            v = v_desc.load([first + j * BN, 0])
            if ISSUE_BOTH:  # both q k^T before either softmax
                s_a = tl.dot(q_a, tl.trans(k))
                s_b = tl.dot(q_b, tl.trans(k))
                acc_a, m_a, l_a = _pair_update(s_a, v, acc_a, m_a, l_a, factor)
                acc_b, m_b, l_b = _pair_update(s_b, v, acc_b, m_b, l_b, factor)
            else:
                acc_a, m_a, l_a = _pair_update(tl.dot(q_a, tl.trans(k)), v, acc_a, m_a, l_a, factor)
                acc_b, m_b, l_b = _pair_update(tl.dot(q_b, tl.trans(k)), v, acc_b, m_b, l_b, factor)
        for start in range(n_full * BN, end_a, BN):  # half a's diagonal (or the keys' partial tile)
            keys = start + tl.arange(0, BN)
            k = k_desc.load([first + start, 0])
            v = v_desc.load([first + start, 0])
            s_a = tl.dot(q_a, tl.trans(k))
            s_b = tl.dot(q_b, tl.trans(k))
            s_a = tl.where(_pair_keep(rows_a, keys, seq, CAUSAL), s_a, float("-inf"))
            s_b = tl.where(_pair_keep(rows_b, keys, seq, CAUSAL), s_b, float("-inf"))
            acc_a, m_a, l_a = _pair_update(s_a, v, acc_a, m_a, l_a, factor)
            acc_b, m_b, l_b = _pair_update(s_b, v, acc_b, m_b, l_b, factor)
        for start in range(end_a, end_b, BN):  # half b's diagonal: keys half a does not see
            keys = start + tl.arange(0, BN)
            k = k_desc.load([first + start, 0])
            v = v_desc.load([first + start, 0])
            s_b = tl.where(_pair_keep(rows_b, keys, seq, CAUSAL), tl.dot(q_b, tl.trans(k)), float("-inf"))
            acc_b, m_b, l_b = _pair_update(s_b, v, acc_b, m_b, l_b, factor)
        cols = tl.arange(0, D)[None, :]
        out_a = o_ptr + (first + rows_a).to(tl.int64)[:, None] * D + cols
        out_b = o_ptr + (first + rows_b).to(tl.int64)[:, None] * D + cols
        if EVEN:
            tl.store(out_a, (acc_a / l_a[:, None]).to(o_ptr.dtype.element_ty))
            tl.store(out_b, (acc_b / l_b[:, None]).to(o_ptr.dtype.element_ty))
        else:
            tl.store(out_a, (acc_a / l_a[:, None]).to(o_ptr.dtype.element_ty), mask=rows_a[:, None] < seq)
            tl.store(out_b, (acc_b / l_b[:, None]).to(o_ptr.dtype.element_ty), mask=rows_b[:, None] < seq)


def pair_attention(q, k, v, is_causal, bm, bn, warps, stages, issue_both=True, info=None):
    """Attention by the hand-written two-half kernel: ``[B, H, S, D]`` tensors of one shape
    (self-attention), ``bn`` dividing ``bm``, ``D`` a power of two >= 16. ``info``, a dict, receives
    what the compiler made of it (warps, registers, spills, shared memory)."""
    if q.shape != k.shape or k.shape != v.shape or q.dim() != 4:
        raise ValueError(f"q/k/v: expected three [B, H, S, D] tensors of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if bm % bn:
        raise ValueError(f"bn: must divide bm, got bm={bm}, bn={bn}")
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, s, d = q.shape
    q, k, v = (t.contiguous() for t in (q, k, v))
    o = torch.empty_like(q)
    descs = [TensorDescriptor(t.view(-1, d), [b * h * s, d], [d, 1], [bm if t is q else bn, d]) for t in (q, k, v)]
    even = s % (2 * bm) == 0 and s % bn == 0
    compiled = _pair_attention[(triton.cdiv(s, 2 * bm), b * h)](
        *descs, o, s, 1.0 / math.sqrt(d), BM=bm, BN=bn, D=d, CAUSAL=bool(is_causal), EVEN=even,
        ISSUE_BOTH=issue_both, num_warps=warps, num_stages=stages,
    )
    if info is not None and compiled is not None:
        info.update(bench._compiled_info(compiled))
    return o


# ------------------------------------------------------------------------------------------ rows

HAND_CONFIGS = (  # BM (rows per half), BN, warps, stages, flags ("serial": a's update before b's scores)
    (64, 64, 8, 2, ()),
    (64, 64, 8, 3, ()),
    (64, 64, 4, 2, ()),
    (64, 32, 4, 2, ()),
    (64, 32, 4, 3, ()),
    (128, 64, 8, 2, ()),
    (64, 64, 8, 2, ("serial",)),
    (64, 64, 4, 2, ("serial",)),
)
# Per-SM occupancy decides much here: sm_90 has 64K registers and ~227 KiB shared memory per SM;
# compiled for sm_90 (Triton 3.9, ptxas -v): pair 2x64x32 w4 254 registers (two programs per SM),
# 2x64x64 w8 ~230-245 (one); the q-unscaled pipelined 64x32 w4 s3 155 registers and 73 KiB (three
# programs per SM), 64x64 w4 s2 198 and 97 KiB (two), 64x64 w4 s3 206 and 129 KiB (one).
DSL_CONFIGS = (  # BLOCK_M (per half), BLOCK_N, warps, stages, lowering flags
    (64, 64, 8, 2, "rows", "hoist"),
    (64, 32, 4, 2, "rows", "hoist"),
    (64, 32, 4, 3, "rows", "hoist"),
    (64, 64, 4, 2, "rows", "hoist"),
    (64, 64, 8, 3, "rows", "hoist"),
    (128, 64, 8, 2, "rows", "hoist"),
    (64, 64, 8, 2, "rows", "hoist", "row-major"),
    (64, 32, 4, 2, "rows", "hoist", "row-major"),
    (64, 64, 8, 3),  # pointer loads
)
# --set stages (GPU run 2): run 1 showed pipeline depth and programs per SM deciding (pair 2x64x32 w4:
# s2 1.460, s3 1.154 ms; anything at one program per SM slow). Triton 3.6 for sm_90 (ptxas -v): session
# 4's pipelined application at 64x32 w4 168 registers, 57 KiB (s3) / 73 KiB (s4) shared: three programs
# per SM (the ops and loads-first applications: 151 registers, 48 / 64 KiB, also three); pair 2x64x32 w4 s4 / s5 229 registers, 97 / 113 KiB: two per SM (113 KiB: as session 4's best).
SINGLE_TILE = {"pipelined": bench._attention_pipelined, "ops": attention.application,
               "loads-first": bench._attention_loads_first}  # one query tile per program (bench.dsl's)
STAGES_SET = {
    "pipelined": tuple((name, 64, 32, 4, st, "rows", "hoist") for name in SINGLE_TILE for st in (3, 4)),
    "dsl": ((64, 64, 4, 2, "rows", "hoist"), (64, 32, 4, 4, "rows", "hoist"), (64, 32, 4, 5, "rows", "hoist")),
    "hand": ((64, 32, 4, 4, ()), (64, 32, 4, 5, ())),
    "unscaled": (),
}
UNSCALED_CONFIGS = (  # the single-tile pipelined application with q left unscaled: BM, BN, warps, stages, flags
    (64, 32, 4, 3, "rows", "hoist"),
    (64, 32, 4, 3, "rows", "hoist", "row-major"),
    (64, 32, 4, 4, "rows", "hoist"),
    (64, 64, 4, 2, "rows", "hoist"),
    (64, 32, 4, 2, "rows", "hoist"),
    (64, 64, 4, 3, "rows", "hoist"),
    (128, 64, 8, 3, "rows", "hoist"),
)


def attention_rows(b=4, h=32, s=4096, d=128, dtype=torch.bfloat16, causal=True, hand=None, dsl=None, unscaled=None,
                   baseline=True, deadline_s=None, pipelined=()):
    """Check then time every row at one shape, in this order: torch SDPA, session 4's best DSL
    kernel, the two-half DSL kernel, the q-unscaled pipelined DSL kernel, the hand-written
    two-half kernel. Rows not started ``deadline_s`` seconds after the first are listed as skipped.
    ``hand``/``dsl``/``unscaled`` default to ``HAND_CONFIGS``/``DSL_CONFIGS``/``UNSCALED_CONFIGS``;
    ``pipelined``: ``(application, BM, BN, warps, stages, *flags)`` rows of the one-tile applications
    (``SINGLE_TILE``) after the baseline.
    Returns ``ninefold.bench.dsl`` sweep rows."""
    hand = HAND_CONFIGS if hand is None else hand
    dsl = DSL_CONFIGS if dsl is None else dsl
    unscaled = UNSCALED_CONFIGS if unscaled is None else unscaled
    start = time.perf_counter()
    torch.manual_seed(0)
    q, k, v = (bench._randn((b, h, s, d), dtype, DEVICE) for _ in range(3))
    reference = bench._sdpa_float64(q, k, v, causal)
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = [bench._sweep_row("torch sdpa (as dispatched)", lambda: sdpa(q, k, v, is_causal=causal),
                             reference, dtype, flops, None)]
    torch_s = rows[0].get("seconds")
    ceiling = flops / torch_s if torch_s else None  # fractions are of torch SDPA's rate
    if ceiling:
        rows[0]["fraction_of_cublas"] = 1.0
    scale = 1.0 / math.sqrt(d)

    def dsl_call(kernel, bm, bn):
        o = torch.empty_like(q)

        def call():
            kernel(q, k, v, scale, causal, o, BLOCK_M=bm, BLOCK_N=bn)
            return o

        return call

    plans = []  # (label, make the call, compiler info dict or None)
    if baseline:
        plans.append(("dsl pipelined 64x64 w4 s3 rows hoist (session 4 best)", lambda: dsl_call(
            bench._fixed(attention.arrangement, bench._attention_pipelined, attention.tensors(), 4, 3, "rows", "hoist"),
            64, 64), None))
    for name, bm, bn, w, st, *flags in pipelined:
        plans.append((" ".join([f"dsl {name}", f"{bm}x{bn} w{w} s{st}", *flags]),
                      lambda name=name, bm=bm, bn=bn, w=w, st=st, flags=flags: dsl_call(bench._fixed(
                          attention.arrangement, SINGLE_TILE[name], attention.tensors(), w, st, *flags), bm, bn),
                      None))
    for bm, bn, w, st, *flags in dsl:
        plans.append((" ".join(["dsl pair", f"2x{bm}x{bn} w{w} s{st}", *flags]),
                      lambda bm=bm, bn=bn, w=w, st=st, flags=flags: dsl_call(pair_kernel(w, st, *flags), bm, bn), None))
    for bm, bn, w, st, *flags in unscaled:
        plans.append((" ".join(["dsl pipelined q-unscaled", f"{bm}x{bn} w{w} s{st}", *flags]),
                      lambda bm=bm, bn=bn, w=w, st=st, flags=flags: dsl_call(bench._fixed(
                          attention.arrangement, pipelined_unscaled_application, attention.tensors(), w, st, *flags), bm, bn),
                      None))
    for bm, bn, w, st, flags in hand:
        info = {}
        plans.append((" ".join(["triton pair", f"2x{bm}x{bn} w{w} s{st}", *flags]),
                      lambda bm=bm, bn=bn, w=w, st=st, flags=flags, info=info: lambda: pair_attention(
                          q, k, v, causal, bm, bn, w, st, issue_both="serial" not in flags, info=info), info))
    for label, make, info in tqdm(plans, desc="two query halves", file=sys.stderr):
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            rows.append({"config": label, "ok": False, "error": f"skipped: past the {deadline_s:.0f} s deadline"})
            continue
        rows.append(bench._sweep_row(label, make(), reference, dtype, flops, ceiling))
        if info:
            rows[-1]["compiled"] = info
            print(f"    compiled: {info}", flush=True)
    return rows


def table(rows) -> str:
    """The rows as printed: ms, TFLOP/s, fraction of torch (or why a row failed)."""
    lines = [f"  {'row':<56}{'ms':>9} {'TFLOP/s':>8} {'of torch':>9}"]
    for row in rows:
        if row.get("seconds"):
            share = f"{row['fraction_of_cublas'] * 100:8.1f}%" if "fraction_of_cublas" in row else "        -"
            lines.append(f"  {row['config']:<56}{row['seconds'] * 1e3:9.3f} {row['tflops']:8.1f} {share}")
        else:
            why = row.get("error") or f"FAIL rel_error {row.get('rel_error', float('nan')):.3g}"
            lines.append(f"  {row['config']:<56}{why}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.dsl_pingpong", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for dsl_pingpong.json (default $OUT)")
    parser.add_argument("--shape", default="4,32,4096,128", help="B,H,S,D of the causal bf16 attention (default 4,32,4096,128)")
    parser.add_argument("--set", choices=("all", "stages"), default="all",
                        help="rows: all (run 1) or stages (deeper pipelines at two programs per SM: run 2)")
    parser.add_argument("--deadline", type=float, default=200.0, help="seconds after which rows are skipped")
    args = parser.parse_args(argv)
    try:
        b, h, s, d = (int(n) for n in args.shape.split(","))
    except ValueError:
        parser.error(f"--shape: expected four integers B,H,S,D, got {args.shape!r}")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device")
    start = time.perf_counter()
    bench.PROGRESS_LINES = True
    with tempfile.TemporaryDirectory() as caches:  # own tuning cache, as the sweeps
        os.environ["NINEFOLD_CACHE_DIR"] = os.path.join(caches, "ninefold")
        dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter computes bf16 wrongly
        chosen = STAGES_SET if args.set == "stages" else {}
        rows = attention_rows(b, h, s, d, dtype, deadline_s=args.deadline, **chosen)
    title = f"sdpa causal B{b} H{h} S{s} D{d} {str(dtype)[6:]}: two query halves per program"
    print(title)
    print(table(rows))
    report = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "triton": bench._version("triton"),
        "wall_s": time.perf_counter() - start,
        "workload": title,
        "rows": rows,
    }
    if args.out:
        write_json("dsl_pingpong.json", report, args.out, default=str, announce=True)
    return report


if __name__ == "__main__":
    main()
