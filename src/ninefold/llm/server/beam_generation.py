"""Requests with ``use_beam_search`` (vLLM's extra): the ``n`` best beams of each prompt become its choices.

``BeamGeneration`` has ``Generation``'s interface (``sequences``, ``events``, ``fail``, ``abort``), so the
endpoints build their responses and streams from it unchanged: every choice arrives once, finished, after the
last round (as in vLLM, a beam is not final until the search ends).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ninefold.llm.beam_search import BeamSearchParams, round_sampling_params, search_async
from ninefold.llm.outputs import CompletionOutput
from ninefold.llm.server.errors import APIError, bad_request
from ninefold.llm.server.generation import Sequence
from ninefold.llm.server.preprocess import Prompt

# Fields that steer sampling or constrain the output, with the values that leave them off: beam search
# ranks by the model's log-probabilities alone, so a request setting one of them is refused, not ignored.
_NEUTRAL = {
    "temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "stop": (None, []), "stop_token_ids": (None, []), "min_tokens": (0,), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,), "echo": (False,),
    "tools": (None, []), "response_format": (None, {"type": "text"}), "guided_choice": (None,),
    "guided_json": (None,), "guided_regex": (None,), "structured_outputs": (None,),
}


def beam_search_params(req: Any, max_tokens: int) -> BeamSearchParams:
    """The request's ``BeamSearchParams`` (``n`` beams, vLLM's mapping); a 400 naming any field it cannot honour."""
    for name, neutral in _NEUTRAL.items():
        if name in type(req).model_fields and not _unset(getattr(req, name), neutral):
            raise bad_request(f"'{name}' cannot be combined with 'use_beam_search' (beam search ranks beams by the "
                              f"model's log-probabilities alone); got {getattr(req, name)!r}", name)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as error:
        raise bad_request(str(error), "length_penalty") from None


def beam_generation(engine: Any, req: Any, prompts: list[Prompt], request_id: str,
                    max_tokens_for: Callable[[Prompt], int], logprobs: int | None, lora=None) -> BeamGeneration:
    """The ``BeamGeneration`` of a request with ``use_beam_search``: ``n`` choices per prompt; ``max_tokens_for``
    gives a prompt's token budget (the endpoint's rule); 400 for a field beam search cannot honour."""
    params = [beam_search_params(req, max_tokens_for(prompt)) for prompt in prompts]
    round_params = round_sampling_params(params[0], engine.vocab_size, logprobs or 0) if params else None
    sequences = [Sequence(p * req.n + i, f"{request_id}-{p * req.n + i}", prompt, round_params,
                          priority=req.priority, lora_request=lora)
                 for p, prompt in enumerate(prompts) for i in range(req.n)]
    return BeamGeneration(engine, sequences, params, logprobs, req.skip_special_tokens)


def _unset(value: Any, neutral: tuple) -> bool:
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


@dataclass(eq=False)
class BeamGeneration:
    """The beam searches of one request (one per prompt), run on the async engine round by round.

    ``sequences``: the choices, ``n`` per prompt in prompt order; ``logprobs``: the top logprobs per token a
    choice reports (None: none). Each round's one-token requests are ordinary engine requests, so leaving
    early (client gone, shutdown deadline) aborts them like any other.
    """

    engine: Any
    sequences: list[Sequence]
    params: list[BeamSearchParams]
    logprobs: int | None = None
    skip_special_tokens: bool = True
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def __post_init__(self) -> None:  # (built inside a request handler, so on the server's event loop)
        self._failure: asyncio.Future = asyncio.get_running_loop().create_future()

    def fail(self, error: APIError) -> None:
        """End the generation with ``error`` (used when a shutdown deadline passes)."""
        if not self._failure.done():
            self._failure.set_exception(error)

    async def events(self) -> AsyncIterator[Sequence]:
        """Yield every choice once, finished, after the searches end; raises the first error."""
        n = len(self.sequences) // max(len(self.params), 1)
        groups = [self.sequences[i * n:(i + 1) * n] for i in range(len(self.params))]
        self._tasks = [asyncio.create_task(self._search(group, params)) for group, params in zip(groups, self.params)]
        try:
            pending = set(self._tasks) | {self._failure}
            while pending - {self._failure}:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # an error (or the shutdown deadline) ends the whole request
            for seq in self.sequences:
                seq.done = True
                if seq.timer is not None:
                    seq.timer.tokens_now(len(seq.output.token_ids) if seq.output is not None else 0)
                    seq.timer.finish(seq.finish_reason)
                yield seq
        finally:
            with anyio.CancelScope(shield=True):
                await self.abort()

    async def abort(self) -> None:
        """Stop every search; their rounds' requests are aborted in the engine as their streams close."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for seq in self.sequences:
            if not seq.done:
                seq.done = True
                if seq.timer is not None:
                    seq.timer.finish(seq.finish_reason)

    async def _search(self, group: list[Sequence], params: BeamSearchParams) -> None:
        first = group[0]
        try:
            search = await search_async(self.engine, first.prompt.token_ids, params, first.request_id,
                                        priority=first.priority, lora_request=first.lora_request,
                                        reported=self.logprobs or 0)
        except asyncio.CancelledError:
            raise
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"the engine rejected the request: {exc}") from None
        except Exception as exc:
            raise APIError(500, f"generation failed ({type(exc).__name__}: {exc})") from None
        tokenizer = self.engine.tokenizer
        for seq, beam in zip(group, search.result().sequences):
            generated = beam.tokens[search.prompt_len:]
            shown = search.shown_tokens(beam)[search.prompt_len:]
            text = tokenizer.decode(shown, skip_special_tokens=self.skip_special_tokens) if tokenizer else ""
            seq.output = CompletionOutput(seq.index % len(group), text, generated, beam.cum_logprob,
                                          beam.logprobs if self.logprobs is not None else None,
                                          beam.finish_reason, beam.stop_reason)
