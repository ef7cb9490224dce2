"""Measured cuBLASLt algorithms for ``linear``, per exact shape.

For one (device, dtype, M, N, K) the tuner asks cuBLASLt's heuristic for its candidate algorithms,
checks each one's result against torch's ``F.linear`` (what cuBLAS runs by default), times each and
``F.linear`` over rotating copies of the weight (so the weight streams from memory, as in a decode
step) and keeps the fastest, or ``"vendor"`` when none beats ``F.linear`` by ``MIN_GAIN``. Results
persist in ``$NINEFOLD_CACHE_DIR/ops/cublaslt-<fingerprint>.json`` keyed also by the cuBLASLt
version (an algorithm is only valid within one), so a second process pays nothing.

Tuning runs only where it is asked for (``with autotune():``, as the engine does for its decode
batch sizes before capturing CUDA graphs, or ``NINEFOLD_CUBLASLT_AUTOTUNE=1``); an untuned shape runs
``F.linear``, so an eager prefill chunk of an odd size never stalls to tune.
"""

from __future__ import annotations

import os

import torch

from ninefold.ops import linear_candidates, timing
from ninefold.ops.choice_cache import ChoiceCache
from ninefold.ops.cublaslt import binding

VENDOR = linear_candidates.VENDOR
MIN_GAIN = 0.02  # an algorithm must be this much faster than F.linear to replace it
ROUNDS = ((5, None), (20, 4))  # (repeats, keep the best n of the previous round)

measured: dict = {}  # this process's tuning runs: key -> {candidate: us}, fastest first
_algos: dict = {}  # key -> binding.Algo of the persisted choice
CACHE = ChoiceCache("cublaslt", "NINEFOLD_CUBLASLT_AUTOTUNE")
autotune = CACHE.autotune  # inside ``with autotune():`` untuned shapes are tuned on their first call


def search_mode() -> str:
    """``NINEFOLD_CUBLASLT_SEARCH``: ``heuristic`` (default: the algorithms cuBLASLt's heuristic offers) or
    ``exhaustive`` (also every tile, stage count and split-K configuration it accepts for the shape)."""
    mode = os.environ.get("NINEFOLD_CUBLASLT_SEARCH", "heuristic")
    if mode not in ("heuristic", "exhaustive"):
        raise ValueError(f"NINEFOLD_CUBLASLT_SEARCH: got {mode!r}; expected 'heuristic' or 'exhaustive'")
    return mode


def key(device_name: str, dtype: torch.dtype, m: int, n: int, k: int) -> str:
    """The cache key of one product shape."""
    return f"{device_name}|cublaslt{binding.version()}|{str(dtype).removeprefix('torch.')}|{m}|{n}|{k}"


def choice(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> binding.Algo | None:
    """The algorithm to run (``None``: ``F.linear``), tuning first when allowed and not yet known."""
    from ninefold.ops.dispatch import device_model

    name = key(device_model(device), dtype, m, n, k)
    if name in _algos:
        return _algos[name]
    known = CACHE.choices().get(name)
    if known is None:
        if not CACHE.autotune_on() or torch.cuda.is_current_stream_capturing():
            return None
        known = tune(m, n, k, dtype, device)["choice"]
    algo = None if known == VENDOR else binding.algo_from_words(known["algo"])
    _algos[name] = algo
    return algo


def tune(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, progress: bool = True) -> dict:
    """Time ``F.linear`` and every algorithm the heuristic offers for this shape, remember the fastest
    and return ``{"choice": {"algo": [...], "name": ...} or "vendor", "times_us": {...}}``."""
    from ninefold.ops.dispatch import device_model

    plan = binding.plan(m, n, k, dtype, device)
    offered = binding.candidates(plan)
    if search_mode() == "exhaustive":
        offered += binding.enumerated(plan)
    runs, found = linear_candidates.checked_runs(
        "cuBLASLt algorithm", m, n, k, dtype, device, _named(offered),
        lambda x, w, out, cand: binding.matmul(x, w, out, cand.algo), binding.CublasLtError, progress=progress)
    best, times = timing.fastest(runs, device, ROUNDS, VENDOR, MIN_GAIN)
    picked = VENDOR if best == VENDOR else {"algo": binding.algo_words(found[best].algo), "name": best}
    name = key(device_model(device), dtype, m, n, k)
    CACHE.store(name, picked)
    _algos.pop(name, None)
    measured[name] = {c: round(t, 3) for c, t in sorted(times.items(), key=lambda item: item[1])}
    return {"choice": picked, "times_us": measured[name]}


def _named(offered) -> list[tuple[str, object]]:
    """Each distinct algorithm once, with its label (numbered where two share one)."""
    seen, names, out = set(), set(), []
    for cand in offered:
        words = tuple(binding.algo_words(cand.algo))
        if words in seen:
            continue
        seen.add(words)
        name = cand.name()
        if name in names:
            name = f"{name} #{len(seen)}"
        names.add(name)
        out.append((name, cand))
    return out


def measured_times(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> dict | None:
    """What this process's tuning run of the shape measured (``{candidate: us}``, fastest first)."""
    from ninefold.ops.dispatch import device_model

    return measured.get(key(device_model(device), dtype, m, n, k))


def forget() -> None:
    """Drop the in-memory choices (the file is re-read on the next call)."""
    CACHE.forget()
    _algos.clear()
