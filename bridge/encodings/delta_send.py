"""How a delta's buckets are formed: each rank encodes its own pieces, rank 0 receives them, and where they go.

Per delta bucket (:class:`bridge.encodings.delta.DeltaBucket`), in one agreed step of the publisher's loop:
every rank writes the records of its own pieces (its sizes are known to every rank since prepare); rank 0
writes its own at the start of the bucket's wire buffer and receives each other rank's straight after them
(one point-to-point receive per rank on the gather group, no padding, no full tensor anywhere), then the
publisher sends the buffer through rank 0's sink:

* to the project's reference servers (``via="native"``), through rank 0's sink (its transport), as a bucket of one
  uint8 tensor named :data:`DELTA_TENSOR` whose request carries the delta's table (``wsync_delta``: base
  version and digest, the layout of the trainer's pieces, names, dtypes, shapes). The broadcast transport
  broadcasts it on its group, the colocated one hands it over in a shared-memory file;
* to real SGLang (``via="loader"``), started with ``--custom-weight-loader`` :data:`LOADER`, as
  ``/update_weights_from_tensor`` with ``load_format=LOADER``: a pickle of plain tensors (the table as JSON
  bytes, and the records), which SGLang's ``SafeUnpickler`` accepts; SGLang calls the loader
  (:mod:`bridge.serving.sglang_delta_loader`) in every TP rank's scheduler process.

A delta to real SGLang travels over HTTP whatever the transport (it has no route that takes a
``load_format`` and bytes from the group), so the group of the broadcast transport carries only anchors.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from bridge.buckets import Bucket
from bridge.codecs.delta import DELTA_TENSOR
from bridge.encodings.base import Outgoing
from bridge.tensors import ParamSpec, dtype_to_str
from bridge.transports.sessions import bucket_answers
from bridge.transports.sink import Sink

__all__ = ["LOADER", "LoaderSink", "ZSTD_SGLANG", "delta_buckets", "delta_route", "table", "zstd_unreadable"]

LOADER = "bridge.serving.sglang_delta_loader.load_delta"
"""The loader real SGLang calls for a delta: ``--custom-weight-loader`` and ``load_format`` name it."""


def delta_route(servers, base_version: int | None) -> tuple[str | None, str | None]:
    """Rank 0, servers paused: (why this sync must be an anchor, None) or (None, ``native``/``loader``).

    A server the fleet (:mod:`bridge.fleet`) took out of rotation gets an anchor: it restarted, joined, serves
    another version, or may be torn or was left paused by a failed sync or commit, and this sync is what
    repairs it, with every tensor. Otherwise reference servers check the base version and digest of every
    delta bucket themselves; real SGLang's loader cannot answer a refusal, so before a delta to it every
    server must report the base version."""
    out = servers.out_of_rotation
    if out:
        return ("out of rotation until a full sync repairs it: "
                + "; ".join(f"{u} ({why})" for u, why in out.items())), None
    clients = servers.clients
    reference = [c.is_reference_server for c in clients]
    if any(reference) and not all(reference):
        return ("the servers are of two kinds (reference server and real SGLang), and a delta goes to each kind "
                "another way; publish to each kind with a publisher of its own"), None
    if all(reference):  # each checks the base itself, refusing before it stages anything: no round trip here
        return None, "native"
    missing = [c.url for c in clients if LOADER not in c.custom_weight_loaders]
    if missing:
        return (f"{', '.join(missing)} was not started with --custom-weight-loader {LOADER}, so it cannot "
                "apply a delta"), None
    off = {u: v for u, v in servers.weight_versions().items() if v != str(base_version)}
    if off:
        return ("a server does not serve the base version " + str(base_version) + ": "
                + ", ".join(f"{u} serves {v}" for u, v in off.items())), None
    return None, "loader"


ZSTD_SGLANG = (0, 5, 20)
"""The first SGLang release that requires the ``zstandard`` package: before it, its environment may lack it."""


def zstd_unreadable(clients) -> str | None:
    """Rank 0: why some server may not read zstd delta records, or None. Real SGLang before :data:`ZSTD_SGLANG` does
    not require ``zstandard``, and the loader cannot refuse a record it cannot read (an exception in a loader ends
    SGLang's scheduler), so those get records without the zstd stage. A reference server without ``zstandard``
    refuses a zstd record with a reason (``pip install zstandard``) before it applies anything."""
    from bridge.protocol import parse_version

    old = [f"{c.url} (SGLang {c.version})" for c in clients
           if not c.is_reference_server and parse_version(c.version) < ZSTD_SGLANG]
    if not old:
        return None
    return (f"{', '.join(old)} may lack the zstandard package (SGLang requires it from "
            f"{'.'.join(map(str, ZSTD_SGLANG))} on) and cannot read zstd delta records")


def table(db, enc, version: int, first: bool) -> dict:
    """The delta bucket's table: what a server needs besides the bytes (``wsync_delta``). For the SGLang
    loader, the first bucket also carries the base values to check (``probes``)."""
    out = {"base_version": str(enc.base_version), "base_digest": db.digest, "world": enc.world, "whole": db.whole,
           "names": [s.name for s in db.specs], "dtypes": [dtype_to_str(s.dtype) for s in db.specs],
           "shapes": [list(s.shape) for s in db.specs], "version": str(version)}
    if first and enc.via == "loader":
        out["probes"] = enc.probes
    return out


def delta_buckets(plan, rank: int, write: Callable[[list, torch.Tensor], int], servers,
                  http_timeout: float) -> list[Outgoing]:
    """Every rank: ``plan``'s delta buckets, each gathered to rank 0 (its own records first, then each other
    rank's). ``write(specs, out)``: this rank's records of the tensors ``specs`` into ``out``, the bytes it
    wrote (the encoding's, which holds the changes and the base); ``servers`` (rank 0): where the loader's
    sink sends them, for real SGLang, each call bounded by ``http_timeout``."""
    enc = plan.encoded
    sink = LoaderSink(servers, http_timeout) if rank == 0 and enc.via == "loader" else None
    out = []
    for j, db in enumerate(enc.buckets):
        extra = {"wsync_delta": table(db, enc, plan.version, j == 0)} if rank == 0 else {}
        bucket = Bucket([ParamSpec(DELTA_TENSOR, (db.nbytes,), torch.uint8)], extra=extra)
        out.append(Outgoing(f"delta {j}", bucket,
                            lambda buf, dst, group, db=db: _fill(rank, write, db, buf, dst, group), sink=sink))
    return out


def _fill(rank: int, write, db, buf: torch.Tensor | None, dst: int, group) -> None:
    """Every rank: this rank's records of bucket ``db``; rank ``dst`` (0) writes its own at the start of ``buf``
    and receives each other rank's straight after them, the others send theirs."""
    own = db.sizes[rank]
    if rank != dst:
        if own:
            out = torch.empty(own, dtype=torch.uint8, device=_p2p_device(group))
            _encode(write, db, out)
            dist.send(out, dst=dst, group=group)
        return
    if buf is None:  # (its sink gave no buffer: the step fails on this rank, which leaves the group)
        return
    _encode(write, db, buf[:own])
    buf[sum(db.sizes):].zero_()
    _receive(buf, db.sizes, group)


def _p2p_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _receive(buf: torch.Tensor, sizes: list[int], group) -> None:
    """Rank 0: every other rank's records, straight after the ones before them in ``buf``."""
    device = _p2p_device(group) if len(sizes) > 1 else buf.device
    at, works = sizes[0], []
    for r in range(1, len(sizes)):
        if sizes[r]:
            dst = buf[at : at + sizes[r]]
            tmp = dst if dst.device == device else torch.empty(sizes[r], dtype=torch.uint8, device=device)
            works.append((dist.irecv(tmp, src=r, group=group), dst, tmp))
        at += sizes[r]
    for work, dst, tmp in works:
        work.wait()
        if tmp is not dst:
            dst.copy_(tmp)


def _encode(write, db, out: torch.Tensor) -> None:
    """This rank's records of the bucket's tensors into ``out`` (exactly its planned size)."""
    at = write(db.specs, out)
    if at != out.numel():
        raise RuntimeError(f"encoded {at} bytes of a delta bucket, planned {out.numel()}")


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
        head = json.dumps(bucket.extra["wsync_delta"]).encode()
        payload = [(DELTA_TENSOR + ".table", torch.frombuffer(bytearray(head), dtype=torch.uint8)),
                   (DELTA_TENSOR + ".records", buf.cpu())]
        entry = base64.b64encode(pickle.dumps(payload, protocol=4)).decode()
        last = version is not None
        futures = self.servers.submit(lambda c: c.update_weights_from_tensor(
            [entry] * c.tp_size, load_format=LOADER, flush_cache=last, timeout=self.http_timeout))
        self._inflight = (k, futures)

    def settle(self) -> None:
        if self._inflight is None:
            return
        (k, futures), self._inflight = self._inflight, None
        bucket_answers(self.servers.clients, futures, k, self.http_timeout, "http_timeout")

    def abort(self, seconds: float) -> None:
        self._inflight = None  # (the transport's abort gives the servers back)

