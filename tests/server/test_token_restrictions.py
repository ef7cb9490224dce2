"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens through the HTTP API."""

import httpx


def letters(server) -> dict[str, int]:
    """The token ids of single letters, each one token in the tiny model's vocabulary."""
    ids = {c: httpx.post(server.base + "/tokenize", json={"prompt": c, "add_special_tokens": False}).json()["tokens"]
           for c in "abc"}
    assert all(len(v) == 1 for v in ids.values()), ids
    return {c: v[0] for c, v in ids.items()}


def test_allowed_token_ids_and_bad_words(server, client):
    ids = letters(server)
    args = dict(model="tiny", prompt="Hello", max_tokens=24, temperature=1.0, seed=2)
    allowed = {"ignore_eos": True, "allowed_token_ids": list(ids.values())}
    text = client.completions.create(**args, extra_body=allowed).choices[0].text
    assert len(text) == 24 and set(text) <= set("abc")
    pair = next(text[i : i + 2] for i in range(len(text) - 1) if text[i] != text[i + 1])
    again = client.completions.create(**args, extra_body={**allowed, "bad_words": [pair]}).choices[0].text
    assert len(again) == 24 and set(again) <= set("abc") and pair not in again


def test_truncate_prompt_tokens(server, client):
    long = list(range(5, 60))
    cut = client.completions.create(model="tiny", prompt=long, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True, "truncate_prompt_tokens": 8})
    same = client.completions.create(model="tiny", prompt=long[-8:], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == same.choices[0].text


def test_bad_values_are_400_naming_the_field(server):
    cases = [({"allowed_token_ids": [10**9]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
             ({"bad_words": ["  "]}, "bad_words"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]
    for extra, field in cases:
        r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert field in r.text
    assert httpx.get(server.base + "/health").status_code == 200


def test_continuous_usage_stats_count_every_chunk(client):
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted and all(c.usage is not None for c in chunks)
    two = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=1, n=2,
                                    stream=True, extra_body={"ignore_eos": True},
                                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    per_choice: dict[int, list[int]] = {}
    for c in two:
        for choice in c.choices:
            per_choice.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert sorted(per_choice) == [0, 1] and all(v[-1] == 6 and v == sorted(v) for v in per_choice.values())
    assert counted == sorted(counted) and counted[-1] == 10 and chunks[-1].usage.completion_tokens == 10
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, stream=True,
                                      stream_options={"continuous_usage_stats": True})
    assert all(c.usage is None for c in plain)  # without include_usage, as vLLM


def test_return_tokens_as_token_ids(server, client):
    body = dict(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True})
    named = client.completions.create(**body).choices[0].logprobs
    as_ids = client.completions.create(**{**body, "extra_body": {"ignore_eos": True,
                                                                 "return_tokens_as_token_ids": True}})
    tokens = as_ids.choices[0].logprobs.tokens
    assert len(tokens) == 5 and all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.split(":")[1]) for t in tokens]
    detok = httpx.post(server.base + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert detok == as_ids.choices[0].text
    assert as_ids.choices[0].logprobs.token_logprobs == named.token_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


def test_include_stop_str_in_output(client):
    args = dict(model="tiny", prompt="Hello world", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(**args).choices[0].text
    stop = free[6:8]
    assert stop.strip() and stop not in free[:6]
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    kept = client.completions.create(**{**args, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                     stop=[stop]).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and kept.text.endswith(stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **{**args, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}, stop=[stop], stream=True))
    assert streamed == kept.text


def test_continue_final_message(server, client):
    begun = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello, my friend"}]
    tokens = httpx.post(server.base + "/tokenize", json={"messages": [begun[0]], "add_generation_prompt": True})
    opened = tokens.json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": opened}).json()["prompt"]
    reply = client.chat.completions.create(model="tiny", messages=begun, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True, "continue_final_message": True,
                                                       "add_generation_prompt": False})
    # the same tokens as a completion of the rendered conversation cut after the assistant's words
    same = client.completions.create(model="tiny", prompt=text + "Hello, my friend", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == same.choices[0].text
    cut = httpx.post(server.base + "/tokenize", json={"messages": begun, "add_generation_prompt": False,
                                                      "continue_final_message": True}).json()["tokens"]
    assert httpx.post(server.base + "/detokenize", json={"tokens": cut}).json()["prompt"].endswith("Hello, my friend")
    both = httpx.post(server.base + "/v1/chat/completions",
                      json={"messages": begun, "max_tokens": 2, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
