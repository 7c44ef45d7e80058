"""How a sync's buckets reach the servers: one module per transport, one lifecycle for all.

``base`` documents the lifecycle (begin, buffer, send, settle, commit, abort) and which process runs
each step; :class:`bridge.publisher.WeightPublisher` drives it. ``broadcast``: a custom process group
(NCCL on GPU, gloo on CPU); ``colocated``: shared-memory files on one host (reference server);
``disk``: HF snapshots announced in name resolution.
"""

from __future__ import annotations

from bridge.transports.base import Plan, Transport

__all__ = ["Plan", "Transport", "make_transport"]


def make_transport(config, servers) -> Transport:
    """The transport named by ``config.transport``, talking to ``servers`` (a ServerGroup or None)."""
    if config.transport == "broadcast":
        from bridge.transports.broadcast import BroadcastTransport

        return BroadcastTransport(config, servers)
    if config.transport == "colocated":
        from bridge.transports.colocated import ColocatedTransport

        return ColocatedTransport(config, servers)
    from bridge.transports.disk import DiskTransport

    return DiskTransport(config, servers)
