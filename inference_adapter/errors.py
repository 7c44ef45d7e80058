"""The reference server's one exception: a refused request, carried to the HTTP layer as status + message,
and the one place a request body becomes a JSON object or that error.

It lives apart from :mod:`inference_adapter.model_state` so every concern module can raise it without
importing the facade (which imports them). ``inference_adapter.model_state.RequestError`` is the same class.
"""

from __future__ import annotations

import json

__all__ = ["RequestError", "json_object"]


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP code, ``message`` says why and what to do.

    ``reason``: a machine-readable cause sent as ``wsync_reason`` (e.g. :data:`bridge.protocol.VERSION_GOES_BACK`).
    """

    def __init__(self, message: str, status: int = 400, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason


MAX_DEPTH = 32
"""Deepest nesting a request body may have; no route's body needs more than a few levels."""


def json_object(raw: bytes, route: str) -> dict:
    """The request body as a JSON object (an empty body is ``{}``), or a RequestError naming the route.

    Refused here, before any route sees them: invalid JSON, NaN/Infinity (not JSON, though Python's parser
    takes them), nesting deeper than :data:`MAX_DEPTH`, and strings that cannot be encoded back as UTF-8
    (a lone surrogate such as ``"\\ud800"`` parses, but would make every answer that echoes it fail).
    """

    def no_constants(name: str):
        raise ValueError(f"{name} is not a JSON value; send a number or null")

    try:
        data = json.loads(raw, parse_constant=no_constants) if raw.strip() else {}
    except RecursionError:
        raise RequestError(f"invalid request body for {route}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(f"invalid request body for {route}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError(f"invalid request body for {route}: expected a JSON object, got {type(data).__name__}")
    _check_values(data, route)
    return data


def _check_values(data: dict, route: str) -> None:
    """Walk the body without recursion: depth, and strings that UTF-8 cannot carry (keys included)."""
    todo: list[tuple[object, str, int]] = [(data, "", 1)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"invalid request body for {route}: field '{where[:40]}...' is nested deeper than "
                               f"{MAX_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                key = f"{where}.{_printable(k)}".lstrip(".")
                _check_text(k, key, route)
                todo.append((v, key, depth + 1))
        elif isinstance(value, list):
            todo.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where, route)


def _printable(text: str) -> str:
    """``text`` with lone surrogates escaped, so a message can name it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(text: str, where: str, route: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = _printable(text[e.start : e.end])
        raise RequestError(f"invalid request body for {route}: field '{where}' holds {bad}, a lone UTF-16 "
                           "surrogate that is not Unicode text; send valid UTF-8 strings") from None
