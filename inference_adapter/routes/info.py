"""Information routes: health, model and server info, the weight version, SGLang's debug reads.

``/model_info`` and ``/server_info`` exist from SGLang 0.5.6, ``/ready`` from 0.5.20, ``/get_weight_version``
in 0.5.1-0.5.7 and ``/weight_version`` in 0.5.6-0.5.7; the other ``/get_*`` names exist in every emulated version. ``/get_server_info`` adds the project's ``wsync_reference_server`` and
``wsync_disk_roots`` (see :mod:`inference_adapter.server`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from bridge.protocol import GetWeightsByNameReq
from inference_adapter.errors import RequestError
from inference_adapter.model_state import ModelState
from inference_adapter.routes.common import Served, absent, parse

__all__ = ["router"]

router = APIRouter()


@router.get("/health")
@router.get("/health_generate")
async def health():
    return Response(status_code=200)


@router.get("/ready")
async def ready(state: Served):
    return Response(status_code=200) if state.features.release >= (0, 5, 20) else absent()


@router.get("/get_model_info")
async def get_model_info(state: Served):
    return state.model_info()


@router.get("/model_info")
async def model_info(state: Served):
    return state.model_info() if state.features.info_routes else absent()


@router.get("/get_server_info")
async def get_server_info(request: Request, state: Served):
    return _server_info(request, state)


@router.get("/server_info")
async def server_info(request: Request, state: Served):
    return _server_info(request, state) if state.features.info_routes else absent()


def _server_info(request: Request, state: ModelState) -> dict:
    return {
        **request.app.state.server_args, "version": state.features.version, "tp_size": 1, "dp_size": 1, "pp_size": 1,
        "model_path": state.model_path, "tokenizer_path": state.tokenizer_path,
        "served_model_name": state.served_model_name, "weight_version": state.version,
        "dtype": str(state.dtype).removeprefix("torch."), "context_length": state.context_length,
        "startup_time": request.app.state.started, "wsync_reference_server": True,
        "wsync_disk_roots": state.disk_roots, "internal_states": [state.internal_state()],
    }


@router.get("/v1/models")
async def models(state: Served):
    base = {"id": state.served_model_name, "object": "model", "owned_by": "sglang", "root": state.model_path}
    # With --enable-lora, SGLang lists every loaded adapter after the model: id its name, root its path.
    adapters = [{"id": n, "object": "model", "owned_by": "sglang", "root": p, "parent": state.served_model_name,
                 "max_model_len": None} for n, p in state.adapters.listing().items()]
    return {"object": "list", "data": [base, *adapters]}


@router.get("/get_weight_version")
async def get_weight_version(state: Served):
    if state.features.get_weight_version_route:
        return {"weight_version": state.version}
    return absent()  # before 0.5.1, and from 0.5.8 (SGLang answers 404 "deprecated")


@router.get("/weight_version")
async def weight_version(state: Served):
    if state.features.weight_version_route:
        return {"weight_version": state.version}
    return absent()  # before 0.5.6, and from 0.5.8 (404 "deprecated" until 0.5.22; 0.5.23 has no such route)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    # No KV cache is kept between requests, so there is never anything to flush.
    return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation will not be performed.)\n")


@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(state: Served):
    if state.features.release < (0, 5, 6):
        return absent()  # SGLang serves it from 0.5.6
    raise RequestError("/weights_checker is not served by the reference server: SGLang's checker hashes its model "
                       "runners' own tensors (per TP rank, q/k/v and gate/up stacked), which this server does not hold; "
                       "POST /wsync/weights_checksum gives the sha256 of every served tensor under its HF name",
                       status=501)


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request, state: Served):
    req = await parse(request, GetWeightsByNameReq)
    out = await run_in_threadpool(state.get_weights_by_name, req.name, req.truncate_size)
    if out is None:
        raise RequestError(f"Get parameter by name failed: {req.name!r} is not a parameter of the served model")
    return JSONResponse(out)
