"""The options of ``ninefold bench serve``, kept apart from the benchmark so that building the
command line does not import the HTTP client and the benchmark's machinery."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ninefold.bench.serve_datasets import parse_length_range
from ninefold.bench.serve_metrics import SLO

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``bench serve`` to ``parser``."""
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                        help="/v1/completions, /v1/chat/completions or /v1/embeddings (one prompt per request, "
                             "end-to-end latency only; default: completions)")
    parser.add_argument("--dataset", nargs="+", default=["random"], metavar=("KIND", "FILE"),
                        help="'random' (prompts of --input-len tokens) or 'jsonl FILE' (lines with 'prompt' and "
                             "optional 'output_len'); default random")
    parser.add_argument("--num-prompts", type=_positive_int("--num-prompts"), default=100, help="requests per run (default 100)")
    parser.add_argument("--input-len", type=_length_range("--input-len"), default=(256, 256), metavar="A:B",
                        help="prompt tokens, uniform in [A, B] (random dataset; default 256)")
    parser.add_argument("--output-len", type=_length_range("--output-len"), default=(128, 128), metavar="A:B",
                        help="max_tokens per request, uniform in [A, B] (default 128)")
    parser.add_argument("--request-rate", type=_rate, default=math.inf, metavar="R|inf",
                        help="mean requests per second, or inf to send all at once (default inf)")
    parser.add_argument("--burstiness", type=_positive_float("--burstiness"), default=1.0,
                        help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 steadier (default 1)")
    parser.add_argument("--max-concurrency", type=_positive_int("--max-concurrency"), default=None, help="cap on requests in flight")
    parser.add_argument("--slo", type=_slo, default=SLO(), metavar="ttft=500ms,itl=50ms,tpot=..,e2e=..",
                        help="latency bounds for goodput; itl bounds a request's largest inter-token gap")
    parser.add_argument("--sweep-rates", type=_rates, default=None, metavar="r1,r2,...",
                        help="run at each rate and report the highest with SLO attainment >= 90%% (needs --slo)")
    parser.add_argument("--output", required=True, type=Path, help="where to write the JSON report")
    parser.add_argument("--plot", type=Path, default=None, help="where to write the plots (PNG, SVG or PDF)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default 0)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos=true (vLLM/ninefold extension) so outputs run to max_tokens")
    parser.add_argument("--timeout", type=_positive_float("--timeout"), default=600.0,
                        help="seconds before one request is given up as failed (default 600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _checked(name: str, parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = name  # argparse names the type in its "invalid ... value" message
    return convert


def _positive_number(name: str, text: str, kind=float):
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {text!r}")
    return value


def _positive_float(name: str):
    return _checked(name, lambda text: _positive_number(name, text))


def _positive_int(name: str):
    return _checked(name, lambda text: _positive_number(name, text, int))


def _parse_rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return _positive_number("--request-rate", text)


def _parse_rates(text: str) -> list[float]:
    rates = [_positive_number("--sweep-rates", item) for item in text.split(",")]
    if len(set(rates)) != len(rates):
        raise ValueError(f"--sweep-rates repeats a rate: {text!r}")
    return sorted(rates)


def _length_range(name: str):
    return _checked(name, lambda text: parse_length_range(text, name))


_rate = _checked("rate", _parse_rate)
_rates = _checked("rates", _parse_rates)
_slo = _checked("slo", SLO.parse)
