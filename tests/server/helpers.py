"""Shared checks of the server tests."""

import httpx


def check_error(response: httpx.Response, status: int, param: str | None = None, text: str | None = None) -> dict:
    """Assert an OpenAI error response: status, body shape, no traceback, and optionally param and text."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    if param is not None:
        assert error["param"] == param, error
    if text is not None:
        assert text in error["message"], error["message"]
    return error
