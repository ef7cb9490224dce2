"""A byte-level recognizer of one JSON object (RFC 8259), advanced a byte at a time.

A state is a hashable tuple ``(mode, stack, aux)``: ``stack`` holds the open containers (``o``
object, ``a`` array, innermost last); ``aux`` is what the mode needs (whitespace run length between
tokens, whether a string is a key, the hex digits left in ``\\uXXXX``, the letters left of ``true``,
``false`` or ``null``). :func:`step` returns the next state, or ``None`` where the byte cannot follow.
The document must be an object (OpenAI's ``json_object`` mode); it is complete in mode ``DONE``,
after which no byte may follow. Whitespace between tokens is allowed in runs of at most
``MAX_WHITESPACE`` bytes, so a constrained model cannot pad forever. Inside strings any byte from
0x20 up except ``"`` and ``\\`` passes (UTF-8 sequences are the detokenizer's business).
"""

from __future__ import annotations

MAX_WHITESPACE = 32
WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

START = ("start", "", 0)
DONE = "done"
# modes between tokens, where whitespace may come (aux: the current run's length)
_BETWEEN = frozenset(("start", "value", "array_first", "object_first", "key", "colon", "after_value"))


def step(state: tuple, byte: int) -> tuple | None:
    """The state after ``byte``, or None when no JSON object can continue with it."""
    mode, stack, aux = state
    if mode in _BETWEEN and byte in WHITESPACE:
        return (mode, stack, aux + 1) if aux < MAX_WHITESPACE else None
    if mode == "string":
        if byte == 0x22:  # closing quote
            return ("colon", stack, 0) if aux == "key" else _after_value(stack)
        if byte == 0x5C:
            return ("escape", stack, aux)
        return state if byte >= 0x20 else None
    if mode == "escape":
        if byte == 0x75:  # \u
            return ("hex", stack, (aux, 4))
        return ("string", stack, aux) if byte in ESCAPES else None
    if mode == "hex":
        kind, left = aux
        if byte not in HEX:
            return None
        return ("string", stack, kind) if left == 1 else ("hex", stack, (kind, left - 1))
    if mode == "literal":
        if byte != aux[0]:
            return None
        return _after_value(stack) if len(aux) == 1 else ("literal", stack, aux[1:])
    if mode in _NUMBER:
        return _number(mode, stack, byte)
    if mode == "start":
        return ("object_first", "o", 0) if byte == 0x7B else None
    if mode in ("value", "array_first"):
        if mode == "array_first" and byte == 0x5D:
            return _close(stack)
        return _value(stack, byte)
    if mode in ("object_first", "key"):
        if byte == 0x22:
            return ("string", stack, "key")
        return _close(stack) if mode == "object_first" and byte == 0x7D else None
    if mode == "colon":
        return ("value", stack, 0) if byte == 0x3A else None
    if mode == "after_value":
        top = stack[-1:]
        if byte == 0x2C:  # ","
            return ("key", stack, 0) if top == "o" else ("value", stack, 0) if top == "a" else None
        if (byte == 0x7D and top == "o") or (byte == 0x5D and top == "a"):
            return _close(stack)
        return None
    return None  # DONE: nothing may follow


def advance(state: tuple | None, data: bytes) -> tuple | None:
    """The state after every byte of ``data`` (None once one cannot follow)."""
    return steps(step, state, data)


def steps(step_one, state, data: bytes):
    """``step_one`` applied for every byte of ``data`` from ``state`` (None once a byte cannot follow)."""
    for byte in data:
        if state is None:
            return None
        state = step_one(state, byte)
    return state


def complete(state: tuple | None) -> bool:
    """Whether the bytes so far form one whole JSON object."""
    return state is not None and state[0] == DONE


def _value(stack: str, byte: int) -> tuple | None:
    if byte == 0x7B:
        return ("object_first", stack + "o", 0)
    if byte == 0x5B:
        return ("array_first", stack + "a", 0)
    if byte == 0x22:
        return ("string", stack, "value")
    if byte == 0x2D:
        return ("minus", stack, None)
    if byte == 0x30:
        return ("zero", stack, None)
    if byte in DIGITS:
        return ("integer", stack, None)
    if byte in LITERALS:
        return ("literal", stack, LITERALS[byte])
    return None


def _close(stack: str) -> tuple | None:
    rest = stack[:-1]
    if not stack or stack[-1] == "*":  # (a key's truncated stack: what lies below is not known)
        return None
    return (DONE, "", 0) if not rest else ("after_value", rest, 0)


def _after_value(stack: str) -> tuple:
    return ("after_value", stack, 0)


NUMBER_ENDS = frozenset(("zero", "integer", "fraction", "exponent"))  # number modes a number may end in


def number_next(mode: str, byte: int, integer: bool = False) -> str | None:
    """The number mode after ``byte`` (modes: minus, zero, integer, point, fraction, exponent_mark,
    exponent_sign, exponent), or None when the byte does not continue the number (``integer``: no
    fraction or exponent)."""
    digit = byte in DIGITS
    if mode == "minus":
        return "zero" if byte == 0x30 else "integer" if digit else None
    if mode in ("zero", "integer"):
        if digit:
            return "integer" if mode == "integer" else None
        if integer:
            return None
        return "point" if byte == 0x2E else "exponent_mark" if byte in (0x65, 0x45) else None
    if mode == "point":
        return "fraction" if digit else None
    if mode == "fraction":
        return "fraction" if digit else "exponent_mark" if byte in (0x65, 0x45) else None
    if mode == "exponent_mark":
        return "exponent_sign" if byte in (0x2B, 0x2D) else "exponent" if digit else None
    return "exponent" if digit else None  # exponent_sign, exponent


_NUMBER = frozenset(("minus", "zero", "integer", "point", "fraction", "exponent_mark", "exponent_sign", "exponent"))


def _number(mode: str, stack: str, byte: int) -> tuple | None:
    nxt = number_next(mode, byte)
    if nxt is not None:
        return (nxt, stack, None)
    if mode not in NUMBER_ENDS:
        return None
    return step(_after_value(stack), byte)  # the byte ends the number and is read after it


def cache_key(state: tuple, depth: int = 4) -> tuple:
    """``state`` with only the innermost ``depth`` containers (a ``*`` below them): bytes that would close
    past them are refused from the key's state, so masks computed for it are safe for every deeper one."""
    mode, stack, aux = state
    if len(stack) > depth:
        stack = "*" + stack[-depth:]
    return (mode, stack, aux)


class JsonObjectMachine:
    """This module's recognizer behind the interface ``masks.TokenMasks`` and the guides use."""

    key = "json_object"
    start = START
    step = staticmethod(step)
    advance = staticmethod(advance)
    complete = staticmethod(complete)
    cache_key = staticmethod(cache_key)

    @staticmethod
    def may_end(state) -> bool:
        return complete(state)

    @staticmethod
    def in_string(state) -> bool:
        """Inside a string every plain-content token stays inside it (the masks' fast path)."""
        return state[0] == "string"


JSON_OBJECT = JsonObjectMachine()
