"""The OpenAI server where a vLLM user would look first (live server, official openai client):
(a) streaming n > 1 / include_usage / stop strings / stop tokens / finish_reason, (b) disconnects,
(c) bad input, (d) logprobs formats (the sampled token always among the completions' top_logprobs),
(e) concurrent requests.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from .helpers import check_error

ABORT = 'ninefold:request_success_total{finished_reason="abort",model_name="tiny"}'
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def reference_tokenizer(tiny_model):
    return Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))


def _collect_stream(chunks, chat: bool):
    """Per-choice text, finish reasons, logprobs and the usage chunk of a stream; checks its framing."""
    texts, reasons, logprobs, roles, usage = {}, {}, {}, {}, None
    for chunk in chunks:
        assert usage is None, "the usage chunk must be the last one"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for choice in chunk.choices:
            assert choice.index not in reasons, f"choice {choice.index} got a chunk after its finish_reason"
            if chat:
                if choice.delta.role:
                    roles[choice.index] = roles.get(choice.index, 0) + 1
                piece = choice.delta.content or ""
                if choice.logprobs and choice.logprobs.content:
                    logprobs.setdefault(choice.index, []).extend(
                        (lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
                        for lp in choice.logprobs.content)
            else:
                piece = choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, logprobs, roles, usage


# ---------------------------------------------------------------------------------------------
# (a) streaming with n > 1, include_usage, stop strings, finish_reason


def test_chat_stream_n3_stop_logprobs_usage_match_non_streamed(client):
    args = dict(model="tiny", messages=MESSAGES, max_completion_tokens=30, n=3, seed=2, temperature=0.9,
                stop=["e", "lo"], logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args)
    texts, reasons, logprobs, roles, usage = _collect_stream(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args), chat=True)
    assert roles == {0: 1, 1: 1, 2: 1}  # one role chunk per choice
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert logprobs == {c.index: [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs])
                                  for lp in c.logprobs.content] for c in whole.choices}
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    assert usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)
    assert all("e" not in t and "lo" not in t for t in texts.values())


def test_completion_stream_two_prompts_n2_stop_and_usage(client, reference_tokenizer):
    prompts = ["The quick brown", "Hello"]
    args = dict(model="tiny", prompt=prompts, max_tokens=40, n=2, seed=4, temperature=0.9, stop=["o", "ck"])
    whole = client.completions.create(**args)
    texts, reasons, _, _, usage = _collect_stream(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **args), chat=False)
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert set(reasons.values()) <= {"stop", "length"}
    assert usage.model_dump() == whole.usage.model_dump()
    assert usage.prompt_tokens == sum(len(reference_tokenizer.encode(p).ids) for p in prompts)
    assert all("o" not in t and "ck" not in t for t in texts.values())


def test_stop_token_id_is_not_rendered_in_the_text(client, reference_tokenizer):
    q = reference_tokenizer.token_to_id("Q")
    args = dict(model="tiny", prompt="Hello", max_tokens=4, logit_bias={str(q): 100}, seed=0,
                extra_body={"ignore_eos": True, "stop_token_ids": [q]})
    out = client.completions.create(**args)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    assert out.choices[0].text == ""


# ---------------------------------------------------------------------------------------------
# (b) a client that disconnects mid-stream


def test_chat_stream_disconnect_aborts_both_children_and_server_keeps_serving(server, client):
    before = server.metrics().get(ABORT, 0.0)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3000, "n": 2, "stream": True, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.base + "/v1/chat/completions",
                                                       json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: {"))
        assert len([event for _, event in zip(range(8), events)]) == 8  # both role chunks, then tokens
        m = server.metrics()
        assert m["ninefold:num_free_kv_blocks"] < m["ninefold:num_kv_blocks"]
    m = server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
    assert m["ninefold:num_sequences_admitted"] == 0
    assert server.metrics().get(ABORT, 0.0) - before == 2
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# (c) bad input: 4xx, OpenAI error body naming the parameter, server keeps serving

BAD_CHAT = [
    ({"messages": MESSAGES, "temperature": 2.5}, "temperature"),
    ({"messages": MESSAGES, "top_p": -1}, "top_p"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x" * 20000}]}, "messages"),  # over the 4096-token context
]


def test_bad_chat_requests_are_400_naming_the_parameter(server, client):
    for body, param in BAD_CHAT:
        error = check_error(httpx.post(server.base + "/v1/chat/completions", json={"model": "tiny", **body},
                                       timeout=60), 400, param)
        assert error["type"] == "invalid_request_error"
    # The official client surfaces status, param and code.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * 5000)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert info.value.param == "model"
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_missing_body_error_message_is_clear(server):
    for kwargs in ({}, {"content": b"", "headers": {"content-type": "application/json"}}):
        error = check_error(httpx.post(server.base + "/v1/chat/completions", **kwargs), 400)
        assert "None" not in error["message"] and "body" in error["message"].lower()


# ---------------------------------------------------------------------------------------------
# (d) logprobs formats


def test_chat_and_completion_logprobs_format_greedy(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert item.top_logprobs[0].logprob == item.logprob  # greedy: the chosen token is the most likely
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    args = dict(model="tiny", prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].logprobs
    assert len(whole.tokens) == len(whole.token_logprobs) == len(whole.top_logprobs) == 6
    assert all(lp <= 0 and 1 <= len(top) <= 3 for top, lp in zip(whole.top_logprobs, whole.token_logprobs))
    streamed = [[], [], [], []]
    for chunk in client.completions.create(stream=True, **args):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            streamed[0] += lp.tokens
            streamed[1] += lp.token_logprobs
            streamed[2] += lp.top_logprobs
            streamed[3] += lp.text_offset
    assert streamed == [whole.tokens, whole.token_logprobs, whole.top_logprobs, whole.text_offset]
    # offsets count the tokens' texts: they never go back, whatever text a chunk held back
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(len(whole.tokens))]


def test_completion_top_logprobs_include_the_sampled_token(client):
    args = dict(model="tiny", prompt="Hello world", max_tokens=16, temperature=1.0, seed=3,
                extra_body={"ignore_eos": True})
    lp = client.completions.create(logprobs=1, **args).choices[0].logprobs
    not_top = [i for i, (tok_lp, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs))
               if tok_lp < max(top.values())]
    if not not_top:
        pytest.skip("every sampled token was the most likely one: nothing to check")
    for i in not_top:
        top = lp.top_logprobs[i]
        # the best token and the sampled one; one key when their texts are the same (keyed by text, the best kept)
        assert lp.tokens[i] in top and (len(top) == 2 or list(top) == [lp.tokens[i]]), (i, top)
    zero = client.completions.create(logprobs=0, **args).choices[0].logprobs
    assert all(top is not None and tok in top for tok, top in zip(zero.tokens, zero.top_logprobs))


# ---------------------------------------------------------------------------------------------
# (e) concurrent requests give the same results as alone


def test_concurrent_mixed_requests_match_solo_results(server):
    requests = []
    for i in range(9):
        if i % 3 == 0:  # greedy completion
            requests.append(("cmpl", dict(prompt=f"The quick brown {i}", max_tokens=24, temperature=0)))
        elif i % 3 == 1:  # greedy chat with logprobs
            requests.append(("chat", dict(messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=24,
                                          temperature=0, logprobs=True, top_logprobs=2)))
        else:  # seeded sampling, n=2, with a penalty and a stop string
            requests.append(("cmpl", dict(prompt=f"Numbers {i}", max_tokens=24, temperature=0.8, seed=i, n=2,
                                          presence_penalty=0.5, stop=["q"])))

    async def one(client, kind, args, stream):
        args = dict(model="tiny", extra_body={"ignore_eos": True}, **args)
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        if not stream:
            out = await create(**args)
            return {c.index: ((c.message.content if kind == "chat" else c.text), c.finish_reason)
                    for c in out.choices}
        texts, reasons = {}, {}
        async for chunk in await create(stream=True, **args):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + ((c.delta.content or "") if kind == "chat" else c.text)
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        return {i: (texts[i], reasons[i]) for i in texts}

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            solo = [await one(client, kind, args, False) for kind, args in requests]
            together = await asyncio.gather(*(one(client, kind, args, j % 2 == 0)
                                              for j, (kind, args) in enumerate(requests)))
            return solo, together

    solo, together = asyncio.run(main())
    assert together == solo
    m = server.wait_idle()
    assert m["ninefold:num_free_kv_blocks"] == m["ninefold:num_kv_blocks"]
