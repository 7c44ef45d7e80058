"""One writer at a time: who may change the served weights now, and for how long without a word from it.

A publisher names itself on every weight-changing request (``wsync_writer``, beside its run
``wsync_run_id``) and takes the server's lease before it pauses anything (``/wsync/writer_lease``, or in the
pause's own request: ``/pause_generation`` with ``wsync_lease_s``). It renews the lease while it works (every
request of the holder renews it too) and releases it when its sync ended. While the lease is live, a weight
change from anyone else -- another writer, or a client that names no writer -- is refused with HTTP 409 and
``wsync_reason`` :data:`~bridge.protocol.ANOTHER_WRITER`, naming the holder's run and writer. A lease that expired can be taken over: the update session its holder left
open is discarded first (and the server's watchdog discards it anyway once the lease expired, lifting the
pause). A holder that dies therefore blocks other writers for at most its lease.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from bridge.protocol import ANOTHER_WRITER
from inference_adapter.errors import RequestError

__all__ = ["MAX_LEASE_S", "MIN_LEASE_S", "Lease", "WriterLeases"]

MIN_LEASE_S = 0.5
MAX_LEASE_S = 3600.0


@dataclass
class Lease:
    """The writer that holds the server, and until when without a renewal."""

    writer: str
    run_id: str | None
    seconds: float
    renewed: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Seconds until it expires (negative: expired that long ago)."""
        return self.seconds - (time.monotonic() - self.renewed)

    def describe(self) -> str:
        run = f"run {self.run_id!r}" if self.run_id else "a writer that named no run"
        left = self.left()
        when = (f"its lease of {self.seconds:g} s expires in {left:.1f} s unless renewed" if left > 0 else
                f"its lease expired {-left:.1f} s ago")
        return f"{run}, writer {self.writer!r} ({when})"


class WriterLeases:
    """The server's one writer lease. Thread-safe on its own lock, which is never held while waiting for the
    weights: a holder's renewal goes through while a long update of its own runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held: Lease | None = None

    def renew(self, writer: str | None, seconds: float | None = None) -> bool:
        """True when ``writer`` holds the lease (live, or expired and not taken since): it is renewed."""
        with self._lock:
            h = self.held
            if writer is None or h is None or h.writer != writer:
                return False
            h.renewed = time.monotonic()
            if seconds is not None:
                h.seconds = seconds
            return True

    def check(self, writer: str | None, action: str) -> None:
        """RequestError (409, another_writer) unless ``writer`` may change the weights now: no live lease, or
        its own (which this renews)."""
        with self._lock:
            h = self.held
            if h is None:
                return
            if writer is not None and h.writer == writer:
                h.renewed = time.monotonic()
                return
            if h.left() > 0:
                raise self._refusal(h, action)

    def may(self, writer: str | None) -> bool:
        """True when :meth:`check` would let ``writer`` change the weights now (renews nothing)."""
        with self._lock:
            h = self.held
            return h is None or (writer is not None and h.writer == writer) or h.left() <= 0

    def take(self, writer: str, run_id: str | None, seconds: float) -> Lease | None:
        """Make ``writer`` the holder for ``seconds``; the previous holder's lease when an expired one is taken
        over (its session must go). RequestError (409, another_writer) while another writer's lease is live."""
        with self._lock:
            h = self.held
            if h is not None and h.writer != writer and h.left() > 0:
                raise self._refusal(h, "Failed to take the writer lease")
            self.held = Lease(writer, run_id, seconds)
            return h if h is not None and h.writer != writer else None

    def release(self, writer: str) -> bool:
        """End ``writer``'s lease; False when it does not hold it (nothing changes)."""
        with self._lock:
            if self.held is None or self.held.writer != writer:
                return False
            self.held = None
            return True

    def expired(self) -> Lease | None:
        """The held lease, if it has expired."""
        with self._lock:
            return self.held if self.held is not None and self.held.left() <= 0 else None

    def drop(self, lease: Lease) -> None:
        """Forget ``lease`` if it is still the held one (an expired lease the watchdog cleaned up after)."""
        with self._lock:
            if self.held is lease:
                self.held = None

    def holds(self, writer: str | None) -> bool:
        """True when ``writer`` holds a live lease."""
        with self._lock:
            return writer is not None and self.held is not None and self.held.writer == writer and self.held.left() > 0

    def state(self) -> dict | None:
        """The holder, for ``/server_info``'s internal state (None: nobody holds the server)."""
        with self._lock:
            h = self.held
            if h is None:
                return None
            return {"writer": h.writer, "run_id": h.run_id, "lease_s": h.seconds, "expires_in": round(h.left(), 3)}

    @staticmethod
    def _refusal(h: Lease, action: str) -> RequestError:
        return RequestError(
            f"{action}: another writer holds this server ({ANOTHER_WRITER}): {h.describe()}. A server takes weight "
            "changes from one writer at a time; retry once that writer ended its sync or its lease expired, or stop "
            "the other trainer if it should not be publishing here.", status=409, reason=ANOTHER_WRITER)
