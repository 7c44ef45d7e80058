"""The reference server: SGLang's HTTP protocol on CPU with a transformers model.

``python -m inference_adapter.server --preset tiny --port 30000`` serves a causal LM and speaks SGLang's
native API -- ``/generate``, ``/model_info``, ``/server_info``, the weight-update routes -- and its
OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` with SGLang's request and response shapes, as the SGLang version given by ``--protocol-version`` does (0.5.23 by
default; ``0.5.2`` behaves like an old server: no sessions, no flattened buckets, no destroy route, no
``/server_info``/``/model_info`` (only the ``/get_*`` names), and request fields that version's structs lack
are dropped as SGLang's parsing drops them).
Unlike SGLang, every weight update is atomic: staged, validated, then swapped, and a failed update
leaves the previous weights and version serving (see :mod:`inference_adapter.weight_updates`).

Routes beyond SGLang's (project extensions, safe to ignore):
    ``/wsync/weights_checksum`` (GET or POST ``{"names": [...] | null}``): sha256 of every served
    tensor's bytes (:func:`bridge.digest.tensor_checksum`) and the weight version, read under one
    lock, so a trainer checks a sync bit for bit without pulling the weights back.
    ``/update_weights_from_tensor`` with ``load_format="wsync_shm"``: SGLang's route, but CPU tensors cannot
    cross HTTP (SGLang issue #4551), so each ``serialized_named_tensors`` entry is base64 of the JSON object
    ``{"path": "/dev/shm/...", "nbytes": N, "names": [...], "dtypes": [...], "shapes": [...]}`` naming a
    same-host file that holds one flattened bucket (never a pickle; other load formats answer 400).
    ``/wsync/abort_weight_update`` (POST): discard the open update session without applying anything.
    ``/wsync/writer_lease`` (POST ``{"wsync_writer", "wsync_run_id", "lease_s", "release", ...}``) and field
    ``wsync_writer`` on every weight-changing request: one writer at a time (:mod:`inference_adapter.writers`);
    while a writer holds the lease, weight changes from anyone else answer 409 with
    ``wsync_reason: another_writer``, naming the holder's run and writer. A publisher's first and last
    steps of a sync each take one request: ``/pause_generation`` with ``wsync_lease_s`` (take the lease
    first) and ``wsync_begin_session`` (then open the update session), ``/continue_generation`` with
    ``wsync_release_lease`` (let go of it once resumed).
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

Refused beyond SGLang (each a 400 naming what was wrong): disk paths outside ``--disk-root``, snapshot files
(any the manifest lists) that are not regular files inside the snapshot, NaN/Inf weights, version labels answers could not carry, bodies nested deeper than 32 levels or
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
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import Request

from bridge.local.presets import PRESETS
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL

# SGLang marks its control routes ADMIN_OPTIONAL (srt/utils/auth.py); the client sends the admin key on the same set.
from bridge.protocol import ADMIN_ROUTES

__all__ = ["ADMIN_ROUTES", "add_server_arguments", "build_parser", "create_app", "main", "run"]

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
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="serve the projections as block FP8 (e4m3, 128x128 scales, bridge/codecs/fp8.py): updates must send them "
                        "as FP8 with their _scale_inv (a publisher's encoding='fp8'); default: the --dtype weights")
    p.add_argument("--fp8-skip", action="append", default=None, metavar="REGEX",
                   help="with --quantization fp8: a module-name pattern to keep in --dtype (repeat; the publisher's fp8_skip)")
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
                        "resolved first). Default: wsync's default snapshot root (<temp>/wsync_<user>/snapshots, where `wsync train` "
                        "writes) and the served model's directory; any other snapshot root must be named here")
    p.add_argument("--allow-version-rollback", action="store_true",
                   help="accept a weight version older than the served one without a new run (SGLang's behaviour); "
                        "by default that needs wsync_new_run=true or a new wsync_run_id on the request")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but /health*")
    p.add_argument("--admin-api-key", default=None, help="control routes (weight updates, pause, flush) accept only this key")
    p.add_argument("--served-model-name", default=None, help="name reported on /model_info (default: the model path)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice / OMP_NUM_THREADS)")
    p.add_argument("--enable-metrics", action="store_true",
                   help="answer /metrics in Prometheus' format, as SGLang's flag does: requests and tokens under SGLang's "
                        "names, the served weight version, paused, torn (inference_adapter/metrics.py)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default INFO)")
    lo = p.add_argument_group("LoRA", "serve PEFT LoRA adapters by name (SGLang's flags; docs/lora.md)")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters: /load_lora_adapter, "
                    "/load_lora_adapter_from_tensors, /unload_lora_adapter, /wsync/load_lora_adapter_from_distributed, and "
                    "lora_path in /generate")
    lo.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank loaded (default 64; "
                    "SGLang needs it given when no --lora-paths are)")
    lo.add_argument("--max-loaded-loras", type=int, default=None, help="adapters loaded at once; beyond it the least "
                    "recently used unpinned one is unloaded, as SGLang does (default: no limit)")
    lo.add_argument("--max-loras-per-batch", type=int, default=8, help="accepted for SGLang's command lines; the "
                    "reference server runs any number of adapters side by side")
    lo.add_argument("--lora-paths", nargs="+", default=None, metavar="NAME=DIR", help="PEFT adapter directories to "
                    "serve from the start: NAME=DIR, DIR (named by itself) or {\"lora_name\", \"lora_path\", \"pinned\"}; "
                    "implies --enable-lora")
    lo.add_argument("--lora-target-modules", nargs="+", default=None, metavar="NAME", help="module-name suffixes an "
                    "adapter may adapt (q_proj, ...; 'all' or none given: every Linear)")
    g = p.add_argument_group("registration", "be found by publishers (PublisherConfig(server_registry=URL), wsync train "
                                             "--server-registry URL)")
    g.add_argument("--wait-for-weights", action="store_true",
                   help="answer no generation (503, wsync_reason waiting_for_weights; a router retries it elsewhere) "
                        "until a publish or `wsync watch` has given this server a version: for a server that joins or "
                        "restarts in a fleet, which would otherwise answer on its base weights until then")
    g.add_argument("--register", metavar="URL", help="while this server answers, keep an entry for it in this registry "
                   "(etcd://host:port or file:///dir) under wsync/<experiment>/<trial>/servers/<host:port>; deleted on a "
                   "clean exit, gone within --register-ttl after a crash")
    g.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help=f"the experiment whose publisher this server serves (default {DEFAULT_EXPERIMENT})")
    g.add_argument("--trial", default=DEFAULT_TRIAL, help=f"the trial whose publisher this server serves (default {DEFAULT_TRIAL})")
    g.add_argument("--register-ttl", type=float, default=10.0, help="seconds the entry outlives this server (at most 30; "
                   "default 10)")
    g.add_argument("--advertise-url", metavar="URL", help="the URL publishers reach this server at (default: "
                   "http://<host>:<port>, with this host's name for 0.0.0.0)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m inference_adapter.server",
        description="Reference server: speaks SGLang's HTTP weight-update protocol on CPU with a transformers model, "
                    "and applies every weight update atomically.",
    )
    return add_server_arguments(p)


def create_app(state, *, api_key: str | None = None, admin_api_key: str | None = None, server_args: dict | None = None):
    """The FastAPI app around a :class:`~inference_adapter.model_state.ModelState`: its routes, by concern
    (:mod:`inference_adapter.routes`), the bench's route, SGLang's auth, and refusals as SGLang answers them."""
    import anyio
    from fastapi import FastAPI

    from inference_adapter.bench_routes import register_bench_routes
    from inference_adapter.errors import RequestError
    from inference_adapter.routes import ROUTERS

    @asynccontextmanager
    async def lifespan(_app):
        yield
        state.close()

    app = FastAPI(title="wsync reference server", lifespan=lifespan)
    app.state.served = state
    app.state.server_args = dict(server_args or {})
    app.state.started = time.time()
    # Generations (which wait out a pause in their thread) get threads of their own, so however many are
    # waiting, the control routes' threads (anyio's default pool) stay free: a paused server must still
    # answer /begin_weight_update and /continue_generation at once.
    app.state.generation_threads = anyio.CapacityLimiter(GENERATION_THREADS)
    app.middleware("http")(_auth(api_key, admin_api_key))
    app.add_exception_handler(RequestError, _refused)
    for router in ROUTERS:
        app.include_router(router)
    register_bench_routes(app, state)
    if app.state.server_args.get("enable_metrics"):
        _metrics_route(app, state)
    return app


def _metrics_route(app, state) -> None:
    """``GET /metrics`` (``--enable-metrics``; without it the route does not exist, as in SGLang)."""
    from fastapi.responses import Response

    from inference_adapter.metrics import CONTENT_TYPE_LATEST, server_metrics

    @app.get("/metrics")
    def metrics():
        return Response(server_metrics(state), media_type=CONTENT_TYPE_LATEST)


def _auth(api_key: str | None, admin_api_key: str | None):
    """SGLang's auth middleware: every route but the health probes needs ``api_key``; with
    ``admin_api_key``, the control routes (:data:`ADMIN_ROUTES`) need that one instead."""
    from fastapi.responses import JSONResponse

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

    return auth


async def _refused(request: Request, e):
    """A :class:`~inference_adapter.errors.RequestError` as SGLang answers a refusal: OpenAI's error shape on
    ``/generate`` and SGLang's ``ErrorResponse`` on ``/v1/*``, ``{"success": false, "message"}`` (with the
    project's ``wsync_reason``, which the first two carry beside it too) elsewhere."""
    from fastapi.responses import JSONResponse

    request.app.state.served.log.warning("%s -> %d: %s", request.url.path, e.status, e.message)
    extra = {"wsync_reason": e.reason} if e.reason else {}
    if request.url.path == "/generate":
        return JSONResponse({"error": {"message": e.message, "type": "BadRequest", "code": e.status}, **extra},
                            status_code=e.status)
    if request.url.path.startswith("/v1/"):
        return JSONResponse({"object": "error", "message": e.message, "type": "BadRequest", "param": None,
                             "code": e.status, **extra}, status_code=e.status)
    return JSONResponse({"success": False, "message": e.message, **extra}, status_code=e.status)


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted (SIGINT/SIGTERM)."""
    import torch
    import uvicorn

    from bridge.fleet import answers_health
    from bridge.log import setup_logging
    from bridge.protocol import ProtocolFeatures
    from inference_adapter.model_state import ModelState, load_model

    setup_logging(args.log_level)
    ProtocolFeatures.from_version(args.protocol_version)  # fail fast on a bad version string
    registration = _registration(args)  # a bad registry URL fails now, before the model loads
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    model, tok, model_path, tok_path = load_model(model=args.model, preset=args.preset, seed=args.seed,
                                                  dtype=getattr(torch, args.dtype))
    if args.quantization == "fp8":
        from bridge.codecs.fp8 import Fp8Rule
        from inference_adapter.fp8 import quantize_module

        quantize_module(model, Fp8Rule(tuple(args.fp8_skip or ())))
    state = ModelState(model, tok, model_path=model_path, tokenizer_path=tok_path, weight_version=args.weight_version,
                       protocol_version=args.protocol_version, group_timeout=args.group_timeout,
                       served_model_name=args.served_model_name, receive_timeout=args.receive_timeout,
                       disk_roots=args.disk_roots, allow_version_rollback=args.allow_version_rollback,
                       quantization=args.quantization, lora=_lora_args(args), wait_for_weights=args.wait_for_weights)
    _preload_adapters(state, args)
    n = sum(p.numel() for p in model.parameters())
    state.log.info("loaded %s (%s, %.2f M params, %s) in %.1f s", model_path, type(model).__name__, n / 1e6, args.dtype,
                   time.perf_counter() - t0)
    server_args = {k: v for k, v in vars(args).items() if k not in ("api_key", "admin_api_key")}
    app = create_app(state, api_key=args.api_key, admin_api_key=args.admin_api_key, server_args=server_args)
    state.log.info("serving on http://%s:%d", args.host, args.port)
    stop, follower = threading.Event(), None
    if registration is not None:  # registered once it answers /health, removed when it stops answering
        local = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        follower = threading.Thread(target=registration.follow, args=(stop,), name="wsync-register", daemon=True,
                                    kwargs=dict(interval=1.0, alive=lambda: answers_health(local)))
        follower.start()
        # uvicorn raises SIGTERM again once it has shut down: end by SystemExit instead, so that the entry
        # is deleted below (a clean exit) rather than left to run out.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level.lower(),
                    access_log=False, timeout_graceful_shutdown=5)
    finally:
        stop.set()  # a clean exit deletes the entry at once
        if follower is not None:
            follower.join(5.0)
    return 0


def _lora_args(args: argparse.Namespace) -> dict:
    """:class:`inference_adapter.lora.ServedAdapters`' settings from the LoRA flags."""
    from bridge.errors import ConfigError

    if args.max_lora_rank < 1 or (args.max_loaded_loras is not None and args.max_loaded_loras < 1):
        raise ConfigError("--max-lora-rank and --max-loaded-loras must be at least 1")
    return dict(enabled=args.enable_lora or bool(args.lora_paths), max_rank=args.max_lora_rank,
                max_loaded=args.max_loaded_loras, target_modules=args.lora_target_modules)


def _preload_adapters(state, args: argparse.Namespace) -> None:
    """``--lora-paths``: served before the first request; ConfigError naming the one that does not load."""
    from bridge.errors import ConfigError
    from inference_adapter.errors import RequestError
    from inference_adapter.lora import parse_lora_paths, preload

    if not args.lora_paths:
        return
    try:
        preload(state.adapters, parse_lora_paths(args.lora_paths))
    except (ValueError, RequestError) as e:
        raise ConfigError(f"--lora-paths: {getattr(e, 'message', e)}") from None
    state.log.info("serving LoRA adapters %s", state.adapters.names())


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def _registration(args: argparse.Namespace):
    """The :class:`bridge.fleet.Registration` that ``--register`` asks for, or None."""
    if not args.register:
        return None
    from bridge.fleet import Registration

    url = args.advertise_url
    if url is None:
        host = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host if ':' not in host else f'[{host}]'}:{args.port}"
    return Registration(args.register, url, args.experiment, args.trial, ttl=args.register_ttl)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference_adapter.server [flags]``; ``--help`` lists the flags."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
