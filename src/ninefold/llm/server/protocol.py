"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Ranges that do not depend on the model (temperature, top_p, n, penalties, ...) are checked here, so
FastAPI rejects them with a 400 before any work starts; checks that need the tokenizer or the
engine's limits live in :mod:`ninefold.llm.server.requests`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
)

from ninefold.llm.unicode import UNPAIRED_SURROGATE, first_invalid_string

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TOOLS = 128

# Token ids are non-negative 32-bit integers; anything larger is rejected before it reaches a tensor.
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
Stop = StrictStr | list[StrictStr] | None


def _number_only(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    return value


# A JSON number (int or float), never a string or a boolean, never NaN or infinity.
Number = Annotated[float, BeforeValidator(_number_only), Field(allow_inf_nan=False)]


class RequestModel(BaseModel):
    """A request body: every string in it must be valid Unicode (a 400 names the field otherwise)."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        bad = first_invalid_string(value)
        if bad is not None:
            raise ValueError(f"{UNPAIRED_SURROGATE} ({bad[:40]!a})")
        return value


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts; with it, vLLM's
    ``continuous_usage_stats`` puts the counts so far in every chunk too."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class StructuredOutputs(BaseModel):
    """``structured_outputs`` (vLLM >= 0.12's replacement of the ``guided_*`` fields); one of its formats."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1, max_length=1024)
    json_object: StrictBool | None = None
    grammar: StrictStr | None = Field(None, description="Not supported: a 400 says so.")


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="Served model name; omitted means the only model.")
    n: StrictInt = Field(1, ge=1, le=MAX_N, description="Completions per prompt.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description="Up to 16 non-empty strings that end generation.")
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Number] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)
    user: StrictStr | None = None
    # vLLM's extra sampling fields.
    top_k: StrictInt | None = Field(None, ge=-1, le=2**31 - 1, description="-1 or 0: off.")
    min_p: Number | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=100.0)
    min_tokens: StrictInt = Field(0, ge=0, le=2**31 - 1)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = Field(
        False, description="Keep the stop string (or render the stop token) that ended the output (vLLM's extra).")
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, max_length=1 << 20, description="Every generated token is one of these (vLLM's extra).")
    bad_words: list[StrictStr] | None = Field(
        None, max_length=256, description="Words never generated, as given or after a space (vLLM's extra).")
    use_beam_search: StrictBool = Field(
        False, description="The n choices are the n best beams of a beam search (vLLM's extra).")
    length_penalty: Number = Field(
        1.0, description="With use_beam_search: beams rank by cumulative logprob / length ** length_penalty.")
    priority: StrictInt = Field(0, ge=-(2**31), le=2**31 - 1,
                                description="Lower runs first, with --scheduling-policy priority (vLLM's extra).")
    return_tokens_as_token_ids: StrictBool = Field(
        False, description="Logprobs name tokens as 'token_id:<id>' (vLLM's extra).")
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, le=2**31 - 1,
        description="Keep only the prompt's last N tokens; -1: as many as the context takes (vLLM's extra).")
    prompt_logprobs: StrictInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Every prompt token's logprob and the N most likely tokens at its position (choices[].prompt_logprobs).")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text'}, {'type': 'json_object'} (the output is one JSON object) or "
                          "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}} (a supported subset).")
    guided_choice: list[StrictStr] | None = Field(
        None, min_length=1, max_length=1024, description="The output is one of these strings (vLLM's extra).")
    guided_json: dict[str, Any] | StrictStr | None = Field(
        None, description="The output is JSON following this JSON Schema (vLLM's extra; a supported subset).")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's newer form of the guided_* fields: {'json' | 'regex' | 'choice' | 'json_object': ...}")
    guided_regex: StrictStr | None = Field(
        None, description="The output matches this regular expression as a whole (vLLM's extra; Python syntax "
                          "without backreferences, lookaround or flags).")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Stop) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(len(s) == 0 for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > 1000 for s in stops):
            raise ValueError("stop strings must be at most 1000 characters")
        return stops

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate_prompt_tokens(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be >= 1, or -1 (as much as the context takes)")
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not w.strip() or len(w) > 1000 for w in value):
            raise ValueError("bad words must be non-blank strings of at most 1000 characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > 1024:
            raise ValueError(f"at most 1024 logit_bias entries are supported, got {len(value)}")
        for key, bias in value.items():
            if not (key.strip().isascii() and key.strip().isdigit()):
                raise ValueError(f"keys must be token ids written as non-negative integers, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must lie in [-100, 100], got {bias} for token {key}")
        return value


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of lists of token ids."
    )
    max_tokens: StrictInt | None = Field(16, ge=0, description="Tokens to generate (default 16; 0 only with echo).")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = Field(False, description="Return the prompt before the completion (and its logprobs with logprobs).")
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    """A text content part of a chat message."""

    type: Literal["text"]
    text: StrictStr


class FunctionCallIn(BaseModel):
    """The function an earlier assistant message called: its name and its arguments as JSON text."""

    name: StrictStr
    arguments: StrictStr


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message (``messages[].tool_calls[]``)."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts.

    Assistant messages may carry the ``tool_calls`` they made; ``tool`` messages answer one by ``tool_call_id``.
    """

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    """A function the model may call: its name, what it does and a JSON Schema of its parameters."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    """``tools[]``: a function tool."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = Field(
        False, description="Continue the last message (e.g. a begun assistant reply) instead of opening a new turn; "
                           "needs add_generation_prompt false (vLLM's extra).")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'none', 'auto' (the default with tools; needs --enable-auto-tool-choice), 'required' "
                          "or {'type': 'function', 'function': {'name': ...}}.")
    parallel_tool_calls: StrictBool = Field(True, description="With 'required': whether more than one call may come.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. {'enable_thinking': false}).")
    include_reasoning: StrictBool = Field(True, description="With --reasoning-parser: return the reasoning too.")


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(RequestModel):
    """``POST /v1/embeddings`` (OpenAI's fields plus vLLM's ``truncate_prompt_tokens`` and ``normalize``)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="Served model name; omitted means the only model.")
    input: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of lists of token ids.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'float': lists of numbers; 'base64': little-endian float32 bytes, base64-encoded.")
    dimensions: StrictInt | None = Field(None, ge=1, description="Keep the first N values (Matryoshka models).")
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1, description="Keep the last N tokens (-1: all that fit).")
    normalize: StrictBool | None = Field(None, description="Unit length (default: the model's).")


class EmbeddingChatRequest(RequestModel):
    """``POST /v1/embeddings`` with chat messages instead of ``input`` (vLLM's form): one embedding of the
    conversation rendered through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: StrictBool = Field(False, description="End with the template's assistant header.")
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    normalize: StrictBool | None = None


def _embedding_form(body: Any) -> str:
    return "messages-form" if isinstance(body, dict) and "messages" in body else "input-form"


# The body of ``POST /v1/embeddings``: chat messages when it has a ``messages`` key, else inputs (only the chosen
# form's errors are reported; ``errors.describe_validation_errors`` drops the tag from their locations).
EmbeddingBody = Annotated[
    Annotated[EmbeddingRequest, Tag("input-form")] | Annotated[EmbeddingChatRequest, Tag("messages-form")],
    Discriminator(_embedding_form),
]


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class TokenizeCompletionRequest(RequestModel):
    """``POST /tokenize`` with a prompt."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeChatRequest(RequestModel):
    """``POST /tokenize`` with chat messages (rendered through the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter in ``lora_path`` as model ``lora_name``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving adapter ``lora_name``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(min_length=1)


class DetokenizeResponse(BaseModel):
    prompt: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


# One entry per prompt token (None for the first), keyed by token id (vLLM's prompt_logprobs).
PromptLogprobs = list[dict[str, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    prompt_logprobs: PromptLogprobs = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    prompt_logprobs: PromptLogprobs = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ninefold"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def dump(model: BaseModel) -> dict[str, Any]:
    """A response model as a JSON-ready dict."""
    return model.model_dump(mode="json")
