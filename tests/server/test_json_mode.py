"""``response_format={"type": "json_object"}`` through the official openai client: every finished choice is
one JSON object, an unfinished one a prefix of one, streamed or not (the model is random, the format is not)."""

import json

import pytest

from ninefold.llm.guided import SchemaMachine, json_machine

JSON = {"type": "json_object"}


def _check(text: str, finish_reason: str) -> None:
    state = json_machine.advance(json_machine.START, text.encode())
    assert state is not None, text
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict) and json_machine.complete(state)
    else:
        assert finish_reason == "length" and not json_machine.complete(state)


def test_chat_json_object_choices(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give me JSON"}],
                                         response_format=JSON, max_tokens=48, n=4, seed=5, temperature=1.0)
    assert len(out.choices) == 4
    for choice in out.choices:
        _check(choice.message.content, choice.finish_reason)


def test_completions_json_object_streams_what_the_whole_response_holds(client):
    args = dict(model="tiny", prompt="JSON:", max_tokens=40, seed=9, temperature=1.0,
                extra_body={"response_format": JSON})
    whole = client.completions.create(**args).choices[0]
    _check(whole.text, whole.finish_reason)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == whole.finish_reason


@pytest.mark.parametrize("bias", [{"0": -100}, None])
def test_greedy_json_object_is_deterministic(client, bias):
    args = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], response_format=JSON, max_tokens=32,
                temperature=0, logit_bias=bias)
    first = client.chat.completions.create(**args).choices[0]
    second = client.chat.completions.create(**args).choices[0]
    assert first.message.content == second.message.content
    _check(first.message.content, first.finish_reason)


def test_guided_choice_gives_one_of_the_strings(client):
    choices = ["red", "green", "blue"]
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "colour?"}], n=5,
                                         seed=2, temperature=1.0, max_tokens=8, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model="tiny", prompt="colour:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices


def test_guided_regex_matches_the_pattern_streamed_or_not(client):
    import re

    pattern = r"(?:yes|no), [0-9]{1,3}%"
    args = dict(model="tiny", messages=[{"role": "user", "content": "sure?"}], seed=6, temperature=1.0,
                max_tokens=16, extra_body={"guided_regex": pattern})
    out = client.chat.completions.create(n=4, **args)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content), choice
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                       if c.choices)
    assert streamed == whole and re.fullmatch(pattern, whole)


def test_structured_outputs_is_vllms_newer_form_of_the_guided_fields(client):
    import re

    chat = dict(model="tiny", messages=[{"role": "user", "content": "pick"}], seed=2, temperature=1.0, max_tokens=12)
    out = client.chat.completions.create(extra_body={"structured_outputs": {"choice": ["left", "right"]}}, **chat)
    assert out.choices[0].message.content in ("left", "right")
    out = client.chat.completions.create(extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}, **chat)
    assert re.fullmatch("[0-9]{3}", out.choices[0].message.content)
    out = client.completions.create(model="tiny", prompt="x", max_tokens=64, seed=1,
                                    extra_body={"structured_outputs": {"json": {"enum": [True, None]}}})
    assert out.choices[0].text.strip() in ("true", "null")  # whitespace may come first


def test_bad_guided_requests_are_400(server):
    import httpx

    from .helpers import check_error

    url = server.base + "/v1/completions"
    check_error(httpx.post(url, json={"prompt": "x", "guided_choice": ["a"], "response_format": JSON}), 400,
                "guided_choice")
    check_error(httpx.post(url, json={"prompt": "x", "guided_choice": []}), 400, "guided_choice")
    check_error(httpx.post(url, json={"prompt": "x", "guided_choice": ["a", ""]}), 400, "guided_choice")
    check_error(httpx.post(url, json={"prompt": "x", "guided_regex": "(a"}), 400, "guided_regex")
    check_error(httpx.post(url, json={"prompt": "x", "structured_outputs": {"grammar": "root ::= 'a'"}}), 400,
                "structured_outputs")
    check_error(httpx.post(url, json={"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}), 400,
                "structured_outputs")
    check_error(httpx.post(url, json={"prompt": "x", "structured_outputs": {}}), 400, "structured_outputs")
    check_error(httpx.post(url, json={"prompt": "x", "structured_outputs": {"regex": "a"}, "guided_json": {}}), 400,
                "structured_outputs")
    check_error(httpx.post(url, json={"prompt": "x", "structured_outputs": {"regex": "a", "whitespace": 1}}), 400,
                None)
    check_error(httpx.post(url, json={"prompt": "x", "guided_regex": "a", "guided_json": {}}), 400, "guided_regex")
    assert httpx.get(server.base + "/health").status_code == 200


def test_json_schema_response_format_and_guided_json(client):
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
              "required": ["answer", "score"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "verdict?"}], n=3,
                                         seed=4, temperature=1.0, max_tokens=96, response_format=fmt)
    machine = SchemaMachine(schema)
    for choice in out.choices:
        state = machine.advance(machine.start, choice.message.content.encode())
        assert state is not None, choice.message.content  # a prefix of a conforming value at least
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    out = client.completions.create(model="tiny", prompt="verdict:", max_tokens=96, temperature=0,
                                    extra_body={"guided_json": json.dumps(schema)})
    if out.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(out.choices[0].text), schema)
