"""A recognizer of one string out of a fixed list (vLLM's ``guided_choice``), byte by byte.

A state is the bytes so far; it is live while they start some choice (a binary search in the sorted
choices: the first one not below the bytes starts with them if any does). It is complete (the
sequence stops) when the bytes are a choice that no other choice extends; a choice that another
extends may also end there, by an end-of-sequence token.
"""

from __future__ import annotations

from bisect import bisect_left


class ChoiceMachine:
    """The sorted choices (UTF-8) and which of them end one."""

    def __init__(self, choices: tuple[str, ...]):
        self.key = ("choice", tuple(choices))
        self.sorted = sorted({c.encode("utf-8") for c in choices})
        self.choices = frozenset(self.sorted)
        # In sorted order the choices that extend c come right after c.
        self.leaves = frozenset(c for c, nxt in zip(self.sorted, self.sorted[1:] + [b""]) if not nxt.startswith(c))
        self.start = b""

    def _live(self, prefix: bytes) -> bool:
        i = bisect_left(self.sorted, prefix)
        return i < len(self.sorted) and self.sorted[i].startswith(prefix)

    def step(self, state: bytes, byte: int) -> bytes | None:
        nxt = state + bytes((byte,))
        return nxt if self._live(nxt) else None

    def advance(self, state: bytes | None, data: bytes) -> bytes | None:
        if state is None:
            return None
        nxt = state + data
        return nxt if self._live(nxt) else None

    def complete(self, state) -> bool:
        """The output is a choice nothing longer continues: the sequence ends here."""
        return state in self.leaves

    def may_end(self, state) -> bool:
        """The output is a choice (end-of-sequence tokens are allowed)."""
        return state in self.choices

    @staticmethod
    def cache_key(state: bytes) -> bytes:
        return state

    @staticmethod
    def in_string(state) -> bool:
        return False
