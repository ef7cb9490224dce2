"""``POST /v1/embeddings``: OpenAI's embeddings API over ``AsyncEngine.embed``."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable

import numpy as np
from starlette.responses import JSONResponse, Response

from ninefold.llm.pooling import PoolingParams
from ninefold.llm.server.errors import APIError
from ninefold.llm.server.generation import until_disconnect
from ninefold.llm.server.preprocess import prompt_items, render_chat
from ninefold.llm.server.protocol import MAX_EMBEDDING_INPUTS, EmbeddingChatRequest, EmbeddingRequest
from ninefold.llm.server.state import ServerState

Receive = Callable[[], Awaitable[dict]]


def embedding_inputs(req: EmbeddingRequest | EmbeddingChatRequest, tokenizer) -> list:
    """The request's inputs as engine prompts (strings or token-id lists; chat messages rendered through the chat
    template); empty ones are the client's 400."""
    if isinstance(req, EmbeddingChatRequest):
        return [render_chat(req.messages, tokenizer, req.add_generation_prompt, template_kwargs=req.chat_template_kwargs,
                            continue_final_message=req.continue_final_message)]
    items = prompt_items(req.input, "input", "inputs", MAX_EMBEDDING_INPUTS)
    for i, item in enumerate(items):
        if len(item) == 0:
            raise APIError(400, f"'input' item {i} is empty; every input needs at least one token", param="input")
    return items


def encode(values: list[float], encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI returns it: numbers, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


async def create_embedding(state: ServerState, req: EmbeddingRequest | EmbeddingChatRequest,
                           receive: Receive) -> Response:
    """``POST /v1/embeddings``."""
    if state.check_model(req.model) is not None:
        raise APIError(400, f"'{req.model}' is a LoRA adapter, which this server applies to generation only; "
                            f"embeddings come from '{state.served_model_name}'", param="model")
    items = embedding_inputs(req, state.tokenizer)
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
    except ValueError as error:
        raise APIError(400, str(error), param=str(error).split(":")[0]) from None
    request_id = f"embd-{uuid.uuid4().hex}"
    state.admission.acquire(1)
    try:
        try:
            work = state.engine.embed(items, params, request_id)
            finished, outputs = await until_disconnect(receive, work)
        except (ValueError, TypeError) as error:  # checked in the engine: lengths, vocabulary, dimensions
            raise APIError(400, str(error), param=_param_of(str(error))) from None
    finally:
        state.admission.release(1)
    if not finished:
        return Response(status_code=499)  # nobody is listening; what was not computed is dropped
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    state.metrics.count_prompt(tokens)
    return JSONResponse({
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": state.served_model_name,
        "data": [{"index": i, "object": "embedding", "embedding": encode(out.outputs.embedding, req.encoding_format)}
                 for i, out in enumerate(outputs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })


_ENGINE_FIELDS = {"prompt": "input", "dimensions": "dimensions", "truncate_prompt_tokens": "truncate_prompt_tokens"}


def _param_of(message: str) -> str:
    """The request field an engine error names (its prompts are 'input'); 'input' when it names none."""
    return _ENGINE_FIELDS.get(message.split(":")[0], "input")
