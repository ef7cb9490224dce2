"""API key (401), a full queue (429 + Retry-After), and a KV cache too small for a request (400)."""

import httpx
import openai
import pytest

from .conftest import ServerProcess
from .helpers import check_error
from .tiny_model import build_tiny_model

AUTH = {"Authorization": "Bearer sekret"}


def test_missing_or_wrong_key_is_401(strict_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        response = httpx.post(strict_server.base + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        check_error(response, 401)
    check_error(httpx.get(strict_server.base + "/v1/models"), 401)
    bad = openai.OpenAI(base_url=strict_server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=strict_server.base + "/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    assert httpx.get(strict_server.base + "/health").status_code == 200  # health needs no key


def test_request_that_can_never_fit_the_kv_cache_is_400_and_does_not_block(strict_server):
    # 64 blocks of 16 tokens: 1024 tokens in all, fewer than --max-model-len 4096.
    error = check_error(httpx.post(strict_server.base + "/v1/completions", headers=AUTH,
                                    json={"prompt": [5] * 1500, "max_tokens": 4}), 400, "prompt")
    assert "KV cache" in error["message"]
    error = check_error(httpx.post(strict_server.base + "/v1/completions", headers=AUTH,
                                    json={"prompt": [5] * 10, "max_tokens": 1020}), 400, "max_tokens")
    assert "KV cache" in error["message"]
    ok = httpx.post(strict_server.base + "/v1/completions", headers=AUTH,
                    json={"prompt": [5] * 10, "max_tokens": 4, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_full_queue_is_429_with_retry_after(strict_server):
    # --max-num-seqs 1 --max-queue 1: two sequences fit, a third is refused until they are gone.
    body = {"prompt": [5], "max_tokens": 500, "n": 2, "stream": True, "ignore_eos": True}
    more = {"prompt": [5], "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        check_error(http.post(strict_server.base + "/v1/completions", headers=AUTH, json={**more, "n": 3}), 400, "n")
        with http.stream("POST", strict_server.base + "/v1/completions", headers=AUTH, json=body) as held:
            assert held.status_code == 200
            # The stream is admitted as soon as its headers arrive; it stays admitted until it ends.
            refused = http.post(strict_server.base + "/v1/completions", headers=AUTH, json=more)
            if refused.status_code == 200:
                pytest.fail("the held stream finished before the second request arrived")
            check_error(refused, 429)
            assert int(refused.headers["Retry-After"]) >= 1
            # One child runs, the other waits in the engine's queue (--max-num-seqs 1).
            lines = held.iter_lines()  # keep a reference: a collected iterator closes the response
            assert next(lines).startswith("data: {")
            m = strict_server.metrics()
            assert (m["ninefold:num_requests_running"], m["ninefold:num_requests_waiting"]) == (1, 1)
        # Closing the stream aborts both children, the waiting one included.
    m = strict_server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert m['ninefold:request_success_total{finished_reason="abort",model_name="tiny"}'] == 2
    again = httpx.post(strict_server.base + "/v1/completions", headers=AUTH, json=more, timeout=60)
    assert again.status_code == 200


def test_ids_the_tokenizer_has_but_the_model_lacks_are_400_before_any_stream_starts(tmp_path):
    # The server once checked prompt ids against the tokenizer (384 tokens here) and the engine against
    # the model (300 rows): id 310 passed the first, then failed in the engine after a streamed 200.
    model = build_tiny_model(tmp_path / "model", model_vocab=300)
    server = ServerProcess(model, tmp_path, "--max-model-len", "512", "--num-kv-blocks", "64")
    try:
        for stream in (False, True):
            for body in ({"prompt": [5, 310]}, {"prompt": [5], "logit_bias": {"310": 1}},
                         {"prompt": [5], "stop_token_ids": [310]}):
                response = httpx.post(server.base + "/v1/completions", timeout=60,
                                      json={**body, "max_tokens": 2, "stream": stream})
                check_error(response, 400, next(k for k in body if k != "prompt") if len(body) > 1 else "prompt",
                            "[0, 300)")
        ok = httpx.post(server.base + "/v1/completions", json={"prompt": [5, 299], "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        assert server.stop() == 0
