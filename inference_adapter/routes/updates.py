"""SGLang's weight-update routes: groups, the three update paths, the session, the version label.

Each parses its body once (:mod:`inference_adapter.routes.bodies`) and hands it to
:class:`~inference_adapter.weight_updates.WeightUpdates` on a worker thread: rendezvous, broadcasts and
disk reads block, and ``/model_info`` must answer meanwhile. The session routes exist from SGLang
0.5.21, ``/destroy_weights_update_group`` from 0.5.6, ``/update_weight_version`` from 0.5.1.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from bridge.protocol import DestroyWeightsUpdateGroupReq, InitWeightsUpdateGroupReq
from inference_adapter.routes.bodies import BeginBody, DiskBody, DistributedBody, TensorBody, VersionBody, WriterBody
from inference_adapter.routes.common import Served, absent, ok, parse

__all__ = ["router"]

router = APIRouter()


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, state: Served):
    req = await parse(request, InitWeightsUpdateGroupReq)
    msg = await run_in_threadpool(
        lambda: state.updates.groups.init(master_address=req.master_address, master_port=req.master_port,
                                          rank_offset=req.rank_offset, world_size=req.world_size,
                                          group_name=req.group_name, backend=req.backend)
    )
    return ok(msg)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, state: Served):
    if not state.features.destroy_group:
        return absent()
    req = await parse(request, DestroyWeightsUpdateGroupReq)
    return ok(await run_in_threadpool(state.updates.groups.destroy, req.group_name))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, state: Served):
    req = await parse(request, DistributedBody)
    msg = await run_in_threadpool(
        lambda: state.updates.update_distributed(
            names=req.names, dtypes=req.dtypes, shapes=req.shapes, group_name=req.group_name,
            load_format=req.load_format, weight_version=req.weight_version,
            abort_all_requests=req.abort_all_requests, run=req.run, wsync_delta=req.wsync_delta,
        )
    )
    return ok(msg)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request, state: Served):
    req = await parse(request, TensorBody)
    msg = await run_in_threadpool(
        lambda: state.updates.update_tensor(
            serialized_named_tensors=req.serialized_named_tensors, load_format=req.load_format,
            weight_version=req.weight_version, abort_all_requests=req.abort_all_requests, run=req.run,
        )
    )
    return ok(msg)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, state: Served):
    req = await parse(request, DiskBody)
    msg = await run_in_threadpool(
        lambda: state.updates.update_disk(model_path=req.model_path, weight_version=req.weight_version,
                                          abort_all_requests=req.abort_all_requests, run=req.run,
                                          manifest_sha256=req.wsync_manifest_sha256)
    )
    return ok(msg, num_paused_requests=0)


@router.post("/begin_weight_update")
async def begin_weight_update(request: Request, state: Served):
    if not state.features.needs_session:
        return absent()
    req = await parse(request, BeginBody)
    return ok(await run_in_threadpool(state.updates.begin_session, req.run))


@router.post("/end_weight_update")
async def end_weight_update(request: Request, state: Served):
    if not state.features.needs_session:
        return absent()
    req = await parse(request, WriterBody)
    return ok(await run_in_threadpool(state.updates.end_session, req.run))


@router.post("/update_weight_version")
async def update_weight_version(request: Request, state: Served):
    if not state.features.weight_version:
        return absent()
    req = await parse(request, VersionBody)
    await run_in_threadpool(state.updates.set_version, req.new_version, req.abort_all_requests, req.run)
    return ok(f"Weight version updated to {req.new_version}", new_version=req.new_version)
