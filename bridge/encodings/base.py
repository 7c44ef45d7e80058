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

``wire_specs`` (every rank, in the prepare step) may change what travels for the source's tensors (names, dtypes,
shapes: the ``fp8`` encoding adds scales), and ``gather`` (every rank, in each bucket step of the publisher's loop)
fills a bucket of those. ``transferred`` (every rank, as the settle step begins) says this rank's part of the
transfer is done. ``run`` wraps each ``publish()``. A retry of the last version is safe only with the weights
it published: ``differs`` (every rank, on a retry, before ``prepare``) says why not; ``fingerprint`` (every
rank, in the prepare step of a new version) starts taking what it will compare with, and ``fingerprinted``
(every rank, at settle) waits for it, as the weights may change once ``publish()`` returns.

The ``full`` encoding (:mod:`bridge.encodings.full`) is this base class: it fingerprints a version by each
rank's digest of its shards (taken on a thread while the buckets travel), does nothing at the other steps,
and the publisher gathers and sends every tensor.
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
        # This rank's digest of its shards: the one this sync takes (a 1-tuple of its Future, or of None when the
        # source has no digest; None when the sync takes none: a retry, the weights are the same) and the last
        # version's.
        self._pending: tuple | None = None
        self._published: int | None = None

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

    def wire_specs(self, specs: list) -> list:
        """Every rank, in the prepare step: what travels for ``specs`` (the source's tensors in the serving dtype);
        the buckets are planned from it and the servers' weights_spec is checked against it. Here: ``specs``."""
        return specs

    def gather(self, source, bucket, buf, group, dst: int) -> None:
        """Every rank, in the publisher's step of bucket k: fill rank ``dst``'s ``buf`` with ``bucket`` (collective).
        Here: the source's own gather (:meth:`bridge.sources.CheckedSource.gather`)."""
        source.gather(bucket, buf, group, dst)

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

    def transferred(self) -> None:
        """Every rank, as the settle step begins: this rank's part of the transfer is done."""

    def committed(self, plan) -> None:
        """Every rank: the sync committed."""
        if self._pending is not None:  # (taken: fingerprinted waited for it)
            (future,), self._pending = self._pending, None
            self._published = future.result() if future is not None else None

    def differs(self, source, specs) -> str | None:
        """Every rank, on a retry of the last version (before :meth:`prepare`): why this rank's weights are not the
        ones it published then, or cannot be shown to be; None when they are (the retry is safe). Here: this
        rank's digest of its shards (``local_digest``) against the one taken then."""
        digest = source.digest()
        if digest is None:
            return "the weight source has no local_digest(), so a retry cannot be told from new weights"
        return None if digest == self._published else "other weights"

    def fingerprint(self, source) -> None:
        """Every rank, in the prepare step of a new version: start taking what :meth:`differs` compares with at a
        retry. Here: this rank's digest, on a thread while the buckets travel."""
        self._pending = (source.digest_in_background(),)

    def fingerprinted(self) -> None:
        """Every rank, at settle: the fingerprint is taken (the weights may change once ``publish`` returns);
        an error taking it fails the sync."""
        if self._pending is not None and self._pending[0] is not None:
            self._pending[0].result()

    def failed(self, plan) -> None:
        """Every rank: the sync failed; undo what :meth:`prepare` changed. Never raises."""
        self._pending = None  # (the last version's digest stays)

    def result(self, plan) -> dict:
        """What :class:`bridge.publisher.PublishResult` reports of the encoding."""
        return {"encoding": "full"}

    def close(self) -> None:
        """The publisher is closed."""

