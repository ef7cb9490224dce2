"""Measured CUTLASS configurations for ``linear``, per exact shape.

For one (device, M, N, K) in bfloat16 the tuner checks every candidate (``candidates``: each
configuration of ``build.CONFIGS`` with each decomposition it offers) against ``F.linear``, times
them and ``F.linear`` over rotating copies of the weight (so the weight streams from memory, as in a
decode step) and keeps the fastest, or ``"vendor"`` when none beats ``F.linear`` by ``MIN_GAIN``.
Choices persist in ``$NINEFOLD_CACHE_DIR/ops/cutlass-<fingerprint>.json`` keyed also by the
library's build key, so a second process pays nothing and a rebuilt library is measured again.

``NINEFOLD_CUTLASS_MIN_GAIN`` (a fraction, default ``MIN_GAIN``) sets how much faster than ``F.linear`` a
configuration must be; a negative value keeps a configuration up to that much slower (say, to keep a decode
step's chain of PDL launches unbroken by cuBLAS). A value other than the default is part of the cache key.

Tuning runs only inside ``with autotune():`` (the engine's eager run of each decode size before it
captures the decode graphs; never while capturing) or with
``NINEFOLD_CUTLASS_AUTOTUNE=1``, and only for ``TUNED_ROWS``; every other shape runs ``F.linear``.
"""

from __future__ import annotations

import os

import torch

from ninefold.ops import linear_candidates, timing
from ninefold.ops.choice_cache import ChoiceCache
from ninefold.ops.cutlass import binding, build

VENDOR = linear_candidates.VENDOR
MIN_GAIN = 0.02  # a configuration must be this much faster than F.linear to replace it
ROUNDS = ((5, None), (20, 4))  # (repeats, keep the best n of the previous round)
SPLITS = (2, 3, 4)
TUNED_ROWS = range(48, 513)  # where cuBLAS leaves SMs idle (docs/perf/llm.md); fewer rows take the GEMVs

measured: dict = {}  # this process's tuning runs: key -> {candidate: us}, fastest first
CACHE = ChoiceCache("cutlass", "NINEFOLD_CUTLASS_AUTOTUNE")
autotune = CACHE.autotune


def candidates(configs=build.CONFIGS) -> list[tuple[int, str, int]]:
    """Every ``(configuration index, mode, splits)`` the configurations offer."""
    out = []
    for index, config in enumerate(configs):
        for mode in config.modes:
            for splits in (SPLITS if mode == "split_k" else (1,)):
                out.append((index, mode, splits))
    return out


def describe(candidate, configs=build.CONFIGS) -> str:
    """``<configuration name>/<mode>[splits]``."""
    index, mode, splits = candidate
    return f"{configs[index].name}/{mode}{splits if mode == 'split_k' else ''}"


def min_gain() -> float:
    """``NINEFOLD_CUTLASS_MIN_GAIN`` as a fraction in (-1, 1), else ``MIN_GAIN``."""
    text = os.environ.get("NINEFOLD_CUTLASS_MIN_GAIN")
    if text is None or text == "":
        return MIN_GAIN
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not -1 < value < 1:
        raise ValueError(f"NINEFOLD_CUTLASS_MIN_GAIN: got {text!r}; expected a fraction between -1 and 1 "
                         f"(default {MIN_GAIN})")
    return value


def key(device_name: str, m: int, n: int, k: int) -> str:
    """The cache key of one product shape (bfloat16) under the loaded library (and a non-default ``min_gain``)."""
    gain = min_gain()
    suffix = "" if gain == MIN_GAIN else f"|gain{gain:g}"
    return f"{device_name}|cutlass-{binding.library_key()}|bfloat16|{m}|{n}|{k}{suffix}"


def choice(m: int, n: int, k: int, device: torch.device) -> tuple[int, str, int] | None:
    """The candidate to run (``None``: ``F.linear``), tuning first when allowed and not yet known."""
    from ninefold.ops.dispatch import device_model

    if m not in TUNED_ROWS:
        return None
    known = CACHE.choices().get(key(device_model(device), m, n, k))
    if known is None:
        if not CACHE.autotune_on() or torch.cuda.is_current_stream_capturing():
            return None
        known = tune(m, n, k, device)["choice"]
    return None if known == VENDOR else tuple(known)


def tune(m: int, n: int, k: int, device: torch.device, progress: bool = True) -> dict:
    """Time ``F.linear`` and every candidate for this shape, remember the fastest and return
    ``{"choice": [config, mode, splits] or "vendor", "times_us": {...}}``."""
    from ninefold.ops.dispatch import device_model

    runs, found = linear_candidates.checked_runs(
        "CUTLASS", m, n, k, torch.bfloat16, device, [(describe(c), c) for c in candidates()],
        lambda x, w, out, c: binding.matmul(x, w, out, *c), binding.CutlassError,
        quiet=lambda e: "cannot run this shape" in str(e), progress=progress)
    best, times = timing.fastest(runs, device, ROUNDS, VENDOR, min_gain())
    picked = VENDOR if best == VENDOR else list(found[best])
    name = key(device_model(device), m, n, k)
    CACHE.store(name, picked)
    measured[name] = {c: round(t, 3) for c, t in sorted(times.items(), key=lambda item: item[1])}
    return {"choice": picked, "times_us": measured[name]}


def measured_times(m: int, n: int, k: int, device: torch.device) -> dict | None:
    """What this process's tuning run of the shape measured (``{candidate: us}``, fastest first)."""
    from ninefold.ops.dispatch import device_model

    return measured.get(key(device_model(device), m, n, k))


def forget() -> None:
    """Drop the in-memory choices (the file is re-read on the next call)."""
    CACHE.forget()
