"""``SamplingParams``: how one request is decoded (mirrors vLLM's names and defaults)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ninefold.llm.guided import GuidedDecodingParams
from ninefold.llm.unicode import is_valid_unicode


def prompt_tokens_kept(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (None: all); -1 keeps as many as
    leave room for one generated token."""
    if truncate_prompt_tokens == -1:
        return max_model_len - 1
    return truncate_prompt_tokens


# Temperatures above 0 and below this are raised to it: logits divided by less overflow float32.
MIN_TEMPERATURE = 0.01


@dataclass
class SamplingParams:
    """Decoding settings of one request; invalid values raise ValueError naming the field.

    ``temperature=0`` is greedy; a temperature above 0 and below ``MIN_TEMPERATURE`` (0.01) is raised
    to it. ``top_k`` <= 0 and ``top_p=1`` and ``min_p=0`` switch those filters off. ``stop`` strings end the output and are not included in it; ``stop_token_ids``
    and the model's end-of-sequence tokens end it too (the token is kept in ``token_ids`` but not
    rendered in the text; ``include_stop_str_in_output`` renders stop strings and tokens).
    ``logprobs=N`` returns the N most likely tokens and the sampled one at every step;
    ``prompt_logprobs=N`` returns, for every prompt token after the first, its log-probability given
    the tokens before it and the N most likely tokens at that position (``RequestOutput.prompt_logprobs``).
    ``guided_decoding=GuidedDecodingParams(json_object=True)`` constrains the output to one JSON object
    (``ninefold.llm.guided``); ``structured_outputs=StructuredOutputsParams(...)`` is the same under vLLM's
    newer names. vLLM's ``allowed_token_ids`` restricts every sampled token to a list; ``bad_words`` are
    never generated (their last token is banned wherever the output ends with the tokens before it, each
    word tokenized without its leading whitespace, alone and after a space); ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens
(-1: as many as leave room for one generated token).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    # vLLM's newer name for guided_decoding: taken into it at construction, then None (so replace() sees one)
    structured_outputs: GuidedDecodingParams | None = field(default=None, repr=False, compare=False)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, accepted: str) -> ValueError:
            return ValueError(f"{name}: got {getattr(self, name)!r}; expected {accepted}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_num(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not is_num(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow (as vLLM does)
            logging.getLogger(__name__).warning("temperature %g is below %g: raised to %g", self.temperature,
                                                MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer: -1 or 0 (off) or >= 1")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "a finite number > 0")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"at most max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "an integer >= 0 or None")
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise bad("stop", "a string, a list of strings or None")
        if any(s == "" for s in stops):
            raise bad("stop", "non-empty strings")
        if not all(is_valid_unicode(s) for s in stops):
            raise bad("stop", "valid Unicode strings (an unpaired UTF-16 surrogate can never appear in the output)")
        self.stop_strings = stops
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
                raise bad("stop_token_ids", "a list of non-negative integers or None")
            self.stop_token_ids = list(ids)

        if self.structured_outputs is not None:
            if self.guided_decoding is not None and self.guided_decoding != self.structured_outputs:
                raise bad("structured_outputs", "the same as guided_decoding when both are given (one is the "
                                                "other's name)")
            self.guided_decoding = self.structured_outputs
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise bad("guided_decoding", "a GuidedDecodingParams (StructuredOutputsParams) or None")
        self.structured_outputs = None
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or not all(
                is_int(k) and k >= 0 and is_num(v) and -1e4 <= v <= 1e4 for k, v in bias.items()
            ):
                raise bad("logit_bias", "a dict of token id (int >= 0) -> bias (number in [-1e4, 1e4]) or None")
            self.logit_bias = {int(k): float(v) for k, v in bias.items()}

        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise bad("allowed_token_ids", "a non-empty list of non-negative integers or None")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise bad("bad_words", "a list of strings that are not blank, or None")
            if not all(is_valid_unicode(w) for w in words):
                raise bad("bad_words", "valid Unicode strings (no unpaired UTF-16 surrogate)")
            self.bad_words = list(words)
        if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens)
                                                         or self.truncate_prompt_tokens < -1
                                                         or self.truncate_prompt_tokens == 0):
            raise bad("truncate_prompt_tokens", "an integer >= 1, -1 (as much as the context takes) or None")

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to apply (no penalties, bias, token restrictions, logprobs, min_tokens
        or guide)."""
        return (self.temperature == 0 and not self.has_penalties and not self.logit_bias
                and self.logprobs is None and self.min_tokens == 0 and self.guided_decoding is None
                and self.allowed_token_ids is None and not self.bad_words)

    @property
    def greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition/presence/frequency penalties is active."""
        return (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        )
