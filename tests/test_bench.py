"""``wsync bench`` end to end on the tiny preset, and the bench route on a live server app.

No timing assertions: the machine is shared and the numbers are the benchmark's output, not a test's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quick_bench_on_tiny_writes_every_row_and_the_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "wsync.cli", "bench", "--quick", "--sizes", "tiny", "--repeats", "1",
           "--json", str(out), "--plot", str(png), "--workdir", str(tmp_path / "work"), "--timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    report = json.loads(out.read_text())
    assert report["failed"] == {}
    methods = {r["method"] for r in report["rows"] if r["size"] == "tiny"}
    bucket = f"{report['meta']['config']['bucket_mb'][0]:g}MiB"
    expected = {"raw-gather", "raw-gather-16MiB", "raw-broadcast", "raw-shm", "raw-disk", "floor: gather+broadcast",
                "floor: gather+shm write+read", "floor: gather+disk write+fsync+read", f"gather-{bucket}",
                "gather-per-tensor", f"flat-{bucket}", "per-tensor", f"colocated-{bucket}", "disk-dir",
                "disk-dir-rank0"}  # the rank-0 writer beside every-rank writers (2 ranks by default)
    if shutil.which("etcd"):
        expected.add("disk-etcd")
    expected |= {"delta-lr1e-06", "delta-lr1e-05", "fp8+delta-lr1e-06", "fp8+delta-lr1e-05"}
    expected |= {f"fp8-{bucket}", f"gather-fp8-{bucket}", "raw-broadcast-fp8", "floor: gather+broadcast fp8"}
    expected |= {"lora-tensors", "lora-disk"}
    assert expected <= methods, f"missing rows: {expected - methods}"
    by = {r["method"]: r for r in report["rows"]}
    # FP8 into a server serving FP8: fewer bytes than bf16, the same bytes as its floor, timed against the full sync.
    fp8 = by[f"fp8-{bucket}"]
    assert fp8["bytes"] == by["raw-broadcast-fp8"]["bytes"] < fp8["full_bytes"] == fp8["model_bytes"], fp8
    assert fp8["speedup_vs_full"] > 0 and fp8["full_method"] == f"flat-{bucket}", fp8
    assert {(r["method"], r["encoding"], r["link"]) for r in report["rows"] if r["method"] in (
        f"fp8-{bucket}", f"flat-{bucket}", "delta-lr1e-06", "fp8+delta-lr1e-06")} == {
        (f"fp8-{bucket}", "fp8", None), (f"flat-{bucket}", "bfloat16", None), ("delta-lr1e-06", "delta", None),
        ("fp8+delta-lr1e-06", "fp8+delta", None)}
    # The adapter alone (rank 16 on every projection, in the serving dtype) against the full sync of the same run.
    for m in ("lora-tensors", "lora-disk"):
        lora = by[m]
        assert lora["encoding"] == "lora" and lora["lora_rank"] == 16 and lora["tensors"] == 2 * 7 * 2, lora
        assert 0 < lora["bytes"] < lora["full_bytes"] == lora["model_bytes"] and lora["full_method"] == f"flat-{bucket}"
        assert lora["fraction_of_full"] > 0 and lora["seconds"]["n"] == 1, lora
    assert by["lora-tensors"]["bytes"] == by["lora-disk"]["bytes"]
    for r in report["rows"]:
        assert r["bytes"] > 0 and r["seconds"]["n"] == 1, r
        assert r["seconds"]["median"] > 0, r
        if r["kind"] == "delta":
            # A real optimizer step before each delta: part of the elements changed; sent as a delta, or as an
            # anchor when it is over delta_max_fraction or the measured costs say the full sync is faster (the
            # tiny model's elements change more than a real one's); timed against the full flattened sync and
            # the floor of the same run.
            assert 0 < r["changed_fraction"] < 1, r
            assert r["full_method"] in methods and r["speedup_vs_full"] > 0 and r["ratio"] > 0, r
            assert all(s == "delta" or "delta_max_fraction" in s or "delta_cost" in s for s in r["sent"]), r
            full = r.get("fp8_full_bytes") or r["full_bytes"]  # an FP8 delta's anchor is the FP8 full sync
            assert r["bytes"] < full / 2 if r["sent"] == ["delta"] else r["bytes"] == full, r
            if r["method"].startswith("fp8+delta-"):
                assert r["fp8_full_bytes"] == by[f"fp8-{bucket}"]["bytes"] and r["speedup_vs_fp8"] > 0, r
        elif r["kind"] not in ("floor", "gather", "lora"):
            # Every method is reported end to end and transfer only, against floors of the same run.
            assert r["ratio"] > 0 and r["first_seconds"] > 0, r
            assert r["gather_item"] in methods and r["transfer_seconds"]["n"] == 1, r
    assert {t["target"].split(" ")[0] for t in report["targets"]} >= {"flattened", "disk", "rank-0"}
    assert report["meta"]["device"] == "cpu" and report["sizes"][0]["server_backend"] == "gloo"
    # Every published byte went through the server: the broadcast rows carry the whole model.
    model_bytes = {r["model_bytes"] for r in report["rows"]}
    assert len(model_bytes) == 1
    assert all(r["bytes"] == r["model_bytes"] for r in report["rows"] if r["kind"] in ("flattened", "per-tensor", "colocated"))
    per_tensor = next(r for r in report["rows"] if r["method"] == "per-tensor")
    assert per_tensor["buckets"] == report["sizes"][0]["tensors"]  # one request per tensor
    assert png.stat().st_size > 0
    assert "targets:" in proc.stdout and "per-tensor" in proc.stdout


def test_the_bench_servers_start_at_once_and_one_that_fails_stops_the_others(tiny_model_dir, tmp_path):
    """The bench starts each method's reference server at the same time; if one cannot start, the ones that did are
    stopped and its error is what the bench reports."""
    import time

    from bench.run import _start_servers
    from bridge.client import ServerClient
    from bridge.errors import BridgeError
    from inference_adapter.launcher import launch_server

    def launch(**kw):
        started.append(time.monotonic())
        return launch_server(**kw)

    started = []
    spec = dict(model=tiny_model_dir, use_sglang=False, env={"OMP_NUM_THREADS": "1"}, ready_timeout=120)
    servers = _start_servers(launch, {"a": {**spec, "log_path": str(tmp_path / "a.log")},
                                      "b": {**spec, "log_path": str(tmp_path / "b.log")}})
    try:
        assert sorted(servers) == ["a", "b"] and max(started) - min(started) < 1.0, started
        assert all(ServerClient(s.url).model_info()["weight_version"] for s in servers.values())
    finally:
        for s in servers.values():
            s.stop()
    with pytest.raises(BridgeError) as e:
        _start_servers(launch, {"good": {**spec, "log_path": str(tmp_path / "good.log")},
                                "bad": {**spec, "extra_args": ["--max-lora-rank", "nine"],
                                        "log_path": str(tmp_path / "bad.log")}})
    assert "nine" in str(e.value) or "max-lora-rank" in str(e.value), e.value
    import re

    good_url = re.search(r"Uvicorn running on (http://\S+)", (tmp_path / "good.log").read_text()).group(1)
    with pytest.raises(BridgeError, match="connection refused|cannot reach"):
        ServerClient(good_url, timeout=2).model_info()  # stopped with the bench's error


def test_device_placement_names_what_is_missing():
    """--device cuda on a host without CUDA fails before anything starts, naming the fix; cpu hides GPUs."""
    import torch

    from bench.run import placement
    from bridge.errors import ConfigError

    cpu = placement("cpu", 2)
    assert cpu["device"] == "cpu" and cpu["backend"] is None
    assert cpu["trainer_env"] == cpu["server_env"] == {"CUDA_VISIBLE_DEVICES": ""}
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the error path is for hosts without it")
    assert placement("auto", 2)["device"] == "cpu"
    with pytest.raises(ConfigError, match="no usable CUDA.*--device cpu"):
        placement("cuda", 2)


@pytest.mark.slow
def test_link_bench_on_tiny_runs_the_rows_over_a_shaped_link(tmp_path):
    """--link 200mbit: the servers behind a shaped veth pair in namespaces the bench makes, the link measured
    with plain TCP near the asked rate, the broadcast, delta and disk rows in the table's link section, and
    the namespaces gone afterwards. Root and iproute2 only (skips elsewhere)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("--link needs root and iproute2 (ip, tc)")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "wsync.cli", "bench", "--link", "200mbit", "--link-probe-mb", "8", "--sizes", "tiny",
           "--repeats", "1", "--bucket-mb", "32", "--delta-lrs", "1e-6", "--delta-warmup", "1", "--no-etcd",
           "--json", str(out), "--workdir", str(tmp_path / "work"), "--timeout", "60"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    if proc.returncode != 0 and "`ip netns add" in stderr:
        pytest.skip(f"cannot make network namespaces here: {stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"wsync-bench-{proc.pid}-" not in left, f"namespaces left behind: {left}"

    report = json.loads(out.read_text())
    link = report["meta"]["link"]
    assert link["rate"] == "200mbit" and link["server_addr"].startswith("10.201.")
    # tbf holds one TCP stream near its rate (191 Mbit/s seen at 200mbit); far below it is a link not shaped
    # as asked, far above it no shaping at all.
    assert 100 <= link["measured"]["mbit_s"] <= 220, link
    section = stdout[stdout.index("\nlink: tbf 200mbit"):]
    assert f"measured {link['measured']['mbit_s']:.1f} Mbit/s" in section
    shown = {line.split()[1] if not line.split()[1] == "floor:" else " ".join(line.split()[1:3])
             for line in section.splitlines()[3:] if line.startswith("tiny ")}
    assert {"raw-broadcast", "floor: gather+broadcast", "flat-32MiB", "delta-lr1e-06", "per-tensor", "raw-disk",
            "floor: gather+disk", "disk-dir", "raw-broadcast-fp8", "fp8-32MiB", "fp8+delta-lr1e-06"} <= shown, section
    assert not any(r["kind"] == "colocated" for r in report["rows"])  # /dev/shm does not cross a link
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["delta-lr1e-06"]["bytes"] < rows["flat-32MiB"]["bytes"] == rows["raw-broadcast"]["bytes"]
    assert rows["fp8-32MiB"]["bytes"] == rows["raw-broadcast-fp8"]["bytes"] < rows["flat-32MiB"]["bytes"]
    assert all(r["link"] == "200mbit" for r in rows.values()) and rows["fp8-32MiB"]["encoding"] == "fp8"
    assert all(r["seconds"]["median"] > 0 for r in rows.values())


def test_link_flags_name_what_is_wrong_or_missing(monkeypatch):
    """A bad rate or delay fails as the config is read; without root or iproute2, one line names what is missing."""
    from bench import netns
    from bench.run import BenchConfig
    from bridge.errors import ConfigError

    assert netns.parse_rate("200mbit") == 200e6 and netns.parse_rate("1gbit") == 1e9
    assert netns.parse_delay("1ms") == 1e-3 and netns.parse_delay(None) == 0
    with pytest.raises(ConfigError, match="e.g. 200mbit"):
        BenchConfig(sizes=["tiny"], link="200mb")
    with pytest.raises(ConfigError, match="needs --link"):
        BenchConfig(sizes=["tiny"], link_delay="1ms")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="^--link needs root"):
        netns.require()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    with pytest.raises(ConfigError, match="^--link needs iproute2: tc not on PATH"):
        netns.require()


@pytest.mark.gpu
def test_bench_on_cuda_measures_over_nccl(tmp_path):
    """On a CUDA host: the tiny bench with NCCL gathers, and NCCL to a server on its own GPU when there is one."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gpus = torch.cuda.device_count()
    nproc = 2 if gpus >= 3 else 1
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "wsync.cli", "bench", "--device", "cuda", "--nproc", str(nproc), "--sizes", "tiny",
           "--repeats", "1", "--bucket-mb", "32", "--no-etcd", "--json", str(out), "--workdir", str(tmp_path / "work"),
           "--timeout", "60"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["meta"]["device"] == "cuda" and report["sizes"][0]["device"].startswith("cuda")
    assert report["sizes"][0]["server_backend"] == ("nccl" if gpus >= 2 else "gloo")
    assert {"flat-32MiB", "per-tensor", "colocated-32MiB", "disk-dir"} <= {r["method"] for r in report["rows"]}
    assert all(r["ratio"] > 0 for r in report["rows"] if r["kind"] not in ("floor", "gather"))


def test_recv_raw_route_validates_before_receiving(tiny_model_dir):
    """The route answers 400 without touching a group for a bad body, and names the missing group."""
    import torch
    from fastapi.testclient import TestClient

    from inference_adapter.bench_routes import RECV_RAW_ROUTE, register_bench_routes
    from inference_adapter.model_state import ModelState, load_model
    from inference_adapter.server import create_app

    model, tok, model_path, tok_path = load_model(model=tiny_model_dir, preset=None, seed=0, dtype=torch.bfloat16)
    state = ModelState(model, tok, model_path=model_path, tokenizer_path=tok_path)
    app = create_app(state)
    register_bench_routes(app, state)
    register_bench_routes(app, state)  # idempotent
    from bench import worker

    assert worker.RECV_RAW_ROUTE == RECV_RAW_ROUTE  # the trainer side's copy of the route
    assert sum(getattr(r, "path", None) == RECV_RAW_ROUTE for r in app.routes) == 1
    with TestClient(app) as client:
        for body, words in [({"group_name": "g", "nbytes": 0}, "nbytes"), ({"group_name": "", "nbytes": 8}, "group_name"),
                            ({"group_name": "g", "nbytes": 8, "x": 1}, "unknown"),
                            ({"group_name": "nope", "nbytes": 8}, "init_weights_update_group")]:
            r = client.post(RECV_RAW_ROUTE, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["success"] is False and words in r.json()["message"], r.text


def _fake_size(label: str, nbytes: int, tensors: int = 9) -> dict:
    def runs(*secs, **extra):
        return {"first": {"seconds": 10 * secs[0], "bytes": nbytes, "phases": {"group_init": 1.0}, **extra},
                "runs": [{"seconds": s, "bytes": nbytes, "phases": {}, **extra} for s in secs]}

    bucket = {"peak_extra_bytes": 3 * 2**20, "buckets": 2, "bucket_bytes": 2**20, "largest_bucket_bytes": 2**20,
              "gather_item": "gather-1MiB"}
    items = {
        "raw-gather": runs(1.0, 2.0, 3.0),
        "raw-gather-16MiB": runs(2.0, 1.5, 4.0),  # the floor takes the faster gather of each round: 1, 1.5, 3
        "raw-broadcast": runs(1.0, 1.0, 1.0, server_seconds=0.5),
        "gather-1MiB": runs(1.0, 1.0, 1.0, buckets=2),
        "gather-per-tensor": runs(2.0, 2.0, 2.0, buckets=9),
        "flat-1MiB": runs(3.0, 4.0, 5.0, **bucket),
        "per-tensor": runs(12.0, 12.0, 12.0, **{**bucket, "buckets": 9, "gather_item": "gather-per-tensor"}),
        "raw-disk": runs(2.0, 2.0, 2.0, write_seconds=1.5, read_seconds=0.5),
        "disk-dir": runs(4.0, 4.0, 4.0, **{**bucket, "peak_extra_bytes": 2**20}),
    }
    items["disk-dir"]["runs"] = [{**r, "phases": {"write": 3.0, "load": 1.0}} for r in items["disk-dir"]["runs"]]
    return {"label": label, "params": nbytes // 2, "bytes": nbytes, "tensors": tensors, "items": items}


def test_report_ratios_are_floor_over_method_per_round():
    from bench.report import build_rows, check_targets, format_table

    rows = build_rows([_fake_size("medium", 1000)])
    by = {r["method"]: r for r in rows}
    floor = by["floor: gather+broadcast"]["seconds"]
    assert floor["median"] == 2.5 and (floor["min"], floor["max"]) == (2.0, 4.0)  # summed per round
    assert by["floor: gather+disk write+fsync+read"]["seconds"]["median"] == 3.5  # the gather + the disk floor
    assert "floor: gather+shm write+read" not in by  # no raw-shm measured: no colocated floor
    assert by["floor: gather"]["seconds"]["median"] == 1.5 and by["gather-1MiB"]["ratio"] == pytest.approx(1.5)
    assert by["flat-1MiB"]["ratio"] == pytest.approx(2.5 / 4.0)
    assert by["flat-1MiB"]["ratio_min"] == pytest.approx(2.0 / 3.0)
    assert by["per-tensor"]["ratio"] == pytest.approx(2.5 / 12.0)
    assert by["flat-1MiB"]["speedup_vs_per_tensor"] == pytest.approx(12.0 / 4.0)
    assert by["disk-dir"]["ratio"] == pytest.approx(3.5 / 4.0)
    # Transfer only: the sync minus its own gather, round by round, against the transport's floor alone.
    assert by["flat-1MiB"]["transfer_seconds"]["median"] == pytest.approx(3.0)
    assert by["flat-1MiB"]["transfer_ratio"] == pytest.approx(1.0 / 3.0)
    assert by["per-tensor"]["transfer_seconds"]["median"] == pytest.approx(10.0)
    assert by["flat-1MiB"]["transfer_speedup_vs_per_tensor"] == pytest.approx(10.0 / 3.0)
    assert by["disk-dir"]["transfer_ratio"] == pytest.approx(2.0 / 3.0)
    assert by["flat-1MiB"]["peak_ratio"] == pytest.approx(3.0)
    assert by["flat-1MiB"]["gbps"] == pytest.approx(1000 / 4.0 / 1e9)
    targets = check_targets(rows)
    # flat e2e, flat transfer, many-tensor x2 (no such size), disk e2e, disk transfer, peak (no colocated row)
    assert [t["met"] for t in targets] == [False, False, None, None, True, False, False]
    text = format_table(rows, targets)
    assert "MISSED" in text and "[    MET     ]" in text and "not measured" in text


def test_delta_rows_in_the_report():
    """Delta rows: against the full flattened sync and the broadcast floor of the same run, with the targets."""
    from bench.report import build_rows, check_targets, format_table

    def runs(values, **extra):
        extra = {"bytes": 400, **extra}
        return {"first": {"seconds": values[0], **extra}, "runs": [{"seconds": v, **extra} for v in values]}

    flat = dict(bytes=400, buckets=2, peak_extra_bytes=10, bucket_bytes=2**25, largest_bucket_bytes=200, phases={},
                gather_item="gather-32MiB")
    delta = dict(bytes=20, full_bytes=400, encoding="delta", anchor_reason=None, changed_fraction=0.01, lr=1e-6,
                 peak_extra_bytes=5, bucket_bytes=2**25, base_bytes=200, buckets=2)
    items = {"raw-gather": runs([1.0, 1.0]), "raw-broadcast": runs([0.5, 0.5], server_seconds=0.4),
             "gather-32MiB": runs([1.0, 1.0]),
             "flat-32MiB": runs([2.0, 2.0], **flat), "delta-lr1e-06": runs([0.5, 0.5], **delta),
             "delta-lr1e-05": runs([1.0, 1.0], **{**delta, "lr": 1e-5, "bytes": 80, "changed_fraction": 0.1})}
    rows = build_rows([{"label": "medium", "params": 200, "bytes": 400, "tensors": 3, "items": items}])
    by = {r["method"]: r for r in rows}
    d = by["delta-lr1e-06"]
    assert d["kind"] == "delta" and d["bytes_fraction"] == pytest.approx(0.05) and d["speedup_vs_full"] == pytest.approx(4.0)
    assert d["ratio"] == pytest.approx(1.5 / 0.5) and d["sent"] == ["delta", "delta"]
    targets = [t for t in check_targets(rows) if t["target"].startswith("delta")]
    assert [t["met"] for t in targets] == [True, True]
    assert "delta-lr1e-06: 1.00% of the elements changed" in format_table(rows, check_targets(rows))


def test_fp8_rows_in_the_report():
    """FP8 rows: their bytes against the bf16 bytes, their time against the full bf16 flattened sync and against the
    same FP8 bytes through the same transport (their own floor), transfer only against their own bucket fills; every
    row says what its bytes are and which link they crossed; the target differs on loopback and through a link."""
    from bench.report import build_rows, check_targets, format_link

    def runs(values, **extra):
        extra = {"bytes": 400, **extra}
        return {"first": {"seconds": values[0], **extra}, "runs": [{"seconds": v, **extra} for v in values]}

    flat = dict(bytes=400, buckets=2, peak_extra_bytes=300, bucket_bytes=2**25, largest_bucket_bytes=200, phases={},
                gather_item="gather-32MiB")
    fp8 = {**flat, "bytes": 201, "largest_bucket_bytes": 101, "peak_extra_bytes": 150, "gather_item": "gather-fp8-32MiB",
           "full_bytes": 400, "encoding": "fp8"}
    items = {"raw-gather": runs([1.0, 1.0]), "raw-broadcast": runs([1.0, 1.0], server_seconds=0.4),
             "raw-broadcast-fp8": runs([0.5, 0.5], bytes=201, server_seconds=0.2),
             "gather-32MiB": runs([1.0, 1.0]), "gather-fp8-32MiB": runs([0.6, 0.6], bytes=201),
             "flat-32MiB": runs([2.0, 2.0], **flat), "fp8-32MiB": runs([1.0, 1.0], **fp8),
             "fp8+delta-lr1e-06": runs([0.25, 0.25], bytes=4, full_bytes=400, fp8_bytes=201, encoding="delta",
                                       anchor_reason=None, changed_fraction=0.004, lr=1e-6, peak_extra_bytes=5,
                                       bucket_bytes=2**25, base_bytes=100, buckets=1)}
    size = {"label": "medium", "params": 200, "bytes": 400, "tensors": 3, "items": items, "serving_dtype": "bfloat16"}
    rows = build_rows([size], link="1gbit")
    by = {r["method"]: r for r in rows}
    d = by["fp8+delta-lr1e-06"]  # the FP8 delta: against the bf16 full sync and the FP8 full sync of the same run
    assert d["kind"] == "delta" and d["encoding"] == "fp8+delta" and d["link"] == "1gbit", d
    assert d["bytes_fraction"] == pytest.approx(4 / 400) and d["fp8_bytes_fraction"] == pytest.approx(4 / 201)
    assert d["speedup_vs_full"] == pytest.approx(8.0) and d["speedup_vs_fp8"] == pytest.approx(4.0), d
    f = by["fp8-32MiB"]
    assert f["kind"] == "fp8" and f["encoding"] == "fp8" and f["link"] == "1gbit"
    assert f["bytes_fraction"] == pytest.approx(201 / 400) and f["speedup_vs_full"] == pytest.approx(2.0)
    assert f["floor"] == "floor: gather+broadcast fp8" and f["ratio"] == pytest.approx(1.5 / 1.0)
    assert f["transfer_seconds"]["median"] == pytest.approx(0.4) and f["transfer_ratio"] == pytest.approx(0.5 / 0.4)
    assert by["floor: gather+broadcast fp8"]["bytes"] == 201 and by["floor: gather+broadcast fp8"]["encoding"] == "fp8"
    assert by["flat-32MiB"]["encoding"] == "bfloat16" and by["raw-broadcast"]["link"] == "1gbit"
    assert by["gather-fp8-32MiB"]["encoding"] == "fp8"
    [target] = [t for t in check_targets(rows, "1gbit") if t["target"].startswith("FP8")]
    assert target["met"] is True and "1gbit link" in target["target"], target
    [target] = [t for t in check_targets(rows) if t["target"].startswith("FP8")]
    assert target["met"] is True and "loopback" in target["target"], target
    peak = next(t for t in check_targets(rows) if t["target"].startswith("rank-0 peak"))
    assert "broadcast fp8 worst 1.49x" in peak["measured"], peak
    section = format_link(rows, {"rate": "1gbit", "trainer_addr": "10.201.0.1", "server_addr": "10.201.0.2",
                                 "measured": {"mbit_s": 900.0, "bytes": 8e6, "seconds": 0.07}})
    shown = [line.split()[1] for line in section.splitlines()[3:-1]]
    assert shown.index("flat-32MiB") < shown.index("raw-broadcast-fp8") < shown.index("fp8-32MiB"), section


def test_lora_rows_in_the_report():
    """LoRA rows: the adapter's bytes against the model's and its time against the full flattened sync of the first
    bucket size in the same run; ``encoding: "lora"``; a note line each; the 5 % target on medium at rank 16."""
    from bench.report import build_rows, check_targets, format_table

    def runs(values, **extra):
        extra = {"bytes": 400, **extra}
        return {"first": {"seconds": values[0], **extra}, "runs": [{"seconds": v, **extra} for v in values]}

    flat = dict(bytes=400, buckets=2, peak_extra_bytes=300, bucket_bytes=2**25, largest_bucket_bytes=200, phases={},
                gather_item="gather-32MiB")
    lora = dict(bytes=8, full_bytes=400, lora_rank=16, tensors=28, encoding="lora", phases={"gather": 0.01, "load": 0.02})
    items = {"raw-gather": runs([1.0, 1.0]), "raw-broadcast": runs([1.0, 1.0], server_seconds=0.4),
             "gather-32MiB": runs([1.0, 1.0]), "gather-128MiB": runs([1.0, 1.0]),
             "flat-32MiB": runs([2.0, 2.0], **flat), "flat-128MiB": runs([4.0, 4.0], **flat),
             "lora-tensors": runs([0.05, 0.07], **lora), "lora-disk": runs([0.2, 0.2], **lora)}
    size = {"label": "medium", "params": 200, "bytes": 400, "tensors": 3, "items": items, "serving_dtype": "bfloat16"}
    rows = build_rows([size])
    by = {r["method"]: r for r in rows}
    t = by["lora-tensors"]
    assert t["kind"] == "lora" and t["encoding"] == "lora" and t["full_method"] == "flat-32MiB", t
    assert t["bytes_fraction"] == pytest.approx(8 / 400) and t["fraction_of_full"] == pytest.approx(0.06 / 2.0)
    assert t["phases"] == {"gather": 0.01, "load": 0.02} and by["lora-disk"]["fraction_of_full"] == pytest.approx(0.1)
    [target] = [x for x in check_targets(rows) if x["target"].startswith("LoRA")]
    assert target["met"] is False and "lora-disk 0.200 s, 10.0%" in target["measured"], target
    table = format_table(rows, check_targets(rows))
    assert "medium lora-tensors: adapter of rank 16 (28 tensors)" in table and "3.0% of flat-32MiB" in table, table
    items["lora-disk"] = runs([0.09, 0.09], **lora)
    [target] = [x for x in check_targets(build_rows([size])) if x["target"].startswith("LoRA")]
    assert target["met"] is True, target


def test_servers_growth_rows_for_each_count_and_method(tmp_path):
    """``wsync bench --servers 1 2``: a row per count and method, each with the JSON fields the growth plot and
    docs/fleet.md read; a count below 1 is refused before anything starts."""
    from bench.growth import check_counts
    from bridge.errors import ConfigError

    out = tmp_path / "growth.json"
    cmd = [sys.executable, "-m", "wsync", "bench", "--servers", "2", "1", "--sizes", "tiny", "--repeats", "1",
           "--json", str(out), "--workdir", str(tmp_path / "work"), "--timeout", "60"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["servers"], r["method"]) for r in rows] == [(1, "broadcast"), (1, "disk"), (2, "broadcast"), (2, "disk")]
    assert all(r["seconds"] > 0 and r["bytes"] > 0 and len(r["times"]) == 1 for r in rows), rows
    with pytest.raises(ConfigError, match="at least 1"):
        check_counts([0, 2])
