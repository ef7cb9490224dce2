"""``bench serve`` against a live ``ninefold serve`` process with a tiny model on 127.0.0.1.

The server process and the tiny checkpoint come from the server tests (tests/server, the package
``server`` next to this one), so both areas exercise the same live server.
"""

import json
import os
import subprocess
import sys

import pytest

from ninefold.bench.serve import LoadShape, benchmark
from ninefold.bench.serve_client import ServerTokenizer, StreamClient
from ninefold.bench.serve_datasets import random_requests
from ninefold.bench.serve_metrics import SLO
from server.conftest import ServerProcess, build_tiny_model

from .test_serve_cli import PNG_MAGIC, check_report


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("bench-tiny-model"))


@pytest.fixture(scope="module")
def ninefold_server(tiny_model, tmp_path_factory):
    server = ServerProcess(tiny_model, tmp_path_factory.mktemp("bench-server-logs"), "--max-model-len", "1024",
                           "--max-num-seqs", "16", "--num-kv-blocks", "256")
    yield server
    server.stop()


def test_report_and_plot_from_the_command(ninefold_server, tmp_path):
    out, plot = tmp_path / "result.json", tmp_path / "result.png"
    command = [sys.executable, "-m", "ninefold", "bench", "serve", "--base-url", ninefold_server.base,
               "--num-prompts", "12", "--input-len", "16:48", "--output-len", "6:16", "--request-rate", "12",
               "--max-concurrency", "8", "--slo", "ttft=10s,itl=5s,e2e=60s", "--ignore-eos",
               "--output", str(out), "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    check_report(report, 12)
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["config"]["token_counter"] == "server /tokenize"
    assert report["config"]["token_sources"] == {"usage": 12}
    assert all(16 <= r["prompt_tokens"] <= 48 and 6 <= r["output_tokens"] <= 16 for r in report["requests"])
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert "SLO attainment" in done.stdout


def test_chat_run_counts_what_was_asked(ninefold_server):
    tokenizer = ServerTokenizer.probe(ninefold_server.base, "tiny", None)
    assert tokenizer is not None
    requests = random_requests(8, (10, 40), (4, 12), tokenizer, seed=1)
    client = StreamClient(ninefold_server.base, "tiny", endpoint="chat", ignore_eos=True)
    run = benchmark(client, requests, LoadShape(request_rate=20.0, seed=1), SLO.parse("e2e=60s"), tokenizer,
                    progress=False)
    assert run.report["completed"] == 8, run.report["errors"]
    for result, request in zip(run.results, requests):
        # ignore_eos makes every request run to its max_tokens, and the server's usage says so.
        assert result.token_source == "usage" and result.output_tokens == request.output_len
        assert 1 <= len(result.chunk_times) <= result.output_tokens and result.ttft > 0
    # Completion prompts were sized with the server's tokenizer; chat wraps them in a template, so longer.
    assert all(r.prompt_tokens > q.prompt_len for r, q in zip(run.results, requests))
    assert run.report["slo_attainment"] == 1.0


def test_completion_prompts_have_the_sized_length(ninefold_server):
    tokenizer = ServerTokenizer.probe(ninefold_server.base, "tiny", None)
    requests = random_requests(6, (20, 20), (2, 2), tokenizer, seed=2)
    run = benchmark(StreamClient(ninefold_server.base, "tiny", ignore_eos=True), requests, LoadShape(), SLO(),
                    tokenizer, progress=False)
    assert [r.prompt_tokens for r in run.results] == [q.prompt_len for q in requests]
    assert sum(q.prompt_len == 20 for q in requests) >= 5


def test_one_command_gpu_path_on_the_cpu(tiny_model, tmp_path):
    """``python -m ninefold.bench.serve_local`` (the command the lead runs on the GPU) on the CPU."""
    command = [sys.executable, "-m", "ninefold.bench.serve_local", "--model", str(tiny_model.path), "--device", "cpu",
               "--rates", "8,32", "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4",
               "--server-arg=--max-model-len=512"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ, OUT=str(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "streamed text == non-streamed text: ok" in done.stdout
    check_report(json.loads((tmp_path / "serve_inf.json").read_text()), 4)
    sweep = json.loads((tmp_path / "serve_sweep.json").read_text())
    assert [run["config"]["request_rate"] for run in sweep["runs"]] == [8.0, 32.0]
    for name in ("serve_inf.png", "serve_sweep.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "server.log").is_file()


def test_embeddings_endpoint_reports_end_to_end_latency_and_prompt_tokens(ninefold_server, tmp_path):
    """``--endpoint embeddings``: one prompt per request; no output tokens, so no TTFT/ITL/TPOT, only E2E."""
    out, plot = tmp_path / "embeddings.json", tmp_path / "embeddings.png"
    command = [sys.executable, "-m", "ninefold", "bench", "serve", "--base-url", ninefold_server.base,
               "--endpoint", "embeddings", "--num-prompts", "10", "--input-len", "8:40", "--request-rate", "20",
               "--slo", "e2e=60s", "--output", str(out), "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 10 and report["failed"] == 0 and report["total_output_tokens"] == 0
    assert report["config"]["token_sources"] == {"usage": 10}
    assert all(8 <= r["prompt_tokens"] <= 40 for r in report["requests"])
    assert report["total_input_tokens"] == sum(r["prompt_tokens"] for r in report["requests"])
    assert report["ttft_ms"]["median"] is None and report["e2e_ms"]["median"] > 0
    assert report["slo_attainment"] == 1.0 and "/v1/embeddings" in done.stdout
    assert plot.read_bytes()[:8] == PNG_MAGIC
