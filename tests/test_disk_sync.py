"""Disk sync end to end: a 2-rank trainer writes snapshots and announces them (real etcd, or the
directory backend); a watcher loads each into a real reference server; the served tensors must equal
the trainer's, bit for bit, at every version."""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import time

import pytest

from tests import sync_bodies as sb
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.slow


def _publish_versions(url: str, nr_url: str, root: str, versions: list[int], handshake: str | None = None):
    from bridge import PublisherConfig, WeightPublisher
    from wsync.tasks import make_batch

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(
        transport="disk", servers=[url], name_resolve=nr_url, snapshot_root=root, experiment="e2e",
        trial="t0", keep_snapshots=2, wait_loaded_timeout=60, progress=False,
    ))
    reports = []
    try:
        for i, v in enumerate(versions):
            if handshake and i == 1:
                # Let the test restart etcd between two publishes, while this trainer keeps running.
                if engine.rank == 0:
                    open(handshake + ".ready", "w").close()
                    while not os.path.exists(handshake + ".go"):
                        time.sleep(0.05)
            engine.train_batch(make_batch(engine.tokenizer, 8, seed=v * 13 + engine.rank))
            res = pub.publish(engine, version=v)
            reports.append((res.version, res.path, res.servers, sb.check_served(engine, [url], v), res.phases))
    finally:
        pub.close()
        engine.destroy()
    return reports


def _run(url, nr_url, root, versions, handshake=None, during=None):
    from bridge.client import ServerGroup
    from inference_adapter.watcher import DiskWatcher

    watcher = DiskWatcher(nr_url, "e2e", "t0", ServerGroup([url]))
    watcher.start()
    try:
        if during is None:
            rank0, rank1 = run_ranks(_publish_versions, 2, args=(url, nr_url, root, versions, handshake), timeout=300)
            # The same result on every rank, the transport's own phases too (rank 0's commit outcome).
            assert [r[4] for r in rank0] == [r[4] for r in rank1] and {"write", "announce", "load"} <= set(rank0[0][4])
        else:
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(run_ranks, _publish_versions, 2, (url, nr_url, root, versions, handshake), None, 300)
                during()
                rank0, _ = fut.result()
        return rank0, watcher
    finally:
        watcher.stop()


def _assert_loaded(rank0, url, versions, watcher):
    assert [r[0] for r in rank0] == versions
    for version, path, servers, checks, _ in rank0:
        assert servers == {url: "ok"}
        assert os.path.basename(path) == f"v{version}"
        c = checks[url]
        assert c["tensors_equal"] and c["answer_equal"], f"v{version}: served weights differ from the trainer's"
        assert c["version"] == c["generate_version"] == str(version)
    assert watcher.status() == {url: versions[-1]}
    assert len(watcher.latencies) >= 1
    print(f"announcement -> first load request latency: median {statistics.median(watcher.latencies) * 1e3:.1f} ms "
          f"over {len(watcher.latencies)} versions")


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory.many([dict(model=tiny_model_dir)])[0]


def test_disk_sync_on_directory_backend(server, tmp_path):
    nr_url = f"file://{tmp_path / 'nr'}"
    rank0, watcher = _run(server.url, nr_url, str(tmp_path / "snap"), [1, 2, 3])
    _assert_loaded(rank0, server.url, [1, 2, 3], watcher)
    assert sorted(os.listdir(tmp_path / "snap")) == ["name_resolve", "v2", "v3"] or sorted(
        d for d in os.listdir(tmp_path / "snap") if d.startswith("v")) == ["v2", "v3"]  # keep_snapshots=2


def test_disk_sync_on_etcd_survives_an_etcd_restart(server, etcd_server, tmp_path):
    """docs/guarantees.md: "an etcd restart between publishes loses nothing": the announcement of v10, made before the
    restart, reads back the same after it (from a client that connects after the restart), and the
    trainer and watcher go on with v11 and v12 (whose publish collects v10, announcement included)."""
    from bridge.name_resolve import Announcement, make_name_resolve, names

    etcd = etcd_server
    handshake = str(tmp_path / "hs")
    key10 = names.update_weights_from_disk("e2e", "t0", 10)
    read: dict[str, str] = {}

    def read_key(when: str) -> None:
        with make_name_resolve(etcd.url) as nr:  # a new client each time: what etcd itself holds
            read[when] = nr.get(key10)

    def restart_between_publishes():
        deadline = time.monotonic() + 200
        while not os.path.exists(handshake + ".ready"):
            assert time.monotonic() < deadline, "trainer never reached the restart point"
            time.sleep(0.05)
        try:
            read_key("before")
            etcd.restart()
            read_key("after")
        finally:
            open(handshake + ".go", "w").close()  # the trainer goes on (and the test fails) whatever was read

    rank0, watcher = _run(server.url, etcd.url, str(tmp_path / "snap"), [10, 11, 12], handshake, restart_between_publishes)
    _assert_loaded(rank0, server.url, [10, 11, 12], watcher)
    assert read["after"] == read["before"], read
    ann = Announcement.from_json(read["after"])
    assert ann.version == 10 and ann.path == rank0[0][1], (ann, rank0[0][1])
    with make_name_resolve(etcd.url) as nr:
        versions = sorted(names.version_of(k) for k in nr.find_subtree(names.update_weights_from_disk_root("e2e", "t0")))
    # keep_snapshots=2: v12's publish collected v10's snapshot, and withdrew its announcement with it.
    assert versions == [11, 12], versions


def test_corrupt_snapshot_after_announcement_is_refused(server, tmp_path, caplog):
    """The reference server verifies a snapshot in the pass that reads it, so the watcher does not read it
    first: the fall-back to the newest intact version rests on the server's verdict."""
    from bridge.client import ServerGroup
    from bridge.errors import ServerError
    from bridge.name_resolve import Announcement, make_name_resolve, names
    from bridge.protocol import SNAPSHOT_INVALID
    from bridge.snapshot import read_manifest, snapshot_dir
    from inference_adapter.watcher import DiskWatcher

    caplog.set_level(logging.ERROR, logger="inference_adapter.watcher")

    nr_url = f"file://{tmp_path / 'nr'}"
    root = str(tmp_path / "snap")
    rank0, _ = _run(server.url, nr_url, root, [20])
    assert rank0[0][2] == {server.url: "ok"}
    # Publish v21 with nobody watching, then damage it on disk before any server loads it.
    from bridge import PublisherConfig  # noqa: F401  (import check for the body below)

    run_ranks(_publish_unwatched, 2, args=(nr_url, root, 21), timeout=200)
    shard = next(f for f in os.listdir(snapshot_dir(root, 21)) if f.endswith(".safetensors"))
    path = os.path.join(snapshot_dir(root, 21), shard)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00corrupt\x00")
    watcher = DiskWatcher(nr_url, "e2e", "t0", ServerGroup([server.url]))
    try:
        watcher.catch_up()
        # v21 is refused by the server; the watcher falls back to the newest intact announced version.
        assert watcher.status() == {server.url: 20}
        assert any(f"refusing version 21: {server.url} found:" in r.message and shard in r.message
                   for r in caplog.records), [r.message for r in caplog.records]
        # An announcement whose manifest digest is not the directory's (stale, or rewritten): refused too.
        nr = make_name_resolve(nr_url)
        v20 = snapshot_dir(root, 20)
        stale = Announcement(22, v20, "0" * 64, read_manifest(v20)["total_bytes"], time.time())
        nr.add(names.update_weights_from_disk("e2e", "t0", 22), stale.to_json())
        nr.close()
        watcher.catch_up()
        assert watcher.status() == {server.url: 20}
        assert any("refusing version 22" in r.message and "announcement says" in r.message for r in caplog.records)
    finally:
        watcher.stop()
    group = ServerGroup([server.url])
    assert group.weight_versions() == {server.url: "20"}
    # Asked directly, the server refuses too, names the file and why, and keeps version 20.
    with pytest.raises(ServerError, match=shard) as e:
        group.clients[0].update_weights_from_disk(snapshot_dir(root, 21), weight_version="21")
    assert e.value.reason == SNAPSHOT_INVALID
    assert group.weight_versions() == {server.url: "20"}


def _publish_unwatched(nr_url, root, version):
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="e2e",
                                          trial="t0", progress=False))
    try:
        return pub.publish(engine, version=version).path
    finally:
        pub.close()
        engine.destroy()


def _publish_expect_failure(nr_url, root):
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError
    from bridge.name_resolve import make_name_resolve, names

    engine = sb.engine("small")
    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="full",
                                          trial="t0", progress=False))
    try:
        pub.publish(engine, version=1)
        outcome = "published"
    except BridgeError as e:
        outcome = str(e)
    finally:
        pub.close()
        engine.destroy()
    announced = make_name_resolve(nr_url).find_subtree(names.update_weights_from_disk_root("full", "t0"))
    return outcome, announced, sorted(os.listdir(root))


def test_disk_full_during_write_announces_nothing(tmp_path):
    mnt = tmp_path / "tiny-disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the snapshot tests inject ENOSPC instead")
    try:
        nr_url = f"file://{tmp_path / 'nr'}"
        (outcome, announced, left), _ = run_ranks(_publish_expect_failure, 2, args=(nr_url, str(mnt)), timeout=200)
        assert "No space left" in outcome or "ENOSPC" in outcome or "space" in outcome, outcome
        assert announced == []
        assert [d for d in left if d.startswith("v") or d.startswith(".tmp")] == []
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# ------------------------------------------------------------------ every rank writes its share


def _io_write_bytes() -> int:
    """Bytes this process (all its threads) caused to be written to storage, as the kernel counts them."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no write_bytes in /proc/self/io")


def _publish_measuring_writes(url: str, nr_url: str, root: str, runs: list[tuple[int, str]]):
    """Every rank: for each (version, disk_writers), train a step and publish with a new publisher that
    waits for ``url`` to load the version; what this process wrote to storage during the publish (read
    from the kernel, not from the publisher) and, on rank 0, what the server serves."""
    import sys

    from bridge import PublisherConfig, WeightPublisher
    from wsync.tasks import make_batch

    sys.dont_write_bytecode = True  # a module imported during a publish must not count as its writes
    engine = sb.engine()
    out = []
    try:
        for version, writers in runs:
            engine.train_batch(make_batch(engine.tokenizer, 8, seed=version * 7 + engine.rank))
            pub = WeightPublisher(PublisherConfig(
                transport="disk", servers=[url], name_resolve=nr_url, snapshot_root=root, experiment="e2e",
                trial="writers", bucket_mb=0.05, disk_writers=writers, wait_loaded_timeout=60, progress=False,
            ))
            try:
                before = _io_write_bytes()
                res = pub.publish(engine, version=version)
                wrote = _io_write_bytes() - before
            finally:
                pub.close()
            out.append(dict(version=version, writers=writers, bytes=res.bytes, buckets=res.buckets, path=res.path,
                            servers=res.servers, wrote=wrote, check=sb.check_served(engine, [url], version)))
    finally:
        engine.destroy()
    return out


def test_every_rank_writes_its_share_of_the_snapshot(server, tmp_path):
    """disk_writers="all" (the default): each bucket's shard is gathered to and written by its owner
    rank, so rank 1 writes about half the bytes itself; the snapshot has the same files, index and
    tensor placement as the rank-0 writer's, and loads bit-exact into a server."""
    from bridge.client import ServerGroup
    from bridge.snapshot import read_manifest, verify_snapshot
    from inference_adapter.watcher import DiskWatcher

    nr_url = f"file://{tmp_path / 'nr'}"
    watcher = DiskWatcher(nr_url, "e2e", "writers", ServerGroup([server.url]))
    watcher.start()
    try:
        rank0, rank1 = run_ranks(_publish_measuring_writes, 2, timeout=300,
                                 args=(server.url, nr_url, str(tmp_path / "snap"), [(1, "rank0"), (2, "all")]))
    finally:
        watcher.stop()
    placement, wrote = {}, {}
    for r0, r1 in zip(rank0, rank1):
        total, mode = r0["bytes"], r0["writers"]
        shares = f"{mode}: rank 0 wrote {r0['wrote']} B, rank 1 {r1['wrote']} B of a {total} B snapshot"
        print(shares)
        assert r0["buckets"] >= 8, "the test needs many buckets"
        assert r0["servers"] == {server.url: "ok"}
        c = r0["check"][server.url]
        assert c["tensors_equal"] and c["answer_equal"] and c["version"] == str(r0["version"]), mode
        verify_snapshot(r0["path"])
        manifest = read_manifest(r0["path"])
        placement[mode] = ({n: e["file"] for n, e in manifest["tensors"].items()}, sorted(manifest["files"]))
        wrote[mode] = r0["wrote"], r1["wrote"]
        if mode == "all":
            assert r1["wrote"] >= 0.35 * total, shares  # about half the shards (odd buckets)
        else:
            assert r1["wrote"] <= 0.05 * total and r0["wrote"] >= 0.9 * total, shares
    # Rank 0 was relieved of what rank 1 wrote (less its own small files: manifest, index, announcement).
    assert wrote["all"][0] <= wrote["rank0"][0] - 0.8 * wrote["all"][1], wrote
    assert placement["all"] == placement["rank0"], "per-rank writers changed the snapshot's layout"
    assert any(f.startswith("model-00001-of-") for f in placement["all"][1])


def _fail_while_rank1_writes(nr_url: str, root: str):
    """Every rank: publish v1; then v2 with rank 1 failing inside its write of bucket 1's shard (after the
    file was created); then v2 again. What each rank raised, when it raised and (rank 1) when the fault
    fired (``time.monotonic()``, one clock for every process of the host), and (rank 0) what was
    announced and left behind right after the failure."""
    import bridge.transports.shard_writer as disk_transport
    from bridge import PublisherConfig, WeightPublisher
    from bridge.failpoints import ENV
    from bridge.name_resolve import make_name_resolve, names

    engine = sb.engine()
    fired: list[float] = []  # when the real failpoint raised, in the writer thread
    real_failpoint = disk_transport.failpoint

    def timed_failpoint(name: str, rank: int) -> None:
        try:
            real_failpoint(name, rank)
        except BaseException:
            fired.append(time.monotonic())
            raise

    disk_transport.failpoint = timed_failpoint

    def announced():
        keys = make_name_resolve(nr_url).find_subtree(names.update_weights_from_disk_root("e2e", "fault"))
        return sorted(names.version_of(k) for k in keys)

    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="e2e",
                                          trial="fault", bucket_mb=0.05, group_timeout=20, http_timeout=20,
                                          progress=False))
    try:
        pub.publish(engine, version=1)
        from wsync.tasks import make_batch

        engine.train_batch(make_batch(engine.tokenizer, 8, seed=5 + engine.rank))
        os.environ[ENV] = "write:1@1=OSError"
        try:
            pub.publish(engine, version=2)
            got = ("no error", "")
        except Exception as e:  # the test records whatever comes
            got = (type(e).__name__, str(e))
        finally:
            raised = time.monotonic()
            del os.environ[ENV]
        after = (announced(), sorted(os.listdir(root))) if engine.rank == 0 else None
        pub.publish(engine, version=2)  # the trainer goes on
        final = announced() if engine.rank == 0 else None
        return got, (raised, fired), after, final
    finally:
        pub.close()
        engine.destroy()


def test_a_failed_write_on_rank_1_fails_every_rank_and_announces_nothing(tmp_path):
    root = str(tmp_path / "snap")
    r0, r1 = run_ranks(_fail_while_rank1_writes, 2, args=(f"file://{tmp_path / 'nr'}", root), timeout=300)
    (got0, (raised0, fired0), after, final), (got1, (raised1, fired1), _, _) = r0, r1
    assert fired0 == [] and len(fired1) == 1, (fired0, fired1)
    s0, s1 = raised0 - fired1[0], raised1 - fired1[0]  # from the fault to each rank's raise (one host clock)
    print(f"every rank raised, {s0:.3f} s / {s1:.3f} s after the fault: {got0[0]}: {got0[1]}")
    assert got0 == got1, f"the ranks raised different errors: {got0} vs {got1}"
    assert got0[0] == "SnapshotError" and "rank 1" in got0[1] and "OSError" in got0[1] and "injected fault at write:1" in got0[1], got0
    # docs/guarantees.md: "within 1 s of the fault". Measured 0.02-0.07 s on a 2-core machine at load 4-5 and up to
    # 0.14 s with two CPU hogs besides (load 8), where 0.1 s failed: 1 s is about 7x the worst seen. (Rank 1 notices the failed background
    # write when it next waits for it, at bucket 3, its next bucket; then every rank aborts and raises.)
    assert 0 <= max(s0, s1) < 1.0, f"rank 0 raised {s0:.3f} s and rank 1 {s1:.3f} s after the fault"
    versions, left = after
    assert versions == [1], f"announced {versions}"
    assert [d for d in left if d.startswith(".tmp")] == [] and "v2" not in left, left
    assert final == [1, 2]


def test_disk_writers_setting_is_checked():
    from bridge import PublisherConfig
    from bridge.errors import ConfigError

    assert PublisherConfig(transport="disk").disk_writers == "all"
    with pytest.raises(ConfigError, match="disk_writers must be all or rank0"):
        PublisherConfig(transport="disk", disk_writers="rank1")


# ------------------------------------------------------------------ a failed announce, and what gc leaves


def _publish_trained(nr_url: str, root: str, version: int, seed: int):
    """Every rank: train one step (``seed`` makes the weights), publish ``version`` (no server waited for);
    (error class or "ok", message, this rank's own checksums after the step on rank 0)."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError

    engine = sb.engine()
    sb.train_step(engine, seed)
    own = sb.own_checksums(engine)
    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="ann",
                                          trial="t0", progress=False))
    try:
        pub.publish(engine, version=version)
        outcome = ("ok", "")
    except BridgeError as e:
        outcome = (type(e).__name__, str(e))
    finally:
        pub.close()
        engine.destroy()
    return (*outcome, own)


def test_a_version_whose_announce_failed_can_be_published_again(etcd_server, tmp_path, monkeypatch):
    """etcd killed in the announce step (after the rename) and kept down: every rank raises
    NameResolveError and the final directory is gone with the announce; with etcd back, a fresh trainer
    with other weights publishes the same version (before: VersionError, "already published")."""
    from bridge.digest import tensor_checksum
    from bridge.name_resolve import Announcement, make_name_resolve, names
    from bridge.snapshot import read_snapshot, snapshot_dir

    etcd, root = etcd_server, str(tmp_path / "snap")
    nr_url = f"{etcd.url}?retry_deadline=3"
    monkeypatch.setenv("WSYNC_FAILPOINTS", "announce@0=sleep:2")  # rank 0 waits there, renamed, not announced
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool:
        first = pool.submit(run_ranks, _publish_trained, 2, (nr_url, root, 2, 1), None, 200)
        deadline = time.monotonic() + 150
        while not os.path.isdir(snapshot_dir(root, 2)):
            assert time.monotonic() < deadline and not first.done(), "the publish never reached the announce"
            time.sleep(0.02)
        etcd.proc.kill()  # killed, not stopped
        etcd.proc.wait()
        etcd.proc = None
        try:
            r0, r1 = first.result()
        finally:
            etcd.start()
    assert r0[0] == r1[0] == "NameResolveError" and r0[1] == r1[1], (r0, r1)
    assert not [d for d in os.listdir(root) if d.startswith(("v", ".tmp"))], os.listdir(root)
    monkeypatch.delenv("WSYNC_FAILPOINTS")
    r0, _ = run_ranks(_publish_trained, 2, args=(etcd.url, root, 2, 2), timeout=200)
    assert r0[0] == "ok", r0
    with make_name_resolve(etcd.url) as nr:
        ann = Announcement.from_json(nr.get(names.update_weights_from_disk("ann", "t0", 2)))
    assert ann.path == snapshot_dir(root, 2)
    served = {n: tensor_checksum(t) for n, t in read_snapshot(ann.path, expected_manifest_sha256=ann.manifest_sha256).items()}
    # Every tensor the second trainer has, under its own name and with its bytes (comparing only the names
    # both have passed when none did).
    assert served == r0[2], (sorted(set(served) ^ set(r0[2])), [n for n in served if served[n] != r0[2].get(n)])


def test_garbage_collection_removes_the_announcements_of_the_snapshots_it_removes(tmp_path):
    """50 versions with keep_snapshots=3: 3 snapshots and 3 announcements remain, the newest ones."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.name_resolve import make_name_resolve, names
    from bridge.snapshot import list_snapshots
    from tests.fixtures_server import local_model, random_weights

    nr_url, root = f"file://{tmp_path / 'nr'}", str(tmp_path / "snap")
    model = local_model(random_weights(seed=3))
    cfg = PublisherConfig(transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="gc", trial="t0",
                          keep_snapshots=3, progress=False)
    with WeightPublisher(cfg) as pub:
        for v in range(1, 51):
            pub.publish(model, version=v)
    with make_name_resolve(nr_url) as nr:
        announced = sorted(names.version_of(k) for k in nr.find_subtree(names.update_weights_from_disk_root("gc", "t0")))
    assert list_snapshots(root) == [48, 49, 50]
    assert announced == [48, 49, 50], announced


# ------------------------------------------------------------------ a version nobody loads fails at once


def _publish_timed(url: str, nr_url: str, root: str, trial: str, preset: str):
    """Publish version 1 of ``preset`` with a long wait_loaded_timeout; (seconds, error or None, announced)."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError
    from bridge.name_resolve import make_name_resolve, names

    engine = sb.engine(preset)
    pub = WeightPublisher(PublisherConfig(transport="disk", servers=[url], name_resolve=nr_url, snapshot_root=root,
                                          experiment="e2e", trial=trial, wait_loaded_timeout=120, progress=False))
    t0 = time.monotonic()
    try:
        pub.publish(engine, version=1)
        error = None
    except BridgeError as e:
        error = str(e)
    finally:
        seconds = time.monotonic() - t0
        pub.close()
        engine.destroy()
    with make_name_resolve(nr_url) as nr:
        announced = nr.find_subtree(names.update_weights_from_disk_root("e2e", trial))
    return seconds, error, announced


def test_a_version_no_server_can_load_fails_at_once_with_the_watchers_reason_and_is_withdrawn(server, server_factory,
                                                                                             tmp_path):
    """The watcher's server cannot take the snapshot: it serves the tiny preset, the trainer trains the small one.
    (The publisher checks the servers it lists before anything moves; the watcher loads into its own, as real
    SGLang's, which list no parameters to check.) The watcher's reason, the shapes, reaches the publisher at once,
    not after wait_loaded_timeout=120 s, and the version is not left announced."""
    from bridge.client import ServerGroup
    from inference_adapter.watcher import DiskWatcher

    small = server_factory(preset="small")  # what the publisher lists and waits for; only the watcher loads
    nr_url, root = f"file://{tmp_path / 'nr'}", str(tmp_path / "snap")
    group = ServerGroup([server.url, small.url])
    before = group.weight_versions()
    watcher = DiskWatcher(nr_url, "e2e", "mismatch", ServerGroup([server.url]))
    watcher.start()
    try:
        (seconds, error, announced), = run_ranks(_publish_timed, 1, args=(small.url, nr_url, root, "mismatch", "small"),
                                                 timeout=200)
    finally:
        watcher.stop()
    assert error is not None and "no server could load version 1" in error and "shape" in error, error
    assert server.url in error and "withdrawn" in error and seconds < 10, (seconds, error)
    assert announced == []
    assert not [d for d in os.listdir(root) if d.startswith("v")]
    assert group.weight_versions() == before


def test_no_watcher_for_the_trial_fails_at_once_naming_wsync_watch(server, tmp_path):
    nr_url, root = f"file://{tmp_path / 'nr'}", str(tmp_path / "snap")
    (seconds, error, announced), = run_ranks(_publish_timed, 1, args=(server.url, nr_url, root, "nowatcher", "tiny"),
                                             timeout=200)
    assert error is not None and "no watcher" in error, error
    assert "wsync watch" in error and "--experiment e2e --trial nowatcher" in error, error
    assert "\n" not in error and seconds < 15, (seconds, error)  # NO_WATCHER_GRACE_S = 5 s, plus the write
    assert announced == []


# ------------------------------------------------------------------ a run never loads another run's snapshot


def _publish_run(url: str | None, nr_url: str, root: str, version: int):
    """One run of experiment e2e, trial reuse: publish ``version`` (waiting for ``url`` to load it, if given)."""
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(transport="disk", servers=[url] if url else [], name_resolve=nr_url,
                                          snapshot_root=root, experiment="e2e", trial="reuse", new_run=True,
                                          wait_loaded_timeout=60, progress=False))
    try:
        res = pub.publish(engine, version=version)
        return res.version, res.servers
    finally:
        pub.close()
        engine.destroy()


def test_a_watcher_never_loads_the_snapshot_of_an_earlier_run_of_the_same_trial(server, tmp_path, caplog, monkeypatch):
    """Run B published version 5 of e2e/reuse and ended; run A starts a new run with the same names
    (new_run=True). A watcher started once A runs ignores B's version (logged once), though its server is
    behind it, and loads A's version 6."""
    import concurrent.futures as cf
    import json

    from bridge.client import ServerGroup
    from bridge.name_resolve import make_name_resolve, names
    from inference_adapter.watcher import DiskWatcher

    nr_url = f"file://{tmp_path / 'nr'}"
    run_ranks(_publish_run, 1, args=(None, nr_url, str(tmp_path / "b"), 5), timeout=200)
    nr = make_name_resolve(nr_url)
    run_b = json.loads(nr.get(names.update_weights_from_disk("e2e", "reuse", 5))).get("run")
    live = names.trial_root("e2e", "reuse") + "/publisher"  # the liveness key of a running publisher
    # Run A holds in its begin step (its run recorded, nothing announced) while the watcher starts.
    monkeypatch.setenv("WSYNC_FAILPOINTS", "begin@0=sleep:5")
    loaded = []
    watcher = DiskWatcher(nr, "e2e", "reuse", ServerGroup([server.url]), on_loaded=lambda a: loaded.append(a.version))
    caplog.set_level(logging.WARNING, logger="inference_adapter.watcher")
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(run_ranks, _publish_run, 1, (server.url, nr_url, str(tmp_path / "a"), 6), None, 200)
            deadline = time.monotonic() + 60
            while not nr.find_subtree(live):
                assert time.monotonic() < deadline and not fut.done(), "run A never started publishing"
                time.sleep(0.05)
            watcher.catch_up()
            watcher.start()
            (version, servers), = fut.result()
    finally:
        watcher.stop()
        nr.close()
    assert (version, servers) == (6, {server.url: "ok"})
    assert loaded == [6], loaded
    ignored = [r.getMessage() for r in caplog.records if "ignoring version" in r.getMessage()]
    assert len(ignored) == 1 and "version 5" in ignored[0] and str(run_b) in ignored[0], ignored
