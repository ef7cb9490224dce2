"""Terminal tables of serving benchmark reports."""

from __future__ import annotations

from ninefold.bench.serve_metrics import LATENCY_KEYS, STAT_KEYS
from ninefold.bench.serve_options import ENDPOINTS


def format_report(report: dict) -> str:
    """The terminal table of one run."""
    config = report["config"]
    attainment = report["slo_attainment"]
    slo = ", ".join(f"{k[:-3]}<={v:g}ms" for k, v in report["slo"].items() if v is not None) or "none"
    rows = [
        ("Model / endpoint", f"{config['model']} / {ENDPOINTS[config['endpoint']]}"),
        ("Request rate (req/s)", config["request_rate"]),
        ("Burstiness / max concurrency", f"{config['burstiness']:g} / {config['max_concurrency'] or 'none'}"),
        ("Completed / failed", f"{report['completed']} / {report['failed']}"),
        ("Duration (s)", f"{report['duration_s']:.2f}"),
        ("Input / output tokens", f"{report['total_input_tokens']} / {report['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{report['request_throughput']:.3f}"),
        ("Output token throughput (tok/s)", f"{report['output_token_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}"),
        ("SLO", slo),
        ("Goodput (req/s)", f"{report['goodput']:.3f}"),
        ("SLO attainment", "-" if attainment is None else f"{100 * attainment:.1f}%"),
    ]
    lines = ["=" * 60, f"{'ninefold bench serve':^60}", "=" * 60]
    lines += [f"{name:<36}{value}" for name, value in rows]
    lines += ["-" * 60, f"{'latency (ms)':<16}" + "".join(f"{k:>11}" for k in STAT_KEYS)]
    for key in LATENCY_KEYS:
        stats = report[key]
        lines.append(f"{key[:-3].upper():<16}" + "".join(f"{_ms(stats[s]):>11}" for s in STAT_KEYS))
    lines.append("=" * 60)
    return "\n".join(lines)


def format_sweep(sweep: dict) -> str:
    """The terminal table of a rate sweep."""
    head = f"{'rate':>8}{'done':>7}{'fail':>6}{'req/s':>9}{'goodput':>9}{'attain':>8}{'p90 TTFT':>10}{'p90 TPOT':>10}"
    lines = ["=" * len(head), head, "-" * len(head)]
    for run in sweep["runs"]:
        att = run["slo_attainment"]
        lines.append(
            f"{run['config']['request_rate']:>8g}{run['completed']:>7}{run['failed']:>6}"
            f"{run['request_throughput']:>9.3f}{run['goodput']:>9.3f}{'-' if att is None else f'{100 * att:.1f}%':>8}"
            f"{_ms(run['ttft_ms']['p90']):>10}{_ms(run['tpot_ms']['p90']):>10}"
        )
    best = sweep["goodput_rate"]
    lines += ["-" * len(head),
              f"highest rate with SLO attainment >= {100 * sweep['attainment_target']:.0f}%: "
              + ("none of the rates tried" if best is None else f"{best:g} req/s"),
              "=" * len(head)]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
