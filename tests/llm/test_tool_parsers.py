"""Tool-call parsers (ninefold.llm.tools): whole outputs, malformed ones, streaming prefixes and deltas."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninefold.llm.tools import PARSERS, Parsed, ParsedCall, ToolCallDeltas, ToolCallParser, get_parser
from ninefold.llm.tools.partial_json import scan_object, scan_string, scan_value

FORMATS = ["hermes", "llama3_json", "mistral", "json_array"]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def final_calls(parsed: Parsed) -> list[tuple[str | None, str]]:
    assert all(call.complete for call in parsed.calls)
    return [(call.name, call.arguments) for call in parsed.calls]


def check_extends(earlier: Parsed, later: Parsed) -> None:
    """``later`` (a parse of a longer prefix, or the final parse) only adds to ``earlier``."""
    assert later.content.startswith(earlier.content)
    assert len(earlier.calls) <= len(later.calls)
    for before, after in zip(earlier.calls, later.calls):
        assert after.arguments.startswith(before.arguments)
        assert before.name is None or before.name == after.name
        assert not before.complete or after.complete


def check_prefixes(parser: ToolCallParser, text: str, well_formed: bool) -> None:
    """The prefix property over every prefix of ``text`` (consecutive pairs suffice: it is transitive)."""
    previous = parser.parse("", False)
    assert previous == Parsed("", ())
    for end in range(1, len(text) + 1):
        current = parser.parse(text[:end], False)
        check_extends(previous, current)
        previous = current
    if well_formed:
        check_extends(previous, parser.parse(text, True))


def stream(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed growing text chunk by chunk (the last update final); the content and calls the deltas add up to."""
    ids = (f"call_{i}" for i in itertools.count())
    deltas = ToolCallDeltas(parser, lambda: next(ids))
    content, calls, seen_ids = "", [], []
    text = ""
    for number, chunk in enumerate(chunks):
        text += chunk
        content_delta, call_deltas = deltas.update(text, final=number == len(chunks) - 1)
        content += content_delta
        for delta in call_deltas:
            index = delta["index"]
            if "id" in delta:
                assert index == len(calls)
                assert delta["type"] == "function" and set(delta["function"]) == {"name", "arguments"}
                seen_ids.append(delta["id"])
                calls.append([delta["function"]["name"], delta["function"]["arguments"]])
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                assert delta["function"]["arguments"]
                calls[index][1] += delta["function"]["arguments"]
    assert seen_ids == [f"call_{i}" for i in range(len(calls))]
    assert deltas.calls_sent == len(calls)
    return content, [tuple(call) for call in calls]


def check_streaming(parser: ToolCallParser, text: str) -> None:
    """Every-prefix streaming adds up to the final parse (its calls only where the final parse has calls)."""
    final = parser.parse(text, True)
    content, calls = stream(parser, [text[:1]] + list(text[1:]) if text else [""])
    assert content == final.content
    if final.calls:
        assert calls == final_calls(final)


# --- complete outputs ---------------------------------------------------------------------------------


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris"}')]),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>\n  {"name": "b", '
     '"arguments": {"x": [1, {"y": null}], "z": {"w": true}}}  \n</tool_call>',
     "Let me check.\n", [("a", "{}"), ("b", '{"x": [1, {"y": null}], "z": {"w": true}}')]),
    ('<tool_call>{"arguments": {"q": "say \\"hi\\" {}[] </tool_call>"}, "name": "search"}</tool_call>',
     "", [("search", '{"q": "say \\"hi\\" {}[] </tool_call>"}')]),
    ('<tool_call>{"name": "météo", "arguments": {"ville": "Zürich ☃", "esc": "\\u00e9\\n"}}</tool_call>',
     "", [("météo", '{"ville": "Zürich ☃", "esc": "\\u00e9\\n"}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> dropped <tool_call>{"name": "g"}</tool_call>x',
     "", [("f", '{"a": 1}'), ("g", "{}")]),
    ('Sure <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "Sure ", [("f", '{"a": 1}')]),
    ('<tool_call>{"name":"f","id":7,"arguments":{\n  "a": "b"\n}\n}</tool_call>', "", [("f", '{\n  "a": "b"\n}')]),
    ("No tools needed, <tool_c is not a marker.", "No tools needed, <tool_c is not a marker.", []),
]


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}\n',
     [("a", '{"x": 1}'), ("b", '{"y": [2]}')]),
    ('\n <|python_tag|>\n{"parameters": {"s": "a;b}"}, "name": "c"};{"name": "d"}', [("c", '{"s": "a;b}"}'), ("d", "{}")]),
]


@pytest.mark.parametrize("text", ["The answer is 42.", "  <|python_tag|>print(1)", "<|python_tag|>", " \n", ""])
def test_llama3_json_plain_content(text):
    parser = get_parser("llama3_json")
    assert parser.parse(text, True) == Parsed(text, ())
    check_prefixes(parser, text, True)
    check_streaming(parser, text)


MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [("get_weather", '{"city": "Paris"}')]),
    ('Checking both. [TOOL_CALLS] [\n {"name": "a", "arguments": {"k": "[]{}\\""}},\n {"arguments": {}, "name": "b"}\n] \n',
     "Checking both. ", [("a", '{"k": "[]{}\\""}'), ("b", "{}")]),
    ("[TOOL_CALLS][]", "", []),
    ("Just [TOOL text.", "Just [TOOL text.", []),
]


JSON_ARRAY_CASES = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', [("get_weather", '{"city": "Paris"}')]),
    ('\n  [ {"name": "a", "parameters": {"n": -1.5e3}} , {"parameters": {"o": {"p": []}}, "name": "b"} ]',
     [("a", '{"n": -1.5e3}'), ("b", '{"o": {"p": []}}')]),
]


WELL_FORMED = ([("hermes", *case) for case in HERMES_CASES] + [("mistral", *case) for case in MISTRAL_CASES]
               + [("llama3_json", text, "", calls) for text, calls in LLAMA_CASES]
               + [("json_array", text, "", calls) for text, calls in JSON_ARRAY_CASES])


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_well_formed_outputs_whole_by_prefix_and_streamed(name, text, content, calls):
    parsed = get_parser(name).parse(text, True)
    assert parsed.content == content
    assert final_calls(parsed) == calls
    check_prefixes(get_parser(name), text, True)
    check_streaming(get_parser(name), text)


# --- malformed final outputs: the whole text is content -------------------------------------------------


MALFORMED = {
    "hermes": [
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # a brace short
        '<tool_call>{"name": "f", "arguments": {"a": 1}}}</tool_call>',  # a brace too many
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as a string
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off
        "Text <tool_call>",
        "<tool_call>get_weather(city='Paris')</tool_call>",
        '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}',
        '<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g", "arguments": {}}</tool_call>',
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {"a": 1}',
        '{"city": "Paris"}',
        '{"name": "f", "parameters": {}} trailing words',
        '{"name": "f", "parameters": {}};',
        '{"name": "f", "parameters": {}, "arguments": {}}',
        '{"name": ["f"], "parameters": {}}',
        '{"name": "f", "parameters": 5}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "f", "arguments": {}}',  # array not closed
        '[TOOL_CALLS]{"name": "f", "arguments": {}}',  # not an array
        '[TOOL_CALLS][{"name": "f", "arguments": {}},]',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}] then text',
        '[TOOL_CALLS][{"name": "f", "arguments": null}]',
        "Hi [TOOL_CALLS]",
    ],
    "json_array": [
        "",
        "I cannot call tools.",
        '[{"name": "f", "parameters": {}}',
        '[{"name": "f", "parameters": {}}, 3]',
        '[{"name": "f", "arguments": {"a": 1}, "parameters": {"a": 1}, "parameters": {}}]',
        '[{"name": "f", "parameters": {"a": Infinity}}]',
    ],
}


@pytest.mark.parametrize("parser_name, text", [(name, text) for name, texts in MALFORMED.items() for text in texts])
def test_malformed_final_is_all_content(parser_name, text):
    parser = get_parser(parser_name)
    assert parser.parse(text, True) == Parsed(text, ())
    check_prefixes(parser, text, False)
    content, _ = stream(parser, [text[: len(text) // 2], text[len(text) // 2 :]])
    assert content == text  # the rest of the text follows the content streamed before the markup


def test_streamed_call_stays_when_final_turns_out_malformed():
    parser = get_parser("hermes")
    deltas = ToolCallDeltas(parser, lambda: "call_x")
    head = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1'
    assert deltas.update(head, False) == (
        "Hi ", [{"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1'}}])
    text = head + "}</tool_call>"
    assert deltas.update(text, True) == (text[3:], [])
    assert deltas.calls_sent == 1 and parser.parse(text, True).calls == ()


# --- streaming prefixes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("parser_name, text, content", [
    ("hermes", "Hello <tool_c", "Hello "),
    ("hermes", "Hello <", "Hello "),
    ("hermes", "a < b", "a < b"),
    ("hermes", "Hello <tool_call", "Hello "),
    ("hermes", "x <tool_calls> y", "x <tool_calls> y"),
    ("mistral", "Sure [TOOL_CA", "Sure "),
    ("mistral", "Sure [", "Sure "),
    ("mistral", "[1, 2]", "[1, 2]"),
    ("llama3_json", "  ", ""),
    ("llama3_json", " <|python_t", ""),
    ("llama3_json", "<|python_tag|> \n", ""),
    ("llama3_json", " <|python_x", " <|python_x"),
    ("llama3_json", "\nHi", "\nHi"),
    ("json_array", "[", ""),
    ("json_array", "oops", ""),
])
def test_held_back_markers(parser_name, text, content):
    assert get_parser(parser_name).parse(text, False) == Parsed(content, ())


def test_partial_calls():
    parser = get_parser("hermes")
    call = lambda text: parser.parse("ok<tool_call>\n" + text, False).calls  # noqa: E731
    assert call("") == ()
    assert call('{"na') == (ParsedCall(None, "", False),)
    assert call('{"name": "get_wea') == (ParsedCall(None, "", False),)
    assert call('{"name": "get_weather"') == (ParsedCall("get_weather", "", False),)
    assert call('{"name": "get_weather", "arguments":  ') == (ParsedCall("get_weather", "", False),)
    assert call('{"name": "get_weather", "arguments": {"city": "Par') == (
        ParsedCall("get_weather", '{"city": "Par', False),)
    assert call('{"name": "get_weather", "arguments": {"city": "Paris",\n  ') == (
        ParsedCall("get_weather", '{"city": "Paris",', False),)
    assert call('{"name": "get_weather", "arguments": {"city": "Paris"} ') == (
        ParsedCall("get_weather", '{"city": "Paris"}', False),)
    assert call('{"name": "get_weather", "arguments": {"city": "Paris"}}') == (
        ParsedCall("get_weather", '{"city": "Paris"}', True),)
    assert call('{"name": "ping"}') == (ParsedCall("ping", "{}", True),)
    assert call('{"arguments": {"a": "\\"}') == (ParsedCall(None, '{"a": "\\"}', False),)
    assert call('{"name": "f", "arguments": {"a": "}}') == (ParsedCall("f", '{"a": "}}', False),)
    llama = get_parser("llama3_json")
    assert llama.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1', False).calls == (
        ParsedCall("a", "{}", True), ParsedCall("b", '{"x": 1', False))
    array = get_parser("json_array")
    assert array.parse('[{"name": "a", "parameters": {"n": 12', False).calls == (ParsedCall("a", '{"n": 12', False),)


class ScriptedParser(ToolCallParser):
    """Returns the given parses in turn, whatever the text."""

    name = "scripted"

    def __init__(self, *parses: Parsed) -> None:
        self.parses = iter(parses)

    def parse(self, text: str, final: bool) -> Parsed:
        return next(self.parses)


def test_deltas_never_contradict_what_was_sent():
    parser = ScriptedParser(
        Parsed("Hello", (ParsedCall("f", '{"a"', False), ParsedCall("g", "{", False))),
        Parsed("Help, me!", (ParsedCall("f", '{"b": 1}', True), ParsedCall("h", "{}", True))),
        Parsed("Hello, world", (ParsedCall("f", '{"a": 2}', True), ParsedCall("g", "{}", True))),
    )
    deltas = ToolCallDeltas(parser, lambda: "id")
    assert deltas.update("", False)[0] == "Hello" and deltas.calls_sent == 2
    assert deltas.update("", False) == ("", [])  # neither the content nor the calls extend what was sent
    assert deltas.update("", True) == (", world", [{"index": 0, "function": {"arguments": ": 2}"}},
                                                   {"index": 1, "function": {"arguments": "}"}}])


def test_calls_are_announced_in_order():
    parser = get_parser("llama3_json")
    text = '{"parameters": {}}; {"name": "f", "parameters": {"a": 1}}'
    assert [call.name for call in parser.parse(text, False).calls] == [None, "f"]
    deltas = ToolCallDeltas(parser, lambda: "id")
    assert deltas.update(text, False) == ("", [])  # call 1 waits for the name of call 0
    assert deltas.update(text, True) == (text, [])
    assert deltas.calls_sent == 0


def test_streaming_deltas_format():
    parser = get_parser("json_array")
    ids = iter(["id_a", "id_b"])
    deltas = ToolCallDeltas(parser, lambda: next(ids))
    assert deltas.update('[{"name": "f", "parameters": {"x"', False) == (
        "", [{"index": 0, "id": "id_a", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}])
    assert deltas.update('[{"name": "f", "parameters": {"x"', False) == ("", [])
    assert deltas.update('[{"name": "f", "parameters": {"x": 1}}, {"parameters": {}, "name": "g', False) == (
        "", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert deltas.calls_sent == 1
    assert deltas.update('[{"name": "f", "parameters": {"x": 1}}, {"parameters": {}, "name": "g"}]', True) == (
        "", [{"index": 1, "id": "id_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}])
    assert deltas.calls_sent == 2


# --- generated outputs ------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(
    max_size=8)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5)
whitespace = st.sampled_from(["", " ", "\n", "  \n\t", "\r\n"])


@st.composite
def calls_json(draw, argument_key: str, min_calls: int):
    """(the calls' JSON texts, [(name, raw arguments)]) for random calls, dumped in random styles."""
    texts, expected = [], []
    for _ in range(draw(st.integers(min_calls, 3))):
        name = draw(st.text(min_size=1, max_size=10))
        arguments = draw(st.dictionaries(st.text(max_size=6), json_values, max_size=4))
        style = draw(st.sampled_from([{}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (",", ":")}]))
        raw_arguments = json.dumps(arguments, **style)
        raw_name = json.dumps(name, ensure_ascii=draw(st.booleans()))
        members = [f'"name": {raw_name}', f'"{argument_key}": {raw_arguments}']
        if draw(st.booleans()):
            members.reverse()
        if draw(st.booleans()):
            members.insert(1, '"id": "x"')
        gap = draw(whitespace)
        texts.append("{" + gap + ("," + gap).join(members) + draw(whitespace) + "}")
        expected.append((name, raw_arguments))
    return texts, expected


@st.composite
def outputs(draw, parser_name: str):
    """(a well-formed output of the format, its content, its calls)."""
    if parser_name == "hermes":
        content = draw(st.text(max_size=20).filter(lambda text: "<tool_call>" not in text))
        texts, expected = draw(calls_json("arguments", 0))
        blocks = [f"<tool_call>{draw(whitespace)}{text}{draw(whitespace)}</tool_call>" for text in texts]
        if blocks and draw(st.booleans()):
            blocks[-1] = blocks[-1].removesuffix("</tool_call>")
        return content + draw(whitespace).join(blocks), content, expected
    if parser_name == "llama3_json":
        texts, expected = draw(calls_json(draw(st.sampled_from(["parameters", "arguments"])), 1))
        head = draw(st.sampled_from(["", "<|python_tag|>", " <|python_tag|>\n", "\n"]))
        return head + (draw(whitespace) + ";" + draw(whitespace)).join(texts) + draw(whitespace), "", expected
    texts, expected = draw(calls_json("arguments" if parser_name == "mistral" else "parameters", 0))
    array = draw(whitespace) + "[" + draw(whitespace) + ("," + draw(whitespace)).join(texts) + draw(whitespace) + "]"
    if parser_name == "json_array":
        return array, "", expected
    content = draw(st.text(max_size=20).filter(lambda text: "[TOOL_CALLS]" not in text))
    return content + "[TOOL_CALLS]" + array + draw(whitespace), content, expected


@pytest.mark.parametrize("parser_name", FORMATS)
@SETTINGS
@given(data=st.data())
def test_generated_outputs(parser_name, data):
    text, content, calls = data.draw(outputs(parser_name))
    parser = get_parser(parser_name)
    final = parser.parse(text, True)
    assert final.content == content
    assert final_calls(final) == calls
    check_prefixes(parser, text, True)
    check_streaming(parser, text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    assert stream(parser, chunks) == (content, calls)


PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<tool_", "[TOOL", "{", "}", "[", "]",
          '"', "\\", ":", ",", ";", " ", "\n", "1", "true", "x", "é", '"name"', '"arguments"', '"parameters"', '"f"']


@pytest.mark.parametrize("parser_name", FORMATS)
@settings(max_examples=100, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=40).map("".join))
def test_arbitrary_text_is_tolerated(parser_name, text):
    parser = get_parser(parser_name)
    check_prefixes(parser, text, bool(parser.parse(text, True).calls))
    check_streaming(parser, text)


# --- scanner, registry, cost -----------------------------------------------------------------------------


def test_scan_object_on_truncated_text():
    text = '{"a": {"b": "}"}, "c" : [1, "]"], "d": 12'
    scan = scan_object(text, 0)
    assert [(m.key, text[m.value_start : m.value_end] if m.value_end else m.value_end) for m in scan.members] == [
        ("a", '{"b": "}"}'), ("c", '[1, "]"]'), ("d", None)]
    assert scan.end is None and scan.error is None
    closed = scan_object(text + "}  ", 0)
    assert closed.end == len(text) + 1 and closed.members[-1].value_end == len(text)
    assert scan_object('{"a": 1 "b": 2}', 0).error == 8
    assert scan_object('{"\\q": 1}', 0).error == 1
    assert scan_string('"a\\"', 0) is None and scan_string('"a\\""', 0) == 5
    assert scan_value("tru", 0) is None and scan_value("true,", 0) == 4
    assert scan_value('{"a": "}', 0) is None and scan_value('["]"]', 0) == 5
    with pytest.raises(ValueError):
        scan_value("@", 0)


def test_registry():
    assert sorted(PARSERS) == sorted(FORMATS)
    for name in FORMATS:
        parser = get_parser(name)
        assert isinstance(parser, ToolCallParser) and parser.name == name
    with pytest.raises(ValueError, match=r"tool_call_parser.*'pythonic'.*hermes, json_array, llama3_json, mistral"):
        get_parser("pythonic")


def test_parse_time_is_linear():
    arguments = json.dumps({f"k{i}": ["v" * 20, {"n": i, "s": "\\\"{["}] for i in range(30_000)})
    text = '<tool_call>{"name": "big", "arguments": ' + arguments + "}</tool_call>"
    parser = get_parser("hermes")
    start = time.perf_counter()
    assert parser.parse(text[:-20], False).calls[0].arguments == arguments[: len(arguments) - 7]
    assert parser.parse(text, True).calls[0].arguments == arguments
    assert time.perf_counter() - start < 2.0  # ~2 MB: linear is a few tens of ms, quadratic would be hours
