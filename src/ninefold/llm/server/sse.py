"""Server-sent events in OpenAI's streaming format."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def sse_data(payload: dict[str, Any]) -> str:
    """One ``data:`` event carrying ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(body: dict[str, Any]) -> str:
    """An ``error`` event: how a failure after the first streamed byte reaches the client.

    The data is the usual ``{"error": {...}}`` object, which the ``openai`` client raises as an APIError.
    """
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
