"""The route of a delta into real SGLang: each delta bucket as ``/update_weights_from_tensor`` for SGLang's custom
loader, over HTTP, whatever the transport (:class:`LoaderSink`).

SGLang started with ``--custom-weight-loader`` :data:`bridge.protocol.DELTA_LOADER` takes ``load_format`` naming it and
a pickle of plain tensors (the delta's table as JSON bytes, and the records), which its ``SafeUnpickler`` accepts;
it calls the loader (:mod:`bridge.serving.sglang_delta_loader`) in every TP rank's scheduler process. Rank 0's
sink routes a delta bucket here when the servers take deltas this way
(:attr:`bridge.client.capabilities.Capabilities.delta`).
"""

from __future__ import annotations

import base64
import json
import pickle

import torch

from bridge.buckets import Bucket
from bridge.codecs.delta import DELTA_FIELD, DELTA_TENSOR
from bridge.protocol import DELTA_LOADER
from bridge.transports.sessions import bucket_answers
from bridge.transports.sink import Sink

__all__ = ["LoaderSink"]


class LoaderSink(Sink):
    """Rank 0's sink of a delta for real SGLang: each delta bucket as ``/update_weights_from_tensor`` to every
    server, for SGLang's loader, one in flight at most."""

    def __init__(self, servers, http_timeout: float):
        self.servers, self.http_timeout = servers, http_timeout
        self._inflight = None  # (k, futures)

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        return torch.empty(bucket.nbytes, dtype=torch.uint8)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        self.settle()  # one bucket in flight at most
        head = json.dumps(bucket.extra[DELTA_FIELD]).encode()
        payload = [(DELTA_TENSOR + ".table", torch.frombuffer(bytearray(head), dtype=torch.uint8)),
                   (DELTA_TENSOR + ".records", buf.cpu())]
        entry = base64.b64encode(pickle.dumps(payload, protocol=4)).decode()
        last = version is not None
        futures = self.servers.submit(lambda c: c.update_weights_from_tensor(
            [entry] * c.tp_size, load_format=DELTA_LOADER, flush_cache=last, timeout=self.http_timeout))
        self._inflight = (k, futures)

    def settle(self) -> None:
        if self._inflight is None:
            return
        (k, futures), self._inflight = self._inflight, None
        bucket_answers(self.servers.clients, futures, k, self.http_timeout, "http_timeout")

    def abort(self, seconds: float) -> None:
        self._inflight = None  # (the transport's abort gives the servers back)

