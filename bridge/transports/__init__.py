"""How a sync's buckets reach the servers: one module per transport, one lifecycle for all.

``base`` documents the lifecycle (begin, buffer, send, settle, commit, abort), which process runs each
step, and what receives the buckets on each rank (:class:`Sink`); :class:`bridge.publisher.core.WeightPublisher`
drives it. ``registry`` knows every transport by name: each module registers its class with
:func:`register`. The project's own: ``broadcast``, a custom process group (NCCL on GPU, gloo on CPU);
``colocated``, buckets handed over by reference on one host, as shared-memory files to the reference
server or as SGLang's CUDA IPC flattened buckets to real SGLang (``cuda_ipc``); ``disk``, HF snapshots
announced in name resolution.
"""

from __future__ import annotations

from bridge.transports.base import NoOptions, Plan, SessionOptions, Transport, option
from bridge.transports.registry import option_fields, register, transport_class, transport_names
from bridge.transports.sink import Sink, TransportSink

__all__ = [
    "NoOptions", "Plan", "SessionOptions", "Sink", "Transport", "TransportSink", "option", "option_fields", "register",
    "transport_class", "transport_names",
]
