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


def test_clients_that_leave_before_the_first_byte_release_their_admission(server):
    # Raw sockets that send a streaming request and hang up at once: some leave before the response
    # starts, some mid-stream; either way nothing stays admitted, running or holding KV blocks.
    import json
    import socket

    body = json.dumps({"prompt": [5, 6], "max_tokens": 3000, "stream": True, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request)
    m = server.wait_idle()
    assert m["ninefold:num_sequences_admitted"] == 0
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert m["ninefold:num_requests_running"] == 0
