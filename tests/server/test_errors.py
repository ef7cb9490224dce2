"""Client mistakes get OpenAI error JSON with the right status, and the server keeps serving."""

import httpx
import pytest

from .helpers import check_error

BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 100000}, "n"),
    ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": "hi", "stop": ["a"] * 100}, "stop"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "presence_penalty": 9}, "presence_penalty"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "logit_bias": {"zebra": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1": 1000}}, "logit_bias"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
    ({"prompt": 17}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1, 2]}, "prompt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_fields_are_400(server, body, param):
    response = httpx.post(server.base + "/v1/completions", json={"model": "tiny", **body})
    error = check_error(response, 400, param=param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_and_wrong_body_type_are_400(server):
    bad = httpx.post(server.base + "/v1/completions", content=b'{"prompt": "hi",',
                     headers={"content-type": "application/json"})
    check_error(bad, 400, text="not valid JSON")
    check_error(httpx.post(server.base + "/v1/completions", json=[1, 2]), 400)
    check_error(httpx.post(server.base + "/v1/chat/completions", json={"messages": "hello"}), 400, "messages")
    check_error(httpx.post(server.base + "/v1/chat/completions", json={"messages": []}), 400, "messages")
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
                 400, "top_logprobs")
    user = [{"role": "user", "content": "x"}]
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}),
                 400, "tool_choice")  # "auto" (the default with tools) needs --enable-auto-tool-choice
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": user, "response_format": {"type": "json_schema", "json_schema": {}}}),
                 400, "response_format", text="needs")
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": user, "response_format": {"type": "json_schema", "json_schema": {
                                "name": "x", "schema": {"type": "string", "pattern": "a+"}}}}),
                 400, "response_format", text="pattern")
    check_error(httpx.post(server.base + "/v1/completions", json={"prompt": "x", "response_format": {"type": "yaml"}}),
                400, "response_format")
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": [{"type": "image_url", "x": 1}]}]}), 400)
    check_error(httpx.post(server.base + "/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, "suffix")


def test_out_of_vocabulary_ids_are_400(server, tiny_model):
    check_error(httpx.post(server.base + "/v1/completions",
                            json={"prompt": [1, tiny_model.vocab_size + 5], "max_tokens": 2}), 400, "prompt",
                 text="outside the vocabulary")
    check_error(httpx.post(server.base + "/v1/completions",
                            json={"prompt": "hi", "logit_bias": {str(tiny_model.vocab_size): 3}}), 400, "logit_bias")
    check_error(httpx.post(server.base + "/v1/completions",
                            json={"prompt": "hi", "stop_token_ids": [tiny_model.vocab_size]}), 400, "stop_token_ids")
    check_error(httpx.post(server.base + "/detokenize", json={"tokens": [tiny_model.vocab_size]}), 400, "tokens")


def test_prompt_over_the_context_and_huge_max_tokens_are_400(server):
    long_prompt = [5] * 5000
    error = check_error(httpx.post(server.base + "/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    at_limit = [5] * 4096
    check_error(httpx.post(server.base + "/v1/completions", json={"prompt": at_limit}), 400, "prompt")
    error = check_error(httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 10**12}),
                         400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    check_error(httpx.post(server.base + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}),
                 400, "max_completion_tokens")


def test_unknown_model_is_404(server, client):
    import openai

    error = check_error(httpx.post(server.base + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                         "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_and_method_are_json(server):
    check_error(httpx.get(server.base + "/v1/nothing"), 404)
    check_error(httpx.get(server.base + "/v1/completions"), 405)


def test_body_over_the_limit_is_413(server):
    big = b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    check_error(httpx.post(server.base + "/v1/completions", content=big,
                            headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    check_error(httpx.post(server.base + "/v1/completions", content=chunks(),
                            headers={"content-type": "application/json"}), 413)


def test_server_still_serves_after_the_bad_requests(client):
    out = client.completions.create(model="tiny", prompt="still alive", max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_bad_requests_do_not_disturb_a_running_stream(server, tiny_model):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 300, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    bad_bodies = [{"prompt": [5] * 4096}, {"prompt": [tiny_model.vocab_size]}, {"prompt": "x", "logit_bias": {"-3": 1}},
                  {"prompt": "x", "logit_bias": {str(tiny_model.vocab_size + 1): 1}}, {"prompt": "x", "n": 10**6}]
    with httpx.Client(timeout=120) as http, http.stream("POST", server.base + "/v1/completions", json=body) as good:
        lines = good.iter_lines()
        assert next(lines).startswith("data: {")
        for bad in bad_bodies:
            check_error(http.post(server.base + "/v1/completions", json=bad), 400)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"completion_tokens":300' in events[-2]
    assert '"finish_reason":"length"' in events[-3]


# JSON's "\ud800" escape decodes to a lone UTF-16 surrogate: valid JSON, not valid Unicode (no tokenizer takes it)
SURROGATE_BODIES = [
    ("/v1/completions", b'{"model":"tiny","prompt":"\\ud800 lone","max_tokens":2}', "prompt"),
    ("/v1/completions", b'{"model":"tiny","prompt":"hi","max_tokens":2,"stop":["\\udc00"]}', "stop"),
    ("/v1/chat/completions", b'{"model":"tiny","messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}',
     "messages"),
    ("/v1/chat/completions", b'{"model":"\\ud800","messages":[{"role":"user","content":"hi"}],"max_tokens":2}',
     "model"),
    ("/v1/chat/completions",
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"bad_words":["\\ud800"]}',
     "bad_words"),
    ("/v1/chat/completions",
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,'
     b'"bad_words":["\\ud800"]}', "bad_words"),
    ("/v1/chat/completions",
     b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"guided_regex":"\\ud800"}',
     "guided_regex"),
    ("/v1/embeddings", b'{"model":"tiny","input":"\\ud800"}', "input"),
    ("/tokenize", b'{"prompt":"\\ud800"}', "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES)
def test_an_unpaired_surrogate_anywhere_is_a_400_naming_its_field(server, path, body, param):
    response = httpx.post(server.base + path, content=body, headers={"content-type": "application/json"})
    check_error(response, 400, param=param, text="surrogate")


def test_stream_options_without_streaming_is_a_400(client):
    import openai

    for create in (lambda **kw: client.completions.create(prompt="hi", **kw),
                   lambda **kw: client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny", max_tokens=2, stream_options={"include_usage": True})
        assert info.value.body["param"] == "stream_options"
