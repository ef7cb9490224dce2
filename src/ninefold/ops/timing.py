"""Timing of operator calls on CPUs and GPUs (median of repeated runs)."""

from __future__ import annotations

import statistics
import time

import torch


def measure(fn, device, *, warmup: int = 3, repeats: int = 20, max_seconds: float = 1.0) -> float:
    """Median time of ``fn()`` in microseconds (GPU work timed with events, after warm-up)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        deadline = time.perf_counter() + max_seconds
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
            if time.perf_counter() > deadline and len(times) >= 3:
                break
        return statistics.median(times)
    times = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return statistics.median(times)
