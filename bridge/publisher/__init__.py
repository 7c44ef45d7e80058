"""The publisher's lifecycle: one sync as agreed steps on every trainer rank.

:mod:`bridge.publisher.core` holds :class:`WeightPublisher`, which drives the steps (prepare, begin, one per bucket,
commit); beside it what it decides with: :mod:`~bridge.publisher.agreement` (every rank learns every outcome of a
step in bounded time), :mod:`~bridge.publisher.versions` and :mod:`~bridge.publisher.labels` (which versions may be
published), :mod:`~bridge.publisher.interrupts` (Ctrl-C and SIGTERM held to the end of a step),
:mod:`~bridge.publisher.bounded` (calls that cannot hang the caller), :mod:`~bridge.publisher.preflight` and
:mod:`~bridge.publisher.preflight_sglang` (what is checked before the first sync), :mod:`~bridge.publisher.plan`
(what one sync moves), :mod:`~bridge.publisher.result` (what it returns) and :mod:`~bridge.publisher.memory` (rank
0's peak memory).
"""

from __future__ import annotations

from bridge import lazy_exports

_EXPORTS = {"WeightPublisher": "bridge.publisher.core", "PublisherConfig": "bridge.publisher.core",
            "PublishResult": "bridge.publisher.result"}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
