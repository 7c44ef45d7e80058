"""The reference server: SGLang's HTTP protocol on CPU with a transformers model.

``python -m inference_adapter.server --preset tiny --port 30000`` serves a causal LM and speaks SGLang's
native API -- ``/generate``, ``/model_info``, ``/server_info``, the weight-update routes -- with SGLang's
request and response shapes, as the SGLang version given by ``--protocol-version`` does (0.5.23 by
default; ``0.5.2`` behaves like an old server: no sessions, no flattened buckets, no destroy route, no
``/server_info``/``/model_info`` (only the ``/get_*`` names), and request fields that version's structs lack
are dropped as SGLang's parsing drops them).
Unlike SGLang, every weight update is atomic: staged, validated, then swapped, and a failed update
leaves the previous weights and version serving (see :mod:`inference_adapter.model_state`).

Routes beyond SGLang's (project extensions, safe to ignore):
    ``/wsync/weights_checksum`` (GET or POST ``{"names": [...] | null}``): sha256 of every served
    tensor's bytes (:func:`bridge.protocol.tensor_checksum`) and the weight version, read under one
    lock, so a trainer checks a sync bit for bit without pulling the weights back.
    ``/update_weights_from_tensor`` with ``load_format="wsync_shm"``: SGLang's route, but CPU tensors cannot
    cross HTTP (SGLang issue #4551), so each ``serialized_named_tensors`` entry is base64 of the JSON object
    ``{"path": "/dev/shm/...", "nbytes": N, "names": [...], "dtypes": [...], "shapes": [...]}`` naming a
    same-host file that holds one flattened bucket (never a pickle; other load formats answer 400).
    ``/wsync/abort_weight_update`` (POST): discard the open update session without applying anything.
    The ``wsync_shm`` descriptor may carry ``"pid"``: the trainer's rank-0 process id; if it dies, the open
    session is discarded and the pause lifted within ~1-2 s.
    Fields ``wsync_run_id`` (str) and ``wsync_new_run`` (bool) on ``/begin_weight_update``, the update
    routes and ``/update_weight_version``: without a new run (a run id other than the served run's, or
    ``wsync_new_run=true``) a version older than the served one is refused; ``--allow-version-rollback``
    turns that off. Real SGLang ignores these fields.
    ``/get_server_info`` (and ``/server_info``) add ``wsync_reference_server: true`` and
    ``wsync_disk_roots`` (the resolved directories disk loads may come from), so that clients can tell
    this server from SGLang and a disk publisher can refuse a snapshot root it would not load.
    Field ``wsync_manifest_sha256`` on ``/update_weights_from_disk``: the announced manifest digest; a
    snapshot is verified against it in the pass that reads it, and a failed check answers 400 with
    ``wsync_reason: snapshot_invalid`` (the disk watcher then falls back to an older announced version).

Refused beyond SGLang (each a 400 naming what was wrong): disk paths outside ``--disk-root``, non-regular
files, NaN/Inf weights, version labels answers could not carry, bodies nested deeper than 32 levels or
with NaN literals or lone surrogates. A broadcast bigger than announced is a 400, not a crash, and a
broadcast whose bytes never come gives up after ``--receive-timeout`` plus its size at 50 MB/s.

Auth follows SGLang: ``--api-key`` protects every route but ``/health*``; with ``--admin-api-key`` the
control routes (weight updates, pause, flush, debug reads) accept only the admin key.

Blocking work (generation, rendezvous, broadcasts, disk reads) runs in worker threads, so
``/model_info`` answers while a broadcast is being received; generations have threads of their own, so
any number of them waiting out a pause never delays a control route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import sys
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request

from bridge.presets import PRESETS

__all__ = ["ADMIN_ROUTES", "add_server_arguments", "build_parser", "create_app", "main", "run"]

# SGLang marks its control routes ADMIN_OPTIONAL (srt/utils/auth.py); the client sends the admin key on the same set.
from bridge.protocol import ADMIN_ROUTES  # noqa: E402


GENERATION_THREADS = 256
"""Generations computing or waiting at once; more queue (without a thread) until one ends."""


def add_server_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags (also used by ``wsync serve``)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="local Hugging Face model directory to serve (config, safetensors, tokenizer)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="serve a locally built model of this preset instead (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --preset model's initial weights (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000, SGLang's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype the weights are served in; distributed updates must send exactly this dtype (default bfloat16)")
    p.add_argument("--weight-version", default="default", help="initial weight version reported on /model_info and every generation (default 'default')")
    p.add_argument("--protocol-version", default="0.5.23",
                   help="SGLang version whose HTTP protocol to emulate, e.g. 0.5.23, 0.5.10.post1, 0.5.2 (default 0.5.23)")
    p.add_argument("--group-timeout", type=float, default=120.0,
                   help="seconds a weight-update group waits for its rendezvous and for each broadcast (default 120)")
    p.add_argument("--receive-timeout", type=float, default=10.0,
                   help="seconds a broadcast may take beyond its size at 50 MB/s before the server gives up on it and "
                        "drops the group (default 10; never more than --group-timeout)")
    p.add_argument("--disk-root", action="append", default=None, metavar="DIR", dest="disk_roots",
                   help="a directory /update_weights_from_disk may load from (repeat for several; symlinks are "
                        "resolved first). Default: wsync's default snapshot root (<temp>/wsync-snapshots, where `wsync train` "
                        "writes) and the served model's directory; any other snapshot root must be named here")
    p.add_argument("--allow-version-rollback", action="store_true",
                   help="accept a weight version older than the served one without a new run (SGLang's behaviour); "
                        "by default that needs wsync_new_run=true or a new wsync_run_id on the request")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but /health*")
    p.add_argument("--admin-api-key", default=None, help="control routes (weight updates, pause, flush) accept only this key")
    p.add_argument("--served-model-name", default=None, help="name reported on /model_info (default: the model path)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice / OMP_NUM_THREADS)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default INFO)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m inference_adapter.server",
        description="Reference server: speaks SGLang's HTTP weight-update protocol on CPU with a transformers model, "
                    "and applies every weight update atomically.",
    )
    return add_server_arguments(p)


def create_app(state, *, api_key: str | None = None, admin_api_key: str | None = None, server_args: dict | None = None):
    """The FastAPI app around a :class:`~inference_adapter.model_state.ModelState`."""
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from pydantic import BaseModel, ValidationError
    from starlette.concurrency import run_in_threadpool

    from bridge.protocol import (
        BeginWeightUpdateReq, ContinueGenerationReq, DestroyWeightsUpdateGroupReq, GenerateReq, GetWeightsByNameReq,
        InitWeightsUpdateGroupReq, PauseGenerationReq, SamplingParams, UpdateWeightFromDiskReq, UpdateWeightsFromDistributedReq,
        UpdateWeightsFromTensorReq, UpdateWeightVersionReq, WeightsChecksumReq, describe_validation_error,
    )
    from inference_adapter.errors import RequestError, json_object
    from inference_adapter.weight_updates import RunClaim

    f = state.features
    args = dict(server_args or {})
    started = time.time()
    # Generations (which wait out a pause in their thread) get threads of their own, so however many are
    # waiting, the control routes' threads (anyio's default pool) stay free: a paused server must still
    # answer /begin_weight_update and /continue_generation at once.
    generation_threads = anyio.CapacityLimiter(GENERATION_THREADS)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        state.close()

    app = FastAPI(title="wsync reference server", lifespan=lifespan)
    not_found = lambda: JSONResponse({"detail": "Not Found"}, status_code=404)  # noqa: E731 - a route this version lacks

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        if path.startswith(("/health", "/ready", "/metrics")) or request.method == "OPTIONS":
            return await call_next(request)
        key = admin_api_key if path in ADMIN_ROUTES and admin_api_key else api_key
        if key:
            got = request.headers.get("authorization", "")
            scheme, _, token = got.partition(" ")
            if not (scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError):
        state.log.warning("%s -> %d: %s", request.url.path, e.status, e.message)
        if request.url.path == "/generate":
            return JSONResponse({"error": {"message": e.message, "type": "BadRequest", "code": e.status}}, status_code=e.status)
        extra = {"wsync_reason": e.reason} if e.reason else {}
        return JSONResponse({"success": False, "message": e.message, **extra}, status_code=e.status)

    async def body(request: Request, model: type[BaseModel], route: str, convert=None) -> Any:
        data = json_object(await request.body(), route)
        if convert is not None:
            data = convert(data)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise RequestError(describe_validation_error(route, e)) from None

    async def run_claim(request: Request) -> RunClaim:
        # The project's wsync_run_id / wsync_new_run fields; the request models ignore unknown keys.
        return RunClaim.from_body(json_object(await request.body(), request.url.path))

    def ok(message: str, **extra) -> JSONResponse:
        return JSONResponse({"success": True, "message": message, **extra})

    # ------------------------------------------------------------------ info

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        return Response(status_code=200) if f.release >= (0, 5, 20) else not_found()

    # /model_info and /server_info exist from 0.5.6; the /get_* names exist in every emulated version.
    @app.get("/get_model_info")
    async def get_model_info():
        return state.model_info()

    @app.get("/model_info")
    async def model_info():
        return state.model_info() if f.info_routes else not_found()

    @app.get("/server_info")
    async def server_info():
        return await get_server_info() if f.info_routes else not_found()

    @app.get("/get_server_info")
    async def get_server_info():
        return {
            **args, "version": f.version, "tp_size": 1, "dp_size": 1, "pp_size": 1, "model_path": state.model_path,
            "tokenizer_path": state.tokenizer_path, "served_model_name": state.served_model_name,
            "weight_version": state.version, "dtype": str(state.dtype).removeprefix("torch."),
            "context_length": state.context_length, "startup_time": started, "wsync_reference_server": True,
            "wsync_disk_roots": state.disk_roots, "internal_states": [state.internal_state()],
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.served_model_name, "object": "model", "owned_by": "sglang",
                                            "root": state.model_path}]}

    @app.get("/get_weight_version")
    async def get_weight_version():
        if f.get_weight_version_route:
            return {"weight_version": state.version}
        return not_found()  # before 0.5.1, and from 0.5.8 (SGLang answers 404 "deprecated")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # No KV cache is kept between requests, so there is never anything to flush.
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        req = await body(request, GetWeightsByNameReq, "/get_weights_by_name")
        out = await run_in_threadpool(state.get_weights_by_name, req.name, req.truncate_size)
        if out is None:
            raise RequestError(f"Get parameter by name failed: {req.name!r} is not a parameter of the served model")
        return JSONResponse(out)

    @app.api_route("/wsync/weights_checksum", methods=["GET", "POST"])
    async def weights_checksum(request: Request):
        req = await body(request, WeightsChecksumReq, "/wsync/weights_checksum")
        return await run_in_threadpool(state.checksums, req.names)

    # ------------------------------------------------------------------ generation

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        req = await body(request, GenerateReq, "/generate")
        prompts, batched = _prompts(state, req)
        n = len(prompts)
        sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params or {}] * n
        lps = req.return_logprob if isinstance(req.return_logprob, list) else [bool(req.return_logprob)] * n
        rids = req.rid if isinstance(req.rid, list) else [req.rid if not batched else None] * n
        if not len(sps) == len(lps) == len(rids) == n:
            raise RequestError(f"batched /generate: {n} prompts but {len(sps)} sampling_params, {len(lps)} "
                               f"return_logprob and {len(rids)} rid entries")
        try:
            params = [SamplingParams.model_validate(sp) for sp in sps]
        except ValidationError as e:
            raise RequestError(describe_validation_error("/generate sampling_params", e)) from None
        outs = await asyncio.gather(*[
            anyio.to_thread.run_sync(state.generate, p, sp, bool(lp), rid, limiter=generation_threads)
            for p, sp, lp, rid in zip(prompts, params, lps, rids)
        ])
        result = list(outs) if batched else outs[0]
        if req.stream:
            async def events():
                for o in (result if batched else [result]):
                    yield f"data: {json.dumps(o)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(result)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        if f.release < (0, 4, 9):
            return not_found()
        # Before 0.5.6 SGLang's route reads no body: a mode (even a bad one) is ignored and it pauses (aborting).
        req = await body(request, PauseGenerationReq, "/pause_generation",
                         None if f.pause_mode else lambda d: {k: v for k, v in d.items() if k != "mode"})
        await run_in_threadpool(state.pause, req.mode if f.pause_mode else "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        if f.release < (0, 4, 9):
            return not_found()
        await body(request, ContinueGenerationReq, "/continue_generation")
        state.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ------------------------------------------------------------------ weight updates

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        req = await body(request, InitWeightsUpdateGroupReq, "/init_weights_update_group")
        msg = await run_in_threadpool(
            lambda: state.init_group(master_address=req.master_address, master_port=req.master_port,
                                     rank_offset=req.rank_offset, world_size=req.world_size,
                                     group_name=req.group_name, backend=req.backend)
        )
        return ok(msg)

    def single_to_batched(data: dict) -> dict:
        # SGLang <= 0.4.8 took one tensor per request.
        if not f.batched_distributed and "name" in data:
            data = {**data, "names": [data.get("name")], "dtypes": [data.get("dtype")], "shapes": [data.get("shape")]}
        return drop_unknown_fields(data)

    def drop_unknown_fields(data: dict) -> dict:
        # A field the emulated version's request struct lacks is dropped, as SGLang's parsing drops it:
        # load_format (flattened buckets) from 0.5.6, weight_version from 0.5.1.
        gone = ([] if f.flattened_bucket else ["load_format"]) + ([] if f.weight_version else ["weight_version"])
        return {k: v for k, v in data.items() if k not in gone} if any(k in data for k in gone) else data

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        req = await body(request, UpdateWeightsFromDistributedReq, "/update_weights_from_distributed", single_to_batched)
        run = await run_claim(request)
        msg = await run_in_threadpool(
            lambda: state.update_distributed(
                names=req.names, dtypes=req.dtypes, shapes=req.shapes, group_name=req.group_name,
                load_format=req.load_format, weight_version=req.weight_version,
                abort_all_requests=req.abort_all_requests, run=run,
            )
        )
        return ok(msg)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        req = await body(request, UpdateWeightsFromTensorReq, "/update_weights_from_tensor", drop_unknown_fields)
        run = await run_claim(request)
        msg = await run_in_threadpool(
            lambda: state.update_tensor(
                serialized_named_tensors=req.serialized_named_tensors, load_format=req.load_format,
                weight_version=req.weight_version, abort_all_requests=req.abort_all_requests, run=run,
            )
        )
        return ok(msg)

    @app.post("/wsync/abort_weight_update")
    async def abort_weight_update(request: Request):
        return ok(await run_in_threadpool(state.abort_session))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        if not f.destroy_group:
            return not_found()
        req = await body(request, DestroyWeightsUpdateGroupReq, "/destroy_weights_update_group")
        return ok(await run_in_threadpool(state.destroy_group, req.group_name))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = await body(request, UpdateWeightFromDiskReq, "/update_weights_from_disk", drop_unknown_fields)
        run = await run_claim(request)
        sha = json_object(await request.body(), request.url.path).get("wsync_manifest_sha256")
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise RequestError(f"wsync_manifest_sha256 must be the announced manifest's sha256 (64 lowercase hex "
                               f"digits), got {sha!r}")
        msg = await run_in_threadpool(
            lambda: state.update_disk(model_path=req.model_path, weight_version=req.weight_version,
                                      abort_all_requests=req.abort_all_requests, run=run, manifest_sha256=sha)
        )
        return ok(msg, num_paused_requests=0)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        if not f.needs_session:
            return not_found()
        await body(request, BeginWeightUpdateReq, "/begin_weight_update")
        return ok(await run_in_threadpool(state.begin_session, await run_claim(request)))

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        if not f.needs_session:
            return not_found()
        return ok(await run_in_threadpool(state.end_session))

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        if not f.weight_version:
            return not_found()
        req = await body(request, UpdateWeightVersionReq, "/update_weight_version")
        await run_in_threadpool(state.set_version, req.new_version, req.abort_all_requests, await run_claim(request))
        return ok(f"Weight version updated to {req.new_version}", new_version=req.new_version)

    from inference_adapter.bench_routes import register_bench_routes

    register_bench_routes(app, state)
    return app


def _prompts(state, req) -> tuple[list[list[int]], bool]:
    from inference_adapter.model_state import RequestError

    if (req.text is None) == (req.input_ids is None):
        raise RequestError("/generate needs exactly one of 'text' or 'input_ids'")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        ids = [state.tokenizer(t)["input_ids"] for t in texts]
        return ids, isinstance(req.text, list)
    if req.input_ids and isinstance(req.input_ids[0], list):
        return [list(x) for x in req.input_ids], True
    return [list(req.input_ids)], False


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted (SIGINT/SIGTERM)."""
    import torch
    import uvicorn

    from bridge.log import setup_logging
    from bridge.protocol import ProtocolFeatures
    from inference_adapter.model_state import ModelState, load_model

    setup_logging(args.log_level)
    ProtocolFeatures.from_version(args.protocol_version)  # fail fast on a bad version string
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    model, tok, model_path, tok_path = load_model(model=args.model, preset=args.preset, seed=args.seed,
                                                  dtype=getattr(torch, args.dtype))
    state = ModelState(model, tok, model_path=model_path, tokenizer_path=tok_path, weight_version=args.weight_version,
                       protocol_version=args.protocol_version, group_timeout=args.group_timeout,
                       served_model_name=args.served_model_name, receive_timeout=args.receive_timeout,
                       disk_roots=args.disk_roots, allow_version_rollback=args.allow_version_rollback)
    n = sum(p.numel() for p in model.parameters())
    state.log.info("loaded %s (%s, %.2f M params, %s) in %.1f s", model_path, type(model).__name__, n / 1e6, args.dtype,
                   time.perf_counter() - t0)
    server_args = {k: v for k, v in vars(args).items() if k not in ("api_key", "admin_api_key")}
    app = create_app(state, api_key=args.api_key, admin_api_key=args.admin_api_key, server_args=server_args)
    state.log.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level.lower(),
                access_log=False, timeout_graceful_shutdown=5)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference_adapter.server [flags]``; ``--help`` lists the flags."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
