"""How a delta's buckets are formed: each rank encodes its own pieces, rank 0 receives them, and where they go.

Per delta bucket (:class:`bridge.encodings.delta.DeltaBucket`), in one agreed step of the publisher's loop:
every rank writes the records of its own pieces (its sizes are known to every rank since prepare); rank 0
writes its own at the start of the bucket's wire buffer and receives each other rank's straight after them
(one point-to-point receive per rank on the gather group, no padding, no full tensor anywhere), then the
publisher sends the buffer through rank 0's sink:

a bucket of one uint8 tensor named :data:`DELTA_TENSOR` whose request carries the delta's table (``wsync_delta``:
base version and digest, the layout of the trainer's pieces, names, dtypes, shapes). Where it goes, rank 0's sink
decides from what the servers can do (:class:`bridge.transports.sink.TransportSink`):

* to the project's reference servers (``via="native"``), through the transport: the broadcast transport
  broadcasts it on its group, the colocated one hands it over in a shared-memory file;
* to real SGLang (``via="loader"``), started with ``--custom-weight-loader`` :data:`LOADER`, over HTTP whatever
  the transport (SGLang has no route that takes a ``load_format`` and bytes from a group):
  :class:`bridge.transports.loader.LoaderSink`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from bridge.buckets import Bucket
from bridge.codecs.delta import DELTA_FIELD, DELTA_TENSOR
from bridge.encodings.base import Outgoing
from bridge.protocol import DELTA_LOADER, ZSTD_SGLANG
from bridge.tensors import ParamSpec, dtype_to_str

__all__ = ["LOADER", "ZSTD_SGLANG", "delta_buckets", "delta_route", "table", "zstd_unreadable"]

LOADER = DELTA_LOADER
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
    routes = {c.url: c.can.delta for c in servers.clients}
    native = [r == "native" for r in routes.values()]
    if any(native) and not all(native):
        return ("the servers are of two kinds (reference server and real SGLang), and a delta goes to each kind "
                "another way; publish to each kind with a publisher of its own"), None
    if all(native):  # each checks the base itself, refusing before it stages anything
        return None, "native"
    missing = [u for u, r in routes.items() if r is None]
    if missing:
        return (f"{', '.join(missing)} was not started with --custom-weight-loader {LOADER}, so it cannot "
                "apply a delta"), None
    off = {u: v for u, v in servers.weight_versions().items() if v != str(base_version)}
    if off:
        return ("a server does not serve the base version " + str(base_version) + ": "
                + ", ".join(f"{u} serves {v}" for u, v in off.items())), None
    return None, "loader"


def zstd_unreadable(clients) -> str | None:
    """Rank 0: why some server may not read zstd delta records, or None. Real SGLang before
    :data:`bridge.protocol.ZSTD_SGLANG` does not require ``zstandard``, and the loader cannot refuse a record it
    cannot read (an exception in a loader ends SGLang's scheduler), so those get records without the zstd stage
    (:attr:`bridge.client.capabilities.Capabilities.zstd_records`)."""
    old = [f"{c.url} ({c.can.kind})" for c in clients if not c.can.zstd_records]
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


def delta_buckets(plan, rank: int, write: Callable[[list, torch.Tensor], int]) -> list[Outgoing]:
    """Every rank: ``plan``'s delta buckets, each gathered to rank 0 (its own records first, then each other
    rank's). ``write(specs, out)``: this rank's records of the tensors ``specs`` into ``out``, the bytes it
    wrote (the encoding's, which holds the changes and the base). Where they go is rank 0's sink's choice
    (:class:`bridge.transports.sink.TransportSink`)."""
    enc = plan.encoded
    out = []
    for j, db in enumerate(enc.buckets):
        extra = {DELTA_FIELD: table(db, enc, plan.version, j == 0)} if rank == 0 else {}
        bucket = Bucket([ParamSpec(DELTA_TENSOR, (db.nbytes,), torch.uint8)], extra=extra)
        out.append(Outgoing(f"delta {j}", bucket,
                            lambda buf, dst, group, db=db: _fill(rank, write, db, buf, dst, group)))
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
