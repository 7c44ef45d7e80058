"""The reference server's model: generation, staged weight updates and the atomic swap.

Weights change only inside :meth:`ModelState._swap`, under the writer side of a reader/writer lock;
every generation holds the reader side while it computes, and records ``(weights epoch, version)``
when it starts. So a generation sees the old weights or the new ones, never a mix, and reports the
version it ran on. An update first *stages* (receive or read, then validate), and only a complete,
valid update is swapped in; anything that fails leaves the previous weights and version serving.

How an update travels:

* Broadcast (``update_distributed``): the metadata is checked first. If it cannot describe what is on
  the wire (unparseable dtype, ragged lists, unsupported ``load_format``) the server cannot receive
  it; it answers 400 and destroys the group, because the trainer's bytes are already in flight and
  would be read by the next receive. If it is well-formed but wrong for this model (unknown name,
  wrong shape, dtype other than the served dtype, unaligned bucket, or no open session on a 0.5.21+
  protocol), the server still receives the broadcast as announced -- so the trainer does not hang and
  the group stays usable -- then discards it and answers 400. With a session (0.5.21+) buckets are
  staged until ``end_weight_update``, which swaps them together with the ``weight_version`` given on
  any bucket; any failure aborts the whole session.
* Co-located (``update_tensor``, ``/update_weights_from_tensor``): real SGLang takes pickled CUDA IPC
  handles; CPU tensors cannot cross HTTP, and this server never unpickles anything. It accepts only the
  project extension ``load_format="wsync_shm"``: the entry names a file under /dev/shm (or the temp dir)
  holding one flattened bucket, which is checked like a distributed bucket, copied out and staged in
  the session. Bad input answers 400, aborts the session and changes nothing.
* Disk (``update_disk``): the checkpoint is read and checked completely (every served parameter,
  shapes; dtypes are cast as SGLang casts them) before the swap.

Byte-size check (gloo groups; NCCL groups, possible on a CUDA host, receive exactly as SGLang does,
without it): gloo does not tell a receiver how many bytes arrived, and aborts the process when
more arrive than were posted. Each receive therefore posts a buffer with slack beyond the announced
size and pre-fills the bytes around the announced end with a pattern derived from the request; a
changed pattern beyond the end means more bytes came; the last 16 announced bytes still holding the
pattern mean at least 16 fewer came (a smaller shortfall, or a receive under 8 bytes, goes unnoticed).
A sender that sends more than twice the announced size plus 4 KiB still overruns the slack, and gloo
aborts the server.

A trainer that dies is noticed even between requests: a watchdog pings each group's TCP store, which
group rank 0 (the trainer) hosts. A dead trainer's group is dropped and its session aborted; and if
generation is paused, it continues on the previous weights, since the trainer that paused it will not
come back. A broadcast that fails (the trainer died, or stalled past ``--group-timeout``) does the same.

Pause: ``abort`` ends in-flight generations with ``finish_reason`` abort; ``retract`` and
``in_place`` park them at the next token, outside the lock; after ``/continue_generation`` a parked
generation continues, or starts again from its prompt if the weights changed meanwhile (no mixed
outputs; ``meta_info.num_retractions`` counts restarts). New generations wait while paused.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import BridgeError, ConfigError, SnapshotError
from bridge.process_group import destroy_custom_process_group, init_custom_process_group
from bridge.protocol import SESSION_REQUIRED_MESSAGE, SHM_LOAD_FORMAT, ProtocolFeatures, SamplingParams, tensor_checksum
from bridge.tensors import ParamSpec, dtype_to_str

__all__ = ["ModelState", "RequestError", "load_model"]

_PROBE = 16  # bytes of pattern on each side of a receive's announced end
_MIN_UNDER_CHECK = 8  # below this many bytes the "fewer bytes arrived" check is skipped (false alarms)


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP code, ``message`` says why and what to do."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


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


@dataclass(eq=False)
class _Gen:
    """One generation in flight."""

    rid: str
    state: str = "waiting"  # waiting | running | parked
    abort: str | None = None  # the abort message once aborted


@dataclass
class _Session:
    """An open begin/end_weight_update session (0.5.21+ protocol)."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    groups: set[str] = field(default_factory=set)
    requests: int = 0


class _SizeMismatch(Exception):
    pass


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


class ModelState:
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
    ):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.features = ProtocolFeatures.from_version(protocol_version)
        self.group_timeout = float(group_timeout)
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

        self._version = str(weight_version)
        self._epoch = 0
        self._rw = _RWLock()
        self._cv = threading.Condition()  # guards _paused, _gens
        self._paused = False
        self._pause_mode = "abort"
        self._gens: set[_Gen] = set()
        self._update_lock = threading.Lock()  # one weight operation at a time
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._dead_groups: dict[str, str] = {}  # group name -> why the server destroyed it
        self._nccl_groups: set[str] = set()
        self._receiving: str | None = None  # the group a broadcast is being received on, for /server_info
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_trainers, name="wsync-trainer-watchdog", daemon=True)
        self._watchdog.start()
        self._session: _Session | None = None
        self._last_session_error: str | None = None

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

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: list[int], sp: SamplingParams, return_logprob: bool, rid: str | None = None) -> dict:
        """Decode one prompt; SGLang's result shape ``{"text", "output_ids", "meta_info"}``."""
        t0 = time.perf_counter()
        self._check_sampling(prompt, sp)
        max_new = min(sp.max_new_tokens, self.context_length - len(prompt))
        gen = _Gen(rid or uuid.uuid4().hex)
        with self._cv:
            self._gens.add(gen)
        st = None
        restarts = 0
        try:
            while True:
                with self._cv:
                    while self._paused and gen.abort is None:
                        gen.state = "parked" if st is not None else "waiting"
                        self._cv.wait()
                if gen.abort is not None:
                    break
                self._rw.acquire_read()
                try:
                    with self._cv:
                        gen.state = "running"
                    if st is None or st.epoch != self._epoch:
                        restarts += st is not None
                        st = _Decode(self, prompt, sp, max_new, return_logprob)
                    st.run(gen, lambda: self._paused)
                finally:
                    with self._cv:
                        gen.state = "parked"
                        self._cv.notify_all()
                    self._rw.release_read()
                if st.finish is not None or gen.abort is not None:
                    break
        finally:
            with self._cv:
                self._gens.discard(gen)
                self._cv.notify_all()
        if st is None:  # aborted before it started
            st = _Decode.empty(self, prompt, max_new)
        if st.finish is None:
            st.finish = {"type": "abort", "message": gen.abort, "status_code": None, "err_type": None}
        return st.result(gen.rid, restarts, time.perf_counter() - t0)

    def _check_sampling(self, prompt: list[int], sp: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not prompt:
            raise RequestError("the prompt is empty; send non-empty text or input_ids")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids contain {bad[:5]}, outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.context_length:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model's context length is {self.context_length}")
        checks = [
            (sp.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (sp.temperature >= 0, "temperature must be >= 0"),
            (0 < sp.top_p <= 1, "top_p must be in (0, 1]"),
            (sp.top_k == -1 or sp.top_k >= 1, "top_k must be -1 (all) or >= 1"),
            (0 <= sp.min_p <= 1, "min_p must be in [0, 1]"),
            (sp.n == 1, "the reference server supports n=1 only; send the prompt several times"),
            (sp.frequency_penalty == 0 and sp.presence_penalty == 0 and sp.repetition_penalty == 1,
             "the reference server does not implement frequency/presence/repetition penalties; leave them at 0, 0, 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise RequestError(f"sampling_params: {msg}")

    # ------------------------------------------------------------------ pause / abort

    def pause(self, mode: str) -> None:
        """Stop generating; returns when no generation holds the weights (abort: when they have ended)."""
        with self._cv:
            self._paused, self._pause_mode = True, mode
            victims = set(self._gens) if mode == "abort" else set()
            for g in victims:
                g.abort = g.abort or "Abort by pause_generation."
            self._cv.notify_all()
            while any(g.state == "running" for g in self._gens) or (victims & self._gens):
                self._cv.wait(timeout=1.0)
        self.log.info("generation paused (mode %s)", mode)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()
        self.log.info("generation continued")

    def abort_all(self, why: str) -> int:
        with self._cv:
            for g in self._gens:
                g.abort = g.abort or why
            self._cv.notify_all()
            return len(self._gens)

    # ------------------------------------------------------------------ groups

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                   backend: str) -> str:
        """Join the trainer's custom process group as rank ``rank_offset`` (TP rank 0); blocks for the rendezvous."""
        if backend not in ("gloo", "nccl"):
            raise RequestError(f"Failed to initialize custom process group: backend must be 'nccl' or 'gloo', got {backend!r}.")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RequestError(
                "Failed to initialize custom process group: backend 'nccl' needs CUDA, which this server does not "
                "have (the reference server runs on CPU); initialize the group with backend='gloo'."
            )
        rank = rank_offset
        if not 0 < rank < world_size:
            raise RequestError(
                f"Failed to initialize custom process group: rank_offset {rank_offset} gives rank {rank}, outside "
                f"1..{world_size - 1} (rank 0 is the trainer; world_size = 1 + all servers' TP ranks)."
            )
        with self._update_lock:
            if group_name in self._groups:
                self.log.warning("group %s is initialized again; dropping the old one", group_name)
                self._drop_group(group_name, "it was initialized again")
            self._dead_groups.pop(group_name, None)
        self.log.info("joining group %s at %s:%s as rank %d/%d (%s)", group_name, master_address, master_port, rank,
                      world_size, backend)
        try:
            pg = init_custom_process_group(
                master_address=master_address, master_port=int(master_port), world_size=world_size, rank=rank,
                group_name=group_name, backend=backend, timeout=self.group_timeout,
            )
        except (BridgeError, RuntimeError, ValueError) as e:
            raise RequestError(f"Failed to initialize custom process group: {e}.") from e
        with self._update_lock:
            self._groups[group_name] = pg
            if backend == "nccl":
                self._nccl_groups.add(group_name)
        return "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> str:
        with self._update_lock:
            if group_name not in self._groups:
                raise RequestError("The group to be destroyed does not exist.")
            self._drop_group(group_name, "it was destroyed")
            self._dead_groups.pop(group_name, None)
        return "Succeeded to destroy custom process group."

    def _drop_group(self, name: str, why: str) -> None:
        # Caller holds _update_lock.
        destroy_custom_process_group(self._groups.pop(name, None))
        self._nccl_groups.discard(name)
        self._dead_groups[name] = why
        if self._session is not None and name in self._session.groups:
            self._abort_session(f"group {name} was dropped during the session ({why})")

    def close(self) -> None:
        """Destroy every group (gloo aborts the process at exit otherwise)."""
        self._closing.set()
        for name in list(self._groups):
            destroy_custom_process_group(self._groups.pop(name))

    def _watch_trainers(self, interval: float = 1.0) -> None:
        """Notice a trainer that died between requests: its group's TCP store (hosted by group rank 0) is gone.

        Without this, a trainer killed between two buckets would leave its session open and generation
        paused forever. A dead trainer's group is dropped, its session aborted, and a pause lifted.
        """
        from torch.distributed import distributed_c10d as c10d

        while not self._closing.wait(interval):
            for name, pg in list(self._groups.items()):
                store = c10d._world.pg_map.get(pg, (None, None))[1]
                if store is None:
                    continue
                try:
                    store.check(["wsync/alive"])
                except Exception as e:  # noqa: BLE001 - DistNetworkError / timeout: the trainer is gone
                    self._trainer_gone(name, pg, e)

    def _trainer_gone(self, name: str, pg, e: Exception) -> None:
        # A receive in progress on this group fails by itself and cleans up; try again next round.
        if not self._update_lock.acquire(timeout=0.1):
            return
        try:
            if self._groups.get(name) is not pg:
                return
            self.log.warning("the trainer of group %s is gone (%s); dropping the group", name, str(e).splitlines()[0])
            self._drop_group(name, "its trainer (group rank 0, the host of its store) is gone")
            if self._paused:
                self.log.warning("continuing generation on the previous weights: the trainer that paused it is gone")
                self.resume()
        finally:
            self._update_lock.release()

    # ------------------------------------------------------------------ sessions

    def begin_session(self) -> str:
        with self._update_lock:
            if self._session is not None:
                raise RequestError("A weight update session is already open; call end_weight_update() first.")
            self._session, self._last_session_error = _Session(), None
        self.log.info("weight update session opened")
        return "Weight update session started."

    def end_session(self) -> str:
        with self._update_lock:
            s = self._session
            if s is None:
                why = f" The last session was aborted: {self._last_session_error}" if self._last_session_error else ""
                raise RequestError(f"No weight update session is open; call begin_weight_update() first.{why}")
            self._session = None
            self._swap(s.staged, s.version)
        msg = f"Weight update session ended: {len(s.staged)} tensors from {s.requests} requests applied atomically."
        if s.version is not None:
            msg += f" Weight version updated to {s.version}."
        return msg

    def _abort_session(self, why: str) -> None:
        if self._session is not None:
            n = len(self._session.staged)
            self._session, self._last_session_error = None, why
            self.log.warning("weight update session aborted, %d staged tensors discarded: %s", n, why)

    # ------------------------------------------------------------------ updates

    def update_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                           load_format: str | None, weight_version: str | None, abort_all_requests: bool) -> str:
        """Receive one broadcast request (see the module docstring); returns SGLang's success message."""
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_distributed(abort_all_requests=True).")
        t0 = time.perf_counter()
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."
            pg = self._groups.get(group_name)
            if pg is None:
                why = f" (the server destroyed it because {self._dead_groups[group_name]})" if group_name in self._dead_groups else ""
                self._abort_session(f"group {group_name} does not exist")
                raise RequestError(
                    f"Group {group_name} not in {sorted(self._groups)}{why}. Please call init_weights_update_group first."
                )
            flattened = load_format == "flattened_bucket"
            try:
                if load_format not in (None, "flattened_bucket"):
                    raise _WireError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
                if flattened and not self.features.flattened_bucket:
                    raise _WireError(
                        f"load_format 'flattened_bucket' needs SGLang >= 0.5.10; this server speaks {self.features.version}"
                    )
                specs = _wire_specs(names, dtypes, shapes)
            except _WireError as e:
                self._drop_group(group_name, "it was sent a request it could not receive")
                self._abort_session(str(e))
                raise RequestError(
                    f"Failed to update parameter online: {e}. The trainer's broadcast was not received, so group "
                    f"{group_name} was destroyed; call init_weights_update_group again.{keep}"
                ) from None
            problems = []
            if self.features.needs_session and self._session is None:
                problems.append(SESSION_REQUIRED_MESSAGE + "; call begin_weight_update() first")
            problems += self._check_specs(specs, flattened)
            nbytes = sum(s.nbytes for s in specs)
            if problems and nbytes > max(2 * self._param_bytes, 64 << 20):
                self._drop_group(group_name, "it was sent an invalid request too large to receive and discard")
                self._abort_session(problems[0])
                raise RequestError(f"Failed to update parameter online: {_join(problems)}. The {nbytes}-byte broadcast "
                                   f"was not received; group {group_name} was destroyed.{keep}")
            self._receiving = group_name
            try:
                received = self._receive(pg, specs, flattened, tag=f"{group_name}|{names}|{dtypes}|{shapes}",
                                         nccl=group_name in self._nccl_groups)
            except _SizeMismatch as e:
                problems.append(str(e))
                received = []
            except Exception as e:  # noqa: BLE001 - any receive failure leaves the group unusable
                self._drop_group(group_name, f"a broadcast on it failed ({e})")
                self._abort_session(f"broadcast failed: {e}")
                if self._paused:
                    # The trainer that paused generation died or stalled; it may never send
                    # /continue_generation. The old weights are intact, so serve them again.
                    self.log.warning("broadcast failed while paused: continuing generation on the previous weights")
                    self.resume()
                raise RequestError(
                    f"Failed to update parameter online: the broadcast on group {group_name} failed ({e}); the trainer "
                    f"may have died or timed out (group timeout {self.group_timeout:g} s). The group was destroyed; "
                    f"call init_weights_update_group again.{keep}"
                ) from e
            finally:
                self._receiving = None
            if problems:
                sess = " The update session was aborted; nothing it staged was applied." if self._session else ""
                self._abort_session(problems[0])
                raise RequestError(f"Failed to update parameter online: {_join(problems)}.{sess}{keep} "
                                   "(The broadcast was received and discarded; the group is still usable.)")
            return self._stage(received, weight_version, nbytes, t0, group_name)

    def _stage(self, received: list[tuple[str, torch.Tensor]], weight_version: str | None, nbytes: int, t0: float,
               group_name: str | None) -> str:
        """Caller holds _update_lock: stage a validated request in the session, or swap it in without one."""
        staged = {n: t for n, t in received if n not in self._aliases}
        dt = time.perf_counter() - t0
        if self._session is not None:
            s = self._session
            s.staged.update(staged)
            if group_name is not None:
                s.groups.add(group_name)
            s.requests += 1
            if weight_version is not None:
                s.version = str(weight_version)
            self.log.info("staged %d tensors (%d bytes) in %.3f s, %.2f GB/s", len(staged), nbytes, dt,
                          nbytes / max(dt, 1e-9) / 1e9)
            msg = "Succeeded to update parameter online (staged; applied at end_weight_update())."
            if weight_version is not None:
                msg += f" Weight version {weight_version} is applied with the weights at end_weight_update()."
            return msg
        self._swap(staged, weight_version if self.features.weight_version else None)
        msg = "Succeeded to update parameter online."
        if weight_version is not None and self.features.weight_version:
            msg += f" Weight version updated to {weight_version}."
        return msg

    def update_tensor(self, *, serialized_named_tensors: list[str], load_format: str | None,
                      weight_version: str | None, abort_all_requests: bool) -> str:
        """``/update_weights_from_tensor``: only the project's ``load_format="wsync_shm"`` on this CPU server.

        Each entry (one per TP rank; this server has one) is base64 of the JSON object ``{"path", "nbytes",
        "names", "dtypes", "shapes"}``: a file under /dev/shm (or the temp dir) holding one flattened bucket.
        Nothing is unpickled. The file is mapped read-only and copied out (the trainer unlinks it once we
        answer), validated like a distributed bucket, and staged in the session (swapped at
        end_weight_update). Any bad input answers 400, aborts the session, and changes nothing.
        """
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_tensor(abort_all_requests=True).")
        t0 = time.perf_counter()
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."

            def refuse(why: str) -> RequestError:
                sess = " The update session was aborted; nothing it staged was applied." if self._session else ""
                self._abort_session(why)
                return RequestError(f"Failed to update weights from tensor: {why}.{sess}{keep}")

            if load_format != SHM_LOAD_FORMAT:
                raise refuse(
                    f"load_format {load_format!r} is not supported by the reference server: CPU tensors cannot cross "
                    f"HTTP; use load_format={SHM_LOAD_FORMAT!r} with the reference server, or CUDA tensors with real SGLang"
                )
            if self.features.needs_session and self._session is None:
                raise refuse(SESSION_REQUIRED_MESSAGE.replace("update_weights_from_distributed", "update_weights_from_tensor")
                             + "; call begin_weight_update() first")
            try:
                if len(serialized_named_tensors) != 1:
                    raise _WireError(f"serialized_named_tensors has {len(serialized_named_tensors)} entries; this server "
                                     "has 1 TP rank, so send exactly 1")
                desc = _shm_descriptor(serialized_named_tensors[0])
                specs = _wire_specs(desc["names"], desc["dtypes"], desc["shapes"])
            except _WireError as e:
                raise refuse(str(e)) from None
            problems = self._check_specs(specs, flattened=True)
            nbytes = sum(sp.nbytes for sp in specs)
            if desc["nbytes"] != nbytes:
                problems.append(f"nbytes is {desc['nbytes']} but names/dtypes/shapes describe {nbytes} bytes")
            if problems:
                raise refuse(_join(problems))
            try:
                buf = _read_shm(desc["path"], nbytes)
            except _WireError as e:
                raise refuse(str(e)) from None
            return self._stage(unflatten_bucket(buf, specs), weight_version, nbytes, t0, None)

    def abort_session(self) -> str:
        """Project extension (``/wsync/abort_weight_update``): discard the open session, apply nothing."""
        with self._update_lock:
            if self._session is None:
                raise RequestError("No weight update session is open; nothing to abort.")
            self._abort_session("the trainer aborted it (/wsync/abort_weight_update)")
        return f"Weight update session aborted; nothing was applied; still serving weight version {self._version}."

    def _check_specs(self, specs: list[ParamSpec], flattened: bool) -> list[str]:
        problems, seen = [], set()
        for s in specs:
            target = self._params.get(self._aliases.get(s.name, s.name))
            if s.name in seen:
                problems.append(f"tensor {s.name!r} appears twice in one request")
            seen.add(s.name)
            if target is None:
                problems.append(
                    f"tensor {s.name!r} is not a parameter of the served model ({type(self.model).__name__}; names are "
                    f"HF checkpoint names such as {next(iter(self._params))!r})"
                )
                continue
            if tuple(target.shape) != s.shape:
                problems.append(f"tensor {s.name!r} has shape {list(s.shape)} but the served parameter has shape "
                                f"{list(target.shape)}; send the full (unsharded) tensor")
            if target.dtype != s.dtype:
                problems.append(f"tensor {s.name!r} is sent as {dtype_to_str(s.dtype)} but served as "
                                f"{dtype_to_str(target.dtype)}; cast to {dtype_to_str(target.dtype)} before sending")
        if flattened:
            try:
                Bucket(list(specs))
            except ConfigError as e:
                problems.append(f"Unaligned received tensor: {e}")
        return problems

    def _receive(self, pg, specs: list[ParamSpec], flattened: bool, tag: str, nccl: bool) -> list[tuple[str, torch.Tensor]]:
        if nccl:
            try:
                return _receive_nccl(pg, specs, flattened)
            except ConfigError:  # unaligned bucket, already reported by _check_specs
                return []
        # The pattern is the same on every server of the group: gloo relays a receiver's whole buffer,
        # slack included, to the next receiver of a broadcast tree.
        seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
        if flattened:
            nbytes = sum(s.nbytes for s in specs)
            buf = _recv_bytes(pg, nbytes, seed, "the flattened bucket")
            try:
                return unflatten_bucket(buf, specs)
            except ConfigError:  # unaligned: the problem was reported by _check_specs; hand back nothing
                return []
        out = []
        for i, s in enumerate(specs):
            buf = _recv_bytes(pg, s.nbytes, seed + i, f"tensor {s.name!r}")
            out.append((s.name, buf.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)))
        return out

    def update_disk(self, *, model_path: str, weight_version: str | None, abort_all_requests: bool) -> str:
        """Load a whole HF checkpoint directory, validate it, then swap; SGLang's success message."""
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_disk(abort_all_requests=True).")
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."
            t0 = time.perf_counter()
            tensors = _read_checkpoint(model_path, keep)
            problems, staged = [], {}
            for n, t in tensors.items():
                target = self._params.get(self._aliases.get(n, n))
                if target is None:
                    problems.append(f"checkpoint tensor {n!r} is not a parameter of the served model")
                elif tuple(t.shape) != tuple(target.shape):
                    problems.append(f"checkpoint tensor {n!r} has shape {list(t.shape)}, the served one {list(target.shape)}")
                elif t.is_floating_point() != target.is_floating_point():
                    problems.append(f"checkpoint tensor {n!r} is {dtype_to_str(t.dtype)}, the served one {dtype_to_str(target.dtype)}")
                elif n not in self._aliases:
                    staged[n] = t.to(target.dtype)  # SGLang's loader casts into the parameter's dtype, so do we
            missing = [n for n in self._params if n not in staged and n not in tensors]
            if missing:
                problems.append(f"the checkpoint lacks {len(missing)} of the {len(self._params)} served parameters, "
                                f"e.g. {missing[:3]}")
            if problems:
                raise RequestError(f"Failed to update weights: {model_path}: {_join(problems)}.{keep}")
            self._swap(staged, weight_version if self.features.weight_version else None, model_path=model_path)
            self.log.info("loaded %s from disk in %.2f s", model_path, time.perf_counter() - t0)
        return "Succeeded to update model weights."

    def set_version(self, new_version: str, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.abort_all("Abort by update_weight_version(abort_all_requests=True).")
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


class _WireError(Exception):
    pass


def _join(problems: list[str], limit: int = 4) -> str:
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def _shm_descriptor(entry) -> dict:
    """Decode one ``wsync_shm`` entry: base64 of a JSON object (never a pickle); _WireError if malformed."""
    import base64
    import binascii
    import json

    if not isinstance(entry, str):
        raise _WireError("the serialized entry must be a base64 string")
    try:
        desc = json.loads(base64.b64decode(entry, validate=True))
    except (binascii.Error, ValueError) as e:
        raise _WireError(f"the serialized entry is not base64 of a JSON object ({e})") from None
    if not isinstance(desc, dict):
        raise _WireError(f"the serialized entry must decode to a JSON object, got {type(desc).__name__}")
    missing = [k for k in ("path", "nbytes", "names", "dtypes", "shapes") if k not in desc]
    if missing:
        raise _WireError(f"the serialized entry lacks {missing}; it needs path, nbytes, names, dtypes, shapes")
    if not isinstance(desc["path"], str) or not desc["path"]:
        raise _WireError(f"'path' must be a non-empty string, got {desc['path']!r}")
    if isinstance(desc["nbytes"], bool) or not isinstance(desc["nbytes"], int) or desc["nbytes"] < 0:
        raise _WireError(f"'nbytes' must be a non-negative integer, got {desc['nbytes']!r}")
    for key in ("names", "dtypes"):
        if not isinstance(desc[key], list) or not all(isinstance(x, str) for x in desc[key]):
            raise _WireError(f"{key!r} must be a list of strings")
    if not isinstance(desc["shapes"], list) or not all(
        isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in desc["shapes"]
    ):
        raise _WireError("'shapes' must be a list of lists of integers")
    return desc


def _shm_roots() -> list[str]:
    import tempfile

    return [os.path.realpath(d) for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def _read_shm(path: str, nbytes: int) -> torch.Tensor:
    """Copy a shared-memory bucket file into a new tensor; _WireError if the file is not acceptable."""
    import mmap
    import stat

    import numpy as np

    real = os.path.realpath(path)
    roots = _shm_roots()
    if not any(real.startswith(r.rstrip("/") + "/") for r in roots):
        raise _WireError(f"path {path!r} is not under {' or '.join(roots)}; shared-memory buckets must live there")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise _WireError(f"cannot open {path!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _WireError(f"{path!r} is not a regular file")
        if st.st_size != nbytes:
            raise _WireError(f"{path!r} holds {st.st_size} bytes, but nbytes and names/dtypes/shapes say {nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as mm:
                view = np.frombuffer(mm, dtype=np.uint8)
                out.numpy()[:] = view
                del view
        return out
    finally:
        os.close(fd)


def _wire_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[ParamSpec]:
    """What the trainer says it broadcasts; _WireError when that cannot be known."""
    if not len(names) == len(dtypes) == len(shapes):
        raise _WireError(f"names, dtypes and shapes have different lengths ({len(names)}, {len(dtypes)}, {len(shapes)})")
    specs = []
    for n, d, s in zip(names, dtypes, shapes):
        dt = getattr(torch, d, None) if isinstance(d, str) and not d.startswith("_") else None
        if not isinstance(dt, torch.dtype):
            raise _WireError(
                f"tensor {n!r} has dtype {d!r}, which is not a torch dtype name; send the bare name such as "
                "'bfloat16' (SGLang resolves dtypes with getattr(torch, name))"
            )
        if any(x < 0 for x in s):
            raise _WireError(f"tensor {n!r} has a negative dimension in shape {s}")
        specs.append(ParamSpec(n, tuple(s), dt))
    return specs


def _receive_nccl(pg, specs: list[ParamSpec], flattened: bool) -> list[tuple[str, torch.Tensor]]:
    """NCCL receives exactly as SGLang does (NCCL needs equal counts and dtypes on every rank, so no slack
    and no byte-size check), on the current CUDA device, then copies to the CPU model."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if flattened:
        buf = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=0, group=pg)
        return unflatten_bucket(buf.cpu(), specs)
    out = []
    for s in specs:
        t = torch.empty(s.shape, dtype=s.dtype, device=dev)
        dist.broadcast(t, src=0, group=pg)
        out.append((s.name, t.cpu()))
    return out


def _recv_bytes(pg, nbytes: int, seed: int, what: str) -> torch.Tensor:
    """Receive one broadcast of ``nbytes`` bytes into a slack buffer; _SizeMismatch if the size differs."""
    slack = max(nbytes, 4096)
    buf = torch.empty(nbytes + slack, dtype=torch.uint8)
    lo = max(0, nbytes - _PROBE)
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    pattern = torch.randint(0, 256, (nbytes + _PROBE - lo,), dtype=torch.uint8, generator=g)
    buf[lo : nbytes + _PROBE] = pattern
    dist.broadcast(buf, src=0, group=pg)
    if not torch.equal(buf[nbytes : nbytes + _PROBE], pattern[nbytes - lo :]):
        raise _SizeMismatch(f"{what}: the trainer broadcast more than the {nbytes} bytes its names/dtypes/shapes announce")
    if nbytes >= _MIN_UNDER_CHECK and torch.equal(buf[lo:nbytes], pattern[: nbytes - lo]):
        raise _SizeMismatch(f"{what}: the trainer broadcast fewer than the {nbytes} bytes its names/dtypes/shapes announce")
    return buf[:nbytes]


def _read_checkpoint(path: str, keep: str) -> dict[str, torch.Tensor]:
    from bridge.snapshot import read_snapshot

    if not os.path.isdir(path):
        raise RequestError(f"Failed to get weights iterator: {path} does not exist or is not a directory.{keep}")
    try:
        return read_snapshot(path, verify=True)
    except SnapshotError as e:
        raise RequestError(f"Failed to get weights iterator: {e}.{keep}") from e
    except Exception as e:  # noqa: BLE001 - safetensors/JSON/OS errors of a corrupt directory
        raise RequestError(f"Failed to get weights iterator: cannot read {path}: {type(e).__name__}: {e}.{keep}") from e


class _Decode:
    """The decoding state of one generation under one weights epoch; ``run`` continues it."""

    def __init__(self, state: ModelState, prompt: list[int], sp: SamplingParams, max_new: int, logprob: bool):
        from transformers import DynamicCache

        self.s, self.prompt, self.sp, self.max_new, self.want_logprob = state, prompt, sp, max_new, logprob
        self.epoch, self.version = state._epoch, state._version
        self.greedy = sp.temperature < 1e-6 or sp.top_k == 1
        seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
        self.gen = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
        self.cache = DynamicCache(config=state.model.config)
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict | None = None
        self.stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        self.stop_ids = [] if sp.ignore_eos else list(dict.fromkeys([*(sp.stop_token_ids or []), *state.eos_token_ids]))
        self.text_cut: int | None = None

    @classmethod
    def empty(cls, state: ModelState, prompt: list[int], max_new: int) -> _Decode:
        d = cls.__new__(cls)
        d.s, d.prompt, d.out, d.logprobs, d.finish, d.version = state, prompt, [], [], None, state._version
        d.want_logprob, d.text_cut, d.sp = False, None, SamplingParams()
        return d

    @torch.no_grad()
    def run(self, gen: _Gen, paused) -> None:
        model = self.s.model
        if self.max_new <= 0:
            self.finish = {"type": "length", "length": self.sp.max_new_tokens}
            return
        while self.finish is None:
            if gen.abort is not None or paused():
                return
            pos = len(self.prompt) + len(self.out)
            ids = self.prompt if not self.out else self.out[-1:]
            start = pos - len(ids) if self.out else 0
            # Same calls as transformers' greedy generate (prefill, then one token with the cache),
            # so greedy outputs are identical to model.generate(do_sample=False).
            o = model(input_ids=torch.tensor([ids]), use_cache=True, **{self.s._cache_kw: self.cache},
                      cache_position=torch.arange(start, start + len(ids)), logits_to_keep=1)
            logits = o.logits[0, -1].float()
            if len(self.out) < self.sp.min_new_tokens and self.stop_ids:
                logits[self.stop_ids] = -math.inf
            tok, lp = self._pick(logits)
            self.out.append(tok)
            if self.want_logprob:
                self.logprobs.append(lp)
            self._check_finish(tok)

    def _pick(self, logits: torch.Tensor) -> tuple[int, float]:
        if self.greedy:
            tok = int(torch.argmax(logits))
            return tok, float(torch.log_softmax(logits, -1)[tok]) if self.want_logprob else 0.0
        sp = self.sp
        scaled = logits / sp.temperature
        probs = torch.softmax(scaled, -1)
        if sp.top_k > 0 and sp.top_k < probs.numel():
            kth = torch.topk(probs, sp.top_k).values[-1]
            probs = torch.where(probs < kth, 0.0, probs)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, -1)
            sorted_p[(cum - sorted_p) > sp.top_p * cum[-1]] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        if sp.min_p > 0:
            probs = torch.where(probs < sp.min_p * probs.max(), 0.0, probs)
        tok = int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
        return tok, float(torch.log_softmax(scaled, -1)[tok]) if self.want_logprob else 0.0

    def _check_finish(self, tok: int) -> None:
        if tok in self.stop_ids:  # (masked out before min_new_tokens)
            self.finish = {"type": "stop", "matched": tok}
            return
        if self.stops:
            text = self._decode()
            hits = [(text.find(s), s) for s in self.stops if s and s in text]
            if hits:
                at, s = min(hits)
                self.text_cut = at
                self.finish = {"type": "stop", "matched": s}
                return
        if len(self.out) >= self.max_new:
            self.finish = {"type": "length", "length": self.sp.max_new_tokens}

    def _decode(self) -> str:
        return self.s.tokenizer.decode(self.out, skip_special_tokens=self.sp.skip_special_tokens)

    def result(self, rid: str, restarts: int, seconds: float) -> dict:
        text = self._decode() if self.out else ""
        if self.text_cut is not None:
            text = text[: self.text_cut]
        meta = {
            "id": rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.out),
            "cached_tokens": 0,
            "weight_version": self.version,
            "num_retractions": restarts,
            "e2e_latency": seconds,
        }
        if self.want_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.out)]
        return {"text": text, "output_ids": list(self.out), "meta_info": meta}


class _VersionLog(logging.LoggerAdapter):
    """Prefixes every line with the emulated SGLang version and the served weight version."""

    def __init__(self, logger: logging.Logger, state: ModelState):
        super().__init__(logger, {})
        self.state = state

    def process(self, msg, kwargs):
        return f"[sglang {self.state.features.version} | weights {self.state._version}] {msg}", kwargs
