"""Serving benchmark against any OpenAI-compatible server: TTFT, ITL, TPOT, throughput, goodput.

Run it as ``ninefold bench serve --base-url http://127.0.0.1:8000 --num-prompts 100 --output r.json``
(or ``python -m ninefold.bench.serve ...``). Requests arrive by a gamma process (``--request-rate``,
``--burstiness``) under an optional concurrency cap, each is streamed and every chunk timed, and the
report (a table on the terminal, JSON in ``--output``, plots in ``--plot``) gives the latency
distributions, throughput, and goodput under ``--slo``. ``--sweep-rates`` repeats the run at several
rates and reports the highest whose SLO attainment stays at or above 90% (DistServe's goodput).

The client is one asyncio process; it spends roughly 50 us of CPU per streamed chunk (measured on
the 2-core development machine), so past some ten thousand chunks per second its own delay shows
up in the ITL figures.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from ninefold.bench.serve_arrivals import arrival_times
from ninefold.bench.serve_client import ServerTokenizer, StreamClient, api_root, list_models
from ninefold.bench.serve_datasets import (
    BenchRequest,
    TokenCounter,
    WordCounter,
    jsonl_requests,
    random_requests,
)
from ninefold.bench.serve_metrics import SLO, RequestResult, compute_report
from ninefold.bench.serve_options import add_arguments
from ninefold.bench.serve_table import format_report, format_sweep

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class LoadShape:
    """How requests are offered: rate (req/s, ``inf`` = all at once), burstiness, concurrency cap."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RunOutcome:
    """One benchmark run: the per-request results, generated texts and wall time."""

    results: list[RequestResult]
    texts: list[str]
    duration_s: float
    report: dict = field(default_factory=dict)


async def send_all(client: StreamClient, requests: list[BenchRequest], load: LoadShape,
                   progress: bool = True) -> RunOutcome:
    """Send every request at its arrival time (at most ``max_concurrency`` in flight) and time them."""
    arrivals = arrival_times(len(requests), load.request_rate, load.burstiness, load.seed)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=load.max_concurrency)
    timeout = httpx.Timeout(load.timeout_s, pool=None)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    failed = 0

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        t0 = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> tuple[RequestResult, str]:
            nonlocal failed
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                outcome = await client.send(http, request, t0)
            else:
                async with gate:
                    outcome = await client.send(http, request, t0)
            failed += not outcome[0].success
            bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
            return outcome

        outcomes = await asyncio.gather(*(one(r, float(at)) for r, at in zip(requests, arrivals)))
        duration = time.perf_counter() - t0
    bar.close()
    return RunOutcome([o[0] for o in outcomes], [o[1] for o in outcomes], duration)


def benchmark(client: StreamClient, requests: list[BenchRequest], load: LoadShape, slo: SLO,
              counter: TokenCounter | None = None, progress: bool = True) -> RunOutcome:
    """One run: send the requests, fill in token counts the server did not report, build the report.

    Output lengths come from the server's usage; without it, from ``counter`` applied to the
    generated text when that is the server's own tokenizer, else from the number of chunks.
    """
    outcome = asyncio.run(send_all(client, requests, load, progress))
    if isinstance(counter, ServerTokenizer):
        for result, text in zip(outcome.results, outcome.texts):
            if result.success and result.token_source == "chunks" and text:
                try:
                    result.output_tokens, result.token_source = counter.count(text), "tokenizer"
                except (httpx.HTTPError, ValueError, KeyError):
                    pass  # keep the chunk count
    report = compute_report(outcome.results, outcome.duration_s, slo)
    report["config"] = {
        "base_url": client.root, "model": client.model, "endpoint": client.endpoint,
        "num_prompts": len(requests), "request_rate": _rate_json(load.request_rate),
        "burstiness": load.burstiness, "max_concurrency": load.max_concurrency, "seed": load.seed,
        "ignore_eos": client.ignore_eos,
        "token_counter": counter.name if counter is not None else None,
        "token_sources": dict(Counter(r.token_source for r in outcome.results if r.success)),
    }
    report["errors"] = dict(Counter(r.error for r in outcome.results if not r.success).most_common(10))
    report["requests"] = [_record(r) for r in outcome.results]
    outcome.report = report
    return outcome


def warm_up(client: StreamClient, counter: TokenCounter, timeout_s: float = 600.0) -> RequestResult:
    """Send one short request outside the measurement (first-call costs, a check that serving works).

    Its prompt shares no prefix with the benchmark's; a failure is printed, not raised.
    """
    request = random_requests(1, (16, 16), (8, 8), counter, seed=2**32 - 1)[0]
    load = LoadShape(timeout_s=timeout_s)
    result = asyncio.run(send_all(client, [request], load, progress=False)).results[0]
    if result.success:
        first = "" if result.ttft is None else f"TTFT {1e3 * result.ttft:.1f} ms, "
        print(f"warm-up request: ok, {first}E2E {1e3 * result.e2e:.1f} ms", file=sys.stderr)
    else:
        print(f"warm-up request failed: {result.error}", file=sys.stderr)
    return result


def best_rate(runs: list[dict], target: float = ATTAINMENT_TARGET) -> float | None:
    """The highest request rate among ``runs`` whose SLO attainment is at least ``target``."""
    passing = [run["config"]["request_rate"] for run in runs if (run["slo_attainment"] or 0) >= target]
    return max(passing, default=None)


# ---------------------------------------------------------------------------------------- command line


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``bench serve`` from parsed arguments.

    Returns 0 when the report was written and some request completed, 1 when none did or the server
    could not be reached, 2 for bad arguments.
    """
    try:
        return _run(args)
    except ValueError as error:
        print(f"ninefold bench serve: error: {error}", file=sys.stderr)
        return 2
    except httpx.HTTPError as error:  # outside the measured requests, e.g. /tokenize while building prompts
        print(f"ninefold bench serve: error talking to {args.base_url}: {type(error).__name__}: {error}",
              file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    kind, files = args.dataset[0], args.dataset[1:]
    if kind not in ("random", "jsonl"):
        raise ValueError(f"--dataset must be 'random' or 'jsonl FILE', got {' '.join(args.dataset)!r}")
    if (kind == "random") != (not files) or len(files) > 1:
        raise ValueError(f"--dataset random takes no file and jsonl takes exactly one, got {' '.join(args.dataset)!r}")
    if args.sweep_rates is not None and args.slo.empty:
        raise ValueError("--sweep-rates needs --slo (attainment is measured against it)")
    if args.sweep_rates is not None and not math.isinf(args.request_rate):
        raise ValueError("give either --request-rate or --sweep-rates, not both")
    for path, what in ((args.output, "--output"), (args.plot, "--plot")):
        if path is not None and not path.resolve().parent.is_dir():
            raise ValueError(f"{what} {str(path)!r}: directory {str(path.resolve().parent)!r} does not exist")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    progress = not args.no_progress
    root = api_root(args.base_url)
    model = args.model or _first_model(root, args.api_key)
    if model is None:
        return 1
    counter: TokenCounter | None = ServerTokenizer.probe(root, model, args.api_key)
    if counter is None:
        counter = WordCounter()
        print("note: the server has no usable /tokenize; prompt lengths are counted in words", file=sys.stderr)
    client = StreamClient(root, model, args.endpoint, args.api_key, args.ignore_eos)
    warm_up(client, counter, args.timeout)

    def make_requests(seed: int) -> list[BenchRequest]:
        if kind == "jsonl":
            return jsonl_requests(files[0], args.num_prompts, args.output_len, counter, seed)
        return random_requests(args.num_prompts, args.input_len, args.output_len, counter, seed, progress)

    rates = args.sweep_rates or [args.request_rate]
    runs = []
    for i, rate in enumerate(rates):
        # Fresh random prompts per rate, so a prefix cache cannot serve one run from the last.
        load = LoadShape(rate, args.burstiness, args.max_concurrency, args.seed + i, args.timeout)
        outcome = benchmark(client, make_requests(args.seed + i), load, args.slo, counter, progress)
        outcome.report["config"].update(
            dataset=files[0] if files else "random", output_len=list(args.output_len),
            input_len=list(args.input_len) if kind == "random" else None)
        runs.append(outcome)
        print(format_report(outcome.report))
        for error, count in list(outcome.report["errors"].items())[:3]:
            print(f"  {count} failed with: {error}", file=sys.stderr)

    if args.sweep_rates is None:
        document = runs[0].report
    else:
        reports = [o.report for o in runs]
        document = {"attainment_target": ATTAINMENT_TARGET, "goodput_rate": best_rate(reports), "runs": reports}
        print(format_sweep(document))
    args.output.write_text(json.dumps(document, indent=1, allow_nan=False))
    print(f"report written to {args.output}")
    if args.plot is not None:
        from ninefold.bench.serve_plots import plot_run, plot_sweep

        if args.sweep_rates is None:
            plot_run(runs[0].results, runs[0].report, args.plot)
        else:
            plot_sweep(document, args.plot)
        print(f"plots written to {args.plot}")
    return 0 if any(o.report["completed"] for o in runs) else 1


def _first_model(root: str, api_key: str | None) -> str | None:
    try:
        models = list_models(root, api_key)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        print(f"ninefold bench serve: cannot list models at {root}/v1/models ({error}); "
              f"is the server up? Pass --model to skip this.", file=sys.stderr)
        return None
    if not models:
        print(f"ninefold bench serve: {root}/v1/models lists no model; pass --model", file=sys.stderr)
        return None
    return models[0]


def _record(r: RequestResult) -> dict:
    return {
        "success": r.success, "error": r.error, "start_s": r.start, "end_s": r.end,
        "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "token_source": r.token_source,
        "ttft_ms": None if r.ttft is None else r.ttft * 1e3, "tpot_ms": None if r.tpot is None else r.tpot * 1e3,
        "e2e_ms": r.e2e * 1e3, "chunk_times_s": r.chunk_times,
    }


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def main(argv: list[str] | None = None) -> int:
    """``python -m ninefold.bench.serve``: the same as ``ninefold bench serve``."""
    parser = argparse.ArgumentParser(prog="python -m ninefold.bench.serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
