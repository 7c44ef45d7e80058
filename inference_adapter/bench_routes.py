"""Project-extension routes for ``wsync bench``: the raw-transport floor, measured on the server's own group.

``register_bench_routes(app, state)`` adds to the reference server's FastAPI app:

``POST /wsync/bench/recv_raw`` ``{"group_name": str, "nbytes": int}``
    Receives one ``uint8`` broadcast of exactly ``nbytes`` bytes from group rank 0 (the trainer) on the
    server's existing weight-update group ``group_name`` (created by ``/init_weights_update_group``),
    and discards it. Answers ``{"success": true, "seconds": <receive time>, "nbytes": nbytes}``.

It is the same transfer a flattened-bucket update makes, without anything around it (no metadata
check, no slack buffer, no unflatten, no staging, no swap), so the trainer can time the bare transport
between the same two processes over the same group. The order on the trainer: post this request, then
start ``dist.broadcast(buf, src=0, group=pg)`` with a buffer of ``nbytes`` bytes, then wait for both.

The receive holds the server's weight-operation lock, so it never interleaves with a weight update on
the same group. It is guarded as a weight update's receive is (:mod:`inference_adapter.wire`): a
broadcast of another size answers 400 (the group stays usable), and one that fails or does not arrive
within the receive bound leaves the group unusable: it is destroyed, as a failed
``/update_weights_from_distributed`` destroys it. A request the server refuses (unknown group, bad
size) is answered before anything is received; the trainer must then not broadcast.

Example (:func:`~inference_adapter.server.create_app` calls it; a test can call it on an app of its own):
    >>> from inference_adapter.server import create_app          # doctest: +SKIP
    >>> app = create_app(state)                                   # doctest: +SKIP
    >>> register_bench_routes(app, state)                         # doctest: +SKIP
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from fastapi import Request  # at module level: FastAPI resolves the route's annotations in these globals

__all__ = ["RECV_RAW_ROUTE", "register_bench_routes"]

RECV_RAW_ROUTE = "/wsync/bench/recv_raw"
_MIN_CAP = 1 << 30  # a raw receive may always be this large, whatever the model size


def register_bench_routes(app, state) -> None:
    """Add ``POST /wsync/bench/recv_raw`` to ``app`` (idempotent: a second call adds nothing).

    Args:
        app: the FastAPI app of :func:`inference_adapter.server.create_app`.
        state: its :class:`inference_adapter.model_state.ModelState` (its groups, by group name).
    """
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    if any(getattr(r, "path", None) == RECV_RAW_ROUTE for r in app.routes):
        return

    @app.post(RECV_RAW_ROUTE)
    async def recv_raw(request: Request):
        group_name, nbytes = _parse(await request.body(), _cap(state))
        seconds = await run_in_threadpool(_receive, state, group_name, nbytes)
        return JSONResponse({"success": True, "seconds": seconds, "nbytes": nbytes})


def _cap(state) -> int:
    # Twice the served weights: room for any raw floor of this model, far from exhausting the host.
    return max(2 * state.weights.nbytes, _MIN_CAP)


def _parse(raw: bytes, cap: int) -> tuple[str, int]:
    from inference_adapter.errors import RequestError, json_object

    route = RECV_RAW_ROUTE
    data = json_object(raw, route)
    unknown = sorted(set(data) - {"group_name", "nbytes"})
    if unknown:
        raise RequestError(f"invalid request body for {route}: unknown field(s) {unknown}; send group_name and nbytes")
    group_name, nbytes = data.get("group_name"), data.get("nbytes")
    if not isinstance(group_name, str) or not group_name:
        raise RequestError(f"{route}: group_name must be the non-empty name of a weight-update group, got {group_name!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= cap:
        raise RequestError(f"{route}: nbytes must be an integer in 1..{cap} (twice the served weights, at least "
                           f"1 GiB), got {nbytes!r}")
    return group_name, nbytes


def _receive(state, group_name: str, nbytes: int) -> float:
    """Receive and drop one broadcast of ``nbytes`` bytes on ``group_name``; the seconds it took."""
    from inference_adapter.errors import RequestError
    from inference_adapter.wire import SizeMismatch, receive_bound, recv_bytes

    updates = state.updates
    groups = updates.groups
    with updates.lock:
        pg = groups.pgs.get(group_name)
        if pg is None:
            raise RequestError(f"{RECV_RAW_ROUTE}: group {group_name} not in {groups.names()}; call "
                               "init_weights_update_group first (nothing was received, so do not broadcast)")
        t0 = time.perf_counter()
        try:
            with groups.receiving_on(group_name):
                if group_name in groups.nccl:  # NCCL needs equal counts on every rank: no slack, as SGLang receives
                    device = torch.device("cuda", torch.cuda.current_device())
                    dist.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=device), src=0, group=pg)
                    torch.cuda.synchronize(device)
                else:
                    bound = receive_bound(nbytes, updates.receive_timeout, updates.group_timeout)
                    recv_bytes(pg, nbytes, nbytes, "the raw broadcast", bound, keep=False)
        except SizeMismatch as e:
            raise RequestError(f"{RECV_RAW_ROUTE}: {e}; nothing was kept and group {group_name} is still usable") from None
        except Exception as e:  # any receive failure leaves the group unusable
            groups.drop(group_name, f"a raw bench broadcast on it failed ({e})")
            raise RequestError(f"{RECV_RAW_ROUTE}: the broadcast on group {group_name} failed ({e}); the group was "
                               "destroyed; call init_weights_update_group again") from e
        seconds = time.perf_counter() - t0
    state.log.info("bench: received and dropped a raw broadcast of %d bytes on %s in %.3f s (%.2f GB/s)",
                   nbytes, group_name, seconds, nbytes / max(seconds, 1e-9) / 1e9)
    return seconds
