"""Speculative decoding by n-gram prompt lookup, as vLLM's ``{"method": "ngram"}``.

A decoding sequence whose last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``)
appeared earlier in its prompt or output proposes the tokens that followed that earlier occurrence
as drafts. The step then computes the sequence's next token and its ``k`` drafts in one forward
pass (``k + 1`` query rows over the cached context), samples every row with the sequence's own
parameters, and keeps the drafts up to the first one the model disagrees with, plus the model's own
token at that row. Text that repeats its context (code edits, quoting, extraction, summaries) then
takes several tokens per step for the price of one memory-bound pass over the weights.

The output distribution is the model's: a draft is one fixed token (a one-hot proposal), and for
such a proposal the rejection-sampling rule (accept ``d`` with probability ``p(d)``, else sample from
``p`` without ``d``) is the same as drawing ``t ~ p`` at that row and accepting ``d`` iff ``t == d``,
emitting ``t`` otherwise. Greedy decoding therefore gives exactly the tokens it gives without
speculation, and so does seeded sampling, whose draw for a token depends only on the seed and the
token's position (``ninefold.llm.sampler.generators``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` (only ``"ngram"``; vLLM's older ``"[ngram]"`` too), ``num_speculative_tokens`` drafts per
    step at most, and the n-gram lengths looked up, from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
    As in vLLM, a missing bound takes the other's value, and both missing are 5."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A config from ``None``, a ``SpeculativeConfig`` or a dict with vLLM's keys; ValueError naming
        ``speculative_config`` and the offending key otherwise."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: got {type(value).__name__}; expected a dict such as "
                             '{"method": "ngram", "num_speculative_tokens": 4} or None')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; accepted: {sorted(known)}")
        method = value.get("method", "ngram")
        method = "ngram" if method == "[ngram]" else method
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: got {method!r}; supported: {', '.join(METHODS)}")
        value = dict(value)
        if value.get("prompt_lookup_min") is None and value.get("prompt_lookup_max") is not None:
            value["prompt_lookup_min"] = value["prompt_lookup_max"]
        if value.get("prompt_lookup_max") is None and value.get("prompt_lookup_min") is not None:
            value["prompt_lookup_max"] = value["prompt_lookup_min"]
        fields = {}
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            got = value.get(name, cls.__dataclass_fields__[name].default)
            if isinstance(got, bool) or not isinstance(got, int) or got < 1:
                raise ValueError(f"speculative_config.{name}: got {got!r}; expected a positive integer")
            fields[name] = got
        if fields["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: got {fields['num_speculative_tokens']}; "
                             f"expected at most {MAX_SPECULATIVE_TOKENS}")
        if fields["prompt_lookup_min"] > fields["prompt_lookup_max"]:
            raise ValueError(f"speculative_config.prompt_lookup_min: got {fields['prompt_lookup_min']}, more than "
                             f"prompt_lookup_max {fields['prompt_lookup_max']}")
        return cls(method=method, **fields)


def ngram_drafts(token_ids: list[int], max_drafts: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to ``max_drafts`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``token_ids`` of ``lookup_max`` down to ``lookup_min`` tokens; ``[]`` when no suffix recurs."""
    length = len(token_ids)
    if max_drafts <= 0 or length < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length-n-1: every earlier occurrence, not the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            follow = int(hits[-1]) + n
            return tokens[follow : follow + max_drafts].tolist()
    return []


def accepted_count(drafts: list[int], sampled: list[int]) -> int:
    """How many leading ``drafts`` the model's tokens ``sampled`` (one per row, ``len(drafts) + 1``) confirm."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


class DraftRow:
    """A sequence as the sampler sees it at the row after its first ``k`` drafts: the drafts count as
    tokens already generated (penalties, ``min_tokens``), everything else is the sequence's own."""

    __slots__ = ("seq", "drafts")
    guide = None  # sequences under guided decoding do not speculate

    def __init__(self, seq, drafts: list[int]):
        self.seq = seq
        self.drafts = drafts

    def __getattr__(self, name):
        return getattr(self.seq, name)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)

    @property
    def allowed_mask(self):
        return self.seq.allowed_mask

    @allowed_mask.setter
    def allowed_mask(self, mask) -> None:  # the sampler's cache belongs to the sequence
        self.seq.allowed_mask = mask


class NgramProposer:
    """The scheduler's ``propose`` for n-gram speculation: drafts for one decoding sequence, no more
    than the step's remaining budget, the tokens its ``max_tokens`` still allows after the next one, or
    the positions left before ``max_model_len``. Sequences under guided decoding get none."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def __call__(self, seq, room: int) -> list[int]:
        if seq.guide is not None:
            return []
        most = min(self.config.num_speculative_tokens, room, self.max_model_len - len(seq.token_ids) - 1)
        if seq.params.max_tokens is not None:
            most = min(most, seq.params.max_tokens - seq.num_output_tokens - 1)
        return ngram_drafts(seq.token_ids, most, self.config.prompt_lookup_max, self.config.prompt_lookup_min)
