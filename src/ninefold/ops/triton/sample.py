"""Triton ``sample``: one token per row of ``[B, V]`` logits under temperature, top-p and min-p, without sorting.

torch's route (``ninefold.ops.sampling``) sorts every row for top-p and writes several float32 copies of the
logits, noise included: at 256 rows of a 128k vocabulary that took 5.0 ms of an H100 for top-p (``python -m
ninefold.bench.sampling``), half a decode step; this kernel took 0.37 ms. Here one program per row reads the row a few times
and keeps nothing but scalars:

1. with top-p or min-p, one pass for the row's maximum ``m`` and ``Z = sum(exp(x - m))`` (``x`` = logits /
   temperature, online);
2. a draw from the tokens still allowed (min-p: ``x >= m + log(min_p)``; above the pivot, below) by the
   exponential race: the largest ``x - log(E)``, ``E ~ Exp(1)`` from Philox (``tl.rand``) keyed by the row's
   seed, the round and the column, so a draw depends on nothing but them;
3. with top-p, a pass for the mass of the tokens above the drawn one, ``sum(exp(x - m)) / Z`` over ``x > x_j``:
   below ``p``, the token is in the smallest most-likely set reaching ``p`` (the nucleus) and is kept.
   Otherwise every token up to ``x_j`` is outside it too, so ``x_j`` becomes the pivot and step 2 draws again
   from the tokens above it: rejection sampling, whose accepted draw follows the nucleus's distribution exactly
   (FlashInfer's sampling kernels work this way). A draw from the full distribution lands in the nucleus with
   probability about ``p``, so most rows take one round; after ``MAX_ROUNDS`` the largest token is taken.

Rows with temperature 0 take the first largest logit (as ``torch.argmax``). Top-k is not handled here (its set
needs the k-th largest logit); calls with ``top_k`` go to torch's route. Ties at the nucleus's edge are kept
whole (torch's route keeps the first ones in its sort order).
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
def sample_kernel(logits_ptr, stride, n, temp_ptr, top_p_ptr, min_p_ptr, seed_ptr, token_ptr,
                  HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    t = tl.load(temp_ptr + row)
    greedy = t <= 0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    noise = tl.where(greedy, 0.0, 1.0)  # greedy rows: the race without noise is the argmax
    seed = tl.load(seed_ptr + row)
    # 1. the row's maximum and normaliser, per lane online, then across lanes (only the filters need them)
    m = float("-inf")
    z = 0.0
    if HAS_TOP_P or HAS_MIN_P:
        lane_m = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_z = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            c = start + cols
            x = tl.load(base + c, mask=c < n, other=float("-inf")).to(tl.float32) * inv_t
            new_m = tl.maximum(lane_m, x)
            safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
            lane_z = lane_z * tl.exp(lane_m - safe_m) + tl.exp(x - safe_m)
            lane_m = new_m
        m = tl.max(lane_m, 0)
        z = tl.sum(lane_z * tl.exp(lane_m - m), 0)
    lowest = float("-inf")
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
        lowest = tl.where(min_p > 0, m + tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))
    top_p = 1.0
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
    pivot = float("-inf")  # tokens with x <= pivot are known to lie outside the nucleus
    chosen = 0
    rounds = 0
    accepted = 0
    while accepted == 0 and rounds < MAX_ROUNDS:
        # 2. the exponential race among the allowed tokens (Gumbel form: x + g, g = -log(-log(u)))
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_x = tl.full([BLOCK], float("-inf"), tl.float32)
        where = tl.full([BLOCK], 0, tl.int32)
        for start in range(0, n, BLOCK):
            c = start + cols
            x = tl.load(base + c, mask=c < n, other=float("-inf")).to(tl.float32) * inv_t
            u = tl.minimum(tl.maximum(tl.rand(seed, rounds * n + c), U_MIN), U_MAX)
            score = tl.where((c < n) & (x > pivot) & (x >= lowest), x - noise * tl.log(-tl.log(u)), float("-inf"))
            better = score > best  # strict: an earlier column keeps a tie (greedy rows: torch.argmax's choice)
            best = tl.where(better, score, best)
            best_x = tl.where(better, x, best_x)
            where = tl.where(better, c, where)
        top = tl.max(best, 0)
        chosen = tl.min(tl.where(best == top, where, n), 0)
        x_chosen = tl.max(tl.where(where == chosen, best_x, float("-inf")), 0)
        rounds += 1
        accepted = (greedy | (top_p >= 1)).to(tl.int32)
        if HAS_TOP_P:
            if accepted == 0:
                # 3. the mass of the tokens above the drawn one: inside the nucleus when below top_p
                above = tl.zeros([BLOCK], tl.float32)
                for start in range(0, n, BLOCK):
                    c = start + cols
                    x = tl.load(base + c, mask=c < n, other=float("-inf")).to(tl.float32) * inv_t
                    above += tl.where(x > x_chosen, tl.exp(x - m), 0.0)
                accepted = (tl.sum(above, 0) < top_p * z).to(tl.int32)
                pivot = tl.where(accepted == 0, x_chosen, pivot)
    if HAS_TOP_P:
        if accepted == 0:  # MAX_ROUNDS rejections (not seen in practice): the largest token, always in the nucleus
            first = tl.full([BLOCK], n, tl.int32)
            for start in range(0, n, BLOCK):
                c = start + cols
                x = tl.load(base + c, mask=c < n, other=float("-inf")).to(tl.float32) * inv_t
                first = tl.minimum(first, tl.where(x == m, c, n))
            chosen = tl.min(first, 0)
    tl.store(token_ptr + row, chosen.to(tl.int64))


def supports(logits, temperature, top_k=None, top_p=None, min_p=None, generators=None) -> str | None:
    """Why this kernel cannot run the call (None when it can)."""
    if top_k is not None:
        return "top_k (its set needs the k-th largest logit; torch's route sorts)"
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


_LAUNCH = Launcher(sample_kernel, ("HAS_TOP_P", "HAS_MIN_P", "BLOCK", "MAX_ROUNDS"))  # once per decode step


def sample(logits, temperature, top_k=None, top_p=None, min_p=None, generators=None) -> torch.Tensor:
    """``ops.sample`` for calls without top_k (``supports``): int64 ``[B]``, one launch after the row seeds."""
    b, n = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    seeds = _row_seeds(b, logits.device, generators)
    temp = temperature.float().contiguous()
    top_p = top_p.float().contiguous() if top_p is not None else None
    min_p = min_p.float().contiguous() if min_p is not None else None
    args = (logits, logits.stride(0), n, temp, temp if top_p is None else top_p, temp if min_p is None else min_p,
            seeds, out)
    _LAUNCH((b,), args, (int(top_p is not None), int(min_p is not None), BLOCK, MAX_ROUNDS), num_warps=8,
            device_index=logits.get_device())
    return out


def aot_variants(op: str, dtype: torch.dtype, shapes) -> list[dict]:
    """The kernels the launcher runs (with and without each filter) for ``ninefold.ops.triton.aot``."""
    return [{"kernel": sample_kernel, "num_warps": 8,
             "constexprs": {"HAS_TOP_P": p, "HAS_MIN_P": q, "BLOCK": BLOCK, "MAX_ROUNDS": MAX_ROUNDS}}
            for p in (0, 1) for q in (0, 1)]
