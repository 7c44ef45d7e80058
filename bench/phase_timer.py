"""Rank side of ``python -m bench.profile`` (see that module): the timed syncs of one method.

Kept apart from the command so that :mod:`bench.worker`, which runs it in the trainer's ranks, does not
import the driver (:mod:`bench.run`) back.
"""

from __future__ import annotations

import collections
import cProfile
import io
import os
import pstats
import time

__all__ = ["fixed_work", "profile_method"]


def profile_method(bench, method: str, repeats: int = 5, top: int = 30) -> dict | None:
    """Collective on every rank: ``repeats`` timed syncs of ``method`` (a :meth:`bench.worker._Bench.items`
    name) after one warm-up; rank 0's breakdown (None on the other ranks)."""
    import torch.distributed as dist

    items = dict(bench.items())
    if method not in items:
        raise SystemExit(f"unknown method {method!r}; choose one of {', '.join(n for n in items if not n.startswith('raw'))}")
    fn = items[method]
    if method.startswith("fp8+delta-lr"):  # its row publishes the step the delta row took: here it takes its own
        row, lr = fn, float(method[len("fp8+delta-lr"):])
        fn = lambda: (bench.delta._step(lr), row())[1]  # noqa: E731 (the record is the publish's alone)
    dist.barrier()
    rec = fn()  # warm-up: groups, connections, first allocations (rank 0: its record)
    # The same bucket plan's gather alone, timed between the syncs: how much slower it is inside one.
    name = [rec.get("gather_item") if rec else None]
    dist.broadcast_object_list(name, src=0)
    gather_alone = items.get(name[0])
    alone = []
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    restore = _instrument(bench, totals, counts) if bench.rank0 else []
    prof = cProfile.Profile() if bench.rank0 else None
    seconds, last = [], None
    try:
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            last = fn()
            if prof is not None:
                prof.disable()
            # The publish alone (a delta item's record leaves out its optimizer step).
            seconds.append(last["seconds"] if last and "seconds" in last else time.perf_counter() - t0)
            if gather_alone is not None:
                dist.barrier()
                r = gather_alone()
                if r:
                    alone.append(r["seconds"])
    finally:
        for undo in restore:
            undo()
    if not bench.rank0:
        return None
    snapshot = _snapshot_costs(last["path"]) if last and last.get("path") else {}
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    n = len(seconds)
    return {
        "label": bench.spec["label"], "method": method, "repeats": n, "tensors": len(bench.wire), "bytes": bench.nbytes,
        "seconds": seconds, "per_sync": {k: v / n for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "calls_per_sync": {k: v / n for k, v in counts.items()}, "cprofile": text.getvalue(),
        "gather_item": name[0], "gather_alone_seconds": alone, "snapshot": snapshot,
    }


def _snapshot_costs(path: str) -> dict:
    """Disk: what the load side of the last snapshot costs here, piece by piece: ``verify_snapshot`` alone
    (what the watcher does before real SGLang reads a snapshot), a plain unverified read of every tensor,
    and the reference server's read, which verifies the bytes it loads in the same pass."""
    from safetensors.torch import load_file

    from bridge.snapshot import read_snapshot, verify_snapshot

    if not os.path.isdir(path):
        return {}
    t = time.perf_counter()
    verify_snapshot(path)
    verify = time.perf_counter() - t
    t = time.perf_counter()
    nbytes = 0
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            for tensor in load_file(os.path.join(path, f)).values():
                nbytes += tensor.clone().nbytes  # the copy is what reads the mapped file
    read = time.perf_counter() - t
    t = time.perf_counter()
    for tensor in read_snapshot(path).values():
        tensor.clone()
    return {"verify_seconds": verify, "read_seconds": read, "verified_read_seconds": time.perf_counter() - t, "bytes": nbytes}


def _kind(step: str) -> str:
    """A step's name without its bucket number (``bucket 3`` -> ``bucket``)."""
    return step.rstrip("0123456789").strip()


FIXED_STEPS = ("begin", "settle", "commit")


def fixed_work(per_sync: dict) -> float:
    """The fixed work of one sync, from its pieces: the steps ``begin`` (pause, open the sessions, the group),
    ``settle`` (the wait for the last bucket) and ``commit`` (end the sessions, resume), each with its
    cross-rank agreement, and the agreement of every other step (prepare, each bucket)."""
    steps = sum(per_sync.get(f"step {s}", 0.0) for s in FIXED_STEPS)
    others = sum(v for k, v in per_sync.items() if k.startswith("agreement ") and k[len("agreement "):] not in FIXED_STEPS)
    return steps + others


def _instrument(bench, totals, counts) -> list:
    """Clock wrappers around the real calls on rank 0; returns the undo functions."""
    from bridge.client.connection import Connection
    from bridge.publisher.agreement import Agreement
    from bridge.sources import CheckedSource

    undo = []

    def timed(owner, attr, key):
        real = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                k = key(args) if callable(key) else key
                totals[k] += time.perf_counter() - t
                counts[k] += 1

        setattr(owner, attr, wrapper)
        undo.append(lambda: setattr(owner, attr, real))

    timed(CheckedSource, "gather", "gather")
    import bridge.encodings.fp8 as fp8_encoding
    from bridge.encodings.delta import DeltaEncoding

    timed(fp8_encoding, "gather_fp8_bucket", "fp8 bucket fill")
    for attr in ("prepare", "_diff", "_write_records", "end"):  # the delta encoding's own work (and fp8_delta's)
        timed(DeltaEncoding, attr, f"delta {attr.strip('_')}")
    timed(Agreement, "exchange", lambda args: f"agreement {_kind(args[1])}")
    timed(Agreement, "step", lambda args: f"step {_kind(args[1])}")
    timed(Connection, "call", lambda args: f"http {args[2]}")  # (self, method, route, ...)
    extra = [bench.fp8.pub] if getattr(bench, "fp8", None) is not None else []
    extra += list(bench.delta.pubs.values()) if getattr(bench, "delta", None) is not None else []
    for pub in [bench.broadcast, bench.colocated, *bench.disks.values(), *extra]:
        transport = getattr(pub, "_transport", None) if pub is not None else None
        if transport is not None:  # built at the warm-up publish
            for attr in ("begin", "buffer", "send", "settle", "commit"):
                timed(transport, attr, attr)
    return undo
