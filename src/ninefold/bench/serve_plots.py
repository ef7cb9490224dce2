"""Plots of serving benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ninefold.bench.serve_metrics import RequestResult, output_tokens_over_time, running_over_time


def plot_run(results: list[RequestResult], report: dict, path: str | Path) -> None:
    """Latency CDFs, output-token throughput over time and requests in flight over time, in one image."""
    done = [r for r in results if r.success]
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    _cdf(axes[0, 0], {"TTFT": [r.ttft for r in done if r.ttft is not None], "E2E": [r.e2e for r in done]})
    _cdf(axes[0, 1], {"ITL": [g for r in done for g in r.itls], "TPOT": [r.tpot for r in done if r.tpot is not None]})
    duration = max((r.end for r in results), default=0.0)
    bin_s = max(duration / 60, 0.05)
    starts, rate = output_tokens_over_time(results, bin_s)
    axes[1, 0].step(starts, rate, where="post")
    axes[1, 0].set(title=f"output throughput ({bin_s:.2g} s bins)", xlabel="time (s)", ylabel="tokens/s")
    times, running = running_over_time(results)
    axes[1, 1].step(times, running, where="post")
    axes[1, 1].set(title="requests in flight", xlabel="time (s)", ylabel="requests")
    fig.suptitle(
        f"{report.get('config', {}).get('model', '')}  rate {report.get('config', {}).get('request_rate', '?')} req/s  "
        f"completed {report['completed']}  failed {report['failed']}"
    )
    fig.savefig(path, dpi=100)


def plot_sweep(sweep: dict, path: str | Path) -> None:
    """SLO attainment, throughput and goodput, and p90 latencies against the request rate."""
    runs = sweep["runs"]
    rates = [run["config"]["request_rate"] for run in runs]
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    axes[0].plot(rates, [100 * (run["slo_attainment"] or 0) for run in runs], marker="o")
    axes[0].axhline(100 * sweep["attainment_target"], color="gray", linestyle="--")
    axes[0].set(title="SLO attainment", xlabel="request rate (req/s)", ylabel="%", ylim=(0, 105))
    axes[1].plot(rates, [run["request_throughput"] for run in runs], marker="o", label="throughput")
    axes[1].plot(rates, [run["goodput"] for run in runs], marker="o", label="goodput")
    axes[1].set(title="requests per second", xlabel="request rate (req/s)", ylabel="req/s")
    axes[1].legend()
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = [run[key]["p90"] if run[key]["p90"] is not None else np.nan for run in runs]
        axes[2].plot(rates, values, marker="o", label=f"p90 {key[:-3].upper()}")
    axes[2].set(title="p90 latency", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    axes[2].legend()
    fig.savefig(path, dpi=100)


def _cdf(ax, series: dict[str, list[float]]) -> None:
    for label, values_s in series.items():
        if values_s:
            ms = np.sort(np.asarray(values_s)) * 1e3
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=label)
    ax.set(title="latency CDF", xlabel="ms", ylabel="cumulative fraction", ylim=(0, 1.02))
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
