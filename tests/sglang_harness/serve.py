"""A receiving server built from SGLang's own code, on CPU, served over real HTTP.

``python -m tests.sglang_harness.serve --sglang-dir DIR --model MODEL_DIR --port N`` (see ``__init__``).

Composition, top to bottom (SGLang's code unless marked STUB):

* HTTP: ``sglang.srt.entrypoints.http_server.app`` itself -- its routes, request parsing and validation,
  status codes and response bodies -- with SGLang's own API-key middleware (``add_api_key_middleware``),
  served by uvicorn (SGLang's lifespan hook is skipped: it starts OpenAI-compatible serving classes).
* Tokenizer side: an instance of SGLang's ``TokenizerManager`` class whose ``__init__`` is skipped; its
  weight-update methods (``init_weights_update_group``, ``update_weights_from_distributed``,
  ``update_weights_from_disk``, ``begin/end_weight_update``, ``pause_generation``, ``update_weight_version``,
  ...), its reader/writer ``model_update_lock`` and pause condition, and SGLang's communicator classes run
  as they are. STUB: the ZMQ sockets -- a request object goes to a one-thread executor that plays the
  scheduler process, and its reply object is handed back on the event loop, as SGLang's handle loop would;
  config look-ups (``config_value``/``record_config_updates``) read and write a dict; ``abort_request``.
* Scheduler side: SGLang's ``Scheduler`` handlers (0.4.x-0.5.x mixins) or, from 0.5.16-ish,
  ``SchedulerWeightUpdaterManager`` (session gate, flush after update, version recording), with
  ``TpModelWorker``'s forwarding methods. A handler that raises (SGLang's ``assert flush_cache_success``)
  kills this process, as it kills a real server. STUB: ``flush_cache`` answers False while generations
  are in flight (SGLang's radix-cache check), True otherwise; internal state; version bookkeeping that
  0.5.23 keeps in its runtime context.
* Model runner: SGLang's weight-receiving code -- ``ModelRunner.init_weights_update_group`` /
  ``update_weights_from_distributed`` / ``update_weights_from_disk`` (older releases) or the
  ``WeightUpdater`` component (newer), so ``init_custom_process_group``, the per-tensor and
  ``FlattenedTensorBucket`` receives and the disk loader are SGLang's. STUB: the model is a transformers
  causal LM (no CUDA kernels here) given a ``load_weights`` that assigns each named tensor with SGLang's
  ``default_weight_loader`` (Qwen2's own loader additionally stacks q/k/v; the HF layout has no stacking).
* Generation (``/generate``): STUB -- greedy decoding with the transformers model inside SGLang's
  reader lock and pause condition, so that in-flight requests, pausing and locking behave as in SGLang.
* ``/wsync_harness/weights`` (GET, harness only): sha256 of every served tensor, to check bit-equality.

Prints ``HARNESS READY <url>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import traceback
import types


def _parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--sglang-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument("--weight-version", default="default")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.sglang_harness.bootstrap import setup

    rel = setup(args.sglang_dir)
    if rel < (0, 5, 10):
        _accept_pg_options()
    logging.basicConfig(level=logging.INFO, format="[harness %(asctime)s] %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # SGLang asserts a default process group exists; a gloo group of one, on a port of its own.
    from bridge.process_group import find_free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    h = Harness(args, rel)
    h.serve()
    return 0


def _accept_pg_options() -> None:
    """SGLang before 0.5.10 picks the keyword with ``str(torch.__version__) >= "2.6"``, a string comparison
    that is False for torch 2.10+ (it was True for the torch each release pinned); it then passes
    ``pg_options``, which torch renamed ``backend_options`` in 2.6. Map the old name to the new one so
    SGLang's ``init_custom_process_group`` runs as it did with its own torch."""
    import torch.distributed.distributed_c10d as c10d

    orig = c10d._new_process_group_helper

    def helper(*a, pg_options=None, **k):
        if "backend_options" not in k:
            k["backend_options"] = pg_options
        return orig(*a, **k)

    c10d._new_process_group_helper = helper


class _Done:
    """What a stubbed ``socket.send`` returns: awaitable (async callers) and ignorable (sync callers)."""

    def __await__(self):
        return iter(())


class Harness:
    def __init__(self, args, rel):
        import torch
        import transformers

        self.args, self.rel = args, rel
        self.dtype = getattr(torch, args.dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=self.dtype).eval()
        self.model.load_weights = self._load_weights  # what SGLang's model classes provide
        self.inflight = 0
        self.inflight_lock = threading.Lock()
        self.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-scheduler")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._build()

    # ------------------------------------------------------------------ model glue (STUB)

    def _load_weights(self, weights):
        import torch
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        params = dict(self.model.named_parameters())
        names = []
        for name, w in weights:
            p = params.get(name)
            if p is None:
                if name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
                    continue  # SGLang's Qwen2 loader skips the tied head too
                logging.getLogger("harness").warning("skipping unknown parameter %s", name)  # as Qwen2's loader
                continue
            with torch.no_grad():
                default_weight_loader(p, w)
            names.append(name)
        return set(names)

    def checksums(self) -> dict:
        out = {}
        for name, p in self.model.state_dict().items():
            t = p.detach().contiguous().cpu()
            out[name] = hashlib.sha256(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()
        return out

    # ------------------------------------------------------------------ composition

    def _build(self):
        from sglang.srt.managers import io_struct

        self.io = io_struct
        self.server_args = self._server_args()
        try:
            from sglang.srt import runtime_context
        except ImportError:
            runtime_context = None
        self.runtime_context = runtime_context if hasattr(runtime_context, "publish") else None
        if self.runtime_context is not None:
            # 0.5.2x keeps its config (weight version included) in a process-wide runtime context: SGLang's own.
            self.runtime_context.publish(self.server_args, role="scheduler")
            if self.args.weight_version != "default":
                self.runtime_context.get_context().override("scheduler.weight_version", weight_version=self.args.weight_version)
        import sglang.srt.server_args as sa_mod

        if hasattr(sa_mod, "set_global_server_args_for_scheduler"):  # 0.5.x before the runtime context
            sa_mod.set_global_server_args_for_scheduler(self.server_args)
        self._build_model_runner()
        self._build_scheduler()
        self._build_tokenizer_manager()

    def _model_config(self):
        from sglang.srt.configs.model_config import ModelConfig

        try:
            return ModelConfig(self.args.model, dtype=self.args.dtype)
        except Exception as e:  # noqa: BLE001 - the disk route reports it
            logging.getLogger("harness").warning("ModelConfig unavailable (%s); disk loads will fail", e)
            return types.SimpleNamespace(model_path=self.args.model, dtype=self.dtype, revision=None)

    def _build_model_runner(self):
        import torch

        model = self.model
        self.model_config = self._model_config()
        try:
            from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        except ImportError:
            WeightUpdater = None
        if WeightUpdater is not None:
            self.weight_updater = WeightUpdater(
                tp_rank=0, device="cpu", gpu_id=0, model_config=self.model_config, custom_weight_loaders={},
                get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                recapture_cuda_graph=lambda: None, get_model_runner=lambda: self.model_runner,
            )
            self.model_runner = types.SimpleNamespace(model=model, weight_updater=self.weight_updater, device="cpu")
            return
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_executor.model_runner import ModelRunner

        mr = object.__new__(ModelRunner)
        mr.model, mr.device, mr.gpu_id, mr.tp_rank, mr.tp_size = model, "cpu", 0, 0, 1
        mr._model_update_group = {}
        mr.model_config = self.model_config
        mr.load_config = LoadConfig(load_format="auto")
        mr.server_args = self.server_args
        mr.is_draft_worker = False
        self.model_runner = mr
        del torch

    def _server_args(self):
        from sglang.srt.server_args import ServerArgs

        if not dataclasses.is_dataclass(ServerArgs):  # 0.5.23: a plain record, resolved on demand
            sa = ServerArgs(model_path=self.args.model, device="cpu", dtype=self.args.dtype)
            sa.api_key = self.args.api_key
            sa.admin_api_key = self.args.admin_api_key
            return sa
        sa = object.__new__(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            if f.default is not dataclasses.MISSING:
                v = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                v = f.default_factory()  # type: ignore[misc]
            else:
                v = None
            setattr(sa, f.name, v)
        sa.model_path = sa.tokenizer_path = self.args.model
        sa.dtype, sa.device, sa.tp_size, sa.dp_size = self.args.dtype, "cpu", 1, 1
        sa.api_key = self.args.api_key
        if hasattr(sa, "admin_api_key"):
            sa.admin_api_key = self.args.admin_api_key
        if hasattr(sa, "weight_version"):
            sa.weight_version = self.args.weight_version
        sa.load_format = "auto"
        if hasattr(sa, "custom_weight_loader") and sa.custom_weight_loader is None:
            sa.custom_weight_loader = []  # as ServerArgs.__post_init__ (skipped here) normalizes it
        return sa

    def _flush_cache(self, *a, **k) -> bool:
        # STUB of Scheduler.flush_cache: SGLang refuses to flush while requests run or wait.
        with self.inflight_lock:
            return self.inflight == 0

    def _build_scheduler(self):
        io = self.io
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.tp_worker import TpModelWorker

        tw = object.__new__(TpModelWorker)
        for attr in ("model_runner", "_model_runner", "worker"):
            try:
                setattr(tw, attr, self.model_runner)
            except AttributeError:
                pass
        tw.tp_rank = 0  # before 0.5.23 the worker picks its own tensor entry by this
        self.tp_worker = tw

        sched = object.__new__(Scheduler)
        sched.tp_worker = tw
        sched.draft_worker = None
        sched.flush_cache = self._flush_cache
        sched.tp_cpu_group = None
        sched._engine_paused = False
        sched._pause_started_at = None
        sched._pause_intervals = []
        sched.enable_overlap = False
        sched.last_batch = None
        sched.server_args = self.server_args
        self.scheduler = sched
        handlers = {}
        try:
            from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        except ImportError:
            SchedulerWeightUpdaterManager = None
        if SchedulerWeightUpdaterManager is not None:
            import sglang.srt.managers.scheduler_components.weight_updater as wu_mod

            import sglang.srt.managers.tp_worker as tw_mod
            import sglang.srt.model_executor.model_runner_components.weight_updater as mr_wu_mod

            # STUB: the parallel topology (one TP rank; SGLang's barriers on a group of one are no-ops), where the
            # scheduler's updater, the worker (each rank deserializes its own tensor entry) and the runner read it.
            parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None), tp_rank=0)
            for mod in (wu_mod, tw_mod, mr_wu_mod):
                mod.get_parallel = lambda: parallel
            sched.waiting_queue, sched.chunked_req, sched.hisparse_coordinator = [], None, None
            sched.collect_inflight_reqs = lambda: set()
            wu = SchedulerWeightUpdaterManager(
                tp_worker=tw, draft_worker=None, memory_saver_adapter=None, flush_cache=self._flush_cache,
                is_fully_idle=lambda **k: self.inflight == 0, scheduler=sched,
            )
            sched.weight_updater = wu
            for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                         "update_weights_from_tensor", "update_weights_from_disk", "begin_weight_update",
                         "end_weight_update", "get_weights_by_name"):
                handlers[name] = getattr(wu, name)
            handlers["update_weight_version"] = sched.handle_update_weight_version
        else:
            for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                         "update_weights_from_tensor", "update_weights_from_disk", "get_weights_by_name"):
                if hasattr(sched, name):
                    handlers[name] = getattr(sched, name)
            if hasattr(io, "UpdateWeightVersionReqInput"):
                handlers["update_weight_version"] = lambda req: self._record_version(req.new_version)
        handlers["pause_generation"] = self._sched_pause
        handlers["continue_generation"] = self._sched_continue
        handlers["get_internal_state"] = self._internal_state
        handlers["flush_cache"] = lambda req: io.FlushCacheReqOutput(success=self._flush_cache())
        table = {}
        names = {
            "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
            "destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
            "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
            "update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
            "update_weights_from_disk": "UpdateWeightFromDiskReqInput",
            "begin_weight_update": "BeginWeightUpdateReqInput",
            "end_weight_update": "EndWeightUpdateReqInput",
            "get_weights_by_name": "GetWeightsByNameReqInput",
            "update_weight_version": "UpdateWeightVersionReqInput",
            "pause_generation": "PauseGenerationReqInput",
            "continue_generation": "ContinueGenerationReqInput",
            "get_internal_state": "GetInternalStateReq",
            "flush_cache": "FlushCacheReqInput",
        }
        for key, cls_name in names.items():
            cls = getattr(io, cls_name, None)
            if cls is not None and key in handlers:
                table[cls] = handlers[key]
        self.handlers = table

    def _record_version(self, new_version):
        # Older releases keep the version in the tokenizer manager's server_args (set there by SGLang's code).
        return self._output("UpdateWeightVersionReqOutput")

    def current_version(self) -> str:
        if self.runtime_context is not None:
            return str(self.runtime_context.get_context().config_leaf("weight_version"))
        return str(getattr(self.tm.server_args, "weight_version", None))

    def _output(self, cls_name, **kw):
        cls = getattr(self.io, cls_name, None)
        if cls is None:
            return None
        try:
            return cls(**kw)
        except TypeError:
            return cls()

    def _sched_pause(self, req):
        self.scheduler._engine_paused = True
        return None

    def _sched_continue(self, req):
        self.scheduler._engine_paused = False
        return None

    def _internal_state(self, req):
        return self.io.GetInternalStateReqOutput(internal_state={"harness": True})

    # ------------------------------------------------------------------ the scheduler "process"

    def dispatch(self, obj, reply):
        """Run ``obj``'s scheduler handler in the scheduler thread; ``reply(output)`` on the event loop."""

        def run():
            handler = None
            for cls, fn in self.handlers.items():
                if type(obj) is cls:
                    handler = fn
                    break
            if handler is None:
                logging.getLogger("harness").warning("no scheduler handler for %s", type(obj).__name__)
                return
            try:
                out = handler(obj)
            except BaseException:  # noqa: BLE001 - an uncaught scheduler exception ends SGLang's server
                traceback.print_exc()
                sys.stderr.write("HARNESS SCHEDULER DIED\n")
                sys.stderr.flush()
                os._exit(70)
            if out is not None and reply is not None:
                self.loop.call_soon_threadsafe(reply, out)

        self.executor.submit(run)

    def _build_tokenizer_manager(self):
        from sglang.srt.managers import tokenizer_manager as tm_mod
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        harness = self
        tm = object.__new__(TokenizerManager)
        tm.server_args = self.server_args
        tm.model_path = tm.served_model_name = self.args.model
        tm.is_generation = True
        tm.mm_processor = None
        tm.tokenizer_ipc_name = None
        tm.elastic_worker_count = 1
        tm.enable_metrics = False
        tm.model_config = types.SimpleNamespace(is_image_understandable_model=False, is_audio_understandable_model=False,
                                                is_multimodal=False, context_len=2048, hf_config=self.model.config)
        tm.rid_to_state = {}
        tm.gracefully_exit = False
        tm.startup_time = 0.0
        RWLock = tm_mod.RWLock  # SGLang's asyncio reader/writer lock, as its TokenizerManager imports it

        tm.model_update_lock = RWLock()
        tm.is_pause = False
        tm.is_pause_cond = asyncio.Condition()
        tm._cond = asyncio.Condition()  # 0.4.x pause condition
        tm._updating = False

        class FakeSocket:
            def __init__(self, reply):
                self.reply = reply

            def send_pyobj(self, obj, *a, **k):
                harness.dispatch(obj, self.reply)
                return _Done()

            def send(self, data, *a, **k):
                from sglang.srt.managers.io_struct import msgpack_decode

                return self.send_pyobj(msgpack_decode(data))

        def disk_reply(out):
            handler = getattr(tm, "_handle_update_weights_from_disk_req_output", None)
            if handler is not None and hasattr(tm, "model_update_expected_workers"):
                handler(out)
            else:
                tm.model_update_result.set_result(out)

        tm.send_to_scheduler = FakeSocket(disk_reply)
        tm._dispatch_to_scheduler = lambda obj: harness.dispatch(obj, disk_reply)

        async def _async_dispatch(obj):
            harness.dispatch(obj, None)

        tm._async_dispatch_to_scheduler = _async_dispatch
        tm.auto_create_handle_loop = lambda: None
        tm.abort_request = lambda *a, **k: None
        tm.get_internal_state = self._tm_internal_state
        tm.is_ready = lambda: True
        tm.generate_request = self._generate
        # Communicators: SGLang's own classes, one per control call, each with a reply path of its own.
        comm_cls = getattr(tm_mod, "_Communicator", None)
        fan_out_cls = None
        try:
            from sglang.srt.managers.tokenizer_communicator_mixin import _Communicator as comm_cls  # noqa: F811
        except ImportError:
            pass
        try:
            from sglang.srt.managers.communicator import FanOutCommunicator as fan_out_cls
        except ImportError:
            pass
        for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                     "update_weights_from_tensor", "get_weights_by_name", "update_weight_version", "flush_cache",
                     "begin_weight_update", "end_weight_update", "get_internal_state"):
            holder = {}

            def reply(out, holder=holder):
                holder["comm"].handle_recv(out)

            if fan_out_cls is not None:
                comm = fan_out_cls(lambda obj, reply=reply: harness.dispatch(obj, reply), 1, "queueing")
            else:
                comm = comm_cls(FakeSocket(reply), 1)
            holder["comm"] = comm
            setattr(tm, f"{name}_communicator", comm)
        if hasattr(tm_mod, "get_parallel"):
            tm_mod.get_parallel = lambda: types.SimpleNamespace(dp_size=1, num_dp_ranks=1, tp_size=1, tp_rank=0)
        for mod_name in ("sglang.srt.managers.tokenizer_control_mixin",):
            mod = sys.modules.get(mod_name)
            if mod is not None and hasattr(mod, "get_parallel"):
                mod.get_parallel = tm_mod.get_parallel
        self.tm = tm

    async def _tm_internal_state(self):
        return [{"harness": True}]

    # ------------------------------------------------------------------ generation (STUB)

    async def _generate(self, obj, request=None):
        """Greedy decoding inside SGLang's reader lock, waiting while paused as SGLang's tokenizer does."""
        import torch

        tm = self.tm
        cond = tm.is_pause_cond if self.rel >= (0, 5, 0) else tm._cond
        paused = (lambda: tm.is_pause) if self.rel >= (0, 5, 0) else (lambda: tm._updating)
        async with cond:
            await cond.wait_for(lambda: not paused())
        async with tm.model_update_lock.reader_lock:
            with self.inflight_lock:
                self.inflight += 1
            try:
                ids = obj.input_ids if obj.input_ids is not None else None
                if ids is None:
                    raise ValueError("the harness generates from input_ids only")
                sp = obj.sampling_params or {}
                n = int(sp.get("max_new_tokens", 8))
                # keep the request in flight (tests of pausing); custom_params passes SGLang's validation
                hold = float((sp.get("custom_params") or {}).get("harness_hold_s", 0.0))
                version = self.current_version()

                def run():
                    with torch.no_grad():
                        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                                  min_new_tokens=n, pad_token_id=0)
                    return out[0, len(ids):].tolist()

                out_ids = await asyncio.get_running_loop().run_in_executor(None, run)
                if hold:
                    await asyncio.sleep(hold)
                yield {"text": "", "output_ids": out_ids,
                       "meta_info": {"id": "harness", "finish_reason": {"type": "length", "length": n},
                                     "prompt_tokens": len(ids), "completion_tokens": n, "weight_version": version}}
            finally:
                with self.inflight_lock:
                    self.inflight -= 1

    # ------------------------------------------------------------------ HTTP

    def serve(self):
        import uvicorn
        from fastapi.responses import JSONResponse
        from sglang.srt.entrypoints import http_server

        app = http_server.app
        gs_cls = http_server._GlobalState
        kwargs = {"tokenizer_manager": self.tm, "scheduler_info": {"max_total_num_tokens": 4096}}
        if "template_manager" in getattr(gs_cls, "__dataclass_fields__", {}) or "template_manager" in gs_cls.__init__.__code__.co_varnames:
            kwargs["template_manager"] = None
        http_server.set_global_state(gs_cls(**kwargs))

        @app.get("/wsync_harness/weights")
        async def harness_weights():
            return JSONResponse({"weight_version": self.current_version(), "checksums": self.checksums()})

        if self.args.api_key or self.args.admin_api_key:
            self._add_auth(app)
        harness = self

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                harness.loop = asyncio.get_running_loop()
                await super().startup(sockets)
                print(f"HARNESS READY http://127.0.0.1:{harness.args.port}", flush=True)

        config = uvicorn.Config(app, host="127.0.0.1", port=self.args.port, lifespan="off", log_level="warning",
                                timeout_keep_alive=30)
        Server(config).run()

    def _add_auth(self, app):
        import inspect

        try:
            from sglang.srt.utils.auth import add_api_key_middleware
        except ImportError:
            from sglang.srt.utils import add_api_key_middleware
        params = inspect.signature(add_api_key_middleware).parameters
        if "admin_api_key" in params:
            add_api_key_middleware(app, api_key=self.args.api_key, admin_api_key=self.args.admin_api_key)
        else:
            add_api_key_middleware(app, self.args.api_key)


if __name__ == "__main__":
    sys.exit(main())
