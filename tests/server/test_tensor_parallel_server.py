"""``ninefold serve -tp 2``: a live server whose engine spans two processes, through the openai client."""

import signal
import time
from pathlib import Path

import openai

from .conftest import ServerProcess
from .tiny_model import CHAIN_TEXT


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_a_two_rank_server_answers_then_stops_its_worker(tiny_model, tmp_path):
    server = ServerProcess(tiny_model, tmp_path, "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        workers = [pid for pid in _children(server.proc.pid)
                   if "ninefold.llm.parallel.worker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
        assert len(workers) == 1, server.log()
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt=[tiny_model.trigger_id], max_tokens=50, temperature=0)
        assert out.choices[0].text == CHAIN_TEXT and out.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    deadline = time.monotonic() + 10
    while _alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(workers[0]), "the worker outlived the server"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_server_that_lost_a_worker_fails_its_health_check(tiny_model, tmp_path):
    import os

    import httpx

    server = ServerProcess(tiny_model, tmp_path, "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        (worker,) = [pid for pid in _children(server.proc.pid) if b"ninefold.llm.parallel.worker"
                     in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert httpx.get(server.base + "/health").status_code == 200
        os.kill(worker, signal.SIGKILL)
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            client.completions.create(model="tiny", prompt=[tiny_model.trigger_id], max_tokens=5, temperature=0)
            raise AssertionError("a completion succeeded without the worker")
        except openai.APIStatusError as error:
            assert error.status_code == 500
        health = httpx.get(server.base + "/health")
        assert health.status_code == 503 and "tensor-parallel workers gone: rank 1" in health.text, health.text
    finally:
        server.stop(signal.SIGTERM)
