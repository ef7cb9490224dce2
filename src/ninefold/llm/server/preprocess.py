"""From a validated request body to engine inputs: prompt token ids and SamplingParams.

Everything here that fails is a client mistake and raises :class:`APIError` (400) naming the
parameter, so the engine only ever sees requests it can finish.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ninefold.llm.guided import GuidedDecodingParams
from ninefold.llm.sampling import SamplingParams
from ninefold.llm.server.errors import bad_request
from ninefold.llm.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from ninefold.llm.server.tool_choice import template_tools


@dataclass(frozen=True)
class Limits:
    """What the served model and engine can take."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int | None = None  # KV-cache blocks x block size, when the engine says
    max_sequences: int | None = None  # sequences the server admits at once (running + queued)


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine gets it."""

    token_ids: list[int]
    text: str | None = None


def needs_tokenizer(tokenizer, param: str):
    """``tokenizer``, or the client's 400 naming ``param`` when the model has none (dummy weights without a
    tokenizer.json take token ids only)."""
    if tokenizer is None:
        raise bad_request(f"'{param}': this model has no tokenizer (dummy weights without a tokenizer.json), so it "
                          "takes token ids only (a list of int)", param)
    return tokenizer


def completion_prompts(req: CompletionRequest, tokenizer) -> list[Prompt]:
    """The prompts of a completions request (a string, strings, token ids or lists of token ids)."""
    if req.suffix:
        raise bad_request("'suffix' is not supported", "suffix")
    prompts = []
    for item in prompt_items(req.prompt, "prompt", "prompts", 64):
        if isinstance(item, str):
            prompts.append(Prompt(needs_tokenizer(tokenizer, "prompt").encode(item), item))
        else:
            prompts.append(Prompt(list(item)))
    return prompts


def prompt_items(raw, param: str, noun: str, limit: int) -> list:
    """The prompts of a ``param`` field that holds a string, strings, token ids or lists of token ids, one list
    entry each; an empty field, or more than ``limit`` ``noun``, is the client's 400."""
    if isinstance(raw, str):
        items: list = [raw]
    elif len(raw) == 0:
        raise bad_request(f"'{param}' must not be empty", param)
    elif isinstance(raw[0], int):
        items = [raw]
    else:
        items = list(raw)
    if len(items) > limit:
        raise bad_request(f"at most {limit} {noun} per request are supported, got {len(items)}", param)
    return items


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> Prompt:
    """The chat messages rendered through the model's chat template (with the request's tools)."""
    return Prompt(render_chat(req.messages, tokenizer, req.add_generation_prompt, tools=template_tools(req),
                              template_kwargs=req.chat_template_kwargs,
                              continue_final_message=req.continue_final_message))


# Variables the server itself passes to the template; chat_template_kwargs may not replace them.
_RESERVED = frozenset(("messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message"))


def render_chat(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool, *,
                tools: list[dict] | None = None, template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> list[int]:
    """Token ids of ``messages`` under the chat template; template failures are the client's 400.

    ``tools`` go to the template as ``tools`` (transformers' convention); earlier tool calls' JSON arguments
    reach it as objects, as Hugging Face templates expect.
    """
    needs_tokenizer(tokenizer, "messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request("'continue_final_message' needs 'add_generation_prompt': false", "continue_final_message")
    extra = dict(template_kwargs or {})
    clash = sorted(_RESERVED & set(extra))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    if tools is not None:
        extra["tools"] = tools
    plain = [_template_message(m) for m in messages]
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            continue_final_message=continue_final_message, **extra)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"cannot render the messages with the chat template: {exc}", "messages") from exc
    except Exception as exc:  # jinja2 TemplateError and friends: raised by the template on these messages
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    return list(ids)


def _template_message(message: ChatMessage) -> dict:
    """One message as chat templates read it."""
    out = {"role": message.role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in message.tool_calls]
    return out


def _arguments(text: str):
    """A tool call's arguments as an object when they are a JSON object, else the text as given."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def truncated(prompt: Prompt, keep: int | None, tokenizer) -> Prompt:
    """``prompt`` cut to its last ``keep`` tokens (``truncate_prompt_tokens``), its text decoded from them."""
    if keep is None or len(prompt.token_ids) <= keep:
        return prompt
    ids = prompt.token_ids[-keep:]
    return Prompt(ids, tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else None)


def check_prompt(prompt: Prompt, limits: Limits, param: str) -> None:
    """Reject an empty prompt, token ids outside the vocabulary, and a prompt at or over the context."""
    ids = prompt.token_ids
    if not ids:
        raise bad_request(f"'{param}' must contain at least one token", param)
    worst = max(ids)
    if worst >= limits.vocab_size:
        raise bad_request(
            f"'{param}' holds token id {worst}, outside the vocabulary [0, {limits.vocab_size})", param
        )
    if len(ids) >= limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens{_kv_note(limits)}, and the "
            f"prompt has {len(ids)} tokens, which leaves no room to generate. Please shorten the prompt.",
            param,
            code="context_length_exceeded",
        )


def _kv_note(limits: Limits) -> str:
    """Says so when the context is cut short by the KV cache: such requests could never be scheduled."""
    cap = limits.kv_capacity_tokens
    if cap is not None and cap <= limits.max_model_len:
        return f" (the whole KV cache holds {cap} tokens, so no longer sequence can ever be scheduled)"
    return ""


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: Limits, param: str) -> int:
    """Tokens to generate: the request's limit, or what the context leaves; 400 when it cannot fit."""
    room = limits.max_model_len - prompt_len
    max_tokens = room if requested is None else requested
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens{_kv_note(limits)}. However, "
            f"you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the prompt or '{param}'.",
            param,
            code="context_length_exceeded",
        )
    cap = limits.kv_capacity_tokens
    if cap is not None and prompt_len + max_tokens > cap:
        raise bad_request(
            f"The request needs up to {prompt_len + max_tokens} tokens of KV cache ({prompt_len} prompt + "
            f"{max_tokens} completion) but the whole KV cache holds {cap} tokens, so it can never be "
            f"scheduled. Please reduce the prompt or '{param}'.",
            param,
            code="kv_cache_too_small",
        )
    return max_tokens


def check_admissible(num_sequences: int, limits: Limits) -> None:
    """Reject a request whose sequences (prompts x n) can never be admitted at once."""
    if limits.max_sequences is not None and num_sequences > limits.max_sequences:
        raise bad_request(
            f"the request asks for {num_sequences} sequences (prompts x n) but the server admits at most "
            f"{limits.max_sequences} at a time",
            "n",
        )


def logit_bias(raw: dict[str, float] | None, limits: Limits) -> dict[int, float] | None:
    """``logit_bias`` with integer keys, each checked against the vocabulary."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        token = int(key)
        if token >= limits.vocab_size:
            raise bad_request(
                f"logit_bias names token id {token}, outside the vocabulary [0, {limits.vocab_size})",
                "logit_bias",
            )
        bias[token] = float(value)
    return bias


def guided_decoding(req, reasoning: str | None = None) -> GuidedDecodingParams | None:
    """What the output must follow: ``response_format`` (``text`` or none: nothing; ``json_object``: one JSON
    object; ``json_schema``: JSON following its schema) or vLLM's ``guided_choice`` / ``guided_json`` /
    ``guided_regex``; two at once, or a schema or pattern outside the supported subset, is a 400. ``reasoning``:
    the server's reasoning parser, after whose thinking the format holds."""
    fmt = req.response_format or {}
    kind = fmt.get("type", "text")
    structured = req.structured_outputs
    if structured is not None:
        if structured.grammar is not None:
            raise bad_request("structured_outputs.grammar (a context-free grammar) is not supported; json, regex, "
                              "choice and json_object are", "structured_outputs")
        chosen = [k for k, v in (("json", structured.json_schema), ("regex", structured.regex),
                                 ("choice", structured.choice), ("json_object", structured.json_object))
                  if v not in (None, False)]
        if len(chosen) != 1:
            raise bad_request(f"structured_outputs needs exactly one of json, regex, choice and json_object, got "
                              f"{chosen or 'none'}", "structured_outputs")
    given = [name for name, value in (("response_format", kind != "text" or None),
                                      ("guided_choice", req.guided_choice), ("guided_json", req.guided_json),
                                      ("guided_regex", req.guided_regex), ("structured_outputs", structured))
             if value is not None]
    if len(given) > 1:
        raise bad_request(f"give one of response_format, structured_outputs, guided_choice, guided_json and "
                          f"guided_regex, not {' and '.join(given)}", given[-1])
    try:
        if structured is not None:
            return GuidedDecodingParams(json=structured.json_schema, regex=structured.regex, choice=structured.choice,
                                        json_object=bool(structured.json_object), reasoning=reasoning)
        if req.guided_choice is not None:
            return GuidedDecodingParams(choice=req.guided_choice, reasoning=reasoning)
        if req.guided_json is not None:
            return GuidedDecodingParams(json=req.guided_json, reasoning=reasoning)
        if req.guided_regex is not None:
            return GuidedDecodingParams(regex=req.guided_regex, reasoning=reasoning)
        if kind == "text":
            return None
        if kind == "json_object":
            return GuidedDecodingParams(json_object=True, reasoning=reasoning)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            return GuidedDecodingParams(json=spec["schema"], reasoning=reasoning)
    except ValueError as error:
        raise bad_request(str(error), given[0] if given else "response_format") from None
    raise bad_request(f"response_format type {kind!r} is unknown; expected 'text', 'json_object' or 'json_schema'",
                      "response_format")


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    limits: Limits,
    child: int,
    defaults: SamplingParams | None = None,
    prompt_logprobs: int | None = None,
    guided: GuidedDecodingParams | None = None,
) -> SamplingParams:
    """SamplingParams of child ``child`` (0 <= child < n) of the request.

    ``guided``: the request's ``guided_decoding(req)``, compiled once and shared by its children.

    Sampling fields the request leaves out come from ``defaults`` (the model's generation_config,
    as vLLM does), else from SamplingParams' own defaults.
    """
    base = defaults if defaults is not None else SamplingParams()

    def pick(value, name):
        return getattr(base, name) if value is None else value

    if req.stop_token_ids and max(req.stop_token_ids) >= limits.vocab_size:
        raise bad_request(
            f"stop_token_ids holds {max(req.stop_token_ids)}, outside the vocabulary [0, {limits.vocab_size})",
            "stop_token_ids",
        )
    if req.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    seed = None if req.seed is None else (req.seed + child) % 2**63
    kwargs = dict(
        n=1,
        temperature=pick(req.temperature, "temperature"),
        top_p=pick(req.top_p, "top_p"),
        top_k=pick(req.top_k, "top_k"),
        min_p=pick(req.min_p, "min_p"),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty"),
        seed=seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        guided_decoding=guided,
    )
    bias = logit_bias(req.logit_bias, limits)
    if bias:
        kwargs["logit_bias"] = bias
    if req.allowed_token_ids is not None:
        if max(req.allowed_token_ids) >= limits.vocab_size:
            raise bad_request(f"allowed_token_ids holds {max(req.allowed_token_ids)}, outside the vocabulary "
                              f"[0, {limits.vocab_size})", "allowed_token_ids")
        kwargs["allowed_token_ids"] = req.allowed_token_ids
    if req.bad_words:
        kwargs["bad_words"] = req.bad_words
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc)) from exc

