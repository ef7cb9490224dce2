"""What a chat request's ``tools`` and ``tool_choice`` ask of the output, and how the output is read back.

- ``none`` (the default without tools): plain content; the tools are still shown to the chat template.
- ``auto`` (the default with tools): the model decides; its output is read by the server's tool-call parser
  (``--enable-auto-tool-choice --tool-call-parser NAME``, vLLM's flags). Without them, a 400.
- ``required``: guided decoding forces a JSON array of ``{"name": ..., "parameters": {...}}`` calls, one of the
  tools each with arguments following its parameters schema (one call with ``parallel_tool_calls: false``).
- a named function: guided decoding forces that function's arguments (its parameters schema).

Schemas outside what guided decoding supports are a 400 naming the tool and the keyword.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ninefold.llm.guided import GuidedDecodingParams
from ninefold.llm.server.errors import bad_request
from ninefold.llm.server.protocol import ChatCompletionRequest, NamedToolChoice
from ninefold.llm.tools import Parsed, ParsedCall, ToolCallDeltas, ToolCallParser, get_parser

NO_PARAMETERS = {"type": "object", "properties": {}}


class NamedCallParser(ToolCallParser):
    """The output of a named tool choice: the whole text is the arguments of that one function."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        arguments = text.strip()
        if not arguments and not final:
            return Parsed("", ())
        return Parsed("", (ParsedCall(self.function, arguments, final),))


@dataclass(frozen=True)
class ToolPlan:
    """How one request treats tools: ``mode`` is none, auto, required or named."""

    mode: str
    guided: GuidedDecodingParams | None = None
    parser: ToolCallParser | None = None

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for tool calls."""
        return self.parser is not None

    def deltas(self) -> ToolCallDeltas:
        """A streaming reader of one choice's output."""
        return ToolCallDeltas(self.parser, new_call_id)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and the finish reason to report.

        Calls read from the output make ``tool_calls`` (content ``None`` when there is no other text); the
        reason becomes ``tool_calls`` for ``auto``/``required`` outputs that ended normally (a named call keeps
        ``stop``, as OpenAI reports forced calls). An output cut by ``max_tokens`` (``length``) is read as a
        stream reads it so far, as OpenAI does: the calls whose names were written, with the arguments as far as
        they got (not valid JSON), and the content before them.
        """
        parsed = self.parser.parse(text, final=finish_reason != "length")
        calls = [call_object(c) for c in parsed.calls if c.name is not None]
        message = {"role": "assistant", "content": parsed.content or (None if calls else ""), "tool_calls": calls}
        return message, self.reason(finish_reason, bool(calls))

    def reason(self, finish_reason: str | None, called: bool) -> str | None:
        """``tool_calls`` in place of ``stop`` when an auto or required output called tools."""
        if called and finish_reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def new_call_id() -> str:
    """An id for one tool call (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_object(call: ParsedCall) -> dict:
    """A finished call in the response's ``tool_calls`` format."""
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def plan(req: ChatCompletionRequest, auto_parser: str | None, other_format: bool,
         reasoning: str | None = None) -> ToolPlan:
    """The request's ToolPlan; a 400 for a choice the tools or the server cannot give.

    ``auto_parser``: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on.
    ``other_format``: the request also asks for ``response_format`` / ``guided_*``. ``reasoning``: the server's
    reasoning parser, after whose thinking forced calls hold.
    """
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools: the function name {duplicate!r} is given twice", "tools")
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise bad_request(f"tool_choice {_shown(choice)} needs tools; none were given", "tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                              "--tool-call-parser (or send tool_choice 'none', 'required' or a named function)",
                              "tool_choice")
        return ToolPlan("auto", parser=get_parser(auto_parser))
    if other_format:
        raise bad_request(f"tool_choice {_shown(choice)} decides the output's format; it cannot be combined with "
                          "response_format, guided_json, guided_choice or guided_regex", "tool_choice")
    parameters = {t.function.name: t.function.parameters or NO_PARAMETERS for t in tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in parameters:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"({', '.join(map(repr, names))})", "tool_choice")
        return ToolPlan("named", _guided(parameters[name], f"tools[{names.index(name)}] ({name})", reasoning),
                        NamedCallParser(name))
    definitions: dict = {}
    alternatives = []
    for i, (name, schema) in enumerate(parameters.items()):
        schema = _hoist_definitions(schema, f"tool{i}.", definitions)
        alternatives.append({"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                             "required": ["name", "parameters"]})
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if definitions:
        calls["$defs"] = definitions
    if not req.parallel_tool_calls:
        calls["maxItems"] = 1
    return ToolPlan("required", _guided(calls, "tools", reasoning), get_parser("json_array"))


def template_tools(req) -> list[dict] | None:
    """The tools as chat templates take them (``[{"type": "function", "function": {...}}]``), or None."""
    if not req.tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools]


def _hoist_definitions(schema, prefix: str, definitions: dict):
    """``schema`` with its ``$defs`` / ``definitions`` moved into ``definitions`` under ``prefix`` (its ``$ref``s
    rewritten to match) and its ``$id`` dropped: the tools' schemas become parts of one schema, whose root
    alone may hold them."""
    if not isinstance(schema, dict):
        return schema
    local = {}
    for container in ("$defs", "definitions"):
        for key, value in (schema.get(container) or {}).items() if isinstance(schema.get(container), dict) else ():
            local[f"#/{container}/{key}"] = f"#/$defs/{prefix}{key}"
            definitions[f"{prefix}{key}"] = value

    def rewrite(node):
        if isinstance(node, dict):
            return {k: (local.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items() if node is not schema or k not in ("$defs", "definitions", "$id")}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    out = rewrite(schema)
    for key in [k for k in definitions if k.startswith(prefix)]:
        definitions[key] = rewrite(definitions[key])
    return out


def _guided(schema: dict, where: str, reasoning: str | None) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(json=schema, reasoning=reasoning)
    except ValueError as error:
        raise bad_request(f"{where}: the parameters cannot be enforced: {error}", "tools") from None


def _shown(choice) -> str:
    return json.dumps(choice.model_dump()) if isinstance(choice, NamedToolChoice) else repr(choice)
