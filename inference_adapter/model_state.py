"""The reference server's model: the served weights, their version, and the atomic swap.

Weights change only inside :meth:`ModelState._swap`, under the writer side of a reader/writer lock;
every generation holds the reader side while it computes, and records ``(weights epoch, version)``
when it starts. So a generation sees the old weights or the new ones, never a mix, and reports the
version it ran on. An update first *stages* (receive or read, then validate), and only a complete,
valid update is swapped in; anything that fails leaves the previous weights and version serving.

:class:`ModelState` is the facade the HTTP layer talks to; each concern lives in its own module and is
mixed in here:

* :mod:`inference_adapter.generation` -- decoding, stop handling, pause/abort/retract.
* :mod:`inference_adapter.weight_updates` -- the update session, staging, validation, and the
  distributed, shared-memory (``wsync_shm``) and disk update paths.
* :mod:`inference_adapter.wire` -- reading announced bytes off a group or /dev/shm, with the gloo
  byte-size check.
* :mod:`inference_adapter.groups` -- the trainers' process groups and the watchdog that notices a dead one.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bridge.errors import ConfigError
from bridge.protocol import VERSION_GOES_BACK, ProtocolFeatures, tensor_checksum
from bridge.tensors import dtype_to_str
from inference_adapter.errors import RequestError
from inference_adapter.generation import GenerationMixin
from inference_adapter.groups import GroupsMixin
from inference_adapter.weight_updates import RunClaim, WeightUpdateMixin, version_problem

__all__ = ["ModelState", "RequestError", "load_model"]


def load_model(*, model: str | None, preset: str | None, seed: int, dtype: torch.dtype):
    """``(model, tokenizer, model_path, tokenizer_path)`` from an HF directory or a preset, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is not None:
        if not os.path.isdir(model):
            raise ConfigError(f"--model {model}: not a directory; give a local HF model directory or use --preset")
        m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(model)
        path = os.path.abspath(model)
        return m, tok, path, path
    from bridge.presets import build_model, build_tokenizer

    m = build_model(preset or "tiny", seed=seed).to(dtype)
    return m, build_tokenizer(), f"preset:{preset or 'tiny'}", f"preset:{preset or 'tiny'}"


def _disk_roots(roots: list[str] | None, model_path: str) -> list[str]:
    """The resolved directories disk loads may come from; ConfigError for one that does not exist.

    Default (no ``--disk-root``): the snapshot roots this server knows of without being told: wsync's
    default snapshot root (``<temp>/wsync-snapshots``, where ``wsync train`` and ``PublisherConfig``
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


class _RWLock:
    """Reader/writer lock that prefers writers, so a stream of generations cannot starve an update."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cv:
            while self._writer or self._writers_waiting:
                self._cv.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cv:
            self._readers -= 1
            if not self._readers:
                self._cv.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cv:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cv.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


class ModelState(GenerationMixin, GroupsMixin, WeightUpdateMixin):
    """The served model and everything that reads or changes it. Methods block; call them from threads."""

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
    ):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.features = ProtocolFeatures.from_version(protocol_version)
        self.group_timeout = float(group_timeout)
        self.receive_timeout = float(receive_timeout)
        self.disk_roots = _disk_roots(disk_roots, model_path)
        self.allow_version_rollback = bool(allow_version_rollback)
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self._served_model_name = served_model_name
        self.dtype = next(self.model.parameters()).dtype
        self.log = _VersionLog(logging.getLogger("inference_adapter.server"), self)

        # Served tensors by HF checkpoint name; aliases are state_dict names of the same storage (the
        # tied lm_head.weight): accepted in updates and skipped, as SGLang does.
        self._params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        sd = self.model.state_dict()
        for n, b in self.model.named_buffers():
            if n in sd:
                self._params[n] = b
        by_ptr = {t.data_ptr(): n for n, t in self._params.items()}
        self._aliases = {n: by_ptr[t.data_ptr()] for n, t in sd.items() if n not in self._params and t.data_ptr() in by_ptr}
        self._param_bytes = sum(t.numel() * t.element_size() for t in self._params.values())

        cfg = self.model.config
        self.context_length = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        # transformers 5.x renames forward's past_key_values to cache (the old name warns).
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

        problem = version_problem(str(weight_version), "--weight-version")
        if problem:
            raise ConfigError(problem)
        self._version = str(weight_version)
        self._epoch = 0
        self._rw = _RWLock()
        self._init_generation()
        self._update_lock = threading.Lock()  # one weight operation at a time
        self._init_groups()  # starts the trainer watchdog
        self._init_sessions()

    # ------------------------------------------------------------------ reads

    @property
    def version(self) -> str:
        return self._version

    @property
    def served_model_name(self) -> str:
        return self._served_model_name or self.model_path

    @property
    def paused(self) -> bool:
        return self._paused

    def internal_state(self) -> dict:
        with self._cv:
            running = len(self._gens)
        return {"weight_version": self._version, "paused": self._paused, "running_requests": running,
                "update_session_open": self._session is not None, "weight_update_groups": sorted(self._groups),
                "receiving_on_group": self._receiving}

    def model_info(self) -> dict:
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self._version,
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
        name = self._aliases.get(name, name)
        t = self._params.get(name)
        if t is None:
            return None
        with self._rw.read():
            return t[: max(0, truncate_size)].detach().to(torch.float32).tolist()

    def checksums(self, names: list[str] | None) -> dict:
        """Project extension: sha256 of every (or the named) served tensor's bytes, with the version."""
        wanted = names if names is not None else [*self._params, *self._aliases]
        unknown = [n for n in wanted if self._aliases.get(n, n) not in self._params]
        if unknown:
            raise RequestError(f"unknown tensor names {unknown[:5]}; the served model has {len(self._params)} parameters")
        with self._rw.read():
            sums = {n: tensor_checksum(self._params[self._aliases.get(n, n)]) for n in wanted}
            dtypes = {n: dtype_to_str(self._params[self._aliases.get(n, n)].dtype) for n in wanted}
            return {"weight_version": self._version, "checksums": sums, "dtypes": dtypes}

    def set_version(self, new_version: str, abort_all_requests: bool, run: RunClaim = RunClaim()) -> None:
        problem = version_problem(new_version, "new_version")
        if problem:
            raise RequestError(f"Failed to update weight version: {problem}.")
        with self._update_lock:
            problem = self._rollback_problem(new_version, run)
            if problem:
                raise RequestError(f"Failed to update weight version: {problem}.", reason=VERSION_GOES_BACK)
            if abort_all_requests:
                self.abort_all("Abort by update_weight_version(abort_all_requests=True).")
            self._claim(new_version, run)
            with self._rw.write():
                self._version = str(new_version)
        self.log.info("weight version set")

    def _swap(self, staged: dict[str, torch.Tensor], version: str | None, model_path: str | None = None) -> None:
        """The only place weights change: all tensors and the version, under the writer lock."""
        with self._rw.write(), torch.no_grad():
            for n, t in staged.items():
                self._params[n].copy_(t)
            if version is not None:
                self._version = str(version)
            if model_path is not None:
                self.model_path = model_path
            self._epoch += 1
        self.log.info("swapped in %d tensors", len(staged))


class _VersionLog(logging.LoggerAdapter):
    """Prefixes every line with the emulated SGLang version and the served weight version."""

    def __init__(self, logger: logging.Logger, state: ModelState):
        super().__init__(logger, {})
        self.state = state

    def process(self, msg, kwargs):
        return f"[sglang {self.state.features.version} | weights {self.state._version}] {msg}", kwargs
