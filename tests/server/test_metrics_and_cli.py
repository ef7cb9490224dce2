"""Prometheus counters and histograms move by what a request did; the CLI fails cleanly."""

import re
import subprocess
import sys

import httpx

from .conftest import ServerProcess

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


def _cache_config(server) -> dict[str, str]:
    line = next(line for line in httpx.get(server.base + "/metrics").text.splitlines()
                if line.startswith(PREFIX + "cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def _prefix_hits_after_repeating_a_prompt(server) -> float:
    """Prefix-cache hit tokens that two identical 40-token prompts, one after the other, add."""
    before = server.metrics().get(PREFIX + "prefix_cache_hits_total", 0.0)
    for _ in range(2):
        response = httpx.post(server.base + "/v1/completions", timeout=120,
                              json={"model": "tiny", "prompt": list(range(3, 43)), "max_tokens": 2})
        assert response.status_code == 200, response.text
    return server.metrics()[PREFIX + "prefix_cache_hits_total"] - before


def test_vllm_cache_flags_reach_the_engine(server, tiny_model, tmp_path):
    """--block-size, --no-enable-prefix-caching, --gpu-memory-utilization and --enforce-eager, as vLLM spells them:
    /metrics' cache_config_info shows them, and the second of two identical prompts hits no cached block."""
    assert _cache_config(server)["block_size"] == "16" and _cache_config(server)["enable_prefix_caching"] == "True"
    assert _prefix_hits_after_repeating_a_prompt(server) >= 32  # the default server reuses the first prompt's blocks
    flagged = ServerProcess(tiny_model, tmp_path, "--block-size", "8", "--no-enable-prefix-caching",
                            "--gpu-memory-utilization", "0.5", "--enforce-eager", "--max-model-len", "512")
    try:
        config = _cache_config(flagged)
        assert (config["block_size"], config["enable_prefix_caching"], config["gpu_memory_utilization"]) == \
            ("8", "False", "0.5")
        assert _prefix_hits_after_repeating_a_prompt(flagged) == 0
    finally:
        assert flagged.stop() == 0


def test_bad_cache_flags_exit_before_loading():
    for flag, value, accepted in (("--gpu-memory-utilization", "1.5", "a fraction in (0, 1]"),
                                  ("--gpu-memory-utilization", "nan", "a fraction in (0, 1]"),
                                  ("--block-size", "0", "an integer >= 1")):
        run = subprocess.run([sys.executable, "-m", "ninefold", "serve", flag, value], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2
        assert f"argument {flag}: expected {accepted}, got '{value}'" in run.stderr


def test_cache_flags_become_engine_arguments_only_when_given():
    import argparse

    from ninefold.cli._common import add_cache_arguments, cache_engine_args

    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    assert cache_engine_args(parser.parse_args([])) == {}
    assert cache_engine_args(parser.parse_args(["--enforce-eager", "--no-enable-prefix-caching", "--block-size", "32",
                                                "--gpu-memory-utilization", "0.25", "--max-model-len", "100",
                                                "--num-kv-blocks", "7"])) == {
        "enforce_eager": True, "enable_prefix_caching": False, "block_size": 32, "gpu_memory_utilization": 0.25,
        "max_model_len": 100, "num_kv_blocks": 7}
    assert cache_engine_args(parser.parse_args(["--enable-prefix-caching"])) == {"enable_prefix_caching": True}
