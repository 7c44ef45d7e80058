"""What an encoding is: which bytes a sync sends and how they are laid out. The ``full`` encoding is this base.

Every trainer rank has one encoding object per publisher. An encoding never moves bytes itself: it says what
goes (:class:`Outgoing` buckets) and the publisher's one loop (:mod:`bridge.publisher.core`) sends each through the
sink of the rank it is gathered to (:mod:`bridge.transports.sink`). Its surface is six methods, each called by
the publisher at one step of the sync:

================  ========  =============================================================================
method            who       when / what
================  ========  =============================================================================
``prepare``       every     the prepare step, before anything moves: this rank's summary (a small picklable
                  rank      dataclass; every rank receives every rank's)
``plan``          every     after prepare, given every rank's summary, identically on every rank: returns a
                  rank      :class:`~bridge.publisher.plan.Planned`: its ``encoded`` (an
                            :class:`~bridge.publisher.plan.Encoded` dataclass, or None); an encoding whose
                            tensors travel otherwise than in the serving dtype plans the ``buckets`` again
                            from what it sends (the servers are checked against them), and may add
                            ``config_fields`` to a snapshot's ``config.json``
``decide``        rank 0    the begin step, servers paused: returns this sync's decision (``plan.decision``
                            on every rank; a delta or an anchor, say)
``buckets``       every     after begin: the buckets to send (:class:`Transfer`)
                  rank
``end``           every     the sync committed (``committed=True``) or failed at any step (False: undo what
                  rank      ``prepare`` changed; ``plan`` is None when it failed before it was planned)
``differs``       every     on a retry of the last version, only for an encoding that keeps what it
                  rank      published (``fingerprints = False``): why these weights are not those
================  ========  =============================================================================

What :class:`~bridge.publisher.result.PublishResult` reports of the encoding is ``plan.encoded.report()``.

The publisher, not the encoding, owns the version and retry decisions (:mod:`bridge.publisher.versions`): a retry of the
last version is safe only with the weights it published, which the publisher tells by a digest of each rank's
shards (``fingerprints = True``) or, for an encoding that keeps them (the delta's base), by its ``differs``;
a sync a server refused for its encoding (``DeltaBaseMismatch``) is published again at once as a full sync,
with ``plan.forced`` saying why.

An encoding is one module: a subclass registered with :func:`bridge.encodings.registry.register_encoding`,
and its module name in the registry's ``BUILTIN`` (or imported by the program). docs/architecture.md,
"Writing an encoding", shows one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bridge.buckets import Bucket
from bridge.errors import ConfigError
from bridge.options import NoOptions
from bridge.publisher.plan import Plan, Planned

__all__ = ["Encoding", "Outgoing", "Transfer", "gathered"]


@dataclass
class Outgoing:
    """One bucket a sync sends: what the sink receives, and how its bytes get into the sink's buffer."""

    step: str
    """The name of its agreed step (``bucket 3``); its failpoint is the name with ``:`` for the space."""
    bucket: Bucket
    """What the sink receives: names, dtypes, shapes and layout of the bytes, and the request's extra fields.
    Needed on the rank it is gathered to (the other ranks may give its specs alone)."""
    fill: Callable[[torch.Tensor | None, int, Any], None]
    """``fill(buf, dst, group)``, on every rank at once: the bytes into ``buf`` (``bucket.nbytes``) on rank
    ``dst`` (``buf`` is None on the other ranks, and on ``dst`` when its sink gave no buffer: it then only
    takes part), over the gather group."""
    to_owner: bool = False
    """Gathered to the rank its sink names (``Sink.owner``); else to rank 0. Where it goes from there is the sink's
    choice, never the encoding's."""


@dataclass
class Transfer:
    """What one sync sends: its buckets in order (the last one carries the version)."""

    buckets: list[Outgoing]
    sent: Callable[[], None] | None = None
    """Every rank, once every bucket was sent (the settle step begins): work that may start then."""
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(o.bucket.nbytes for o in self.buckets)


def gathered(plan: Plan) -> list[Outgoing]:
    """Every tensor of ``plan``, bucket by bucket, gathered from the weight source as the wire specs say (to the
    sink's owner when the source can gather to any rank)."""
    source = plan.source
    return [Outgoing(f"bucket {k}", b, lambda buf, dst, group, b=b: source.gather(b, buf, group, dst),
                     to_owner=source.gathers_to_any_rank) for k, b in enumerate(plan.buckets)]


class Encoding:
    """The ``full`` encoding, and the base of every other (see the module docstring)."""

    name = "full"
    Options: type = NoOptions
    """Its own settings: a dataclass of :func:`bridge.options.option` fields, checked in its ``__post_init__``
    (``PublisherConfig.encoding_options``; flat keywords of ``PublisherConfig`` and ``wsync train`` flags too)."""
    any_transport = True
    """Its buckets are plain named tensors, which every transport carries; False: only a transport that lists it
    in ``Transport.encodings`` carries it (a delta bucket needs one that passes its table on)."""
    fingerprints = True
    """The publisher takes a digest of each rank's shards at each new version, to tell a safe retry; False
    for an encoding whose own state tells it (:meth:`differs`)."""

    def __init__(self, config, rank: int, world: int):
        self.config, self.rank, self.world = config, rank, world

    @classmethod
    def check_config(cls, config, transport_cls) -> None:
        """A ConfigError when the transport cannot carry this encoding, or its settings are wrong."""
        if not cls.any_transport and cls.name not in transport_cls.encodings:
            raise ConfigError(f"the {transport_cls.name} transport cannot send the {cls.name} encoding; it sends "
                              f"{', '.join(transport_cls.encodings)} (encoding='delta' needs broadcast or colocated)")

    def prepare(self, source, specs) -> Any:
        """Every rank: this rank's summary for :meth:`plan` (None: nothing to say)."""
        return None

    def plan(self, plan: Plan, summaries: list) -> Planned:
        """Every rank: what every rank's summary says, the same on every rank (``Planned.encoded``); and what travels
        (``Planned.buckets``, ``Planned.config_fields``) when it is not the serving-dtype tensors. The publisher makes
        the sync's plan from it (the encoding never writes into ``plan``)."""
        return Planned()

    def decide(self, plan: Plan, servers) -> Any:
        """Rank 0, once the servers are paused (``servers``: the :class:`bridge.client.ServerGroup`, or None):
        this sync's decision, which becomes ``plan.decision`` on every rank."""
        return None

    def buckets(self, plan: Plan) -> Transfer:
        """Every rank: what this sync sends. Here: every tensor."""
        return Transfer(gathered(plan))

    def end(self, plan: Plan | None, committed: bool) -> None:
        """Every rank: the sync committed, or failed (then undo what :meth:`prepare` changed; never raises)."""

    def differs(self, source, specs) -> str | None:
        """Every rank, on a retry of the last version, when :attr:`fingerprints` is False: why this rank's weights
        are not the ones it published then, or cannot be shown to be; None when they are (the retry is safe)."""
        return f"the {self.name} encoding keeps nothing to compare the weights with"
