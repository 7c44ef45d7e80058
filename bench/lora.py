"""The LoRA row: an adapter publish against the full sync of the same model, in the same run.

One reference server (``--enable-lora``, the preset in bfloat16) and ``--nproc`` FSDP2 ranks training a LoRA
adapter (rank ``--rank`` on every projection). Each round, after a barrier, rank 0 times: the full sync of
the base (``WeightPublisher``, broadcast of flattened buckets), the adapter by tensors, by disk and by broadcast
(``AdapterPublisher``); round 0 is a warm-up (it makes the broadcast's group). Prints one line per method (median seconds, bytes, and the
adapter's fraction of the full sync's time) and writes them to ``--json``.

    python -m bench.lora --preset medium --rank 16 --repeats 3 --json lora.json

The same rows in ``wsync bench`` (:class:`LoraRows`, in every trainer rank, on by default; ``--lora-rank 0``
skips them): a second FSDP2 engine of the same model trains no step but holds a PEFT adapter of rank
``lora_rank`` on every projection; ``lora-tensors`` and ``lora-disk`` publish it (``AdapterPublisher``, in the
serving dtype, as every method sends) into a reference server of its own (``--enable-lora``), timed in every
round beside the full syncs. Report side (:func:`lora_fields`, :func:`lora_targets`): each row's bytes and time
against the full flattened sync of the first bucket size, measured in the same run (``encoding: "lora"``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

__all__ = ["LORA_TARGET", "LoraRows", "lora_fields", "lora_notes", "lora_targets"]

LORA_TARGET = 0.05
"""On medium, rank 16 on every projection: an adapter publish takes at most 5 % of the full sync's time."""

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
        "adapter-broadcast": AdapterPublisher(AdapterPublisherConfig(name="bench-broadcast", via="broadcast",
                                                                     servers=[url], dtype=spec["dtype"])),
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


class LoraRows:
    """The LoRA rows of ``wsync bench`` (worker side): a LoRA engine of the bench's model and two adapter
    publishers (by tensors, by disk) into ``spec["lora_server"]``."""

    METHODS = ("lora-tensors", "lora-disk")

    def __init__(self, bench, spec: dict):
        from bridge import AdapterPublisher, AdapterPublisherConfig
        from trainer import EngineConfig, FSDPEngine, LoraConfig

        self.bench = bench
        rank = int(spec["lora_rank"])
        self.engine = FSDPEngine(EngineConfig(model_path=spec["model_dir"],
                                              lora=LoraConfig(rank=rank, alpha=2.0 * rank))).initialize()
        common = dict(servers=[spec["lora_server"]], dtype=spec["serving_dtype"], http_timeout=bench.timeout)
        self.pubs = {
            "lora-tensors": AdapterPublisher(AdapterPublisherConfig(name="bench-tensors", via="tensors", **common)),
            "lora-disk": AdapterPublisher(AdapterPublisherConfig(name="bench-disk", via="disk", root=spec["lora_root"],
                                                                 name_resolve="memory://bench-lora", **common)),
        }
        self.versions = {k: 0 for k in self.pubs}
        self.rank = rank

    def items(self) -> list:
        return [(name, lambda n=name: self._publish(n)) for name in self.METHODS]

    def _publish(self, name: str) -> dict | None:
        self.versions[name] += 1
        t0 = time.perf_counter()
        res = self.pubs[name].publish(self.engine, version=self.versions[name])
        seconds = time.perf_counter() - t0
        if not self.bench.rank0:
            return None
        return {"seconds": seconds, "bytes": res.bytes, "full_bytes": self.bench.nbytes, "lora_rank": self.rank,
                "tensors": len(res.checksums or {}), "phases": getattr(res, "phases", None) or {}, "encoding": "lora"}

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()
        self.engine.destroy()  # the bench's engine owns the process group: this one leaves it alone


def lora_fields(rec: dict, items: dict) -> dict:
    """A LoRA row's own figures: its bytes against the full model's, its time against the full flattened sync of
    the first bucket size in the same run (``rec``: its item's record; ``items``: every item of its size)."""
    runs = rec["runs"]
    if not runs:
        return {}
    med = statistics.median(r["seconds"] for r in runs)
    flats = sorted((n for n in items if n.startswith("flat-")), key=lambda n: float(n[5:].removesuffix("MiB")))
    flat = flats[0] if flats else None
    flat_runs = items[flat]["runs"] if flat else []
    flat_s = statistics.median(r["seconds"] for r in flat_runs) if flat_runs else None
    full = runs[0]["full_bytes"]
    out = {"full_bytes": full, "bytes_fraction": runs[0]["bytes"] / full if full else None, "full_method": flat,
           "full_seconds": flat_s, "fraction_of_full": med / flat_s if flat_s else None,
           "lora_rank": runs[0]["lora_rank"], "tensors": runs[0]["tensors"]}
    if runs[0]["phases"]:
        out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in runs[0]["phases"]}
    return out


def lora_notes(rows) -> list[str]:
    """One line per LoRA row: the adapter's bytes and time against the full sync of the same run."""
    out = []
    for r in rows:
        if r["kind"] == "lora" and r.get("fraction_of_full") is not None:
            out.append(f"{r['size']} {r['method']}: adapter of rank {r['lora_rank']} ({r['tensors']} tensors) "
                       f"{r['bytes'] / 2**20:.2f} MiB = {r['bytes_fraction']:.2%} of the model's bytes, "
                       f"{r['seconds']['median']:.3f} s = {r['fraction_of_full']:.1%} of {r['full_method']} "
                       f"({r['full_seconds']:.3f} s, same run)")
    return out


def lora_targets(rows) -> list[dict]:
    """The LoRA target on medium (rank 16 on every projection): each adapter publish <= 5 % of the full sync's time."""
    target = f"LoRA rank 16: adapter publish <= {LORA_TARGET:.0%} of the full sync's time, on medium"
    medium = [r for r in rows if r["kind"] == "lora" and r["size"] == "medium" and r.get("lora_rank") == 16]
    if not medium:
        return [{"target": target, "measured": "medium not measured at rank 16 (--sizes medium, --lora-rank 16)",
                 "met": None}]
    fracs = [r.get("fraction_of_full") for r in medium]
    met = None if None in fracs else all(f <= LORA_TARGET for f in fracs)
    measured = "; ".join(f"{r['method']} {r['seconds']['median']:.3f} s, " + ("-" if r.get("fraction_of_full") is None
                         else f"{r['fraction_of_full']:.1%}") for r in medium)
    return [{"target": target, "measured": f"{measured} of {medium[0]['full_method']}", "met": met}]


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from bridge.process_group import find_free_port
    from inference_adapter.launcher import launch_server

    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n\n")[0])
    from bridge.local.presets import PRESETS

    p.add_argument("--preset", default="medium", choices=sorted(PRESETS),
                   help="the model built from a config (no download) for the trainer and the server (default medium)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank on every projection (default 16)")
    p.add_argument("--nproc", type=int, default=2, help="FSDP2 trainer ranks (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up; medians are printed (default 3)")
    p.add_argument("--dtype", default=None, help="the adapter's wire and serving dtype (default: the trainer's, float32)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
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
