"""Prometheus counters and histograms move by what a request did; the CLI fails cleanly."""

import subprocess
import sys

import httpx

PREFIX = "ninefold:"


def test_token_counters_and_latency_histograms(server, client):
    before = server.metrics()
    out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=9, seed=0,
                                    extra_body={"ignore_eos": True})
    after = server.metrics()

    def grew(name: str) -> float:
        return after.get(PREFIX + name, 0.0) - before.get(PREFIX + name, 0.0)

    assert grew("prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("generation_tokens_total") == 9
    assert grew("time_to_first_token_seconds_count") == 1
    assert grew("inter_token_latency_seconds_count") == 8
    assert grew("e2e_request_latency_seconds_count") == 1
    assert grew("request_success_total") == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate"):
        assert PREFIX + gauge in after
    text = httpx.get(server.base + "/metrics").text
    assert "# TYPE ninefold:time_to_first_token_seconds histogram" in text


def test_rejections_are_counted(server):
    before = server.metrics().get(PREFIX + "request_rejected_total", 0.0)
    httpx.post(server.base + "/v1/completions", json={"prompt": "x", "top_p": 7})
    assert server.metrics()[PREFIX + "request_rejected_total"] == before + 1


def test_serve_help_and_bad_model_exit_cleanly(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "ninefold", "serve", "--help"], capture_output=True,
                               text=True, timeout=120)
    assert help_text.returncode == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--max-model-len", "--max-num-seqs", "--max-queue",
                 "--served-model-name", "--dtype", "--device"):
        assert flag in help_text.stdout
    missing = subprocess.run([sys.executable, "-m", "ninefold", "serve", "--model", str(tmp_path / "nope.gguf")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2
    assert "nope.gguf" in missing.stderr and "Traceback" not in missing.stderr
