"""From the workers' raw timings to rows, a table, the target checks and a plot.

Every row is one method (or floor) on one model size. Seconds are the median of the timed repeats,
with min/max and the interquartile range as the spread; the warm-up (round 0) is reported on its own
as ``first_seconds``. Ratios are ``floor seconds / method seconds`` (1.0 = as fast as the bare
transport): ``ratio`` from the medians, ``ratio_min`` from each one's fastest repeat (noise on a shared
machine only ever adds time, so the fastest repeats are the least disturbed). Each floor is summed per
round from the same round's pieces:

- broadcast methods: ``raw-gather + raw-broadcast`` (the FSDP all-gather, then trainer -> server), the
  gather being the faster, in that round, of one flat all-gather and the same bytes in 16 MiB gathers;
- disk methods: ``raw-disk`` (safetensors write + fsync + read back).

``fsdp-gather`` is a diagnostic row: the trainer's parameter-by-parameter gather that every method pays.

GB/s is 10^9 bytes per second, of each row's own bytes (a disk row counts its snapshot's files).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["TARGETS", "build_rows", "build_warmups", "check_targets", "format_table", "plot", "stats"]

FLOOR_BROADCAST = "floor: gather+broadcast"
FLOOR_DISK = "floor: disk write+fsync+read"

TARGETS = {
    "flat_ratio": 0.8,     # flattened broadcast >= 0.8 of its floor
    "flat_speedup": 3.0,   # flattened >= 3x faster than per-tensor on medium
    "disk_ratio": 0.7,     # disk >= 0.7 of its floor
    "peak_ratio": 2.5,     # rank-0 peak extra memory <= 2.5 x bucket size
}


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
    if name.startswith("disk-"):
        return "disk"
    if name == "fsdp-gather":
        return "diagnostic"
    return "floor"


def build_rows(sizes: Sequence[dict]) -> list[dict]:
    """One row per (size, method or floor), from the workers' results (see :mod:`bench.worker`)."""
    rows: list[dict] = []
    for size in sizes:
        items = size["items"]
        per_round = {name: [r["seconds"] for r in rec["runs"]] for name, rec in items.items()}
        gathers = [n for n in items if n.startswith("raw-gather")]
        gather = [min(g) for g in zip(*(per_round[n] for n in gathers))]  # the faster way, round by round
        floors = {
            FLOOR_BROADCAST: [g + b for g, b in zip(gather, per_round["raw-broadcast"])],
            FLOOR_DISK: per_round["raw-disk"],
        }
        floor_first = {
            FLOOR_BROADCAST: min(items[n]["first"]["seconds"] for n in gathers) + items["raw-broadcast"]["first"]["seconds"],
            FLOOR_DISK: items["raw-disk"]["first"]["seconds"],
        }
        floor_stats = {k: stats(v) for k, v in floors.items()}
        per_tensor = stats(per_round["per-tensor"])["median"] if "per-tensor" in items else None
        base = {"size": size["label"], "params": size["params"], "model_bytes": size["bytes"]}
        for name, rec in items.items():
            kind = _kind(name)
            runs = rec["runs"]
            s = stats(per_round[name])
            row = {**base, "method": name, "kind": kind, "bytes": runs[0]["bytes"] if runs else size["bytes"],
                   "seconds": s, "first_seconds": rec["first"]["seconds"] if rec["first"] else None}
            row["gbps"] = row["bytes"] / s["median"] / 1e9 if s["median"] else None
            floor = FLOOR_DISK if kind == "disk" else FLOOR_BROADCAST if kind in ("flattened", "per-tensor") else None
            if floor is not None:
                row["floor"] = floor
                row["floor_seconds"] = floor_stats[floor]["median"]
                row["ratio"] = floor_stats[floor]["median"] / s["median"]
                row["ratio_min"] = floor_stats[floor]["min"] / s["min"]
            if kind in ("flattened", "per-tensor"):
                peak = max(r["peak_extra_bytes"] for r in runs)
                row["peak_extra_bytes"] = peak
                row["bucket_bytes"] = runs[0]["largest_bucket_bytes"]
                row["bucket_budget_bytes"] = runs[0]["bucket_bytes"]
                row["peak_ratio"] = peak / row["bucket_bytes"]
                row["buckets"] = runs[0]["buckets"]
                if rec["first"] and "group_init" in rec["first"]["phases"]:
                    row["first_group_init_seconds"] = rec["first"]["phases"]["group_init"]
            if kind == "flattened" and per_tensor:
                row["speedup_vs_per_tensor"] = per_tensor / s["median"]
            if kind == "disk":
                row["phases"] = {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
            if name == "raw-broadcast":
                row["server_seconds"] = stats([r["server_seconds"] for r in runs])
            if name == "raw-disk":
                row["write_seconds"] = stats([r["write_seconds"] for r in runs])
                row["read_seconds"] = stats([r["read_seconds"] for r in runs])
            rows.append(row)
        for floor, s in floor_stats.items():
            rows.append({**base, "method": floor, "kind": "floor", "bytes": size["bytes"], "seconds": s,
                         "first_seconds": floor_first[floor],
                         "gbps": size["bytes"] / s["median"] / 1e9 if s["median"] else None})
    order = {"floor": 0, "diagnostic": 1, "flattened": 2, "per-tensor": 3, "disk": 4}
    floor_order = ["raw-gather", "raw-gather-chunked", "raw-broadcast", FLOOR_BROADCAST, "raw-disk", FLOOR_DISK]
    sizes_order = [s["label"] for s in sizes]

    def key(r):
        m = "raw-gather-chunked" if r["method"].startswith("raw-gather-") else r["method"]
        sub = floor_order.index(m) if m in floor_order else 0
        bucket = r.get("bucket_budget_bytes", 0)
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


def check_targets(rows: Sequence[dict]) -> list[dict]:
    """The issue's targets, each with the measured figures, per size, and whether it was met."""
    out = []
    sizes = list(dict.fromkeys(r["size"] for r in rows))

    def best(size, kind, field):
        cands = [r for r in rows if r["size"] == size and r["kind"] == kind and r.get(field) is not None]
        return max(cands, key=lambda r: r[field]) if cands else None

    measured, ok = [], True
    for size in sizes:
        r = best(size, "flattened", "ratio")
        if r:
            measured.append(f"{size} {r['ratio']:.2f} ({r['method']}; fastest runs {r['ratio_min']:.2f})")
            ok &= r["ratio"] >= TARGETS["flat_ratio"]
    out.append({"target": f"flattened broadcast >= {TARGETS['flat_ratio']} x its floor (best bucket)",
                "measured": ", ".join(measured), "met": ok if measured else None})

    # Only a measured medium can meet or miss the medium target; a smaller size's figure is shown for reference.
    largest = "medium" if "medium" in sizes else (sizes[-1] if sizes else None)
    r = best(largest, "flattened", "speedup_vs_per_tensor") if largest else None
    measured = f"{largest} {r['speedup_vs_per_tensor']:.2f}x ({r['method']})" if r else ""
    if largest != "medium":
        measured = "medium not measured" + (f"; for reference {measured}" if measured else "")
    out.append({"target": f"flattened >= {TARGETS['flat_speedup']:g}x faster than per-tensor on medium",
                "measured": measured,
                "met": (r["speedup_vs_per_tensor"] >= TARGETS["flat_speedup"]) if r and largest == "medium" else None})

    disk = [r for r in rows if r["kind"] == "disk"]
    out.append({"target": f"disk >= {TARGETS['disk_ratio']} x its floor",
                "measured": ", ".join(f"{r['size']} {r['method']} {r['ratio']:.2f} (fastest runs {r['ratio_min']:.2f})"
                                      for r in disk),
                "met": all(r["ratio"] >= TARGETS["disk_ratio"] for r in disk) if disk else None})

    # A peak of 0 is no reading: the RSS high-water mark did not grow because freed heap was reused.
    flat = [r for r in rows if r["kind"] == "flattened"]
    read = [r for r in flat if r["peak_extra_bytes"] > 0]
    worst = max(read, key=lambda r: r["peak_ratio"]) if read else None
    unread = [f"{r['size']} {r['method']}" for r in flat if r["peak_extra_bytes"] <= 0]
    measured = (f"worst {worst['peak_ratio']:.2f}x ({worst['size']} {worst['method']}: "
                f"{worst['peak_extra_bytes'] / 2**20:.0f} MiB peak, bucket {worst['bucket_bytes'] / 2**20:.0f} MiB)"
                if worst else "")
    if unread:
        measured += ("; " if measured else "") + f"no reading (0 MiB: under-read) for {', '.join(unread)}"
    out.append({"target": f"rank-0 peak extra memory <= {TARGETS['peak_ratio']} x bucket size",
                "measured": measured,
                "met": all(r["peak_ratio"] <= TARGETS["peak_ratio"] for r in read) if read else None})
    return out


def _f(x, fmt: str, dash: str = "-") -> str:
    return dash if x is None else format(x, fmt)


def format_table(rows: Sequence[dict], targets: Sequence[dict], warmups: dict | None = None) -> str:
    """The human-readable table: every row, then the warm-up line per size, then the targets."""
    head = (f"{'size':<8} {'method':<30} {'MB':>7} {'median s':>9} {'min-max s':>15} {'IQR s':>15} {'GB/s':>6} "
            f"{'ratio':>6} {'r@min':>6} {'first s':>8} {'peak MiB':>9} {'pk/bkt':>6} {'x p-t':>6}")
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["size"] != last:
            lines.append("")
        last = r["size"]
        s = r["seconds"]
        spread = f"{_f(s['min'], '.3f')}-{_f(s['max'], '.3f')}"
        iqr = f"{_f(s['q1'], '.3f')}-{_f(s['q3'], '.3f')}"
        peak = r.get("peak_extra_bytes")
        lines.append(
            f"{r['size']:<8} {r['method']:<30} {r['bytes'] / 1e6:>7.1f} {_f(s['median'], '.3f'):>9} {spread:>15} "
            f"{iqr:>15} {_f(r.get('gbps'), '.2f'):>6} {_f(r.get('ratio'), '.2f'):>6} {_f(r.get('ratio_min'), '.2f'):>6} "
            f"{_f(r.get('first_seconds'), '.3f'):>8} "
            f"{_f(peak / 2**20 if peak is not None else None, '.0f'):>9} {_f(r.get('peak_ratio'), '.2f'):>6} "
            f"{_f(r.get('speedup_vs_per_tensor'), '.1f'):>6}"
        )
    lines.append("")
    lines.append("ratio = floor s / method s, medians (floor: gather+broadcast for broadcast rows, the gather being "
                 "the faster of the two raw gathers in each round; write+fsync+read for disk); r@min = the same from each one's fastest repeat (least touched by noise); "
                 "first s = warm-up sync (not in the median); pk/bkt = peak extra memory (RSS high-water growth) / "
                 "largest bucket; "
                 "x p-t = speed-up over per-tensor; fsdp-gather = the trainer's own parameter-by-parameter "
                 "gather, paid by every method (a diagnostic, not a floor)")
    for r in rows:
        if r.get("ratio", 0) > 1:
            fl = next(x for x in rows if x["size"] == r["size"] and x["method"] == r["floor"])["seconds"]
            lines.append(f"note: {r['size']} {r['method']} beat its floor's median (ratio {r['ratio']:.2f}): the floor "
                         f"ranged {fl['min']:.3f}-{fl['max']:.3f} s in this run; read r@min")
    for r in rows:
        if r["kind"] == "disk":
            p = r["phases"]
            lines.append(f"{r['size']} {r['method']}: gather+write+fsync {p.get('write', 0):.3f} s, announce "
                         f"{p.get('announce', 0):.3f} s, load (announced -> served) {p.get('load', 0):.3f} s (medians)")
    for label, w in (warmups or {}).items():
        lines.append(f"{label}: first broadcast sync {w['first_seconds']:.3f} s, of which weight-update group "
                     f"creation {w['group_init_seconds']:.3f} s")
    lines.append("")
    lines.append("targets:")
    for t in targets:
        verdict = {True: "MET", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  [{verdict:^12}] {t['target']}: {t['measured'] or '-'}")
    return "\n".join(lines)


# One colour family per kind, used by the method lines and by that kind's target line, so the legend reads
# the same in both panels.
_FAMILY = {"floor": "Greys", "flattened": "Blues", "per-tensor": "Oranges", "disk": "Greens"}
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
    """Seconds and ratio to the floor per method: against model size (several sizes), or as bars (one size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["kind"] != "diagnostic" and not r["method"].startswith("raw-")]
    methods = list(dict.fromkeys((r["method"], r["kind"]) for r in shown))
    colour = _colours(methods)
    sizes = list(dict.fromkeys(r["size"] for r in shown))
    fig, (ax_s, ax_r) = plt.subplots(1, 2, figsize=(13, 5))
    if len(sizes) == 1:
        _bars(ax_s, ax_r, shown, methods, colour)
        where = f"{sizes[0]} ({shown[0]['model_bytes'] / 1e6:.0f} MB in the serving dtype)"
        ax_s.set_title(f"sync time, {where}")
    else:
        _lines(ax_s, ax_r, shown, methods, colour)
        ax_s.set_title("sync time")
        ax_s.legend(fontsize=7)
    ax_s.set_ylabel("seconds per sync (median, min-max)")
    ax_s.grid(True, which="both", alpha=0.3)
    ax_r.axhline(1.0, color="grey", lw=0.8)
    for kind, target in _TARGET_OF.items():
        if any(k == kind for _, k in methods):
            ax_r.axhline(TARGETS[target], color=matplotlib.colormaps[_FAMILY[kind]](0.9), lw=1, ls=":",
                         label=f"target: {kind} >= {TARGETS[target]}")
    ax_r.set_ylabel("floor seconds / method seconds")
    ax_r.set_title("ratio to the raw transport (1 = as fast as the floor)")
    ax_r.grid(True, which="both", alpha=0.3)
    ax_r.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _spread(r: dict) -> tuple[float, float]:
    s = r["seconds"]
    return s["median"] - s["min"], s["max"] - s["median"]


def _bars(ax_s, ax_r, shown: Sequence[dict], methods, colour) -> None:
    """One size: a bar per method, so the figure is not a single point on a log axis."""
    names = [m for m, _ in methods]
    by_name = {r["method"]: r for r in shown}
    xs = range(len(names))
    ax_s.bar(xs, [by_name[m]["seconds"]["median"] for m in names], color=[colour[m] for m in names],
             yerr=list(zip(*(_spread(by_name[m]) for m in names))), capsize=3)
    ratio = [m for m in names if by_name[m].get("ratio") is not None]
    ax_r.bar(range(len(ratio)), [by_name[m]["ratio"] for m in ratio], color=[colour[m] for m in ratio])
    for ax, labels in ((ax_s, names), (ax_r, ratio)):
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)


def _lines(ax_s, ax_r, shown: Sequence[dict], methods, colour) -> None:
    """Several sizes: a line per method against model size (log-log)."""
    for m, kind in methods:
        pts = sorted((r for r in shown if r["method"] == m), key=lambda r: r["model_bytes"])
        xs = [r["model_bytes"] / 1e6 for r in pts]
        style = "o--" if kind == "floor" else "o-"
        lo, hi = zip(*(_spread(r) for r in pts))
        ax_s.errorbar(xs, [r["seconds"]["median"] for r in pts], yerr=[lo, hi], fmt=style, color=colour[m],
                      capsize=3, label=m)
        if pts[0].get("ratio") is not None:
            ax_r.plot(xs, [r["ratio"] for r in pts], style, color=colour[m], label=m)
    for ax in (ax_s, ax_r):
        ax.set_xscale("log")
        ax.set_xlabel("model size in the serving dtype (MB)")
    ax_s.set_yscale("log")
