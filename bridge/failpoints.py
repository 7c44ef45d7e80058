"""Named fault-injection points, switched on by an environment variable (off and free by default).

The fault tests make a sync fail at a chosen step, on a chosen rank, with an exception of a chosen
type, in real processes: ``WSYNC_FAILPOINTS="commit@0=RuntimeError"`` makes rank 0 raise
``RuntimeError`` when it reaches the ``commit`` step; several entries are separated by commas, and
``bucket:2@1=OSError`` names the third bucket on rank 1. The points are the steps of the sync
lifecycle (see :mod:`bridge.transports.base`): ``prepare``, ``begin``, ``bucket:<k>``, ``settle`` (every
rank's vote on the commit), ``commit`` (rank 0, before anything is made live) and ``commit:<i>`` (rank 0,
inside the commit: after servers 0..i-1 ended their update sessions, before server ``i`` does);
``gather``: inside a bucket's flat gather, after this rank packed its shards and before it joins the
collective the other ranks are already waiting in; ``delta:<j>``: delta bucket ``j`` of the delta encoding, on
each rank before it encodes its records; ``write:<k>``: inside the disk transport's
write of shard ``k`` by the rank that owns it, after the file was created; and ``announce`` (rank 0,
disk): after the snapshot was renamed into place, before it is announced.

Besides an exception type, an entry may name a real signal, which this process then sends itself
(``bucket:2@1=SIGINT``: rank 1 gets a real SIGINT there, as from Ctrl-C), or a pause
(``bucket:1@0=sleep:3``: rank 0 sleeps 3 s there, so that a test can signal a sync it knows is running).
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import time

__all__ = ["armed", "failpoint"]

ENV = "WSYNC_FAILPOINTS"


def _entries(name: str, rank: int):
    spec = os.environ.get(ENV)
    for entry in spec.split(",") if spec else ():
        where, _, kind = entry.strip().partition("=")
        point, _, on_rank = where.partition("@")
        if point == name and on_rank in ("", str(rank)):
            yield kind


def armed(name: str, rank: int) -> bool:
    """True when a fault is configured for point ``name`` on ``rank``."""
    return any(True for _ in _entries(name, rank))


def failpoint(name: str, rank: int) -> None:
    """Act on the fault configured for point ``name`` on ``rank``, if any: raise it, send the signal, sleep."""
    for kind in _entries(name, rank):
        if kind.startswith("SIG") and hasattr(signal, kind):
            os.kill(os.getpid(), getattr(signal, kind))
            continue
        if kind.startswith("sleep:"):
            print(f"failpoint {name} on rank {rank}: sleeping {kind[len('sleep:'):]} s", file=sys.stderr, flush=True)
            time.sleep(float(kind[len("sleep:"):]))
            continue
        cls = getattr(builtins, kind or "RuntimeError", None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            cls = RuntimeError
        raise cls(f"injected fault at {name} on rank {rank} ({ENV})")
