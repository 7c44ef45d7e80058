"""An open weight-update session, and how the server tells that its trainer is still alive."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from inference_adapter.checks import RunClaim
from inference_adapter.wire import WireError

__all__ = ["Session", "process_start", "session_owner"]


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
