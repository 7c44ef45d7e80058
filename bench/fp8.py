"""The FP8 rows of ``wsync bench``: the flattened broadcast with ``encoding="fp8"`` into a server serving FP8.

Worker side (:class:`Fp8Rows`, in every trainer rank): a broadcast publisher with ``encoding="fp8"`` at the first
bucket size, into a reference server of its own started with ``--quantization fp8`` (a bf16 server refuses FP8
payloads). Its items, timed in every round beside the bf16 methods (so they publish the same weights):

- ``raw-broadcast-fp8``: the floor, one ``uint8`` broadcast of the FP8 wire bytes (quantized weights, their fp32
  scales, the rest in the serving dtype) to that server, received and dropped: the same bytes through the same
  link as the FP8 sync;
- ``gather-fp8-<N>MiB``: the FP8 encoding's bucket fills alone (each rank casts and quantizes its own rows, the
  scales agreed by one ``all_reduce(MAX)``, the FP8 bytes gathered to rank 0), nothing sent: the FP8 sync's
  transfer-only time is the sync minus this;
- ``fp8-<N>MiB``: the FP8 sync (``WeightPublisher.publish``), end to end.

Report side (:func:`fp8_fields`, :func:`fp8_targets`): each FP8 row carries its bytes against the bf16 bytes and its
time against the full bf16 flattened sync of the same bucket size, measured in the same run. The end-to-end floor
is the gather floor (the ranks' serving-dtype bytes) plus ``raw-broadcast-fp8``.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["FLOOR_BROADCAST_FP8", "FP8_RAW", "FP8_TARGETS", "Fp8Rows", "fp8_fields", "fp8_targets"]

FP8_RAW = "raw-broadcast-fp8"
FLOOR_BROADCAST_FP8 = "floor: gather+broadcast fp8"
FP8_TARGETS = {"bytes_fraction": 0.51, "loopback_slowdown": 1.1, "link_speedup": 1.8}
"""On medium: FP8 moves <= 51 % of the bf16 bytes; on loopback it is at most 1.1x slower than the full bf16
flattened sync; through a link (``--link``) at least 1.8x faster."""


class Fp8Rows:
    def __init__(self, bench, spec: dict, common: dict):
        from bridge import PublisherConfig, WeightPublisher
        from bridge.codecs.fp8 import Fp8Rule, fp8_wire_specs, plan_fp8_buckets

        self.bench, self.engine = bench, bench.engine
        self.url = spec["fp8_server"]
        self.bucket_mb = spec["buckets_mb"][0]
        self.pub = WeightPublisher(PublisherConfig(**{**common, "servers": [self.url]}, transport="broadcast",
                                                   bucket_mb=self.bucket_mb, encoding="fp8"))
        wire = fp8_wire_specs(bench.wire, Fp8Rule())
        self.nbytes = sum(s.nbytes for s in wire)
        self.buckets = plan_fp8_buckets(bench.wire, Fp8Rule(), self.pub.config.bucket_bytes)  # as the encoding plans
        self.served = {s.name: s for s in bench.wire}

    def items(self) -> list:
        mb = f"{self.bucket_mb:g}MiB"
        return [(FP8_RAW, lambda: self.bench._raw_broadcast(self.url, self.nbytes)),
                (f"gather-fp8-{mb}", self._gather_only),
                (f"fp8-{mb}", self._publish)]

    def _publish(self) -> dict | None:
        rec = self.bench._publish(self.pub, f"gather-fp8-{self.bucket_mb:g}MiB")
        if rec is not None:
            rec.update(full_bytes=self.bench.nbytes, encoding="fp8")
        return rec

    def _gather_only(self) -> dict | None:
        """Every FP8 bucket filled as the encoding fills it (quantized on the ranks that hold the rows), into
        buffers on the broadcast's device, nothing sent."""
        from bridge.sources import check_source
        from bridge.sources.fp8 import gather_fp8_bucket

        bench = self.bench
        source = check_source(self.engine)
        t0 = time.perf_counter()
        for bucket in self.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=bench.wire_device) if bench.rank0 else None
            gather_fp8_bucket(source, bucket, buf, self.served, bench.gather_group, 0)
            del buf
        bench._sync()
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "bytes": self.nbytes, "buckets": len(self.buckets)} if bench.rank0 else None

    def close(self) -> None:
        self.pub.close()


# ------------------------------------------------------------------------------------------ report side


def fp8_fields(rec: dict, items: dict) -> dict:
    """An FP8 row's own figures: its bytes against the bf16 bytes, its time against the full bf16 flattened sync of
    the same bucket size (``rec``: its item's record; ``items``: every item of its size)."""
    runs = rec["runs"]
    if not runs:
        return {}
    med = statistics.median(r["seconds"] for r in runs)
    full = runs[0]["full_bytes"]
    flat = f"flat-{runs[0]['bucket_bytes'] / 2**20:g}MiB"
    flat_runs = items.get(flat, {}).get("runs") or []
    flat_s = statistics.median(r["seconds"] for r in flat_runs) if flat_runs else None
    return {"full_bytes": full, "bytes_fraction": runs[0]["bytes"] / full if full else None, "full_method": flat,
            "full_seconds": flat_s, "speedup_vs_full": flat_s / med if flat_s and med else None}


def fp8_targets(rows, link: str | None) -> list[dict]:
    """The FP8 targets on medium: <= 51 % of the bf16 bytes; on loopback at most 1.1x slower than the full bf16
    sync, through a link at least 1.8x faster."""
    medium = [r for r in rows if r["kind"] == "fp8" and r["size"] == "medium"]
    if link:
        what = f"FP8 >= {FP8_TARGETS['link_speedup']:g}x faster than the bf16 full sync through the {link} link"
    else:
        what = f"FP8 at most {FP8_TARGETS['loopback_slowdown']:g}x slower than the bf16 full sync on loopback"
    target = f"FP8 <= {FP8_TARGETS['bytes_fraction']:.0%} of the bf16 bytes, and {what}, on medium"
    if not medium:
        return [{"target": target, "measured": "medium not measured (--sizes medium, without --no-fp8)", "met": None}]
    r = medium[0]
    x = r.get("speedup_vs_full")
    fast = None if x is None else (x >= FP8_TARGETS["link_speedup"] if link else 1 / x <= FP8_TARGETS["loopback_slowdown"])
    ok = None if fast is None else fast and r["bytes_fraction"] <= FP8_TARGETS["bytes_fraction"]
    measured = (f"{r['bytes_fraction']:.1%} of the bytes; {r['seconds']['median']:.3f} s against "
                f"{_f3(r.get('full_seconds'))} s for {r['full_method']}: " + ("-" if x is None else f"{x:.2f}x"))
    return [{"target": target, "measured": measured, "met": ok}]


def _f3(v) -> str:
    return "-" if v is None else f"{v:.3f}"
