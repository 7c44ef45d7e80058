"""The fleet: servers are found at every publish, a dead server never stops training, and no server in
rotation ever serves a torn, mixed or stale model (docs/fleet.md).

Real processes throughout: reference servers (one process each), a real etcd, SGLang's real routers
(``sglang-router`` 0.3.2 and ``smg`` 1.13.0), and one trainer process publishing a plain HF model of the
tiny preset (a "training step" moves every weight a little, so each version has other weights).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import requests
import torch

from bridge import PublisherConfig, SyncError, WeightPublisher
from bridge.client import ServerClient
from bridge.errors import BridgeError
from bridge.fleet.discovery import Registry
from tests.sync_bodies import answers_within

EXP = "fleet"


# ------------------------------------------------------------------ helpers


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _train(model, seed: int) -> None:
    """One "training step": every weight moves a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _own(model) -> dict[str, str]:
    """The model's weights as a server serves them: one checksum per tensor."""
    from bridge.digest import tensor_checksum

    return {n: tensor_checksum(p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()}


def _serves(url: str, want: dict[str, str]) -> bool:
    got = ServerClient(url, timeout=10).weights_checksum(list(want))["checksums"]
    return got == want


def _changed(url: str, before: dict[str, str]) -> int:
    got = ServerClient(url, timeout=10).weights_checksum(list(before))["checksums"]
    return sum(got[n] != before[n] for n in before)


def _version(url: str) -> str:
    return ServerClient(url, timeout=10).model_info()["weight_version"]


def _register(etcd, trial: str) -> list[str]:
    return ["--register", etcd.url, "--experiment", EXP, "--trial", trial, "--register-ttl", "5"]


def _registered(etcd, trial: str, n: int, timeout: float = 30.0) -> list[str]:
    reg = Registry(etcd.url, EXP, trial)
    try:
        deadline = time.monotonic() + timeout
        while len(urls := reg.urls()) < n:
            assert time.monotonic() < deadline, f"only {urls} registered within {timeout} s"
            time.sleep(0.1)
        return urls
    finally:
        reg.close()


def _marked_out(etcd, trial: str) -> list[str]:
    reg = Registry(etcd.url, EXP, trial)
    try:
        return sorted(k.rsplit("/", 1)[-1] for k in reg.nr.find_subtree(reg.out_prefix))
    finally:
        reg.close()


def _kill(server) -> None:
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _config(**kw) -> PublisherConfig:
    base = dict(experiment=EXP, bucket_mb=0.05, http_timeout=10, group_timeout=10, probe_timeout=2, progress=False)
    return PublisherConfig(**{**base, **kw})


class Generations:
    """Generations through routers from a thread, each with the version it ran on and when it started,
    so that a test can check that none came from a stale server."""

    def __init__(self, routers):
        self.routers, self.seen, self.errors = routers, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Generations:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            router = self.routers[i % len(self.routers)]
            i += 1
            t = time.monotonic()
            try:
                out = router.generate()
                self.seen.append((t, router.kind, out["meta_info"]["weight_version"]))
            except Exception as e:  # a worker that died before it left the router: the router's error, not an answer
                self.errors.append((t, router.kind, repr(e)))
            time.sleep(0.02)


def _check_no_stale_answers(seen, published: list[tuple[float, int]]) -> None:
    """Every answer that started after version v was published carries v or a later version."""
    assert seen, "no generation answered"
    for t, kind, tag in seen:
        floor = max((v for done, v in published if done < t), default=None)
        if floor is None:
            continue
        assert tag.isdigit() and int(tag) >= floor, f"{kind} answered from version {tag!r} after v{floor} was published"


def test_registrations_are_checked():
    from bridge import ConfigError
    from bridge.fleet import Registration

    with pytest.raises(ConfigError, match="cannot register itself in a router"):
        Registration("router+http://127.0.0.1:1", "http://127.0.0.1:2", EXP, "t")
    with pytest.raises(ConfigError, match="ttl must be in"):
        Registration("memory://fleet", "http://127.0.0.1:2", EXP, "t", ttl=60)


# ------------------------------------------------------------------ a registry (etcd)


def test_registered_servers_die_restart_and_join(server_factory, etcd_server, tiny_model_dir, model, caplog):
    """Three servers register themselves in etcd; the publisher finds them there at every publish. One is
    SIGKILLed: the next publishes succeed without it, report it excluded (logged once) and training goes
    on. Restarted, it is out of rotation until it serves the fleet's version, which the next publish
    gives it, bit-equal. A fourth server started mid-training is published to at the next publish."""
    trial = "kill"
    s1, s2, s3 = server_factory.many([dict(model=tiny_model_dir, extra_args=_register(etcd_server, trial))] * 3)
    assert sorted(_registered(etcd_server, trial, 3)) == sorted([s1.url, s2.url, s3.url])
    cfg = _config(server_registry=etcd_server.url, trial=trial)
    caplog.set_level(logging.WARNING, logger="bridge.fleet")
    with WeightPublisher(cfg) as pub:
        assert pub.publish(model, version=1).servers == {s1.url: "ok", s2.url: "ok", s3.url: "ok"}
        _kill(s3)
        for v in (2, 3):  # training goes on without it
            _train(model, v)
            t = time.monotonic()
            r = pub.publish(model, version=v)
            assert time.monotonic() - t < cfg.http_timeout + 10
            assert (r.servers[s1.url], r.servers[s2.url]) == ("ok", "ok") and r.servers[s3.url].startswith("excluded: ")
            assert _serves(s1.url, _own(model)) and _serves(s2.url, _own(model))
        warned = [rec for rec in caplog.records if s3.url in rec.getMessage() and "excluded" in rec.getMessage()]
        assert len(warned) == 1, [rec.getMessage() for rec in warned]
        # A publisher that needs all three fails before anything moves, naming the dead one.
        with WeightPublisher(_config(server_registry=etcd_server.url, trial=trial, min_servers=3)) as strict:
            with pytest.raises(SyncError, match="min_servers=3") as e:
                strict.publish(model, version=4)
        assert s3.url in str(e.value) and _version(s1.url) == "3"

        s3 = server_factory(model=tiny_model_dir, port=_port(s3), extra_args=_register(etcd_server, trial))
        _registered(etcd_server, trial, 3)
        assert _version(s3.url) == "default" and _marked_out(etcd_server, trial) == [s3.url.split("//")[1]]
        _train(model, 4)
        assert pub.publish(model, version=4).servers == {s1.url: "ok", s2.url: "ok", s3.url: "ok"}
        assert _serves(s3.url, _own(model)) and _version(s3.url) == "4" and _marked_out(etcd_server, trial) == []

        s4 = server_factory(model=tiny_model_dir, extra_args=_register(etcd_server, trial))
        _registered(etcd_server, trial, 4)
        _train(model, 5)
        assert pub.publish(model, version=5).servers == {u: "ok" for u in (s1.url, s2.url, s3.url, s4.url)}
        assert all(_serves(s.url, _own(model)) for s in (s1, s2, s3, s4))
    s4.stop()  # a clean exit deletes its entry at once
    assert s4.url not in _registered(etcd_server, trial, 3)


# ------------------------------------------------------------------ routers


def test_through_real_routers_dead_restarted_and_new_servers_never_answer_stale(
        server_factory, router_factory, etcd_server, tiny_model_dir, model):
    """sglang-router and smg in front of three servers, and etcd where new servers register: the routers
    are the rotation. A killed server leaves both routers' worker lists at the next publish; restarted, it
    stays out of them until the next publish brought it to the fleet's version; a new registered server
    enters them only once it serves that version. A server restarted between two publishes while the routers still
    list it (no publish saw it die) leaves them within the publisher's guard_every and a probe, with no publish, and
    the next publish puts it back; restarted with ``--wait-for-weights`` it answers no generation meanwhile (503, which
    the routers retry elsewhere or pass on). Generations go on through both routers all along, and none answers from
    an older version than the last one published."""
    trial = "routers"
    s1, s2, s3 = server_factory.many([dict(model=tiny_model_dir)] * 3)
    urls = sorted([s1.url, s2.url, s3.url])
    routers = [router_factory("sglang-router", urls), router_factory("smg", urls)]
    registries = [f"router+{r.url}" for r in routers] + [etcd_server.url]
    published = []
    guard = 0.5
    with WeightPublisher(_config(server_registry=registries, trial=trial, guard_every=guard)) as pub, \
            Generations(routers) as gens:
        def publish(v: int) -> dict:
            _train(model, v)
            servers = pub.publish(model, version=v).servers
            published.append((time.monotonic(), v))
            return servers

        assert publish(1) == {u: "ok" for u in urls}
        _kill(s3)
        servers = publish(2)
        assert servers[s3.url].startswith("excluded: ") and servers[s1.url] == servers[s2.url] == "ok"
        assert all(r.workers() == sorted([s1.url, s2.url]) for r in routers)
        s3 = server_factory(model=tiny_model_dir, port=_port(s3))
        time.sleep(1.0)  # restarted on its base weights: not back in any router
        assert _version(s3.url) == "default" and all(r.workers() == sorted([s1.url, s2.url]) for r in routers)
        assert publish(3) == {u: "ok" for u in urls}
        assert all(r.workers() == urls for r in routers) and _serves(s3.url, _own(model))

        s4 = server_factory(model=tiny_model_dir, extra_args=_register(etcd_server, trial))
        _registered(etcd_server, trial, 1)
        assert all(s4.url not in r.workers() for r in routers)
        assert publish(4) == {u: "ok" for u in [*urls, s4.url]}
        assert all(r.workers() == sorted([*urls, s4.url]) for r in routers) and _serves(s4.url, _own(model))

        everyone = sorted([*urls, s4.url])
        dead = time.monotonic()
        _kill(s2)
        # On its base weights, still in both routers, but answering no generation until it has the fleet's weights.
        s2 = server_factory(model=tiny_model_dir, port=_port(s2), extra_args=["--wait-for-weights"])
        back = time.monotonic()
        refused = requests.post(f"{s2.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                                timeout=30)
        assert refused.status_code == 503 and refused.json()["wsync_reason"] == "waiting_for_weights", refused.text
        while any(s2.url in r.workers() for r in routers) and time.monotonic() < back + 10 * guard + 10:
            time.sleep(0.05)
        out = time.monotonic()
        assert all(s2.url not in r.workers() for r in routers), "the restarted server is still in rotation"
        assert _version(s2.url) == "default"  # out of rotation, not yet repaired: a broadcast fleet has no snapshot
        assert publish(5) == {u: "ok" for u in everyone}
        assert all(r.workers() == everyone for r in routers) and _serves(s2.url, _own(model))
        time.sleep(0.5)
    print(f"the restarted server left the routers {out - back:.2f} s after it answered (guard_every={guard:g} s); "
          f"{len(gens.errors)} generations the routers did not answer meanwhile")
    assert dead < out
    _check_no_stale_answers(gens.seen, published)  # (the restarted server's base weights answered none)
    assert {kind for _, kind, _ in gens.seen} == {"sglang-router", "smg"}


def test_a_server_waiting_for_weights_answers_no_generation_until_a_version_is_labelled(server_factory, tmp_path,
                                                                                        tiny_model_dir, model):
    """``wsync serve --wait-for-weights``: on its base weights every generation route answers 503 with
    ``wsync_reason: waiting_for_weights`` (the OpenAI routes too, and before any stream starts), ``/health`` answers
    (so it registers and is found); a disk load of a labelled snapshot, as ``wsync watch`` makes, opens it, and it
    answers from that version."""
    from bridge import PublisherConfig as Config
    from bridge.client import ServerClient

    s = server_factory(model=tiny_model_dir, extra_args=["--wait-for-weights", "--disk-root", str(tmp_path)])
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    for route, req in (("/generate", body), ("/generate", {**body, "stream": True}),
                       ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})):
        r = requests.post(f"{s.url}{route}", json=req, timeout=30)
        assert r.status_code == 503 and r.json()["wsync_reason"] == "waiting_for_weights", (route, r.text)
    assert requests.get(f"{s.url}/health", timeout=10).status_code == 200
    c = ServerClient(s.url)
    assert c.server_info()["internal_states"][0]["waiting_for_weights"] is True
    _train(model, 7)
    with WeightPublisher(Config(transport="disk", snapshot_root=str(tmp_path), name_resolve=f"file://{tmp_path}/nr",
                                experiment=EXP, trial="waiting", progress=False)) as pub:
        path = pub.publish(model, version=7).path  # no servers: a snapshot, announced, as a fleet's publisher leaves it
    c.update_weights_from_disk(path, weight_version="7")  # what `wsync watch` does for a server that joined
    assert c.server_info()["internal_states"][0]["waiting_for_weights"] is False
    assert c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})["meta_info"]["weight_version"] == "7"
    assert _serves(s.url, _own(model))
    c.close()


# ------------------------------------------------------------------ torn and split servers


@pytest.fixture(scope="module")
def pair(server_factory, tiny_model_dir):
    """A server that stages (0.5.23), one that loads buckets as they arrive (0.5.5, as real SGLang does),
    and a second staging one."""
    return server_factory.many([dict(model=tiny_model_dir), dict(model=tiny_model_dir, extra_args=[
        "--protocol-version", "0.5.5"]), dict(model=tiny_model_dir)])


def test_a_torn_server_never_answers_until_the_next_publish_repairs_it(pair, router_factory, model):
    """A sync bucket by bucket (``atomic_mb=0``, as one above the limit goes) fails at bucket 3: the staging server
    drops what it staged and serves on; the one that loaded buckets 0-2 already holds a mix of two versions under
    the old label, so it stays paused and leaves the router instead of being resumed; the next publish sends it
    every tensor."""
    from bridge.failpoints import ENV

    staging, loading = pair[0], pair[1]
    router = router_factory("sglang-router", sorted([staging.url, loading.url]))
    lease = 1.0  # the trainer's writer lease runs out while the torn server waits for the next publish
    cfg = _config(servers=[staging.url, loading.url], server_registry=f"router+{router.url}", trial="torn",
                  writer_lease=lease, atomic_mb=0)
    with WeightPublisher(cfg) as pub:
        pub.publish(model, version=1)
        old = _own(model)
        _train(model, 2)
        os.environ[ENV] = "bucket:3@0=RuntimeError"
        try:
            with pytest.raises(SyncError) as e:
                pub.publish(model, version=2)
        finally:
            del os.environ[ENV]
        assert "torn" in str(e.value) and loading.url in str(e.value), str(e.value)
        assert _version(loading.url) == "1" and _changed(loading.url, old) > 0  # torn: new and old weights
        # ... so it answers nothing, also once the lease ran out (the server's watchdog, every 1 s, resumes a
        # server whose writer is gone only when its weights are whole) and its receive of bucket 3 failed
        assert not answers_within(loading.url, lease + 2 * 1.0 + 1.0)
        assert router.workers() == [staging.url]
        assert _version(staging.url) == "1" and _serves(staging.url, old) and answers_within(staging.url, 1.0)
        assert pub.publish(model, version=2).servers == {staging.url: "ok", loading.url: "ok"}
        assert _serves(loading.url, _own(model)) and _version(loading.url) == "2" and answers_within(loading.url, 1.0)
        assert router.workers() == sorted([staging.url, loading.url])


def test_a_commit_that_fails_on_one_of_two_servers_takes_it_out_of_rotation(pair, router_factory, model):
    """/end_weight_update fails on the second server: the first serves the new version; the second is
    paused and out of the router, so no two servers in rotation serve different versions once publish()
    returns; the next publish repairs it."""
    from bridge.failpoints import ENV

    a, b = pair[0], pair[2]
    router = router_factory("sglang-router", sorted([a.url, b.url]))
    cfg = _config(servers=[a.url, b.url], server_registry=f"router+{router.url}", trial="commit")
    with WeightPublisher(cfg) as pub:
        pub.publish(model, version=1)
        _train(model, 2)
        os.environ[ENV] = "commit:1@0=RuntimeError"
        try:
            servers = pub.publish(model, version=2).servers
        finally:
            del os.environ[ENV]
        assert servers[a.url] == "ok" and servers[b.url].startswith("failed: commit failed") and "injected" in servers[b.url]
        assert router.workers() == [a.url] and {_version(u) for u in router.workers()} == {"2"}
        assert _serves(a.url, _own(model)) and _version(b.url) == "1" and not answers_within(b.url, 2.0)
        _train(model, 3)
        assert pub.publish(model, version=3).servers == {a.url: "ok", b.url: "ok"}
        assert router.workers() == sorted([a.url, b.url]) and _serves(b.url, _own(model))


def test_a_restarted_server_is_repaired_from_the_newest_snapshot_at_once(server_factory, tiny_model_dir, model,
                                                                          tmp_path, caplog):
    """Disk transport: a server restarted on its base weights is brought to the fleet's version from the
    newest complete snapshot before the sync, then takes the new version like the others."""
    from bridge.client import ServerGroup
    from inference_adapter.watcher import DiskWatcher

    a, b = server_factory.many([dict(model=tiny_model_dir)] * 2)
    nr = f"file://{tmp_path / 'nr'}"
    cfg = _config(transport="disk", servers=[a.url, b.url], name_resolve=nr, snapshot_root=str(tmp_path / "snap"),
                  trial="snapshot")
    from prometheus_client import REGISTRY

    def repaired() -> float:  # bridge.metrics' count of servers the publisher repaired, in this process
        return REGISTRY.get_sample_value("wsync_servers_repaired_total", {"by": "publisher"}) or 0.0

    watcher = DiskWatcher(nr, EXP, "snapshot", ServerGroup([a.url, b.url]))
    watcher.start()
    caplog.set_level(logging.WARNING, logger="bridge.fleet")
    before = repaired()
    try:
        with WeightPublisher(cfg) as pub:
            pub.publish(model, version=1)
            v1 = _own(model)
            _kill(b)
            b = server_factory(model=tiny_model_dir, port=_port(b))
            _train(model, 2)
            assert pub.publish(model, version=2).servers == {a.url: "ok", b.url: "ok"}
        assert any(f"{b.url} repaired from the snapshot of version 1" in r.getMessage() for r in caplog.records)
        assert repaired() - before == 1
        assert _serves(a.url, _own(model)) and _serves(b.url, _own(model)) and _own(model) != v1
    finally:
        watcher.stop()


def test_wsync_watch_follows_the_registry_and_heals_joining_and_restarted_servers(server_factory, tiny_model_dir,
                                                                                  model, tmp_path):
    """``wsync watch --server-registry``: no fixed list. A server that registers after the last publish, and one
    restarted on its base weights at the same URL, each serve the fleet's version bit-equal within seconds, with
    no publish in between; the next publish reaches all of them."""
    import subprocess
    import sys

    registry, nr = f"file://{tmp_path / 'registry'}", f"file://{tmp_path / 'nr'}"
    reg = ["--register", registry, "--experiment", EXP, "--trial", "heal", "--register-ttl", "3"]
    (a,) = server_factory.many([dict(model=tiny_model_dir, extra_args=reg)])
    watch = subprocess.Popen([sys.executable, "-m", "wsync", "watch", "--server-registry", registry, "--name-resolve",
                              nr, "--experiment", EXP, "--trial", "heal", "--heal-every", "0.5"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cfg = _config(transport="disk", server_registry=registry, name_resolve=nr, snapshot_root=str(tmp_path / "snap"),
                  trial="heal", wait_loaded_timeout=60)

    def registered(url: str) -> None:
        deadline = time.monotonic() + 30
        while url not in Registry(registry, EXP, "heal").urls():
            assert time.monotonic() < deadline, f"{url} never registered"
            time.sleep(0.1)

    def healed(url: str, version: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not (_answers(url) and _version(url) == str(version) and _serves(url, _own(model))):
            assert watch.poll() is None, watch.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"{url} serves {_version(url)}, not version {version}"
            time.sleep(0.2)

    try:
        registered(a.url)
        with WeightPublisher(cfg) as pub:
            pub.publish(model, version=1)
            healed(a.url, 1)
            (b,) = server_factory.many([dict(model=tiny_model_dir, extra_args=reg)])  # joins after the publish
            healed(b.url, 1)
            _kill(a)
            a = server_factory(model=tiny_model_dir, port=_port(a), extra_args=reg)  # back on its base weights
            healed(a.url, 1)
            _train(model, 2)
            assert set(pub.publish(model, version=2).servers) == {a.url, b.url}
            healed(a.url, 2, timeout=5)
            healed(b.url, 2, timeout=5)
    finally:
        watch.terminate()
        watch.wait(30)
    assert "loaded version 1 into it" in watch.stderr.read()


def _answers(url: str) -> bool:
    try:
        _version(url)
        return True
    except BridgeError:
        return False


# ------------------------------------------------------------------ the command line


def test_the_register_sidecar_keeps_an_entry_only_while_its_server_answers(pair, tmp_path):
    """``wsync register`` for a server that cannot register itself: the entry is there while the server
    answers /health, gone while it does not (SIGSTOP), back when it answers again, and deleted when the
    sidecar is stopped."""
    import subprocess
    import sys

    server = pair[2]
    registry = f"file://{tmp_path / 'registry'}"
    sidecar = subprocess.Popen([sys.executable, "-m", "wsync", "register", "--server", server.url, "--registry", registry,
                                "--experiment", EXP, "--trial", "sidecar", "--ttl", "3", "--interval", "0.2"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def listed(want: bool, within: float = 15.0) -> None:
        reg, deadline = Registry(registry, EXP, "sidecar"), time.monotonic() + within
        try:
            while (server.url in reg.urls()) != want:
                assert time.monotonic() < deadline and sidecar.poll() is None, f"listed is not {want}"
                time.sleep(0.1)
        finally:
            reg.close()

    try:
        listed(True)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            listed(False)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        listed(True)
        sidecar.send_signal(signal.SIGTERM)
        out, _ = sidecar.communicate(timeout=20)
        assert sidecar.returncode == 0 and "removed" in out, out
        listed(False, within=0.1)
    finally:
        if sidecar.poll() is None:
            sidecar.kill()


def test_wsync_train_finds_its_servers_in_a_registry(server_factory, tiny_model_dir, tmp_path):
    """``wsync train --server-registry``: the trainer publishes to the server registered with
    ``wsync serve --register``; a registered server that is dead is excluded, and training goes on."""
    import json
    import subprocess
    import sys

    from bridge.name_resolve import make_name_resolve

    registry = f"file://{tmp_path / 'registry'}"
    reg = ["--register", registry, "--experiment", EXP, "--trial", "cli"]
    (server,) = server_factory.many([dict(model=tiny_model_dir, extra_args=reg)])
    nr = make_name_resolve(registry)
    nr.add(f"wsync/{EXP}/cli/servers/dead", json.dumps({"url": "http://127.0.0.1:9"}))  # nobody listens there
    nr.close()
    deadline = time.monotonic() + 15
    while server.url not in (reg_urls := Registry(registry, EXP, "cli").urls()):
        assert time.monotonic() < deadline, reg_urls
        time.sleep(0.1)
    out = subprocess.run([sys.executable, "-m", "wsync", "train", "--nproc", "1", "--steps", "2", "--publish", "broadcast",
                          "--server-registry", registry, "--experiment", EXP, "--trial", "cli", "--start-version", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "published v2" in out.stdout and _version(server.url) == "2"
    assert "http://127.0.0.1:9 is excluded" in out.stderr, out.stderr[-2000:]


# ------------------------------------------------------------------ soak


# The sizes are what the soak has to prove, and no more: several servers behind one router (4, so that one
# dead and one joining are both a minority: min_servers=3 holds), several churn cycles in one run (a server
# joins and one dies every 5 publishes: 4 cycles, each a new server registering while training goes on), and
# enough publishes between them for generations through the router to race each commit (20).
SOAK_SERVERS, SOAK_PUBLISHES, SOAK_CHURN_EVERY = 4, 20, 5


@pytest.mark.slow
def test_soak_servers_behind_a_router_publishes_while_one_dies_and_one_joins(
        server_factory, router_factory, etcd_server, tiny_model_dir, model):
    """SOAK_SERVERS servers of the tiny preset behind sglang-router, registered in etcd; SOAK_PUBLISHES
    publishes; every SOAK_CHURN_EVERY publishes a new server starts (and registers while training goes on)
    and one is SIGKILLed. No publish fails (min_servers: all but one), and no generation through the router
    answers from an older version than the last one published; at the end every server in the router serves
    the last one, bit-equal."""
    import concurrent.futures as cf

    trial = "soak"
    spec = dict(model=tiny_model_dir, extra_args=_register(etcd_server, trial))
    alive = server_factory.many([spec] * SOAK_SERVERS)
    router = router_factory("sglang-router", sorted(s.url for s in alive))
    quorum = SOAK_SERVERS - 1
    cfg = _config(server_registry=[etcd_server.url, f"router+{router.url}"], trial=trial, min_servers=quorum)
    published, starting = [], []
    last = SOAK_PUBLISHES + 1
    with WeightPublisher(cfg) as pub, Generations([router]) as gens, cf.ThreadPoolExecutor(2) as pool:
        for v in range(1, last):
            if v % SOAK_CHURN_EVERY == 1:  # a server starts, and joins once registered while training goes on
                starting.append(pool.submit(server_factory, **spec))
            if v % SOAK_CHURN_EVERY == 0:  # the new one has registered first, then the oldest dies
                alive.append(starting[-1].result(timeout=120))
                while alive[-1].url not in _registered(etcd_server, trial, 1):
                    time.sleep(0.1)
                _kill(alive.pop(0))
            _train(model, v)
            servers = pub.publish(model, version=v).servers
            published.append((time.monotonic(), v))
            assert sum(s == "ok" for s in servers.values()) >= quorum, servers
            assert all(s == "ok" or s.startswith("excluded: ") for s in servers.values()), servers
        _train(model, last)
        servers = pub.publish(model, version=last).servers
        published.append((time.monotonic(), last))
        assert all(servers[s.url] == "ok" for s in alive), servers
        time.sleep(0.5)
    _check_no_stale_answers(gens.seen, published)
    assert router.workers() == sorted(s.url for s in alive)
    assert all(_serves(s.url, _own(model)) and _version(s.url) == str(last) for s in alive)
