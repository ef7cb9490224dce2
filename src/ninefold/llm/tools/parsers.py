"""Parsers of tool calls in a model's generated text, for whole outputs and for growing prefixes.

Each parser reads one model family's format (see the classes). ``parse(text, final=True)`` reads a
whole output: its content and its calls, or, when the tool-call markup is malformed, the whole text
as content and no calls. ``parse(prefix, final=False)`` reads a prefix of an output while it streams
and returns only what further text cannot change: parsing a longer prefix (or the whole well-formed
output) gives content that extends the content, at least as many calls, each call's arguments
extending the earlier ones, and the same name once a name is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ninefold.llm.markers import partial_marker_length
from ninefold.llm.tools.partial_json import WHITESPACE, ObjectScan, scan_object, skip_whitespace


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: its function name and the raw JSON text of its arguments."""

    name: str | None  # None until the name string is complete
    arguments: str  # raw JSON text of the arguments value generated so far ("" if not started)
    complete: bool  # the call's JSON object is closed (its arguments value is complete)


@dataclass(frozen=True)
class Parsed:
    """What a parse found: the ordinary assistant content and the tool calls."""

    content: str
    calls: tuple[ParsedCall, ...]


class ToolCallParser:
    """Reads tool calls out of generated text; ``name`` is the parser's registry name."""

    name: str

    def parse(self, text: str, final: bool) -> Parsed:
        """Parse a whole output (``final``) or a prefix of one while it streams (see the module docstring)."""
        raise NotImplementedError


@dataclass
class _Split:
    """A format's reading of the text: content, the call objects begun and whether the markup is sound."""

    content: str
    objects: list[ObjectScan] = field(default_factory=list)
    well_formed: bool = True  # only for a final parse: the markup around the objects is complete and valid


class _JSONCallsParser(ToolCallParser):
    """A format whose calls are JSON objects holding a name and an arguments object."""

    argument_keys: tuple[str, ...] = ("arguments",)

    def parse(self, text: str, final: bool) -> Parsed:
        """Parse a whole output (``final``) or a prefix of one while it streams (see the module docstring)."""
        split = self._split(text, final)
        if not final:
            return Parsed(split.content, tuple(self._partial_call(text, obj) for obj in split.objects))
        calls = [self._final_call(text, obj) for obj in split.objects]
        if not split.well_formed or any(call is None for call in calls):
            return Parsed(text, ())
        return Parsed(split.content, tuple(calls))

    def _split(self, text: str, final: bool) -> _Split:
        raise NotImplementedError

    def _partial_call(self, text: str, obj: ObjectScan) -> ParsedCall:
        name = None
        name_member = obj.first("name")
        if name_member and name_member.value_end is not None and text[name_member.value_start] == '"':
            try:
                name = json.loads(text[name_member.value_start : name_member.value_end])
            except ValueError:
                pass
        arguments = ""
        argument_member = obj.first(self.argument_keys)
        if argument_member and argument_member.value_start is not None:
            if argument_member.value_end is None:
                arguments = text[argument_member.value_start :].rstrip(WHITESPACE)
            else:
                arguments = text[argument_member.value_start : argument_member.value_end]
        elif argument_member is None and obj.end is not None:
            arguments = "{}"
        return ParsedCall(name, arguments, obj.end is not None)

    def _final_call(self, text: str, obj: ObjectScan) -> ParsedCall | None:
        """The call that a closed, valid object makes; None when it is malformed."""
        if obj.end is None:
            return None
        try:
            value = json.loads(text[obj.start : obj.end], parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            return None
        names = [member for member in obj.members if member.key == "name"]
        arguments = [member for member in obj.members if member.key in self.argument_keys]
        if len(names) != 1 or len(arguments) > 1 or not isinstance(value["name"], str):
            return None
        if not arguments:
            return ParsedCall(value["name"], "{}", True)
        member = arguments[0]
        if not isinstance(value[member.key], dict):
            return None
        return ParsedCall(value["name"], text[member.value_start : member.value_end], True)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _hold_back(text: str, marker: str) -> str:
    """``text`` less its longest suffix that is a proper prefix of ``marker`` (it may become the marker)."""
    return text[: len(text) - partial_marker_length(text, (marker,))]


def _only_whitespace(text: str, start: int) -> bool:
    return skip_whitespace(text, start) == len(text)


def _scan_sequence(text: str, i: int, separator: str, closer: str | None) -> tuple[list[ObjectScan], bool]:
    """Scan objects separated by ``separator`` from ``i``, up to ``closer`` (or, without one, the text's end).

    Returns the objects begun and whether the sequence is complete with only whitespace after it.
    """
    objects: list[ObjectScan] = []
    n = len(text)
    i = skip_whitespace(text, i)
    if closer and i < n and text[i] == closer:
        return objects, _only_whitespace(text, i + 1)
    while i < n and text[i] == "{":
        obj = scan_object(text, i)
        objects.append(obj)
        if obj.end is None:
            return objects, False
        i = skip_whitespace(text, obj.end)
        if i >= n:
            return objects, closer is None
        if closer and text[i] == closer:
            return objects, _only_whitespace(text, i + 1)
        if text[i] != separator:
            return objects, False
        i = skip_whitespace(text, i + 1)
    return objects, False


class HermesParser(_JSONCallsParser):
    """Hermes 2 Pro / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    Content is the text before the first ``<tool_call>``; text after or between blocks is dropped. The
    last block may lack ``</tool_call>`` (models often stop right after the JSON object).
    """

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def _split(self, text: str, final: bool) -> _Split:
        start = text.find(self.START)
        if start < 0:
            return _Split(text if final else _hold_back(text, self.START))
        split = _Split(text[:start], well_formed=False)
        i = start + len(self.START)
        while True:
            i = skip_whitespace(text, i)
            if i >= len(text) or text[i] != "{":
                return split
            obj = scan_object(text, i)
            split.objects.append(obj)
            if obj.end is None:
                return split
            i = skip_whitespace(text, obj.end)
            if i == len(text):
                split.well_formed = True
                return split
            if not text.startswith(self.END, i):
                return split
            i = text.find(self.START, i + len(self.END))
            if i < 0:
                split.well_formed = True
                return split
            i += len(self.START)


class Llama3JSONParser(_JSONCallsParser):
    """Llama 3.1 / 3.2 JSON tool calling: ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.

    An output is tool calls when, after optional whitespace and ``<|python_tag|>``, it starts with
    ``{``; otherwise it is all content. ``"arguments"`` is accepted for ``"parameters"``. While only
    whitespace and (part of) the tag have come, nothing is decided and nothing is returned.
    """

    name = "llama3_json"
    argument_keys = ("parameters", "arguments")
    TAG = "<|python_tag|>"

    def _split(self, text: str, final: bool) -> _Split:
        i = skip_whitespace(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_whitespace(text, i + len(self.TAG))
        elif not final and i < len(text) and self.TAG.startswith(text[i:]):
            return _Split("")
        if i >= len(text):
            return _Split(text if final else "")
        if text[i] != "{":
            return _Split(text)
        objects, well_formed = _scan_sequence(text, i, ";", None)
        return _Split("", objects, well_formed)


class MistralParser(_JSONCallsParser):
    """Mistral: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name": ..., "arguments": {...}}``."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def _split(self, text: str, final: bool) -> _Split:
        start = text.find(self.MARKER)
        if start < 0:
            return _Split(text if final else _hold_back(text, self.MARKER))
        i = skip_whitespace(text, start + len(self.MARKER))
        if i >= len(text) or text[i] != "[":
            return _Split(text[:start], well_formed=False)
        objects, well_formed = _scan_sequence(text, i + 1, ",", "]")
        return _Split(text[:start], objects, well_formed)


class JSONArrayParser(_JSONCallsParser):
    """The server's guided format for ``tool_choice: "required"``: a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects and nothing else (content is always empty).
    """

    name = "json_array"
    argument_keys = ("parameters",)

    def _split(self, text: str, final: bool) -> _Split:
        i = skip_whitespace(text, 0)
        if i >= len(text) or text[i] != "[":
            return _Split("", well_formed=False)
        objects, well_formed = _scan_sequence(text, i + 1, ",", "]")
        return _Split("", objects, well_formed)


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JSONParser, MistralParser, JSONArrayParser)
}


def get_parser(name: str) -> ToolCallParser:
    """A new parser of the registered format ``name``; ValueError when there is none."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser: got {name!r}; expected one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
