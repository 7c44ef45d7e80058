"""The reference server's model: the facade the HTTP layer talks to.

:class:`ModelState` holds the served model and its parts, each in its own module:

* :mod:`inference_adapter.weights` -- the served tensors, their version, and the atomic swap: weights
  change only inside :meth:`ServedWeights.swap <inference_adapter.weights.ServedWeights.swap>`, under
  the writer side of a reader/writer lock every generation holds the reader side of.
* :mod:`inference_adapter.generation` -- decoding, stop handling, pause/abort/retract (mixed in here).
* :mod:`inference_adapter.weight_updates` -- :class:`WeightUpdates`, the component that owns the update
  session, staging, validation, and the distributed, shared-memory (``wsync_shm``) and disk update
  paths; with :mod:`inference_adapter.checks` and :mod:`inference_adapter.disk_reader` beside it.
* :mod:`inference_adapter.groups` -- the trainers' process groups (owned by the weight updates).
* :mod:`inference_adapter.wire` -- reading announced bytes off a group or /dev/shm, with the gloo
  byte-size check.

An update first *stages* (receive or read, then validate), and only a complete, valid update is
swapped in; anything that fails leaves the previous weights and version serving. A watchdog thread
(:meth:`ModelState._watch_trainers`) notices a trainer that died between requests.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading

import torch

from bridge.digest import served_digest_part, tensor_checksum
from bridge.errors import ConfigError
from bridge.protocol import ProtocolFeatures
from bridge.tensors import dtype_to_str
from inference_adapter.checks import version_problem
from inference_adapter.errors import RequestError
from inference_adapter.generation import GenerationMixin
from inference_adapter.lora import ServedAdapters
from inference_adapter.weight_updates import WeightUpdates
from inference_adapter.weights import ServedWeights

__all__ = ["ModelState", "RequestError", "load_model"]


def load_model(*, model: str | None, preset: str | None, seed: int, dtype: torch.dtype):
    """``(model, tokenizer, model_path, tokenizer_path)`` from an HF directory or a preset, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is not None:
        if not os.path.isdir(model):
            raise ConfigError(f"--model {model}: not a directory; give a local HF model directory or use --preset")
        if not any(os.path.isfile(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(f"{model} has no tokenizer (tokenizer.json or tokenizer_config.json): save the model's "
                              f"tokenizer into it (tokenizer.save_pretrained({model!r})), or serve a --preset")
        m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        try:
            tok = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError, TypeError, ImportError) as e:  # transformers' own text names no file
            from bridge.log import debug_enabled

            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{model}: its tokenizer does not load ({first if debug_enabled() else first[:200]}); "
                              "check its tokenizer files, or save the model's tokenizer into it") from e
        path = os.path.abspath(model)
        return m, tok, path, path
    from bridge.local.presets import build_model, build_tokenizer

    m = build_model(preset or "tiny", seed=seed).to(dtype)
    return m, build_tokenizer(), f"preset:{preset or 'tiny'}", f"preset:{preset or 'tiny'}"


def _disk_roots(roots: list[str] | None, model_path: str) -> list[str]:
    """The resolved directories disk loads may come from; ConfigError for one that does not exist.

    Default (no ``--disk-root``): the snapshot roots this server knows of without being told: wsync's
    default snapshot root (``<temp>/wsync_<user>/snapshots``, where ``wsync train`` and ``PublisherConfig``
    write by default; created if missing) and the directory of the model it serves (reloading the base
    weights). Any other directory, the rest of the temp folder included, must be named.
    """
    if not roots:
        from bridge.transports.disk import default_snapshot_root

        roots = [default_snapshot_root()]
        os.makedirs(roots[0], exist_ok=True)
        if os.path.isdir(model_path):
            roots.append(model_path)
    out = []
    for r in roots:
        real = os.path.realpath(r)
        if not os.path.isdir(real):
            raise ConfigError(f"--disk-root {r}: not a directory; give an existing directory that holds snapshots")
        out.append(real)
    return out


class ModelState(GenerationMixin):
    """The served model and everything that reads or changes it. Methods block; call them from threads.

    ``weights`` (:class:`~inference_adapter.weights.ServedWeights`) are what is served; ``updates``
    (:class:`~inference_adapter.weight_updates.WeightUpdates`) is every operation that changes them, with
    its session and ``updates.groups``; generation and pause are mixed in (:class:`GenerationMixin`).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path: str,
        tokenizer_path: str,
        weight_version: str = "default",
        protocol_version: str = "0.5.23",
        group_timeout: float = 120.0,
        served_model_name: str | None = None,
        receive_timeout: float = 10.0,
        disk_roots: list[str] | None = None,
        allow_version_rollback: bool = False,
        quantization: str | None = None,
        lora: dict | None = None,
        wait_for_weights: bool = False,
    ):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.features = ProtocolFeatures.from_version(protocol_version)
        self.disk_roots = _disk_roots(disk_roots, model_path)
        self.tokenizer_path = tokenizer_path
        self._served_model_name = served_model_name
        self.dtype = next(p for p in self.model.parameters() if p.dtype.itemsize > 1).dtype
        self.quantization = quantization
        """``fp8`` when the projections are served as block FP8 (``--quantization fp8``), else None."""
        self.log = _VersionLog(logging.getLogger("inference_adapter.server"), self)
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = _eos_token_ids(self.model, tokenizer)
        # transformers 5.x renames forward's past_key_values to cache (the old name warns).
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

        problem = version_problem(str(weight_version), "--weight-version")
        if problem:
            raise ConfigError(problem)
        self.weights = ServedWeights(self.model, str(weight_version), model_path)
        self.adapters = ServedAdapters(self.model, **(lora or {}))
        """LoRA adapters (``--enable-lora``; :mod:`inference_adapter.lora`), apart from the base weights."""
        self._init_generation()
        self.weights.on_version_change.append(self._record_version_change)
        self.waiting_for_weights = bool(wait_for_weights)
        """``--wait-for-weights``: no generation is answered until a weight update labels a version (a publish, a disk
        load): a server that joins or restarts in a fleet answers nothing on its base weights."""
        self.weights.on_version_change.append(self._weights_came)
        self.updates = WeightUpdates(
            weights=self.weights, generation=self, features=self.features, log=self.log,
            group_timeout=float(group_timeout), receive_timeout=float(receive_timeout), disk_roots=self.disk_roots,
            allow_version_rollback=bool(allow_version_rollback),
        )
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_trainers, name="wsync-trainer-watchdog", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ reads

    @property
    def version(self) -> str:
        return self.weights.version

    @property
    def model_path(self) -> str:
        """Where the served weights came from: the model directory or preset, then the last disk update's path."""
        return self.weights.model_path

    @property
    def served_model_name(self) -> str:
        return self._served_model_name or self.model_path

    @property
    def paused(self) -> bool:
        return self._paused

    def _weights_came(self, old: str, new: str) -> None:
        if self.waiting_for_weights:
            self.waiting_for_weights = False
            self.log.info("weight version %s came (it was %s): generations are answered from now on", new, old)

    def internal_state(self) -> dict:
        with self._cv:
            running = len(self._gens)
        groups = self.updates.groups
        return {"weight_version": self.version, "paused": self._paused, "running_requests": running,
                "waiting_for_weights": self.waiting_for_weights,
                "released_memory": self.released_memory(),
                "update_session_open": self.updates.session is not None, "weight_update_groups": groups.names(),
                "receiving_on_group": groups.receiving, "writer_lease": self.updates.writers.state()}

    def model_info(self) -> dict:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": list(getattr(cfg, "architectures", None) or [type(self.model).__name__]),
            "served_model_name": self.served_model_name,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "dtype": dtype_to_str(self.dtype),
        }

    def get_weights_by_name(self, name: str, truncate_size: int) -> list | None:
        """SGLang's debug view: the first ``truncate_size`` rows as float32 lists; None if unknown."""
        t = self.weights.target(name)
        if t is None:
            return None
        with self.weights.rw.read():
            return t[: max(0, truncate_size)].detach().to(torch.float32).tolist()

    def checksums(self, names: list[str] | None, digest: bool = False) -> dict:
        """Project extension: sha256 of every (or the named) served tensor's bytes, with the version; with
        ``digest``, the :func:`bridge.digest.served_digest_part` sum of those tensors instead, with the version
        and the run it came from (a publisher compares it with its own weights before it publishes the served
        version again)."""
        w = self.weights
        wanted = names if names is not None else [*w.params, *w.aliases]
        unknown = [n for n in wanted if w.target(n) is None]
        if unknown:
            raise RequestError(f"unknown tensor names {unknown[:5]}; the served model has {len(w.params)} parameters")
        with w.rw.read():
            if digest:
                total = sum(served_digest_part(n, w.target(n).reshape(-1)) for n in wanted) % (1 << 64)
                return {"weight_version": w.version, "run_id": self.updates.run_id, "digest": f"{total:016x}"}
            sums = {n: tensor_checksum(w.target(n)) for n in wanted}
            dtypes = {n: dtype_to_str(w.target(n).dtype) for n in wanted}
            return {"weight_version": w.version, "checksums": sums, "dtypes": dtypes}

    def weights_spec(self) -> dict:
        """Project extension: what the server serves, for a publisher's check before any byte moves: each
        tensor's shape and dtype by HF name, the aliases it accepts (a tied head) and the serving dtype."""
        w = self.weights
        return {"dtype": dtype_to_str(self.dtype), "model_type": w.model_type, "quantization": self.quantization,
                "params": {n: {"shape": list(t.shape), "dtype": dtype_to_str(t.dtype)} for n, t in w.params.items()},
                "aliases": dict(w.aliases)}

    # ------------------------------------------------------------------ the trainer watchdog

    def _watch_trainers(self, interval: float = 1.0) -> None:
        """Notice a trainer that died between requests, and continue generation on the previous weights.

        Without this, a trainer killed between two buckets would leave its session open and generation
        paused forever. A colocated trainer's pid is watched (:meth:`WeightUpdates.check_session_owner`);
        a broadcasting trainer's group is dropped once its TCP store (hosted by group rank 0) is gone.
        """
        groups = self.updates.groups
        while not self._closing.wait(interval):
            self.updates.check_session_owner()
            for name, pg, e in groups.unreachable():
                if groups.drop_unreachable(name, pg, e) and self._paused:
                    self.log.warning("continuing generation on the previous weights: the trainer that paused it is gone")
                    self.resume()

    def close(self) -> None:
        """Stop the watchdog and destroy every group (gloo aborts the process at exit otherwise)."""
        self._closing.set()
        self.updates.groups.close()


def _eos_token_ids(model, tokenizer) -> list[int]:
    """The token ids that end a generation: the model's generation config's, and the tokenizer's."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


class _VersionLog(logging.LoggerAdapter):
    """Prefixes every line with the emulated SGLang version and the served weight version."""

    def __init__(self, logger: logging.Logger, state: ModelState):
        super().__init__(logger, {})
        self.state = state

    def process(self, msg, kwargs):
        return f"[sglang {self.state.features.version} | weights {self.state.weights.version}] {msg}", kwargs
