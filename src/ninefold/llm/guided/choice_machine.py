"""A recognizer of one string out of a fixed list (vLLM's ``guided_choice``), byte by byte.

A state is the bytes so far; it is live while they start some choice. It is complete (the sequence
stops) when they are a choice that no other choice extends; a choice that another extends may also
end there, by an end-of-sequence token.
"""

from __future__ import annotations


class ChoiceMachine:
    """The byte prefixes of ``choices`` and which of them end one."""

    def __init__(self, choices: tuple[str, ...]):
        self.key = ("choice", tuple(choices))
        encoded = [c.encode("utf-8") for c in choices]
        self.choices = frozenset(encoded)
        self.prefixes = frozenset(c[:i] for c in encoded for i in range(len(c) + 1))
        self.leaves = frozenset(c for c in encoded if not any(o != c and o.startswith(c) for o in encoded))
        self.start = b""

    def step(self, state: bytes, byte: int) -> bytes | None:
        nxt = state + bytes((byte,))
        return nxt if nxt in self.prefixes else None

    def advance(self, state: bytes | None, data: bytes) -> bytes | None:
        if state is None:
            return None
        nxt = state + data
        return nxt if nxt in self.prefixes else None

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
