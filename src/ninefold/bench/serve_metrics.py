"""Serving metrics from request timelines: latencies, throughput, goodput under SLOs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

LATENCY_KEYS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
STAT_KEYS = ("mean", "median", "p90", "p99")


@dataclass
class RequestResult:
    """What happened to one request; times are seconds since the benchmark started.

    ``chunk_times`` holds the arrival time of every streamed chunk that carried output text;
    ``output_tokens`` comes from the server's usage when it sent one (``token_source`` says where
    the count came from: ``"usage"``, ``"tokenizer"`` or ``"chunks"``).
    """

    start: float
    end: float
    success: bool
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_source: str = "usage"
    error: str = ""

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds), None without any output chunk."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive output chunks (seconds)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self) -> float:
        """End-to-end latency (seconds), from sending to the end of the response."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (seconds), None with fewer than two tokens."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


_SLO_KEYS = ("ttft", "itl", "tpot", "e2e")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?\s*$")


@dataclass(frozen=True)
class SLO:
    """Latency bounds in milliseconds a request must meet to count towards goodput (None = no bound).

    ``itl`` bounds every inter-token gap of the request (its largest gap), ``tpot`` its mean time per
    output token, ``ttft`` and ``e2e`` its first-token and end-to-end latencies.
    """

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """Parse ``"ttft=500ms,itl=50ms,e2e=2s"``; a bare number means milliseconds."""
        if text is None or not text.strip():
            return cls()
        bounds: dict[str, float] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in _SLO_KEYS:
                raise ValueError(
                    f"--slo items must be KEY=DURATION with KEY one of {', '.join(_SLO_KEYS)}, got {item!r}"
                )
            if f"{key}_ms" in bounds:
                raise ValueError(f"--slo gives {key!r} twice in {text!r}")
            match = _DURATION.match(value)
            if match is None:
                raise ValueError(f"--slo {key} must be a duration like 500ms, 0.5s or 500 (ms), got {value!r}")
            number = float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2) or "ms"]
            if number <= 0:
                raise ValueError(f"--slo {key} must be positive, got {value!r}")
            bounds[f"{key}_ms"] = number
        return cls(**bounds)

    @property
    def empty(self) -> bool:
        return all(v is None for v in self.as_dict().values())

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}

    def met_by(self, result: RequestResult) -> bool:
        """Whether a request succeeded and met every bound (a bound on a missing value is met)."""
        if not result.success:
            return False
        itls = result.itls
        measured = {
            "ttft_ms": result.ttft,
            "itl_ms": max(itls) if itls else None,
            "tpot_ms": result.tpot,
            "e2e_ms": result.e2e,
        }
        return all(
            bound is None or measured[key] is None or measured[key] * 1e3 <= bound
            for key, bound in self.as_dict().items()
        )


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean, median, p90 and p99 in milliseconds of values in seconds (linear interpolation)."""
    if not values_s:
        return dict.fromkeys(STAT_KEYS)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def compute_report(results: list[RequestResult], duration_s: float, slo: SLO) -> dict:
    """The benchmark's figures over all requests of one run lasting ``duration_s`` seconds.

    Latencies cover successful requests; ITL pools every gap of every request. Goodput counts
    requests per second that succeeded and met every SLO; attainment is their share of all requests.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s!r}")
    done = [r for r in results if r.success]
    good = sum(slo.met_by(r) for r in results)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itls]),
        "tpot_ms": latency_stats([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": latency_stats([r.e2e for r in done]),
        "slo": slo.as_dict(),
        "goodput": good / duration_s,
        "slo_attainment": good / len(results) if results else None,
    }


def running_over_time(results: list[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """Step function of requests in flight: ``(times, counts)``, count ``counts[i]`` from ``times[i]`` on."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results])
    times = np.array([0.0] + [t for t, _ in events])
    counts = np.cumsum([0] + [d for _, d in events])
    return times, counts


def output_tokens_over_time(results: list[RequestResult], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens per second in consecutive bins of ``bin_s``: ``(bin_starts, tokens_per_s)``.

    A request's tokens are spread evenly over its chunks (a chunk may carry several tokens).
    """
    if not bin_s > 0:
        raise ValueError(f"bin_s must be positive, got {bin_s!r}")
    end = max((r.end for r in results), default=0.0)
    num_bins = max(1, math.ceil(end / bin_s))
    tokens = np.zeros(num_bins)
    for r in results:
        if r.success and r.chunk_times:
            idx = np.minimum((np.asarray(r.chunk_times) / bin_s).astype(int), num_bins - 1)
            np.add.at(tokens, idx, r.output_tokens / len(r.chunk_times))
    return np.arange(num_bins) * bin_s, tokens / bin_s
