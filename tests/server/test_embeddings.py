"""``POST /v1/embeddings`` on the live tiny server through the official ``openai`` client.

The tiny model's attention and MLP add nothing (tests/server/tiny_model.py), so a token's final hidden
state is its embedding row through the final RMSNorm (weight 1): the expected vectors come straight from
the checkpoint's tensors.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

TEXTS = ["Hello world, this is a tiny test model", "The quick brown fox", "汉字测试"]


@pytest.fixture(scope="module")
def expected(tiny_model):
    """(tokenizer, function: token ids -> (normalized, raw) last-token embedding)."""
    table = load_file(str(tiny_model.path / "model.safetensors"))["model.embed_tokens.weight"].astype(np.float64)
    tokenizer = Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))

    def vector(ids):
        row = table[ids[-1]]
        return row / np.linalg.norm(row), row / np.sqrt(np.mean(row**2) + 1e-6)

    return tokenizer, vector


def test_openai_client_embeddings_match_the_checkpoint(client, expected):
    tokenizer, vector = expected
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    result = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    assert result.object == "list" and result.model == "tiny" and [d.index for d in result.data] == [0, 1, 2]
    got = np.array([d.embedding for d in result.data])
    np.testing.assert_allclose(got, [vector(i)[0] for i in ids], atol=1e-5)
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    as_floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in as_floats.data], got, atol=1e-7)
    by_ids = client.embeddings.create(model="tiny", input=ids[1])  # one prompt as token ids
    np.testing.assert_allclose(by_ids.data[0].embedding, got[1], atol=1e-7)
    many = client.embeddings.create(model="tiny", input=ids)  # several, as lists of token ids
    np.testing.assert_allclose([d.embedding for d in many.data], got, atol=1e-7)


def test_raw_base64_and_vllm_extensions(server, expected):
    tokenizer, vector = expected
    ids = tokenizer.encode(TEXTS[0]).ids
    body = {"model": "tiny", "input": TEXTS[0], "encoding_format": "base64", "normalize": False,
            "truncate_prompt_tokens": 3}
    reply = httpx.post(server.base + "/v1/embeddings", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    values = np.frombuffer(base64.b64decode(data["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(values, vector(ids)[1], rtol=1e-5, atol=1e-5)
    assert data["usage"]["prompt_tokens"] == 3 and data["id"].startswith("embd-")


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": []}, 400, "input", "must not be empty"),
    ({"input": ["fine", ""]}, 400, "input", "item 1 is empty"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions", "not trained for shortened"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", ""),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ({"input": [[5, 100000]]}, 400, "input", "out of the vocabulary"),
    ({"input": [1] * 5000}, 400, "input", "one step of at most 4096"),
    ({"input": "x", "model": "other"}, 404, "model", ""),
])
def test_bad_embedding_requests_get_4xx_and_the_server_keeps_serving(server, client, body, status, param, words):
    reply = httpx.post(server.base + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert client.embeddings.create(model="tiny", input="still serving").data


def test_embeddings_run_beside_streaming_generation(async_client, expected):
    """Embedding requests sent while a long generation streams are answered correctly, and the stream completes
    (the engine thread interleaves embedding steps with generation steps)."""
    tokenizer, vector = expected

    async def run():
        stream = await async_client.completions.create(model="tiny", prompt="Hello", max_tokens=200, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True})
        generated = asyncio.ensure_future(_generated_tokens(stream))
        embedded = await asyncio.gather(*[async_client.embeddings.create(model="tiny", input=TEXTS)
                                          for _ in range(6)])
        return await generated, embedded

    tokens, embedded = asyncio.run(run())
    want = [vector(tokenizer.encode(t).ids)[0] for t in TEXTS]
    for result in embedded:
        np.testing.assert_allclose([d.embedding for d in result.data], want, atol=1e-5)
    assert tokens == 200


async def _generated_tokens(stream) -> int:
    """The stream's completion tokens, from its closing usage chunk."""
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    return usage.completion_tokens


def test_the_banner_names_the_pooling(server):
    assert "LAST pooling (default)" in server.log()


def test_a_decoder_only_checkpoint_serves_embeddings_and_refuses_text(tmp_path):
    """A real server process on a checkpoint saved without its output layer (as embedding models are)."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import openai

    from .conftest import ServerProcess

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llm"))
    from tiny_models import write_embedding_model

    path = write_embedding_model(tmp_path / "embedding-model", variant="llama", pooling="mean")
    proc = ServerProcess(SimpleNamespace(path=path), tmp_path)
    try:
        assert "embeddings only" in proc.log()
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        result = client.embeddings.create(model="tiny", input=["Hello world", "The quick brown fox"])
        assert [len(d.embedding) for d in result.data] == [64, 64]
        with pytest.raises(openai.BadRequestError, match="output layer"):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert client.embeddings.create(model="tiny", input="still serving").data
    finally:
        assert proc.stop() == 0


def test_chat_messages_are_embedded_through_the_chat_template(server, expected):
    """vLLM's ``messages`` form: the conversation rendered as /tokenize renders it (no generation prompt by default)."""
    _, vector = expected
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    tokens = httpx.post(server.base + "/tokenize", json={"model": "tiny", "messages": messages,
                                                         "add_generation_prompt": False}, timeout=60).json()["tokens"]
    reply = httpx.post(server.base + "/v1/embeddings", json={"model": "tiny", "messages": messages}, timeout=60)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["usage"]["prompt_tokens"] == len(tokens)
    np.testing.assert_allclose(data["data"][0]["embedding"], vector(tokens)[0], atol=1e-5)
    with_prompt = httpx.post(server.base + "/v1/embeddings", timeout=60, json={
        "model": "tiny", "messages": messages, "add_generation_prompt": True}).json()
    assert with_prompt["usage"]["prompt_tokens"] > len(tokens)
    empty = httpx.post(server.base + "/v1/embeddings", json={"model": "tiny", "messages": []}, timeout=60)
    assert empty.status_code == 400
