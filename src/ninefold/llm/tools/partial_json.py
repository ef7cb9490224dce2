"""A tolerant, linear-time scanner of possibly-truncated JSON.

It finds structure, it does not validate: strings (with escapes) and nesting are understood well
enough to locate, in an object whose text may stop anywhere, each top-level key, where its value
starts and ends, and where the object closes. Whoever needs a valid value runs ``json.loads`` on the
span found. Every function only moves forward through the text, so a scan costs O(length scanned).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"

_WHITESPACE_RUN = re.compile(r"[ \t\n\r]*")
_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_STRING_TOKEN = re.compile(_STRING, re.DOTALL)
# In a container: a whole string, a bracket, or the opening quote of a string the text cuts off.
_CONTAINER_TOKEN = re.compile(rf'(?P<string>{_STRING})|(?P<bracket>[{{}}\[\]])|(?P<cut>")', re.DOTALL)
_SCALAR = re.compile(r"[-+.0-9A-Za-z]+")


def skip_whitespace(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    return _WHITESPACE_RUN.match(text, i).end()


def scan_string(text: str, i: int) -> int | None:
    """The index just past the string token that starts at ``text[i] == '"'``; None if the text ends first."""
    token = _STRING_TOKEN.match(text, i)
    return None if token is None else token.end()


def _scan_container(text: str, i: int) -> int | None:
    depth = 0
    pos = i
    while True:
        token = _CONTAINER_TOKEN.search(text, pos)
        if token is None or token.lastgroup == "cut":
            return None
        pos = token.end()
        if token.lastgroup == "bracket":
            # Brackets are only counted, not matched: mismatched ones are for json.loads to refuse.
            depth += 1 if text[token.start()] in "{[" else -1
            if depth == 0:
                return pos


def scan_value(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at ``i``; None while the text ends inside it.

    A scalar (number, ``true``, ...) that reaches the end of the text is still open: more characters
    may belong to it. Raises ValueError when ``text[i]`` cannot start a value.
    """
    char = text[i]
    if char == '"':
        return scan_string(text, i)
    if char in "{[":
        return _scan_container(text, i)
    scalar = _SCALAR.match(text, i)
    if scalar is None:
        raise ValueError(f"no JSON value starts with {char!r} at {i}")
    return scalar.end() if scalar.end() < len(text) else None


@dataclass
class Member:
    """A top-level member of a scanned object, found once its key string is complete."""

    key: str
    key_start: int
    value_start: int | None = None  # None until the value's first character is seen
    value_end: int | None = None  # just past the value; None while it is open


@dataclass
class ObjectScan:
    """What ``scan_object`` found: the members so far and, once seen, where the object closes."""

    start: int
    members: list[Member] = field(default_factory=list)
    end: int | None = None  # just past the closing brace; None while the object is open
    error: int | None = None  # index of the first character that cannot continue the object

    def first(self, keys: tuple[str, ...] | str) -> Member | None:
        """The first member whose key is ``keys`` (or one of them)."""
        keys = (keys,) if isinstance(keys, str) else keys
        return next((member for member in self.members if member.key in keys), None)


def scan_object(text: str, start: int) -> ObjectScan:
    """Scan the object that starts at ``text[start] == '{'`` as far as the text goes.

    Stops at the end of the text, at the closing brace, or at the first character that cannot
    continue the object (``error``); keys are decoded with ``json.loads`` (one that does not decode
    is an error at its first character).
    """
    scan = ObjectScan(start)
    n = len(text)
    i = skip_whitespace(text, start + 1)
    if i < n and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < n:
        if text[i] != '"':
            scan.error = i
            return scan
        key_end = scan_string(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.error = i
            return scan
        member = Member(key, i)
        scan.members.append(member)
        i = skip_whitespace(text, key_end)
        if i >= n:
            return scan
        if text[i] != ":":
            scan.error = i
            return scan
        i = skip_whitespace(text, i + 1)
        if i >= n:
            return scan
        try:
            member.value_end = scan_value(text, i)
        except ValueError:
            scan.error = i
            return scan
        member.value_start = i
        if member.value_end is None:
            return scan
        i = skip_whitespace(text, member.value_end)
        if i >= n:
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            scan.error = i
            return scan
        i = skip_whitespace(text, i + 1)
    return scan
