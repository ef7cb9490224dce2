"""`ninefold chat` driven through a pseudo-terminal with the default model (SmolLM2-135M-Instruct):
a question in, a streamed answer out; the conversation kept across turns; /reset starts over;
Ctrl-C stops an answer but not the program; /exit quits."""

from __future__ import annotations

import sys

import pytest

pexpect = pytest.importorskip("pexpect")

QUESTION = "What is the capital of France?"
FOLLOW_UP = "And what is its population, roughly?"


def _spawn(*args: str):
    return pexpect.spawn(sys.executable, ["-m", "ninefold", "chat", *args], encoding="utf-8",
                         timeout=300, dimensions=(50, 200))


def _answer(child, text: str) -> str:
    child.sendline(text)
    child.expect_exact(text + "\r\n")  # the terminal's echo of what we typed
    child.expect_exact(">>> ")
    return child.before.strip()


def _reset(child) -> None:
    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.expect_exact(">>> ")


def test_chat_session(smollm2):
    child = _spawn("--max-tokens", "64")
    child.expect_exact(">>> ")
    banner = child.before
    assert "SmolLM2-135M-Instruct" in banner and "loading" in banner and "/reset" in banner

    first = _answer(child, QUESTION)
    assert "Paris" in first
    follow = _answer(child, FOLLOW_UP)
    assert follow

    _reset(child)
    # greedy decoding of the same single-turn conversation gives the same answer as the first time
    assert _answer(child, QUESTION) == first
    # and the follow-up asked afresh is a different prompt from the one with the conversation before it
    _reset(child)
    assert _answer(child, FOLLOW_UP) != follow

    # Ctrl-C while an answer streams stops it; the program keeps going
    child.sendline("Write a very long story about a dragon who learns to cook, with many chapters.")
    child.expect_exact("chapters.\r\n")
    child.expect(r"\w+ \w+ \w+")  # some of the answer has streamed out
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact(">>> ")
    assert "Paris" in _answer(child, "Thanks. Remind me: what is the capital of France?")

    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_bad_model_is_an_error(tmp_path):
    child = _spawn("--model", str(tmp_path / "missing-model"))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2
    assert "not an existing file or directory" in child.before
