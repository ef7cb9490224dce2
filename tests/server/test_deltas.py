"""Streamed deltas: a stop string's prefix and an incomplete UTF-8 tail are never sent early."""

import random

from ninefold.llm.server.deltas import DeltaStream, stop_prefix_overlap


def test_overlap_is_the_longest_suffix_that_starts_a_stop_string():
    assert stop_prefix_overlap("hello wor", ["world"]) == 3
    assert stop_prefix_overlap("hello", ["world"]) == 0
    assert stop_prefix_overlap("abab", ["abac", "b"]) == 2
    assert stop_prefix_overlap("xaba", ["abac"]) == 3
    assert stop_prefix_overlap("xx", ["x"]) == 0  # a whole stop string is the engine's job, not a prefix


def _stream(pieces: list[str], stops: list[str], final: str) -> tuple[list[str], str]:
    """Feed cumulative texts then the final one; returns the deltas and their concatenation."""
    stream = DeltaStream(stops)
    text, deltas = "", []
    for piece in pieces:
        text += piece
        deltas.append(stream.delta(text, finished=False))
    deltas.append(stream.delta(final, finished=True))
    return deltas, "".join(deltas)


def test_stop_string_prefix_is_held_until_the_engine_decides():
    # The engine stops at "STOP" and drops it: the client must never have seen "ST".
    deltas, joined = _stream(["abc S", "T", "O"], ["STOP"], final="abc ")
    assert joined == "abc "
    assert all("S" not in d for d in deltas)
    # A prefix that turns out not to be a stop string is released.
    deltas, joined = _stream(["abc S", "T", "x"], ["STOP"], final="abc STx")
    assert joined == "abc STx"


def test_replacement_char_tail_is_held_and_never_duplicated():
    stream = DeltaStream()
    assert stream.delta("中\ufffd", False) == "中"
    assert stream.delta("中文", False) == "文"
    assert stream.delta("中文\ufffd\ufffd", False) == ""
    assert stream.delta("中文好", True) == "好"


def test_random_cumulative_streams_concatenate_to_the_final_text():
    rng = random.Random(0)
    alphabet = "ab中文 \ufffd"
    for _ in range(300):
        stops = ["".join(rng.choice("ab中") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 2))]
        final = "".join(rng.choice(alphabet.replace("\ufffd", "")) for _ in range(rng.randint(0, 12)))
        stream, sent = DeltaStream(stops), ""
        for end in range(len(final) + 1):
            shown = final[:end] + ("\ufffd" if rng.random() < 0.3 else "")
            sent += stream.delta(shown, False)
            assert final.startswith(sent) and "\ufffd" not in sent
        sent += stream.delta(final, True)
        assert sent == final
