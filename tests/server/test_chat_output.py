"""A chat choice's text read into reasoning, content and tool calls (``chat_output``), whole and streamed in
every chunking: what a stream sends adds up to the whole message. (The live-server tests force outputs with
guided decoding, which with a reasoning parser applies only after the thinking, so the thinking itself is
checked here.)"""

import random

import pytest

from ninefold.llm.reasoning import get_reasoning_parser
from ninefold.llm.server.chat_output import ChatOutput
from ninefold.llm.server.tool_choice import ToolPlan
from ninefold.llm.tools import get_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>'
CASES = [  # reasoning parser, tools?, output, expected message fields, finish reason
    ("qwen3", True, "<think>\nI call it.\n</think>\n\nLet me look." + CALL,
     {"reasoning": "\nI call it.\n", "content": "Let me look.", "calls": [("get_weather", '{"unit": "celsius"}')]},
     "tool_calls"),
    ("qwen3", False, "<think>x < y</think>\n\nYes.", {"reasoning": "x < y", "content": "Yes.", "calls": []}, "stop"),
    ("qwen3", False, "No thinking.", {"reasoning": None, "content": "No thinking.", "calls": []}, "stop"),
    ("deepseek_r1", False, "cut short in the thinking", {"reasoning": "cut short in the thinking", "content": "",
                                                         "calls": []}, "stop"),
    ("deepseek_r1", True, "hmm</think>" + CALL, {"reasoning": "hmm", "content": None,
                                                 "calls": [("get_weather", '{"unit": "celsius"}')]}, "tool_calls"),
    (None, True, "Plain " + CALL, {"reasoning": None, "content": "Plain ",
                                   "calls": [("get_weather", '{"unit": "celsius"}')]}, "tool_calls"),
]


def _output(reasoning, tools, include=True):
    plan = ToolPlan("auto", parser=get_parser("hermes")) if tools else None
    return ChatOutput(plan, get_reasoning_parser(reasoning) if reasoning else None, include)


@pytest.mark.parametrize("reasoning, tools, text, expected, reason", CASES)
def test_whole_and_streamed_messages_agree(reasoning, tools, text, expected, reason):
    output = _output(reasoning, tools)
    message, finish = output.message(text, "stop")
    assert finish == reason
    assert message.get("reasoning") == message.get("reasoning_content") == expected["reasoning"]
    assert message["content"] == expected["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == \
        expected["calls"]
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) + [len(text)]
        deltas, start, got = output.deltas(), 0, {"reasoning": "", "content": "", "calls": {}}
        for end in cuts:
            fields = deltas.update(text[start:end], end == len(text))
            start = end
            assert fields.get("reasoning") == fields.get("reasoning_content")
            got["reasoning"] += fields.get("reasoning", "")
            got["content"] += fields.get("content", "")
            for call in fields.get("tool_calls", []):
                entry = got["calls"].setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name", "")
                entry[1] += call["function"].get("arguments", "")
        assert got["reasoning"] == (expected["reasoning"] or "")
        assert got["content"] == (expected["content"] or "")
        assert [tuple(got["calls"][i]) for i in sorted(got["calls"])] == expected["calls"]
        assert deltas.called == bool(expected["calls"])


def test_include_reasoning_false_leaves_the_reasoning_out():
    output = _output("qwen3", False, include=False)
    message, _ = output.message("<think>secret</think>\n\nAnswer.", "stop")
    assert message == {"role": "assistant", "content": "Answer."}
    deltas = output.deltas()
    fields = [deltas.update(piece, last) for piece, last in (("<think>sec", False), ("ret</think>\n\nAns", False),
                                                               ("wer.", True))]
    assert all("reasoning" not in f and "reasoning_content" not in f for f in fields)
    assert "".join(f.get("content", "") for f in fields) == "Answer."


def test_a_call_found_malformed_at_the_end_is_no_call_either_way():
    text = 'Sure.<tool_call>\n{"name": "get_time", "arguments": "utc"}\n</tool_call>'  # arguments not an object
    output = _output(None, True)
    message, finish = output.message(text, "stop")
    assert finish == "stop" and message["content"] == text and message["tool_calls"] == []
    deltas = output.deltas()
    for end in range(1, len(text) + 1):
        deltas.update(text[end - 1:end], end == len(text))
    assert not deltas.called  # the stream reports "stop" too, though it had announced the call
