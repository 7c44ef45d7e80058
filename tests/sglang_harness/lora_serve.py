"""SGLang's LoRA adapter code in the harness server (:mod:`tests.sglang_harness.serve`, ``--enable-lora``): 0.5.23
(the per-TP-rank ``serialized_named_tensors`` body) and 0.5.8 (the single ``serialized_tensors`` string).

SGLang's own code, as it runs in a server: the HTTP routes ``/load_lora_adapter``,
``/load_lora_adapter_from_tensors`` and ``/unload_lora_adapter`` of ``http_server.app``; the tokenizer manager's
``load_lora_adapter`` / ``load_lora_adapter_from_tensors`` / ``unload_lora_adapter`` (``lora_update_lock``,
``pending_lora_unloads``, ``lora_ref_cache``), its ``LoRARegistry`` (names, ids, the counters of the generations
that acquired an adapter, ``wait_for_unload``) and, for ``/generate`` with ``lora_path``,
``_validate_and_resolve_lora`` (the implicit reload of an unloaded name from ``lora_ref_cache`` included); the
``update_lora_adapter`` communicator; the scheduler's LoRA handlers (``kv_event_lora_names``), ``TpModelWorker``'s
(``deserialize_own_rank`` with the allowlisted unpickler, ``flattened_bucket``, the ``expected_checksums`` check)
and ``ModelRunner``'s; the ``LoRAManager``'s ``load_lora_adapter`` / ``load_lora_adapter_from_tensors`` /
``unload_lora_adapter`` with ``LoRAConfig`` (from the directory or ``config_dict``), ``validate_new_adapter`` (the
"already loaded", rank and target-module refusals), ``LoRAAdapter`` (disk: ``DefaultModelLoader``; tensors:
``initialize_weights_from_tensors``; q/k/v and gate/up stacking) and ``init_lora_shapes``.

STUB, each one:

* ``LoRAManager.__init__`` is skipped: the state it sets is assigned (SGLang's ``init_lora_adapters`` and
  ``init_lora_shapes`` run); no LoRA layers replace the model's modules (``init_lora_modules``), no kernel
  backend is built (``LoRAAdapter`` holds ``None`` for it, it reads it nowhere on load).
* The LoRA memory pool (GPU buffers, ``init_memory_pool``): a ``LoRAMemoryPool`` without its buffers, whose own
  ``can_support`` and ``remove_lora`` run (no adapter is ever paged into a slot: no batch runs).
* Generation with an adapter computes with the base model (the adapter's kernels need the GPU): the harness
  proves which adapter a generation acquired (``meta_info.harness_lora_id``), not its numbers.
* The tokenizer's per-request release (``_release_lora_once`` of a request state the harness does not build):
  the generation releases its ``lora_id`` in the registry when it ends, as that method does.
* ``/wsync_harness/lora`` (GET, harness only): SGLang's registry (name -> id), the ``LoRAManager``'s loaded
  adapters (name, id, path, rank) with the sha256 of every tensor SGLang's ``LoRAAdapter`` was handed (recorded
  in its ``_process_weight`` before SGLang's code runs, PEFT's names), each id's request counter, the unloads
  waiting for their counters, and how many requests wait for the tokenizer's ``lora_update_lock``.
"""

from __future__ import annotations

import hashlib
import time
import types

import torch


def supported(rel) -> bool:
    """The releases whose LoRA code the harness runs (the two body shapes the client sends)."""
    return rel == (0, 5, 8) or rel >= (0, 5, 23)


def server_args_fields(args) -> dict:
    """The LoRA flags, as SGLang's ``ServerArgs`` takes them (set as attributes on the dataclass releases)."""
    if not args.enable_lora:
        return {}
    return {"enable_lora": True, "max_lora_rank": args.max_lora_rank,
            "lora_target_modules": list(args.lora_target_modules), "max_loaded_loras": args.max_loaded_loras}


def _lora_config(h):
    """Where the release keeps its LoRA settings: 0.5.2x's runtime context, or the server args before it."""
    if h.runtime_context is not None:
        from sglang.srt.runtime_context import get_lora

        return get_lora()
    return h.server_args


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class LoraHarness:
    """Wires SGLang's LoRA code into a built :class:`tests.sglang_harness.serve.Harness` (0.5.8, 0.5.23)."""

    def __init__(self, h):
        self.h = h
        self.enabled = bool(_lora_config(h).enable_lora)
        self.recorded: dict[str, dict[str, str]] = {}  # lora_id -> {PEFT name: sha256}, what SGLang's adapter got
        self._tokenizer_state()
        if self.enabled:
            self._manager()
            self._runner_and_worker()
            self._scheduler_handlers()

    # ------------------------------------------------------------------ tokenizer side (SGLang's own state)

    def _tokenizer_state(self):
        """What ``TokenizerManager.init_lora`` sets (SGLang's ``LoRARegistry``, lock, caches)."""
        import asyncio

        from sglang.srt.lora.lora_registry import LoRARegistry

        tm = self.h.tm
        tm.enable_lora = self.enabled
        tm.lora_registry = LoRARegistry(_lora_config(self.h).lora_paths)
        tm.lora_update_lock = asyncio.Lock()
        tm.lora_ref_cache = {}
        tm.pending_lora_unloads = {}
        tm._lora_release_tasks = set()

    # ------------------------------------------------------------------ scheduler side

    def _manager(self):
        """SGLang's ``LoRAManager`` (STUB: ``__init__`` skipped, the memory pool without buffers)."""
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.lora import lora as lora_mod
        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.lora.mem_pool import LoRAMemoryPool

        h, cfg = self.h, _lora_config(self.h)
        m = object.__new__(LoRAManager)
        m.base_model = h.model
        hf = h.hf_model.config
        m.base_hf_config = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        m.max_loras_per_batch = cfg.max_loras_per_batch
        m.load_config = LoadConfig(load_format="auto")
        m.dtype, m.device = h.dtype, torch.device("cpu")
        m.attn_tp_size, m.attn_dp_enabled, m.tp_size, m.tp_rank = 1, False, 1, 0
        m.lora_added_tokens_size = None
        m.enable_lora_overlap_loading = False
        m.pending_lora_load_events = {}
        m.eviction_policy = cfg.lora_eviction_policy
        m.lora_strict_loading = getattr(cfg, "lora_strict_loading", False)
        m.speculative_algorithm = None
        m.lora_backend = None  # STUB: no kernels
        m.init_lora_adapters(cfg.lora_paths)
        m.init_lora_shapes(max_lora_rank=cfg.max_lora_rank, target_modules=cfg.lora_target_modules)
        pool = object.__new__(LoRAMemoryPool)  # STUB: no GPU buffers; its own can_support / remove_lora
        pool.max_lora_rank, pool.target_modules = m.max_lora_rank, m.target_modules
        pool.lora_added_tokens_size = m.lora_added_tokens_size
        pool.uid_to_buffer_id = {}
        m.memory_pool = pool
        self.manager = m
        # Record what SGLang's LoRAAdapter is handed, then run SGLang's own _process_weight.
        orig, recorded = lora_mod.LoRAAdapter._process_weight, self.recorded

        def process_weight(adapter, name, weight):
            recorded.setdefault(adapter.uid, {})[name] = _sha(weight)
            return orig(adapter, name, weight)

        lora_mod.LoRAAdapter._process_weight = process_weight

    def _runner_and_worker(self):
        """``ModelRunner``'s LoRA methods on the harness's runner (on 0.5.23 a bare record, on 0.5.8 bound again)."""
        from sglang.srt.model_executor.model_runner import ModelRunner

        mr = self.h.model_runner
        mr.lora_manager = self.manager
        for name in ("load_lora_adapter", "load_lora_adapter_from_tensors", "unload_lora_adapter"):
            setattr(mr, name, types.MethodType(getattr(ModelRunner, name), mr))

    def _scheduler_handlers(self):
        h, io = self.h, self.h.io
        s = h.scheduler
        s.enable_lora = True
        if hasattr(s, "init_kv_event_lora_names"):
            s.init_kv_event_lora_names()  # SGLang's
        h.handlers[io.LoadLoRAAdapterReqInput] = s.load_lora_adapter
        h.handlers[io.LoadLoRAAdapterFromTensorsReqInput] = s.load_lora_adapter_from_tensors
        h.handlers[io.UnloadLoRAAdapterReqInput] = s.unload_lora_adapter

    # ------------------------------------------------------------------ generation

    async def acquire(self, obj) -> None:
        """SGLang's ``_validate_and_resolve_lora`` (refusal, implicit reload, counter increment); 0.5.8 calls its
        ``_resolve_lora_path`` when LoRA is enabled."""
        tm = self.h.tm
        if hasattr(tm, "_validate_and_resolve_lora"):
            await tm._validate_and_resolve_lora(obj)
        elif self.enabled and obj.lora_path:
            await tm._resolve_lora_path(obj)

    async def release(self, obj) -> None:
        if self.enabled and obj.lora_path and getattr(obj, "lora_id", None):
            await self.h.tm.lora_registry.release(obj.lora_id)

    # ------------------------------------------------------------------ view

    def view(self) -> dict:
        """What the tests read; SGLang's scheduler thread loads and unloads meanwhile, so a read that raced it (a dict
        changed under it, an adapter half removed) is taken again."""
        for _ in range(50):
            try:
                return self._view()
            except (RuntimeError, KeyError):
                time.sleep(0.001)
        return self._view()

    def _view(self) -> dict:
        tm = self.h.tm
        reg = tm.lora_registry.get_all_adapters()
        out = {"registry": {n: r.lora_id for n, r in reg.items()},
               "counters": {i: c._count for i, c in tm.lora_registry._counters.items()},
               "pending_unloads": dict(tm.pending_lora_unloads), "loaded": {},
               "update_lock_waiters": len(getattr(tm.lora_update_lock, "_waiters", None) or ())}
        if self.enabled:
            m = self.manager
            for lid, ref in list(m.lora_refs.items()):
                out["loaded"][ref.lora_name] = {
                    "lora_id": lid, "lora_path": ref.lora_path, "r": m.configs[lid].r,
                    "checksums": dict(self.recorded.get(lid, {})),
                    "normalized": sorted(n for layer in m.loras[lid].layers for n in layer.weights)}
        return out
