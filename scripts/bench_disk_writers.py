"""Disk publish with every rank writing its share (disk_writers="all") against the rank-0 writer.

Runs an N-rank gloo FSDP2 trainer (real processes, as torchrun would) on a preset, and publishes the
same weights alternately with ``disk_writers="rank0"`` and ``"all"`` (the order swaps every round),
after one warm-up publish each. Per publish: the seconds rank 0 measured (gather + write + fsync +
manifest + rename + announce), rank 0's peak extra memory as the publisher reports it, and on every
rank its own peak extra memory (the kernel's resident high-water mark) and the bytes it wrote to
storage (``/proc/self/io``). Prints medians and, with ``--json``, writes every figure.

Memory: glibc raises its mmap threshold after a large free and then serves later buffers from heap it
keeps, which the kernel's high-water mark does not see (the peaks under-read). ``--exact-memory`` runs
the ranks with ``MALLOC_MMAP_THRESHOLD_=1 MiB``: every buffer is a mapping of its own, so the resident
high-water mark is what the publish held at once; the page faults this costs make those runs slower,
so time them without it.

    python scripts/bench_disk_writers.py --world 2 --preset medium --repeats 5 --json /tmp/dw.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

MODES = ["rank0", "all"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def _rank(rank: int, world: int, port: int, args: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from bridge import PublisherConfig, WeightPublisher
        from trainer import EngineConfig, FSDPEngine, OptimizerConfig

        engine = FSDPEngine(EngineConfig(preset=args["preset"], optimizer=OptimizerConfig(lr=1e-3)))
        engine.initialize()
        MODES[:] = args["modes"]
        # Code from before disk_writers existed (--modes rank0 on an older checkout) has only rank 0.
        # (a flat field once, a disk option since PublisherConfig.keywords)
        has_writers = "disk_writers" in (PublisherConfig.keywords("disk") if hasattr(PublisherConfig, "keywords")
                                         else PublisherConfig.__dataclass_fields__)
        pubs = {
            mode: WeightPublisher(PublisherConfig(
                transport="disk", name_resolve=f"file://{args['root']}/nr", snapshot_root=f"{args['root']}/{mode}",
                experiment="bench", trial=mode, keep_snapshots=1, bucket_mb=args["bucket_mb"],
                progress=False, **(dict(disk_writers=mode) if has_writers else {}),
            ))
            for mode in MODES
        }
        rows = []
        version = 0
        order = [MODES] + [MODES if i % 2 == 0 else MODES[::-1] for i in range(args["repeats"])]
        assert has_writers or MODES == ["rank0"], "this checkout has no disk_writers: use --modes rank0"
        for round_, modes in enumerate(order):
            for mode in modes:
                version += 1
                dist.barrier()
                rss, wb = _status_kib("VmRSS") * 1024, _write_bytes()
                res = pubs[mode].publish(engine, version=version)
                rows.append(dict(mode=mode, round=round_, warmup=round_ == 0, seconds=res.seconds, bytes=res.bytes,
                                 buckets=res.buckets, rank0_peak=res.peak_extra_bytes,
                                 peak=max(0, _status_kib("VmHWM") * 1024 - rss), wrote=_write_bytes() - wb))
        for pub in pubs.values():
            pub.close()
        engine.destroy()
        q.put((rank, rows, None))
    except BaseException:  # report, do not hang the parent
        import traceback

        q.put((rank, None, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(world: int, preset: str, repeats: int, bucket_mb: float, root: str) -> list[list[dict]]:
    from bridge.process_group import find_free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    args = dict(preset=preset, repeats=repeats, bucket_mb=bucket_mb, root=root, modes=list(MODES))
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    try:
        while len(out) < world:
            rank, rows, error = q.get(timeout=1800)
            if error:
                raise SystemExit(f"rank {rank} failed:\n{error}")
            out[rank] = rows
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def summarize(world: int, ranks: list[list[dict]]) -> dict:
    summary = {}
    for mode in MODES:
        idx = [i for i, row in enumerate(ranks[0]) if row["mode"] == mode and not row["warmup"]]
        med = lambda key, r=0, idx=idx: statistics.median(ranks[r][i][key] for i in idx)  # noqa: E731
        summary[mode] = dict(
            seconds=med("seconds"), seconds_all=[round(ranks[0][i]["seconds"], 3) for i in idx],
            bytes=ranks[0][idx[0]]["bytes"], buckets=ranks[0][idx[0]]["buckets"],
            rank0_peak_reported=med("rank0_peak"),
            peak_by_rank=[med("peak", r) for r in range(world)],
            wrote_by_rank=[med("wrote", r) for r in range(world)],
        )
        s = summary[mode]
        s["gbps"] = s["bytes"] / s["seconds"] / 1e9
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--root", default=None, help="snapshot root (default: a new folder under the temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", default="rank0,all", help="which writers to run, comma-separated")
    ap.add_argument("--exact-memory", action="store_true", help="MALLOC_MMAP_THRESHOLD_=1 MiB in the ranks (see above)")
    a = ap.parse_args()
    MODES[:] = a.modes.split(",")
    if a.exact_memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # inherited by the spawned ranks
    root = a.root or tempfile.mkdtemp(prefix="wsync-dw-")
    t = time.monotonic()
    ranks = run(a.world, a.preset, a.repeats, a.bucket_mb, root)
    summary = summarize(a.world, ranks)
    mb = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    bucket = a.bucket_mb * 2**20
    print(f"{a.world} ranks, {a.preset}, {a.bucket_mb:g} MiB buckets, {a.repeats} repeats (medians), "
          f"{'exact memory (MALLOC_MMAP_THRESHOLD_), ' if a.exact_memory else ''}"
          f"{time.monotonic() - t:.0f} s in all")
    for mode, s in summary.items():
        print(f"  disk_writers={mode:5s}: {s['seconds']:.3f} s ({s['gbps']:.2f} GB/s) of {mb(s['bytes'])} in {s['buckets']} "
              f"buckets; runs {s['seconds_all']}")
        print(f"    rank-0 peak extra {mb(s['rank0_peak_reported'])} = {s['rank0_peak_reported'] / bucket:.2f} x bucket "
              f"(publisher); per rank {[round(p / bucket, 2) for p in s['peak_by_rank']]} x bucket; "
              f"written per rank {[mb(w) for w in s['wrote_by_rank']]}")
    # The same weights were published both ways: the newest snapshots must hold the same files, bytes
    # and tensors (only the version and the write time differ).
    from bridge.snapshot import list_snapshots, read_manifest, snapshot_dir, verify_snapshot

    same = {}
    for mode in MODES if len(MODES) == 2 else ():
        path = snapshot_dir(f"{root}/{mode}", list_snapshots(f"{root}/{mode}")[-1])
        verify_snapshot(path)
        m = read_manifest(path)
        same[mode] = (m["files"], m["tensors"], m["total_bytes"])
    if same:
        assert same["rank0"] == same["all"], "the two writers made different snapshots of the same weights"
        print("  both snapshots verified against their manifests; same files, bytes and tensor checksums")
        old, new = summary["rank0"]["seconds"], summary["all"]["seconds"]
        print(f"  all / rank0 time: {new / old:.2f} ({old / new:.2f}x faster)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(world=a.world, preset=a.preset, bucket_mb=a.bucket_mb, repeats=a.repeats, exact_memory=a.exact_memory,
                           summary=summary, rows=ranks), f, indent=1)
    import shutil

    if a.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
