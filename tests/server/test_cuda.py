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
