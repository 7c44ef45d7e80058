"""What every route module shares: the served state, parsing a body once, and SGLang's small answers."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from bridge.protocol import describe_validation_error
from inference_adapter.errors import RequestError, json_object
from inference_adapter.model_state import ModelState

__all__ = ["Served", "absent", "ok", "parse", "served"]

M = TypeVar("M", bound=BaseModel)


def served(request: Request) -> ModelState:
    """The app's :class:`~inference_adapter.model_state.ModelState` (set by ``create_app``)."""
    return request.app.state.served


Served = Annotated[ModelState, Depends(served)]
"""A route parameter of this type receives the served state."""


async def parse(request: Request, model: type[M]) -> M:
    """The request body parsed once into ``model``; a RequestError naming the route and every bad field.

    The JSON is checked first (:func:`~inference_adapter.errors.json_object`); the emulated version's
    features go to the model's validators as context (:mod:`inference_adapter.routes.bodies`).
    """
    route = request.url.path
    data = json_object(await request.body(), route)
    try:
        return model.model_validate(data, context={"features": served(request).features})
    except ValidationError as e:
        raise RequestError(describe_validation_error(route, e)) from None


def absent() -> JSONResponse:
    """The answer of a route the emulated SGLang version lacks: FastAPI's own 404."""
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def ok(message: str, **extra) -> JSONResponse:
    """SGLang's answer to a weight operation that succeeded."""
    return JSONResponse({"success": True, "message": message, **extra})
