"""``ninefold serve --speculative-config --scheduling-policy priority``: the same greedy text as without
speculation, drafts counted in /metrics; request priorities accepted (a first-come server refuses them)."""

import json
import subprocess
import sys

import httpx
import openai
import pytest

from .conftest import ServerProcess

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
PROMPTS = ["abcabcabcabcabc", "Hello Hello Hello Hello", "one two three one two three one"]


@pytest.fixture(scope="module")
def spec_server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("spec-logs"), "--max-model-len", "2048",
                         "--speculative-config", NGRAM, "--scheduling-policy", "priority")
    yield proc
    assert proc.stop() == 0


def test_greedy_text_matches_the_plain_server_and_drafts_are_counted(spec_server, server):
    plain = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    spec = openai.OpenAI(base_url=spec_server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    before = spec_server.metrics()
    args = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    for prompt in PROMPTS:
        expected = plain.completions.create(prompt=prompt, **args).choices[0].text
        assert spec.completions.create(prompt=prompt, **args).choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in spec.completions.create(prompt=prompt, stream=True, **args))
        assert streamed == expected
    after = spec_server.wait_idle()
    drafted = after["ninefold:spec_decode_num_draft_tokens_total"] - before["ninefold:spec_decode_num_draft_tokens_total"]
    accepted = (after["ninefold:spec_decode_num_accepted_tokens_total"]
                - before["ninefold:spec_decode_num_accepted_tokens_total"])
    assert drafted > 0 and 0 <= accepted <= drafted
    assert after["ninefold:num_free_kv_blocks"] == after["ninefold:num_kv_blocks"]


@pytest.mark.parametrize("value, message", [
    ('{"method": "medusa"}', "speculative_config.method"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ("ngram", "expected a JSON object"),
])
def test_bad_speculative_config_exits_with_a_usage_error(value, message):
    done = subprocess.run([sys.executable, "-m", "ninefold", "serve", "--speculative-config", value],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--speculative-config" in done.stderr and message in done.stderr and "Traceback" not in done.stderr


def test_priority_needs_the_priority_policy(spec_server, server):
    body = {"prompt": "Hello", "max_tokens": 3, "priority": -5, "ignore_eos": True}  # (a random model may end early)
    ok = httpx.post(spec_server.base + "/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    refused = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
