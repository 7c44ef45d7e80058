"""SGLang's LoRA adapter routes: ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors`` (from 0.5.8),
``/unload_lora_adapter``, and the project's ``/wsync/lora_checksum`` and ``/wsync/load_lora_adapter_from_distributed``
(an adapter broadcast on a weight-update group, :mod:`inference_adapter.lora_distributed`).

Answers are SGLang's ``LoRAUpdateOutput``: ``{"success", "error_message", "loaded_adapters": {name: path}}``,
400 with ``success: false`` for a refusal (SGLang's words where SGLang refuses the same thing), plus the project's
``wsync_lora_version`` on a load. Building an adapter (reading a directory, unpickling, checking every tensor)
runs on a worker thread and publishes nothing until it is complete (:mod:`inference_adapter.lora`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from bridge.digest import tensor_checksum
from inference_adapter.errors import RequestError
from inference_adapter.lora import adapter_from_dir, build_adapter
from inference_adapter.lora_distributed import receive_adapter
from inference_adapter.model_state import ModelState
from inference_adapter.routes.bodies import LoraDistributedBody, LoraPathBody, LoraTensorsBody, LoraUnloadBody
from inference_adapter.routes.common import Served, absent, parse
from inference_adapter.tensor_payload import PayloadRefused, adapter_tensors

__all__ = ["router"]

router = APIRouter()


def _answer(state: ModelState, fn) -> JSONResponse:
    try:
        loaded, extra = fn()
    except RequestError as e:
        state.log.warning("LoRA: %s", e.message)
        body = {"success": False, "error_message": e.message, "loaded_adapters": None}
        if e.reason:
            body["wsync_reason"] = e.reason
        return JSONResponse(body, status_code=e.status)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": loaded, **extra})


def _publish(state: ModelState, req, config: dict, tensors: dict, path: str, check=None):
    """Build the adapter, then publish it. ``check()``: what must pass first (the checksums, computed meanwhile);
    its refusal is the answer even when the build fails too, as SGLang checks checksums before anything."""
    try:
        a = build_adapter(state.adapters, req.lora_name, config, tensors, version=req.wsync_lora_version, path=path,
                          pinned=req.pinned, run_id=req.run.run_id)
    except RequestError:
        if check is not None:
            check()
        raise
    if check is not None:
        check()
    # One writer at a time (inference_adapter.writers), checked as the adapter is published: 409 another_writer.
    state.updates.writers.check(req.run.writer, f"Failed to load LoRA adapter {a.name}")
    loaded = state.adapters.load(a, replace=req.wsync_replace, run=req.run,
                                 allow_rollback=state.updates.allow_version_rollback)
    state.log.info("LoRA adapter %s loaded (rank %d, %d modules, version %s, from %s)", a.name, a.rank,
                   len(a.modules), a.version, path)
    return loaded, {"wsync_lora_version": a.version}


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, state: Served):
    req = await parse(request, LoraPathBody)

    def load():
        state.adapters.require_enabled()
        config, tensors = adapter_from_dir(req.lora_path, req.lora_name, state.disk_roots)
        return _publish(state, req, config, tensors, req.lora_path)

    return await run_in_threadpool(_answer, state, load)


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: Request, state: Served):
    if not state.features.lora_from_tensors:
        return absent()
    req = await parse(request, LoraTensorsBody)

    def load():
        state.adapters.require_enabled()
        entries = req.serialized_named_tensors if req.serialized_named_tensors is not None else [req.serialized_tensors]
        try:
            if len(entries) != 1:
                raise PayloadRefused(f"serialized_named_tensors has {len(entries)} entries; this server has 1 TP "
                                     "rank, so send exactly 1")
            tensors = adapter_tensors(entries[0], req.load_format)
        except PayloadRefused as e:
            raise RequestError(f"LoRA adapter {req.lora_name}: {e}", reason=e.reason) from None
        expected = req.expected_checksums
        if expected is None:
            return _publish(state, req, req.config_dict, tensors, "__tensor__")
        pending = _checksums_meanwhile(tensors)  # while the adapter is built and checked
        return _publish(state, req, req.config_dict, tensors, "__tensor__",
                        check=lambda: _check_expected(expected, tensors, {n: c for f in pending for n, c in f.result().items()}))

    return await run_in_threadpool(_answer, state, load)


DISTRIBUTED_PATH = "__distributed__"
"""The path ``loaded_adapters`` lists for an adapter received over a group (SGLang lists ``__tensor__`` for tensors)."""


@router.post("/wsync/load_lora_adapter_from_distributed")
async def load_lora_adapter_from_distributed(request: Request, state: Served):
    """The adapter broadcast on ``group_name`` (received into a buffer of the server's own, which its tensors stay
    views of), checked against ``expected_checksums`` and built as ``/load_lora_adapter_from_tensors`` builds one."""
    req = await parse(request, LoraDistributedBody)

    def load():
        tensors = receive_adapter(state.updates, state.adapters, lora_name=req.lora_name, group_name=req.group_name,
                                  names=req.names, dtypes=req.dtypes, shapes=req.shapes)
        expected = req.expected_checksums
        if expected is None:
            return _publish(state, req, req.config_dict, tensors, DISTRIBUTED_PATH)
        pending = _checksums_meanwhile(tensors)  # while the adapter is built and checked
        return _publish(state, req, req.config_dict, tensors, DISTRIBUTED_PATH,
                        check=lambda: _check_expected(expected, tensors, {n: c for f in pending for n, c in f.result().items()}))

    return await run_in_threadpool(_answer, state, load)


_CHECKSUM_THREADS = 2
_checksum_pool = ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="wsync-lora-checksums")


def _checksums_meanwhile(tensors: dict) -> list:
    """sha256 of every tensor on :data:`_CHECKSUM_THREADS` threads (hashlib leaves the GIL), half the bytes each:
    futures of ``{name: sha256}``."""
    names = list(tensors)
    total = sum(tensors[n].nbytes for n in names) or 1
    parts, acc, cut = [[]], 0, total / _CHECKSUM_THREADS
    for n in names:
        if acc >= cut * len(parts) and len(parts) < _CHECKSUM_THREADS:
            parts.append([])
        parts[-1].append(n)
        acc += tensors[n].nbytes
    return [_checksum_pool.submit(lambda part=part: {n: tensor_checksum(tensors[n]) for n in part}) for part in parts]


def _check_expected(expected: dict[str, str] | None, tensors: dict, got: dict[str, str] | None = None) -> None:
    """SGLang 0.5.23's ``expected_checksums`` check (sha256 of each tensor's bytes), in its words. ``got``: the
    checksums already computed."""
    if expected is None:
        return
    got = got if got is not None else {n: tensor_checksum(t) for n, t in tensors.items()}
    missing = [n for n in expected if n not in tensors]
    mismatch = [n for n, want in expected.items() if n in tensors and got[n] != want]
    extra = [n for n in tensors if n not in expected]
    if mismatch or missing or extra:
        raise RequestError(f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected: {len(mismatch)} "
                           f"value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, {len(extra)} extra "
                           f"{extra[:5]}")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, state: Served):
    req = await parse(request, LoraUnloadBody)

    def unload():
        state.adapters.require_enabled()
        state.updates.writers.check(req.run.writer, f"Failed to unload LoRA adapter {req.lora_name}")
        return state.adapters.unload(req.lora_name), {}

    return await run_in_threadpool(_answer, state, unload)


class _ChecksumBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


@router.post("/wsync/lora_checksum")
async def lora_checksum(request: Request, state: Served):
    """``{"lora_name"}`` -> ``{"lora_name", "wsync_lora_version", "checksums": {tensor: sha256}, "dtypes"}`` of the
    adapter served under that name (:func:`bridge.digest.tensor_checksum` of each tensor, as it was sent)."""
    req = await parse(request, _ChecksumBody)
    return await run_in_threadpool(state.adapters.checksums, req.lora_name)
