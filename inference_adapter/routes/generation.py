"""Generation routes: ``/generate`` (single or batched, optionally streamed), pause/continue, ``/abort_request``,
and SGLang's memory routes (``/release_memory_occupation``, ``/resume_memory_occupation``).

Generations run on the app's own thread limiter (``app.state.generation_threads``), not on the
threads of the control routes, so any number of them waiting out a pause never delays a control route.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from bridge.protocol import AbortReq, GenerateReq, MemoryOccupationReq, SamplingParams, describe_validation_error
from inference_adapter.errors import RequestError
from inference_adapter.model_state import ModelState
from inference_adapter.routes.bodies import ContinueBody, PauseBody
from inference_adapter.routes.common import Served, absent, parse

__all__ = ["router"]

router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, state: Served):
    req = await parse(request, GenerateReq)
    prompts, batched = _prompts(state, req)
    params, logprobs, rids = _per_prompt(req, len(prompts), batched)
    adapters = _adapters(state, req, len(prompts))
    limiter = request.app.state.generation_threads
    if req.stream:
        for p, sp in zip(prompts, params):
            state.check_sampling(p, sp)  # refused before the stream starts, as SGLang validates first
        return StreamingResponse(_stream(state, limiter, prompts, params, logprobs, rids, adapters, batched),
                                 media_type="text/event-stream")
    outs = await asyncio.gather(*[
        anyio.to_thread.run_sync(functools.partial(state.generate, p, sp, bool(lp), rid, adapter=a), limiter=limiter)
        for p, sp, lp, rid, a in zip(prompts, params, logprobs, rids, adapters)
    ])
    return JSONResponse(list(outs) if batched else outs[0])


async def _stream(state: ModelState, limiter, prompts, params, logprobs, rids, adapters, batched: bool):
    """``/generate``'s event stream, as SGLang's: a chunk per token as it comes, each the whole answer so far (its
    text and ``output_ids``, ``meta_info`` with ``finish_reason`` null), the last one the finished answer; a batch's
    chunks interleave, each with its prompt's ``index``; then ``data: [DONE]``."""
    loop, q = asyncio.get_running_loop(), asyncio.Queue()
    rids = [rid or uuid.uuid4().hex for rid in rids]

    async def run(i: int) -> None:
        ids: list[int] = []

        def watch(text: str, finished: bool, tok: int) -> None:
            ids.append(tok)
            if not finished:  # the finishing token comes with the result
                meta = {"id": rids[i], "finish_reason": None, "prompt_tokens": len(prompts[i]),
                        "weight_version": state.version, "completion_tokens": len(ids)}
                loop.call_soon_threadsafe(q.put_nowait, (i, {"text": text, "output_ids": list(ids), "meta_info": meta}))
        try:
            out = await anyio.to_thread.run_sync(functools.partial(
                state.generate, prompts[i], params[i], bool(logprobs[i]), rids[i], watch=watch, adapter=adapters[i]),
                limiter=limiter)
        except Exception as e:  # (checked before the stream started; a generation's own failure ends it)
            out = {"error": {"message": str(e), "type": "BadRequest", "code": 400}}
        q.put_nowait((i, out))
        q.put_nowait((i, None))

    tasks = [asyncio.create_task(run(i)) for i in range(len(prompts))]
    try:
        left = len(prompts)
        while left:
            i, chunk = await q.get()
            if chunk is None:
                left -= 1
                continue
            yield f"data: {json.dumps({**chunk, 'index': i} if batched else chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


def _prompts(state: ModelState, req: GenerateReq) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the request was batched."""
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("/generate needs exactly one of 'text' or 'input_ids'")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        ids = [state.tokenizer(t)["input_ids"] for t in texts]
        return ids, isinstance(req.text, list)
    if req.input_ids and isinstance(req.input_ids[0], list):
        return [list(x) for x in req.input_ids], True
    return [list(req.input_ids)], False


def _adapters(state: ModelState, req: GenerateReq, n: int) -> list:
    """The LoRA adapter each prompt runs with (None: the base model), taken now: a generation computes with the
    adapter its request found, to its end, even if that name is replaced or unloaded meanwhile."""
    names = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path] * n
    if len(names) != n:
        raise RequestError(f"lora_path list length ({len(names)}) must match batch size ({n})")
    return [None if name is None else state.adapters.acquire(name) for name in names]


def _per_prompt(req: GenerateReq, n: int, batched: bool) -> tuple[list[SamplingParams], list, list]:
    """Sampling parameters, ``return_logprob`` and ``rid`` for each of ``n`` prompts (a single value applies to all)."""
    sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params or {}] * n
    lps = req.return_logprob if isinstance(req.return_logprob, list) else [bool(req.return_logprob)] * n
    rids = req.rid if isinstance(req.rid, list) else [req.rid if not batched else None] * n
    if not len(sps) == len(lps) == len(rids) == n:
        raise RequestError(f"batched /generate: {n} prompts but {len(sps)} sampling_params, {len(lps)} "
                           f"return_logprob and {len(rids)} rid entries")
    try:
        return [SamplingParams.model_validate(sp) for sp in sps], lps, rids
    except ValidationError as e:
        raise RequestError(describe_validation_error("/generate sampling_params", e)) from None


@router.post("/pause_generation")
async def pause_generation(request: Request, state: Served):
    if state.features.release < (0, 4, 9):
        return absent()
    req = await parse(request, PauseBody)
    if req.wsync_lease_s is not None:  # as /wsync/writer_lease would, before anything is paused
        await run_in_threadpool(state.updates.take_lease, req.run.writer, req.run.run_id, float(req.wsync_lease_s),
                                True)
    was_paused = state.is_paused()
    if not state.pause_if_idle(req.mode):
        await run_in_threadpool(state.pause, req.mode)
    out = {"message": "Generation paused successfully.", "status": "ok"}
    if req.wsync_begin_session and state.features.needs_session:  # as /begin_weight_update would, once paused
        try:
            out["session"] = await run_in_threadpool(state.updates.begin_session, req.run)
        except BaseException:
            if not was_paused:  # refused: as if nothing was asked (the writer's lease, if taken, stays); a server
                state.resume()  # paused before (out of rotation, say) stays paused
            raise
    return out


@router.post("/continue_generation")
async def continue_generation(request: Request, state: Served):
    if state.features.release < (0, 4, 9):
        return absent()
    req = await parse(request, ContinueBody)
    state.updates.writer_continues()
    state.resume()
    out = {"message": "Generation continued successfully.", "status": "ok"}
    if req.wsync_release_lease:  # after the resume, as a separate /wsync/writer_lease release would come
        out["writer_lease"] = await run_in_threadpool(state.updates.release_lease, req.wsync_writer)
    return out


@router.post("/abort_request")
async def abort_request(request: Request, state: Served):
    req = await parse(request, AbortReq)
    state.abort_request(req.rid, req.abort_all)
    return Response(status_code=200)


def _tags(req: MemoryOccupationReq) -> list[str] | None:
    from inference_adapter.generation import MEMORY_TAGS

    unknown = [t for t in req.tags or () if t not in MEMORY_TAGS]
    if unknown:
        raise RequestError(f"tags {unknown[:5]} are not memory tags; send some of {list(MEMORY_TAGS)}, or none for all")
    return req.tags


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, state: Served):
    state.release_memory(_tags(await parse(request, MemoryOccupationReq)))
    return JSONResponse(None)


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, state: Served):
    state.resume_memory(_tags(await parse(request, MemoryOccupationReq)))
    return JSONResponse(None)
