"""A byte-level recognizer of text that matches a regular expression as a whole (vLLM's ``guided_regex``).

The pattern (Python ``re`` syntax, a subset) is parsed into a Thompson NFA over characters; a state is the
set of NFA positions reached (closed under empty moves) and the bytes of a character not yet complete, so
UTF-8 text is matched by character as ``re`` matches it. Supported: literals and escapes (``\\d \\w \\s`` and
their negations, ``\\n \\t \\r \\f \\v``, ``\\xHH``, ``\\uXXXX``, escaped metacharacters), classes ``[...]`` and
``[^...]`` with ranges, ``.`` (any character but a newline), groups ``(...)``, ``(?:...)`` and
``(?P<name>...)``, alternation, and the quantifiers ``* + ? {m} {m,} {m,n}`` (lazy or not: the same
language; ``{,}`` is ``{0,}``); a leading ``^`` and a trailing ``$`` are accepted (the whole output matches anyway). ``\\d \\w \\s``
are ASCII classes (as with ``re.ASCII``). Anything else
(backreferences, lookaround, ``\\b``, inline flags) is a ValueError naming it, and so is a pattern that ``re`` refuses,
one nested more than ``MAX_NESTING`` groups deep, or one that no text can match.
"""

from __future__ import annotations

import re

from ninefold.llm.guided.json_machine import steps
from ninefold.llm.unicode import UNPAIRED_SURROGATE, is_valid_unicode

MAX_PATTERN = 4096  # characters
MAX_STATES = 4000  # NFA positions (bounded repetition copies its body)
MAX_ACTIVE = 256  # positions one character may leave the match at (checked per position at compile time)
MAX_MOVES = 1 << 20  # positions held by the cache of moves, all entries together
MAX_REPEAT = 1000
MAX_NESTING = 100  # groups inside groups (the parser and the compiler recurse per level)
MAX_CODE = 0x10FFFF

_DIGITS = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20))
_CLASSES = {"d": (_DIGITS, False), "D": (_DIGITS, True), "w": (_WORD, False), "W": (_WORD, True),
            "s": (_SPACE, False), "S": (_SPACE, True)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}  # \0 is read as octal
_UNSUPPORTED_ESCAPES = {"b": "word boundaries (\\b)", "B": "\\B", "A": "\\A", "Z": "\\Z", "z": "\\z"}


class CharSet:
    """Characters as sorted inclusive code-point ranges, or everything outside them (``negated``)."""

    __slots__ = ("ranges", "negated")

    def __init__(self, ranges, negated: bool = False):
        self.ranges = tuple(sorted(ranges))
        self.negated = negated

    def __contains__(self, code: int) -> bool:
        inside = any(low <= code <= high for low, high in self.ranges)
        return inside != self.negated

    def meets(self, low: int, high: int) -> bool:
        """Whether some character in ``low..high`` is in the set."""
        if not self.negated:
            return any(a <= high and low <= b for a, b in self.ranges)
        for a, b in self.ranges:  # sorted: walk up from low past the ranges that cover it
            if a <= low <= b:
                low = b + 1
        return low <= high and not any(a <= low <= b for a, b in self.ranges)


class _Parser:
    """Recursive descent over the pattern into nested tuples: ("alt", [...]), ("cat", [...]),
    ("repeat", node, low, high|None), ("set", CharSet)."""

    def __init__(self, pattern: str):
        self.text = pattern
        self.i = 0
        self.depth = 0  # groups open at self.i

    def fail(self, what: str):
        raise ValueError(f"guided_decoding.regex: {what} at position {self.i} of {self.text[:80]!r}")

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def take(self) -> str:
        if self.i >= len(self.text):
            self.fail("the pattern ends early")
        self.i += 1
        return self.text[self.i - 1]

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.peek() == "$" and self.i == len(self.text) - 1:
            self.i += 1
        if self.i != len(self.text):
            self.fail(f"unexpected {self.peek()!r}")
        return node

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else ("alt", options)

    def concatenation(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.i == len(self.text) - 1:
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def quantified(self, node):
        counts = self._quantifier()
        if counts is None:
            return node
        if self.peek() == "?":  # lazy: the same strings
            self.i += 1
        elif self.peek() == "+":
            self.fail("possessive quantifiers are not supported")
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._counted()):
            self.fail("multiple repeat (a quantifier right after another)")
        return ("repeat", node, *counts)

    def _quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c == "{" and self._counted():
            return self._counts()
        if c not in ("*", "+", "?"):
            return None
        self.i += 1
        return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]

    def _counted(self) -> bool:
        end = self.text.find("}", self.i)
        inner = self.text[self.i + 1:end] if end > 0 else ""
        parts = inner.split(",")
        if end < 0 or len(parts) > 2 or not all(p.isdigit() or p == "" for p in parts):
            return False
        return bool(parts[0]) or len(parts) == 2  # {m} {m,} {m,n} {,n} {,}

    def _counts(self) -> tuple[int, int | None]:
        end = self.text.index("}", self.i)
        parts = self.text[self.i + 1:end].split(",")
        self.i = end + 1
        low = int(parts[0] or 0)
        high = low if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if high is not None and high < low:
            self.fail(f"{{{low},{high}}} has its bounds the wrong way round")
        if max(low, high or 0) > MAX_REPEAT:
            self.fail(f"repetition counts above {MAX_REPEAT} are not supported")
        return low, high

    def atom(self):
        c = self.take()
        if c == "(":
            if self.depth >= MAX_NESTING:
                self.fail(f"groups nested more than {MAX_NESTING} deep are not supported")
            if self.peek() == "?":
                self.i += 1
                kind = self.take()
                if kind == "P" and self.peek() == "<":
                    end = self.text.find(">", self.i)
                    if end < 0:
                        self.fail("a group name is not closed")
                    name = self.text[self.i + 1:end]
                    if not name.isidentifier():
                        self.fail(f"the group name {name!r} is not an identifier")
                    self.i = end + 1
                elif kind != ":":
                    self.fail(f"(?{kind} (lookaround, flags or other extensions) is not supported")
            self.depth += 1
            node = self.alternation()
            self.depth -= 1
            if self.peek() != ")":
                self.fail("a group is not closed")
            self.i += 1
            return node
        if c == "[":
            return ("set", self._class())
        if c == ".":
            return ("set", CharSet(((0x0A, 0x0A),), negated=True))
        if c == "\\":
            return ("set", self._escape())
        if c in "*+?":
            self.fail(f"nothing to repeat before {c!r}")
        if c == ")":
            self.fail("unbalanced ')'")
        if c in "^$":
            self.fail(f"{c!r} inside the pattern is not supported (the whole output matches)")
        return ("set", CharSet(((ord(c), ord(c)),)))

    def _escape(self) -> CharSet:
        c = self.take()
        if c in _CLASSES:
            ranges, negated = _CLASSES[c]
            return CharSet(ranges, negated)
        if c in _UNSUPPORTED_ESCAPES:
            self.fail(f"{_UNSUPPORTED_ESCAPES[c]} is not supported")
        if c in "01234567" and (c == "0" or self.text[self.i:self.i + 2].isdigit()):
            digits = c  # an octal escape: \0, \0N, \0NN, or \NNN from 1
            while len(digits) < 3 and self.peek() is not None and self.peek() in "01234567":
                digits += self.take()
            if c != "0" and len(digits) < 3:
                self.fail("backreferences are not supported")
            if int(digits, 8) > 0o377:
                self.fail(f"the octal escape \\{digits} is above \\377")
            return CharSet(((int(digits, 8),) * 2,))
        if c.isdigit():
            self.fail("backreferences are not supported")
        if c in ("x", "u", "U"):
            digits = {"x": 2, "u": 4, "U": 8}[c]
            code = self.text[self.i:self.i + digits]
            if len(code) != digits or any(d not in "0123456789abcdefABCDEF" for d in code):
                self.fail(f"\\{c} needs {digits} hex digits")
            self.i += digits
            value = int(code, 16)
            if value > MAX_CODE:
                self.fail(f"\\{c}{code} is above U+10FFFF")
            return CharSet(((value, value),))
        if c.isalnum() and c not in _CHAR_ESCAPES:
            self.fail(f"the escape \\{c} is not supported")
        code = ord(_CHAR_ESCAPES.get(c, c))
        return CharSet(((code, code),))

    def _class(self) -> CharSet:
        negated = self.peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                part = self._escape()
                if part.negated:  # \D \W \S inside [...]: the characters outside their ranges
                    ranges.extend(_complement(part.ranges))
                    continue
                if len(part.ranges) == 1 and part.ranges[0][0] == part.ranges[0][1]:
                    low = part.ranges[0][0]
                else:
                    if self.peek() == "-" and self.i + 1 < len(self.text) and self.text[self.i + 1] != "]":
                        self.fail("a class escape (\\d, \\w, \\s, ...) cannot start a range")
                    ranges.extend(part.ranges)
                    continue
            else:
                low = ord(c)
            if self.peek() == "-" and self.i + 1 < len(self.text) and self.text[self.i + 1] != "]":
                self.i += 1
                c = self.take()
                high = self._range_end() if c == "\\" else ord(c)
                if high < low:
                    self.fail("a class range is backwards")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        return CharSet(ranges, negated)

    def _range_end(self) -> int:
        """The character of an escape that ends a class range; a class escape (``\\d``, ...) is refused."""
        part = self._escape()
        if part.negated or len(part.ranges) != 1 or part.ranges[0][0] != part.ranges[0][1]:
            self.fail("a class escape (\\d, \\w, \\s, ...) cannot end a range")
        return part.ranges[0][0]


class RegexMachine:
    """The compiled pattern and the recognizer's step over it."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"guided_decoding.regex: expected a non-empty pattern string, got {pattern!r}")
        if len(pattern) > MAX_PATTERN:
            raise ValueError(f"guided_decoding.regex: {len(pattern)} characters; at most {MAX_PATTERN}")
        if not is_valid_unicode(pattern):  # no output text can contain an unpaired surrogate
            raise ValueError(f"guided_decoding.regex: {UNPAIRED_SURROGATE} ({pattern[:40]!a})")
        _check_python_accepts(pattern)
        tree = _Parser(pattern).parse()
        self.edges: list[list[tuple[CharSet, int]]] = []  # per position: (characters, next position)
        self.empty: list[list[int]] = []  # per position: positions reached without a character
        start, self.accept = self._build(tree)
        self.key = ("regex", pattern)
        self.start = (self._closure({start}), b"")
        self._check_reachable(start, pattern)
        self._check_activity(start)
        self._moves: dict[tuple[frozenset, int], frozenset] = {}
        self._moved = 0  # positions held by _moves

    # -- compiling -----------------------------------------------------------------------------------

    def _new(self) -> int:
        if len(self.edges) >= MAX_STATES:
            raise ValueError(f"guided_decoding.regex: the pattern needs more than {MAX_STATES} states")
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1

    def _build(self, node) -> tuple[int, int]:
        """(entry, exit) positions of a fragment recognizing ``node``."""
        kind = node[0]
        if kind == "set":
            a, b = self._new(), self._new()
            self.edges[a].append((node[1], b))
            return a, b
        if kind == "cat":
            a = b = self._new()
            for item in node[1]:
                s, e = self._build(item)
                self.empty[b].append(s)
                b = e
            return a, b
        if kind == "alt":
            a, b = self._new(), self._new()
            for option in node[1]:
                s, e = self._build(option)
                self.empty[a].append(s)
                self.empty[e].append(b)
            return a, b
        _, body, low, high = node  # repeat
        a = b = self._new()
        for _ in range(low):
            s, e = self._build(body)
            self.empty[b].append(s)
            b = e
        if high is None:
            s, e = self._build(body)
            self.empty[b].append(s)
            self.empty[e].append(s)
            end = self._new()
            self.empty[b].append(end)
            self.empty[e].append(end)
            return a, end
        end = self._new()
        for _ in range(high - low):
            self.empty[b].append(end)
            s, e = self._build(body)
            self.empty[b].append(s)
            b = e
        self.empty[b].append(end)
        return a, end

    def _check_activity(self, start: int) -> None:
        """Refuse patterns where one position reaches more than MAX_ACTIVE others without a character (``(.?){900}``):
        every step would carry thousands of positions."""
        entries = {start} | {nxt for edges in self.edges for _, nxt in edges}
        for position in entries:
            seen, todo = {position}, [position]
            while todo:
                for nxt in self.empty[todo.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
                        if len(seen) > MAX_ACTIVE:
                            raise ValueError(f"guided_decoding.regex: the pattern keeps more than {MAX_ACTIVE} ways "
                                             "to match open at once (optional parts repeated many times); "
                                             "not supported")

    def _check_reachable(self, start: int, pattern: str) -> None:
        """Refuse a pattern that no text matches (``[^\\x00-\\U0010FFFF]``): the accept position cannot be reached
        from the start through empty moves and characters some UTF-8 text can hold."""
        seen, todo = {start}, [start]
        while todo:
            position = todo.pop()
            nexts = list(self.empty[position])
            nexts += [nxt for chars, nxt in self.edges[position] if _has_scalar(chars)]
            for nxt in nexts:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        if self.accept not in seen:
            raise ValueError(f"guided_decoding.regex: no text matches {pattern[:80]!r}; expected a pattern that "
                             "some text matches")

    def _closure(self, positions) -> frozenset:
        seen, todo = set(positions), list(positions)
        while todo:
            for nxt in self.empty[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    # -- recognizing ---------------------------------------------------------------------------------

    def _move(self, positions: frozenset, code: int) -> frozenset:
        key = (positions, code)
        moved = self._moves.get(key)
        if moved is None:
            moved = self._closure({nxt for p in positions for chars, nxt in self.edges[p] if code in chars})
            if self._moved + len(moved) > MAX_MOVES:
                self._moves.clear()
                self._moved = 0
            self._moves[key] = moved
            self._moved += len(moved)
        return moved

    def step(self, state: tuple, byte: int) -> tuple | None:
        """The state after ``byte``, or None when no match can continue with it."""
        positions, pending = state
        if not pending and byte < 0x80:
            moved = self._move(positions, byte)
            return (moved, b"") if moved else None
        pending += bytes((byte,))
        need = _utf8_length(pending[0])
        if need == 0 or (len(pending) > 1 and not 0x80 <= byte <= 0xBF):
            return None
        if len(pending) < need:  # live only while some character it may become can move on
            span = _completions(pending, need)
            if span is None or not any(chars.meets(*span) for p in positions for chars, _ in self.edges[p]):
                return None
            return positions, pending
        try:
            code = ord(pending.decode("utf-8"))
        except UnicodeDecodeError:
            return None
        moved = self._move(positions, code)
        return (moved, b"") if moved else None

    def advance(self, state: tuple | None, data: bytes) -> tuple | None:
        return steps(self.step, state, data)

    def may_end(self, state) -> bool:
        """The text so far matches (an end-of-sequence token may come)."""
        return not state[1] and self.accept in state[0]

    def complete(self, state) -> bool:
        """The text matches and nothing can follow: the sequence ends here."""
        positions, pending = state
        return not pending and self.accept in positions and not any(self.edges[p] for p in positions)

    @staticmethod
    def cache_key(state):
        return state

    @staticmethod
    def in_string(state) -> bool:
        return False


def _check_python_accepts(pattern: str) -> None:
    """Refuse what Python's ``re`` refuses, with its message."""
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"guided_decoding.regex: {pattern[:80]!r} is not a valid regular expression ({error})") from None
    except RecursionError:
        raise ValueError(f"guided_decoding.regex: {pattern[:80]!r} nests too deeply; at most {MAX_NESTING} groups "
                         "inside each other") from None


def _has_scalar(chars: CharSet) -> bool:
    """Whether ``chars`` holds a character that UTF-8 text can carry (not a surrogate, not past U+10FFFF)."""
    return chars.meets(0, 0xD7FF) or chars.meets(0xE000, MAX_CODE)


def _completions(pending: bytes, need: int) -> tuple[int, int] | None:
    """The code points that the incomplete UTF-8 sequence ``pending`` (of ``need`` bytes) may still become."""
    low_second = {0xE0: 0xA0, 0xF0: 0x90}.get(pending[0], 0x80)  # no overlong forms
    high_second = {0xED: 0x9F, 0xF4: 0x8F}.get(pending[0], 0xBF)  # no surrogates, nothing past U+10FFFF
    if len(pending) > 1 and not low_second <= pending[1] <= high_second:
        return None
    rest = need - len(pending)
    low = pending + (bytes((low_second,)) if len(pending) == 1 else b"") + b"\x80" * (rest - (len(pending) == 1))
    high = pending + (bytes((high_second,)) if len(pending) == 1 else b"") + b"\xbf" * (rest - (len(pending) == 1))
    return ord(low.decode("utf-8")), ord(high.decode("utf-8"))


def _complement(ranges) -> list[tuple[int, int]]:
    """The code points outside sorted ``ranges``."""
    out, low = [], 0
    for a, b in sorted(ranges):
        if a > low:
            out.append((low, a - 1))
        low = max(low, b + 1)
    if low <= 0x10FFFF:
        out.append((low, 0x10FFFF))
    return out


def _utf8_length(first: int) -> int:
    """Bytes of the UTF-8 sequence that ``first`` starts (0: not a valid first byte)."""
    if 0xC2 <= first <= 0xDF:
        return 2
    if 0xE0 <= first <= 0xEF:
        return 3
    if 0xF0 <= first <= 0xF4:
        return 4
    return 0
