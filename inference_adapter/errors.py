"""The reference server's one exception: a refused request, carried to the HTTP layer as status + message,
and the one place a request body becomes a JSON object or that error.

It lives apart from :mod:`inference_adapter.model_state` so every concern module can raise it without
importing the facade (which imports them). ``inference_adapter.model_state.RequestError`` is the same class.
"""

from __future__ import annotations

import json

__all__ = ["RequestError", "json_object"]


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP code, ``message`` says why and what to do."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def json_object(raw: bytes, route: str) -> dict:
    """The request body as a JSON object (an empty body is ``{}``), or a RequestError naming the route."""
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise RequestError(f"invalid request body for {route}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError(f"invalid request body for {route}: expected a JSON object, got {type(data).__name__}")
    return data
