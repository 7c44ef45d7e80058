"""The LoRA row: an adapter publish against the full sync of the same model, in the same run (issue 37).

One reference server (``--enable-lora``, the preset in bfloat16) and ``--nproc`` FSDP2 ranks training a LoRA
adapter (rank ``--rank`` on every projection). Each round, after a barrier, rank 0 times: the full sync of
the base (``WeightPublisher``, broadcast of flattened buckets), the adapter by tensors and the adapter by
disk (``AdapterPublisher``); round 0 is a warm-up. Prints one line per method (median seconds, bytes, and the
adapter's fraction of the full sync's time) and writes them to ``--json``.

    python -m bench.lora --preset medium --rank 16 --repeats 3 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _rank_main(rank: int, world: int, port: int, spec: dict, out_path: str) -> None:
    import torch.distributed as dist

    from bridge import AdapterPublisher, AdapterPublisherConfig, PublisherConfig, WeightPublisher
    from trainer import EngineConfig, FSDPEngine, LoraConfig

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    engine = FSDPEngine(EngineConfig(preset=spec["preset"], lora=LoraConfig(rank=spec["rank"], alpha=2.0 * spec["rank"])))
    engine.initialize()
    url = spec["url"]
    pubs = {
        "full-broadcast": WeightPublisher(PublisherConfig(servers=[url], progress=False, serving_dtype="bfloat16")),
        "adapter-tensors": AdapterPublisher(AdapterPublisherConfig(name="bench-tensors", via="tensors", servers=[url],
                                                                   dtype=spec["dtype"])),
        "adapter-disk": AdapterPublisher(AdapterPublisherConfig(name="bench-disk", via="disk", servers=[url], dtype=spec["dtype"],
                                                                root=spec["root"], name_resolve="memory://bench-lora")),
    }
    times: dict[str, list[float]] = {k: [] for k in pubs}
    phases: dict[str, list[dict]] = {k: [] for k in pubs}
    nbytes: dict[str, int] = {}
    for r in range(spec["repeats"] + 1):
        for name, pub in pubs.items():
            dist.barrier()
            t0 = time.perf_counter()
            res = pub.publish(engine, version=r + 1)
            seconds = time.perf_counter() - t0
            if r > 0:
                times[name].append(seconds)
                phases[name].append(getattr(res, "phases", None) or {})
            nbytes[name] = res.bytes
    for pub in pubs.values():
        pub.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "bytes": nbytes, "phases": phases}, f)
    engine.destroy()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from bridge.process_group import find_free_port
    from inference_adapter.launcher import launch_server

    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank on every projection")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, help="the adapter's wire and serving dtype (default: the trainer's, float32)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="wsync-bench-lora-")
    server = launch_server(preset=args.preset, extra_args=["--enable-lora", "--max-lora-rank", str(args.rank),
                                                           "--disk-root", root, "--log-level", "WARNING"],
                           log_path=os.path.join(root, "server.log"))
    out = os.path.join(root, "times.json")
    try:
        spec = dict(preset=args.preset, rank=args.rank, repeats=args.repeats, url=server.url, root=root, dtype=args.dtype)
        mp.start_processes(_rank_main, args=(args.nproc, find_free_port(), spec, out), nprocs=args.nproc,
                           start_method="fork")
    finally:
        server.stop()
    data = json.load(open(out))
    full = statistics.median(data["times"]["full-broadcast"])
    rows = []
    for name, ts in data["times"].items():
        med = statistics.median(ts)
        steps = {k: statistics.median(ph.get(k, 0.0) for ph in data["phases"][name]) for k in data["phases"][name][0]}
        rows.append(dict(method=name, seconds=med, bytes=data["bytes"][name], fraction_of_full=med / full, phases=steps))
        print(f"{name:>16}  {med:8.3f} s  {data['bytes'][name] / 2**20:9.2f} MiB  {100 * med / full:6.1f} % of the full sync"
              + ("  (" + ", ".join(f"{k} {v:.3f}" for k, v in steps.items()) + ")" if steps else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, rank=args.rank, nproc=args.nproc, repeats=args.repeats, dtype=args.dtype,
                           rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
