"""The delta rows of ``wsync bench``: a real optimizer step between two syncs, then a delta sync.

Worker side (:class:`DeltaRows`, in every trainer rank): a broadcast publisher with ``encoding="delta"``,
first bucket size, into a reference server of its own (the other methods publish the same weights under
other versions to the main server, which would make every delta an anchor). Its first call publishes an
anchor and then ``warmup`` steps at the first learning rate, untimed (AdamW's first steps move far more
elements than later ones). Each timed item ``delta-lr<lr>`` then takes one optimizer step at that
learning rate (untimed: AdamW on a batch of random tokens) and times one publish. The steps happen in the
rounds, so every method of a round publishes the same changing weights. With the FP8 rows on
(``spec["fp8_delta_server"]``), a second publisher with ``encoding="fp8_delta"`` into a server serving FP8 of
its own publishes the same anchor and warm-up steps, and each ``fp8+delta-lr<lr>`` times its publish right after
``delta-lr<lr>`` (no step of its own: it sends the same step, over FP8 bytes and scales).

Report side (:func:`delta_fields`, :func:`delta_targets`, :func:`delta_notes`): each delta row carries the
changed fraction of the elements, the bytes moved (median) against the full bytes, what was sent
(``delta``, or ``anchor`` and why), and its time against the full flattened sync of the same bucket size
and the broadcast floor, both measured in the same run; an FP8 delta row also against the FP8 full bytes (its
anchor's) and the FP8 full sync of the same run (``fp8-<N>MiB``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["DELTA_TARGETS", "FP8_DELTA", "DeltaRows", "delta_fields", "delta_notes", "delta_targets"]

DELTA_TARGETS = {"bytes_fraction": 0.05, "speedup": 3.0}
"""At the smallest learning rate, on medium: delta bytes <= 5 % of the full bytes, >= 3x faster end to end
than the full flattened sync; at every learning rate: never slower than the full flattened sync."""


FP8_DELTA = "fp8+delta"
"""The FP8 delta rows' method prefix and ``encoding`` (``encoding="fp8_delta"`` into a server serving FP8)."""


class DeltaRows:
    def __init__(self, bench, spec: dict, common: dict):
        from bridge import PublisherConfig, WeightPublisher

        self.bench, self.engine = bench, bench.engine
        self.lrs = [float(x) for x in spec["delta_lrs"]]
        self.warmup = int(spec.get("delta_warmup", 5))
        self.bucket_mb = spec["buckets_mb"][0]
        urls = {"delta": spec["delta_server"], FP8_DELTA: spec.get("fp8_delta_server")}
        self.pubs = {kind: WeightPublisher(PublisherConfig(**{**common, "servers": [url]}, transport="broadcast",
                                                           bucket_mb=self.bucket_mb,
                                                           encoding="delta" if kind == "delta" else "fp8_delta"))
                     for kind, url in urls.items() if url}
        self.fp8_bytes = None
        if FP8_DELTA in self.pubs:  # what the FP8 full sync (the FP8 delta's anchor) moves
            from bridge.codecs.fp8 import Fp8Rule, fp8_wire_specs

            self.fp8_bytes = sum(s.nbytes for s in fp8_wire_specs(bench.wire, Fp8Rule()))
        self.steps = 0
        self.warm = False

    def items(self) -> list:
        """``delta-lr<LR>`` takes one optimizer step and times the delta; ``fp8+delta-lr<LR>``, right after it, times
        the FP8 delta of the same step (each publisher's base is its last publish: both see one step)."""
        out = []
        for lr in self.lrs:
            out.append((f"delta-lr{lr:g}", lambda lr=lr: self.run(lr, "delta")))
            if FP8_DELTA in self.pubs:
                out.append((f"{FP8_DELTA}-lr{lr:g}", lambda lr=lr: self.run(lr, FP8_DELTA)))
        return out

    def run(self, lr: float, kind: str) -> dict | None:
        if not self.warm:  # the anchors, then AdamW's first steps, untimed
            self.warm = True
            self._publish_all()
            for _ in range(self.warmup):
                self._step(self.lrs[0])
                self._publish_all()
        if kind == "delta":
            self._step(lr)
        dist.barrier()
        t0 = time.perf_counter()
        res = self._publish(kind)
        seconds = time.perf_counter() - t0
        if not self.bench.rank0:
            return None
        out = {"seconds": seconds, "bytes": res.bytes, "full_bytes": self.bench.nbytes, "encoding": res.encoding,
               "anchor_reason": res.anchor_reason, "changed_fraction": res.changed_fraction, "lr": lr,
               "peak_extra_bytes": res.peak_extra_bytes, "bucket_bytes": self.pubs[kind].config.bucket_bytes,
               "base_bytes": res.base_bytes, "buckets": res.buckets}
        if kind == FP8_DELTA:
            out["fp8_bytes"] = self.fp8_bytes
        return out

    def _publish_all(self) -> None:
        for kind in self.pubs:
            self._publish(kind)

    def _publish(self, kind: str):
        return self.pubs[kind].publish(self.engine, version=next(self.bench.versions))

    def _step(self, lr: float) -> None:
        """One AdamW step at ``lr`` on 2 random sequences of 64 tokens per rank."""
        engine = self.engine
        self.steps += 1
        g = torch.Generator().manual_seed(1000 * self.steps + engine.rank)
        vocab = engine.model_config.vocab_size
        ids = torch.randint(3, vocab, (2, 64), generator=g)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        engine.train_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()


# ------------------------------------------------------------------------------------------ report side


def delta_fields(rec: dict, items: dict, floor: str, floor_median: float | None) -> dict:
    """A delta row's own figures (``rec`` is its item's record, ``items`` every item of its size; ``floor`` the
    broadcast floor's row, of median ``floor_median``)."""
    runs = rec["runs"]
    if not runs:
        return {}
    med = statistics.median(r["seconds"] for r in runs)
    full = runs[0]["full_bytes"]
    moved = statistics.median(r["bytes"] for r in runs)
    flat = f"flat-{runs[0]['bucket_bytes'] / 2**20:g}MiB"
    flat_s = statistics.median(r["seconds"] for r in items[flat]["runs"]) if items.get(flat, {}).get("runs") else None
    sent = [r["encoding"] + (f" ({r['anchor_reason']})" if r.get("anchor_reason") else "") for r in runs]
    out = {
        "lr": runs[0]["lr"], "changed_fraction": statistics.median(r["changed_fraction"] for r in runs),
        "bytes": moved, "full_bytes": full, "bytes_fraction": moved / full if full else None,
        "full_method": flat, "full_seconds": flat_s, "speedup_vs_full": flat_s / med if flat_s else None,
        "ratio": floor_median / med if floor_median else None, "floor": floor, "floor_seconds": floor_median,
        "sent": sent,
        "base_bytes": runs[0].get("base_bytes"),
        # the syncs sent as deltas that took longer than the full sync's median in the same run
        "slower_than_full": sum(r["encoding"] == "delta" and r["seconds"] > flat_s for r in runs) if flat_s else None,
        "deltas": sum(r["encoding"] == "delta" for r in runs),
    }
    fp8 = runs[0].get("fp8_bytes")
    if fp8:  # an FP8 delta: also against the FP8 full sync (its anchor) of the same bucket size (bench.fp8)
        name = f"fp8-{runs[0]['bucket_bytes'] / 2**20:g}MiB"
        fp8_s = statistics.median(r["seconds"] for r in items[name]["runs"]) if items.get(name, {}).get("runs") else None
        out.update(fp8_full_bytes=fp8, fp8_bytes_fraction=moved / fp8, fp8_method=name, fp8_seconds=fp8_s,
                   speedup_vs_fp8=fp8_s / med if fp8_s else None)
    return out


def delta_targets(rows) -> list[dict]:
    """The delta targets, on medium: at the smallest learning rate <= 10 % of the full bytes and >= 3x faster
    than the full flattened sync; at every learning rate never slower than it."""
    medium = [r for r in rows if r["kind"] == "delta" and r["size"] == "medium" and r["method"].startswith("delta-")]
    out = []
    if not medium:
        note = "medium not measured (--sizes medium, and delta learning rates)"
        return [{"target": t, "measured": note, "met": None} for t in (
            "delta at the smallest lr: <= 10 % of the full bytes and >= 3x faster than full flattened, on medium",
            "delta never slower than full flattened, every lr, on medium")]
    low = min(medium, key=lambda r: r["lr"])
    ok = (low["bytes_fraction"] is not None and low["bytes_fraction"] <= DELTA_TARGETS["bytes_fraction"]
          and (low.get("speedup_vs_full") or 0) >= DELTA_TARGETS["speedup"])
    out.append({"target": f"delta at lr {low['lr']:g}: <= {DELTA_TARGETS['bytes_fraction']:.0%} of the full bytes and "
                          f">= {DELTA_TARGETS['speedup']:g}x faster than full flattened, on medium",
                "measured": f"{low['bytes_fraction']:.1%} of the bytes, {_x(low.get('speedup_vs_full'))} "
                            f"({low['changed_fraction']:.2%} of the elements changed)",
                "met": ok if low.get("speedup_vs_full") is not None else None})
    checks = [(r.get("speedup_vs_full") or 0) >= 1.0 if r.get("speedup_vs_full") else None for r in medium]
    out.append({"target": "delta never slower than full flattened, every lr, on medium",
                "measured": ", ".join(f"lr {r['lr']:g} {_x(r.get('speedup_vs_full'))}" for r in medium),
                "met": None if None in checks else all(checks)})
    return out


def delta_notes(rows) -> list[str]:
    out = []
    for r in rows:
        if r["kind"] == "delta" and r.get("lr") is not None:
            sent = sorted(set(r["sent"]))
            fp8 = (f" ({r['fp8_bytes_fraction']:.2%} of the FP8 full {r['fp8_full_bytes'] / 1e6:.1f} MB; "
                   f"{_x(r.get('speedup_vs_fp8'))} vs {r['fp8_method']}, {_f3(r.get('fp8_seconds'))} s)"
                   if r.get("fp8_full_bytes") else "")
            out.append(f"{r['size']} {r['method']}: {r['changed_fraction']:.2%} of the elements changed per step, "
                       f"{r['bytes'] / 1e6:.2f} MB moved ({r['bytes_fraction']:.1%} of {r['full_bytes'] / 1e6:.1f} MB){fp8}, "
                       f"{_x(r.get('speedup_vs_full'))} vs {r['full_method']} ({_f3(r.get('full_seconds'))} s), "
                       f"{_f2(r.get('ratio'))} of the broadcast floor; sent: {'; '.join(sent)}"
                       + (f"; {r['slower_than_full']} of {r['deltas']} deltas slower than the full sync"
                          if r.get("slower_than_full") is not None else ""))
    return out


def _x(v) -> str:
    return "-" if v is None else f"{v:.1f}x"


def _f2(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _f3(v) -> str:
    return "-" if v is None else f"{v:.3f}"
