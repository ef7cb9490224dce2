"""``ninefold serve -tp 2``: a live server whose engine spans two processes, through the openai client."""

import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai

from .conftest import ServerProcess
from .tiny_model import CHAIN_TEXT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir, write_lora_adapter  # noqa: E402


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


def test_a_two_rank_server_serves_adapters_given_at_start_and_loaded_at_runtime(tmp_path):
    """``--lora-modules`` and ``/v1/load_lora_adapter`` with ``-tp 2``: each model name gives what a one-device
    engine gives under that adapter, also when one slot makes the adapters take turns (rewritten on both ranks)."""
    from ninefold import LLM, LoRARequest, SamplingParams

    base = build_model_dir(tmp_path / "base", "qwen2")
    adapters = {"a": write_lora_adapter(base, tmp_path / "a", r=8, seed=1),
                "b": write_lora_adapter(base, tmp_path / "b", r=4, seed=2, target_modules=("q_proj", "v_proj"))}
    prompt, params = "The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(base), device="cpu", enable_lora=True, block_size=8, num_kv_blocks=64) as one_device:
        expected = {name: one_device.generate([prompt], params, lora_request=LoRARequest(name, i + 1, str(path)) if
                                              path else None)[0].outputs[0].text
                    for i, (name, path) in enumerate((("a", adapters["a"]), ("b", adapters["b"]), ("tiny", None)))}
    assert len(set(expected.values())) == 3
    server = ServerProcess(SimpleNamespace(path=base), tmp_path, "--tensor-parallel-size", "2", "--num-kv-blocks",
                           "64", "--lora-modules", f"a={adapters['a']}", "--max-loras", "1",
                           "--allow-runtime-lora-updating")
    try:
        reply = httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path":
                                                                          str(adapters["b"])}, timeout=60)
        assert reply.status_code == 200, reply.text
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        for name in ("a", "b", "tiny", "a", "b"):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected[name], name
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
