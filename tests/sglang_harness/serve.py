"""A receiving server built from SGLang's own code, on CPU, served over real HTTP.

``python -m tests.sglang_harness.serve --sglang-dir DIR --model MODEL_DIR --port N`` (see ``__init__``).

Composition, top to bottom. Everything is SGLang's own code except what is marked STUB, and this list of
STUBs is complete:

* Imports (:mod:`tests.sglang_harness.bootstrap`): STUB -- inert stand-ins for ``torchvision``, ``sgl_kernel`` and
  ``vllm`` (importable; any use raises, so a kernel call fails loudly), shims for names today's torch and triton
  dropped, and, before 0.5.10, torch's renamed ``pg_options`` keyword mapped for ``init_custom_process_group``.
* HTTP: ``sglang.srt.entrypoints.http_server.app`` itself -- its routes, request parsing and validation,
  status codes and response bodies -- with SGLang's own API-key middleware (``add_api_key_middleware``),
  served by uvicorn. STUB: SGLang's lifespan hook is skipped (it starts OpenAI-compatible serving classes);
  the app's global state holds a fixed ``scheduler_info`` and no template manager.
* Configuration: SGLang's ``ServerArgs`` with its defaults (STUB: on the dataclass releases ``__post_init__`` is
  skipped and the two normalizations it makes that the code here reads -- ``page_size``, ``custom_weight_loader``
  -- are made by hand), published as SGLang does (runtime context on 0.5.2x, global server args before);
  SGLang's ``ModelConfig`` (STUB: a bare record where it cannot be built, then disk loads fail).
* Tokenizer side: an instance of SGLang's ``TokenizerManager`` class (STUB: ``__init__`` skipped, the attributes
  it would set assigned directly); its weight-update methods (``init_weights_update_group``,
  ``update_weights_from_distributed``/``_tensor``/``_disk``, ``begin/end_weight_update``,
  ``pause_generation``/``continue_generation``, ``abort_request``, ``update_weight_version``, ...), its
  reader/writer ``model_update_lock`` and pause condition, and SGLang's communicator classes run as they are.
  STUB: the ZMQ sockets -- a request object goes to a one-thread executor that plays the scheduler process,
  and its reply object is handed back on the event loop, as SGLang's handle loop would (so
  ``auto_create_handle_loop`` does nothing); ``get_internal_state`` and ``is_ready``.
* Scheduler side: an instance of SGLang's ``Scheduler`` (STUB: ``__init__`` skipped) whose own handlers run:
  the weight-update handlers (0.4.x-0.5.x mixins) or ``SchedulerWeightUpdaterManager`` (session gate, flush
  after update, version recording), ``pause_generation`` (``in_place``/``retract``, 0.5.x),
  ``continue_generation``, ``abort_request``, ``flush_cache`` (with its ``is_fully_idle`` / ``_is_no_request``
  check; 0.5.2x through its ``SchedulerFlushWrapper``), and ``TpModelWorker``'s forwarding methods. They read
  SGLang's own state objects: a ``ScheduleBatch`` running batch, the waiting queue, a ``ReqToTokenPool``, a
  ``TokenToKVPoolAllocator`` and a ``RadixCache``. A handler that raises (SGLang's ``assert
  flush_cache_success``) kills this process, as it kills a real server. STUB: the scheduler's event loop
  (requests are handled one at a time in the executor; a deferred flush is re-checked after each); request
  intake, prefill and decode: a ``/generate`` request is an SGLang ``Req`` in the running batch holding a
  request slot and KV slots from SGLang's pools but no KV data, and leaves whichever queue holds it when its
  generation ends; the managers that hold no request here (grammar, dLLM, beam search, multimodal receiver)
  are empty, the metrics and KV-event reporters and the socket to the tokenizer do nothing (an abort of a
  queued request is seen by the generation from the queues); ``get_internal_state``; for releases whose
  scheduler has no ``UpdateWeightVersionReqInput`` handler, a bare answer (their version lives in the
  tokenizer's server args, set by SGLang's own route).
* Parallel topology: SGLang's own ``parallel_state`` holds one TP rank on a gloo world of one (the TP group
  the stacked linear layers are built for). STUB: the ``get_parallel()`` accessor that 0.5.2x's tokenizer,
  worker, runner and scheduler read, and 0.5.20-0.5.21's scheduler-held copy (one TP rank, one PP rank; SGLang's
  barriers on a group of one are no-ops).
* Model runner: SGLang's weight-receiving code -- ``ModelRunner.init_weights_update_group`` /
  ``update_weights_from_distributed`` / ``_tensor`` / ``_disk`` (older releases; STUB: ``__init__`` skipped) or
  the ``WeightUpdater`` component (newer; STUB: its CUDA-graph and model-field callbacks do nothing), so
  ``init_custom_process_group``, the per-tensor and ``FlattenedTensorBucket`` receives and the disk loader are
  SGLang's.
* Model: SGLang's ``Qwen2ForCausalLM`` (or ``LlamaForCausalLM`` for a Llama directory; STUB: ``__init__``
  skipped, the ``stacked_params_mapping`` it sets assigned) whose own ``load_weights`` loads every
  tensor (also the checkpoint at start), through its ``stacked_params_mapping``: q/k/v into SGLang's
  ``QKVParallelLinear`` (``qkv_proj``) and gate/up into SGLang's ``MergedColumnParallelLinear``
  (``gate_up_proj``), the rest with ``default_weight_loader``. STUB: its other modules (embedding, norms,
  ``o_proj``, ``down_proj``) are a transformers model's, and so is the forward pass. ``/get_weights_by_name``
  runs SGLang's route, tokenizer, scheduler, worker and runner (0.5.2x: ``WeightExporter``) code into the
  model's own ``get_weights_by_name``: Llama's answers, Qwen2 has none (SGLang answers 400, as it does).
* Generation (``/generate``): STUB -- greedy decoding with that transformers model (whose q/k/v/gate/up
  weights are views into SGLang's stacked tensors, so it computes with what SGLang loaded), inside SGLang's
  reader lock and pause condition; the request stays in SGLang's running batch while its
  ``custom_params.harness_hold_s`` lasts and while the scheduler is paused, and ends early, with SGLang's
  abort finish reason, once SGLang's ``abort_request`` marked it.
* LoRA (0.5.23, and 0.5.8 with ``--enable-lora``): :mod:`tests.sglang_harness.lora_serve` lists what of SGLang's adapter code
  runs (routes, tokenizer manager, registry and counters, scheduler, worker, runner, ``LoRAManager``) and its
  STUBs (the manager's ``__init__``, its GPU memory pool and LoRA layers, generation computing with the base
  model, the per-request release, ``/wsync_harness/lora``).
* ``/wsync_harness/release_holds`` (POST, harness only): the ``harness_hold_s`` of every generation begun before it
  is over (a paused scheduler still holds them).
* ``/wsync_harness/weights`` and ``/wsync_harness/scheduler`` (GET, harness only): sha256 of every served
  tensor under SGLang's names (see :func:`sglang_layout`), and the running/waiting counts and paused flag
  of SGLang's scheduler state.

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
    p.add_argument("--custom-weight-loader", action="append", default=[],
                   help="SGLang's --custom-weight-loader (dotted path of a loader; repeat for several)")
    p.add_argument("--device", default="cpu", help="the model runner's device (cuda: the CUDA IPC receive check)")
    # SGLang's LoRA flags (0.5.23; tests/sglang_harness/lora_serve.py)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--lora-target-modules", nargs="*",
                   default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    p.add_argument("--max-loaded-loras", type=int, default=None)
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

    # (Not the HTTP port: it is free until the server binds it, and the kernel once handed it out here again.)
    group_port = find_free_port(avoid=(args.port,))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=0, world_size=1)
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


_STACKED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def sglang_layout(named: dict) -> dict:
    """``{HF name: tensor}`` as SGLang's Qwen2 serves it: each layer's q/k/v concatenated (rows, in that order)
    as ``qkv_proj`` and gate/up as ``gate_up_proj``, weight and bias; a group with a part missing is left out.
    What the harness serves is compared with this, so a stacked tensor equals the trainer's slices."""
    import torch

    out, used = {}, set()
    for name in named:
        for stacked, parts in _STACKED:
            if f".{parts[0]}." in name:
                names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                if all(n in named for n in names):
                    out[name.replace(f".{parts[0]}.", f".{stacked}.")] = torch.cat([named[n] for n in names])
                used.update(names)
    out.update({n: t for n, t in named.items() if n not in used})
    return out


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
        self.hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=self.dtype).eval()
        self.hf_model.requires_grad_(False)  # as SGLang's layers make their parameters (SGLang's code calls .numpy())
        self.executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-scheduler")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.hold_epoch = 0  # /wsync_harness/release_holds: the holds of generations begun before it end
        self._build()

    # ------------------------------------------------------------------ model glue (STUB)

    def _served_model(self, hf):
        """SGLang's own ``Qwen2ForCausalLM`` (``__init__`` skipped) as the served model: its ``load_weights``
        (the ``stacked_params_mapping`` loop) loads every tensor, into SGLang's own ``QKVParallelLinear`` (q/k/v
        stacked as ``qkv_proj``) and ``MergedColumnParallelLinear`` (gate/up stacked as ``gate_up_proj``) on one TP
        rank; the other modules are the transformers model's. STUB: generation runs the transformers model, whose
        q/k/v/gate/up projections are views into SGLang's stacked tensors, so it uses what SGLang loaded."""
        import inspect

        import torch
        from torch import nn

        self._sglang_tp_group()
        import sglang.srt.models.llama as llama  # before the layers: the import order SGLang's loader has
        import sglang.srt.models.qwen2 as qwen2
        from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

        cfg = hf.config
        classes = {"qwen2": qwen2.Qwen2ForCausalLM, "llama": llama.LlamaForCausalLM}
        if cfg.model_type not in classes:
            raise ValueError(f"the harness serves Qwen2 and Llama models (SGLang's loaders), not {cfg.model_type}")
        served = object.__new__(classes[cfg.model_type])
        nn.Module.__init__(served)
        served.config, served.quant_config = cfg, None
        if cfg.model_type == "llama":  # as SGLang's LlamaForCausalLM.__init__ sets it (its get_weights_by_name reads it)
            served.stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                                             (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
                                             (".gate_up_proj", ".up_proj", 1)]
        served.pp_group = types.SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True)
        inner = nn.Module()
        inner.embed_tokens, inner.norm, inner.layers = hf.model.embed_tokens, hf.model.norm, nn.ModuleList()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # one TP rank, stated where the layer takes it (0.5.21 would read it from an unset runtime context)
        rank = {"tp_rank": 0, "tp_size": 1} if "tp_rank" in inspect.signature(QKVParallelLinear).parameters else {}
        for hl in hf.model.layers:
            layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
            attn.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads,
                                              cfg.num_key_value_heads, bias=hl.self_attn.q_proj.bias is not None,
                                              params_dtype=self.dtype, **rank)
            attn.o_proj = hl.self_attn.o_proj
            mlp.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False,
                                                          params_dtype=self.dtype, **rank)
            mlp.down_proj = hl.mlp.down_proj
            layer.self_attn, layer.mlp = attn, mlp
            layer.input_layernorm, layer.post_attention_layernorm = hl.input_layernorm, hl.post_attention_layernorm
            inner.layers.append(layer)
        served.model = inner
        if not getattr(cfg, "tie_word_embeddings", False):
            served.lm_head = hf.lm_head
        else:
            served.lm_head = inner.embed_tokens  # as SGLang's Qwen2 and Llama tie them
        with torch.no_grad():
            served.load_weights(list(hf.state_dict().items()))  # the checkpoint, through SGLang's loader
        for hl, layer in zip(hf.model.layers, inner.layers):
            qkv = [hl.self_attn.q_proj, hl.self_attn.k_proj, hl.self_attn.v_proj]
            self._view(layer.self_attn.qkv_proj, "weight", qkv)
            if hl.self_attn.q_proj.bias is not None:
                self._view(layer.self_attn.qkv_proj, "bias", qkv)
            self._view(layer.mlp.gate_up_proj, "weight", [hl.mlp.gate_proj, hl.mlp.up_proj])
        return served

    @staticmethod
    def _view(stacked, attr, parts) -> None:
        """Make each transformers projection's ``attr`` a view of its rows in SGLang's stacked tensor."""
        from torch import nn

        data, at = getattr(stacked, attr).data, 0
        for part in parts:
            n = getattr(part, attr).shape[0]
            setattr(part, attr, nn.Parameter(data[at:at + n], requires_grad=False))
            at += n
        assert at == data.shape[0]

    def _sglang_tp_group(self) -> None:
        """SGLang's own parallel state, one TP rank on the gloo world this process already has."""
        import inspect

        from sglang.srt.distributed import parallel_state as ps

        if getattr(ps, "_TP", None) is None:
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method="env://")
            if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
                ps.initialize_model_parallel(1)
            else:  # 0.5.2x reads the widths from its runtime context (published from the server args)
                ps.initialize_model_parallel()

    def checksums(self) -> dict:
        out = {}
        for name, p in self.model.named_parameters():  # SGLang's names: stacked, the tied head once
            t = p.detach().contiguous().cpu()
            out[name] = hashlib.sha256(t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()
        return out

    # ------------------------------------------------------------------ composition

    def _build(self):
        self._build_runtime()
        self.model = self._served_model(self.hf_model)
        self._build_model_runner()
        self._build_tp_worker()
        self._build_scheduler()
        self._build_tokenizer_manager()
        self.lora = None
        from tests.sglang_harness.lora_serve import LoraHarness, supported

        if self.args.enable_lora and not supported(self.rel):
            raise SystemExit("the harness serves LoRA on SGLang 0.5.8 and >= 0.5.23 only")
        if self.rel >= (0, 5, 23) or self.args.enable_lora:  # SGLang's LoRA state ("not enabled" without the flag)
            self.lora = LoraHarness(self)

    def _build_runtime(self):
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
            if self.rel < (0, 5, 22):  # 0.5.21's layers read this rank before any group is built: one rank here
                self.runtime_context.get_parallel().override_permanently(tp_rank=0)
            if self.args.weight_version != "default":
                self.runtime_context.get_context().override("scheduler.weight_version", weight_version=self.args.weight_version)
        import sglang.srt.server_args as sa_mod

        if hasattr(sa_mod, "set_global_server_args_for_scheduler"):  # 0.5.x before the runtime context
            sa_mod.set_global_server_args_for_scheduler(self.server_args)

    def _model_config(self):
        from sglang.srt.configs.model_config import ModelConfig

        try:
            return ModelConfig(self.args.model, dtype=self.args.dtype)
        except Exception as e:  # the disk route reports it
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
            # As SGLang's ModelRunner builds it: the loaders the server was started with (--custom-weight-loader).
            self.weight_updater = WeightUpdater(
                tp_rank=0, device=self.args.device, gpu_id=0, model_config=self.model_config,
                custom_weight_loaders=list(self.server_args.custom_weight_loader or []),
                get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                recapture_cuda_graph=lambda: None, get_model_runner=lambda: self.model_runner,
            )
            self.model_runner = types.SimpleNamespace(model=model, weight_updater=self.weight_updater,
                                                      device=self.args.device, weight_exporter=self._weight_exporter())
            return
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_executor.model_runner import ModelRunner

        mr = object.__new__(ModelRunner)
        mr.model, mr.device, mr.gpu_id, mr.tp_rank, mr.tp_size = model, self.args.device, 0, 0, 1
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
            from tests.sglang_harness.lora_serve import server_args_fields

            sa = ServerArgs(model_path=self.args.model, device="cpu", dtype=self.args.dtype,
                            custom_weight_loader=list(self.args.custom_weight_loader), **server_args_fields(self.args))
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
        if getattr(sa, "page_size", 1) is None:
            sa.page_size = 1  # as ServerArgs.__post_init__ normalizes it
        if hasattr(sa, "custom_weight_loader"):  # as ServerArgs.__post_init__ (skipped here) normalizes it
            sa.custom_weight_loader = list(self.args.custom_weight_loader)
        from tests.sglang_harness.lora_serve import server_args_fields

        for k, v in server_args_fields(self.args).items():
            setattr(sa, k, v)
        return sa

    def _scheduler_state(self, sched) -> None:
        """The state SGLang's scheduler handlers (pause, continue, flush, abort, idle checks) read: SGLang's own
        running batch, waiting queue, request-to-token pool, KV-slot allocator and radix cache, and the flags of
        a scheduler started with default arguments on one TP rank (no overlap, speculation, disaggregation,
        grammar, hierarchical cache). STUB: the managers that hold no request here (grammar, dLLM, beam search,
        multimodal receiver) are empty, and the metrics and KV-event reporters do nothing."""
        import inspect

        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        try:
            from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        except ImportError:
            from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        pool = ReqToTokenPool(size=64, max_context_len=2048, device="cpu", enable_memory_saver=False)
        kw = dict(size=4096, dtype=self.dtype, device="cpu", kvcache=None)
        if "need_sort" in inspect.signature(TokenToKVPoolAllocator.__init__).parameters:
            kw["need_sort"] = False
        alloc = TokenToKVPoolAllocator(**kw)
        if "params" in inspect.signature(RadixCache.__init__).parameters:
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams

            tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                              page_size=1))
        else:
            tree = RadixCache(req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=1)
        sched.req_to_token_pool, sched.token_to_kv_pool_allocator, sched.tree_cache = pool, alloc, tree
        sched.running_batch = ScheduleBatch(reqs=[])
        for name in ("tree_cache", "req_to_token_pool", "token_to_kv_pool_allocator"):  # as ScheduleBatch.init_new
            setattr(sched.running_batch, name, getattr(sched, name))
        sched.running_batch.device = "cpu"
        sched.waiting_queue, sched.grammar_queue, sched.result_queue = [], [], []
        sched.cur_batch = sched.last_batch = sched.chunked_req = None
        sched.enable_overlap = sched.enable_overlap_mlx = False
        sched.enable_hicache_storage = sched.enable_hierarchical_cache = sched.enable_hisparse = False
        sched.enable_lmcache = sched.enable_priority_scheduling = sched.abort_on_priority_when_disabled = False
        sched.max_queued_requests = None
        sched.processed_tokens_counter = 0
        sched.enable_continuous_input_polling = False
        sched.pp_size = 1
        sched.grammar_backend = sched.decode_offload_manager = sched.hisparse_coordinator = None
        sched.mm_receiver = sched.rust_server = sched.dllm_config = None
        sched._engine_paused = False
        sched._pause_started_at = None
        sched._pause_intervals = []
        try:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            sched.spec_algorithm = SpeculativeAlgorithm.NONE
        except ImportError:
            sched.spec_algorithm = None
        try:
            from sglang.srt.disaggregation.utils import DisaggregationMode

            sched.disaggregation_mode = DisaggregationMode.NULL
        except ImportError:
            pass
        empty = types.SimpleNamespace
        sched.dllm_manager = empty(any_staging_reqs=lambda: False, staging_queue=[])
        sched.grammar_manager = empty(grammar_queue=[], clear=lambda: None, abort_requests=lambda recv: None)
        sched.beam_coordinator = empty(retire_group=lambda req: None)
        sched.metrics_reporter = empty(reset_metrics=lambda: None, is_stats_logging_rank=True, last_gen_throughput=0.0,
                                       current_scheduler_metrics_enabled=False)
        sched.kv_events_publisher = empty(publish_kv_events=lambda: None)
        # STUB: the scheduler's socket to the tokenizer. What it would carry here (an abort of a queued request)
        # the harness's generation sees from the queues themselves.
        to_tokenizer = empty(send_output=lambda *a, **k: None, send_pyobj=lambda *a, **k: None)
        sched.send_to_tokenizer = to_tokenizer
        sched.ipc_channels = empty(send_to_tokenizer=to_tokenizer)

    def scheduler_view(self) -> dict:
        s = self.scheduler
        return {"running": len(s.running_batch.reqs), "waiting": len(s.waiting_queue),
                "paused": bool(getattr(s, "_engine_paused", False))}

    def _weight_exporter(self):
        """0.5.2x's ``WeightExporter`` component, as SGLang's ``ModelRunner.init_weight_exporter`` builds it (one
        TP rank): ``/get_weights_by_name`` runs through it into the model's own ``get_weights_by_name``
        (Llama has one, Qwen2 has none, so SGLang answers 400 for every name of a Qwen2)."""
        try:
            from sglang.srt.model_executor.model_runner_components.weight_exporter import WeightExporter
        except ImportError:
            return None
        return WeightExporter(tp_rank=0, tp_size=1, gpu_id=0, get_model_path=lambda: self.args.model,
                              get_model=lambda: self.model)

    def _build_tp_worker(self):
        import sglang.srt.managers.tp_worker as tw_mod
        from sglang.srt.managers.tp_worker import TpModelWorker

        tw = object.__new__(TpModelWorker)
        for attr in ("model_runner", "_model_runner", "worker"):
            try:
                setattr(tw, attr, self.model_runner)
            except AttributeError:
                pass
        tw.tp_rank = 0  # before 0.5.23 the worker picks its own tensor entry by this
        self.tp_worker = tw
        # STUB: the parallel topology (one TP rank; SGLang's barriers on a group of one are no-ops), where 0.5.2x's
        # scheduler-side updater, the worker (each rank deserializes its own tensor entry) and the runner read it.
        self.parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None), tp_rank=0, pp_size=1,
                                              tp_size=1)
        mods = [tw_mod]
        for name in ("sglang.srt.managers.scheduler_components.weight_updater",
                     "sglang.srt.model_executor.model_runner_components.weight_updater",
                     "sglang.srt.managers.scheduler"):
            try:
                __import__(name)
                mods.append(sys.modules[name])
            except ImportError:
                pass
        for mod in mods:
            if hasattr(mod, "get_parallel"):
                mod.get_parallel = lambda: self.parallel

    def load_tensor_entries(self, entries, load_format, tp_rank: int):
        """SGLang's receive of one ``/update_weights_from_tensor`` payload as TP rank ``tp_rank``: the worker
        deserializes its own entry, the runner (or 0.5.2x's ``WeightUpdater``) unflattens a flattened bucket and
        calls the model's ``load_weights``."""
        self.tp_worker.tp_rank = self.model_runner.tp_rank = self.parallel.tp_rank = tp_rank
        if hasattr(self.tp_worker, "deserialize_own_rank"):
            named = self.tp_worker.deserialize_own_rank(entries)
            return self.weight_updater.update_weights_from_tensor(named_tensors=named, load_format=load_format)
        req = self.io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=entries, load_format=load_format)
        return self.tp_worker.update_weights_from_tensor(req)

    @classmethod
    def receiver(cls, args, rel, model) -> Harness:
        """Only the receive side (runtime config, model runner, TP worker) of SGLang ``rel`` around ``model``."""
        import torch

        self = object.__new__(cls)
        self.args, self.rel, self.dtype, self.model = args, rel, getattr(torch, args.dtype), model
        self._build_runtime()
        self._build_model_runner()
        self._build_tp_worker()
        return self

    def _build_scheduler(self):
        io = self.io
        from sglang.srt.managers.scheduler import Scheduler

        tw = self.tp_worker
        sched = object.__new__(Scheduler)
        sched.tp_worker = tw
        sched.draft_worker = None
        sched.tp_cpu_group = None
        sched.server_args = self.server_args
        self._scheduler_state(sched)
        if (0, 5, 20) <= self.rel < (0, 5, 22):  # 0.5.20-0.5.21 keep the parallel state on the scheduler (one rank)
            sched.ps = types.SimpleNamespace(pp_size=1, tp_size=1, tp_rank=0, pp_rank=0, dp_rank=None, attn_tp_rank=0,
                                             attn_cp_rank=0, gpu_id=0)
        self.scheduler = sched
        handlers = {}
        try:
            from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        except ImportError:
            SchedulerWeightUpdaterManager = None
        if SchedulerWeightUpdaterManager is not None:
            wu = SchedulerWeightUpdaterManager(
                tp_worker=tw, draft_worker=None, memory_saver_adapter=None, flush_cache=sched.flush_cache,
                is_fully_idle=sched.is_fully_idle, scheduler=sched,
                **({"tp_cpu_group": None} if self.rel < (0, 5, 22) else {}),  # 0.5.20-0.5.21 take the TP group
            )
            sched.weight_updater = wu
            for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                         "update_weights_from_tensor", "update_weights_from_disk", "begin_weight_update",
                         "end_weight_update", "get_weights_by_name"):
                if hasattr(wu, name):  # sessions from 0.5.21
                    handlers[name] = getattr(wu, name)
            handlers["update_weight_version"] = sched.handle_update_weight_version
        else:
            for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                         "update_weights_from_tensor", "update_weights_from_disk", "get_weights_by_name"):
                if hasattr(sched, name):
                    handlers[name] = getattr(sched, name)
            if hasattr(io, "UpdateWeightVersionReqInput"):
                handlers["update_weight_version"] = lambda req: self._record_version(req.new_version)
        # SGLang's own scheduler handlers (0.4.x has no scheduler-side pause: its tokenizer aborts instead).
        for name in ("pause_generation", "continue_generation", "abort_request"):
            if hasattr(sched, name):
                handlers[name] = getattr(sched, name)
        try:  # 0.5.2x: a flush may wait (timeout_s) for the scheduler to go idle
            from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        except ImportError:
            SchedulerFlushWrapper = None
        if SchedulerFlushWrapper is not None:
            send = lambda out, req: self.loop.call_soon_threadsafe(self.tm.flush_cache_communicator.handle_recv, out)  # noqa: E731
            sched.flush_wrapper = SchedulerFlushWrapper(
                flush_cache=sched.flush_cache, is_fully_idle=sched.is_fully_idle,
                **({"send_output": send} if self.rel >= (0, 5, 23) else  # 0.5.20-0.5.22: through the IPC channels
                   {"ipc_channels": types.SimpleNamespace(send_to_tokenizer=types.SimpleNamespace(send_output=send))}))
            handlers["flush_cache"] = sched.flush_wrapper.handle
        else:
            handlers["flush_cache"] = sched.flush_cache_wrapped
        handlers["get_internal_state"] = self._internal_state
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
            "abort_request": "AbortReq",
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
            except BaseException:  # an uncaught scheduler exception ends SGLang's server
                traceback.print_exc()
                sys.stderr.write("HARNESS SCHEDULER DIED\n")
                sys.stderr.flush()
                os._exit(70)
            if out is not None and reply is not None:
                self.loop.call_soon_threadsafe(reply, out)
            self._scheduler_tick()

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
                                                is_multimodal=False, context_len=2048, hf_config=self.hf_model.config)
        tm.rid_to_state = {}
        tm.gracefully_exit = False
        tm.startup_time = 0.0
        RWLock = tm_mod.RWLock  # SGLang's asyncio reader/writer lock, as its TokenizerManager imports it

        tm.model_update_lock = RWLock()
        tm.is_pause = False
        tm.is_pause_cond = asyncio.Condition()
        tm._cond = asyncio.Condition()  # 0.4.x pause condition
        tm._updating = False
        tm._is_updating_cond = asyncio.Condition()  # 0.4.10's names for the same
        tm._is_updating = False

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
        tm.get_internal_state = self._tm_internal_state
        tm.is_ready = lambda: True
        tm.generate_request = self._generate
        # Communicators: SGLang's own classes, one per control call, each with a reply path of its own.
        comm_cls = getattr(tm_mod, "_Communicator", None)
        fan_out_cls = None
        try:
            from sglang.srt.managers.tokenizer_communicator_mixin import _Communicator as comm_cls
        except ImportError:
            pass
        try:
            from sglang.srt.managers.communicator import FanOutCommunicator as fan_out_cls
        except ImportError:
            pass
        for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                     "update_weights_from_tensor", "get_weights_by_name", "update_weight_version", "flush_cache",
                     "begin_weight_update", "end_weight_update", "get_internal_state", "update_lora_adapter"):
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
        """Greedy decoding inside SGLang's reader lock, waiting while paused as SGLang's tokenizer does, and (0.5.23)
        the adapter looked up as SGLang's tokenizer does after the pause wait."""
        tm = self.tm
        if self.rel >= (0, 5, 0):
            cond, paused = tm.is_pause_cond, (lambda: tm.is_pause)
        elif self.rel >= (0, 4, 10):  # 0.4.10 renamed 0.4.9's pause condition
            cond, paused = tm._is_updating_cond, (lambda: tm._is_updating)
        else:
            cond, paused = tm._cond, (lambda: tm._updating)
        async with cond:
            await cond.wait_for(lambda: not paused())
        async with tm.model_update_lock.reader_lock:
            if self.lora is not None:  # SGLang's own lookup: refusal, implicit reload, the adapter's counter
                await self.lora.acquire(obj)
            try:
                async for out in self._generate_locked(obj):
                    yield out
            finally:
                if self.lora is not None:
                    await self.lora.release(obj)

    async def _generate_locked(self, obj):
        """The generation proper (STUB: greedy decoding with the transformers model), SGLang's lock held."""
        import torch

        ids = obj.input_ids if obj.input_ids is not None else None
        if ids is None:
            raise ValueError("the harness generates from input_ids only")
        sp = obj.sampling_params or {}
        n = int(sp.get("max_new_tokens", 8))
        # keep the request in flight (tests of pausing); custom_params passes SGLang's validation
        hold = float((sp.get("custom_params") or {}).get("harness_hold_s", 0.0))
        req = await self._in_scheduler(self._admit, list(ids), n)
        epoch = self.hold_epoch
        try:
            version = self.current_version()

            def run():
                with torch.no_grad():
                    out = self.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                              min_new_tokens=n, pad_token_id=0)
                return out[0, len(ids):].tolist()

            out_ids = await asyncio.get_running_loop().run_in_executor(None, run)
            deadline = asyncio.get_running_loop().time() + hold
            # The request stays in SGLang's batch until its hold is over and the scheduler is not paused
            # (a paused SGLang scheduler runs no batch), or until SGLang's own abort handler ended it.
            # (/wsync_harness/release_holds ends every hold begun before it, as if its time were up.)
            while not self._aborted(req) and ((asyncio.get_running_loop().time() < deadline and epoch == self.hold_epoch)
                                              or getattr(self.scheduler, "_engine_paused", False)):
                await asyncio.sleep(0.05)
            finish = {"type": "length", "length": n}
            if self._aborted(req):
                to_finish = getattr(req, "to_finish", None)
                finish = to_finish.to_json() if to_finish is not None else {"type": "abort", "message": "Aborted"}
            meta = {"id": req.rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": n,
                    "weight_version": version}
            if getattr(obj, "lora_id", None):
                meta["harness_lora_id"] = obj.lora_id  # harness only: the adapter this generation acquired
            yield {"text": "", "output_ids": out_ids, "meta_info": meta}
        finally:
            await self._in_scheduler(self._leave, req)

    async def _in_scheduler(self, fn, *args):
        """Run ``fn`` in the scheduler thread, between its handlers, as SGLang's event loop would."""
        return await asyncio.wrap_future(self.executor.submit(fn, *args))

    def _admit(self, ids, n):
        """STUB of SGLang's request intake and prefill: an SGLang ``Req`` joins the running batch with a
        request slot from SGLang's pool and no KV tokens (the transformers model keeps its own cache)."""
        import array
        import inspect
        import uuid

        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        s = self.scheduler
        req = Req(uuid.uuid4().hex, "", ids, SamplingParams(max_new_tokens=n))
        if isinstance(req.output_ids, array.array):  # 0.5.2x keeps token ids in arrays, as its tokenizer sends them
            ids = array.array("q", ids)
            req = Req(req.rid, "", ids, req.sampling_params)
        kv = getattr(req, "kv", req)  # 0.5.2x: the request's KV state lives in an object of its own
        if "reqs" in inspect.signature(s.req_to_token_pool.alloc).parameters:  # 0.5.9+: the pool binds the slot
            s.req_to_token_pool.alloc([req])
        else:
            req.req_pool_idx = s.req_to_token_pool.alloc(1)[0]
        locs = s.token_to_kv_pool_allocator.alloc(len(ids))
        s.req_to_token_pool.write((kv.req_pool_idx, slice(0, len(ids))), locs.to(torch.int32))
        kv.kv_committed_len = kv.kv_allocated_len = len(ids)
        req.fill_ids = ids[:]
        req.last_node = s.tree_cache.root_node
        s.running_batch.reqs.append(req)
        return req

    def _leave(self, req):
        """STUB of SGLang's finishing a request: it leaves whichever queue holds it; its slot is freed unless
        SGLang's retract already released it."""
        import inspect

        s = self.scheduler
        if req in s.running_batch.reqs:
            s.running_batch.reqs.remove(req)
            kv = getattr(req, "kv", req)
            if "req" in inspect.signature(s.req_to_token_pool.free).parameters:  # 0.5.9+: frees the request's slot
                if kv.req_pool_idx is not None:
                    s.req_to_token_pool.free(req)
            elif not getattr(req, "is_retracted", False):
                s.req_to_token_pool.free(req.req_pool_idx)
        if req in s.waiting_queue:
            s.waiting_queue.remove(req)
        self._scheduler_tick()

    def _scheduler_tick(self) -> None:
        """What SGLang's event loop does between requests that the harness needs: answer a deferred flush."""
        fw = getattr(self.scheduler, "flush_wrapper", None)
        if fw is not None:
            fw.check_pending()

    def _aborted(self, req) -> bool:
        s = self.scheduler
        return (getattr(req, "to_finish", None) is not None or bool(getattr(req, "to_abort", False))
                or (req not in s.running_batch.reqs and req not in s.waiting_queue))

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

        @app.get("/wsync_harness/scheduler")
        async def harness_scheduler():
            return JSONResponse(await self._in_scheduler(self.scheduler_view))

        @app.get("/wsync_harness/weights")
        async def harness_weights():
            return JSONResponse({"weight_version": self.current_version(), "checksums": self.checksums()})

        @app.post("/wsync_harness/release_holds")
        async def harness_release_holds():
            self.hold_epoch += 1
            return JSONResponse({"hold_epoch": self.hold_epoch})

        if self.lora is not None:
            @app.get("/wsync_harness/lora")
            async def harness_lora():
                return JSONResponse(self.lora.view())

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
