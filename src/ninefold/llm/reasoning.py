"""Reasoning (``<think> ... </think>``) split from the answer of reasoning models, for ``--reasoning-parser``.

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the output is reasoning up to ``</think>`` and the
  answer after it; a leading ``<think>`` is dropped (their chat templates often put it in the prompt, so
  the output starts inside the reasoning). An output without ``</think>`` is all reasoning (cut short).
- ``qwen3`` (Qwen3): an output that starts with ``<think>`` is reasoning up to ``</think>``; any other
  output is all answer (thinking turned off with ``chat_template_kwargs: {"enable_thinking": false}``).
  Where the chat template itself opens ``<think>`` at the end of the prompt (Qwen3 Thinking-2507), the
  output starts inside the reasoning and reads as ``deepseek_r1``'s (``effective_parser``).

``split(text, final=False)`` reads a prefix of an output while it streams and returns only what later text
cannot change: a partial tag at the end is held back, and each part only grows.
"""

from __future__ import annotations

from ninefold.llm.markers import partial_marker_length

START, END = "<think>", "</think>"


class ReasoningParser:
    """Splits an output into (reasoning, answer); ``name`` is the registry name."""

    name: str
    # whether an output that does not start with <think> is reasoning (True) or answer (False)
    untagged_is_reasoning: bool

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, answer)`` of a whole output (``final``) or of a prefix of one."""
        stripped = text.lstrip()
        if not final and START.startswith(stripped) and stripped != START:
            return "", ""  # it may still become <think>
        if stripped.startswith(START):
            body = stripped[len(START):]
        elif self.untagged_is_reasoning:
            body = text
        else:
            return "", text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):].lstrip("\n") if final or body[end + len(END):].strip() else ""
        return body if final else body[:len(body) - partial_marker_length(body, (END,))], ""


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    untagged_is_reasoning = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    untagged_is_reasoning = False


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def effective_parser(name: str | None, prompt_tail: str) -> str | None:
    """The parser that reads an output of a prompt ending in ``prompt_tail``: a prompt whose template opened
    ``<think>`` is answered from inside the reasoning, which ``qwen3`` reads as ``deepseek_r1`` does."""
    if name == Qwen3Parser.name and prompt_tail.rstrip().endswith(START):
        return DeepSeekR1Parser.name
    return name


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A parser of the registered format ``name``; ValueError when there is none."""
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser: got {name!r}; expected one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
