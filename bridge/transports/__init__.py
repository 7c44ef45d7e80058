"""How a sync's buckets reach the servers: one module per transport, one lifecycle for all.

``base`` documents the lifecycle (begin, buffer, send, settle, commit, abort) and which process runs
each step; :class:`bridge.publisher.WeightPublisher` drives it. ``broadcast``: a custom process group
(NCCL on GPU, gloo on CPU); ``colocated``: buckets handed over by reference on one host, as shared-memory
files to the reference server or as SGLang's CUDA IPC flattened buckets to real SGLang (``cuda_ipc``);
``disk``: HF snapshots announced in name resolution.
"""

from __future__ import annotations

from bridge.transports.base import Plan, Transport

__all__ = ["Plan", "Transport", "make_transport", "transport_class"]


def transport_class(name: str) -> type[Transport]:
    """The class of the transport called ``name`` (``broadcast``, ``colocated`` or ``disk``)."""
    if name == "broadcast":
        from bridge.transports.broadcast import BroadcastTransport

        return BroadcastTransport
    if name == "colocated":
        from bridge.transports.colocated import ColocatedTransport

        return ColocatedTransport
    from bridge.transports.disk import DiskTransport

    return DiskTransport


def make_transport(config, servers) -> Transport:
    """The transport named by ``config.transport``, talking to ``servers`` (a ServerGroup or None)."""
    return transport_class(config.transport)(config, servers)
