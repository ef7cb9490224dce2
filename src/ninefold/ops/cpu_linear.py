"""CPU ``linear`` for a few rows and a large weight: ``F.linear`` or ``(weight @ x.T).T``, as measured.

torch's CPU GEMM can be several times slower for 2..64 rows than the same product written with the
operands swapped: on a 2-core AMD EPYC (torch 2.13), SmolLM2's 49152 x 576 output layer took 22 ms for
2-8 rows through ``F.linear`` and 5.6-9.2 ms as ``weight @ x.T``; for small matrices either form can
win by 10-40% (``docs/perf/speculative.md``). Such few-row products are what a CPU engine runs for a
handful of concurrent requests, or for a decode step with speculative drafts.

For each (CPU model, dtype, rows rounded up to a power of two, N, K, bias) both forms are timed on the
first call and the faster one is kept in ``$NINEFOLD_CACHE_DIR/ops/cpu-linear-<fingerprint>.json``, so a
second process pays nothing and keeps the same numerics. Only weights of at least ``MIN_WEIGHT_ELEMENTS``
qualify (below that a measurement costs more than it can save, and the products are a few microseconds);
``NINEFOLD_CPU_LINEAR_AUTOTUNE=0`` keeps untuned shapes on ``F.linear``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ninefold.ops import timing
from ninefold.ops.choice_cache import ChoiceCache

MIN_ROWS, MAX_ROWS = 2, 64
MIN_WEIGHT_ELEMENTS = 1 << 22  # 4M elements: 16 MB in float32
LINEAR, SWAPPED = "linear", "swapped"
CACHE = ChoiceCache("cpu-linear", "NINEFOLD_CPU_LINEAR_AUTOTUNE")


def supports(x, weight, bias=None) -> str | None:
    """Why this implementation does not take the call, or None."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not MIN_ROWS <= rows <= MAX_ROWS:
        return f"{rows} rows: the measured few-row form covers {MIN_ROWS}..{MAX_ROWS}"
    if weight.numel() < MIN_WEIGHT_ELEMENTS:
        return f"a weight of {weight.numel()} elements: below {MIN_WEIGHT_ELEMENTS} F.linear runs as it is"
    return None


def bucket(rows: int) -> int:
    """Rows rounded up to a power of two: one measurement serves every count up to it."""
    return 1 << max(rows - 1, 0).bit_length()


def swapped(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 @ weight.T + bias`` computed as ``(weight @ x2.T).T`` (contiguous result)."""
    y = (weight @ x2.t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous()


def _key(dtype: torch.dtype, rows: int, n: int, k: int, has_bias: bool) -> str:
    from ninefold.ops.dispatch import device_model

    return f"{device_model(torch.device('cpu'))}|{str(dtype).removeprefix('torch.')}|{bucket(rows)}|{n}|{k}|{int(has_bias)}"


def choice(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """``LINEAR`` or ``SWAPPED`` for this shape, measured now when not known and tuning is allowed."""
    n, k = weight.shape
    key = _key(weight.dtype, rows, n, k, bias is not None)
    known = CACHE.choices().get(key)
    if known is None:
        if os.environ.get(CACHE.env) == "0":
            return LINEAR
        known = tune(bucket(rows), weight, bias)["choice"]
        CACHE.store(key, known)
    return known


def tune(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """Time both forms on ``rows`` random rows with ``weight``; ``{"choice", "times_us"}``."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))  # not the global RNG
    times = {LINEAR: timing.measure(lambda: F.linear(x, weight, bias), "cpu", warmup=1, repeats=7, max_seconds=0.3),
             SWAPPED: timing.measure(lambda: swapped(x, weight, bias), "cpu", warmup=1, repeats=7, max_seconds=0.3)}
    return {"choice": min(times, key=times.get), "times_us": times}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [..., K]`` with 2..64 rows, in the form measured faster here."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if choice(x2.shape[0], weight, bias) == LINEAR:
        return F.linear(x, weight, bias)
    return swapped(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
