"""The disk watcher: real snapshots, real name resolution (memory, directory, etcd), a callable ``apply``."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import pytest
import torch

from bridge.name_resolve import Announcement, make_name_resolve, names
from bridge.snapshot import read_snapshot, write_snapshot
from inference_adapter.watcher import DiskWatcher
from wsync.cli import main as wsync


@pytest.fixture(params=["memory", "file", "etcd"])
def nr(request, tmp_path):
    if request.param == "memory":
        url = f"memory://watch-{uuid.uuid4().hex}"
    elif request.param == "file":
        url = f"file://{tmp_path}/nr"
    else:
        url = request.getfixturevalue("etcd_server").url
    r = make_name_resolve(url)
    yield r
    r.close()


@pytest.fixture
def trial():
    return f"trial-{uuid.uuid4().hex[:8]}"


class Loader:
    """The ``apply`` callable: loads each snapshot for real and keeps what it loaded."""

    def __init__(self):
        self.loaded: list[tuple[int, dict]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail_next = False

    def __call__(self, path: str, version: int) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("server busy")
        self.loaded.append((version, read_snapshot(path)))

    @property
    def versions(self) -> list[int]:
        return [v for v, _ in self.loaded]


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed.weight": torch.randn(16, 8, generator=g), "norm.weight": torch.randn(8, generator=g)}


def _publish(nr, root, trial, version, *, corrupt=False, replace=False) -> Announcement:
    info = write_snapshot(root, version, _weights(version).items(), dtype="bf16")
    if corrupt:
        path = os.path.join(info.path, "model.safetensors")
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\xff\xff\xff")
    ann = Announcement.from_snapshot(info)
    nr.add(names.update_weights_from_disk("exp", trial, version), ann.to_json(), replace=replace)
    return ann


def _until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_versions_load_in_order_and_never_go_backwards(nr, trial, tmp_path):
    loader = Loader()
    seen = []
    w = DiskWatcher(nr, "exp", trial, loader, on_loaded=seen.append)
    w.start()
    try:
        for v in (1, 2, 3):
            _publish(nr, tmp_path / "snaps", trial, v)
            assert w.wait_for_version(v, timeout=30)
        assert loader.versions == [1, 2, 3] and [a.version for a in seen] == [1, 2, 3]
        for v, tensors in loader.loaded:  # what was loaded is bit-equal to what was published
            assert all(torch.equal(tensors[k], t.bfloat16()) for k, t in _weights(v).items())
        # Duplicates and an out-of-order announcement are ignored...
        for v in (2, 3):
            key = names.update_weights_from_disk("exp", trial, v)
            nr.add(key, nr.get(key), replace=True)
        _publish(nr, tmp_path / "snaps", trial, 4)
        assert w.wait_for_version(4, timeout=30)
        assert loader.versions == [1, 2, 3, 4]  # ...and the next version still loads
        assert w.status() == {"apply": 4} and w.latest_version == 4
        assert len(w.latencies) == 4 and w.median_latency is not None and w.median_latency >= 0
    finally:
        w.stop()


def test_catch_up_loads_only_the_newest(nr, trial, tmp_path):
    for v in (3, 1, 10, 2):  # numeric order, not string order: 10 > 3
        _publish(nr, tmp_path / "snaps", trial, v)
    loader = Loader()
    w = DiskWatcher(nr, "exp", trial, loader)
    assert w.catch_up() == 10 and loader.versions == [10]
    assert w.catch_up() == 10 and loader.versions == [10]  # idempotent
    w.start()  # existing announcements are delivered again by the watch and ignored
    try:
        _publish(nr, tmp_path / "snaps", trial, 11)
        assert w.wait_for_version(11, timeout=30)
        assert loader.versions == [10, 11]
    finally:
        w.stop()


@pytest.mark.parametrize("corrupt, loaded", [(None, 4), (4, 3)], ids=["all-intact", "newest-corrupt"])
def test_a_burst_loads_only_the_newest_intact(nr, trial, tmp_path, caplog, corrupt, loaded):
    caplog.set_level(logging.ERROR, logger="inference_adapter.watcher")
    loader = Loader()
    loader.gate = threading.Event()
    w = DiskWatcher(nr, "exp", trial, loader)
    w.start()
    try:
        _publish(nr, tmp_path / "snaps", trial, 1)
        assert loader.entered.wait(30)  # version 1 is loading (held at the gate)
        for v in (2, 3, 4):
            _publish(nr, tmp_path / "snaps", trial, v, corrupt=v == corrupt)
        assert _until(lambda: sorted(w._pending) == [2, 3, 4])
        loader.gate.set()
        assert w.wait_for_version(loaded, timeout=30)
        assert loader.versions == [1, loaded]  # a corrupt newest falls back to the newest intact one
        assert any(f"refusing version {corrupt}" in r.message for r in caplog.records) == (corrupt is not None)
    finally:
        loader.gate.set()
        w.stop()


def test_corrupt_snapshot_is_refused_and_old_version_kept(nr, trial, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="inference_adapter.watcher")
    loader = Loader()
    w = DiskWatcher(nr, "exp", trial, loader)
    _publish(nr, tmp_path / "snaps", trial, 1)
    assert w.catch_up() == 1
    _publish(nr, tmp_path / "snaps", trial, 2, corrupt=True)
    assert w.catch_up() == 1 and w.status() == {"apply": 1} and loader.versions == [1]
    assert any("refusing version 2" in r.message and "model.safetensors" in r.message for r in caplog.records)
    w.start()
    try:
        # A stale announcement (its manifest digest does not match the directory) is refused too.
        info3 = write_snapshot(tmp_path / "snaps", 3, _weights(3).items())
        bad = Announcement(3, info3.path, "0" * 64, info3.total_bytes, time.time())
        nr.add(names.update_weights_from_disk("exp", trial, 3), bad.to_json())
        assert _until(lambda: any("refusing version 3" in r.message for r in caplog.records))
        assert w.status() == {"apply": 1}
        _publish(nr, tmp_path / "snaps", trial, 4)
        assert w.wait_for_version(4, timeout=30) and loader.versions == [1, 4]
    finally:
        w.stop()


def test_failed_load_is_retried_on_reannouncement_and_bad_values_ignored(nr, trial, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="inference_adapter.watcher")
    loader = Loader()
    loader.fail_next = True
    w = DiskWatcher(nr, "exp", trial, loader)
    w.start()
    try:
        nr.add(names.update_weights_from_disk("exp", trial, 7), "{not json")
        assert _until(lambda: any("ignoring the announcement" in r.message for r in caplog.records))
        ann = _publish(nr, tmp_path / "snaps", trial, 1)
        assert _until(lambda: any("failed to load version 1" in r.message for r in caplog.records))
        assert w.status() == {"apply": None} and w.latest_version is None
        nr.add(names.update_weights_from_disk("exp", trial, 1), ann.to_json(), replace=True)  # the same, again
        assert w.wait_for_version(1, timeout=30) and loader.versions == [1]
    finally:
        w.stop()


def test_server_group_failures_are_reported_per_server(tmp_path, trial, caplog):
    from bridge.client import ServerGroup

    caplog.set_level(logging.ERROR, logger="inference_adapter.watcher")
    nr = make_name_resolve(f"memory://watch-{uuid.uuid4().hex}")
    group = ServerGroup(["http://127.0.0.1:9", "http://127.0.0.1:10"], timeout=5)  # nothing listens there
    w = DiskWatcher(nr, "exp", trial, group)
    _publish(nr, tmp_path / "snaps", trial, 1)
    assert w.catch_up() is None
    assert w.status() == {c.url: None for c in group.clients}
    for c in group.clients:
        assert any(r.message.startswith(f"{c.url} failed to load version 1") for r in caplog.records)
    nr.close()


def test_cli_once(tmp_path, trial, capsys):
    url = f"file://{tmp_path}/nr"
    assert wsync(["watch", "--name-resolve", url, "--experiment", "exp", "--trial", trial, "--server",
                  "http://127.0.0.1:9", "--once", "--timeout", "5"]) != 0
    assert "no version announced yet" in capsys.readouterr().err
    assert wsync(["watch", "--experiment", "exp"]) != 0  # no --server, no --server-registry
    assert "--server URL (repeat) or --server-registry URL" in capsys.readouterr().err


def test_a_corrupt_newest_snapshot_falls_back_to_the_newest_intact_one(trial, tmp_path, caplog):
    """Catching up: versions 1 and 2 intact, 3 corrupt -> version 2 is loaded and 3 reported."""
    caplog.set_level(logging.ERROR, logger="inference_adapter.watcher")
    nr = make_name_resolve(f"memory://watch-{uuid.uuid4().hex}")
    for v in (1, 2):
        _publish(nr, tmp_path / "snaps", trial, v)
    _publish(nr, tmp_path / "snaps", trial, 3, corrupt=True)
    loader = Loader()
    w = DiskWatcher(nr, "exp", trial, loader)
    try:
        assert w.catch_up() == 2 and loader.versions == [2]
        assert any("refusing version 3" in r.message for r in caplog.records)
    finally:
        w.stop()
        nr.close()
