"""Guided decoding: constrain sampling so the output follows a format (``SamplingParams.guided_decoding``).

- ``json_object=True`` (OpenAI's ``response_format={"type": "json_object"}``): the output is one JSON
  object; the sequence ends (finish reason ``"stop"``) the moment the object is complete.
- ``choice=[...]`` (vLLM's ``guided_choice``): the output is one of the strings; it ends when it is
  one that no other choice continues (one that another continues may also end by an end-of-sequence
  token).
- ``json=schema`` (a dict or its JSON text; OpenAI's ``response_format`` ``json_schema``, vLLM's
  ``guided_json``): JSON that follows the schema, within the subset ``schema_machine`` supports
  (others are refused with a ValueError naming the keyword).
- ``regex=pattern`` (vLLM's ``guided_regex``): text that matches the regular expression as a whole
  (``regex_machine``: Python syntax without backreferences, lookaround or flags).

With ``reasoning`` (a ``--reasoning-parser`` name) the format applies after the model's thinking
(``reasoning_machine.AfterReasoning``): free text up to ``</think>``, for Qwen3 only when the output opens
with ``<think>``.

Either way an output cut by ``max_tokens`` is a prefix of what was asked for. Each step masks the
logits of the tokens whose bytes cannot continue the output (``masks.TokenMasks``), after penalties
and ``logit_bias``.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

import torch

from ninefold.llm.guided.choice_machine import ChoiceMachine
from ninefold.llm.guided.json_machine import JSON_OBJECT
from ninefold.llm.guided.masks import TokenMasks
from ninefold.llm.guided.reasoning_machine import AfterReasoning
from ninefold.llm.guided.regex_machine import RegexMachine
from ninefold.llm.guided.schema_machine import SchemaMachine
from ninefold.llm.reasoning import END, START
from ninefold.llm.reasoning import PARSERS as REASONING_PARSERS
from ninefold.llm.unicode import UNPAIRED_SURROGATE, first_invalid_string

__all__ = ["ChoiceMachine", "Guide", "GuidedDecodingParams", "SchemaMachine", "StructuredOutputsParams", "TokenMasks"]

MAX_CHOICES = 1024
MAX_CHOICE_BYTES = 1 << 16  # all choices together, UTF-8


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What the output must follow (vLLM's names); exactly one of ``json_object=True`` and ``choice``."""

    json_object: bool = False
    choice: tuple[str, ...] | list[str] | None = None
    json: dict | str | None = None
    regex: str | None = None
    # the format applies after the thinking this --reasoning-parser reads (deepseek_r1, qwen3); None: from the start
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema, parse_constant=_refuse_constant)
                except (ValueError, RecursionError) as error:
                    raise ValueError(f"guided_decoding.json: not JSON ({str(error)[:200]})") from None
            object.__setattr__(self, "_schema", SchemaMachine(schema))  # a schema it cannot follow fails here
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object: got {self.json_object!r}; expected True or False")
        if self.choice is not None:
            choices = self.choice
            if (not isinstance(choices, (list, tuple)) or not choices or len(choices) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"guided_decoding.choice: got {str(choices)[:200]}; expected 1 to {MAX_CHOICES} "
                                 "non-empty strings")
            bad = first_invalid_string(choices)
            if bad is not None:
                raise ValueError(f"guided_decoding.choice: {bad[:40]!a} {UNPAIRED_SURROGATE}")
            size = sum(len(c.encode("utf-8")) for c in choices)
            if size > MAX_CHOICE_BYTES:
                raise ValueError(f"guided_decoding.choice: {size} bytes of choices; at most {MAX_CHOICE_BYTES}")
            object.__setattr__(self, "choice", tuple(dict.fromkeys(choices)))
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(f"guided_decoding.reasoning: got {self.reasoning!r}; expected None or one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        if self.regex is not None:
            object.__setattr__(self, "_regex", RegexMachine(self.regex))  # a pattern it cannot follow fails here
        if self.json_object + (self.choice is not None) + (self.json is not None) + (self.regex is not None) != 1:
            raise ValueError("guided_decoding: set exactly one of json_object=True, choice=[...], json=schema and "
                             "regex=pattern")

    def machine(self):
        """The recognizer of this format (after the thinking, with ``reasoning``)."""
        if self.json is not None:
            inner = self._schema
        elif self.regex is not None:
            inner = self._regex
        else:
            inner = JSON_OBJECT if self.json_object else ChoiceMachine(self.choice)
        if self.reasoning is None:
            return inner
        parser = REASONING_PARSERS[self.reasoning]
        return AfterReasoning(inner, END, None if parser.untagged_is_reasoning else START)


StructuredOutputsParams = GuidedDecodingParams  # vLLM's newer name (SamplingParams.structured_outputs)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class Guide:
    """One sequence's progress through its format: the recognizer's state after the output so far."""

    def __init__(self, machine, masks: TokenMasks, end_ids: tuple[int, ...]):
        self.machine = machine
        self.masks = masks
        self.end_ids = end_ids  # end-of-sequence tokens, allowed where the output may end
        self.state = machine.start

    @property
    def complete(self) -> bool:
        """Whether the output is finished: nothing more may follow."""
        return self.machine.complete(self.state)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; returns whether the output is now complete."""
        if token_id in self.end_ids:  # allowed where the output may end, or where nothing else can follow
            return True
        data = self.masks.vocab[token_id] if token_id < len(self.masks.vocab) else None
        state = self.machine.advance(self.state, data) if data else None
        if state is None:  # the mask allowed only tokens that continue the output
            raise RuntimeError(f"guided decoding: token {token_id} ({data!r}) cannot follow the output so far")
        self.state = state
        return self.complete

    def mask(self, device: torch.device) -> torch.Tensor:
        """Boolean ``[vocab]``: the tokens that may come next."""
        return self.masks.mask(self.machine, self.state, device, self.end_ids)
