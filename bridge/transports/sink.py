"""What receives a sync's buckets on one trainer rank: the :class:`Sink` protocol, and rank 0's default sink,
its transport (:class:`TransportSink`).

Every rank has one sink per publisher, chosen by its transport (``Transport.sink``): rank 0's is the transport
itself by default; disk with ``disk_writers="all"`` gives every rank a writer of its own shards
(:class:`bridge.transports.shard_writer.ShardWriter`); rank 0's sends a bucket the way its transport routes it
(``Transport.route``: a delta for real SGLang goes to the loader's, :class:`bridge.transports.loader.LoaderSink`). The publisher hands each bucket to the sink of the rank it
was gathered to, always the same way:

============  ==================================================================================================
method        what
============  ==================================================================================================
``buffer``    the uint8 tensor bucket ``k`` is gathered into (of ``bucket.nbytes``)
``send``      put bucket ``k`` (in that buffer) on its way; it may return before it arrived, but a sink holds at
              most one bucket in flight (it first waits for the one before). ``version`` is set on the last
              bucket only.
``settle``    wait until every bucket handed to ``send`` arrived (raise if one did not); what it returns is this
              rank's report, which reaches rank 0's ``Transport.commit``. Called on every rank at the settle
              step; idempotent.
``abort``     the sync failed: stop within ``seconds`` and remove what this sink made. Never raises.
============  ==================================================================================================

``owner`` (which rank bucket ``k`` is gathered to), ``begin`` (a sync starts, with what rank 0's transport
opened) and ``close`` have defaults.
"""

from __future__ import annotations

from typing import Any

import torch

from bridge.buckets import Bucket
from bridge.publisher.plan import Plan

__all__ = ["Sink", "TransportSink"]


class Sink:
    """What receives buckets on one rank (see the module docstring). This one receives none: the sink of a rank
    that only takes part in the gathers."""

    stops_before_abort = False
    """True when every rank's sink must have stopped (``abort``) before rank 0's transport aborts (its files
    live in the folder rank 0 removes); the publisher then waits for all of them."""

    def owner(self, k: int) -> int:
        """The rank bucket ``k`` is gathered to (when the source can gather to any rank; else rank 0)."""
        return 0

    def begin(self, opened: Any, plan: Plan) -> None:
        """A sync starts; ``opened`` is what rank 0's ``Transport.begin`` returned."""

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        """The uint8 tensor bucket ``k`` is gathered into."""
        raise NotImplementedError(f"{type(self).__name__} receives no bucket")

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        """Put bucket ``k`` on its way (at most one in flight); ``version`` on the last bucket only."""
        raise NotImplementedError(f"{type(self).__name__} receives no bucket")

    def settle(self) -> Any:
        """Wait until every bucket sent arrived (raise if one did not); this rank's report for the commit."""
        return None

    def abort(self, seconds: float) -> None:
        """The sync failed: stop within ``seconds`` and remove what this sink made. Never raises."""

    def close(self) -> None:
        """The publisher is closed."""


class TransportSink(Sink):
    """Rank 0's default sink: every bucket goes the route its transport chooses (``Transport.route``: the transport
    itself, or a delta for SGLang's loader over HTTP), one in flight at most on each. The transport's own ``abort``
    (rank 0, after the agreement) undoes the sync."""

    def __init__(self, transport):
        """``transport``: rank 0's :class:`bridge.transports.Transport`."""
        self.transport = transport
        self._routes: list[Sink] = []  # the other routes this sync's buckets took

    def begin(self, opened: Any, plan: Plan) -> None:
        self._routes = []

    def _route(self, bucket: Bucket) -> Sink | None:
        route = self.transport.route(bucket)
        if route is not None and route not in self._routes:
            self._routes.append(route)
        return route

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        route = self._route(bucket)
        return route.buffer(k, bucket) if route is not None else self.transport.buffer(k, bucket)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        route = self._route(bucket)
        if route is not None:
            route.send(k, bucket, buf, version)
            return
        self.transport.settle()  # bucket k-1 arrived first: one bucket in flight at most
        self.transport.send(k, bucket, buf, version)

    def settle(self) -> None:
        for route in self._routes:
            route.settle()
        self.transport.settle()

    def abort(self, seconds: float) -> None:
        for route in self._routes:
            route.abort(seconds)
