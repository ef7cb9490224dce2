"""The completions and chat-completions endpoints: sequences in, OpenAI responses and chunks out."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response

from ninefold.llm.guided import GuidedDecodingParams
from ninefold.llm.reasoning import effective_parser, get_reasoning_parser
from ninefold.llm.sampling import prompt_tokens_kept
from ninefold.llm.server import preprocess, tool_choice
from ninefold.llm.server.beam_generation import beam_generation
from ninefold.llm.server.chat_output import ChatDeltas, ChatOutput
from ninefold.llm.server.deltas import DeltaStream
from ninefold.llm.server.errors import APIError
from ninefold.llm.server.event_stream import EventStreamResponse
from ninefold.llm.server.generation import Generation, Sequence, until_disconnect
from ninefold.llm.server.logprobs import (
    TokenIdTexts,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    prompt_logprobs,
)
from ninefold.llm.server.protocol import ChatCompletionRequest, CompletionRequest
from ninefold.llm.server.sse import DONE, sse_data, sse_error
from ninefold.llm.server.state import ServerState

logger = logging.getLogger("ninefold.server")

Receive = Callable[[], Awaitable[dict]]


async def create_completion(state: ServerState, req: CompletionRequest, receive: Receive) -> Response:
    """``POST /v1/completions``."""
    lora = state.check_model(req.model)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "'max_tokens': 0 is accepted only with 'echo': true (the prompt is scored, nothing "
                            "generated)", param="max_tokens")
    guided = preprocess.guided_decoding(req)  # a bad format is refused before the prompts are tokenized
    prompts = preprocess.completion_prompts(req, state.tokenizer)
    return await _serve(state, req, prompts, "cmpl", req.max_tokens, "max_tokens", req.logprobs, receive, guided,
                        lora=lora)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, receive: Receive) -> Response:
    """``POST /v1/chat/completions``."""
    lora = state.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    prompts = [preprocess.chat_prompt(req, state.tokenizer)]
    reasoning = state.reasoning_parser
    if reasoning is not None:  # (the prompt's end is decoded only for a server that splits reasoning)
        reasoning = effective_parser(reasoning, state.tokenizer.decode(prompts[0].token_ids[-8:], False))
    # with a reasoning parser, a format holds after the thinking
    guided = preprocess.guided_decoding(req, reasoning=reasoning)
    tools = tool_choice.plan(req, state.tool_parser, other_format=guided is not None, reasoning=reasoning)
    guided = tools.guided or guided
    if tools.mode == "auto" and req.skip_special_tokens:  # a model's call markers may be special tokens
        req = req.model_copy(update={"skip_special_tokens": False})
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return await _serve(state, req, prompts, "chatcmpl", requested, param, logprobs, receive, guided, tools, lora,
                        reasoning)


async def _serve(
    state: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[preprocess.Prompt],
    kind: str,
    requested_max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    receive: Receive,
    guided: GuidedDecodingParams | None = None,
    tools: tool_choice.ToolPlan | None = None,
    lora=None,
    reasoning: str | None = None,
) -> Response:
    arrival = time.perf_counter()
    limits = state.limits
    prompt_param = "prompt" if kind == "cmpl" else "messages"
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    if req.priority and state.engine.engine.config.scheduling_policy != "priority":
        raise APIError(400, f"'priority' is {req.priority}, but this server schedules first come first served "
                            "(start it with --scheduling-policy priority)", param="priority")
    if lora is not None:  # its files are read (once) off the event loop
        try:
            await anyio.to_thread.run_sync(state.engine.engine.prepare_lora, lora)
        except ValueError as e:
            raise APIError(400, str(e), param="model") from None
    keep = prompt_tokens_kept(req.truncate_prompt_tokens, state.limits.max_model_len)
    prompts = [preprocess.truncated(p, keep, state.tokenizer) for p in prompts]
    for prompt in prompts:
        preprocess.check_prompt(prompt, limits, prompt_param)
    preprocess.check_admissible(len(prompts) * req.n, limits)
    request_id = f"{kind}-{uuid.uuid4().hex}"
    echo = kind == "cmpl" and req.echo
    # echo with logprobs reports the prompt's logprobs too: every choice has its own (each is an engine request)
    scored = [v for v in (req.prompt_logprobs, logprobs if echo else None) if v is not None]
    if req.use_beam_search:
        gen = beam_generation(state.engine, req, prompts, request_id, lambda prompt: preprocess.resolve_max_tokens(
            requested_max_tokens, len(prompt.token_ids), limits, max_tokens_param), logprobs, lora)
        sequences = gen.sequences
    else:
        sequences = []
        for p, prompt in enumerate(prompts):
            max_tokens = preprocess.resolve_max_tokens(requested_max_tokens, len(prompt.token_ids), limits,
                                                       max_tokens_param)
            for i in range(req.n):
                # max_tokens 0 (echo only): one token is generated and left out of the response
                params = preprocess.sampling_params(req, max_tokens=max(max_tokens, 1), logprobs=logprobs,
                                                    limits=limits, child=i, defaults=state.defaults,
                                                    prompt_logprobs=max(scored) if scored else None, guided=guided)
                sequences.append(Sequence(p * req.n + i, f"{request_id}-{p * req.n + i}", prompt, params,
                                          priority=req.priority, lora_request=lora))
        gen = Generation(state.engine, sequences)
    view = _View(state, req, kind, request_id, prompts, logprobs, score_only=requested_max_tokens == 0, tools=tools,
                 model=lora.lora_name if lora is not None else state.served_model_name, reasoning=reasoning)
    state.admission.acquire(len(sequences))
    state.active.add(gen)
    for prompt in prompts:
        state.metrics.count_prompt(len(prompt.token_ids))
    for seq in sequences:
        seq.timer = state.metrics.sequence(arrival)

    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.admission.release(len(sequences))
            state.active.discard(gen)

    if req.stream:
        return EventStreamResponse(_stream(view, gen), on_close=release)
    try:
        finished, body = await until_disconnect(receive, view.collect(gen))
    finally:
        release()
    if not finished:
        return Response(status_code=499)  # nobody is listening; the sequences were aborted
    return JSONResponse(body)


async def _stream(view: _View, gen: Generation) -> AsyncIterator[str]:
    try:
        for chunk in view.opening_chunks(gen):
            yield sse_data(chunk)
        async for seq in gen.events():
            chunk = view.chunk(seq)
            if chunk is not None:
                yield sse_data(view.with_usage(chunk, seq))
        if view.include_usage:
            yield sse_data(view.usage_chunk(gen))
    except APIError as err:
        yield sse_error(err.body())
    except Exception as exc:
        logger.exception("streaming failed")
        yield sse_error(APIError(500, f"internal server error ({type(exc).__name__})").body())
    yield DONE


class _View:
    """How one request's sequences look in the OpenAI format (completions or chat)."""

    def __init__(self, state: ServerState, req: Any, kind: str, request_id: str,
                 prompts: list[preprocess.Prompt], logprobs: int | None, score_only: bool = False,
                 tools: tool_choice.ToolPlan | None = None, model: str = "", reasoning: str | None = None) -> None:
        self.state = state
        self.model = model  # the name the response reports: the served model's or the adapter's
        self.chat = kind == "chatcmpl"
        self.request_id = request_id
        self.created = int(time.time())
        self.prompts = prompts
        self.logprobs = logprobs
        self.n = req.n
        self.echo = not self.chat and req.echo
        self.score_only = score_only  # max_tokens 0 with echo: the generated token is left out
        self.prompt_top = req.prompt_logprobs  # vLLM's field: the top N per prompt token (None: not asked)
        self.opened: set[int] = set()  # choices whose first chunk (echoed prompt, prompt logprobs) was sent
        self.texts = TokenIdTexts(state.texts) if req.return_tokens_as_token_ids else state.texts
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.continuous_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self.deltas: dict[int, DeltaStream] = {}
        self.sent_tokens: dict[int, int] = {}
        self.token_offsets: dict[int, int] = {}  # completions: text_offset of each choice's next token
        self.stops = req.stop or []
        reasoning = get_reasoning_parser(reasoning) if self.chat and reasoning else None
        self.output = ChatOutput(tools, reasoning, self.chat and req.include_reasoning) if self.chat else None
        self.readers: dict[int, ChatDeltas] = {}  # chat choices read for reasoning or tool calls

    def _envelope(self, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self, gen: Generation) -> dict[str, int]:
        """Token counts: each prompt once, every generated token of every choice."""
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(self._generated(s) for s in gen.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _reason(self, seq: Sequence) -> str | None:
        """The choice's finish reason: a scored prompt (max_tokens 0) ends by "length", whatever ended the
        token generated and left out."""
        if self.score_only and seq.finish_reason != "abort":
            return "length"
        return seq.finish_reason

    def _generated(self, seq: Sequence) -> int:
        """The choice's generated tokens that the response shows."""
        return 0 if self.score_only or seq.output is None else len(seq.output.token_ids)

    def _logprobs(self, seq: Sequence, start: int, end: int, text_offset: int) -> dict | None:
        out = seq.output
        if self.logprobs is None or out is None or out.logprobs is None or self.score_only:
            return None
        ids, steps = out.token_ids[start:end], out.logprobs[start:end]
        if self.chat:
            return chat_logprobs(ids, steps, self.logprobs, self.texts)
        return completion_logprobs(ids, steps, self.logprobs, self.texts, text_offset)

    def _prompt_text(self, seq: Sequence) -> str:
        prompt = self.prompts[seq.index // self.n]
        if prompt.text is not None:
            return prompt.text
        if self.state.tokenizer is None:  # (token ids in, token ids out: no text to echo)
            return ""
        return self.state.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _echo(self, seq: Sequence) -> tuple[str, dict | None, int]:
        """The echoed prompt of a completions choice: its text, its logprobs object (with ``logprobs``) and the
        text offset where the completion's tokens start."""
        prompt = self.prompts[seq.index // self.n]
        if self.logprobs is None or seq.prompt_logprobs is None:
            return self._prompt_text(seq), None, 0
        logprobs = echoed_prompt_logprobs(prompt.token_ids, seq.prompt_logprobs, self.logprobs, self.texts)
        return self._prompt_text(seq), logprobs, logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    def _opening(self, seq: Sequence, choice: dict[str, Any]) -> None:
        """What a choice says once: vLLM's ``prompt_logprobs`` when asked for."""
        if self.prompt_top is not None:
            prompt = self.prompts[seq.index // self.n]
            choice["prompt_logprobs"] = (prompt_logprobs(seq.prompt_logprobs, prompt.token_ids, self.prompt_top,
                                                         self.texts)
                                         if seq.prompt_logprobs is not None else None)

    async def collect(self, gen: Generation) -> dict[str, Any]:
        """Run to the end and build the whole (non-streaming) response."""
        async for _ in gen.events():
            pass
        choices = []
        for seq in sorted(gen.sequences, key=lambda s: s.index):
            text = seq.output.text if seq.output is not None and not self.score_only else ""
            count = self._generated(seq)
            offset, echoed = 0, None
            if self.echo:
                prompt_text, echoed, offset = self._echo(seq)
                text = prompt_text + text
            logprobs = self._logprobs(seq, 0, count, offset)
            if echoed is not None:
                logprobs = joined(echoed, logprobs)
            choice: dict[str, Any] = {"index": seq.index, "logprobs": logprobs, "finish_reason": self._reason(seq)}
            if self.chat and not self.output.plain:
                choice["message"], choice["finish_reason"] = self.output.message(text, choice["finish_reason"])
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self._opening(seq, choice)
            choices.append(choice)
        body = self._envelope(choices)
        body["object"] = "chat.completion" if self.chat else "text_completion"
        body["usage"] = self.usage(gen)
        return body

    def opening_chunks(self, gen: Generation) -> list[dict]:
        """Chat streams announce the assistant role of every choice first."""
        if not self.chat:
            return []
        return [
            self._envelope([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
            for s in sorted(gen.sequences, key=lambda s: s.index)
        ]

    def chunk(self, seq: Sequence) -> dict[str, Any] | None:
        """The chunk for what ``seq`` added since the last one (None when there is nothing to send)."""
        out = seq.output
        finished = seq.done
        opening = seq.index not in self.opened
        deltas = self.deltas.setdefault(seq.index, DeltaStream(self.stops))
        echoed = None
        if opening and self.echo:  # the first chunk of a choice starts with its prompt
            prefix, echoed, self.token_offsets[seq.index] = self._echo(seq)
        else:
            prefix = ""
        # Offsets count the tokens' own texts, as in the whole response; the text sent so far can lag
        # behind them (an incomplete character or a possible stop string is held back).
        offset = self.token_offsets.get(seq.index, 0)
        shown = out.text if out is not None and not self.score_only else ""
        text = prefix + deltas.delta(shown, finished)
        reason = self._reason(seq) if finished else None
        fields = None  # chat read for reasoning or tool calls: the delta's fields
        if self.chat and not self.output.plain:
            reader = self.readers.setdefault(seq.index, self.output.deltas())
            fields = reader.update(text, finished, truncated=reason == "length")
        start = self.sent_tokens.get(seq.index, 0)
        end = self._generated(seq) if out is not None else start
        news = text if fields is None else fields
        if not news and not finished and not opening and (self.logprobs is None or end == start):
            return None
        self.opened.add(seq.index)
        self.sent_tokens[seq.index] = end
        logprobs = self._logprobs(seq, start, end, offset)
        if logprobs is not None and not self.chat and logprobs["tokens"]:
            self.token_offsets[seq.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        if echoed is not None:
            logprobs = joined(echoed, logprobs)
        if self.chat:
            if fields is None:
                delta = {"content": text} if text or not finished else {}
            else:
                delta = fields
                if finished and self.output.tools is not None:
                    reason = self.output.tools.reason(reason, reader.called)
            choice = {"index": seq.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": seq.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if opening:
            self._opening(seq, choice)
        return self._envelope([choice])

    def with_usage(self, chunk: dict[str, Any], seq: Sequence) -> dict[str, Any]:
        """``chunk`` of choice ``seq`` with that choice's token counts so far (its prompt and what it generated,
        as vLLM counts them) when ``continuous_usage_stats`` asks for them."""
        if self.continuous_usage:
            prompt, completion = len(seq.prompt.token_ids), self._generated(seq)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        return chunk

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the token counts."""
        body = self._envelope([])
        body["usage"] = self.usage(gen)
        return body
