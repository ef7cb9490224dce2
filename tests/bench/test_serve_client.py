"""The benchmark client against a real OpenAI-format streaming server (the stand-in, on 127.0.0.1)."""

import math
import socket

import pytest

from ninefold.bench.serve import LoadShape, benchmark
from ninefold.bench.serve_arrivals import arrival_times
from ninefold.bench.serve_client import ServerTokenizer, StreamClient, api_root, list_models
from ninefold.bench.serve_datasets import BenchRequest, WordCounter
from ninefold.bench.serve_metrics import SLO

from .openai_standin import MODEL, count_tokens


def make_requests(n: int, output_len: int = 6) -> list[BenchRequest]:
    prompts = [f"prompt number {i} with some words" for i in range(n)]
    return [BenchRequest(p, count_tokens(p), output_len) for p in prompts]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_timing_and_usage(standin, endpoint):
    server = standin()
    requests = make_requests(5, output_len=6)
    run = benchmark(StreamClient(server.url, MODEL, endpoint), requests, LoadShape(), SLO(), progress=False)
    assert run.report["completed"] == 5 and run.report["failed"] == 0
    for result, text, request in zip(run.results, run.texts, requests):
        assert text == "".join(f" t{i}" for i in range(6))
        assert result.token_source == "usage" and result.output_tokens == 6
        assert result.prompt_tokens == count_tokens(request.prompt)
        assert len(result.chunk_times) == 6 and len(result.itls) == 5
        assert result.start < result.chunk_times[0] <= result.chunk_times[-1] <= result.end
        # The stand-in sleeps 10 ms before the first token and 2 ms before each later one.
        assert result.ttft >= 0.01 and result.e2e >= 0.01 + 5 * 0.002
        assert all(gap >= 0 for gap in result.itls)
    assert run.report["total_output_tokens"] == 30
    body = server.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6 and body["model"] == MODEL
    assert ("messages" in body) == (endpoint == "chat") and "ignore_eos" not in body


def test_several_tokens_per_chunk(standin):
    server = standin(tokens_per_chunk=3)
    run = benchmark(StreamClient(server.url, MODEL), make_requests(3, output_len=7), LoadShape(), SLO(), progress=False)
    # 7 tokens in chunks of 3, 3, 1: usage still gives 7 tokens; ITL has one gap per pair of chunks.
    assert [len(r.chunk_times) for r in run.results] == [3, 3, 3]
    assert [r.output_tokens for r in run.results] == [7, 7, 7]
    assert all(r.tpot == pytest.approx((r.e2e - r.ttft) / 6) for r in run.results)


def test_without_usage_tokens_come_from_the_servers_tokenizer(standin):
    server = standin(send_usage=False, tokens_per_chunk=2)
    tokenizer = ServerTokenizer.probe(server.url, MODEL, None)
    run = benchmark(StreamClient(server.url, MODEL), make_requests(3, 5), LoadShape(), SLO(), tokenizer, progress=False)
    assert [(r.token_source, r.output_tokens) for r in run.results] == [("tokenizer", 5)] * 3
    assert run.report["config"]["token_sources"] == {"tokenizer": 3}


def test_without_usage_or_tokenizer_chunks_are_counted(standin):
    server = standin(send_usage=False, serve_tokenize=False, tokens_per_chunk=2)
    assert ServerTokenizer.probe(server.url, MODEL, None) is None
    run = benchmark(StreamClient(server.url, MODEL), make_requests(3, 5), LoadShape(), SLO(), WordCounter(),
                    progress=False)
    assert [(r.token_source, r.output_tokens) for r in run.results] == [("chunks", 3)] * 3


def test_failures_are_counted_and_the_run_goes_on(standin):
    server = standin()
    requests = make_requests(6)
    for i, word in enumerate(["REJECT", "BREAK", "EVENT", "PLAIN"], start=1):
        requests[i] = BenchRequest(f"please {word} this", 4, 6)
    run = benchmark(StreamClient(server.url, MODEL), requests, LoadShape(), SLO(), progress=False)
    assert [r.success for r in run.results] == [True, False, False, False, False, True]
    errors = [r.error for r in run.results]
    assert errors[1].startswith("HTTP 400") and "rejected on purpose" in errors[1]
    assert errors[2].startswith("error event") and "broke on purpose" in errors[2]
    assert errors[3].startswith("error event") and "named error event" in errors[3]
    assert "no server-sent events (application/json)" in errors[4]
    report = run.report
    assert (report["completed"], report["failed"]) == (2, 4) and report["slo_attainment"] == pytest.approx(1 / 3)
    assert sum(report["errors"].values()) == 4


def test_unreachable_server_fails_every_request_without_raising():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, not listening: connections are refused
        run = benchmark(StreamClient(url, MODEL), make_requests(3), LoadShape(), SLO(), progress=False)
    assert run.report["completed"] == 0 and run.report["failed"] == 3
    assert all("ConnectError" in r.error for r in run.results)


def test_concurrency_cap_holds_on_the_server(standin):
    server = standin(first_token_delay_s=0.05)
    run = benchmark(StreamClient(server.url, MODEL), make_requests(8), LoadShape(max_concurrency=2), SLO(),
                    progress=False)
    assert run.report["completed"] == 8
    assert server.state.max_in_flight == 2
    uncapped = standin(first_token_delay_s=0.05)
    benchmark(StreamClient(uncapped.url, MODEL), make_requests(8), LoadShape(), SLO(), progress=False)
    assert uncapped.state.max_in_flight > 2


def test_requests_are_not_sent_before_their_arrival_time(standin):
    server = standin()
    load = LoadShape(request_rate=40.0, burstiness=0.5, seed=5)
    run = benchmark(StreamClient(server.url, MODEL), make_requests(12, 2), load, SLO(), progress=False)
    arrivals = arrival_times(12, 40.0, 0.5, seed=5)
    assert all(r.start >= at for r, at in zip(run.results, arrivals))
    assert max(r.start for r in run.results) >= 12 / 40.0
    assert run.report["config"]["request_rate"] == 40.0


def test_ignore_eos_and_api_key_are_sent(standin):
    server = standin(api_key="sekrit")
    requests = make_requests(2)
    denied = benchmark(StreamClient(server.url, MODEL), requests, LoadShape(), SLO(), progress=False)
    assert denied.report["failed"] == 2 and "HTTP 401" in denied.results[0].error
    client = StreamClient(server.url, MODEL, api_key="sekrit", ignore_eos=True)
    assert benchmark(client, requests, LoadShape(), SLO(), progress=False).report["completed"] == 2
    assert server.state.bodies[-1]["ignore_eos"] is True
    assert list_models(server.url, "sekrit") == [MODEL]


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                                 "http://h:8000/v1/completions", "http://h:8000/v1/chat/completions/"])
def test_api_root(url):
    assert api_root(url) == "http://h:8000"


@pytest.mark.parametrize("url", ["ftp://h:1", "h:8000", "", "http://"])
def test_api_root_rejects(url):
    with pytest.raises(ValueError, match="--base-url"):
        api_root(url)


def test_infinite_rate_is_reported_as_a_string(standin):
    server = standin()
    run = benchmark(StreamClient(server.url, MODEL), make_requests(1), LoadShape(request_rate=math.inf), SLO(),
                    progress=False)
    assert run.report["config"]["request_rate"] == "inf"


def test_a_request_past_its_timeout_fails(standin):
    server = standin(first_token_delay_s=1.0)
    run = benchmark(StreamClient(server.url, MODEL), make_requests(2), LoadShape(timeout_s=0.2), SLO(), progress=False)
    assert run.report["failed"] == 2
    assert all(r.error.startswith("ReadTimeout") for r in run.results)
