"""The benchmark's verdicts and plot, from hand-made rows: no target is MET that was not measured."""

from __future__ import annotations

from bench import report


def _row(size, method, kind, seconds, **extra):
    s = {"median": seconds, "min": seconds * 0.9, "max": seconds * 1.2, "q1": seconds, "q3": seconds, "n": 3}
    mb = {"small": 97e6, "medium": 387e6}[size]
    return {"size": size, "method": method, "kind": kind, "model_bytes": mb, "bytes": mb, "seconds": s, **extra}


def _rows(size, peak_mib):
    flat = dict(ratio=0.9, ratio_min=0.9, speedup_vs_per_tensor=6.0, peak_extra_bytes=peak_mib * 2**20,
                bucket_bytes=32 * 2**20, peak_ratio=peak_mib / 32)
    return [
        _row(size, report.FLOOR_BROADCAST, "floor", 0.2),
        _row(size, "flat-32MiB", "flattened", 0.22, **flat),
        _row(size, "per-tensor", "per-tensor", 1.3, ratio=0.15, ratio_min=0.15),
        _row(size, "disk-dir", "disk", 0.3, ratio=0.8, ratio_min=0.8),
    ]


def test_a_target_on_a_size_not_measured_is_not_met():
    speedup = next(t for t in report.check_targets(_rows("small", 40)) if "per-tensor on medium" in t["target"])
    assert speedup["met"] is None
    assert speedup["measured"].startswith("medium not measured; for reference small 6.00x")


def test_a_peak_memory_reading_of_zero_is_no_reading():
    peak = next(t for t in report.check_targets(_rows("small", 0)) if "peak" in t["target"])
    assert peak["met"] is None and "no reading (0 MiB: under-read) for small flat-32MiB" in peak["measured"]
    mixed = report.check_targets(_rows("small", 0) + _rows("medium", 60))
    peak = next(t for t in mixed if "peak" in t["target"])
    assert peak["met"] is True and peak["measured"].startswith("worst 1.88x (medium flat-32MiB")


def test_plot_of_one_size_draws_bars_in_the_legend_colours(tmp_path):
    import matplotlib.image

    methods = [("floor: x", "floor"), ("flat-32MiB", "flattened"), ("flat-128MiB", "flattened"), ("disk-dir", "disk")]
    colours = report._colours(methods)
    assert colours["flat-32MiB"] != colours["flat-128MiB"]
    assert all(colours[m][2] > colours[m][0] for m in ("flat-32MiB", "flat-128MiB"))  # blue family
    assert colours["disk-dir"][1] > colours["disk-dir"][0]  # green family, as the disk target line
    path = tmp_path / "one.png"
    report.plot(_rows("small", 40), str(path))
    image = matplotlib.image.imread(path)
    # Bars fill the panels: well over 10% of the pixels are not white (one point on log axes left ~90% empty).
    assert (image[..., :3].mean(axis=-1) < 0.95).mean() > 0.1
