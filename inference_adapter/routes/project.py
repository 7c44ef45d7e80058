"""The project's own routes (not SGLang's; a client that does not know them can ignore them).

``/wsync/weights_checksum`` (GET or POST ``{"names": [...] | null}``): the sha256 of every (or each
named) served tensor and the weight version, read under one lock; with ``"digest": true``, one digest of the named
tensors (:func:`bridge.digest.served_digest_part`) with the version and its run instead. ``/wsync/weights_spec``
(GET): each served tensor's shape and dtype, the aliases accepted and the serving dtype (a publisher's check
before any byte moves). ``/wsync/abort_weight_update``
(POST): discard the open update session without applying anything. ``/wsync/writer_lease`` (POST
``{"wsync_writer", "wsync_run_id", "lease_s", "release", "starts_sync", "renew_only"}``): take, renew or release the writer lease (one
writer at a time, :mod:`inference_adapter.writers`). The bench's raw-transport route lives in
:mod:`inference_adapter.bench_routes`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from bridge.protocol import WeightsChecksumReq
from inference_adapter.routes.bodies import LeaseBody, WriterBody
from inference_adapter.routes.common import Served, ok, parse

__all__ = ["router"]

router = APIRouter()


@router.api_route("/wsync/weights_checksum", methods=["GET", "POST"])
async def weights_checksum(request: Request, state: Served):
    req = await parse(request, WeightsChecksumReq)
    return await run_in_threadpool(state.checksums, req.names, req.digest)


@router.get("/wsync/weights_spec")
async def weights_spec(state: Served):
    return state.weights_spec()


@router.post("/wsync/abort_weight_update")
async def abort_weight_update(request: Request, state: Served):
    req = await parse(request, WriterBody)
    return ok(await run_in_threadpool(state.updates.abort_session, req.run))


@router.post("/wsync/writer_lease")
async def writer_lease(request: Request, state: Served):
    req = await parse(request, LeaseBody)
    u, run = state.updates, req.run
    if req.release:
        return ok(await run_in_threadpool(u.release_lease, run.writer))
    return ok(await run_in_threadpool(u.take_lease, run.writer, run.run_id, float(req.lease_s), req.starts_sync,
                                      req.renew_only),
              **{"writer_lease": u.writers.state()})
