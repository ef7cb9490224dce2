"""Tool calls in generated text, for the chat server's ``tool_choice`` ``"auto"`` and ``"required"``.

``get_parser(name)`` gives the parser of one format (``PARSERS``: ``hermes``, ``llama3_json``, ``mistral``,
``json_array``); its ``parse(text, final)`` reads the content and the calls of a whole output or, while it
streams, the part of a prefix that more text cannot change. ``ToolCallDeltas`` turns those parses into
OpenAI streaming deltas.
"""

from ninefold.llm.tools.parsers import PARSERS, Parsed, ParsedCall, ToolCallParser, get_parser
from ninefold.llm.tools.streaming import ToolCallDeltas

__all__ = ["PARSERS", "Parsed", "ParsedCall", "ToolCallDeltas", "ToolCallParser", "get_parser"]
