"""What an encoding does at each step of a sync, and the ``full`` encoding (every tensor, every sync).

Every trainer rank has one encoding object per publisher. The publisher (:mod:`bridge.publisher`) calls:

============  ========  ==================================================================================
method        who       when / what
============  ========  ==================================================================================
``prepare``   every     inside the prepare step, before anything moves: this rank's summary (small,
              rank      picklable; every rank receives every rank's)
``plan``      every     after prepare, given every rank's summary, identically on every rank
              rank
``begin``     rank 0    after the transport opened the sync (servers paused, sessions open): the decision
                        of this sync, which reaches every rank's ``decided``
``transfer``  every     instead of the publisher's own bucket loop, when ``sends`` says so
              rank
``settle``    rank 0    wait for what ``transfer`` left in flight
``committed`` every     the version is live on every server
              rank
``failed``    every     the sync failed at any step: undo what ``prepare`` changed
              rank
============  ========  ==================================================================================

``run`` wraps each ``publish()``. The ``full`` encoding (:mod:`bridge.encodings.full`) is this base class: it
does nothing at any step, and the publisher gathers and sends every tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bridge.errors import ConfigError

__all__ = ["Encoding"]


class Encoding:
    """The ``full`` encoding, and the base of every other (see the module docstring)."""

    name = "full"

    def __init__(self, config, rank: int, world: int):
        self.config, self.rank, self.world = config, rank, world

    @classmethod
    def check_config(cls, config, transport_cls) -> None:
        """A ConfigError when the transport cannot carry this encoding."""
        if cls.name not in transport_cls.encodings:
            raise ConfigError(f"the {transport_cls.name} transport cannot send the {cls.name} encoding; it sends "
                              f"{', '.join(transport_cls.encodings)} (encoding='delta' needs broadcast or colocated)")

    def run(self, publish: Callable[[], Any]) -> Any:
        """Every rank: run one ``publish()`` (the delta encoding runs it again, as an anchor, when a server
        refused a delta)."""
        return publish()

    def prepare(self, source, specs) -> Any:
        """Every rank: this rank's summary for :meth:`plan`."""
        return None

    def plan(self, plan, summaries: list) -> None:
        """Every rank: what the summaries of every rank say (the same on every rank)."""

    def begin(self, plan, transport) -> Any:
        """Rank 0: the decision of this sync, handed to every rank's :meth:`decided`."""
        return None

    def decided(self, plan, decision: Any) -> None:
        """Every rank: rank 0's decision."""

    def sends(self, plan) -> bool:
        """True when :meth:`transfer` moves this sync's bytes instead of the publisher's bucket loop."""
        return False

    def transfer(self, plan, steps) -> None:
        """Every rank: move the bytes (see :class:`bridge.encodings.delta.DeltaEncoding`)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Rank 0: wait for what :meth:`transfer` left in flight."""

    def committed(self, plan) -> None:
        """Every rank: the sync committed."""

    def failed(self, plan) -> None:
        """Every rank: the sync failed; undo what :meth:`prepare` changed. Never raises."""

    def result(self, plan) -> dict:
        """What :class:`bridge.publisher.PublishResult` reports of the encoding."""
        return {"encoding": "full"}

    def close(self) -> None:
        """The publisher is closed."""

