"""Beam search over the engine, as vLLM's ``LLM.beam_search`` does it.

Each round asks the engine for one token of every live beam (a one-token request whose prompt is the beam so
far, so the prefix cache serves what earlier rounds computed) with its ``2 * beam_width`` most likely next
tokens and their log-probabilities. Every beam's candidates extend it; a candidate ending in an EOS token
finishes (unless ``ignore_eos``), the others compete for the ``beam_width`` places of the next round. After
``max_tokens`` rounds (or when no beam is left) the finished and the live beams are ranked together by
``cum_logprob / length ** length_penalty``, where the length counts the prompt's tokens and the generated ones
except a final EOS token (vLLM's score), and the best ``beam_width`` are returned. One difference from vLLM: the
EOS tokens are all that the model's files name (as ``generate`` stops at), not only the tokenizer's.

This module holds the search itself and its rounds on an ``AsyncEngine`` (``search_async``); ``LLM.beam_search``
runs the rounds on its engine, ``AsyncEngine.beam_search`` and the server through ``search_async``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ninefold.llm.sampling import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """What a beam search keeps and when it stops (the fields of vLLM's ``BeamSearchParams``).

    ``beam_width`` beams are kept per round and returned; ``max_tokens`` rounds at most; ``ignore_eos``: EOS
    tokens extend a beam like any other token; ``length_penalty``: the exponent of the length that divides a
    beam's summed log-probability when beams are ranked (0: rank by the sum alone; larger values favour longer
    beams); ``include_stop_str_in_output``: a finished beam's text keeps its EOS token's text. ``temperature``
    is accepted for vLLM's signature but must be 0: the beams are ranked by the model's own log-probabilities.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: got {value!r}; expected an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: got {getattr(self, name)!r}; expected True or False")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or self.temperature != 0:
            raise ValueError(f"temperature: got {self.temperature!r}; beam search ranks beams by the model's "
                             "log-probabilities, so only 0 is accepted")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty: got {lp!r}; expected a finite number")

    @property
    def candidates_per_beam(self) -> int:
        """How many of a beam's most likely next tokens each round considers (twice the width, as vLLM)."""
        return 2 * self.beam_width


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's followed by the generated ones (as in vLLM).

    ``logprobs``: per generated token, the log-probabilities of the candidates its round considered (the
    token's own among them); ``cum_logprob``: the sum of the generated tokens' log-probabilities;
    ``finish_reason``: "stop" (an EOS token, named by ``stop_reason``) or "length"; ``text``: the decoded
    ``tokens`` (prompt included, as vLLM's ``LLM.beam_search`` returns it), set once the search is done.
    """

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(sequence: BeamSearchSequence, eos_token_ids: Iterable[int], length_penalty: float) -> float:
    """vLLM's ranking score: ``cum_logprob / length ** length_penalty``, the length counting the prompt and every
    generated token but a final EOS token (-inf or 0.0 where a penalty's power leaves the float range; the search
    ranks by ``rank_key``, which orders beams alike without overflowing)."""
    length = _scored_length(sequence, eos_token_ids)
    try:
        return sequence.cum_logprob / (length ** length_penalty)
    except (OverflowError, ZeroDivisionError):
        return -math.inf if length_penalty < 0 and sequence.cum_logprob < 0 else 0.0


def rank_key(sequence: BeamSearchSequence, eos_token_ids: Iterable[int], length_penalty: float) -> float:
    """A key that orders beams as ``beam_score`` does (higher first) for every finite penalty: the logarithm
    of the score's magnitude, negated (log-probabilities are never positive, so neither is a score)."""
    if sequence.cum_logprob >= 0:
        return math.inf
    return length_penalty * math.log(_scored_length(sequence, eos_token_ids)) - math.log(-sequence.cum_logprob)


def _scored_length(sequence: BeamSearchSequence, eos_token_ids: Iterable[int]) -> int:
    length = len(sequence.tokens)
    if sequence.tokens and sequence.tokens[-1] in eos_token_ids:  # (vLLM's rule, with ignore_eos too)
        length -= 1
    return max(length, 1)


class BeamSearch:
    """The search of one prompt: the live beams, the finished ones, and how a round's candidates extend them."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Iterable[int],
                 max_model_len: int):
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_len = min(self.prompt_len + params.max_tokens, max_model_len)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))] if self.prompt_len < self.max_len else []
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.beams

    def extend(self, candidates: list[dict[int, float]], reported: list[dict[int, float]] | None = None) -> None:
        """One round: ``candidates[i]`` maps the live beam ``i``'s next tokens to their log-probabilities;
        ``reported[i]`` (default ``candidates[i]``) is what the new beams record as that token's logprobs."""
        if len(candidates) != len(self.beams):
            raise ValueError(f"candidates: {len(candidates)} given for {len(self.beams)} live beams")
        params = self.params
        extended = []
        for beam, options, shown in zip(self.beams, candidates, reported or candidates):
            for token, logprob in options.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [shown],
                                           beam.cum_logprob + logprob)
                if token in self.eos_token_ids and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", token
                    self.finished.append(child)
                else:
                    extended.append(child)
        extended.sort(key=self._score, reverse=True)  # stable: ties keep beam order, then candidate order
        self.beams = extended[:params.beam_width]
        if self.beams and len(self.beams[0].tokens) >= self.max_len:
            for beam in self.beams:
                beam.finish_reason = "length"
            self.finished += self.beams
            self.beams = []

    def take_round(self, logprobs: list[dict[int, float]]) -> None:
        """One round as the engine answered it: each live beam's next-token logprobs (at least its
        ``candidates_per_beam`` most likely tokens); those best ones extend it, and the new beams record the
        whole dict."""
        self.extend([top_candidates(step, self.params.candidates_per_beam) for step in logprobs], logprobs)

    def shown_tokens(self, beam: BeamSearchSequence) -> list[int]:
        """The tokens a beam's text shows: all but an EOS token that ended it, unless
        ``include_stop_str_in_output``."""
        if beam.stop_reason is not None and not self.params.include_stop_str_in_output:
            return beam.tokens[:-1]
        return beam.tokens

    def result(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """The best ``beam_width`` of the finished and live beams, best first, with their text when ``decode``
        (token ids -> str) is given."""
        for beam in self.beams:  # stopped early (an aborted search): what is live counts as cut at its length
            beam.finish_reason = "length"
        best = sorted(self.finished + self.beams, key=self._score, reverse=True)[:self.params.beam_width]
        if decode is not None:
            for beam in best:
                beam.text = decode(self.shown_tokens(beam))
        return BeamSearchOutput(best)

    def _score(self, sequence: BeamSearchSequence) -> float:
        return rank_key(sequence, self.eos_token_ids, self.params.length_penalty)


def whole_request_params(params: BeamSearchParams) -> SamplingParams:
    """What a search asks of the engine as a whole, for checking its prompt up front (room for ``max_tokens`` in
    the context and the KV cache); TypeError when ``params`` is not ``BeamSearchParams``."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params: expected BeamSearchParams, got {type(params).__name__}")
    return SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)


def round_sampling_params(params: BeamSearchParams, vocab_size: int, reported: int = 0) -> SamplingParams:
    """What one round asks of the engine for each live beam: one token and its candidates' log-probabilities
    (``reported``: at least that many, where a caller shows more than the search considers)."""
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                          logprobs=min(max(params.candidates_per_beam, reported), vocab_size))


def top_candidates(logprobs: dict[int, float], count: int) -> dict[int, float]:
    """The ``count`` most likely entries of one token's logprobs dict (it may also hold the sampled token)."""
    ranked = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)
    return dict(ranked[:count])


async def search_async(engine: Any, prompt_token_ids: list[int], params: BeamSearchParams, request_id: str, *,
                       priority: int = 0, lora_request: Any = None, reported: int = 0) -> BeamSearch:
    """Run one prompt's search on an ``AsyncEngine``, each round's one-token requests concurrently (ids
    ``{request_id}-beam{round}-{k}``); returns the finished search (``BeamSearch.result`` ranks it). ``reported``:
    how many logprobs per token the beams record (at least their candidates). Cancelling it aborts the round's
    requests; an engine error is raised as the engine raised it."""
    search = BeamSearch(prompt_token_ids, params, engine.engine.eos_token_ids, engine.max_model_len)
    round_params = round_sampling_params(params, engine.vocab_size, reported)
    rounds = 0
    while not search.done:
        outs = await asyncio.gather(*(_one_token(engine, beam.tokens, round_params, f"{request_id}-beam{rounds}-{k}",
                                                 priority, lora_request)
                                      for k, beam in enumerate(search.beams)))
        search.take_round([out.logprobs[0] for out in outs])
        rounds += 1
    return search


async def _one_token(engine: Any, tokens: list[int], params: SamplingParams, request_id: str, priority: int,
                     lora_request: Any):
    last = None
    async for out in engine.generate(tokens, params, request_id, priority, lora_request):
        last = out
    if last is None or not last.outputs or last.outputs[0].finish_reason in (None, "abort"):
        raise RuntimeError(f"beam search: round request {request_id!r} ended without its token (aborted)")
    return last.outputs[0]
