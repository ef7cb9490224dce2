"""Prometheus counters and histograms move by what a request did; the CLI fails cleanly."""

import re
import subprocess
import sys

import httpx
import pytest

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
    assert cache_engine_args(parser.parse_args(["--kv-cache-dtype", "fp8"])) == {"kv_cache_dtype": "fp8"}


def test_the_default_served_name_is_the_models_file_or_directory_name():
    from ninefold.llm.server.engine import DEFAULT_SERVED_NAME, served_name

    assert served_name("/models/Llama-3.1-8B") == served_name("/models/Llama-3.1-8B/") == "Llama-3.1-8B"
    assert served_name("/models/smollm2-135m.Q4_K_M.gguf") == "smollm2-135m.Q4_K_M"
    assert served_name("/models/my-shape/config.json") == "my-shape"  # not "config.json"
    assert served_name("config.json") == "config.json" and served_name("llama-3.1-8b") == "llama-3.1-8b"
    assert served_name(None) == DEFAULT_SERVED_NAME


def test_dummy_weights_serve_what_an_engine_of_the_same_seed_generates(tiny_model, tmp_path):
    """vLLM's --load-format dummy (benchmarks without the weights) with --seed choosing them; the model directory's
    tokenizer still reads and writes the text."""
    from ninefold import LLM, SamplingParams

    prompt, params = "The quick brown fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(tiny_model.path), device="cpu", load_format="dummy", seed=3, num_kv_blocks=64).generate(
        [prompt], params)[0].outputs[0]
    real = LLM(str(tiny_model.path), device="cpu", num_kv_blocks=64).generate([prompt], params)[0].outputs[0]
    assert want.text and want.token_ids != real.token_ids  # (else the test could not tell the weights apart)
    dummy = ServerProcess(tiny_model, tmp_path, "--load-format", "dummy", "--seed", "3")
    try:
        response = httpx.post(dummy.base + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want.text
    finally:
        assert dummy.stop() == 0


def test_a_bare_config_serves_chat_with_dummy_weights_and_a_tokenizer_given_apart(tiny_model, tmp_path):
    """``--load-format dummy --tokenizer DIR`` for a config.json alone (vLLM's way to benchmark a shape with text):
    completions and chat in text, the chat template taken from the tokenizer directory."""
    import dataclasses

    import openai

    from ninefold import LLM, SamplingParams

    bare = dataclasses.replace(tiny_model, path=tiny_model.path / "config.json")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(bare.path), device="cpu", load_format="dummy", tokenizer=str(tiny_model.path),
               num_kv_blocks=64).chat([{"role": "user", "content": "hi"}], params)[0].outputs[0].text
    assert want  # text, not tokens only
    server = ServerProcess(bare, tmp_path, "--load-format", "dummy", "--tokenizer", str(tiny_model.path))
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == want
        text = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4)
        assert text.usage.prompt_tokens > 1 and text.usage.completion_tokens == 4
    finally:
        assert server.stop() == 0


def test_a_model_without_a_tokenizer_takes_token_ids_and_answers_text_with_a_400(tiny_model, tmp_path):
    """Dummy weights of a bare config.json: token ids in, token ids out (logprobs show "token_id:<id>"); text,
    chat messages and /tokenize are the client's 400 naming the field, and the server keeps serving."""
    import dataclasses

    import openai

    bare = dataclasses.replace(tiny_model, path=tiny_model.path / "config.json")
    server = ServerProcess(bare, tmp_path, "--load-format", "dummy")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    try:
        out = client.completions.create(model="tiny", prompt=list(range(3, 20)), max_tokens=4, temperature=0,
                                        logprobs=2, extra_body={"ignore_eos": True})
        tokens = out.choices[0].logprobs.tokens
        assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)
        for call, param in ((lambda: client.completions.create(model="tiny", prompt="hello", max_tokens=2), "prompt"),
                            (lambda: client.chat.completions.create(
                                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2), "messages")):
            with pytest.raises(openai.BadRequestError) as error:
                call()
            assert error.value.body["param"] == param
            assert "this model has no tokenizer" in error.value.body["message"]
        response = httpx.post(server.base + "/tokenize", json={"model": "tiny", "prompt": "hi"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        with pytest.raises(openai.BadRequestError, match="stop: this model has no tokenizer"):
            client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=4, stop=["a"])
        assert httpx.get(server.base + "/health", timeout=60).status_code == 200
    finally:
        assert server.stop() == 0


def test_a_chat_template_for_a_model_without_a_tokenizer_exits_naming_the_flag(tiny_model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    run = subprocess.run([sys.executable, "-m", "ninefold", "serve", "--model", str(tiny_model.path / "config.json"),
                          "--load-format", "dummy", "--device", "cpu", "--chat-template", str(template)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "argument --chat-template: this model has no tokenizer" in run.stderr
