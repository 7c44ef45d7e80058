"""Versioned weight publishing: one sync of a trainer's weights into every server.

A :class:`WeightPublisher` is created once by the training script (on every rank) and
``publish(source, version)`` is called collectively by every trainer rank after each step. It drives
one sync through the same steps whatever the transport (:mod:`bridge.transports`, registered by name);
after each step every rank learns every rank's outcome (:mod:`bridge.publisher.agreement`):

``WeightPublisher._publish`` (:mod:`bridge.publisher.core`) is these five steps, each one call:

1. **prepare** (every rank): the wire specs and bucket plan, and the encoding's summary (``Encoding.prepare``,
   then ``plan`` with every rank's, which may plan the buckets again from what it sends); then, in a step
   "check", rank 0 asks the servers whether they serve what the plan sends (:mod:`bridge.publisher.preflight`). On a
   retry of the last version each rank tells whether its shards still hold the weights it published then
   (:mod:`bridge.publisher.versions`: a digest of them, or the encoding's ``differs`` for one that keeps them, the
   delta's base); with every rank's answer, every rank decides the same thing: an older version, or the
   last version with other weights, is a :class:`VersionError` before any byte moves; the last version with
   the same weights is a safe retry.
2. **begin** (rank 0): the transport opens the sync (process group, pause, update sessions, snapshot) and
   the encoding decides (``Encoding.decide``: a delta or an anchor, say), which every rank learns.
3. **bucket k** (every rank): the encoding's buckets (``Encoding.buckets``), one agreed step each, in one
   loop: every rank fills the bucket's bytes into one rank's buffer (for ``full``, a few flat gathers on a
   group whose timeout is ``group_timeout``), and that rank's sink sends it (:mod:`bridge.transports.sink`,
   chosen by ``Transport.sink``). By default it is rank 0, whose sink is its transport: it waits for bucket
   k-1 to arrive, then sends bucket k (so the gather of k overlaps the transfer of k-1, and rank 0 holds
   about two buckets at most); the last bucket carries the version. A transport may give every rank a sink
   of its own instead (a writer of its own shards, say).
4. **settle** (every rank): every sink waits until what it sent arrived and reports, and every rank says
   whether it may commit.
5. **commit** (rank 0): the version goes live, given every rank's report.

Each step returns what it learned as a typed result (the encoding's :class:`~bridge.publisher.plan.Planned`, the
label check, the decision, the transport's outcome), and the publisher alone makes the next
:class:`~bridge.publisher.plan.Plan` from it. Where a bucket goes is its transport's route (``Transport.route``: a
delta for SGLang's loader goes over HTTP), never the encoding's; what each server can do is one object
(``client.can``, :mod:`bridge.client.capabilities`). Between publishes, rank 0 keeps a server behind the fleet's
version out of rotation (:mod:`bridge.fleet.guard`).

Ctrl-C and SIGTERM are held until the step in progress ends, then fail the sync the same way before
they take effect (:mod:`bridge.publisher.interrupts`). Any exception on any rank, of any type, in any step, makes
every rank raise the same error (the first
failure's class when it is one of the project's, else :class:`SyncError` naming the rank, the step and
the cause) within the step's bound; every sink aborts, the encoding undoes its prepare (``Encoding.end``),
and rank 0 calls the transport's ``abort``: every server keeps
serving its previous version, unpaused, with no open session; a snapshot that was not complete is
removed, never announced. A trainer that catches the error can publish again.

Version semantics: versions are integers, strictly increasing per publisher (and, for a transport that
announces them, per (experiment, trial) in name resolution). A version whose publish failed was never
completed, so retrying it is allowed.

Example (one process, a reference server started with ``wsync serve --preset tiny``):

    >>> from bridge import WeightPublisher, PublisherConfig          # doctest: +SKIP
    >>> pub = WeightPublisher(PublisherConfig(servers=["http://127.0.0.1:30000"]))  # doctest: +SKIP
    >>> result = pub.publish(model, version=1)                       # doctest: +SKIP
    >>> result.version, result.servers                               # doctest: +SKIP
    (1, {'http://127.0.0.1:30000': 'ok'})

The modules: :mod:`~bridge.publisher.lifecycle` (:class:`~bridge.publisher.lifecycle.Publisher`, what this publisher
and the adapters' one share), :mod:`~bridge.publisher.core` (:class:`WeightPublisher`, the steps), :mod:`~bridge.publisher.agreement`
(every rank learns every outcome of a step in bounded time), :mod:`~bridge.publisher.bounded` (calls that cannot
hang the caller, and the bounds of one sync), :mod:`~bridge.publisher.versions` and :mod:`~bridge.publisher.labels`
(which versions may be published), :mod:`~bridge.publisher.interrupts` (Ctrl-C and SIGTERM held to the end of a
step), :mod:`~bridge.publisher.preflight` and :mod:`~bridge.publisher.preflight_sglang` (what is checked before the
first sync), :mod:`~bridge.publisher.plan` (what one sync moves), :mod:`~bridge.publisher.result` (what it
returns) and :mod:`~bridge.publisher.memory` (rank 0's peak memory).
"""

from __future__ import annotations

from bridge import lazy_exports

_EXPORTS = {"WeightPublisher": "bridge.publisher.core", "PublisherConfig": "bridge.publisher.core",
            "PublishResult": "bridge.publisher.result"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
