"""LoRA adapters served as models of their own: a real ``ninefold serve`` process, the official ``openai`` client,
completions and chat against the engine's own output for the same adapter, ``/v1/models``, runtime loading and
unloading, and the 4xx cases (each followed by a served request)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from .conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
from tiny_models import build_model_dir, write_lora_adapter  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = build_model_dir(root / "base", "qwen2")
    adapters = {"sql": write_lora_adapter(base, root / "sql", r=8, seed=1),
                "chat": write_lora_adapter(base, root / "chat", r=4, seed=2, target_modules=("q_proj", "v_proj")),
                "late": write_lora_adapter(base, root / "late", r=8, seed=3, target_modules=("down_proj",)),
                "big": write_lora_adapter(base, root / "big", r=32, seed=4)}
    truncated = root / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_bytes((adapters["sql"] / "adapter_config.json").read_bytes())
    (truncated / "adapter_model.safetensors").write_bytes((adapters["sql"] / "adapter_model.safetensors").read_bytes()[:999])
    adapters["truncated"] = truncated
    proc = ServerProcess(SimpleNamespace(path=base), root, "--lora-modules", f"sql={adapters['sql']}",
                         f'{{"name": "chat", "path": "{adapters["chat"]}"}}', "--max-loras", "2",
                         "--allow-runtime-lora-updating", "--max-num-seqs", "8")
    yield proc, base, adapters
    assert proc.stop() == 0


def reference(base, adapter, prompt, max_tokens, chat=False):
    """What the engine itself generates greedily for ``prompt`` under ``adapter`` (None: the base model)."""
    from ninefold import LLM, LoRARequest, SamplingParams

    if not hasattr(reference, "llm"):
        reference.llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=2, block_size=8, num_kv_blocks=64)
    lora = LoRARequest(Path(adapter).name, {"sql": 1, "chat": 2, "late": 3}[Path(adapter).name], str(adapter)) \
        if adapter else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if chat:
        return reference.llm.chat([{"role": "user", "content": prompt}], params, lora_request=lora)[0].outputs[0].text
    return reference.llm.generate([prompt], params, lora_request=lora)[0].outputs[0].text


def test_each_model_name_runs_its_adapter(lora_server):
    proc, base, adapters = lora_server
    client = openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "sql", "chat"]
    cards = {m.id: m.model_dump() for m in models}
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == str(adapters["sql"])
    assert client.models.retrieve("chat").id == "chat"
    texts = {}
    for name, adapter in (("tiny", None), ("sql", adapters["sql"]), ("chat", adapters["chat"])):
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.model == name
        texts[name] = reply.choices[0].text
        assert texts[name] == reference(base, adapter, PROMPT, 12), name
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert chat.model == "chat"
    assert chat.choices[0].message.content == reference(base, adapters["chat"], PROMPT, 10, chat=True)
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == texts["sql"]


def test_metrics_name_the_adapters_running(lora_server):
    proc, _, _ = lora_server
    client = openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def info() -> str:
        lines = [line for line in httpx.get(proc.base + "/metrics", timeout=10).text.splitlines()
                 if line.startswith("ninefold:lora_requests_info{")]
        assert len(lines) == 1
        return lines[0]

    assert 'max_lora="2"' in info() and 'running_lora_adapters=""' in info()
    seen = set()
    stream = client.completions.create(model="chat", prompt=PROMPT, max_tokens=480, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i % 20 == 1:
            seen.add(info().split("running_lora_adapters=")[1].split(",")[0])
    assert '"chat"' in seen


def test_adapters_load_and_unload_while_serving(lora_server):
    proc, base, adapters = lora_server
    client = openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = httpx.post(proc.base + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path":
                                                                   str(adapters["late"])}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "late" in [m.id for m in client.models.list().data]
    text = client.completions.create(model="late", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text == reference(base, adapters["late"], PROMPT, 8)
    assert httpx.post(proc.base + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
    assert "late" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=4)


@pytest.mark.parametrize("route, body, status, param, words", [
    ("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}, 404, "model", "'nope' does not exist"),
    ("/v1/embeddings", {"model": "sql", "input": "x"}, 400, "model", "applies to generation only"),
    ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/tmp"}, 400, "lora_name", "already served"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "lora_path", "not a directory"),
    ("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "BIG"}, 400, "lora_path", "max_lora_rank=16"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", ""),
    ("/v1/load_lora_adapter", {"lora_name": "t", "lora_path": "TRUNCATED"}, 400, "lora_path", "cannot read"),
    ("/v1/unload_lora_adapter", {"lora_name": "never"}, 404, "lora_name", "not loaded"),
])
def test_bad_lora_requests_get_4xx_and_the_server_keeps_serving(lora_server, route, body, status, param, words):
    proc, _, adapters = lora_server
    named = {"BIG": str(adapters["big"]), "TRUNCATED": str(adapters["truncated"])}
    body = {k: named.get(v, v) for k, v in body.items()}
    reply = httpx.post(proc.base + route, json=body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(proc.base + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_lora_flags_are_checked_at_start(tmp_path, lora_server):
    _, base, adapters = lora_server
    for args, words in ((("--lora-modules", "broken"), "expected NAME=PATH"),
                        (("--lora-modules", f"a={adapters['big']}"), "max_lora_rank=16"),
                        (("--lora-modules", f"a={adapters['sql']}", f"a={adapters['chat']}"), "given twice")):
        with pytest.raises(RuntimeError, match="exited") as info:
            ServerProcess(SimpleNamespace(path=base), tmp_path, *args)
        assert words in str(info.value)


def test_concurrent_requests_over_more_adapters_than_slots(lora_server):
    """Twelve streams at once over three adapters and the base model with two slots: adapters take turns, every
    answer is the one the adapter gives alone, and afterwards nothing holds a slot or a KV block."""
    proc, base, adapters = lora_server
    extra = httpx.post(proc.base + "/v1/load_lora_adapter", json={"lora_name": "late2", "lora_path":
                                                                   str(adapters["late"])}, timeout=60)
    assert extra.status_code == 200, extra.text
    names = ["sql", "chat", "late2", "tiny"] * 3
    prompts = [f"{PROMPT} {i}" for i in range(len(names))]
    client = openai.AsyncOpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(name, prompt):
        stream = await client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of():
        return await asyncio.gather(*(one(n, p) for n, p in zip(names, prompts)))

    texts = asyncio.run(all_of())
    paths = {"sql": adapters["sql"], "chat": adapters["chat"], "late2": adapters["late"], "tiny": None}
    for name, prompt, text in zip(names, prompts, texts):
        assert text == reference(base, paths[name], prompt, 10), name
    idle = proc.wait_idle()
    assert idle["ninefold:num_free_kv_blocks"] == idle["ninefold:num_kv_blocks"]
    info = next(line for line in httpx.get(proc.base + "/metrics", timeout=10).text.splitlines()
                if line.startswith("ninefold:lora_requests_info{"))
    assert 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info
    assert httpx.post(proc.base + "/v1/unload_lora_adapter", json={"lora_name": "late2"}, timeout=60).status_code == 200
