"""The server on a CUDA engine (skipped without CUDA): `python -m pytest tests/server -k cuda -q`."""

import asyncio
import signal

import httpx
import openai
import pytest
import torch

from .conftest import ServerProcess
from .tiny_model import CHAIN_TEXT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("cuda-logs"), "--device", "cuda", "--max-model-len",
                         "8192", "--num-kv-blocks", "2048", "--max-num-seqs", "256")
    yield proc
    assert proc.stop(signal.SIGTERM) == 0


def test_cuda_greedy_chain_and_streamed_cjk(cuda_server, tiny_model):
    client = openai.OpenAI(base_url=cuda_server.base + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="tiny", prompt=[tiny_model.trigger_id], max_tokens=50, temperature=0)
    assert out.choices[0].text == CHAIN_TEXT and out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=[tiny_model.trigger_id], max_tokens=50, temperature=0, stream=True)]
    assert "".join(pieces) == CHAIN_TEXT and not any("\ufffd" in p for p in pieces)


def test_cuda_seeded_sampling_is_reproducible(cuda_server):
    client = openai.OpenAI(base_url=cuda_server.base + "/v1", api_key="x", max_retries=0)
    args = dict(model="tiny", prompt="Hello", max_tokens=32, seed=3, n=2, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_cuda_200_concurrent_streams_and_disconnect(cuda_server):
    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=f"r{i}", max_tokens=16, stream=True, seed=i,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def main():
        http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=250))
        async with openai.AsyncOpenAI(base_url=cuda_server.base + "/v1", api_key="x", max_retries=0,
                                      http_client=http) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    assert asyncio.run(main()) == [16] * 200
    body = {"prompt": [5], "max_tokens": 8000, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", cuda_server.base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
    m = cuda_server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]


def test_cuda_required_tool_calls_follow_the_schemas(cuda_server, tiny_model):
    """Guided decoding's masks on the device (CUDA graphs, overlapped steps around guided rows): forced tool
    calls of a random model still follow the tools' parameter schemas."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2]}},
              "required": ["unit", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}},
             {"type": "function", "function": {"name": "ping"}}]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))
    no_blanks = {str(i): -100 for i in range(tok.get_vocab_size()) if (t := tok.decode([i])) and not t.strip()}
    client = openai.OpenAI(base_url=cuda_server.base + "/v1", api_key="x", max_retries=0)
    finished = 0
    for seed in range(6):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                             tools=tools, tool_choice="required", max_tokens=96, seed=seed,
                                             temperature=1.0, logit_bias=no_blanks).choices[0]
        if out.finish_reason == "length":
            continue
        finished += 1
        assert out.finish_reason == "tool_calls"
        for call in out.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, schema if call.function.name == "get_weather" else {"maxProperties": 0})
    assert finished >= 1
