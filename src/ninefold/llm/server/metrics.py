"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # no *_created series: they only add noise to scrapes

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


class _EngineGauges(Collector):
    """Gauges read from ``engine.stats()`` at scrape time."""

    _GAUGES = (
        ("num_requests_running", "num_running", "Sequences in the running batch."),
        ("num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
        ("kv_cache_usage_perc", "kv_usage", "Fraction of KV-cache blocks in use (0 to 1)."),
        ("num_free_kv_blocks", "num_free_blocks", "Free KV-cache blocks."),
        ("num_kv_blocks", "num_blocks", "KV-cache blocks in total."),
        ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache."),
        ("num_sequences_admitted", "admitted", "Sequences the server holds (running, queued or still streaming)."),
    )

    # counters that only grow, under Prometheus's ``_total`` names (as vLLM's)
    _COUNTERS = (
        ("num_preemptions", "num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks."),
        ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
        ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens the prefix cache served."),
        ("spec_decode_num_draft_tokens", "num_draft_tokens", "Speculative draft tokens proposed."),
        ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Speculative draft tokens the model accepted."),
    )

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str,
                 admitted: Callable[[], int] | None) -> None:
        self.stats = stats
        self.model_name = model_name
        self.admitted = admitted

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """One gauge per engine figure, plus the sequences the server has admitted, and the counters."""
        stats = self.stats()
        if self.admitted is not None:
            stats = {**stats, "admitted": self.admitted()}
        for name, key, doc in self._GAUGES:
            if key not in stats:
                continue
            family = GaugeMetricFamily(f"ninefold:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], float(stats[key]))
            yield family
        for name, key, doc in self._COUNTERS:
            if key in stats:
                counter = CounterMetricFamily(f"ninefold:{name}", doc, labels=["model_name"])
                counter.add_metric([self.model_name], float(stats[key]))
                yield counter
        cache = stats.get("cache_config")
        if cache is not None:  # vLLM's info gauge: the settings in its labels, value 1
            family = GaugeMetricFamily("ninefold:cache_config_info", "The KV cache's settings.", labels=list(cache))
            family.add_metric(list(cache.values()), 1.0)
            yield family
        lora = stats.get("lora")
        if lora is not None:  # vLLM's info gauge: the adapters in its labels, the scrape time as its value
            family = GaugeMetricFamily("ninefold:lora_requests_info", "LoRA adapters of running and waiting requests.",
                                       labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            family.add_metric([str(lora["max_lora"]), ",".join(lora["running"]), ",".join(lora["waiting"])],
                              time.time())
            yield family


class ServerMetrics:
    """Latency histograms and token counters, plus the engine's gauges."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str,
                 admitted: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"ninefold:{name}", doc, labels, registry=self.registry, buckets=_LATENCY_BUCKETS)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"ninefold:{name}", doc, labels + list(extra), registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last generated token.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Sequences finished, by reason.", ("finished_reason",))
        self.rejected = counter("request_rejected", "Requests answered with an error, by status.", ("status",))
        self.registry.register(_EngineGauges(stats, model_name, admitted))

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)

    def reject(self, status: int) -> None:
        """Count one request answered with ``status``."""
        self.rejected.labels(self.model_name, str(status)).inc()

    def count_prompt(self, tokens: int) -> None:
        """Count the tokens of one prompt."""
        self.prompt_tokens.labels(self.model_name).inc(tokens)

    def sequence(self, arrival: float) -> SequenceTimer:
        """A timer for one generated sequence that arrived at ``arrival`` (``time.perf_counter``)."""
        return SequenceTimer(self, arrival)


class SequenceTimer:
    """Records TTFT, inter-token latency, end-to-end latency and token counts of one sequence."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last = None
        self.tokens = 0

    def tokens_now(self, total_tokens: int) -> None:
        """Note that the sequence now has ``total_tokens`` generated tokens."""
        new = total_tokens - self.tokens
        if new <= 0:
            return
        now = time.perf_counter()
        name = self.metrics.model_name
        if self.last is None:
            self.metrics.ttft.labels(name).observe(now - self.arrival)
            gaps = [0.0] * (new - 1)  # tokens that arrived together with the first one
        else:
            gaps = [(now - self.last) / new] * new  # several tokens in one output share the wait
        for gap in gaps:
            self.metrics.itl.labels(name).observe(gap)
        self.metrics.generation_tokens.labels(name).inc(new)
        self.tokens = total_tokens
        self.last = now

    def finish(self, reason: str | None) -> None:
        """Record the end of the sequence."""
        name = self.metrics.model_name
        self.metrics.e2e.labels(name).observe(time.perf_counter() - self.arrival)
        self.metrics.finished.labels(name, reason or "abort").inc()
