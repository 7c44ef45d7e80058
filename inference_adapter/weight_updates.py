"""Weight updates: the begin/end session, staging, validation, and the distributed/shm/disk receive paths.

An update first *stages* (receive or read, then validate), and only a complete, valid update is
swapped in (:meth:`ServedWeights.swap <inference_adapter.weights.ServedWeights.swap>`); anything that
fails leaves the previous weights and version serving, and its answer says so (:meth:`WeightUpdates._refused`,
the one place a refused update's message is worded).

How an update travels:

* Broadcast (``update_distributed``): the metadata is checked first. If it cannot describe what is on
  the wire (unparseable dtype, ragged lists, unsupported ``load_format``) the server cannot receive
  it; it answers 400 and destroys the group, because the trainer's bytes are already in flight and
  would be read by the next receive. If it is well-formed but wrong for this model (unknown name,
  wrong shape, dtype other than the served dtype, unaligned bucket, or no open session on a 0.5.21+
  protocol), the server still receives the broadcast as announced -- so the trainer does not hang and
  the group stays usable -- then discards it and answers 400. With a session (0.5.21+) buckets are
  staged until ``end_weight_update``, which swaps them together with the ``weight_version`` given on
  any bucket; any failure aborts the whole session. (Receiving and the byte-size check on gloo:
  :mod:`inference_adapter.wire`.)
* Co-located (``update_tensor``, ``/update_weights_from_tensor``): outside a session (0.5.21+) every request
  gets SGLang's session error first, as SGLang's scheduler checks the session before it reads the payload.
  SGLang's own payload (``load_format`` null or ``"flattened_bucket"``) of same-host CPU tensors is unpickled
  as SGLang 0.5.23's allowlisted unpickler does (:mod:`inference_adapter.tensor_payload`), copied out of the
  sender's shared memory and staged. The project extension ``load_format="wsync_shm"`` names a file under
  /dev/shm (or the temp dir) holding one flattened bucket, which is checked like a distributed bucket, copied
  out and staged in the session. Bad input answers 400, aborts the session and changes nothing. A
  descriptor's ``pid`` (the trainer's rank 0) makes that process the session's owner: once it is gone, the
  watchdog discards the session and lifts the pause (see :class:`~inference_adapter.sessions.Session`).
* Disk (``update_disk``): only what :mod:`inference_adapter.disk_reader` lets through, read and checked
  completely (every served parameter, shapes; dtypes are cast as SGLang casts them) before the swap.

Refused on every path, beyond SGLang (:mod:`inference_adapter.checks`): weights holding NaN or Inf (in a
session each request's tensors are checked on a background thread while the next bucket arrives, and
``end_weight_update`` refuses the session if any held them), version labels that answers cannot carry,
and a version older than the served one unless the request starts a new run (:class:`RunClaim`).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.codecs.fp8 import FP8_DTYPE, SCALE_SUFFIX
from bridge.errors import ConfigError
from bridge.protocol import (
    QUANTIZATION_MISMATCH,
    SESSION_REQUIRED_MESSAGE,
    SHM_LOAD_FORMAT,
    VERSION_GOES_BACK,
    ProtocolFeatures,
)
from bridge.tensors import ParamSpec, dtype_to_str
from inference_adapter.checks import (
    RunClaim,
    finite_checker,
    join_problems,
    non_finite_problem,
    version_number,
    version_problem,
)
from inference_adapter.delta import DeltaRefused, Deltas, delta_specs
from inference_adapter.disk_reader import CheckpointRefused, checkpoint_to_stage, missing_problem, read_checkpoint
from inference_adapter.errors import RequestError
from inference_adapter.groups import TrainerGroups
from inference_adapter.sessions import Session, SessionControl, session_owner
from inference_adapter.tensor_payload import PayloadRefused, named_tensors
from inference_adapter.weights import ServedWeights
from inference_adapter.wire import (
    ReceiveTimeout,
    SizeMismatch,
    WireError,
    read_shm,
    receive_bound,
    receive_tensors,
    shm_descriptor,
    wire_specs,
)
from inference_adapter.writers import WriterLeases

__all__ = ["PauseControl", "WeightUpdates"]

_DISTRIBUTED = "Failed to update parameter online"
_TENSOR = "Failed to update weights from tensor"
_DISK = "Failed to update weights"
_SESSION_ABORTED = " The update session was aborted; nothing it staged was applied."


class PauseControl(Protocol):
    """What a weight update needs of generation: end the requests it asks to, and lift a pause."""

    @property
    def paused(self) -> bool: ...

    def resume(self) -> None: ...

    def abort_all(self, why: str) -> int: ...


class WeightUpdates(SessionControl):
    """Every weight operation of the server, one at a time under ``lock``, and the state they share. The
    session and the writer lease are :class:`~inference_adapter.sessions.SessionControl`'s; every
    weight change first asks the lease (:mod:`inference_adapter.writers`) whether its writer may make it.

    Args:
        weights: the served weights, swapped only when an update is complete and valid.
        generation: ended by ``abort_all_requests``, resumed when the trainer that paused it is gone.
        features: the emulated SGLang version's protocol features.
        log: the server's logger.
        group_timeout: ``--group-timeout``: rendezvous and broadcast limit, and an idle session's lifetime.
        receive_timeout: ``--receive-timeout`` (see :func:`~inference_adapter.wire.receive_bound`).
        disk_roots: the resolved directories disk updates may load from.
        allow_version_rollback: accept older versions without a new run (SGLang's behaviour).
    """

    def __init__(self, *, weights: ServedWeights, generation: PauseControl, features: ProtocolFeatures, log,
                 group_timeout: float, receive_timeout: float, disk_roots: list[str], allow_version_rollback: bool):
        self.weights = weights
        self.generation = generation
        self.features = features
        self.log = log
        self.group_timeout = group_timeout
        self.receive_timeout = receive_timeout
        self.disk_roots = disk_roots
        self.allow_version_rollback = allow_version_rollback
        self.lock = threading.Lock()  # one weight operation at a time
        self.groups = TrainerGroups(lock=self.lock, log=log, timeout=group_timeout, on_drop=self._group_dropped)
        self.session: Session | None = None
        self.last_session_error: str | None = None  # why the last session was aborted, for end_weight_update
        self.run_id: str | None = None  # the run (RunClaim.run_id) the served version came from
        self.deltas = Deltas(weights)  # the delta encoding's buckets (inference_adapter.delta)
        self.writers = WriterLeases()  # who may change the weights now
        # Why the served weights mix two versions under one label (a bucket loaded in place, as SGLang loads
        # them, with no label yet): the server then never resumes itself; the writer's labelling or resume does.
        self.torn: str | None = None

    # ------------------------------------------------------------------ refusals

    def _refused(self, action: str, problem: str, *, outcome: str = "", tail: str = "",
                 reason: str | None = None) -> RequestError:
        """A refused update: ``{action}: {problem}.{outcome}`` then that the served weights stayed, then ``tail``."""
        kept = f" Nothing was applied; still serving weight version {self.weights.version}."
        return RequestError(f"{action}: {problem}.{outcome}{kept}{tail}", reason=reason)

    def _refuse(self, action: str, problem: str, *, abort_why: str | None = None, outcome: str | None = None,
                tail: str = "", reason: str | None = None) -> RequestError:
        """Caller holds the lock: abort the open session (for ``abort_why``, default ``problem``) and refuse.

        ``outcome`` says what became of the request; by default, that the open session (if any) was aborted.
        """
        if outcome is None:
            outcome = _SESSION_ABORTED if self.session is not None else ""
        self._abort_session(abort_why or problem)
        return self._refused(action, problem, outcome=outcome, tail=tail, reason=reason)

    def _abort_session(self, why: str) -> None:
        if self.session is not None:
            n = len(self.session.staged)
            self.session, self.last_session_error = None, why
            self.log.warning("weight update session aborted, %d staged tensors discarded: %s", n, why)

    def _group_dropped(self, name: str, why: str) -> None:
        if self.session is not None and name in self.session.groups:
            self._abort_session(f"group {name} was dropped during the session ({why})")

    def _continue_generation(self, why: str) -> None:
        """The trainer that paused generation is gone or failed: serve the old weights again, unless buckets
        were loaded in place since they were labelled (``torn``): a mix of two versions is never served."""
        if self.generation.paused and self.torn is not None:
            self.log.warning("staying paused although %s: %s; a complete update resumes it", why, self.torn)
        elif self.generation.paused:
            self.log.warning("continuing generation on the previous weights: %s", why)
            self.generation.resume()

    def writer_continues(self) -> None:
        """``/continue_generation``: the writer says what it loaded in place is complete, so a later failure may
        resume the server on it (one assignment: no lock, so the route never waits behind a load)."""
        self.torn = None

    def _writer_may(self, run: RunClaim, action: str, group_name: str) -> None:
        """Caller holds the lock: refuse a broadcast of a writer other than the lease's holder; its bytes are
        already in flight on its own group, which is dropped (the holder's session is left alone)."""
        try:
            self.writers.check(run.writer, action)
        except RequestError:
            if group_name in self.groups.pgs and not (self.session and group_name in self.session.groups):
                self.groups.drop(group_name, "it carried a broadcast of a writer that does not hold the server")
            raise

    # ------------------------------------------------------------------ runs and versions

    def _rollback_problem(self, version: str | None, run: RunClaim) -> str | None:
        """Caller holds the lock: why ``version`` must not replace the served one, or None (see RunClaim)."""
        if self.allow_version_rollback or run.starts_new_run(self.run_id):
            return None
        old, new = version_number(self.weights.version), version_number(version)
        if old is None or new is None or new >= old:
            return None
        which = f"run {self.run_id!r}" if self.run_id is not None else "a run without wsync_run_id"
        return (f"weight_version {version} is older than the served version {self.weights.version} of {which}; a "
                "restarted trainer must not replace newer weights. To start a new run on this server, send "
                "wsync_new_run=true, or a wsync_run_id other than the served run's")

    def _claim(self, version: str | None, run: RunClaim) -> None:
        """Caller holds the lock and is about to serve ``version``: remember the run it came from."""
        if version is not None and (run.run_id is not None or run.new_run):
            self.run_id = run.run_id

    def _swap(self, staged: dict[str, torch.Tensor], version: str | None, run: RunClaim,
              model_path: str | None = None) -> None:
        """Caller holds the lock: serve ``staged`` (and ``version``), remembering the run it came from."""
        if "weights" in self.generation.released_memory():
            raise RequestError("Weight update refused, nothing applied: the weights' memory is released "
                               "(/release_memory_occupation); /resume_memory_occupation with tags ['weights'] first")
        self._claim(version, run)
        self.weights.swap(staged, version, model_path=model_path)
        self.torn = None  # a whole update (a session, a disk load, a labelled bucket); see _stage
        self.deltas.after_swap()
        self.log.info("swapped in %d tensors", len(staged))

    def set_version(self, new_version: str, abort_all_requests: bool, run: RunClaim) -> None:
        """``/update_weight_version``: relabel the served weights."""
        problem = version_problem(new_version, "new_version")
        if problem:
            raise RequestError(f"Failed to update weight version: {problem}.")
        with self.lock:
            self.writers.check(run.writer, "Failed to update weight version")
            problem = self._rollback_problem(new_version, run)
            if problem:
                raise RequestError(f"Failed to update weight version: {problem}.", reason=VERSION_GOES_BACK)
            if abort_all_requests:
                self.generation.abort_all("Abort by update_weight_version(abort_all_requests=True).")
            self._claim(new_version, run)
            self.weights.set_version(new_version)
            self.torn = None  # the writer labels what it loaded in place: complete
        self.log.info("weight version set")

    def _stage(self, received: list[tuple[str, torch.Tensor]], weight_version: str | None, nbytes: int, t0: float,
               group_name: str | None, run: RunClaim, check: dict | None = None) -> str:
        """Caller holds the lock: stage a validated request (``check``: its new values, if not all) or swap it in."""
        staged = {n: t for n, t in received if n not in self.weights.aliases}
        check = staged if check is None else check
        run = self.session.run if self.session is not None else run  # a session claims its run at begin
        problem = self._rollback_problem(weight_version, run)
        reason = VERSION_GOES_BACK if problem else None
        if self.session is None:
            problem = problem or non_finite_problem(check)
        if problem:
            raise self._refuse(_DISTRIBUTED, problem, reason=reason)
        if self.session is None:  # loaded in place, as SGLang loads each bucket
            label = weight_version if self.features.weight_version else None
            torn = None if label is not None else self.torn or \
                f"tensors were loaded in place since weight version {self.weights.version} was labelled"
            self._swap(staged, label, run)
            self.torn = torn
            msg = "Succeeded to update parameter online."
            if weight_version is not None and self.features.weight_version:
                msg += f" Weight version updated to {weight_version}."
            return msg
        s = self.session
        s.last_request = time.monotonic()
        s.finite_checks.append(finite_checker.submit(non_finite_problem, check))
        s.staged.update(staged)
        if group_name is not None:
            s.groups.add(group_name)
        s.requests += 1
        if weight_version is not None:
            s.version = str(weight_version)
        dt = time.perf_counter() - t0
        self.log.info("staged %d tensors (%d bytes) in %.3f s, %.2f GB/s", len(staged), nbytes, dt,
                      nbytes / max(dt, 1e-9) / 1e9)
        msg = "Succeeded to update parameter online (staged; applied at end_weight_update())."
        if weight_version is not None:
            msg += f" Weight version {weight_version} is applied with the weights at end_weight_update()."
        return msg

    # ------------------------------------------------------------------ checks shared by the update paths

    def _check_specs(self, specs: list[ParamSpec], flattened: bool) -> list[str]:
        """Why announced tensors are wrong for the served model (names, shapes, dtypes, bucket alignment)."""
        problems, seen = [], set()
        for s in specs:
            target = self.weights.target(s.name)
            if s.name in seen:
                problems.append(f"tensor {s.name!r} appears twice in one request")
            seen.add(s.name)
            if target is None and s.name.endswith(SCALE_SUFFIX) and self.weights.target(s.name.removesuffix(SCALE_SUFFIX)) is not None:
                problems.append(f"{QUANTIZATION_MISMATCH}: tensor {s.name!r} is an FP8 block scale, but this server "
                                f"serves {s.name.removesuffix(SCALE_SUFFIX)!r} unquantized ({dtype_to_str(self.weights.target(s.name.removesuffix(SCALE_SUFFIX)).dtype)}; "
                                "it was not started with --quantization fp8): publish with the full encoding, or "
                                "restart the server with --quantization fp8")
                continue
            if target is None:
                problems.append(
                    f"tensor {s.name!r} is not a parameter of the served model ({self.weights.model_type}; names are "
                    f"HF checkpoint names such as {next(iter(self.weights.params))!r})"
                )
                continue
            if tuple(target.shape) != s.shape:
                problems.append(f"tensor {s.name!r} has shape {list(s.shape)} but the served parameter has shape "
                                f"{list(target.shape)}; the trainer's model is not the served one (or it sent a shard: send full tensors)")
            if target.dtype != s.dtype and FP8_DTYPE in (target.dtype, s.dtype):
                problems.append(_quantization_problem(s, target))
            elif target.dtype != s.dtype and not (target.dtype.is_floating_point and s.dtype.is_floating_point):
                # SGLang's loaders copy what they receive into the parameter, casting a float32 tensor to a bf16 one;
                # a tensor of integers or booleans is never weights (SGLang would cast that too).
                problems.append(f"tensor {s.name!r} is sent as {dtype_to_str(s.dtype)} but served as "
                                f"{dtype_to_str(target.dtype)}; send floating-point weights (they are cast to "
                                f"{dtype_to_str(target.dtype)} as SGLang casts them)")
        if flattened:
            try:
                Bucket(list(specs))
            except ConfigError as e:
                problems.append(f"Unaligned received tensor: {e}")
        return problems

    def _request_problems(self, weight_version: str | None, specs: list[ParamSpec], flattened: bool,
                          route: str) -> list[str]:
        """Why a well-formed update request must be refused: no session (first, as SGLang's scheduler checks it
        first), its version label, its tensors."""
        problems = []
        if self.features.needs_session and self.session is None:
            problems.append(SESSION_REQUIRED_MESSAGE.replace("update_weights_from_distributed", route)
                            + "; call begin_weight_update() first")
        problems += [p for p in [version_problem(weight_version, "weight_version")] if p]
        return problems + self._check_specs(specs, flattened)

    # ------------------------------------------------------------------ broadcast

    def update_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                           load_format: str | None, weight_version: str | None, abort_all_requests: bool,
                           run: RunClaim, wsync_delta: dict | None = None) -> str:
        """Receive one broadcast request (see the module docstring); returns SGLang's success message."""
        if abort_all_requests and self.writers.may(run.writer):  # a refused writer ends nobody's requests
            self.generation.abort_all("Abort by update_weights_from_distributed(abort_all_requests=True).")
        t0 = time.perf_counter()
        with self.lock:
            self._writer_may(run, _DISTRIBUTED, group_name)
            pg = self.groups.pgs.get(group_name)
            if pg is None and self.features.needs_session and self.session is None:  # SGLang checks this first
                raise self._refused(_DISTRIBUTED, SESSION_REQUIRED_MESSAGE + "; call begin_weight_update() first")
            if pg is None:
                self._abort_session(f"group {group_name} does not exist")
                raise self.groups.missing(group_name)
            flattened = load_format == "flattened_bucket"
            specs = self._announced_specs(names, dtypes, shapes, group_name, load_format)
            table, problems = delta_specs(wsync_delta, specs) if wsync_delta is not None else (None, [])
            problems += self._request_problems(weight_version, table or specs, flattened and table is None,
                                               "update_weights_from_distributed")
            nbytes = sum(s.nbytes for s in specs)
            if problems and nbytes > max(2 * self.weights.nbytes, 64 << 20):
                self.groups.drop(group_name, "it was sent an invalid request too large to receive and discard")
                raise self._refuse(_DISTRIBUTED, join_problems(problems), abort_why=problems[0],
                                   outcome=f" The {nbytes}-byte broadcast was not received; group {group_name} was "
                                           "destroyed.", reason=_reason(problems))
            try:
                received = self._receive(pg, specs, flattened, tag=f"{group_name}|{names}|{dtypes}|{shapes}",
                                         group_name=group_name)
            except SizeMismatch as e:
                problems.append(str(e))
                received = []
            if problems:
                raise self._refuse(_DISTRIBUTED, join_problems(problems), abort_why=problems[0],
                                   tail=" (The broadcast was received and discarded; the group is still usable.)",
                                   reason=_reason(problems))
            received, check = self._from_delta(_DISTRIBUTED, wsync_delta, received, table)
            return self._stage(received, weight_version, nbytes, t0, group_name, run, check)

    def _from_delta(self, action: str, wsync_delta, received: list, table) -> tuple[list, dict | None]:
        """Caller holds the lock: a delta bucket's whole new tensors and new values (``received``, None: no delta)."""
        try:
            return (received, None) if wsync_delta is None else self.deltas.staged(wsync_delta, received[0][1], table)
        except (DeltaRefused, WireError) as e:  # a refused base names its reason (delta_base_mismatch)
            raise self._refuse(action, str(e), reason=getattr(e, "reason", None)) from None

    def _announced_specs(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                         load_format: str | None) -> list[ParamSpec]:
        """Caller holds the lock: what the trainer broadcasts; if that cannot be known, the group is destroyed
        (the bytes in flight would be read by the next receive) and the request refused."""
        try:
            if load_format not in (None, "flattened_bucket"):
                raise WireError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
            if load_format == "flattened_bucket" and not self.features.flattened_bucket:
                raise WireError(
                    f"load_format 'flattened_bucket' needs SGLang >= 0.5.6; this server speaks {self.features.version}"
                )
            return wire_specs(names, dtypes, shapes)
        except WireError as e:
            self.groups.drop(group_name, "it was sent a request it could not receive")
            raise self._refuse(_DISTRIBUTED, str(e), outcome=f" The trainer's broadcast was not received, so group "
                               f"{group_name} was destroyed; call init_weights_update_group again.") from None

    def _receive(self, pg, specs: list[ParamSpec], flattened: bool, tag: str,
                 group_name: str) -> list[tuple[str, torch.Tensor]]:
        """Caller holds the lock: the announced tensors off the group; SizeMismatch leaves it usable, any other
        failure destroys it, lifts a pause and refuses the request."""
        def bound(nbytes: int) -> float:
            return receive_bound(nbytes, self.receive_timeout, self.group_timeout)

        try:
            with self.groups.receiving_on(group_name):
                return receive_tensors(pg, specs, flattened, tag=tag, nccl=group_name in self.groups.nccl, bound=bound)
        except SizeMismatch:
            raise
        except Exception as e:  # any receive failure leaves the group unusable
            self.groups.drop(group_name, f"a broadcast on it failed ({e})")
            why = "the trainer sent too little or stalled" if isinstance(e, ReceiveTimeout) else \
                f"the trainer may have died or timed out (group timeout {self.group_timeout:g} s)"
            err = self._refuse(_DISTRIBUTED, f"the broadcast on group {group_name} failed ({e}); {why}",
                               abort_why=f"broadcast failed: {e}",
                               outcome=" The group was destroyed; call init_weights_update_group again.")
            # The trainer that paused generation died or stalled; it may never send /continue_generation.
            self._continue_generation("a broadcast failed while paused")
            raise err from None

    # ------------------------------------------------------------------ shared memory (colocated)

    def update_tensor(self, *, serialized_named_tensors: list[str], load_format: str | None,
                      weight_version: str | None, abort_all_requests: bool, run: RunClaim) -> str:
        """``/update_weights_from_tensor``: SGLang's pickled payload of same-host CPU tensors (:meth:`_update_pickled`)
        or the project's ``load_format="wsync_shm"``.

        With ``wsync_shm`` each entry (one per TP rank; this server has one) is base64 of the JSON object ``{"path", "nbytes",
        "names", "dtypes", "shapes"}``: a file under /dev/shm (or the temp dir) holding one flattened bucket.
        Nothing is unpickled. The file is mapped read-only and copied out (the trainer unlinks it once we
        answer), validated like a distributed bucket, and staged in the session (swapped at
        end_weight_update). Any bad input answers 400, aborts the session, and changes nothing.
        """
        if abort_all_requests and self.writers.may(run.writer):  # a refused writer ends nobody's requests
            self.generation.abort_all("Abort by update_weights_from_tensor(abort_all_requests=True).")
        t0 = time.perf_counter()
        with self.lock:
            self.writers.check(run.writer, _TENSOR)
            if self.features.needs_session and self.session is None:  # SGLang's scheduler checks this first
                raise self._refuse(_TENSOR, SESSION_REQUIRED_MESSAGE.replace(
                    "update_weights_from_distributed", "update_weights_from_tensor") + "; call begin_weight_update() first")
            if load_format != SHM_LOAD_FORMAT:
                return self._update_pickled(serialized_named_tensors, load_format, weight_version, t0, run)
            try:
                if len(serialized_named_tensors) != 1:
                    raise WireError(f"serialized_named_tensors has {len(serialized_named_tensors)} entries; this server "
                                    "has 1 TP rank, so send exactly 1")
                desc = shm_descriptor(serialized_named_tensors[0])
                specs = wire_specs(desc["names"], desc["dtypes"], desc["shapes"])
                owner = session_owner(desc.get("pid"), self.session)
            except WireError as e:
                raise self._refuse(_TENSOR, str(e)) from None
            table, problems = delta_specs(desc["wsync_delta"], specs) if "wsync_delta" in desc else (None, [])
            problems += self._request_problems(weight_version, table or specs, table is None, "update_weights_from_tensor")
            nbytes = sum(sp.nbytes for sp in specs)
            if desc["nbytes"] != nbytes:
                problems.append(f"nbytes is {desc['nbytes']} but names/dtypes/shapes describe {nbytes} bytes")
            if problems:
                raise self._refuse(_TENSOR, join_problems(problems), reason=_reason(problems))
            try:
                buf = read_shm(desc["path"], nbytes)
            except WireError as e:
                raise self._refuse(_TENSOR, str(e)) from None
            if self.session is not None and owner is not None:
                self.session.owner = owner
            received, check = self._from_delta(_TENSOR, desc.get("wsync_delta"), unflatten_bucket(buf, specs), table)
            return self._stage(received, weight_version, nbytes, t0, None, run, check)

    def _update_pickled(self, entries: list[str], load_format: str | None, weight_version: str | None, t0: float,
                        run: RunClaim) -> str:
        """Caller holds the lock: SGLang's own payload of same-host CPU tensors (:mod:`inference_adapter.tensor_payload`)."""
        if load_format not in (None, "flattened_bucket") or (load_format and not self.features.flattened_bucket):
            raise self._refuse(_TENSOR, (
                f"load_format {load_format!r} is not supported by the reference server at SGLang "
                f"{self.features.version}; use null (a list of (name, tensor) pairs)"
                + (", 'flattened_bucket'" if self.features.flattened_bucket else "") + f" or {SHM_LOAD_FORMAT!r}"))
        try:
            if len(entries) != 1:
                raise PayloadRefused(f"serialized_named_tensors has {len(entries)} entries; this server has 1 TP "
                                     "rank, so send exactly 1")
            received = named_tensors(entries[0], load_format)
        except PayloadRefused as e:
            raise self._refuse(_TENSOR, str(e), reason=e.reason) from None
        specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in received]
        problems = self._request_problems(weight_version, specs, False, "update_weights_from_tensor")
        if problems:
            raise self._refuse(_TENSOR, join_problems(problems))
        return self._stage(received, weight_version, sum(sp.nbytes for sp in specs), t0, None, run)

    # ------------------------------------------------------------------ disk

    def update_disk(self, *, model_path: str, weight_version: str | None, abort_all_requests: bool,
                    run: RunClaim, manifest_sha256: str | None = None) -> str:
        """Load a whole HF checkpoint directory, validate it, then swap; SGLang's success message.

        A wsync snapshot is verified against its manifest (and the manifest against ``manifest_sha256``,
        the announced digest, when given) in the same pass that reads it; a failure is refused with
        ``wsync_reason`` :data:`~bridge.protocol.SNAPSHOT_INVALID`. The open session, if any, is untouched.
        """
        if abort_all_requests and self.writers.may(run.writer):  # a refused writer ends nobody's requests
            self.generation.abort_all("Abort by update_weights_from_disk(abort_all_requests=True).")
        problem = version_problem(weight_version, "weight_version")
        if problem:
            raise RequestError(f"{_DISK}: {problem}.")
        with self.lock:
            self.writers.check(run.writer, _DISK)
            problem = self._rollback_problem(weight_version, run)
            if problem:
                raise self._refused(_DISK, problem, reason=VERSION_GOES_BACK)
            t0 = time.perf_counter()
            try:
                tensors = read_checkpoint(model_path, self.disk_roots, manifest_sha256)
            except CheckpointRefused as e:
                raise self._refused("Failed to get weights iterator", e.why, reason=e.reason) from e
            staged, problems = checkpoint_to_stage(tensors, self.weights)
            problems += [p for p in [non_finite_problem(staged), missing_problem(tensors, staged, self.weights)] if p]
            if problems:
                raise self._refused(_DISK, f"{model_path}: {join_problems(problems)}", reason=_reason(problems))
            self._swap(staged, weight_version if self.features.weight_version else None, run, model_path=model_path)
            self.log.info("loaded %s from disk in %.2f s", model_path, time.perf_counter() - t0)
        return "Succeeded to update model weights."


def _quantization_problem(s: ParamSpec, target: torch.Tensor) -> str:
    """The named refusal of a tensor sent quantized to a server that serves it unquantized, or the other way."""
    if s.dtype == FP8_DTYPE:
        return (f"{QUANTIZATION_MISMATCH}: tensor {s.name!r} is sent as FP8 ({dtype_to_str(s.dtype)}) but this server "
                f"serves it as {dtype_to_str(target.dtype)} (it was not started with --quantization fp8): publish "
                "with the full encoding, or restart the server with --quantization fp8")
    return (f"{QUANTIZATION_MISMATCH}: tensor {s.name!r} is sent as {dtype_to_str(s.dtype)} but this server serves it "
            "as block FP8 (float8_e4m3fn with its _scale_inv; started with --quantization fp8): publish with "
            "encoding='fp8' (wsync train --encoding fp8)")


def _reason(problems: list[str]) -> str | None:
    """``wsync_reason`` of a refusal for these problems: :data:`QUANTIZATION_MISMATCH` when one names it."""
    return QUANTIZATION_MISMATCH if any(p.startswith(QUANTIZATION_MISMATCH) for p in problems) else None
