"""Name resolution: one contract, checked on the memory, directory and real-etcd backends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from bridge.errors import ConfigError, NameEntryExists, NameEntryNotFound, NameResolveError
from bridge.name_resolve import (
    Announcement,
    DirectoryNameResolve,
    MemoryNameResolve,
    WatchEvent,
    make_name_resolve,
    names,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["memory", "file", "etcd"])
def url(request, tmp_path):
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex}"
    if request.param == "file":
        return f"file://{tmp_path}/nr"
    return request.getfixturevalue("etcd_server").url


@pytest.fixture
def nr(url):
    r = make_name_resolve(url)
    yield r
    r.close()


@pytest.fixture
def prefix():
    return f"t{uuid.uuid4().hex[:10]}"


def _until(cond, timeout=15.0):
    """Test-side wait for an outcome that has no event to wait on (a TTL running out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _gone(r, key):
    def check():
        try:
            r.get(key)
            return False
        except NameEntryNotFound:
            return True
    return check


def test_add_get_replace_delete(nr, prefix):
    key = f"{prefix}/a"
    nr.add(key, "1")
    assert nr.get(key) == "1"
    with pytest.raises(NameEntryExists):
        nr.add(key, "2")
    assert nr.get(key) == "1"
    nr.add(key, "2", replace=True)
    assert nr.get(key) == "2"
    nr.delete(key)
    with pytest.raises(NameEntryNotFound):
        nr.get(key)
    with pytest.raises(NameEntryNotFound):
        nr.delete(key)
    nr.add(key, "3")  # a deleted key can be added again
    assert nr.get(key) == "3"


def test_subentries_and_subtrees(nr, prefix):
    servers = names.gen_servers(prefix, "trial")
    subs = [nr.add_subentry(servers, addr) for addr in ("10.0.0.1:30000", "10.0.0.2:30000")]
    assert all(s.startswith(servers + "/") for s in subs) and subs[0] != subs[1]
    assert nr.find_subtree(servers) == sorted(subs)
    assert sorted(nr.get_subtree(servers + "/")) == ["10.0.0.1:30000", "10.0.0.2:30000"]
    nr.add(f"{prefix}/x1", "a")
    nr.add(f"{prefix}/x10", "b")
    nr.add(f"{prefix}/x1/y", "c")
    assert nr.find_subtree(f"{prefix}/x1") == [f"{prefix}/x1", f"{prefix}/x1/y"]  # a path, not a string prefix
    assert nr.get_subtree(f"{prefix}/nothing") == []


def test_wait(nr, prefix):
    key = f"{prefix}/later"
    with pytest.raises(NameEntryNotFound, match="did not appear"):
        nr.wait(key, timeout=0.3)
    t = threading.Timer(0.3, nr.add, args=(key, "here"))
    t.start()
    assert nr.wait(key, timeout=10) == "here"
    t.join()
    assert nr.wait(key, timeout=0) == "here"  # already there


def test_watch_delivers_changes_in_order(nr, prefix):
    nr.add(f"{prefix}/w/0", "old")
    got: list[WatchEvent] = []
    cond = threading.Condition()

    def on_event(ev):
        with cond:
            got.append(ev)
            cond.notify_all()

    w = nr.watch(f"{prefix}/w", on_event)
    for i in range(1, 6):
        nr.add(f"{prefix}/w/{i}", str(i))
    nr.add(f"{prefix}/other", "not watched")
    with cond:  # the directory backend coalesces changes within one poll interval, so let the puts land
        assert cond.wait_for(lambda: len(got) >= 5, timeout=10)
    nr.delete(f"{prefix}/w/3")
    with cond:
        assert cond.wait_for(lambda: len(got) >= 6, timeout=10)
    w.cancel()
    assert [(e.type, e.key, e.value) for e in got] == (
        [("put", f"{prefix}/w/{i}", str(i)) for i in range(1, 6)] + [("delete", f"{prefix}/w/3", None)]
    )
    nr.add(f"{prefix}/w/9", "after cancel")
    with nr.watch(f"{prefix}/w", include_existing=True) as it:  # iterator form, existing keys first
        first = [it.get(timeout=10) for _ in range(6)]
    assert [e.key for e in first] == [f"{prefix}/w/{i}" for i in (0, 1, 2, 4, 5, 9)]
    assert len(got) == 6


def test_ttl_expires_and_keepalive_keeps(nr, prefix):
    nr.add(f"{prefix}/short", "x", ttl=1)
    nr.add(f"{prefix}/kept", "y", ttl=1, keepalive=True)
    assert nr.get(f"{prefix}/short") == "x"
    assert _until(_gone(nr, f"{prefix}/short"))
    time.sleep(1.5)  # well past the TTL: the keep-alive refreshed it
    assert nr.get(f"{prefix}/kept") == "y"
    other = make_name_resolve(nr.url)
    try:
        nr.close()  # stops the keep-alive and removes the key at once
        assert _until(_gone(other, f"{prefix}/kept"), timeout=3)
    finally:
        other.close()


_CHILD = """
import sys, time
from bridge.name_resolve import make_name_resolve
nr = make_name_resolve(sys.argv[1])
nr.add(sys.argv[2], "alive", ttl=2, keepalive=True)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("backend", ["file", "etcd"])
def test_keepalive_key_vanishes_after_kill_9(backend, tmp_path, prefix, request):
    url = f"file://{tmp_path}/nr" if backend == "file" else request.getfixturevalue("etcd_server").url
    key = f"{prefix}/worker"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url, key], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": REPO})
    nr = make_name_resolve(url)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert nr.wait(key, timeout=10) == "alive"
        time.sleep(3)  # longer than the TTL: alive because the child refreshes it
        assert nr.get(key) == "alive"
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert _until(_gone(nr, key), timeout=15)
    finally:
        child.kill()
        nr.close()


def test_names_and_urls():
    assert names.update_weights_from_disk("exp", "t1", 12) == "wsync/exp/t1/update_weights_from_disk/12"
    assert names.update_weights_from_disk_root("exp", "t1", root="me") == "me/exp/t1/update_weights_from_disk"
    assert names.gen_servers("exp", "t1") == "wsync/exp/t1/gen_servers"
    assert names.version_of("wsync/exp/t1/update_weights_from_disk/12") == 12
    assert names.version_of("wsync/exp/t1/gen_servers") is None
    for bad in (lambda: names.gen_servers("a/b", "t"), lambda: names.update_weights_from_disk("e", "t", -1)):
        with pytest.raises(ConfigError):
            bad()
    assert isinstance(make_name_resolve("memory://x"), MemoryNameResolve)
    for bad_url in ("redis://h:1", "file://relative/dir", "etcd://", "memory://x?poll=1"):
        with pytest.raises(ConfigError):
            make_name_resolve(bad_url)
    nr = make_name_resolve("memory://keys")
    for bad_key in ("", "/abs", "a//b", "a/../b", "a/.hidden", "trailing/"):
        with pytest.raises(ConfigError):
            nr.add(bad_key, "v")
    with pytest.raises(ConfigError):
        nr.add("k", 3)
    with pytest.raises(ConfigError, match="needs a ttl"):
        nr.add("k", "v", keepalive=True)


def test_announcement_wire_format():
    a = Announcement(version=3, path="/ckpt/v3", manifest_sha256="ab" * 32, total_bytes=1024, created_at=1700000000.5)
    text = a.to_json()
    assert text == ('{"created_at": 1700000000.5, "manifest_sha256": "' + "ab" * 32
                    + '", "path": "/ckpt/v3", "total_bytes": 1024, "version": 3}')
    assert Announcement.from_json(text) == a
    assert Announcement.from_json(json.dumps({**json.loads(text), "future_field": 1})) == a
    for field, value, msg in [("version", -1, "'version'"), ("version", "3", "'version'"), ("path", "", "'path'"),
                              ("manifest_sha256", "xyz", "'manifest_sha256'"), ("total_bytes", 1.5, "'total_bytes'"),
                              ("created_at", "now", "'created_at'")]:
        with pytest.raises(ConfigError, match=msg):
            Announcement.from_json(json.dumps({**json.loads(text), field: value}))
    d = json.loads(text)
    del d["path"]
    with pytest.raises(ConfigError, match="'path' is missing"):
        Announcement.from_json(json.dumps(d))
    with pytest.raises(ConfigError, match="not valid JSON"):
        Announcement.from_json("{")


def test_directory_entries_are_atomic_files(tmp_path):
    nr = DirectoryNameResolve(tmp_path)
    nr.add("a/b", "v")
    files = [f for f in os.listdir(tmp_path) if f != ".wsync-lock"]  # the lock file of create-if-absent
    assert files == ["a%2Fb.entry"]  # flat: every change touches the directory's mtime
    with open(tmp_path / files[0]) as f:
        rec = json.load(f)
    assert sorted(rec) == ["expires_at", "key", "owner", "value", "written_at"] and rec["value"] == "v"
    nr.close()


# -- etcd only ------------------------------------------------------------------------------------


def test_etcd_watch_is_a_stream(etcd_server, prefix):
    nr = make_name_resolve(etcd_server.url)
    try:
        with nr.watch(prefix) as w:
            for i in range(50):
                nr.add(f"{prefix}/{i}", str(i))
            evs = [w.get(timeout=10) for _ in range(50)]
        assert [e.value for e in evs] == [str(i) for i in range(50)]
        revs = [e.revision for e in evs]
        assert revs == sorted(revs) and len(set(revs)) == 50  # etcd's own revisions: one event per put
    finally:
        nr.close()


def test_etcd_restart_mid_run(etcd_server, prefix):
    nr = make_name_resolve(etcd_server.url)
    impatient = make_name_resolve(etcd_server.url + "?retry_deadline=0.5")
    got: list[WatchEvent] = []
    seen = threading.Condition()

    def on_event(ev):
        with seen:
            got.append(ev)
            seen.notify_all()

    def wait_events(n):
        with seen:
            assert seen.wait_for(lambda: len(got) >= n, timeout=30), got

    try:
        w = nr.watch(prefix, on_event)
        nr.add(f"{prefix}/kept", "alive", ttl=2, keepalive=True)
        nr.add(f"{prefix}/1", "one")
        wait_events(2)
        etcd_server.stop()
        with pytest.raises(NameResolveError, match="unreachable"):
            impatient.add(f"{prefix}/never", "x")
        adder = threading.Thread(target=nr.add, args=(f"{prefix}/2", "two"))
        adder.start()  # retries with backoff while etcd is down
        time.sleep(1.0)
        assert adder.is_alive()
        etcd_server.start()
        adder.join(timeout=30)
        assert not adder.is_alive()
        wait_events(3)
        nr.add(f"{prefix}/3", "three")  # the watch reconnected and still delivers
        wait_events(4)
        time.sleep(0.3)
        assert [(e.type, e.key) for e in got] == [("put", f"{prefix}/kept"), ("put", f"{prefix}/1"),
                                                   ("put", f"{prefix}/2"), ("put", f"{prefix}/3")]
        assert nr.get(f"{prefix}/2") == "two"
        time.sleep(2.5)  # past the TTL: the keep-alive resumed after the restart
        assert nr.get(f"{prefix}/kept") == "alive"
        w.cancel()
    finally:
        if etcd_server.proc is None:
            etcd_server.start()
        impatient.close()
        nr.close()


def test_etcd_works_in_a_trainer_process_that_imported_protobuf_first(etcd_server, tmp_path):
    # A real trainer process has imported protobuf (transformers, wandb, SGLang) long before it talks to
    # etcd, with protobuf's default (upb) implementation and no environment variable to change it.
    code = (
        "import google.protobuf, transformers\n"
        "from google.protobuf.internal import api_implementation\n"
        "import torch\n"
        "from bridge import PublisherConfig, VersionSubscriber, WeightPublisher\n"
        f"url = {etcd_server.url!r}\n"
        "cfg = PublisherConfig(transport='disk', name_resolve=url, experiment='pb', trial='first',\n"
        f"                      snapshot_root={str(tmp_path / 'ckpt')!r}, progress=False)\n"
        "with WeightPublisher(cfg) as pub:\n"
        "    pub.publish(torch.nn.Linear(4, 4), version=1)\n"
        "sub = VersionSubscriber(url, 'pb', 'first')\n"
        "print(api_implementation.Type(), sub.latest().version)\n"
        "sub.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "PYTHONPATH": REPO},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["upb", "1"], out.stdout


def test_etcd_lost_lease_is_recreated(etcd_server, prefix):
    # Another client revokes the lease (as etcd does when a keep-alive cannot reach it within the TTL):
    # the key vanishes, and the keep-alive thread grants a new lease and puts the key back.
    nr = make_name_resolve(etcd_server.url)
    import etcd3

    raw = etcd3.client("127.0.0.1", etcd_server.client_port)
    try:
        key = f"{prefix}/kept"
        nr.add(key, "alive", ttl=1, keepalive=True)
        lease_id = raw.get(key)[1].lease_id
        raw.revoke_lease(lease_id)
        assert _until(lambda: raw.get(key)[1] is not None and raw.get(key)[1].lease_id not in (0, lease_id))
        assert nr.get(key) == "alive"
    finally:
        raw.close()
        nr.close()


def _race_for(path: str, key: str, go, out) -> None:
    from bridge.name_resolve import DirectoryNameResolve

    nr = DirectoryNameResolve(path)
    go.wait()
    try:
        nr.add(key, str(os.getpid()), ttl=30)
        out.put("won")
    except NameEntryExists:
        out.put("lost")


def test_taking_an_expired_directory_entry_is_exclusive(tmp_path):
    """A directory entry with a TTL kept alive is a lock with a lease (the publishers' writer locks): when it
    expired, of several processes that try to create it at once exactly one may succeed."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    path, key = str(tmp_path / "nr"), "wsync/writer_lock/x"
    for round_ in range(10):
        stale = DirectoryNameResolve(path)
        stale.add(key, "expired", ttl=0.01)
        stale.close()
        time.sleep(0.05)
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_race_for, args=(path, key, go, out)) for _ in range(6)]
        for p in procs:
            p.start()
        time.sleep(0.3)
        go.set()
        outcomes = sorted(out.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(10)
        assert outcomes.count("won") == 1, f"round {round_}: {outcomes}"
        check = DirectoryNameResolve(path)
        assert check.get(key) != "expired"
        check.delete(key)
        check.close()


def test_etcd_a_key_deleted_while_its_lost_lease_is_renewed_stays_deleted(etcd_server, prefix):
    """The keep-alive thread read the keys it keeps and found one's lease lost; before it put the key back, the key
    was deleted (a writer lock released). It must stay deleted: put back, it would hold the lock for a TTL, kept alive
    by no one, and refuse its own writer's next sync (seen in the suite under load)."""
    nr = make_name_resolve(etcd_server.url)
    try:
        key = f"{prefix}/lock"
        nr.add(key, "writer", ttl=30, keepalive=True)
        kept = nr._kept[key]  # what the keep-alive thread read, before the delete
        nr.delete(key)
        nr._regrant(key, kept)  # what it does then for a lease it found lost
        with pytest.raises(NameEntryNotFound):
            nr.get(key)
    finally:
        nr.close()
