"""/v1/completions through the official openai client against a live server."""

import json

import httpx
import openai
import pytest
from tokenizers import Tokenizer

import ninefold

from .tiny_model import CHAIN_TEXT


@pytest.fixture(scope="module")
def reference_tokenizer(tiny_model):
    return Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))


def test_completion_text_usage_and_finish_reason(client, reference_tokenizer):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, seed=1,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.prompt_tokens == len(reference_tokenizer.encode(prompt).ids)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_greedy_scripted_path_stops_at_eos(client, tiny_model):
    out = client.completions.create(model="tiny", prompt=[tiny_model.trigger_id], max_tokens=50, temperature=0)
    assert out.choices[0].text == CHAIN_TEXT
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(tiny_model.chain_ids) + 1  # the EOS token counts


def test_streaming_matches_non_streaming_and_ends_with_reason_and_usage(client, reference_tokenizer):
    args = dict(model="tiny", prompt="Hello world", max_tokens=12, seed=7, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(reference_tokenizer.encode("Hello world").ids)
    assert chunks[-1].usage.completion_tokens == 12


def test_streamed_cjk_has_no_replacement_or_duplicated_characters(client, tiny_model):
    # Each character is three byte-level tokens: the stream must show whole characters only, once each.
    # (How many chunks it takes depends on timing, since outputs that are ready together are merged;
    # tests/server/test_deltas.py holds partial characters back deterministically.)
    chunks = list(client.completions.create(model="tiny", prompt=[tiny_model.trigger_id], max_tokens=50,
                                            temperature=0, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == CHAIN_TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_ends_generation_and_its_prefix_is_never_streamed(client, tiny_model):
    args = dict(model="tiny", prompt=[tiny_model.trigger_id], max_tokens=50, temperature=0, stop=["文好"])
    out = client.completions.create(**args)
    assert out.choices[0].text == "中" and out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **args)]
    assert "".join(pieces) == "中"
    assert not any("文" in p for p in pieces)
    # A stop string that never completes: its held-back prefix is released at the end.
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **{**args, "stop": ["好!"]})]
    assert "".join(pieces) == CHAIN_TEXT


def test_n_choices_streaming_and_not(client):
    args = dict(model="tiny", prompt="Numbers", max_tokens=6, n=3, seed=3, extra_body={"ignore_eos": True})
    out = client.completions.create(**args)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1  # independent samples of a random model differ
    texts = {0: "", 1: "", 2: ""}
    reasons = {}
    for chunk in client.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in out.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_seed_reproducibility(client):
    args = dict(model="tiny", prompt="Streaming tokens", max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True})
    a = client.completions.create(seed=11, **args).choices[0].text
    b = client.completions.create(seed=11, **args).choices[0].text
    c = client.completions.create(seed=12, **args).choices[0].text
    assert a == b
    assert a != c


def test_logprobs_per_token(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, logprobs=3, seed=5,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0.0
        assert 1 <= len(top) <= 4 and all(v <= 0.0 for v in top.values())
        assert max(top.values()) >= token_lp - 1e-6


def test_token_id_and_batched_prompts(client, reference_tokenizer):
    ids = reference_tokenizer.encode("Hello world").ids
    out = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=3, n=2, seed=0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len(ids) + 2
    assert out.usage.completion_tokens == 12


def test_sampling_extras_and_penalties_are_accepted(client):
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, presence_penalty=1.5, frequency_penalty=-0.5, top_p=0.9,
        seed=2, logit_bias={"5": 50}, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3,
                                                  "ignore_eos": True})
    assert out.usage.completion_tokens == 8


def test_logit_bias_forces_a_token(client, reference_tokenizer):
    target = reference_tokenizer.token_to_id("Q")
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logit_bias={str(target): 100},
                                    seed=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "QQQQ"


def test_tokenize_and_detokenize_round_trip(server, reference_tokenizer):
    text = "The quick brown fox 你好"
    got = httpx.post(server.base + "/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == reference_tokenizer.encode(text).ids
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 4096
    back = httpx.post(server.base + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": text}


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    assert httpx.get(server.base + "/version").json() == {"version": ninefold.__version__}


def test_raw_sse_format(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_a_client_that_reads_late_gets_the_exact_stream(server):
    # The server runs ahead of a client that does not read: outputs queue up (coalesced) and must
    # come out complete, in order, identical to the non-streamed result of the same seed.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1500, "seed": 5, "ignore_eos": True}
    whole = httpx.post(server.base + "/v1/completions", json=body, timeout=300).json()
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}) as response:
            server.wait_idle()  # generation finished while nothing was read
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
