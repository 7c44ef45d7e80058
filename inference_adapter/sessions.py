"""The update session and the writer lease: who may change the weights, and the begin/end session they do it in.

:class:`Session` is an open session's record, with how the server tells that its trainer is still alive.
:class:`SessionControl` is mixed into :class:`~inference_adapter.weight_updates.WeightUpdates`, whose lock,
session, weights and refusal helpers it uses. The lease itself (one writer at a time) is
:class:`~inference_adapter.writers.WriterLeases`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from bridge.protocol import VERSION_GOES_BACK
from inference_adapter.checks import RunClaim
from inference_adapter.errors import RequestError
from inference_adapter.wire import WireError
from inference_adapter.writers import MAX_LEASE_S, MIN_LEASE_S

__all__ = ["Session", "SessionControl", "process_start", "session_owner"]


@dataclass
class Session:
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
    run: RunClaim = field(default_factory=RunClaim)
    finite_checks: list[Future] = field(default_factory=list)  # non_finite_problem of each staged request
    writer: str | None = None  # the writer that opened it (wsync_writer), None if it named none

    def describe(self) -> str:
        if self.owner:
            who = f"colocated trainer pid {self.owner[0]}"
        else:
            who = f"group(s) {sorted(self.groups)}" if self.groups else "no trainer known"
        if self.writer is not None:
            who = f"writer {self.writer!r} of run {self.run.run_id!r}, {who}"
        return f"{who}, {self.requests} request(s) staged, last request {time.monotonic() - self.last_request:.1f} s ago"


def process_start(pid: int) -> str | None:
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


def session_owner(pid, session: Session | None) -> tuple[int, str] | None:
    """A ``wsync_shm`` descriptor's ``pid`` as the owner ``(pid, start time)`` of ``session``; WireError if
    it cannot be (not a pid, no such process here, another trainer's session).

    None: no pid (publishers before it was added); only the idle timeout then protects the session.
    """
    if pid is None:
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise WireError(f"'pid' must be the trainer's positive process id, got {pid!r}")
    started = process_start(pid)
    if started is None:
        raise WireError(f"'pid' {pid} names no running process on this host; the trainer must be on the same host")
    if session is not None and session.owner is not None and session.owner != (pid, started):
        raise WireError(f"the open session belongs to colocated trainer pid {session.owner[0]}, not pid {pid}")
    return (pid, started)

class SessionControl:
    """``/begin_weight_update``, ``/end_weight_update``, ``/wsync/abort_weight_update``, ``/wsync/writer_lease``
    and the watchdog round that discards a session whose trainer is gone or whose writer's lease expired."""

    # ------------------------------------------------------------------ the writer lease

    def take_lease(self, writer: str, run_id: str | None, seconds: float, starts_sync: bool = False,
                   renew_only: bool = False) -> str:
        """Take or renew the writer lease (``/wsync/writer_lease``). Taking the server discards an update session
        left open by a writer that does not hold it (its lease expired, or it let go of it), and, when the take
        ``starts_sync``, one this writer left open itself (an earlier sync whose end never came). ``renew_only``
        (the publisher's renewals) never takes a lease that is not this writer's any more: a renewal that
        arrives after the release must not take the server again."""
        if not MIN_LEASE_S <= seconds <= MAX_LEASE_S:
            raise RequestError(f"lease_s must be between {MIN_LEASE_S:g} and {MAX_LEASE_S:g} seconds, got {seconds!r}")
        if self.writers.renew(writer, seconds) and not starts_sync:
            return f"Writer lease renewed for {seconds:g} s."
        if renew_only:
            self.writers.check(writer, "Failed to renew the writer lease")
            raise RequestError(f"Failed to renew the writer lease: writer {writer!r} holds none here (it was released, "
                               "or it expired and the server cleaned up after it); take it again to write")
        with self.lock:  # taking it over may discard a session: no update may run meanwhile
            previous = self.writers.take(writer, run_id, seconds)
            s = self.session
            if s is not None and s.writer is not None and (s.writer != writer or starts_sync):
                whose = "this writer's own earlier session" if s.writer == writer else f"the session of {s.describe()}"
                why = f"writer {writer!r} took the server over, discarding {whose}"
                self._abort_session(why)
                self._continue_generation(why)
        if previous is not None:
            self.log.warning("writer %s of run %s took over the lease of %s", writer, run_id, previous.describe())
        return f"Writer lease taken for {seconds:g} s."

    def release_lease(self, writer: str) -> str:
        if self.writers.release(writer):
            return "Writer lease released."
        return "This writer holds no lease here; nothing to release."

    # ------------------------------------------------------------------ sessions

    def begin_session(self, run: RunClaim) -> str:
        with self.lock:
            self.writers.check(run.writer, "Failed to begin a weight update session")
            if self.session is not None:
                raise RequestError(
                    f"A weight update session is already open ({self.session.describe()}). If it is yours, finish it "
                    "with end_weight_update(); to discard it without applying anything, call /wsync/abort_weight_update."
                )
            self.session, self.last_session_error = Session(run=run, writer=run.writer), None
        self.log.info("weight update session opened")
        return "Weight update session started."

    def end_session(self, run: RunClaim | None = None) -> str:
        with self.lock:
            self.writers.check(run.writer if run else None, "Failed to end the weight update session")
            s = self.session
            if s is None:
                why = f" The last session was aborted: {self.last_session_error}" if self.last_session_error else ""
                raise RequestError(f"No weight update session is open; call begin_weight_update() first.{why}")
            self.session = None
            problem, reason = next((p for p in (c.result() for c in s.finite_checks) if p), None), None
            if not problem:
                problem = self._rollback_problem(s.version, s.run)
                reason = VERSION_GOES_BACK if problem else None
            if problem:
                self.last_session_error = problem
                raise RequestError(f"Weight update session aborted, nothing applied: {problem}.", reason=reason)
            self._swap(s.staged, s.version, s.run)
        msg = f"Weight update session ended: {len(s.staged)} tensors from {s.requests} requests applied atomically."
        if s.version is not None:
            msg += f" Weight version updated to {s.version}."
        return msg

    def abort_session(self, run: RunClaim | None = None) -> str:
        """Project extension (``/wsync/abort_weight_update``): discard the open session, apply nothing."""
        with self.lock:
            self.writers.check(run.writer if run else None, "Failed to abort the weight update session")
            if self.session is None:
                raise RequestError("No weight update session is open; nothing to abort.")
            self._abort_session("the trainer aborted it (/wsync/abort_weight_update)")
        return f"Weight update session aborted; nothing was applied; still serving weight version {self.weights.version}."

    def check_session_owner(self) -> None:
        """Watchdog round: discard a session whose trainer is gone (see :class:`~inference_adapter.sessions.Session`)
        or whose writer's lease expired, and lift its pause."""
        if not self.lock.acquire(timeout=0.1):
            return  # an update is running: its trainer is alive, or the update fails by itself
        try:
            expired = self.writers.expired()
            if expired is not None:  # its holder stopped renewing it: dead, frozen, or cut off
                self.writers.drop(expired)
                why = f"the writer lease of {expired.describe()}"
                if self.session is not None and self.session.writer == expired.writer:
                    self._abort_session(why)
                self._continue_generation(why)
            s = self.session
            if s is None:
                return
            if s.owner is not None:
                pid, started = s.owner
                if process_start(pid) == started:
                    return
                why = f"its colocated trainer (pid {pid}) is gone"
            elif not s.groups and time.monotonic() - s.last_request > self.group_timeout:
                why = f"no request came for {self.group_timeout:g} s (--group-timeout) and no trainer is known to watch"
            else:
                return
            self._abort_session(why)
            self._continue_generation(why)
        finally:
            self.lock.release()
