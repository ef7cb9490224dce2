"""A format that applies after a reasoning model's thinking: free text up to ``</think>``, then the format.

With ``start`` (Qwen3: ``<think>``), the thinking is there only when the output begins with that tag;
an output that begins otherwise follows the format from its first byte (thinking turned off). Without
``start`` (DeepSeek-R1, whose prompt opens the thinking), the output is free text until the end tag.
The end tag is found across token boundaries (a KMP automaton over its bytes); bytes after it in the
same token already belong to the format. While thinking, every token may come and the sequence may end,
except a token that would close the thinking with bytes the format refuses. The boundaries are read as
``ninefold.llm.reasoning`` reads them: whitespace before ``<think>`` does not stop it from opening the
thinking, and newlines right after ``</think>`` (at most ``MAX_GAP``) are not part of the answer.
"""

from __future__ import annotations

from ninefold.llm.guided.json_machine import WHITESPACE, steps

MAX_GAP = 8  # newlines between </think> and the answer
MAX_LEAD = 16  # whitespace before <think>

class AfterReasoning:
    """``inner`` (a recognizer: JSON, schema, choice) after free thinking text."""

    def __init__(self, inner, end: str = "</think>", start: str | None = None):
        self.inner = inner
        self.end = end.encode()
        self.start_tag = start.encode() if start else None
        self.end_byte = self.end[-1]  # every token that closes the thinking holds it
        self.key = ("after_reasoning", start, end, inner.key)
        self.start = ("open", b"") if self.start_tag else ("free", 0)
        self._fail = _failure(self.end)

    def step(self, state: tuple, byte: int) -> tuple | None:
        """The state after ``byte``, or None when the format cannot continue with it."""
        phase, value = state
        if phase == "inner":
            nxt = self.inner.step(value, byte)
            return None if nxt is None else ("inner", nxt)
        if phase == "gap":  # right after </think>: newlines, then the answer
            if byte == 0x0A and value < MAX_GAP:
                return ("gap", value + 1)
            nxt = self.inner.step(self.inner.start, byte)
            return None if nxt is None else ("inner", nxt)
        if phase == "free":
            matched = value
            while matched and self.end[matched] != byte:
                matched = self._fail[matched - 1]
            matched += self.end[matched] == byte
            return ("gap", 0) if matched == len(self.end) else ("free", matched)
        seen = value + bytes((byte,))  # "open": is the output beginning with the start tag?
        tag = seen.lstrip(bytes(WHITESPACE))
        if self.start_tag.startswith(tag) and len(seen) - len(tag) <= MAX_LEAD:
            return ("free", 0) if tag == self.start_tag else ("open", seen)
        inner = self.inner.advance(self.inner.start, seen)
        return None if inner is None else ("inner", inner)

    def advance(self, state: tuple | None, data: bytes) -> tuple | None:
        return steps(self.step, state, data)

    def free(self, state: tuple) -> bool:
        """Thinking: every token may come but one closing the thinking into bytes the format refuses."""
        return state[0] == "free"

    def complete(self, state: tuple) -> bool:
        return state[0] == "inner" and self.inner.complete(state[1])

    def may_end(self, state: tuple) -> bool:
        """The format's own ends, and anywhere while thinking (a model may stop there)."""
        phase, value = state
        if phase == "open":  # what came so far is also the format's (a prefix of <think> that matches it)
            inner = self.inner.advance(self.inner.start, value)
            return inner is not None and self.inner.may_end(inner)
        if phase == "gap":
            return self.inner.may_end(self.inner.start)
        return phase == "free" or self.inner.may_end(value)

    def cache_key(self, state: tuple):
        return ("inner", self.inner.cache_key(state[1])) if state[0] == "inner" else state

    def in_string(self, state: tuple) -> bool:
        return state[0] == "inner" and self.inner.in_string(state[1])


def _failure(pattern: bytes) -> list[int]:
    """KMP's failure function: for each prefix, the length of its longest proper border."""
    fail, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        k += pattern[i] == pattern[k]
        fail[i] = k
    return fail
