"""Triton paged decode attention with the batch's keys divided evenly among a fixed number of programs.

The split kernel (``ninefold.ops.triton.decode``) gives each (sequence, KV heads) its own programs, so
in a ragged batch the SMs that hold the longest contexts finish last: at 40-128 sequences of
500-2000 keys the launch reaches 75-91% of the copy bandwidth. Here every sequence's context is cut
into tiles of ``BLOCK_N`` keys, the items (sequence, group of ``HEADS`` KV heads) are laid end to end
(sequence-major), and program ``p`` of ``P`` takes tiles ``[p * T // P, (p + 1) * T // P)`` of the
``T`` in the batch. Every program reads the context lengths (a short vector; the grid is fixed, so
CUDA graphs replay it and nothing is read back on the host), finds where its range starts with a
prefix sum, and walks it item by item:

- an item wholly inside the range is attended and its output stored;
- an item cut by a range boundary gets a partial result (normalised accumulator and log-sum-exp)
  in the program's slot 0 (the item its range starts in) or slot 1 (the item it ends in); the
  programs that share the item bump its arrival counter (release, after a CTA barrier), and the
  one that arrives last (acquire) merges the partials of all of them and resets the counter to 0,
  as the split kernel's one-kernel merge does.

A sequence with no keys (a padded CUDA-graph row) owns one empty tile, so its output is written as zeros.
The arrival counters are ``ninefold.ops.triton.decode.counters`` (shared with the split kernel, both
leave them at 0), so launches on one device must be stream-ordered. With PDL (``USE_GDC``) the
program lets the next kernel launch at once and reads the lengths before ``gdc_wait`` (they are copied
from the host before the step, like the split kernel's); q, the cache and the counters only after it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.decode import (
    BALANCED_CONFIG,
    LOG2E,
    _decode_step,
    _heads_per_program,
    _sm_count,
    check_pdl,
    counters,
    pdl_wanted,
)
from ninefold.ops.triton.launch import Launcher, call

CONFIG = BALANCED_CONFIG  # defined beside the split kernel's, which chooses between the two


@triton.jit
def _owner(tile, total, programs):
    """The program whose range ``[p * total // programs, (p + 1) * total // programs)`` holds ``tile``."""
    return ((tile + 1) * programs + total - 1) // total - 1


@triton.jit
def _merge_partials(part_ptr, lse_ptr, out_ptr, out_base, stride_oh, first, last, item_lo, total, programs,
                    ROWS: tl.constexpr, BLOCK_G: tl.constexpr, G2: tl.constexpr, D: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Combine the partial results programs ``first .. last`` wrote for the item starting at tile
    ``item_lo`` (each in slot 0 when its range starts inside the item, else slot 1) by their
    log-sum-exp, and store the output's ``ROWS`` query heads. Partials written by other programs
    are read through L2 (``.cg``), never from a stale L1 line."""
    g = tl.arange(0, G2)[:, None, None]
    s = tl.arange(0, BLOCK_S)[None, :, None]
    e = tl.arange(0, D)[None, None, :]
    gm = g < ROWS
    m = tl.full([G2, 1, 1], float("-inf"), tl.float32)
    weight_sum = tl.zeros([G2, 1, 1], tl.float32)
    acc = tl.zeros([G2, 1, D], tl.float32)
    for p0 in range(first, last + 1, BLOCK_S):
        p = p0 + s
        live = gm & (p <= last)
        slot = tl.where(p * total // programs >= item_lo, 0, 1)
        rows = ((p * 2 + slot) * BLOCK_G + g)
        lse = tl.load(lse_ptr + rows, mask=live, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_ptr + rows * D + e, mask=live, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1, keep_dims=True))
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # padding rows (g >= ROWS) stay -inf
        alpha = tl.exp2(m - safe)
        w = tl.exp2(lse - safe)
        acc = acc * alpha + tl.sum(part * w, 1, keep_dims=True)
        weight_sum = weight_sum * alpha + tl.sum(w, 1, keep_dims=True)
        m = m_new
    out = acc / tl.where(weight_sum > 0, weight_sum, 1.0)
    tl.store(out_ptr + out_base + g * stride_oh + e, out.to(out_ptr.dtype.element_ty), mask=gm)


@triton.jit(do_not_specialize=["batch", "kv_heads", "stride_btb"])
def decode_balanced_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, part_ptr, lse_ptr, out_ptr, counters_ptr,
                           scale_log2e, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_co, stride_ch,
                           stride_btb, batch, kv_heads, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                           D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr,
                           HEADS: tl.constexpr, BLOCK_B: tl.constexpr, G2: tl.constexpr, BLOCK_S: tl.constexpr,
                           USE_GDC: tl.constexpr = False):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    groups = kv_heads // HEADS
    seq = tl.arange(0, BLOCK_B)
    lengths = tl.load(lens_ptr + seq, mask=seq < batch, other=0)
    tiles = tl.maximum(tl.cdiv(lengths, BLOCK_N), (seq < batch).to(tl.int32))  # no keys: one empty tile
    ends = tl.cumsum(tiles, 0).to(tl.int64) * groups  # where each sequence's items end, in tiles
    total = tl.sum(tiles, 0).to(tl.int64) * groups
    programs = tl.minimum(tl.num_programs(0).to(tl.int64), total)  # fewer tiles than programs: one tile each
    lo = pid * total // programs
    hi = tl.where(pid < programs, (pid + 1) * total // programs, lo)  # the spare programs do nothing
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP * HEADS
    e = tl.arange(0, D)
    if USE_GDC:  # q, the cache and the counters come after the kernels before
        tl.extra.cuda.gdc_wait()
    pos = lo
    while pos < hi:
        b = tl.sum((ends <= pos).to(tl.int32), 0)
        this = seq == b
        item_tiles = tl.sum(tl.where(this, tiles, 0), 0).to(tl.int64)
        length = tl.sum(tl.where(this, lengths, 0), 0)
        base = tl.sum(tl.where(this, ends, 0), 0) - item_tiles * groups
        kv_group = (pos - base) // item_tiles
        item_lo = base + kv_group * item_tiles
        item_hi = item_lo + item_tiles
        seg_hi = tl.minimum(hi, item_hi)
        kvh = kv_group * HEADS
        start = ((pos - item_lo) * BLOCK_N).to(tl.int32)
        end = tl.minimum(((seg_hi - item_lo) * BLOCK_N).to(tl.int32), length)
        b64 = b.to(tl.int64)
        q = tl.load(q_ptr + b64 * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + e[None, :],
                    mask=gm[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        first = start + tl.arange(0, BLOCK_N * HEADS) // HEADS
        page = tl.load(bt_ptr + b64 * stride_btb + first // PAGE, mask=first < end, other=0)
        for n0 in range(start, end, BLOCK_N):  # every tile holds at least one key: finite maxima
            m_i, l_i, acc, page = _decode_step(q, n0, end, page, b64, kvh, kc_ptr, vc_ptr, bt_ptr, stride_cb,
                                               stride_co, stride_ch, stride_btb, scale_log2e, m_i, l_i, acc, GROUP,
                                               BLOCK_G, D, BLOCK_N, PAGE, PRECISION, HEADS)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        out_base = b64 * stride_ob + kvh * GROUP * stride_oh
        if (pos == item_lo) & (seg_hi == item_hi):  # the whole item: its output (zeros for no keys)
            tl.store(out_ptr + out_base + g[:, None] * stride_oh + e[None, :],
                     (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None])
        else:
            slot = tl.where(lo >= item_lo, 0, 1)
            row = (pid * 2 + slot) * BLOCK_G + g
            tl.store(part_ptr + row[:, None] * D + e[None, :], acc / safe_l[:, None], mask=gm[:, None])
            tl.store(lse_ptr + row, m_i + tl.log2(safe_l), mask=gm)
            tl.debug_barrier()  # every thread's stores precede the release below
            first_owner = _owner(item_lo, total, programs)
            last_owner = _owner(item_hi - 1, total, programs)
            counter = counters_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + b64 * groups + kv_group
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == last_owner - first_owner:  # the last of the item's programs to finish
                tl.debug_barrier()
                tl.store(counter, 0)  # ready for the next launch (a CUDA-graph replay) without a memset
                _merge_partials(part_ptr, lse_ptr, out_ptr, out_base, stride_oh, first_owner, last_owner, item_lo,
                                total, programs, GROUP * HEADS, BLOCK_G, G2, D, BLOCK_S)
        pos = seg_hi


_CONSTEXPRS = ("GROUP", "BLOCK_G", "D", "BLOCK_N", "PAGE", "PRECISION", "HEADS", "BLOCK_B", "G2", "BLOCK_S", "USE_GDC")
_PDL = Launcher(decode_balanced_kernel, _CONSTEXPRS)


def programs(device: torch.device, config: dict) -> int:
    """The launch's number of programs: ``per_sm`` per SM."""
    return max(1, int(config.get("per_sm", 4)) * _sm_count(device))


def _merge_tile(rows: int, config: dict) -> dict:
    g2 = triton.next_power_of_2(rows)
    return {"G2": g2, "BLOCK_S": max(1, config.get("merge_rows", 64) // g2)}


def aot_variants(dtype: torch.dtype, shapes, batches) -> list[dict]:
    """The kernels :func:`launch` runs at ``shapes`` for each batch size in ``batches`` under ``CONFIG``
    (BLOCK_B follows the batch), for ``ninefold.ops.triton.aot``."""
    group = shapes.heads // shapes.kv_heads
    heads = _heads_per_program(shapes.kv_heads, CONFIG)
    found = []
    for batch in batches:
        variant = {"kernel": decode_balanced_kernel, "num_warps": CONFIG["num_warps"],
                   "num_stages": CONFIG["num_stages"],
                   "constexprs": {**_constexprs(group, heads, shapes.head_dim, shapes.block_size, dtype, batch, CONFIG),
                                  "USE_GDC": False}}
        if variant not in found:
            found.append(variant)
    return found


def _constexprs(group: int, heads: int, d: int, page: int, dtype: torch.dtype, batch: int, config: dict) -> dict:
    block_n = config["block_n"] if dtype != torch.float32 else min(32, config["block_n"])
    return dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group * heads)), D=d, BLOCK_N=block_n, PAGE=page,
                PRECISION="ieee" if dtype == torch.float32 else "tf32", HEADS=heads,
                BLOCK_B=max(16, triton.next_power_of_2(batch)), **_merge_tile(group * heads, config))


def launch(q, k_cache, v_cache, block_tables, context_lens, scale, config: dict | None = None, pdl=None):
    """Decode attention (``attention_decode``'s arguments) with the batch's key tiles divided evenly
    among ``per_sm`` programs per SM; ``config`` as :data:`CONFIG`; ``pdl`` as in
    :func:`ninefold.ops.triton.decode.launch`."""
    config = CONFIG if config is None else config
    b, hq, d = q.shape
    _, page, hk, _ = k_cache.shape
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    heads = _heads_per_program(hk, config)
    consts = _constexprs(hq // hk, heads, d, page, q.dtype, b, config)
    n_programs = programs(q.device, config)
    rows = n_programs * 2 * consts["BLOCK_G"]
    scratch = torch.empty(rows * (d + 1), dtype=torch.float32, device=q.device)  # partials, then log-sum-exps
    part, lse = scratch[: rows * d], scratch[rows * d:]
    arrivals = counters(q.device, b * hk // heads)
    pdl = pdl_wanted(q.device) if pdl is None else check_pdl(pdl, q.device, "attention_decode")
    scale = scale or 1.0 / math.sqrt(d)
    args = (q, k_cache, v_cache, block_tables, context_lens, part, lse, out, arrivals, scale * LOG2E, q.stride(0),
            q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), b, hk)
    consts["USE_GDC"] = pdl
    if pdl:  # a direct launch (builds hold no PDL binaries)
        _PDL((n_programs,), args, tuple(consts[n] for n in _CONSTEXPRS), num_warps=config["num_warps"],
             num_stages=config["num_stages"], device_index=q.get_device(), launch_pdl=True)
    else:
        call(decode_balanced_kernel, (n_programs,), *args, **consts, num_warps=config["num_warps"],
             num_stages=config["num_stages"])
    return out
