"""Timing of operator calls on CPUs and GPUs (median of repeated runs).

On GPUs the figure is device time: each repeat queues ``calls`` back-to-back invocations behind a
short spin kernel (``torch.cuda._sleep``) long enough to cover their launch, then times them with
events. The kernels then run back to back as they do when replayed from a CUDA graph (the engine's
decode steps), so a small kernel is measured by what it costs the GPU, not by the Python and
driver time of launching it. ``include_launch=True`` times single calls end to end instead (what
an eager caller waits for).
"""

from __future__ import annotations

import statistics
import time

import torch

from ninefold.dsl.timing import cycles_per_us


def measure(fn, device, *, warmup: int = 3, repeats: int = 20, max_seconds: float = 1.0,
            include_launch: bool = False, calls: int = 10) -> float:
    """Median time of one ``fn()`` in microseconds (see the module docstring for what GPU time means)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if include_launch:
            return _events(fn, device, repeats, max_seconds, calls=1, cover_us=0.0)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        launch_us = (time.perf_counter() - start) * 1e6
        torch.cuda.synchronize(device)
        return _events(fn, device, repeats, max_seconds, calls=calls, cover_us=1.5 * launch_us + 20.0)
    times = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return statistics.median(times)


def _events(fn, device, repeats: int, max_seconds: float, *, calls: int, cover_us: float) -> float:
    cycles = int(cover_us * cycles_per_us(device))
    times = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if cycles:
            torch.cuda._sleep(cycles)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return statistics.median(times)


class RotatingWeights:
    """Copies of a random ``[n, k]`` weight (as many as fit ``budget`` bytes, at most 8) and timed steps
    that cycle through them, so a GEMM's weight streams from memory as it does in a model step rather
    than staying in L2."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, device, budget: int = 256 << 20):
        nbytes = n * k * torch.finfo(dtype).bits // 8
        free = torch.cuda.mem_get_info(device)[0] if torch.device(device).type == "cuda" else budget * 4
        copies = max(1, min(8, min(budget, free // 4) // max(nbytes, 1)))
        self.weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        self._turn = 0

    def step(self, run):
        """A no-argument function calling ``run(weight)`` with the next copy each time."""
        def call():
            self._turn = (self._turn + 1) % len(self.weights)
            run(self.weights[self._turn])
        return call


def fastest(runs: dict, device, rounds, baseline: str, min_gain: float) -> tuple[str, dict[str, float]]:
    """The fastest of ``runs`` (``{name: no-argument function}``) and every time measured, in us.

    Each round of ``rounds`` (``(repeats, keep)``) times the candidates left, keeping the best ``keep``
    of the previous round (``None``: all) and always ``baseline``; a candidate must beat ``baseline``
    by ``min_gain`` (a fraction) to be picked over it. A negative ``min_gain`` picks the fastest other
    candidate even when ``baseline`` is faster, as long as it is at most that fraction slower."""
    times: dict[str, float] = {}
    field = list(runs)
    for repeats, keep in rounds:
        if keep is not None:
            field = sorted(field, key=times.get)[:keep]
            if baseline not in field:
                field.append(baseline)
        for name in field:
            times[name] = measure(runs[name], device, repeats=repeats)
    best = min(field, key=times.get)
    others = [name for name in field if name != baseline]
    if best == baseline and min_gain < 0 and others:
        best = min(others, key=times.get)
    if best != baseline and times[best] > (1 - min_gain) * times[baseline]:
        best = baseline
    return best, times
