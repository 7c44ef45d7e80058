"""The fleet between publishes: :class:`FleetGuard`, rank 0's background probe that keeps a server behind the fleet's
version out of rotation until a publish repairs it.

A publish probes its servers and brings every one to the new version (:class:`bridge.fleet.Fleet`), but RL publishes
minutes apart, and a server that restarts at the same URL in between comes back on its base weights while a router
still lists it. Every ``guard_every`` seconds, while no publish runs, the guard probes the servers its sources list
(:meth:`bridge.fleet.Fleet.guard`): one that answers with a version behind the fleet's is taken out of rotation (out
of the router, marked out in a registry) and paused at once, and loaded from the newest complete snapshot of the
fleet's version where the transport has one (disk), then put back; the next publish brings the others to its
version and puts them back. So a server serves an older version in rotation at most ``guard_every`` plus one probe
after it came back, instead of until the next publish.

It runs only where rotation means something: a router or a registry among the sources (a fixed list of URLs has
no rotation to take a server out of).
"""

from __future__ import annotations

import threading

from bridge.log import get_logger

__all__ = ["FleetGuard"]

logger = get_logger(__name__)


class FleetGuard:
    """Calls ``fleet.guard(snapshot)`` every ``every`` seconds on a thread of its own, skipping a round while
    ``busy`` (held by each publish) is taken; :meth:`stop` ends it."""

    def __init__(self, fleet, every: float, busy: threading.Lock, snapshot=None):
        self.fleet, self.every, self.busy, self.snapshot = fleet, float(every), busy, snapshot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wsync-fleet-guard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if not self.busy.acquire(blocking=False):  # a publish runs: it probes the fleet itself
                continue
            try:
                if not self._stop.is_set():
                    self.fleet.guard(self.snapshot)
            except Exception as e:  # a round that failed is tried again at the next
                logger.warning("fleet guard: %s", e)
            finally:
                self.busy.release()

    def stop(self, timeout: float) -> None:
        """Stop after the round in progress, waiting for it at most ``timeout`` seconds."""
        self._stop.set()
        self._thread.join(timeout)
