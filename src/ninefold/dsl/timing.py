"""Device-time measurement of tuning candidates (the tuner's stopwatch on GPUs).

What makes the comparison between candidates fair:

- device time: every sample is a pair of CUDA events around one launch, and a round of samples is
  queued behind a spin kernel (``torch.cuda._sleep``) long enough to cover the host's launch time,
  so the host's speed (Triton's Python launch path) never leaks into the figure;
- the same L2 state for every candidate and sample: before each launch a buffer twice the size of
  the L2 cache is zeroed, so every call starts from a cold L2 (as ``triton.testing.do_bench`` and
  the benchmark measure);
- enough repetitions, interleaved: candidates are timed in several rounds, each round in a rotated
  order, after one warm-up round, so clock ramps and drift hit every candidate alike;
- a noise-aware choice (:func:`choose`): the fastest median wins unless an earlier candidate (the
  prior ranking puts the configurations that measured best on the card first) is within the noise.
"""

from __future__ import annotations

import statistics
import time

import torch

ROUNDS = 5
ROUND_MS = 8.0  # kernel time per candidate and round (the rest of a round is flushing)
MIN_SAMPLES = 3
MAX_SAMPLES = 40
NOISE = 0.005  # medians closer than this fraction (or twice their standard errors) count as equal
STEADY = 0.02  # a choice whose standard error exceeds this fraction of its median is not kept on disk
_CYCLES: dict = {}


def cycles_per_us(device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond on ``device`` (a ``torch.device``,
    ``"cuda:1"`` or an index; measured once per device). Queue ``torch.cuda._sleep(int(us *
    cycles_per_us(d)))`` ahead of timed launches to keep the GPU busy while the host issues them."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES:
        with torch.cuda.device(index):
            torch.cuda._sleep(1000)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(1_000_000)
            end.record()
            end.synchronize()
            _CYCLES[index] = 1_000_000 / max(begin.elapsed_time(end) * 1e3, 1.0)
    return _CYCLES[index]


def flush_buffer(device) -> torch.Tensor:
    """A buffer whose zeroing evicts the L2 cache (twice its size; 256 MiB if the size is unknown)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 128 * 2**20
    return torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)


def _queued(fn, flush, n, cover_us, device):
    """``n`` samples (ms) of ``fn``, each after an L2 flush, queued behind a spin of ``cover_us``."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda._sleep(int(cover_us * cycles_per_us(device)))
    for begin, end in events:
        flush.zero_()
        begin.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return [begin.elapsed_time(end) for begin, end in events]


def sample(fns, device, *, rounds=ROUNDS, round_ms=ROUND_MS, progress=None) -> list[list[float]]:
    """Device times (ms per call, cold L2) of each zero-argument launcher in ``fns``.

    Each ``fn`` must already have run once (compiled). ``progress`` (a tqdm bar) is advanced once
    per candidate and round.
    """
    device = torch.device(device)
    with torch.cuda.device(device):
        flush = flush_buffer(device)
        torch.cuda.synchronize(device)
        host_us, estimate_ms = [], []
        for fn in fns:  # host cost of one queued sample, and a first device-time estimate
            start = time.perf_counter()
            flush.zero_()
            fn()
            host_us.append((time.perf_counter() - start) * 1e6)
            estimate_ms.append(statistics.median(_queued(fn, flush, 3, 50.0 + 4 * host_us[-1], device)))
        counts = [max(MIN_SAMPLES, min(MAX_SAMPLES, int(round_ms / max(ms, 1e-3)))) for ms in estimate_ms]
        samples = [[] for _ in fns]
        for r in range(rounds + 1):  # round 0 warms the clocks and is dropped
            shift = r % len(fns)
            for i in list(range(len(fns)))[shift:] + list(range(len(fns)))[:shift]:
                cover = 50.0 + counts[i] * (1.5 * host_us[i] + 10.0)  # + the two event records
                times = _queued(fns[i], flush, counts[i], cover, device)
                if r:
                    samples[i] += times
                    if progress is not None:
                        progress.update(1)
        del flush
    return samples


def choose(samples: list[list[float]]) -> tuple[int, list[dict]]:
    """Index of the candidate to keep and a summary per candidate (median, stderr, samples).

    The fastest median wins, except that the earliest candidate whose median lies within the noise
    of the fastest (``NOISE`` of it, or twice the two standard errors combined) is preferred: the
    candidates come in the order of the prior ranking.
    """
    summary = []
    for times in samples:
        if not times:
            summary.append({"median_ms": None, "stderr_ms": None, "samples": 0})
            continue
        median = statistics.median(times)
        spread = statistics.stdev(times) / len(times) ** 0.5 if len(times) > 1 else 0.0
        summary.append({"median_ms": median, "stderr_ms": spread, "samples": len(times)})
    timed = [i for i, s in enumerate(summary) if s["median_ms"] is not None]
    if not timed:
        raise ValueError("choose: no candidate has samples")
    best = min(timed, key=lambda i: summary[i]["median_ms"])
    b = summary[best]
    for i in timed:
        s = summary[i]
        margin = max(NOISE * b["median_ms"], 2.0 * (s["stderr_ms"] ** 2 + b["stderr_ms"] ** 2) ** 0.5)
        if s["median_ms"] - b["median_ms"] <= margin:
            return i, summary
    return best, summary


def steady(summary: list[dict], index: int, limit: float = STEADY) -> bool:
    """Whether the chosen candidate's measurement was quiet enough to keep for later processes.

    A GPU shared with other processes (parallel tests, another job) time-slices between them: the
    samples then scatter and the standard error of the median grows past ``limit`` of it.
    """
    chosen = summary[index]
    if not chosen.get("median_ms") or chosen.get("samples", 0) < 2:
        return False
    return chosen["stderr_ms"] <= limit * chosen["median_ms"]
