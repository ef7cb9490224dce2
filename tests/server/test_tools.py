"""Tool calling through the official openai client: ``tools`` and ``tool_choice`` (named, ``required``, ``auto``
with ``--enable-auto-tool-choice --tool-call-parser hermes``), streamed and whole, tool messages in the chat
template, reasoning apart from the answer (``--reasoning-parser qwen3``), and the 400s. The model is random; guided decoding makes named and required calls follow the
tools' schemas, and a forced output (``guided_choice``) stands in for a model that writes Hermes tool calls."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from .conftest import ServerProcess, free_port

WEATHER = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                            "days": {"enum": [1, 2, 3]}, "detailed": {"type": "boolean"}},
           "required": ["unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object", "properties": {},
                                                              "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# A Hermes-style template (tools in the system turn, <tool_call> blocks, tool results as user turns).
HERMES_TEMPLATE = """\
{% if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def tool_server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    template = folder / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    proc = ServerProcess(tiny_model, folder, "--max-model-len", "2048", "--num-kv-blocks", "512",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template),
                         "--reasoning-parser", "qwen3")
    yield proc
    assert proc.stop() == 0


@pytest.fixture
def tool_client(tool_server):
    return openai.OpenAI(base_url=tool_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def no_blanks(tiny_model) -> dict[str, int]:
    """A logit_bias banning whitespace-only tokens: the random model would otherwise fill the JSON with them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))
    return {str(i): -100 for i in range(tok.get_vocab_size()) if (s := tok.decode([i])) and not s.strip()}


@pytest.fixture(scope="module")
def no_think(tiny_model) -> dict[str, int]:
    """A logit_bias against tokens that may open a <think> ("<" after any whitespace, or whitespace alone): with
    --reasoning-parser qwen3 a forced format starts after an opening <think> if the model writes one, and a
    random model may; these tests force the answer itself."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model.path / "tokenizer.json"))
    texts = [tok.decode([i]) for i in range(tok.get_vocab_size())]
    return {str(i): -100 for i, t in enumerate(texts) if t and (not t.strip() or t.lstrip().startswith("<"))}


def _check_calls(calls, finish_reason: str) -> None:
    """Finished calls name a tool and carry arguments following its schema."""
    assert calls, "expected tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _streamed(client, reasoning: list | None = None, **args):
    """A streamed choice put back together: content, calls as [(id, name, arguments)], finish reason (and the
    reasoning deltas appended to ``reasoning``)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            if reasoning is not None and getattr(choice.delta, "reasoning", None):
                assert choice.delta.reasoning == choice.delta.reasoning_content
                reasoning.append(choice.delta.reasoning)
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.function.name, "a call's first delta carries its id and name"
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][2] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client, no_blanks):
    seen = 0
    for seed in range(4):
        args = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=64, temperature=1.0, seed=seed,
                    logit_bias=no_blanks, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        out = client.chat.completions.create(**args).choices[0]
        if out.finish_reason == "length":
            continue
        seen += 1
        assert out.finish_reason == "stop" and out.message.content is None
        assert [c.function.name for c in out.message.tool_calls] == ["get_weather"]
        _check_calls(out.message.tool_calls, out.finish_reason)
        content, calls, reason = _streamed(client, **args)
        assert content == "" and reason == "stop"
        assert [(name, arguments) for _, name, arguments in calls] == [
            ("get_weather", out.message.tool_calls[0].function.arguments)]
    assert seen >= 3


def test_required_tool_choice_calls_one_or_more_tools(client, no_blanks):
    finished = 0
    for seed in range(6):
        for parallel in (True, False):
            args = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
                        temperature=1.0, seed=seed, parallel_tool_calls=parallel, logit_bias=no_blanks)
            out = client.chat.completions.create(**args).choices[0]
            if out.finish_reason == "length":  # cut off: test_a_required_call_cut_off_by_max_tokens... reads it
                continue
            finished += 1
            assert out.finish_reason == "tool_calls" and out.message.content is None
            _check_calls(out.message.tool_calls, out.finish_reason)
            if not parallel:
                assert len(out.message.tool_calls) == 1
            content, calls, reason = _streamed(client, **args)
            assert content == "" and reason == "tool_calls"
            assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                                     for c in out.message.tool_calls]
    assert finished >= 4


def test_a_required_call_cut_off_by_max_tokens_reads_the_same_whole_and_streamed(client, no_blanks):
    """As OpenAI does, an output cut by max_tokens reports the calls whose names were written, with the arguments
    as far as they got; the stream sends exactly that, and neither sends the cut JSON as content."""
    announced = 0
    for max_tokens in (3, 20, 40, 56):  # (the tiny tokenizer writes the call a few characters a token)
        args = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=max_tokens,
                    temperature=0, logit_bias=no_blanks)
        out = client.chat.completions.create(**args).choices[0]
        assert out.finish_reason == "length" and out.message.content in (None, "")
        whole = [(c.function.name, c.function.arguments) for c in out.message.tool_calls or []]
        assert all(name in SCHEMAS for name, _ in whole)
        content, calls, reason = _streamed(client, **args)
        assert (content, [(n, a) for _, n, a in calls], reason) == ("", whole, "length")
        announced += any(arguments for _, arguments in whole)
    assert announced >= 2  # calls with part of their arguments


def test_tool_choice_none_and_no_tools_answer_with_content(client):
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                         seed=1, temperature=1.0).choices[0]
    assert out.message.tool_calls in (None, []) and out.finish_reason in ("stop", "length")
    assert isinstance(out.message.content, str)


HERMES_CALL = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')


def test_auto_tool_choice_reads_hermes_calls_from_the_output(tool_client, no_think):
    args = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, logit_bias=no_think,
                extra_body={"guided_choice": [HERMES_CALL]})
    out = tool_client.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == [
        ("get_weather", {"unit": "celsius", "days": 2}), ("get_time", {"zone": "utc"})]
    _check_calls(out.message.tool_calls, out.finish_reason)
    content, calls, reason = _streamed(tool_client, **args)
    assert content == "Let me look." and reason == "tool_calls", (content, calls, reason)
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in out.message.tool_calls]


def test_auto_tool_choice_without_a_call_is_plain_content(tool_client, no_think):
    args = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=50, logit_bias=no_think,
                extra_body={"guided_choice": ["It is sunny, no tool needed <tool"]})
    out = tool_client.chat.completions.create(**args).choices[0]
    assert out.finish_reason == "stop" and out.message.tool_calls in (None, [])
    assert out.message.content == "It is sunny, no tool needed <tool"
    content, calls, reason = _streamed(tool_client, **args)
    assert (content, calls, reason) == ("It is sunny, no tool needed <tool", [], "stop")


def test_a_malformed_call_comes_back_as_content(tool_client, no_think):
    broken = 'Calling <tool_call>\n{"name": "get_weather", "arguments": {"unit": }\n</tool_call>'
    out = tool_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, logit_bias=no_think,
                                              extra_body={"guided_choice": [broken]}).choices[0]
    assert out.finish_reason == "stop" and out.message.content == broken and not out.message.tool_calls


def _rendered(server, **body) -> str:
    tokens = httpx.post(server.base + "/tokenize", json={"model": "tiny", **body}, timeout=30).json()["tokens"]
    return httpx.post(server.base + "/detokenize", json={"model": "tiny", "tokens": tokens}, timeout=30).json()["prompt"]


def test_tools_and_earlier_calls_reach_the_chat_template(tool_server, tool_client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    text = _rendered(tool_server, messages=history, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert json.dumps(TOOLS[0]) in text  # the tool definitions, as the template writes them
    # the earlier call's arguments reach the template as an object (tojson writes it unquoted)
    assert '{"name": "get_weather", "arguments": {"unit": "celsius", "days": 1}}' in text
    assert '<tool_response id="call_1">18 degrees</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n<think></think>\n")
    # the same conversation generates (a client sends the tool's answer back and continues)
    out = tool_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                              max_tokens=4, seed=0, temperature=1.0)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}}}], "tool_choice": "required"},
     "tools", "pattern"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, None, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"}, None, "name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, None, "type"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
])
def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(server, body, param, words):
    response = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and (param is None or error["param"] == param), error
    ok = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                    json={"model": "tiny", "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("flags, words", [
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "hermes"),
    (["--chat-template", "no-such-file.jinja"], "--chat-template"),
    (["--reasoning-parser", "r2"], "deepseek_r1"),
    (["--chat-template", "{% for m in messages %}{{ m.content }"], "not a valid Jinja template"),
])
def test_bad_tool_flags_stop_serve_before_loading(tiny_model, flags, words):
    done = subprocess.run([sys.executable, "-m", "ninefold", "serve", "--model", str(tiny_model.path), "--port", str(free_port()),
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_an_answer_without_thinking_has_no_reasoning(tool_client, no_think):
    args = dict(model="tiny", messages=ASK, max_tokens=20, logit_bias=no_think,
                extra_body={"guided_choice": ["Plain answer."]})
    out = tool_client.chat.completions.create(**args).choices[0].message.model_dump()
    assert out["content"] == "Plain answer." and out.get("reasoning") is None
    pieces: list[str] = []
    assert _streamed(tool_client, reasoning=pieces, **args) == ("Plain answer.", [], "stop") and pieces == []


def test_a_json_format_holds_after_the_thinking(tool_client, no_blanks, no_think):
    """With --reasoning-parser qwen3 a format applies to the answer: a random model kept from opening a <think>
    writes the JSON at once and has no reasoning; one left free may think first (then its thinking is free
    text and the JSON follows it)."""
    args = dict(model="tiny", messages=ASK, max_tokens=64, temperature=1.0, response_format={"type": "json_object"})
    out = tool_client.chat.completions.create(seed=3, logit_bias={**no_blanks, **no_think}, **args).choices[0]
    assert out.message.model_dump().get("reasoning") is None
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    else:
        assert out.finish_reason == "length" and out.message.content.lstrip().startswith("{")
    # pushed towards "<", it opens a <think> (the only way "<" continues) and then thinks freely: no JSON yet
    think = {k: 100 for k in no_think if k not in no_blanks}  # the tokens starting with "<"
    free = tool_client.chat.completions.create(seed=0, logit_bias=think, **args).choices[0]
    message = free.message.model_dump()
    assert free.finish_reason == "length" and message["content"] == ""
    assert message["reasoning"] and message["reasoning"].startswith("<")  # not JSON: the thinking is free


def test_required_calls_of_tools_whose_schemas_hold_their_own_definitions(client, no_blanks):
    """Each tool's $defs move to the root of the combined schema (renamed per tool); its $id is dropped."""
    units = {"$id": "https://example.com/weather", "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
             "required": ["unit"], "$defs": {"Unit": {"enum": ["celsius", "kelvin"]}}}
    zones = {"type": "object", "properties": {"zone": {"$ref": "#/definitions/Unit"}}, "required": ["zone"],
             "definitions": {"Unit": {"enum": ["utc"]}}}  # the same definition name, another tool
    tools = [{"type": "function", "function": {"name": "weather", "parameters": units}},
             {"type": "function", "function": {"name": "time", "parameters": zones}}]
    finished = 0
    for seed in range(8):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                             max_tokens=128, seed=seed, temperature=1.0, logit_bias=no_blanks)
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue
        finished += 1
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), units if call.function.name == "weather" else zones)
    assert finished >= 2


def test_odd_histories_and_template_variables_render(tool_server):
    deep = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ping", "arguments": "[" * 50000}}]}]
    response = httpx.post(tool_server.base + "/tokenize", json={"model": "tiny", "messages": deep}, timeout=30)
    assert response.status_code == 200, response.text  # arguments that are not a JSON object stay text
    response = httpx.post(tool_server.base + "/tokenize", timeout=30, json={
        "model": "tiny", "messages": ASK, "chat_template_kwargs": {"eos_token": "</s>", "pad_token": "<pad>"}})
    assert response.status_code == 200, response.text  # a request may set the special-token variables
