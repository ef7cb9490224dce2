"""Triton ``sample``: one token per row of ``[B, V]`` logits under temperature, top-p and min-p, without sorting.

torch's route (``ninefold.ops.sampling``) sorts every row for top-p and writes several float32 copies of the
logits, noise included: at 256 rows of a 128k vocabulary that took 5.0 ms of an H100 for top-p (``python -m
ninefold.bench.sampling``), half a decode step. Here the kernels read the row a few times and keep nothing but
scalars (``x`` = logits / temperature):

1. with top-p or min-p, the row's maximum ``m`` and ``Z = sum(exp(x - m))``;
2. a draw from the tokens still allowed (min-p: ``x >= m + log(min_p)``; above the pivot, below) by the
   exponential race: the largest ``x - log(E)``, ``E = -log(1 - u) ~ Exp(1)`` with ``u`` from Philox
   (``tl.rand4x``: one call gives the uniforms of four columns) keyed by the row's seed, the round and the
   column, so a draw depends on nothing but them;
3. with top-p, the mass of the tokens above the drawn one, ``sum(exp(x - m)) / Z`` over ``x > x_j``: below
   ``p``, the token is in the smallest most-likely set reaching ``p`` (the nucleus) and is kept. Otherwise every
   token up to ``x_j`` is outside it too, so ``x_j`` becomes the pivot and step 2 draws again from the tokens
   above it: rejection sampling, whose accepted draw follows the nucleus's distribution exactly (FlashInfer's
   sampling kernels work this way). A draw from the full distribution lands in the nucleus with probability
   about ``p``, so most rows take one round; after ``MAX_ROUNDS`` the largest token is taken.

Steps 1, 2 (first round) and 3 (first round) run one program per (row, chunk of ``BLOCK`` columns), each writing
its chunk's partial result; a last kernel combines a row's chunks, and runs any further rounds over the whole row
in one program. One row so spreads over the card (a single program per row took 150 us of an H100 for one row of
128k; H100 figures in ``docs/perf/ops.md``). The chunks are the same for every batch, so a row's token does not
depend on the rows beside it.

Rows with temperature 0 take the first largest logit (as ``torch.argmax``). With top-k, the k-th largest logit
of each row comes first, by radix select over order-preserving keys of the logits (four rounds of 4-bit digit
counts for bfloat16, five for float16, eight for float32, each counted by chunk and picked per row); the filter
keeps every token at or above it. Ties with the k-th largest and at the nucleus's edge are kept whole, as on
torch's route.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninefold.ops.triton.launch import Launcher

# columns per loop step (Triton's interpreter pays for every lane of a block, also past a short row's end)
BLOCK = 256 if os.environ.get("TRITON_INTERPRET") == "1" else 4096
MAX_ROUNDS = 32
MAX_COLUMNS = 1 << 24  # Philox offsets (round * V + column) stay within int32
# uniforms kept inside (0, 1), so E = -log(u) is finite and positive (tl.rand can round to 1.0)
U_MIN = tl.constexpr(2.0**-32)
U_MAX = tl.constexpr(1.0 - 2.0**-24)


@triton.jit
def _row_values(base, c, n, inv_t, kth):
    """The scaled logits of columns ``c``; -inf past the row's end and below the top-k threshold ``kth``."""
    raw = tl.load(base + c, mask=c < n, other=float("-inf")).to(tl.float32)
    return tl.where(raw >= kth, raw * inv_t, float("-inf"))


@triton.jit
def _kth(kth_ptr, row, HAS_TOP_K: tl.constexpr):
    kth = float("-inf")
    if HAS_TOP_K:
        kth = tl.load(kth_ptr + row)
    return kth


@triton.jit
def _race_quarter(base, c, n, u, inv_t, kth, noise, pivot, lowest, best, best_x, where):
    x = _row_values(base, c, n, inv_t, kth)
    u = tl.minimum(tl.maximum(u, U_MIN), U_MAX)
    # E = -log(1 - u), so that a small E, which lets an unlikely token win, keeps the resolution of u near 0
    # (2^-32); -log(u) steps by 2^-24 there, and tokens below about 1e-6 of the mass were drawn up to 20% too
    # rarely. log1p by Kahan's correction (exact where 1 - u rounds to 1), which the interpreter also runs.
    w = 1.0 - u
    e = tl.where(w == 1.0, u, -tl.log(w) * (u / (1.0 - w)))
    score = tl.where((c < n) & (x > pivot) & (x >= lowest), x - noise * tl.log(e), float("-inf"))
    better = score > best
    return tl.where(better, score, best), tl.where(better, x, best_x), tl.where(better, c, where)


@triton.jit
def _race_block(base, start, n, seed, offset, inv_t, kth, noise, pivot, lowest, best, best_x, where,
                QUARTER: tl.constexpr):
    """The exponential race over columns ``start .. start + 4 * QUARTER``, folded into the lanes' best scores.

    One Philox call gives four uniforms, one for each quarter of the block (lane ``g`` of quarter ``j`` is
    column ``start + j * QUARTER + g``), so a lane meets its columns in increasing order and a strict ``>``
    keeps the first of equal scores."""
    g = tl.arange(0, QUARTER)
    u0, u1, u2, u3 = tl.rand4x(seed, offset + start // 4 + g)
    c = start + g
    best, best_x, where = _race_quarter(base, c, n, u0, inv_t, kth, noise, pivot, lowest, best, best_x, where)
    best, best_x, where = _race_quarter(base, c + QUARTER, n, u1, inv_t, kth, noise, pivot, lowest, best, best_x,
                                        where)
    best, best_x, where = _race_quarter(base, c + 2 * QUARTER, n, u2, inv_t, kth, noise, pivot, lowest, best,
                                        best_x, where)
    best, best_x, where = _race_quarter(base, c + 3 * QUARTER, n, u3, inv_t, kth, noise, pivot, lowest, best,
                                        best_x, where)
    return best, best_x, where


@triton.jit
def _inverse_temperature(temp_ptr, row):
    """1 / temperature; 1 for greedy rows (temperature 0), whose logits are compared as they are. A temperature
    below 1e-30 counts as 1e-30: its inverse stays finite (logits times it too), and the draw is greedy anyway."""
    t = tl.load(temp_ptr + row)
    return 1.0 / tl.where(t <= 0, 1.0, tl.maximum(t, 1e-30))


@triton.jit
def _race_result(best, best_x, where, n):
    """From the lanes' best scores: the best score, the first column reaching it, and its scaled logit."""
    top = tl.max(best, 0)
    chosen = tl.min(tl.where(best == top, where, n), 0)
    return top, chosen, tl.max(tl.where(where == chosen, best_x, float("-inf")), 0)


@triton.jit
def _row_setup(row, temp_ptr, seed_ptr):
    greedy = tl.load(temp_ptr + row) <= 0
    noise = tl.where(greedy, 0.0, 1.0)  # greedy rows: the race without noise is the argmax
    return greedy, _inverse_temperature(temp_ptr, row), noise, tl.load(seed_ptr + row)


@triton.jit
def _partials_max(part_ptr, which, rows, row, parts, PART_BLOCK: tl.constexpr):
    """The largest of the row's chunk partials number ``which`` (0: chunk maxima, 2: race scores)."""
    k = tl.arange(0, PART_BLOCK)
    m = tl.full([PART_BLOCK], float("-inf"), tl.float32)
    for s0 in range(0, parts, PART_BLOCK):
        m = tl.maximum(m, tl.load(part_ptr + (which * rows + row) * parts + s0 + k, mask=s0 + k < parts,
                                  other=float("-inf")))
    return tl.max(m, 0)


@triton.jit
def _row_max(part_ptr, rows, row, parts, PART_BLOCK: tl.constexpr):
    return _partials_max(part_ptr, 0, rows, row, parts, PART_BLOCK)


@triton.jit
def _lowest(min_p_ptr, row, m, HAS_MIN_P: tl.constexpr):
    lowest = float("-inf")
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
        lowest = tl.where(min_p > 0, m + tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))
    return lowest


@triton.jit
def _race_winner(part_ptr, rows, row, parts, PART_BLOCK: tl.constexpr):
    """The first column with the best score among the chunks' winners, and its scaled logit."""
    k = tl.arange(0, PART_BLOCK)
    best = _partials_max(part_ptr, 2, rows, row, parts, PART_BLOCK)
    first = tl.full([PART_BLOCK], parts, tl.int32)
    for s0 in range(0, parts, PART_BLOCK):
        score = tl.load(part_ptr + (2 * rows + row) * parts + s0 + k, mask=s0 + k < parts, other=float("-inf"))
        first = tl.minimum(first, tl.where(score == best, s0 + k, parts))
    chunk = tl.min(first, 0)
    x = tl.load(part_ptr + (3 * rows + row) * parts + chunk)
    chosen = tl.load(part_ptr + (4 * rows + row) * parts + chunk).to(tl.int32)  # < 2**24: exact in float32
    return chosen, x


@triton.jit
def sample_stats_kernel(logits_ptr, stride, n, temp_ptr, kth_ptr, part_ptr, HAS_TOP_K: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Per (row, chunk of BLOCK columns): the chunk's largest scaled logit and sum(exp(x - that))."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = tl.num_programs(0)
    parts = tl.num_programs(1)
    inv_t = _inverse_temperature(temp_ptr, row)
    x = _row_values(logits_ptr + row.to(tl.int64) * stride, chunk * BLOCK + tl.arange(0, BLOCK), n, inv_t,
                    _kth(kth_ptr, row, HAS_TOP_K))
    m = tl.max(x, 0)
    z = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)
    tl.store(part_ptr + (0 * rows + row) * parts + chunk, m)
    tl.store(part_ptr + (1 * rows + row) * parts + chunk, z)


@triton.jit
def sample_race_kernel(logits_ptr, stride, n, temp_ptr, min_p_ptr, kth_ptr, seed_ptr, part_ptr,
                       HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                       PART_BLOCK: tl.constexpr):
    """Per (row, chunk): the first round's race winner inside the chunk (score, scaled logit, column)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = tl.num_programs(0)
    parts = tl.num_programs(1)
    greedy, inv_t, noise, seed = _row_setup(row, temp_ptr, seed_ptr)
    m = float("-inf")
    if HAS_MIN_P:
        m = _row_max(part_ptr, rows, row, parts, PART_BLOCK)
    lowest = _lowest(min_p_ptr, row, m, HAS_MIN_P)
    QUARTER: tl.constexpr = BLOCK // 4
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_x = tl.full([QUARTER], float("-inf"), tl.float32)
    where = tl.full([QUARTER], 0, tl.int32)
    best, best_x, where = _race_block(logits_ptr + row.to(tl.int64) * stride, chunk * BLOCK, n, seed, 0, inv_t,
                                      _kth(kth_ptr, row, HAS_TOP_K), noise, float("-inf"), lowest, best, best_x,
                                      where, QUARTER)
    top, chosen, x_chosen = _race_result(best, best_x, where, n)
    tl.store(part_ptr + (2 * rows + row) * parts + chunk, top)
    tl.store(part_ptr + (3 * rows + row) * parts + chunk, x_chosen)
    tl.store(part_ptr + (4 * rows + row) * parts + chunk, chosen.to(tl.float32))


@triton.jit
def sample_mass_kernel(logits_ptr, stride, n, temp_ptr, kth_ptr, part_ptr, HAS_TOP_K: tl.constexpr,
                       BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr):
    """Per (row, chunk): sum(exp(x - m)) over the chunk's tokens above the first round's winner."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = tl.num_programs(0)
    parts = tl.num_programs(1)
    inv_t = _inverse_temperature(temp_ptr, row)
    m = _row_max(part_ptr, rows, row, parts, PART_BLOCK)
    chosen, x_chosen = _race_winner(part_ptr, rows, row, parts, PART_BLOCK)
    x = _row_values(logits_ptr + row.to(tl.int64) * stride, chunk * BLOCK + tl.arange(0, BLOCK), n, inv_t,
                    _kth(kth_ptr, row, HAS_TOP_K))
    tl.store(part_ptr + (5 * rows + row) * parts + chunk, tl.sum(tl.where(x > x_chosen, tl.exp(x - m), 0.0), 0))


@triton.jit
def sample_finish_kernel(logits_ptr, stride, n, temp_ptr, top_p_ptr, min_p_ptr, kth_ptr, seed_ptr, part_ptr,
                         token_ptr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr,
                         BLOCK: tl.constexpr, PART_BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    """Per row: the first round's winner from the chunks; with top-p, its acceptance and, when refused, the
    further rounds above the pivot over the whole row (one program: most rows take one round)."""
    row = tl.program_id(0)
    rows = tl.num_programs(0)
    parts = tl.cdiv(n, BLOCK)
    greedy, inv_t, noise, seed = _row_setup(row, temp_ptr, seed_ptr)
    chosen, x_chosen = _race_winner(part_ptr, rows, row, parts, PART_BLOCK)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        accepted = (greedy | (top_p >= 1)).to(tl.int32)
        if accepted == 0:
            k = tl.arange(0, PART_BLOCK)
            m = _row_max(part_ptr, rows, row, parts, PART_BLOCK)
            lowest = _lowest(min_p_ptr, row, m, HAS_MIN_P)
            z_lanes = tl.zeros([PART_BLOCK], tl.float32)
            above_lanes = tl.zeros([PART_BLOCK], tl.float32)
            for s0 in range(0, parts, PART_BLOCK):
                inside = s0 + k < parts
                pm = tl.load(part_ptr + (0 * rows + row) * parts + s0 + k, mask=inside, other=float("-inf"))
                pz = tl.load(part_ptr + (1 * rows + row) * parts + s0 + k, mask=inside, other=0.0)
                z_lanes += tl.where(pm == float("-inf"), 0.0, pz * tl.exp(pm - m))
                above_lanes += tl.load(part_ptr + (5 * rows + row) * parts + s0 + k, mask=inside, other=0.0)
            z = tl.sum(z_lanes, 0)
            accepted = (tl.sum(above_lanes, 0) < top_p * z).to(tl.int32)
            base = logits_ptr + row.to(tl.int64) * stride
            kth = _kth(kth_ptr, row, HAS_TOP_K)
            QUARTER: tl.constexpr = BLOCK // 4
            groups = parts * QUARTER  # Philox groups of four columns per round
            pivot = x_chosen  # tokens with x <= pivot are known to lie outside the nucleus
            rounds = 1
            cols = tl.arange(0, BLOCK)
            while accepted == 0 and rounds < MAX_ROUNDS:
                best = tl.full([QUARTER], float("-inf"), tl.float32)
                best_x = tl.full([QUARTER], float("-inf"), tl.float32)
                where = tl.full([QUARTER], 0, tl.int32)
                for start in range(0, n, BLOCK):
                    best, best_x, where = _race_block(base, start, n, seed, rounds * groups, inv_t, kth, noise,
                                                      pivot, lowest, best, best_x, where, QUARTER)
                top, chosen, x_chosen = _race_result(best, best_x, where, n)
                rounds += 1
                above = tl.zeros([BLOCK], tl.float32)
                for start in range(0, n, BLOCK):
                    x = _row_values(base, start + cols, n, inv_t, kth)
                    above += tl.where(x > x_chosen, tl.exp(x - m), 0.0)
                accepted = (tl.sum(above, 0) < top_p * z).to(tl.int32)
                pivot = x_chosen
            if accepted == 0:  # MAX_ROUNDS rejections (not seen in practice): the largest token, always inside
                first = tl.full([BLOCK], n, tl.int32)
                for start in range(0, n, BLOCK):
                    c = start + cols
                    first = tl.minimum(first, tl.where(_row_values(base, c, n, inv_t, kth) == m, c, n))
                chosen = tl.min(first, 0)
    tl.store(token_ptr + row, chosen.to(tl.int64))


@triton.jit
def _order_key(raw):
    """float32 -> uint32 whose unsigned order is the floats' order (sign bit set for positives, negatives flipped)."""
    bits = raw.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, ~bits, bits ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def sample_topk_hist_kernel(logits_ptr, stride, n, top_k_ptr, state_ptr, hist_ptr, SHIFT: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Per (row, chunk), for rows with a top-k filter: how many of the chunk's logits whose order key starts with
    the row's prefix so far have each value of the key's next ``DIGIT_BITS`` bits (from bit ``SHIFT`` up)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    parts = tl.num_programs(1)
    k = tl.load(top_k_ptr + row)
    if (k > 0) & (k < n):
        c = chunk * BLOCK + tl.arange(0, BLOCK)
        key = _order_key(tl.load(logits_ptr + row.to(tl.int64) * stride + c, mask=c < n, other=0.0).to(tl.float32))
        ok = c < n
        if SHIFT + DIGIT_BITS < 32:
            ok = ok & ((key >> (SHIFT + DIGIT_BITS)) == tl.load(state_ptr + row).to(tl.uint32, bitcast=True))
        bins = tl.arange(0, BINS)
        digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
        # (counted in bin 0 and taken off again: the lanes outside the prefix or the row)
        hist = tl.histogram(tl.where(ok, digit, 0), BINS)
        hist -= tl.where(bins == 0, tl.sum(tl.where(ok, 0, 1), 0), 0)
        tl.store(hist_ptr + (row * parts + chunk).to(tl.int64) * BINS + bins, hist)


@triton.jit
def sample_topk_select_kernel(n, parts, top_k_ptr, state_ptr, hist_ptr, kth_ptr, SHIFT: tl.constexpr):
    """Per row: the next digit of the k-th largest logit's order key, from the chunks' counts (radix select,
    most significant digit first); after the last digit, the k-th largest logit itself (``kth``; -inf for rows
    without top-k). ``state``: the key's prefix so far and how many tokens of that prefix are still to pass."""
    row = tl.program_id(0)
    rows = tl.num_programs(0)
    k = tl.load(top_k_ptr + row)
    if (k > 0) & (k < n):
        r = tl.arange(0, BINS)
        counts = tl.zeros([BINS], tl.int32)  # counts[i]: of key digit BINS - 1 - i
        for s in range(parts):
            counts += tl.load(hist_ptr + (row * parts + s).to(tl.int64) * BINS + BINS - 1 - r)
        prefix = tl.full([], 0, tl.uint32)
        remaining = k
        if SHIFT + DIGIT_BITS < 32:
            prefix = tl.load(state_ptr + row).to(tl.uint32, bitcast=True)
            remaining = tl.load(state_ptr + rows + row)
        at_least = tl.cumsum(counts, 0)  # tokens whose digit is at least BINS - 1 - i
        i = tl.min(tl.where(at_least >= remaining, r, BINS), 0)
        remaining -= tl.sum(tl.where(r < i, counts, 0), 0)
        prefix = (prefix << DIGIT_BITS) | (-i + (BINS - 1)).to(tl.uint32)
        tl.store(state_ptr + row, prefix.to(tl.int32, bitcast=True))
        tl.store(state_ptr + rows + row, remaining)
        if SHIFT == 0:
            key = prefix.to(tl.int32, bitcast=True)
            bits = tl.where(key < 0, key ^ -2147483648, ~key)
        else:
            key = (prefix << SHIFT).to(tl.int32, bitcast=True)
            # (a negative float's key was flipped whole: the bits below SHIFT, zero in the logit, must come back
            # zero, or -inf's key turns into a NaN; review finding)
            bits = tl.where(key < 0, key ^ -2147483648, ~key & -(1 << SHIFT))
        tl.store(kth_ptr + row, bits.to(tl.float32, bitcast=True))
    else:
        tl.store(kth_ptr + row, float("-inf"))


# Radix select by 4-bit digits (four passes for bfloat16). On an H100, 8-bit digits in two passes cost the same
# over 256 rows of 128k (the passes took ~250 us either way: tl.histogram's atomic adds serialise where digits
# crowd into a few bins, as the keys' upper digits and the lanes outside the prefix do) and 11 us less at one row.
DIGIT_BITS = tl.constexpr(4)
BINS = tl.constexpr(16)
# the order key's digits that can differ between logits of each dtype (bfloat16: the float32 key's upper 16 bits)
KEY_SHIFTS = {torch.bfloat16: (28, 24, 20, 16), torch.float16: (28, 24, 20, 16, 12),
              torch.float32: (28, 24, 20, 16, 12, 8, 4, 0)}


def supports(logits, temperature, top_k=None, top_p=None, min_p=None, generators=None) -> str | None:
    """Why these kernels cannot run the call (None when they can)."""
    if logits.dtype not in KEY_SHIFTS:
        return f"logits of dtype {logits.dtype} (float32, float16 and bfloat16 are)"
    if logits.stride(1) != 1:
        return "the vocabulary dimension is not contiguous"
    if logits.shape[1] >= MAX_COLUMNS:
        return f"vocabularies of {MAX_COLUMNS} tokens or more"
    return None


def _row_seeds(b: int, device: torch.device, generators) -> torch.Tensor:
    """A Philox seed per row: from the row's generator where one is given, else from torch's default one.

    A CUDA generator's state is its seed and Philox offset, both on the host: the row's seed mixes the two and
    the offset moves on (as a draw would move it), so seeded rows cost no launch each; CPU generators (the
    interpreter's) draw theirs."""
    seeds = torch.randint(0, 2**62, (b,), dtype=torch.int64, device=device)
    if generators is None:
        return seeds
    rows, values = [], []
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device.type != "cuda":
            seeds[i : i + 1].random_(0, 2**62, generator=g)
            continue
        offset = g.get_offset()
        g.set_offset(offset + 4)
        rows.append(i)
        values.append((g.initial_seed() * 0x9E3779B97F4A7C15 + offset) % 2**62)
    if rows:
        host = torch.tensor([rows, values], dtype=torch.int64).to(device, non_blocking=True)
        seeds.index_copy_(0, host[0], host[1])
    return seeds


PART_BLOCK = 64  # chunk partials read per step by the kernels that combine them
_HIST = Launcher(sample_topk_hist_kernel, ("SHIFT", "BLOCK"))
_SELECT = Launcher(sample_topk_select_kernel, ("SHIFT",))
_STATS = Launcher(sample_stats_kernel, ("HAS_TOP_K", "BLOCK"))
_RACE = Launcher(sample_race_kernel, ("HAS_MIN_P", "HAS_TOP_K", "BLOCK", "PART_BLOCK"))
_MASS = Launcher(sample_mass_kernel, ("HAS_TOP_K", "BLOCK", "PART_BLOCK"))
_FINISH = Launcher(sample_finish_kernel, ("HAS_TOP_P", "HAS_MIN_P", "HAS_TOP_K", "BLOCK", "PART_BLOCK", "MAX_ROUNDS"))
NUM_WARPS = 8


def sample(logits, temperature, top_k=None, top_p=None, min_p=None, generators=None) -> torch.Tensor:
    """``ops.sample`` on CUDA: int64 ``[B]``.

    With top-k, first the k-th largest logit of each row, by radix select over the logits' order keys: per 4 bits
    of the key, the chunks count their logits' next digit and a kernel per row picks it (four rounds for bfloat16
    logits, eight for float32); the filter then keeps every token at or above it (ties with the k-th included, as
    transformers and vLLM keep them). Then two to four launches: the filters' row statistics, the first round's
    race and, with top-p, the mass above its winner run one program per (row, chunk of ``BLOCK`` columns), so a
    single row spreads over the card; the last launch combines the chunks per row and runs any further rounds.
    The chunks do not depend on the batch, and so neither does any row's token."""
    b, n = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    seeds = _row_seeds(b, logits.device, generators)
    temp = temperature.float().contiguous()
    has_top_p, has_min_p, has_top_k = top_p is not None, min_p is not None, top_k is not None
    top_p = top_p.float().contiguous() if has_top_p else temp
    min_p = min_p.float().contiguous() if has_min_p else temp
    parts = triton.cdiv(n, BLOCK)
    device = logits.get_device()
    grid = (b, parts)
    kth = temp
    if has_top_k:
        top_k = top_k.clamp(-1, n).to(torch.int32).contiguous()  # (off stays off: no int64 k wraps in int32)
        state = torch.empty(2, b, dtype=torch.int32, device=logits.device)
        hist = torch.empty(b, parts, BINS.value, dtype=torch.int32, device=logits.device)
        kth = torch.empty(b, dtype=torch.float32, device=logits.device)
        for shift in KEY_SHIFTS[logits.dtype]:
            _HIST(grid, (logits, logits.stride(0), n, top_k, state, hist), (shift, BLOCK), num_warps=NUM_WARPS,
                  device_index=device)
            _SELECT((b,), (n, parts, top_k, state, hist, kth), (shift,), num_warps=4, device_index=device)
    part = torch.empty(6, b, parts, dtype=torch.float32, device=logits.device)
    k = int(has_top_k)
    if has_top_p or has_min_p:
        _STATS(grid, (logits, logits.stride(0), n, temp, kth, part), (k, BLOCK), num_warps=NUM_WARPS,
               device_index=device)
    _RACE(grid, (logits, logits.stride(0), n, temp, min_p, kth, seeds, part), (int(has_min_p), k, BLOCK, PART_BLOCK),
          num_warps=NUM_WARPS, device_index=device)
    if has_top_p:
        _MASS(grid, (logits, logits.stride(0), n, temp, kth, part), (k, BLOCK, PART_BLOCK), num_warps=NUM_WARPS,
              device_index=device)
    _FINISH((b,), (logits, logits.stride(0), n, temp, top_p, min_p, kth, seeds, part, out),
            (int(has_top_p), int(has_min_p), k, BLOCK, PART_BLOCK, MAX_ROUNDS), num_warps=NUM_WARPS,
            device_index=device)
    return out


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs (with and without each filter) for ``ninefold.ops.triton.aot``."""
    def variant(kernel, num_warps=NUM_WARPS, **constexprs):
        return {"kernel": kernel, "num_warps": num_warps, "constexprs": constexprs}

    flags = (0, 1)
    return ([variant(sample_topk_hist_kernel, SHIFT=shift, BLOCK=BLOCK) for shift in KEY_SHIFTS[dtype]]
            + [variant(sample_topk_select_kernel, 4, SHIFT=shift) for shift in KEY_SHIFTS[dtype]]
            + [variant(sample_stats_kernel, HAS_TOP_K=k, BLOCK=BLOCK) for k in flags]
            + [variant(sample_mass_kernel, HAS_TOP_K=k, BLOCK=BLOCK, PART_BLOCK=PART_BLOCK) for k in flags]
            + [variant(sample_race_kernel, HAS_MIN_P=q, HAS_TOP_K=k, BLOCK=BLOCK, PART_BLOCK=PART_BLOCK)
               for q in flags for k in flags]
            + [variant(sample_finish_kernel, HAS_TOP_P=p, HAS_MIN_P=q, HAS_TOP_K=k, BLOCK=BLOCK,
                       PART_BLOCK=PART_BLOCK, MAX_ROUNDS=MAX_ROUNDS) for p in flags for q in flags for k in flags])
