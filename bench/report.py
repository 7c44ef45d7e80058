"""From the workers' raw timings to rows, a table, the target checks and a plot.

Every row is one method (or floor, or gather) on one model size. Seconds are the median of the timed
repeats, with min/max and the interquartile range as the spread; the warm-up (round 0) is reported on
its own as ``first_seconds``. Each method is reported twice, both as ratios to a floor measured in the
same run (``floor seconds / method seconds``; 1.0 = as fast as the bare transport):

- **end to end** (``ratio``): the whole sync against the gather floor plus the transport's floor;
- **transfer only** (``transfer_ratio``): the sync minus its own gather (the same bucket plan gathered
  alone in the same round, ``gather-<N>MiB`` / ``gather-per-tensor``), against the transport's floor
  alone. Under the publisher's overlap (bucket k+1 is gathered while bucket k travels) this is the part
  of the transfer the gather does not hide, so it can beat its floor.

``ratio_min`` / ``transfer_ratio_min`` come from each one's fastest repeat (noise on a shared machine
only ever adds time, so the fastest repeats are the least disturbed). Floors are summed per round:

- gather (``floor: gather``): the faster, in that round, of one flat all-gather of the model's bytes and
  the same bytes in 16 MiB gathers (``raw-gather``, ``raw-gather-16MiB``); a ``gather-*`` row's ratio
  is against it (the publisher's gather casts, packs and unpacks as well);
- broadcast methods (flattened, per-tensor): ``raw-broadcast``, one broadcast of the same bytes;
- FP8 (``fp8-<N>MiB``, :mod:`bench.fp8`): ``raw-broadcast-fp8``, one broadcast of the FP8 bytes to the server
  serving FP8 (the same bytes through the same link);
- colocated: ``raw-shm``, the bytes written into a /dev/shm file and copied out again;
- disk: ``raw-disk``, safetensors write + fsync + read back.

The end-to-end floor of each is ``gather + transport floor`` (every sync gathers before it sends).
GB/s is 10^9 bytes per second, of each row's own bytes (a disk row counts its snapshot's files). Every row
carries ``encoding`` (what its bytes are: the serving dtype, ``fp8`` or ``delta``) and ``link`` (the ``--link``
rate; None on loopback).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from bench.delta import FP8_DELTA, delta_fields, delta_notes, delta_targets
from bench.fp8 import FLOOR_BROADCAST_FP8, FP8_RAW, fp8_fields, fp8_targets
from bench.lora import lora_fields, lora_notes, lora_targets

__all__ = ["TARGETS", "build_rows", "build_warmups", "check_targets", "format_link", "format_table", "link_rows", "plot",
           "stats"]

ENGINES = {"reference": "the reference server", "sglang": "real SGLang (one-request-*: the whole sync as one request, "
           "its default up to atomic_mb; the raw broadcast floor into a reference server)"}
FLOOR_GATHER = "floor: gather"
FLOOR_BROADCAST = "floor: gather+broadcast"
FLOOR_SHM = "floor: gather+shm write+read"
FLOOR_DISK = "floor: gather+disk write+fsync+read"

TARGETS = {
    "flat_ratio": 0.9,               # flattened broadcast >= 0.9 of its floor, every size
    "flat_speedup_transfer": 10.0,   # flattened >= 10x faster than per-tensor, transfer only, many-tensor size
    "flat_speedup": 3.0,             # ... and >= 3x end to end
    "disk_ratio": 0.8,               # disk >= 0.8 of its floor on medium
    "peak_ratio": 2.5,               # rank-0 peak extra memory <= 2.5 x bucket size, every transport
}
UNDER_READ = 0.5
"""A peak memory reading under this fraction of the largest bucket is no reading (see check_targets)."""
MANY_TENSORS = 300
"""A size with at least this many tensors is a "many-tensor" size (Qwen2.5-7B has 339)."""

# kind -> (end-to-end floor row, the raw item that is its transport floor)
_FLOORS = {
    "flattened": (FLOOR_BROADCAST, "raw-broadcast"),
    "per-tensor": (FLOOR_BROADCAST, "raw-broadcast"),
    "one-request": (FLOOR_BROADCAST, "raw-broadcast"),  # real SGLang: the whole sync in one request (atomic_mb)
    "fp8": (FLOOR_BROADCAST_FP8, FP8_RAW),  # the FP8 bytes through the same transport (bench.fp8)
    "colocated": (FLOOR_SHM, "raw-shm"),
    "disk": (FLOOR_DISK, "raw-disk"),
}
_PUBLISHED = ("flattened", "one-request", "fp8", "per-tensor", "colocated", "disk")
_TRANSPORT_OF = {"flattened": "broadcast", "one-request": "broadcast", "fp8": "broadcast fp8", "colocated": "colocated",
                 "disk": "disk"}


def stats(values: Sequence[float]) -> dict:
    """median, min, max, q1, q3 and n of ``values`` (q1 = q3 = the value when there is one)."""
    v = sorted(values)
    if not v:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    q1, q3 = (statistics.quantiles(v, n=4, method="inclusive")[::2]) if len(v) > 1 else (v[0], v[0])
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "q1": q1, "q3": q3, "n": len(v)}


def _kind(name: str) -> str:
    if name.startswith("flat-"):
        return "flattened"
    if name == "per-tensor":
        return "per-tensor"
    if name.startswith("one-request-"):
        return "one-request"
    if name.startswith("colocated-"):
        return "colocated"
    if name.startswith("disk-"):
        return "disk"
    if name.startswith("gather-"):
        return "gather"
    if name.startswith(("delta-", FP8_DELTA + "-")):
        return "delta"
    if name.startswith("fp8-"):
        return "fp8"
    if name.startswith("lora-"):
        return "lora"
    return "floor"


def _over(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or the denominator is not positive (no reading)."""
    return num / den if num is not None and den is not None and den > 0 else None


def _encoding(name: str, kind: str, serving: str) -> str:
    """What a row's bytes are: ``fp8`` (the FP8 rows, their gather and floors), ``delta``, ``lora`` (an adapter
    alone, in the serving dtype), or the serving dtype."""
    if name.startswith(FP8_DELTA + "-"):
        return FP8_DELTA
    if kind in ("fp8", "delta", "lora"):
        return kind
    return "fp8" if name in (FP8_RAW, FLOOR_BROADCAST_FP8) or name.startswith("gather-fp8-") else serving


def build_rows(sizes: Sequence[dict], link: str | None = None) -> list[dict]:
    """One row per (size, method, floor or gather), from the workers' results (see :mod:`bench.worker`). Every row
    carries ``encoding`` (what its bytes are) and ``link`` (the ``--link`` rate, None on loopback)."""
    rows: list[dict] = []
    for size in sizes:
        items = size["items"]
        per_round = {name: [r["seconds"] for r in rec["runs"]] for name, rec in items.items()}
        gathers = [n for n in items if n.startswith("raw-gather")]
        gather = [min(g) for g in zip(*(per_round[n] for n in gathers))]  # the faster way, round by round
        gather_first = min(items[n]["first"]["seconds"] for n in gathers)
        floors, floor_first = {FLOOR_GATHER: gather}, {FLOOR_GATHER: gather_first}
        for floor, raw in {(f, r) for f, r in _FLOORS.values()}:
            if raw in items:
                floors[floor] = [g + b for g, b in zip(gather, per_round[raw])]
                floor_first[floor] = gather_first + items[raw]["first"]["seconds"]
        floor_stats = {k: stats(v) for k, v in floors.items()}
        base = {"size": size["label"], "params": size["params"], "model_bytes": size["bytes"],
                "tensors": size.get("tensors"), "engine": size.get("engine", "reference")}
        for name, rec in items.items():
            kind = _kind(name)
            runs = rec["runs"]
            s = stats(per_round[name])
            row = {**base, "method": name, "kind": kind, "bytes": runs[0]["bytes"] if runs else size["bytes"],
                   "seconds": s, "first_seconds": rec["first"]["seconds"] if rec["first"] else None}
            row["gbps"] = row["bytes"] / s["median"] / 1e9 if s["median"] else None
            if kind in _FLOORS and _FLOORS[kind][0] in floor_stats:
                floor, raw = _FLOORS[kind]
                row["floor"] = floor
                row["floor_seconds"] = floor_stats[floor]["median"]
                row["ratio"] = _over(floor_stats[floor]["median"], s["median"])
                row["ratio_min"] = _over(floor_stats[floor]["min"], s["min"])
                gather_item = runs[0].get("gather_item") if runs else None
                if gather_item in per_round:
                    transfer = stats([m - g for m, g in zip(per_round[name], per_round[gather_item])])
                    raw_s = stats(per_round[raw])
                    row.update(gather_item=gather_item, gather_seconds=stats(per_round[gather_item])["median"],
                               transfer_floor=raw, transfer_floor_seconds=raw_s["median"], transfer_seconds=transfer,
                               transfer_ratio=_over(raw_s["median"], transfer["median"]),
                               transfer_ratio_min=_over(raw_s["min"], transfer["min"]))
            if kind in _PUBLISHED and runs and "peak_extra_bytes" in runs[0]:
                peak = max(r["peak_extra_bytes"] for r in runs)
                row["peak_extra_bytes"] = peak
                row["bucket_bytes"] = runs[0]["largest_bucket_bytes"]
                row["bucket_budget_bytes"] = runs[0]["bucket_bytes"]
                row["peak_ratio"] = peak / row["bucket_bytes"]
                row["buckets"] = runs[0]["buckets"]
                if rec["first"] and "group_init" in rec["first"].get("phases", {}):
                    row["first_group_init_seconds"] = rec["first"]["phases"]["group_init"]
            if kind == "gather" and runs:
                # How close the publisher's gather (cast, pack, gather to rank 0, unpack) is to the raw gather.
                row["buckets"] = runs[0].get("buckets")
                row.update(floor=FLOOR_GATHER, floor_seconds=floor_stats[FLOOR_GATHER]["median"],
                           ratio=_over(floor_stats[FLOOR_GATHER]["median"], s["median"]),
                           ratio_min=_over(floor_stats[FLOOR_GATHER]["min"], s["min"]))
            if kind == "disk":
                row["phases"] = {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
            if kind == "fp8":  # its bytes and time against the full bf16 sync (bench.fp8)
                row.update(fp8_fields(rec, items))
            if kind == "lora":  # the adapter alone: its bytes and time against the full flattened sync (bench.lora)
                row.update(lora_fields(rec, items))
            if kind == "delta":  # its time against the full flattened sync and the floor (bench.delta)
                row.update(delta_fields(rec, items, FLOOR_BROADCAST, floor_stats.get(FLOOR_BROADCAST, {}).get("median")))
            if name == "raw-broadcast":
                row["server_seconds"] = stats([r["server_seconds"] for r in runs])
            if name in ("raw-disk", "raw-shm"):
                row["write_seconds"] = stats([r["write_seconds"] for r in runs])
                row["read_seconds"] = stats([r["read_seconds"] for r in runs])
            rows.append(row)
        by_name = {r["method"]: r for r in rows if r["size"] == size["label"]}
        pt = by_name.get("per-tensor")
        for r in by_name.values():
            if r["kind"] == "flattened" and pt is not None:
                r["speedup_vs_per_tensor"] = _over(pt["seconds"]["median"], r["seconds"]["median"])
                if "transfer_seconds" in r and "transfer_seconds" in pt and pt["transfer_seconds"]["median"] > 0:
                    r["transfer_speedup_vs_per_tensor"] = _over(pt["transfer_seconds"]["median"],
                                                                r["transfer_seconds"]["median"])
        for floor, s in floor_stats.items():
            nbytes = items[FP8_RAW]["runs"][0]["bytes"] if floor == FLOOR_BROADCAST_FP8 else size["bytes"]
            rows.append({**base, "method": floor, "kind": "floor", "bytes": nbytes, "seconds": s,
                         "first_seconds": floor_first[floor],
                         "gbps": nbytes / s["median"] / 1e9 if s["median"] else None})
    serving = {s["label"]: s.get("serving_dtype", "bfloat16") for s in sizes}
    for r in rows:
        r.update(encoding=_encoding(r["method"], r["kind"], serving[r["size"]]), link=link)
    order = {"floor": 0, "gather": 1, "flattened": 2, "one-request": 3, "fp8": 4, "delta": 5, "per-tensor": 6,
             "colocated": 7, "disk": 8, "lora": 9}
    floor_order = ["raw-gather", "raw-gather-chunked", FLOOR_GATHER, "raw-broadcast", FLOOR_BROADCAST, FP8_RAW,
                   FLOOR_BROADCAST_FP8, "raw-shm", FLOOR_SHM, "raw-disk", FLOOR_DISK]
    sizes_order = [s["label"] for s in sizes]

    def key(r):
        m = "raw-gather-chunked" if r["method"].startswith("raw-gather-") else r["method"]
        sub = floor_order.index(m) if m in floor_order else 0
        bucket = r.get("bucket_budget_bytes", 0)
        if r["kind"] == "gather":  # gather-per-tensor, gather-<N>MiB, gather-<N>MiB-host
            budget = r["method"][len("gather-"):].removesuffix("-host").removeprefix("fp8-")
            bucket = 0 if budget == "per-tensor" else float(budget.removesuffix("MiB"))
        return (sizes_order.index(r["size"]), order[r["kind"]], sub, bucket, r["method"])

    return sorted(rows, key=key)


def build_warmups(sizes: Sequence[dict]) -> dict[str, dict]:
    """Per size: the very first broadcast sync (it creates the weight-update group and gloo's connections)."""
    out = {}
    for size in sizes:
        first = next((rec["first"] for name, rec in size["items"].items() if name.startswith("flat-")), None)
        if first is not None:
            out[size["label"]] = {"first_seconds": first["seconds"],
                                  "group_init_seconds": first["phases"].get("group_init", 0.0)}
    return out


def _verdict(checks: Sequence[bool | None]) -> bool | None:
    """MISSED (False) if any measured check fails; MET (True) only if every check was measured and met;
    otherwise not measured (None). A target over "every size" is not met by the sizes that were measured."""
    if any(c is False for c in checks):
        return False
    if not checks or any(c is None for c in checks):
        return None
    return True


def check_targets(rows: Sequence[dict], link: str | None = None) -> list[dict]:
    """The issue's targets, each with the measured figures and a verdict: True (MET), False (MISSED) or
    None (not measured: the size, row or figure the target needs is not in ``rows``). ``link``: the run's ``--link``
    rate (the FP8 target differs through a link)."""
    out = []
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    tensors = {r["size"]: r.get("tensors") for r in rows}

    def best(size, kind, field):
        cands = [r for r in rows if r["size"] == size and r["kind"] == kind and r.get(field) is not None]
        return max(cands, key=lambda r: r[field]) if cands else None

    # 1-2: flattened against its floor on every size, end to end and transfer only.
    for field, how in (("ratio", "end to end"), ("transfer_ratio", "transfer only")):
        measured, checks = [], []
        for size in sizes:
            if not any(r["size"] == size and r["kind"] == "flattened" for r in rows):
                continue
            r = best(size, "flattened", field)
            if r is None:
                measured.append(f"{size} not measured")
                checks.append(None)
                continue
            measured.append(f"{size} {r[field]:.2f} ({r['method']}; fastest runs {_f(r.get(field + '_min'), '.2f')})")
            checks.append(r[field] >= TARGETS["flat_ratio"])
        out.append({"target": f"flattened broadcast >= {TARGETS['flat_ratio']} x its floor, {how}, every size "
                              "(best bucket)",
                    "measured": ", ".join(measured), "met": _verdict(checks)})

    # 3-4: flattened against per-tensor on the many-tensor sizes.
    many = [s for s in sizes if (tensors.get(s) or 0) >= MANY_TENSORS]
    for field, goal, how in (("transfer_speedup_vs_per_tensor", TARGETS["flat_speedup_transfer"], "transfer only"),
                             ("speedup_vs_per_tensor", TARGETS["flat_speedup"], "end to end")):
        measured, checks = [], []
        for size in many:
            r = best(size, "flattened", field)
            if r is None:
                measured.append(f"{size} not measured")
                checks.append(None)
            else:
                measured.append(f"{size} ({tensors[size]} tensors) {r[field]:.1f}x ({r['method']})")
                checks.append(r[field] >= goal)
        if not many:
            measured = [f"no size with >= {MANY_TENSORS} tensors measured (add --sizes many)"]
        out.append({"target": f"flattened >= {goal:g}x faster than per-tensor, {how}, on a size with "
                              f">= {MANY_TENSORS} tensors",
                    "measured": "; ".join(measured), "met": _verdict(checks)})

    # 5-6: disk on medium; other sizes are shown for reference only.
    for field, how in (("ratio", "end to end"), ("transfer_ratio", "transfer only")):
        # The default disk method(s); the rank-0 writer (disk-*-rank0) is a baseline, shown for reference.
        disk = [r for r in rows if r["kind"] == "disk"]
        on_medium = [r for r in disk if r["size"] == "medium" and not r["method"].endswith("-rank0")]
        measured = [f"{r['size']} {r['method']} {_f(r.get(field), '.2f')} (fastest runs {_f(r.get(field + '_min'), '.2f')})"
                    for r in on_medium]
        if not on_medium:
            measured = ["medium not measured"]
        others = [f"{r['size']} {r['method']} {_f(r.get(field), '.2f')}" for r in disk if r not in on_medium]
        text = ", ".join(measured) + (f"; for reference {', '.join(others)}" if others else "")
        checks = [None if r.get(field) is None else r[field] >= TARGETS["disk_ratio"] for r in on_medium]
        out.append({"target": f"disk >= {TARGETS['disk_ratio']} x its floor on medium, {how}", "measured": text,
                    "met": _verdict(checks)})

    # 7: peak memory, every transport. A transport holds at least its largest bucket while it sends it, so a
    # peak under half of that is no reading: the RSS high-water mark did not grow because memory already
    # resident before the sync (freed heap) was reused.
    def under_read(r):
        return r.get("peak_extra_bytes", 0) < UNDER_READ * r.get("bucket_bytes", 0) or not r.get("peak_extra_bytes")

    cands = [r for r in rows if r["kind"] in _TRANSPORT_OF and "peak_extra_bytes" in r]
    read = [r for r in cands if not under_read(r)]
    unread = [f"{r['size']} {r['method']} ({r['peak_extra_bytes'] / 2**20:.0f} MiB)" for r in cands if under_read(r)]
    worst = {}
    for r in read:
        t = _TRANSPORT_OF[r["kind"]]
        if t not in worst or r["peak_ratio"] > worst[t]["peak_ratio"]:
            worst[t] = r
    worst = {t: worst[t] for t in _TRANSPORT_OF.values() if t in worst}  # broadcast, colocated, disk (, fp8)
    measured = [f"{t} worst {r['peak_ratio']:.2f}x ({r['size']} {r['method']}: {r['peak_extra_bytes'] / 2**20:.0f} MiB "
                f"peak, bucket {r['bucket_bytes'] / 2**20:.0f} MiB)" for t, r in worst.items()]
    expected = list(dict.fromkeys(t for k, t in _TRANSPORT_OF.items()
                                  if k not in ("fp8", "one-request") or any(r["kind"] == k for r in rows)))
    missing = [t for t in expected if t not in worst]
    if missing:
        measured.append(f"not measured for {', '.join(missing)}")
    if unread:
        measured.append(f"no reading (under {UNDER_READ} x its bucket: under-read) for {', '.join(unread)}")
    checks = [r["peak_ratio"] <= TARGETS["peak_ratio"] for r in read] + [None] * len(missing)
    out.append({"target": f"rank-0 peak extra memory <= {TARGETS['peak_ratio']} x bucket size, every transport "
                          f"({', '.join(expected)})",
                "measured": "; ".join(measured), "met": _verdict(checks)})
    out += fp8_targets(rows, link) if any(r["kind"] == "fp8" for r in rows) else []
    out += lora_targets(rows) if any(r["kind"] == "lora" for r in rows) else []
    return out + (delta_targets(rows) if any(r["kind"] == "delta" for r in rows) else [])


def _f(x, fmt: str, dash: str = "-") -> str:
    return dash if x is None else format(x, fmt)


def format_table(rows: Sequence[dict], targets: Sequence[dict], warmups: dict | None = None) -> str:
    """The human-readable table: every row, the notes, the warm-up line per size, then the targets."""
    head = (f"{'size':<8} {'method':<36} {'MB':>7} {'median s':>9} {'min-max s':>15} {'GB/s':>6} {'ratio':>6} "
            f"{'r@min':>6} {'xfer s':>7} {'x-rat':>6} {'x@min':>6} {'first s':>8} {'peak MiB':>9} {'pk/bkt':>6} "
            f"{'x p-t':>6} {'xfer p-t':>8}")
    engines = sorted({r.get("engine", "reference") for r in rows})
    lines = [f"servers: {' and '.join(ENGINES.get(e, e) for e in engines)}", head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["size"] != last:
            lines.append("")
        last = r["size"]
        s = r["seconds"]
        spread = f"{_f(s['min'], '.3f')}-{_f(s['max'], '.3f')}"
        peak = r.get("peak_extra_bytes")
        xfer = r.get("transfer_seconds", {}).get("median")
        lines.append(
            f"{r['size']:<8} {r['method']:<36} {r['bytes'] / 1e6:>7.1f} {_f(s['median'], '.3f'):>9} {spread:>15} "
            f"{_f(r.get('gbps'), '.2f'):>6} {_f(r.get('ratio'), '.2f'):>6} {_f(r.get('ratio_min'), '.2f'):>6} "
            f"{_f(xfer, '.3f'):>7} {_f(r.get('transfer_ratio'), '.2f'):>6} {_f(r.get('transfer_ratio_min'), '.2f'):>6} "
            f"{_f(r.get('first_seconds'), '.3f'):>8} "
            f"{_f(peak / 2**20 if peak is not None else None, '.0f'):>9} {_f(r.get('peak_ratio'), '.2f'):>6} "
            f"{_f(r.get('speedup_vs_per_tensor'), '.1f'):>6} {_f(r.get('transfer_speedup_vs_per_tensor'), '.1f'):>8}"
        )
    lines.append("")
    lines.append(
        "ratio = floor s / method s (medians), end to end: floor = gather + the transport's floor (broadcast: one "
        "broadcast of the same bytes; colocated: /dev/shm write+read; disk: write+fsync+read), the gather being the "
        "faster of the two raw gathers in each round; r@min = the same from each one's fastest repeat (least touched "
        "by noise). xfer s = transfer only: the sync minus its own bucket plan's gather (the gather-* row named in "
        "the JSON's gather_item), round by round; x-rat = the transport's floor alone / xfer s; x@min from the "
        "fastest repeats; a gather-* row (a bucket plan's gather alone) has ratio = floor: gather / its seconds. first s = warm-up sync (not in the median); pk/bkt = peak extra memory (RSS high-water "
        "growth) / largest bucket; x p-t = speed-up over per-tensor, end to end; xfer p-t = the same, transfer only.")
    if any((r.get("transfer_ratio") or 0) > 1 for r in rows):
        lines.append("note: an x-rat above 1 is the publisher's overlap (bucket k+1 is gathered while bucket k "
                     "travels): the sync minus the gather is then less than the transfer itself")
    for r in rows:
        if (r.get("ratio") or 0) > 1:
            fl = next(x for x in rows if x["size"] == r["size"] and x["method"] == r["floor"])["seconds"]
            lines.append(f"note: {r['size']} {r['method']} beat its floor's median (ratio {r['ratio']:.2f}): the floor "
                         f"ranged {fl['min']:.3f}-{fl['max']:.3f} s in this run; read r@min")
        if r.get("transfer_seconds", {}).get("median") is not None and r["transfer_seconds"]["median"] <= 0:
            lines.append(f"note: {r['size']} {r['method']}: the sync took no longer than its gather alone "
                         f"(median xfer {r['transfer_seconds']['median']:.3f} s): transfer only not resolved")
    for r in rows:
        if r["kind"] == "disk" and r.get("phases"):
            p = r["phases"]
            lines.append(f"{r['size']} {r['method']}: gather+write+fsync {p.get('write', 0):.3f} s, announce "
                         f"{p.get('announce', 0):.3f} s, load (announced -> served) {p.get('load', 0):.3f} s (medians)")
    lines += delta_notes(rows)
    lines += lora_notes(rows)
    for label, w in (warmups or {}).items():
        lines.append(f"{label}: first broadcast sync {w['first_seconds']:.3f} s, of which weight-update group "
                     f"creation {w['group_init_seconds']:.3f} s")
    lines.append("")
    lines.append("targets:")
    for t in targets:
        verdict = {True: "MET", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  [{verdict:^12}] {t['target']}: {t['measured'] or '-'}")
    return "\n".join(lines)


LINK_ROWS = ("raw-broadcast", FLOOR_BROADCAST, "flattened", FP8_RAW, FLOOR_BROADCAST_FP8, "fp8", "delta", "per-tensor",
             "raw-disk", FLOOR_DISK, "disk")
"""What the link section shows, in this order: the broadcast floor, the broadcast methods, then disk."""


def link_rows(rows: Sequence[dict], link: dict) -> list[dict]:
    """The rows of a ``--link`` run that the link section shows, each with ``mbit_s`` (its bytes over its median
    seconds), ``of_link`` (that over the measured link rate) and ``link_seconds`` (its bytes alone at the
    measured rate: what the link makes them cost). Disk does not cross the link (the hosts share a filesystem)."""
    rate = link["measured"]["mbit_s"] * 1e6
    sizes = list(dict.fromkeys(r["size"] for r in rows))  # in the order they were measured
    out = []
    for r in rows:
        which = r["method"] if r["method"] in LINK_ROWS else r["kind"]
        if which not in LINK_ROWS or r["kind"] == "gather":
            continue
        med = r["seconds"]["median"]
        bits = r["bytes"] * 8
        out.append({**r, "link_order": LINK_ROWS.index(which), "mbit_s": bits / med / 1e6 if med else None,
                    "of_link": bits / med / rate if med else None, "link_seconds": bits / rate,
                    "crosses_link": r["kind"] != "disk" and not r["method"].startswith(("raw-disk", FLOOR_DISK))})
    return sorted(out, key=lambda r: (sizes.index(r["size"]), r["link_order"], r.get("lr") or 0, r["method"]))


def format_link(rows: Sequence[dict], link: dict) -> str:
    """The section a ``--link`` run adds to the table: the link, then per size the rows of :func:`link_rows`."""
    m = link["measured"]
    delay = f", netem delay {link['delay']} each way" if link.get("delay") else ""
    lines = [f"link: tbf {link['rate']}{delay} on both legs of a veth pair, trainer {link['trainer_addr']} -> servers "
             f"{link['server_addr']}; measured {m['mbit_s']:.1f} Mbit/s (plain TCP, {m['bytes'] / 1e6:.0f} MB in "
             f"{m['seconds']:.2f} s)"]
    head = (f"{'size':<8} {'method':<36} {'MB':>8} {'median s':>9} {'min-max s':>15} {'Mbit/s':>8} {'of link':>7} "
            f"{'link s':>7} {'x full':>6}")
    lines += [head, "-" * len(head)]
    for r in link_rows(rows, link):
        s = r["seconds"]
        spread = f"{_f(s['min'], '.3f')}-{_f(s['max'], '.3f')}"
        lines.append(f"{r['size']:<8} {r['method']:<36} {r['bytes'] / 1e6:>8.2f} {_f(s['median'], '.3f'):>9} "
                     f"{spread:>15} {_f(r['mbit_s'], '.1f'):>8} "
                     f"{_f(r['of_link'] if r['crosses_link'] else None, '.2f'):>7} "
                     f"{_f(r['link_seconds'] if r['crosses_link'] else None, '.3f'):>7} "
                     f"{_f(r.get('speedup_vs_full'), '.1f'):>6}")
    lines.append("Mbit/s = the row's bytes over its median seconds; of link = that / the measured link; link s = the "
                 "row's bytes alone at the measured rate; x full = an FP8 or delta row's speed-up over the full bf16 flattened "
                 "sync of the same bucket size. Disk rows do not cross the link (both hosts share this machine's "
                 "filesystem).")
    return "\n".join(lines)


# One colour family per kind, used by the method lines and by that kind's target line, so the legend reads
# the same in every panel.
_FAMILY = {"floor": "Greys", "flattened": "Blues", "one-request": "GnBu", "fp8": "YlOrBr", "delta": "Reds", "per-tensor": "Oranges", "colocated": "Purples", "disk": "Greens",
           "lora": "PuRd"}
_TARGET_OF = {"flattened": "flat_ratio", "disk": "disk_ratio"}


def _colours(methods: Sequence[tuple[str, str]]) -> dict[str, tuple]:
    """method -> colour: shades of its kind's family, darker for later methods of the same kind."""
    import matplotlib

    out = {}
    for kind, cmap in _FAMILY.items():
        same = [m for m, k in methods if k == kind]
        for i, m in enumerate(same):
            out[m] = matplotlib.colormaps[cmap](0.55 + 0.4 * (i + 1) / (len(same) + 1))
    return out


def plot(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Three panels: seconds per sync, ratio to the floor end to end, and transfer only; against model size
    (several sizes) or as bars (one size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["kind"] in _FAMILY and not r["method"].startswith("raw-")]
    methods = list(dict.fromkeys((r["method"], r["kind"]) for r in shown))
    colour = _colours(methods)
    sizes = list(dict.fromkeys(r["size"] for r in shown))
    fig, (ax_s, ax_r, ax_t) = plt.subplots(1, 3, figsize=(19, 5.5))
    if len(sizes) == 1:
        _bars(ax_s, ax_r, ax_t, shown, methods, colour)
        where = f"{sizes[0]} ({shown[0]['model_bytes'] / 1e6:.0f} MB in the serving dtype)"
        ax_s.set_title(f"sync time, {where}")
    else:
        _lines(ax_s, ax_r, ax_t, shown, methods, colour)
        ax_s.set_title("sync time")
        ax_s.legend(fontsize=7)
    ax_s.set_ylabel("seconds per sync (median, min-max)")
    ax_s.grid(True, which="both", alpha=0.3)
    for ax, what in ((ax_r, "end to end: floor = gather + transport floor"),
                     (ax_t, "transfer only: sync - its gather, vs the transport floor")):
        ax.axhline(1.0, color="grey", lw=0.8)
        for kind, target in _TARGET_OF.items():
            if any(k == kind for _, k in methods):
                ax.axhline(TARGETS[target], color=matplotlib.colormaps[_FAMILY[kind]](0.9), lw=1, ls=":",
                           label=f"target: {kind} >= {TARGETS[target]}")
        ax.set_ylabel("floor seconds / method seconds")
        ax.set_title(f"ratio to the floor ({what})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(r: dict) -> tuple[float, float]:
    s = r["seconds"]
    return s["median"] - s["min"], s["max"] - s["median"]


def _bars(ax_s, ax_r, ax_t, shown: Sequence[dict], methods, colour) -> None:
    """One size: a bar per method, so the figure is not a single point on a log axis."""
    names = [m for m, _ in methods]
    by_name = {r["method"]: r for r in shown}
    ax_s.bar(range(len(names)), [by_name[m]["seconds"]["median"] for m in names], color=[colour[m] for m in names],
             yerr=list(zip(*(_spread(by_name[m]) for m in names))), capsize=3)
    ax_s.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    for ax, field in ((ax_r, "ratio"), (ax_t, "transfer_ratio")):
        have = [m for m in names if by_name[m].get(field) is not None]
        ax.bar(range(len(have)), [by_name[m][field] for m in have], color=[colour[m] for m in have])
        ax.set_xticks(range(len(have)), have, rotation=30, ha="right", fontsize=7)


def _lines(ax_s, ax_r, ax_t, shown: Sequence[dict], methods, colour) -> None:
    """Several sizes: a line per method against model size (log-log)."""
    for m, kind in methods:
        pts = sorted((r for r in shown if r["method"] == m), key=lambda r: r["model_bytes"])
        xs = [r["model_bytes"] / 1e6 for r in pts]
        style = "o--" if kind == "floor" else "o-"
        lo, hi = zip(*(_spread(r) for r in pts))
        ax_s.errorbar(xs, [r["seconds"]["median"] for r in pts], yerr=[lo, hi], fmt=style, color=colour[m],
                      capsize=3, label=m)
        for ax, field in ((ax_r, "ratio"), (ax_t, "transfer_ratio")):
            have = [(x, r[field]) for x, r in zip(xs, pts) if r.get(field) is not None]
            if have:
                ax.plot(*zip(*have), style, color=colour[m], label=m)
    sizes = sorted({(r["model_bytes"], r["size"]) for r in shown})
    for ax in (ax_s, ax_r, ax_t):
        ax.set_xscale("log")
        ax.set_xlabel("model size in the serving dtype (MB)")
        ax.set_xticks([mb / 1e6 for mb, _ in sizes], [f"{label}\n{mb / 1e6:.0f}" for mb, label in sizes], fontsize=8)
        ax.minorticks_off()
    ax_s.set_yscale("log")
