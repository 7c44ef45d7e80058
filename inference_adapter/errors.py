"""The reference server's one exception: a refused request, carried to the HTTP layer as status + message.

It lives apart from :mod:`inference_adapter.model_state` so every concern module can raise it without
importing the facade (which imports them). ``inference_adapter.model_state.RequestError`` is the same class.
"""

from __future__ import annotations

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP code, ``message`` says why and what to do."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status
