"""The reference server's HTTP routes, one :class:`fastapi.APIRouter` per concern.

* :mod:`~inference_adapter.routes.info` -- health, model/server info, the weight version, debug reads.
* :mod:`~inference_adapter.routes.generation` -- ``/generate`` and pause/continue.
* :mod:`~inference_adapter.routes.updates` -- SGLang's weight-update routes.
* :mod:`~inference_adapter.routes.lora` -- SGLang's LoRA adapter routes.
* :mod:`~inference_adapter.routes.openai` -- SGLang's ``/v1/completions`` and ``/v1/chat/completions``.
* :mod:`~inference_adapter.routes.project` -- the project's own ``/wsync/*`` routes.

Request bodies are parsed once each, into the models of :mod:`~inference_adapter.routes.bodies`;
:mod:`~inference_adapter.routes.common` holds what the routes share. A route reaches the served
:class:`~inference_adapter.model_state.ModelState` through ``app.state.served``.
"""

from inference_adapter.routes import generation, info, lora, openai, project, updates

ROUTERS = (info.router, generation.router, openai.router, updates.router, lora.router, project.router)
"""Every router, in the order ``create_app`` includes them."""

__all__ = ["ROUTERS"]
