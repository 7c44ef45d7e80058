"""Calls with a bound: the caller has its answer within the bound, whatever the call does.

A call that can hang (a rendezvous, a server that does not answer) runs on a daemon thread; the caller
waits at most the bound, then goes on and the call finishes, or not, in the background.

* :func:`call_within`: one call; its result, its error, or :class:`~bridge.errors.SyncTimeout` naming
  what did not finish and the bound.
* :func:`each_within`: one call per item, all at once, with one shared bound; never raises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from bridge.errors import SyncTimeout
from bridge.log import get_logger

__all__ = ["ABORT_WAIT_S", "CLOSE_WAIT_S", "SLACK_S", "abort_within", "bucket_bound", "call_within", "dead_rank_bound",
           "each_within", "pending_aborts", "publish_call_bound"]

logger = get_logger(__name__)

T = TypeVar("T")


def call_within(fn: Callable[[], T], timeout: float, what: str, *, bound_name: str | None = None,
                late: Callable[[T], Any] | None = None, background: list[threading.Thread] | None = None,
                thread_name: str = "wsync-bounded") -> T:
    """``fn()``, run on a daemon thread: what it returns, or what it raises, within ``timeout`` seconds.

    When the bound passes first, ``fn`` goes on in the background: a result it returns later is handed to
    ``late`` (to release what it built: nobody else will), an error it raises later is dropped, and its
    thread is appended to ``background`` (for a caller that gives it more time later).

    Raises:
        SyncTimeout: ``"<what> within <timeout> s"`` (``within <bound_name>=<timeout> s`` with
            ``bound_name``): ``fn`` did not finish in time.
    """
    lock = threading.Lock()
    state: dict[str, Any] = {}

    def run() -> None:
        try:
            out = (True, fn())
        except BaseException as e:  # handed to the caller's thread
            out = (False, e)
        with lock:
            abandoned = state.get("abandoned", False)
            if not abandoned:
                state["out"] = out
        if abandoned and out[0] and late is not None:
            late(out[1])

    worker = threading.Thread(target=run, name=thread_name, daemon=True)
    worker.start()
    worker.join(timeout)
    with lock:  # either the call finished and its outcome is ours, or it is abandoned: never both, never neither
        out = state.get("out")
        if out is None:
            state["abandoned"] = True
    if out is None:
        if background is not None:
            background.append(worker)
        bound = f"{bound_name}={timeout:g}" if bound_name else f"{timeout:g}"
        raise SyncTimeout(f"{what} within {bound} s")
    ok, value = out
    if ok:
        return value
    raise value


def each_within(fn: Callable[[T], Any], items: Iterable[T], seconds: float, thread_name: str) -> None:
    """``fn(item)`` for every item, each on its own daemon thread, all started at once; returns when all
    finished or ``seconds`` passed (an item still running is left to its thread). What ``fn`` returns is
    dropped; it handles its own errors (one it raises is printed by the thread and dropped)."""
    threads = [threading.Thread(target=fn, args=(item,), name=thread_name, daemon=True) for item in items]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------- the bounds of one sync

ABORT_WAIT_S = 5.0
"""The most a failed sync waits for its clean-up (resume, discard sessions) before raising."""

CLOSE_WAIT_S = 5.0
"""The most ``close()`` takes."""

SLACK_S = 10.0
"""Added to a step's own bound before the other ranks give up waiting for a rank (it died or hangs)."""


def bucket_bound(config) -> float:
    """The most one bucket step takes: its gather, then the previous bucket's arrival."""
    return 2 * config.group_timeout + config.http_timeout


def publish_call_bound(config) -> float:
    """Seconds a rank in publish() waits for the other ranks to call it too, before it fails naming the
    absent ranks: ``group_timeout``."""
    return config.group_timeout


def dead_rank_bound(config) -> float:
    """The most the other ranks take to raise when a trainer rank dies in the middle of a transfer: the
    bucket step's bound, the agreement's slack and the clean-up's wait; 2 x group_timeout + http_timeout
    + 15 s (docs/guarantees.md, "Bounded time"). The servers are given back at once when rank 0's own step fails
    (a gather with the dead rank does), without waiting that long."""
    return bucket_bound(config) + SLACK_S + ABORT_WAIT_S


def abort_within(transport, reason: str, seconds: float) -> str:
    """Run ``transport.abort`` for at most ``seconds``; a server that does not answer (stopped, say)
    must not delay the error. Whatever is left goes on in the background (it is idempotent cleanup)."""

    def run() -> str:
        try:
            return transport.abort(reason)
        except Exception as e:  # best effort by contract; never hide the cause behind it
            logger.warning("aborting the sync failed: %s", e)
            return ""

    try:
        return call_within(run, seconds, "aborting the sync", background=pending_aborts, thread_name="wsync-abort")
    except SyncTimeout:  # (run itself never raises)
        return f"cleanup goes on in the background: a server did not answer within {seconds:g} s"


pending_aborts: list[threading.Thread] = []
"""Clean-ups still running after their failed sync raised; ``close()`` gives them time to finish."""
