"""Streaming tool calls: what a chat-completion chunk adds to the content and to each tool call."""

from __future__ import annotations

from collections.abc import Callable

from ninefold.llm.tools.parsers import ToolCallParser


class ToolCallDeltas:
    """Turns successive parses of a growing output into OpenAI chat-completion-chunk deltas.

    Call ``update`` with the whole output so far each time it grows, and once with ``final=True`` at
    the end. Content deltas are the new suffix of the parsed content. A tool call is announced once its
    name is known, in order (call ``i`` waits for call ``i - 1``), with a fresh id and the arguments so
    far: ``{"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}``;
    later deltas carry only the arguments' new suffix: ``{"index": i, "function": {"arguments": ...}}``.

    For a well-formed output, everything sent adds up to the final parse: the content and each call's
    name and arguments. When the final parse contradicts what was streamed (the markup turned out to be
    malformed, so the final parse is the whole text as content and no calls), what was sent cannot be
    taken back: the rest of the final content is sent if it extends the content sent (it does for the
    built-in parsers), otherwise no more content; calls already announced stay announced and get no more
    arguments that do not extend theirs. A caller can tell this case by comparing ``calls_sent`` with the
    number of calls in the final parse.
    """

    def __init__(self, parser: ToolCallParser, new_id: Callable[[], str]) -> None:
        self.parser = parser
        self.new_id = new_id
        self._content = ""  # content sent so far
        self._names: list[str] = []  # name of each announced call
        self._arguments: list[str] = []  # arguments sent so far, per announced call
        self.final_calls: int | None = None  # the calls of the final parse, once ``update`` has seen it

    @property
    def calls_sent(self) -> int:
        """The number of tool calls announced so far."""
        return len(self._names)

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """text: the whole output so far (grows between calls). Returns (content delta, tool_call deltas)."""
        parsed = self.parser.parse(text, final)
        if final:
            self.final_calls = len(parsed.calls)
        content_delta = ""
        if len(parsed.content) > len(self._content) and parsed.content.startswith(self._content):
            content_delta = parsed.content[len(self._content) :]
            self._content = parsed.content
        deltas: list[dict] = []
        for index, call in enumerate(parsed.calls):
            if index < len(self._names):
                delta = self._more_arguments(index, call.name, call.arguments)
                if delta:
                    deltas.append(delta)
            elif call.name is None:
                break
            else:
                deltas.append(self._announce(index, call.name, call.arguments))
        return content_delta, deltas

    def _announce(self, index: int, name: str, arguments: str) -> dict:
        self._names.append(name)
        self._arguments.append(arguments)
        function = {"name": name, "arguments": arguments}
        return {"index": index, "id": self.new_id(), "type": "function", "function": function}

    def _more_arguments(self, index: int, name: str | None, arguments: str) -> dict | None:
        sent = self._arguments[index]
        if name != self._names[index] or len(arguments) <= len(sent) or not arguments.startswith(sent):
            return None
        self._arguments[index] = arguments
        return {"index": index, "function": {"arguments": arguments[len(sent) :]}}
