"""The FastAPI application: routes of the OpenAI-compatible API, health, tokenizer and metrics."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ninefold import __version__
from ninefold.llm.reasoning import get_reasoning_parser
from ninefold.llm.server import handlers, lora_routes
from ninefold.llm.server.admission import Admission
from ninefold.llm.server.embeddings import create_embedding
from ninefold.llm.server.errors import APIError, install_error_handlers
from ninefold.llm.server.logprobs import TokenIdTexts, TokenTexts
from ninefold.llm.server.metrics import CONTENT_TYPE, ServerMetrics
from ninefold.llm.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from ninefold.llm.server.preprocess import needs_tokenizer, render_chat
from ninefold.llm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingBody,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    dump,
)
from ninefold.llm.server.state import ServerState, engine_defaults, engine_limits
from ninefold.llm.server.tool_choice import template_tools
from ninefold.llm.tools import get_parser

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)
}


def build_app(
    engine: Any,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_num_seqs: int | None = None,
    max_queue: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    retry_after_s: int = 1,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    lora_modules: dict[str, str] | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The server's ASGI app around a started ``AsyncEngine``.

    At most ``max_num_seqs + max_queue`` sequences are admitted at once (both given), the rest get
    429 with Retry-After; with ``api_key`` the API routes need ``Authorization: Bearer <key>``.
    ``tool_call_parser`` (a name of ``ninefold.llm.tools.PARSERS``) turns on ``tool_choice: "auto"``: outputs
    are read for tool calls in that model family's format. ``reasoning_parser`` (``deepseek_r1``, ``qwen3``)
    returns chat reasoning apart from the answer, in ``reasoning`` / ``reasoning_content``.
    ``lora_modules``: LoRA adapters served as models of their own (``name -> PEFT directory``; the engine needs
    ``enable_lora``); ``allow_runtime_lora_updating`` adds vLLM's ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` routes.
    """
    if tool_call_parser is not None:
        get_parser(tool_call_parser)  # an unknown name fails here, not at the first request
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    if not isinstance(served_model_name, str) or not served_model_name:
        raise ValueError(f"served_model_name: got {served_model_name!r}; expected a non-empty string")
    capacity = None
    if max_queue is not None:
        if max_queue < 0:
            raise ValueError(f"max_queue: got {max_queue}; expected an integer >= 0")
        running = max_num_seqs or _engine_max_num_seqs(engine)
        if running is None:
            raise ValueError("max_queue needs max_num_seqs (or an engine with a max_num_seqs attribute)")
        capacity = running + max_queue
    limits = engine_limits(engine, capacity)
    admission = Admission(capacity, retry_after_s)
    metrics = ServerMetrics(engine.stats, served_model_name, admitted=lambda: admission.in_use)
    state = ServerState(
        engine=engine,
        served_model_name=served_model_name,
        limits=limits,
        metrics=metrics,
        admission=admission,
        # without a tokenizer (dummy weights of a named shape) tokens show as "token_id:<id>", as vLLM's
        # return_tokens_as_token_ids shows them
        texts=TokenTexts(engine.tokenizer) if engine.tokenizer is not None else TokenIdTexts(None),
        defaults=engine_defaults(engine),
        tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    lora_routes.add_start_adapters(state, lora_modules or {})
    app = FastAPI(title="ninefold OpenAI-compatible server", version="1", responses=_ERRORS)
    app.state.server = state
    app.state.api_key_set = bool(api_key)
    install_error_handlers(app, on_error=metrics.reject)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completions; ``stream: true`` answers with server-sent events."""
        return await handlers.create_completion(state, body, request.receive)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions through the model's chat template; streams with ``stream: true``."""
        return await handlers.create_chat_completion(state, body, request.receive)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(body: EmbeddingBody, request: Request) -> Response:
        """OpenAI embeddings: the model's final hidden states pooled per input (``ninefold.llm.pooling``); vLLM's
        ``messages`` form embeds one conversation rendered through the chat template."""
        return await create_embedding(state, body, request.receive)

    def card(model_id: str = served_model_name) -> ModelCard:
        lora = state.check_model(model_id)
        if lora is not None:
            return ModelCard(id=lora.lora_name, created=state.created, root=lora.lora_path, parent=served_model_name,
                             max_model_len=limits.max_model_len)
        return ModelCard(id=served_model_name, created=state.created, root=str(getattr(engine, "model_name", "")),
                         max_model_len=limits.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        """The served model, then the LoRA adapters served beside it."""
        return dump(ModelList(data=[card(), *(card(name) for name in list(state.loras))]))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> dict:
        """One model (the served one or an adapter), else 404."""
        return dump(card(model_id))

    @app.get("/version")
    async def version() -> dict:
        """The ninefold version serving."""
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        """200 while serving; 503 while draining for shutdown, or once the engine cannot serve again (a
        tensor-parallel worker lost): a liveness probe should restart the server then."""
        if state.admission.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(retry_after_s)})
        broken = getattr(engine, "broken", None)
        if broken:
            raise APIError(503, f"the engine cannot serve: {broken}")
        return JSONResponse({"status": "ok"})

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """Token ids of a prompt, or of chat messages rendered through the chat template."""
        state.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = render_chat(body.messages, engine.tokenizer, body.add_generation_prompt,
                                 tools=template_tools(body), template_kwargs=body.chat_template_kwargs,
                                 continue_final_message=body.continue_final_message)
        else:
            tokens = needs_tokenizer(engine.tokenizer, "prompt").encode(body.prompt,
                                                                        add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": list(tokens)}

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> dict:
        """Text of token ids (special tokens kept)."""
        state.check_model(body.model)
        bad = [t for t in body.tokens if t >= limits.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
                           param="tokens")
        return {"prompt": needs_tokenizer(engine.tokenizer, "tokens").decode(body.tokens, skip_special_tokens=False)}

    if allow_runtime_lora_updating:
        lora_routes.install_runtime_updates(app, state)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus metrics: queue, KV cache, prefix cache, latency histograms, token counters."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _document_400_not_422(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def _engine_max_num_seqs(engine: Any) -> int | None:
    """The engine's batch limit: ``engine.max_num_seqs``, else its config's."""
    value = getattr(engine, "max_num_seqs", None)
    if value is None:
        config = getattr(getattr(engine, "engine", None), "config", None)
        value = getattr(config, "max_num_seqs", None)
    return value


def _document_400_not_422(app: FastAPI) -> None:
    """The schema should say what the server does: validation errors are 400s in OpenAI's format."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for methods in schema.get("paths", {}).values():
                for operation in methods.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None and "400" not in responses:
                        responses["400"] = {"description": "Invalid request",
                                            "content": {"application/json": {"schema": {
                                                "$ref": "#/components/schemas/ErrorResponse"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
