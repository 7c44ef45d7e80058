"""Ctrl-C and SIGTERM during a sync: held until the step they arrive in ends, then acted on by every rank.

A signal that kills a rank in the middle of a sync would leave the servers paused with an update
session open (real SGLang resumes only when told to), and the other ranks waiting for the dead one
until their timeout. So while :meth:`bridge.publisher.core.WeightPublisher.publish` runs in the main
thread, SIGINT and SIGTERM are held (:func:`held`): the first one is only recorded, the step in
progress runs to its end (its collectives complete, since every rank is still in them), and the
agreement then counts this rank's step as failed (:func:`pending`). Every rank raises the same
error, rank 0 leaves every server on its previous version, unpaused, with no open session, and
a snapshot that was not complete is removed. Then the signal is delivered as it would have been:
the previous handler runs (``KeyboardInterrupt`` for SIGINT; the trainer's own SIGTERM handler;
SIGTERM's default ends the process). The interrupt still ends the program, after the clean-up.

A second signal of the same kind is not held: it acts at once (press Ctrl-C twice to stop without
the clean-up). A different one is held too: torchrun answers Ctrl-C by sending its ranks SIGTERM,
which must not cut short the clean-up the SIGINT started.

Not in the main thread (a publish from a helper thread), nothing is installed: Python delivers
signals to the main thread only.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from bridge.log import get_logger

__all__ = ["HELD_SIGNALS", "Interrupted", "held", "pending"]

logger = get_logger(__name__)

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A held signal, as a step's outcome: a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` in a user's code takes it for an ordinary error."""


class _Hold:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.received: list[int] = []
        self.previous: dict[int, object] = {}

    def on_signal(self, signum: int, frame) -> None:
        if signum in self.received:  # the same signal again: act on it now, as if nothing were held
            self.restore()
            self.deliver(signum)
            return
        self.received.append(signum)
        logger.warning(
            "rank %d: %s received during a sync; finishing the current step, then every server is left on its "
            "previous version and the signal takes effect (send it again to stop at once)",
            self.rank, signal.Signals(signum).name,
        )

    def restore(self) -> None:
        while self.previous:
            signum, handler = self.previous.popitem()
            signal.signal(signum, handler)

    def deliver(self, signum: int) -> None:
        """Act on ``signum`` as the handler in force before the hold would have (handlers are restored)."""
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)


_active: list[_Hold] = []


def pending() -> str | None:
    """The name of the signal held since the current sync began (SIGINT, SIGTERM), or None."""
    if _active and _active[-1].received:
        return signal.Signals(_active[-1].received[0]).name
    return None


@contextlib.contextmanager
def held(rank: int) -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the duration of the block (see the module docstring); on leaving it,
    deliver the first one held, which raises (KeyboardInterrupt, or whatever the trainer's handler raises)
    or ends the process. Nested holds share the outer one; outside the main thread this does nothing."""
    if _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    hold = _Hold(rank)
    for signum in HELD_SIGNALS:
        hold.previous[signum] = signal.signal(signum, hold.on_signal)
    _active.append(hold)
    try:
        yield
    finally:
        _active.remove(hold)
        hold.restore()
        if hold.received:
            hold.deliver(hold.received[0])
