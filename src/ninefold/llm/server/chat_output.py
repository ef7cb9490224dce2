"""How a chat choice's generated text becomes the assistant message: reasoning, content and tool calls.

With ``--reasoning-parser``, the reasoning (``<think> ... </think>``) goes to ``reasoning`` (and its older
name ``reasoning_content``, which vLLM clients still read) and only the answer after it is content; with
tools read from the output (``tool_choice.ToolPlan``), the answer is parsed for tool calls. Streams send the
same pieces as deltas, each only once later text cannot change it.
"""

from __future__ import annotations

from ninefold.llm.reasoning import ReasoningParser
from ninefold.llm.server.tool_choice import ToolPlan

REASONING_FIELDS = ("reasoning", "reasoning_content")


class ChatOutput:
    """One request's reading of its outputs (shared by its choices)."""

    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningParser | None, include_reasoning: bool = True):
        self.tools = tools if tools is not None and tools.reads_calls else None
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning

    @property
    def plain(self) -> bool:
        """Whether the text is the content as it is."""
        return self.tools is None and self.reasoning is None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output and the finish reason to report."""
        thought, answer = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        if self.tools is not None:
            message, finish_reason = self.tools.message(answer, finish_reason)
        else:
            message = {"role": "assistant", "content": answer}
        if thought is not None and self.include_reasoning:
            message.update(dict.fromkeys(REASONING_FIELDS, thought or None))
        return message, finish_reason

    def deltas(self) -> ChatDeltas:
        """A streaming reader for one choice."""
        return ChatDeltas(self)


class ChatDeltas:
    """One streamed choice: the text so far in, the delta fields that are new out."""

    def __init__(self, output: ChatOutput):
        self.output = output
        self.text = ""
        self.thought_sent = 0
        self.answer_sent = 0
        self.calls = output.tools.deltas() if output.tools is not None else None

    @property
    def called(self) -> bool:
        """Whether the finished output made tool calls (as the whole message reads it: markup that turned out
        malformed at the end makes none, even if a call was already streamed)."""
        return self.calls is not None and bool(self.calls.final_calls)

    def update(self, new_text: str, final: bool, truncated: bool = False) -> dict:
        """The delta's fields for ``new_text`` appended to the choice's text (only non-empty ones); ``truncated``:
        the output ended by ``max_tokens`` (tool calls are read as far as they got, as ``ToolPlan.message``)."""
        self.text += new_text
        parser = self.output.reasoning
        thought, answer = parser.split(self.text, final) if parser else ("", self.text)
        delta: dict = {}
        if len(thought) > self.thought_sent:
            if self.output.include_reasoning:
                delta.update(dict.fromkeys(REASONING_FIELDS, thought[self.thought_sent:]))
            self.thought_sent = len(thought)
        if self.calls is not None:
            content, calls = self.calls.update(answer, final and not truncated)
            if calls:
                delta["tool_calls"] = calls
        else:
            content = answer[self.answer_sent:]
            self.answer_sent = len(answer)
        if content:
            delta["content"] = content
        return delta
