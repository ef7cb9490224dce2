"""A client that goes away aborts its sequences (streaming, non-streaming, every n > 1 child)."""

import httpx
import pytest

ABORT = 'ninefold:request_success_total{finished_reason="abort",model_name="tiny"}'


def _aborted(server) -> float:
    return server.metrics().get(ABORT, 0.0)


def test_streaming_disconnect_aborts_and_frees_blocks(server):
    before = _aborted(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "n": 3, "stream": True, "ignore_eos": True, "seed": 1}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            seen = sum(1 for _, line in zip(range(20), lines) if line.startswith("data: {"))
            assert seen > 0
            m = server.metrics()
            assert m["ninefold:num_free_kv_blocks"] < m["ninefold:num_kv_blocks"]
        # leaving the block closes the connection mid-stream
    m = server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert m["ninefold:num_requests_running"] == 0
    assert _aborted(server) - before == 3  # all three children were aborted, none ran to 4000 tokens


def test_non_streaming_disconnect_aborts_every_child(server):
    before = _aborted(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "n": 2, "ignore_eos": True, "seed": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    m = server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert _aborted(server) - before == 2


def test_many_streams_disconnecting_at_once(server):
    before = _aborted(server)
    body = {"prompt": [5, 6], "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", server.base + "/v1/completions", json=body) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)
        next(responses[0].iter_lines())
        for s in streams:
            s.__exit__(None, None, None)
    m = server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert _aborted(server) - before == 4
