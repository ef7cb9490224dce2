"""Reasoning split from the answer (``--reasoning-parser``): whole outputs, and every prefix of them growing
only (what a stream sends is never taken back) up to what the whole output gives."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninefold.llm.reasoning import PARSERS, get_reasoning_parser

CASES = [  # parser, output, (reasoning, answer)
    ("deepseek_r1", "<think>\nsteps\n</think>\n\nThe answer.", ("\nsteps\n", "The answer.")),
    ("deepseek_r1", "steps, no opening tag</think>The answer.", ("steps, no opening tag", "The answer.")),
    ("deepseek_r1", "still thinking when cut", ("still thinking when cut", "")),
    ("deepseek_r1", "  <think>a < b, <thin</think>\n", ("a < b, <thin", "")),
    ("qwen3", "<think>\nsteps\n</think>\n\nThe answer.", ("\nsteps\n", "The answer.")),
    ("qwen3", "No thinking here. <think>x</think>", ("", "No thinking here. <think>x</think>")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("qwen3", "<think></think>\n\n{\"a\": 1}", ("", "{\"a\": 1}")),
    ("qwen3", "<thinking>", ("", "<thinking>")),
    ("qwen3", "", ("", "")),
]


@pytest.mark.parametrize("name, text, expected", CASES)
def test_whole_outputs_split(name, text, expected):
    assert get_reasoning_parser(name).split(text, final=True) == expected


def _check_prefixes(name: str, text: str) -> None:
    parser = get_reasoning_parser(name)
    final = parser.split(text, final=True)
    previous = ("", "")
    for end in range(len(text) + 1):
        part = parser.split(text[:end], final=False)
        for before, now, whole in zip(previous, part, final):
            assert now.startswith(before) and whole.startswith(now), (name, text[:end], previous, part, final)
        previous = part


@pytest.mark.parametrize("name, text, expected", CASES)
def test_every_prefix_grows_towards_the_whole_output(name, text, expected):
    _check_prefixes(name, text)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(PARSERS)),
       st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "é", "{}"]),
                max_size=12))
def test_prefix_property_on_random_outputs(name, pieces):
    _check_prefixes(name, "".join(pieces))


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="reasoning_parser: got 'r2'; expected one of deepseek_r1, qwen3"):
        get_reasoning_parser("r2")


@pytest.mark.parametrize("name, prompt_tail, expected", [
    ("qwen3", "<|im_start|>assistant\n<think>\n", "deepseek_r1"),  # the template opened the thinking
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3"),  # thinking turned off
    ("qwen3", "<|im_start|>assistant\n", "qwen3"),
    ("deepseek_r1", "<|Assistant|><think>\n", "deepseek_r1"),
    (None, "<think>\n", None),
])
def test_a_prompt_that_opens_the_thinking_is_read_from_inside_the_reasoning(name, prompt_tail, expected):
    from ninefold.llm.reasoning import effective_parser

    assert effective_parser(name, prompt_tail) == expected
    if expected == "deepseek_r1" and name == "qwen3":  # Qwen3 Thinking-2507: the output holds only </think>
        thought, answer = get_reasoning_parser(expected).split("Let me think.\n</think>\n\nIt is 4.", final=True)
        assert (thought, answer) == ("Let me think.\n", "It is 4.")
