"""Weight updates: the begin/end session, staging, validation, and the distributed/shm/disk receive paths.

An update first *stages* (receive or read, then validate), and only a complete, valid update is
swapped in (:meth:`ModelState._swap <inference_adapter.model_state.ModelState._swap>`); anything that
fails leaves the previous weights and version serving.

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
* Co-located (``update_tensor``, ``/update_weights_from_tensor``): real SGLang takes pickled CUDA IPC
  handles; CPU tensors cannot cross HTTP, and this server never unpickles anything. It accepts only the
  project extension ``load_format="wsync_shm"``: the entry names a file under /dev/shm (or the temp dir)
  holding one flattened bucket, which is checked like a distributed bucket, copied out and staged in
  the session. Bad input answers 400, aborts the session and changes nothing. A descriptor's ``pid``
  (the trainer's rank 0) makes that process the session's owner: once it is gone, the watchdog
  discards the session and lifts the pause (see :class:`_Session`).
* Disk (``update_disk``): only directories under ``--disk-root`` (symlinks resolved), whose manifest
  and index name plain files inside them, and only regular files (:func:`_checked_checkpoint_dir`);
  the checkpoint is then read and checked completely (every served parameter, shapes; dtypes are cast
  as SGLang casts them) before the swap.

Refused on every path, beyond SGLang: weights holding NaN or Inf (they would make sampling fail on every
request; in a session each request's tensors are checked on a background thread while the next bucket
arrives, and ``end_weight_update`` refuses the session if any held them), version labels that answers cannot carry (:func:`version_problem`), and a version older than
the served one unless the request starts a new run (:class:`RunClaim`).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import ConfigError, SnapshotError
from bridge.protocol import SESSION_REQUIRED_MESSAGE, SHM_LOAD_FORMAT, SNAPSHOT_INVALID, VERSION_GOES_BACK
from bridge.tensors import ParamSpec, dtype_to_str
from inference_adapter.errors import RequestError
from inference_adapter.wire import (
    _read_shm,
    _receive_nccl,
    _ReceiveTimeout,
    _recv_bytes,
    _shm_descriptor,
    _SizeMismatch,
    _wire_specs,
    _WireError,
    receive_bound,
)

__all__ = ["RunClaim", "WeightUpdateMixin", "version_problem"]


@dataclass
class _Session:
    """An open begin/end_weight_update session (0.5.21+ protocol).

    ``owner`` is the colocated trainer's ``(pid, start time)`` from its first ``wsync_shm`` descriptor:
    the watchdog discards the session once that process is gone. A session with neither an owner nor a
    group (whose own watchdog covers it) is discarded after ``--group-timeout`` seconds without a request.
    """

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    groups: set[str] = field(default_factory=set)
    requests: int = 0
    owner: tuple[int, str] | None = None
    last_request: float = field(default_factory=time.monotonic)
    run: RunClaim = field(default_factory=lambda: RunClaim())
    finite_checks: list[Future] = field(default_factory=list)  # _non_finite_problem of each staged request

    def describe(self) -> str:
        if self.owner:
            who = f"colocated trainer pid {self.owner[0]}"
        else:
            who = f"group(s) {sorted(self.groups)}" if self.groups else "no trainer known"
        return f"{who}, {self.requests} request(s) staged, last request {time.monotonic() - self.last_request:.1f} s ago"


def _process_start(pid: int) -> str | None:
    """A live process's start time (so a reused pid is not mistaken for it), or None if it is gone.

    A zombie (killed, not yet reaped by its parent) counts as gone. Without /proc, liveness only.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    state, *rest = stat[stat.rindex(")") + 2 :].split()
    return None if state in ("Z", "X") else rest[18]  # field 22 of proc(5): starttime


MAX_VERSION_CHARS = 256


def version_problem(version: str | None, field: str, example: str = "the training step") -> str | None:
    """What is wrong with a weight version label, or None if it is fine (or not given).

    SGLang takes any string; this server also refuses what would break its own answers or logs: an empty
    label, more than :data:`MAX_VERSION_CHARS` characters, control characters, and lone surrogates
    (which JSON can carry in but UTF-8 cannot carry out).
    """
    if version is None:
        return None
    if not version:
        problem = "is empty"
    elif len(version) > MAX_VERSION_CHARS:
        problem = f"has {len(version)} characters, more than {MAX_VERSION_CHARS}"
    elif any("\ud800" <= c <= "\udfff" for c in version):
        problem = "holds a lone UTF-16 surrogate"
    elif not version.isprintable():
        problem = "holds control characters"
    else:
        return None
    shown = version[:40].encode("utf-8", "backslashreplace").decode()
    return f"{field} {shown!r} {problem}; send 1-{MAX_VERSION_CHARS} printable characters, such as {example}"


@dataclass(frozen=True)
class RunClaim:
    """What a weight-changing request says about the run it belongs to (project fields, ignored by SGLang).

    ``wsync_run_id``: the publishing run's identity (e.g. ``experiment/trial``); a run id other than the
    served one starts a new run. ``wsync_new_run``: an explicit reset. Either lets a version go back;
    without them a version older than the served one is refused (a restarted trainer must not replace
    newer weights). Versions are ordered only when both are decimal integers.
    """

    run_id: str | None = None
    new_run: bool = False

    @classmethod
    def from_body(cls, data: dict) -> RunClaim:
        run_id, new_run = data.get("wsync_run_id"), data.get("wsync_new_run", False)
        if run_id is not None and not isinstance(run_id, str):
            raise RequestError(f"wsync_run_id must be a string naming the run, got {type(run_id).__name__}")
        problem = version_problem(run_id, "wsync_run_id", example="experiment/trial")
        if problem:
            raise RequestError(problem)
        if not isinstance(new_run, bool):
            raise RequestError(f"wsync_new_run must be true or false, got {new_run!r}")
        return cls(run_id, new_run)


def _as_int(version: str | None) -> int | None:
    return int(version) if version is not None and re.fullmatch(r"[0-9]{1,30}", version) else None


# Exponent bits of IEEE formats: all ones means Inf or NaN. One integer pass, ~4x cheaper than isfinite.
_EXPONENT_MASKS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                   torch.float32: (torch.int32, 0x7F800000)}


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf, which would make sampling fail on every request."""
    bad = []
    for name, t in tensors.items():
        if not t.is_floating_point() or not t.numel():
            continue
        mask = _EXPONENT_MASKS.get(t.dtype)
        if mask is None:
            finite = bool(torch.isfinite(t).all())
        else:
            int_dtype, bits = mask
            finite = int(t.reshape(-1).view(int_dtype).bitwise_and(bits).max()) != bits
        if not finite:
            bad.append(name)
    return bad


# A session's finite checks run here, overlapping the next bucket's receive; end_weight_update waits for them.
_finite_checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsync-finite-check")


def _non_finite_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    bad = _non_finite(tensors)
    if not bad:
        return None
    return f"tensor(s) {bad[:4]} hold NaN or Inf values (not finite); refusing weights that would break sampling"


def _join(problems: list[str], limit: int = 4) -> str:
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


class WeightUpdateMixin:
    """:class:`~inference_adapter.model_state.ModelState`'s weight-update methods.

    Uses the host's ``_params``/``_aliases``, ``features``, ``_update_lock`` (held by every method
    here, one weight operation at a time), its groups (:class:`~inference_adapter.groups.GroupsMixin`)
    and ``_swap``; owns the open session, set up by :meth:`_init_sessions`.
    """

    def _init_sessions(self) -> None:
        self._session: _Session | None = None
        self._last_session_error: str | None = None
        self._run_id: str | None = None  # the run (RunClaim.run_id) the served version came from

    def _rollback_problem(self, version: str | None, run: RunClaim) -> str | None:
        """Caller holds _update_lock: why ``version`` must not replace the served one, or None (see RunClaim)."""
        if self.allow_version_rollback or run.new_run or (run.run_id is not None and run.run_id != self._run_id):
            return None
        old, new = _as_int(self._version), _as_int(version)
        if old is None or new is None or new >= old:
            return None
        which = f"run {self._run_id!r}" if self._run_id is not None else "a run without wsync_run_id"
        return (f"weight_version {version} is older than the served version {self._version} of {which}; a restarted "
                "trainer must not replace newer weights. To start a new run on this server, send wsync_new_run=true, or "
                "a wsync_run_id other than the served run's")

    def _claim(self, version: str | None, run: RunClaim) -> None:
        """Caller holds _update_lock and is about to serve ``version``: remember the run it came from."""
        if version is not None and (run.run_id is not None or run.new_run):
            self._run_id = run.run_id

    def begin_session(self, run: RunClaim = RunClaim()) -> str:
        with self._update_lock:
            if self._session is not None:
                raise RequestError(
                    f"A weight update session is already open ({self._session.describe()}). If it is yours, finish it "
                    "with end_weight_update(); to discard it without applying anything, call /wsync/abort_weight_update."
                )
            self._session, self._last_session_error = _Session(run=run), None
        self.log.info("weight update session opened")
        return "Weight update session started."

    def end_session(self) -> str:
        with self._update_lock:
            s = self._session
            if s is None:
                why = f" The last session was aborted: {self._last_session_error}" if self._last_session_error else ""
                raise RequestError(f"No weight update session is open; call begin_weight_update() first.{why}")
            self._session = None
            problem, reason = next((p for p in (c.result() for c in s.finite_checks) if p), None), None
            if not problem:
                problem = self._rollback_problem(s.version, s.run)
                reason = VERSION_GOES_BACK if problem else None
            if problem:
                self._last_session_error = problem
                raise RequestError(f"Weight update session aborted, nothing applied: {problem}.", reason=reason)
            self._claim(s.version, s.run)
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

    def _check_session_owner(self) -> None:
        """Watchdog round (see :class:`_Session`): discard a session whose trainer is gone, and lift its pause."""
        if not self._update_lock.acquire(timeout=0.1):
            return  # an update is running: its trainer is alive, or the update fails by itself
        try:
            s = self._session
            if s is None:
                return
            if s.owner is not None:
                pid, started = s.owner
                if _process_start(pid) == started:
                    return
                why = f"its colocated trainer (pid {pid}) is gone"
            elif not s.groups and time.monotonic() - s.last_request > self.group_timeout:
                why = f"no request came for {self.group_timeout:g} s (--group-timeout) and no trainer is known to watch"
            else:
                return
            self._abort_session(why)
            if self._paused:
                self.log.warning("continuing generation on the previous weights: %s", why)
                self.resume()
        finally:
            self._update_lock.release()

    # ------------------------------------------------------------------ updates

    def update_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                           load_format: str | None, weight_version: str | None, abort_all_requests: bool,
                           run: RunClaim = RunClaim()) -> str:
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
                        f"load_format 'flattened_bucket' needs SGLang >= 0.5.6; this server speaks {self.features.version}"
                    )
                specs = _wire_specs(names, dtypes, shapes)
            except _WireError as e:
                self._drop_group(group_name, "it was sent a request it could not receive")
                self._abort_session(str(e))
                raise RequestError(
                    f"Failed to update parameter online: {e}. The trainer's broadcast was not received, so group "
                    f"{group_name} was destroyed; call init_weights_update_group again.{keep}"
                ) from None
            problems = [p for p in [version_problem(weight_version, "weight_version")] if p]
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
                why = "the trainer sent too little or stalled" if isinstance(e, _ReceiveTimeout) else \
                    f"the trainer may have died or timed out (group timeout {self.group_timeout:g} s)"
                raise RequestError(
                    f"Failed to update parameter online: the broadcast on group {group_name} failed ({e}); {why}. "
                    f"The group was destroyed; call init_weights_update_group again.{keep}"
                ) from None
            finally:
                self._receiving = None
            if problems:
                sess = " The update session was aborted; nothing it staged was applied." if self._session else ""
                self._abort_session(problems[0])
                raise RequestError(f"Failed to update parameter online: {_join(problems)}.{sess}{keep} "
                                   "(The broadcast was received and discarded; the group is still usable.)")
            return self._stage(received, weight_version, nbytes, t0, group_name, run)

    def _stage(self, received: list[tuple[str, torch.Tensor]], weight_version: str | None, nbytes: int, t0: float,
               group_name: str | None, run: RunClaim) -> str:
        """Caller holds _update_lock: stage a validated request in the session, or swap it in without one."""
        staged = {n: t for n, t in received if n not in self._aliases}
        run = self._session.run if self._session is not None else run  # a session claims its run at begin
        problem = self._rollback_problem(weight_version, run)
        reason = VERSION_GOES_BACK if problem else None
        if self._session is None:
            problem = problem or _non_finite_problem(staged)
        if problem:
            sess = " The update session was aborted; nothing it staged was applied." if self._session else ""
            self._abort_session(problem)
            raise RequestError(f"Failed to update parameter online: {problem}.{sess} Nothing was applied; still "
                               f"serving weight version {self._version}.", reason=reason)
        dt = time.perf_counter() - t0
        if self._session is not None:
            s = self._session
            s.last_request = time.monotonic()
            s.finite_checks.append(_finite_checker.submit(_non_finite_problem, staged))
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
        self._claim(weight_version, run)
        self._swap(staged, weight_version if self.features.weight_version else None)
        msg = "Succeeded to update parameter online."
        if weight_version is not None and self.features.weight_version:
            msg += f" Weight version updated to {weight_version}."
        return msg

    def update_tensor(self, *, serialized_named_tensors: list[str], load_format: str | None,
                      weight_version: str | None, abort_all_requests: bool, run: RunClaim = RunClaim()) -> str:
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
                owner = self._owner(desc.get("pid"))
            except _WireError as e:
                raise refuse(str(e)) from None
            problems = [p for p in [version_problem(weight_version, "weight_version")] if p]
            problems += self._check_specs(specs, flattened=True)
            nbytes = sum(sp.nbytes for sp in specs)
            if desc["nbytes"] != nbytes:
                problems.append(f"nbytes is {desc['nbytes']} but names/dtypes/shapes describe {nbytes} bytes")
            if problems:
                raise refuse(_join(problems))
            try:
                buf = _read_shm(desc["path"], nbytes)
            except _WireError as e:
                raise refuse(str(e)) from None
            if self._session is not None and owner is not None:
                self._session.owner = owner
            return self._stage(unflatten_bucket(buf, specs), weight_version, nbytes, t0, None, run)

    def _owner(self, pid) -> tuple[int, str] | None:
        """A descriptor's ``pid`` as the session's owner ``(pid, start time)``; _WireError if it cannot be.

        None: no pid (publishers before it was added); only the idle timeout then protects the session.
        """
        if pid is None:
            return None
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise _WireError(f"'pid' must be the trainer's positive process id, got {pid!r}")
        started = _process_start(pid)
        if started is None:
            raise _WireError(f"'pid' {pid} names no running process on this host; the trainer must be on the same host")
        s = self._session
        if s is not None and s.owner is not None and s.owner != (pid, started):
            raise _WireError(f"the open session belongs to colocated trainer pid {s.owner[0]}, not pid {pid}")
        return (pid, started)

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
        bound = lambda n: receive_bound(n, self.receive_timeout, self.group_timeout)  # noqa: E731
        if flattened:
            nbytes = sum(s.nbytes for s in specs)
            buf = _recv_bytes(pg, nbytes, seed, "the flattened bucket", bound(nbytes))
            try:
                return unflatten_bucket(buf, specs)
            except ConfigError:  # unaligned: the problem was reported by _check_specs; hand back nothing
                return []
        out = []
        for i, s in enumerate(specs):
            buf = _recv_bytes(pg, s.nbytes, seed + i, f"tensor {s.name!r}", bound(s.nbytes))
            out.append((s.name, buf.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)))
        return out

    def update_disk(self, *, model_path: str, weight_version: str | None, abort_all_requests: bool,
                    run: RunClaim = RunClaim(), manifest_sha256: str | None = None) -> str:
        """Load a whole HF checkpoint directory, validate it, then swap; SGLang's success message.

        A wsync snapshot is verified against its manifest (and the manifest against ``manifest_sha256``,
        the announced digest, when given) in the same pass that reads it; a failure is refused with
        ``wsync_reason`` :data:`~bridge.protocol.SNAPSHOT_INVALID`.
        """
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_disk(abort_all_requests=True).")
        problem = version_problem(weight_version, "weight_version")
        if problem:
            raise RequestError(f"Failed to update weights: {problem}.")
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."
            problem = self._rollback_problem(weight_version, run)
            if problem:
                raise RequestError(f"Failed to update weights: {problem}.{keep}", reason=VERSION_GOES_BACK)
            t0 = time.perf_counter()
            tensors = _read_checkpoint(model_path, self.disk_roots, keep, manifest_sha256)
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
            problems += [p for p in [_non_finite_problem(staged)] if p]
            missing = [n for n in self._params if n not in staged and n not in tensors]
            if missing:
                problems.append(f"the checkpoint lacks {len(missing)} of the {len(self._params)} served parameters, "
                                f"e.g. {missing[:3]}")
            if problems:
                raise RequestError(f"Failed to update weights: {model_path}: {_join(problems)}.{keep}")
            self._claim(weight_version, run)
            self._swap(staged, weight_version if self.features.weight_version else None, model_path=model_path)
            self.log.info("loaded %s from disk in %.2f s", model_path, time.perf_counter() - t0)
        return "Succeeded to update model weights."


_MAX_JSON_BYTES = 64 << 20  # a manifest or index larger than this is not a checkpoint's


def _read_checkpoint(path: str, roots: list[str], keep: str, manifest_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, after :func:`_checked_checkpoint_dir` let it through."""
    from bridge.snapshot import read_snapshot

    real = _checked_checkpoint_dir(path, roots, keep)
    try:
        return read_snapshot(real, verify=True, expected_manifest_sha256=manifest_sha256)
    except SnapshotError as e:
        raise RequestError(f"Failed to get weights iterator: {e}.{keep}", reason=SNAPSHOT_INVALID) from e
    except Exception as e:  # noqa: BLE001 - safetensors/JSON/OS errors of a corrupt directory
        raise RequestError(f"Failed to get weights iterator: cannot read {path}: {type(e).__name__}: {e}.{keep}") from e


def _checked_checkpoint_dir(path: str, roots: list[str], keep: str) -> str:
    """``path`` resolved, or a RequestError for what must not be loaded (SGLang loads any readable directory).

    Refused: a directory outside ``roots`` once symlinks are resolved; a manifest or index entry that
    names a file outside the directory (``../``, a symlink out); and any file the loader would open that is
    not a regular file (a FIFO would block the reader forever) or, for JSON, is implausibly large.
    """
    from bridge.snapshot import INDEX_NAME, MANIFEST_NAME
    from bridge.snapshot.manifest import under_roots

    def refuse(why: str) -> RequestError:
        return RequestError(f"Failed to get weights iterator: {why}.{keep}")

    try:
        real = os.path.realpath(path)
        is_dir = os.path.isdir(real)
    except (ValueError, OSError) as e:  # an embedded NUL byte, a name too long
        raise refuse(f"model_path {path!r} is not a usable path ({e})") from None
    if not is_dir:
        raise refuse(f"{path} does not exist or is not a directory")
    if not under_roots(real, roots):
        raise refuse(f"{path} (resolved: {real}) is outside the directories this server loads from ({', '.join(roots)}); "
                     "start the server with --disk-root naming the snapshot root")
    names = set(os.listdir(real))
    for meta_name, key in ((MANIFEST_NAME, "files"), (INDEX_NAME, "weight_map")):
        if meta_name in names:
            entries = _json_entries(real, meta_name, key, refuse)
            names |= {e for e in entries if isinstance(e, str)}
            bad = [e for e in entries if not isinstance(e, str) or os.path.basename(e) != e or e in ("", ".", "..")]
            if bad:
                raise refuse(f"{meta_name} names {bad[0]!r}, which leaves the snapshot directory; entries must be "
                             "plain file names inside it")
    for name in sorted(names):
        if name.endswith((".safetensors", ".json")):
            _check_regular_file(real, name, refuse)
    return real


def _json_entries(directory: str, name: str, key: str, refuse) -> list:
    """The keys (``files``) or values (``weight_map``) of a small JSON file of the checkpoint."""
    import json

    full = _check_regular_file(directory, name, refuse)
    if os.path.getsize(full) > _MAX_JSON_BYTES:
        raise refuse(f"{name} has {os.path.getsize(full)} bytes, more than a checkpoint's {name} can need")
    try:
        with open(full, "rb") as f:
            data = json.loads(f.read(_MAX_JSON_BYTES))
        table = data[key]
        return list(table) if key == "files" else list(table.values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise refuse(f"{name} is not a valid {name} ({type(e).__name__}: {e})") from None


def _check_regular_file(directory: str, name: str, refuse) -> str:
    """The path of ``name`` in ``directory``; refused unless it resolves to a regular file inside it."""
    import stat

    full = os.path.join(directory, name)
    real = os.path.realpath(full)
    if os.path.dirname(real) != directory:
        raise refuse(f"{name} resolves to {real}, outside the snapshot directory")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return full  # a missing file is the reader's to report, with the manifest's view of it
    if not stat.S_ISREG(st.st_mode):
        raise refuse(f"{name} is not a regular file (a FIFO, device or directory would block or mislead the reader)")
    return full
