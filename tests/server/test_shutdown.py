"""SIGTERM drains: no new requests, running ones finish (or get an SSE error event at the deadline), exit 0."""

import signal
import threading

import httpx
import openai
import pytest

from .conftest import ServerProcess


@pytest.fixture
def draining_server(tiny_model, tmp_path):
    proc = ServerProcess(tiny_model, tmp_path, "--max-model-len", "8192", "--num-kv-blocks", "1024",
                         "--drain-timeout", "3")
    yield proc
    proc.stop(signal.SIGKILL)


def test_sigterm_drains_then_exits_zero(draining_server):
    server = draining_server
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    short = client.completions.create(model="tiny", prompt="Hi", max_tokens=30, stream=True, seed=0,
                                      extra_body={"ignore_eos": True, "min_tokens": 30})
    long = client.completions.create(model="tiny", prompt="Hi", max_tokens=8000, stream=True,
                                     extra_body={"ignore_eos": True})
    first_short, first_long = next(iter(short)), next(iter(long))
    assert first_short.choices and first_long.choices

    server.proc.send_signal(signal.SIGTERM)
    # Let the drain begin, then check that new requests are turned away with 503 + Retry-After.
    refused = None
    for _ in range(200):
        try:
            refused = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        except httpx.TransportError:  # the listener may already be gone
            refused = None
            break
        if refused.status_code == 503:
            break
        threading.Event().wait(0.02)
    if refused is not None:
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["type"] == "service_unavailable"

    # The short stream finishes normally, with its finish_reason.
    rest = list(short)
    assert rest[-1].choices[0].finish_reason == "length"
    # The long one is cut at the 3 s deadline: an SSE error event after the first byte, raised by the client.
    with pytest.raises(openai.APIError, match="shut down"):
        for _ in long:
            pass
    assert server.proc.wait(60) == 0
