"""Where one method's sync time goes: ``python -m bench.profile --size many --method flat-32MiB``.

The bench says how far a method is from its floor; this says why, measured. It runs the same trainer job
as ``wsync bench`` (same server, watchers, FSDP ranks, publishers: :func:`bench.run._measure_size`), but
rank 0 times the pieces of each sync instead of the sync alone:

- ``gather``: ``bridge.publisher._gather_into`` (every bucket's gather to rank 0);
- ``begin`` / ``buffer`` / ``send`` / ``settle`` / ``commit``: the transport's own lifecycle methods
  (``settle`` is the wait for a bucket's server answers and broadcast; ``commit`` ends the sessions and
  resumes, or for disk finishes, announces and waits until loaded);
- ``agreement``: ``Agreement.exchange``, the cross-rank vote after every step (it also absorbs the time a
  rank waits for a slower one);
- ``http <route>``: every HTTP call rank 0 makes, by route, and how many per sync (these overlap the
  above: an update request is posted in ``send`` and waited for in ``settle``).

The wrappers only read the clock around the real calls; nothing is replaced. A cProfile of rank 0 over
the timed syncs (top functions by cumulative time) is kept with the figures. One warm-up sync first.

Example:
    python -m bench.profile --size many --method per-tensor --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time

__all__ = ["main", "profile_method"]


def profile_method(bench, method: str, repeats: int = 5, top: int = 30) -> dict | None:
    """Collective on every rank: ``repeats`` timed syncs of ``method`` (a :meth:`bench.worker._Bench.items`
    name) after one warm-up; rank 0's breakdown (None on the other ranks)."""
    import torch.distributed as dist

    items = dict(bench.items())
    if method not in items:
        raise SystemExit(f"unknown method {method!r}; choose one of {', '.join(n for n in items if not n.startswith('raw'))}")
    fn = items[method]
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
            seconds.append(time.perf_counter() - t0)
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
    """Disk: what the load side of the last snapshot costs here, piece by piece (the watcher verifies the
    snapshot, then the server reads it): ``verify_snapshot`` alone, and reading every tensor of it."""
    from safetensors.torch import load_file

    from bridge.snapshot import verify_snapshot

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
    return {"verify_seconds": verify, "read_seconds": time.perf_counter() - t, "bytes": nbytes}


def _instrument(bench, totals, counts) -> list:
    """Clock wrappers around the real calls on rank 0; returns the undo functions."""
    import bridge.publisher as publisher
    from bridge.agreement import Agreement
    from bridge.client import ServerClient

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

    timed(publisher, "_gather_into", "gather")
    timed(Agreement, "exchange", "agreement")
    timed(ServerClient, "_call", lambda args: f"http {args[2]}")
    for pub in [bench.broadcast, bench.colocated, *bench.disks.values()]:
        transport = getattr(pub, "_transport", None) if pub is not None else None
        if transport is not None:  # built at the warm-up publish
            for attr in ("begin", "buffer", "send", "settle", "commit"):
                timed(transport, attr, attr)
    return undo


def main(argv: list[str] | None = None) -> int:
    from bench.run import BenchConfig, _clean_run, _mkdir, _model_dir, placement

    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="many", help="preset (default many)")
    p.add_argument("--method", default="flat-32MiB", help="flat-<N>MiB, per-tensor, colocated-<N>MiB or disk-dir")
    p.add_argument("--bucket-mb", type=float, default=32.0, help="the flat/colocated bucket size (default 32)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--top", type=int, default=30, help="functions of the cProfile to show (by cumulative time)")
    p.add_argument("--json", help="also write the breakdown here")
    args = p.parse_args(argv)
    kw = {"workdir": args.workdir} if args.workdir else {}
    cfg = BenchConfig(sizes=[args.size], bucket_mb=[args.bucket_mb], repeats=args.repeats, nproc=args.nproc, etcd=False,
                      **kw)
    place = placement(cfg.device, cfg.nproc)
    import tempfile

    from bench.run import _measure_size

    run_dir = tempfile.mkdtemp(prefix="profile-", dir=_mkdir(cfg.workdir, "runs"))
    try:
        out = _measure_size(cfg, args.size, _model_dir(cfg.workdir, args.size), run_dir, None, place,
                            extra={"profile": {"method": args.method, "repeats": args.repeats, "top": args.top}})
    finally:
        _clean_run(run_dir, keep=False)
    print(format_breakdown(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def format_breakdown(out: dict) -> str:
    """The per-sync figures as text, then the cProfile."""
    import statistics

    med = statistics.median(out["seconds"])
    lines = [f"{out['label']} {out['method']}: {out['tensors']} tensors, {out['bytes'] / 1e6:.1f} MB; sync median "
             f"{med:.3f} s (min {min(out['seconds']):.3f}, {out['repeats']} syncs); mean seconds per sync by piece "
             "(pieces overlap: http calls happen inside send/settle/commit/begin):"]
    for k, v in out["per_sync"].items():
        lines.append(f"  {k:<44} {v:8.4f} s  {out['calls_per_sync'].get(k, 0):7.1f} calls")
    if out.get("gather_alone_seconds"):
        alone = out["gather_alone_seconds"]
        lines.append(f"  {out['gather_item'] + ' alone, between the syncs':<44} {sum(alone) / len(alone):8.4f} s  "
                     "(mean; the same bucket plan's gather with nothing else running)")
    if out.get("snapshot"):
        sn = out["snapshot"]
        lines.append(f"  snapshot (the last sync's): verify_snapshot {sn['verify_seconds']:.4f} s, reading "
                     f"its {sn['bytes'] / 1e6:.0f} MB of tensors {sn['read_seconds']:.4f} s")
    lines += ["", out["cprofile"]]
    return "\n".join(lines)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    os._exit(130)
