"""``wsync status``: the fleet as an operator sees it, from a real registry (etcd), real reference servers that
register themselves, and a real publisher; the command run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests

from bridge import PublisherConfig, WeightPublisher
from bridge.fleet.discovery import Registry
from tests.test_fleet import EXP, _register, _registered, _train

TRIAL = "status"


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _status(etcd, *more: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "wsync", "status", "--server-registry", etcd.url, "--experiment", EXP,
                          "--trial", TRIAL, "--timeout", "3", *more], capture_output=True, text=True, timeout=120)
    assert not out.stderr.strip() or out.returncode in (0, 1), out.stderr
    return out.returncode, out.stdout


def test_wsync_status_shows_each_server_and_exits_0_only_when_the_fleet_is_healthy(server_factory, etcd_server,
                                                                                    tiny_model_dir, model):
    a, b, c = server_factory.many([dict(model=tiny_model_dir, extra_args=_register(etcd_server, TRIAL))] * 3)
    _registered(etcd_server, TRIAL, 3)
    pub = WeightPublisher(PublisherConfig(server_registry=etcd_server.url, experiment=EXP, trial=TRIAL,
                                          progress=False, group_timeout=20, http_timeout=20))
    try:
        for v in (1, 2):
            _train(model, v)
            pub.publish(model, version=v)
    finally:
        pub.close()
    rc, text = _status(etcd_server)
    assert rc == 0 and "healthy: every server on the newest version" in text and text.count(" ok ") == 3, text
    assert [line.split()[4] for line in text.splitlines()[2:5]] == ["in"] * 3, text  # registered, not marked out

    os.kill(a.process.pid, signal.SIGKILL)  # its entry lives on for its lease's 5 s
    a.process.wait(10)
    requests.post(b.url + "/pause_generation", json={"mode": "abort"}, timeout=10).raise_for_status()
    requests.post(c.url + "/update_weight_version", json={"new_version": "1"}, timeout=10).raise_for_status()
    rc, text = _status(etcd_server, "--json", "--server", a.url)  # (a dead server's entry goes with its lease)
    got = json.loads(text)
    by_url = {s["url"]: s for s in got["servers"]}
    assert rc == 1 and got["healthy"] is False and got["newest"] == "2", got
    assert by_url[a.url]["state"] == "down" and by_url[a.url]["version"] is None, by_url[a.url]
    assert by_url[b.url]["state"] == "paused" and by_url[b.url]["version"] == "2", by_url[b.url]
    assert by_url[c.url]["state"] == "behind" and by_url[c.url]["behind"] == 1, by_url[c.url]

    registry = Registry(etcd_server.url, EXP, TRIAL)  # what a publisher writes for a server it left torn
    try:
        registry.take_out(b.url, "torn: a sync failed after it loaded buckets")
    finally:
        registry.close()
    rc, text = _status(etcd_server, "--server", a.url)
    line = next(line for line in text.splitlines() if line.startswith(b.url))
    assert rc == 1 and " out " in line and "torn: a sync failed after it loaded buckets" in line, text
    assert "not healthy: 3 of 3 servers not ok" in text, text


def test_wsync_status_needs_servers_and_says_so():
    out = subprocess.run([sys.executable, "-m", "wsync", "status"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give --server URL or --server-registry URL" in out.stderr, out


def test_a_server_a_dead_writer_may_have_torn_with_no_snapshot_of_its_version_stays_paused_and_is_said_once(
        ref_server, etcd_server, caplog):
    """A writer's mark without its lock (the writer died mid-sync, its lock ran out), saying the sync may have torn the
    server, and no snapshot of the version the server is labelled with: the serving side does not resume it (it
    could serve torn weights), says so once however often it looks, and ``wsync status --writer-lock`` shows it
    paused and maybe torn. With a snapshot of another version, the same. (The repair from a snapshot of its version,
    and the resume of an untorn one, run against real SGLang in ``tests/test_real_sglang.py``.)"""
    import logging
    import time
    from types import SimpleNamespace

    from bridge.client import ServerClient
    from bridge.fleet.abandoned import give_back_abandoned
    from bridge.name_resolve import make_name_resolve
    from bridge.transports.lease import held_key

    url = ref_server.url
    c, nr = ServerClient(url, timeout=5), make_name_resolve(etcd_server.url)
    served = str(c.model_info()["weight_version"])
    mark = {"writer": "rank0@trainer-host", "run_id": "default/torn-run", "since": time.time() - 5, "may_tear": True}
    c.pause_generation()
    nr.add(held_key(url), json.dumps(mark), replace=True)
    try:
        reported: set = set()
        with caplog.at_level(logging.ERROR, logger="bridge.fleet.abandoned"):
            first = give_back_abandoned([c], nr, etcd_server.url, snapshot=None, reported=reported)
            again = give_back_abandoned([c], nr, etcd_server.url, snapshot=None, reported=reported)
            other = give_back_abandoned([c], nr, etcd_server.url, reported=reported,
                                        snapshot=SimpleNamespace(version=f"{served}9", path="/nonexistent"))
        assert first == again == {url: f"torn: left paused (no snapshot; it is labelled {served})"}, (first, again)
        assert other == {url: f"torn: left paused (the newest snapshot is version {served}9; it is labelled "
                              f"{served})"}, other
        said = [r.getMessage() for r in caplog.records if "left paused until a publish repairs it" in r.getMessage()]
        assert len(said) == 1 and "may have torn it" in said[0] and "default/torn-run" in said[0], said
        assert c.server_info()["internal_states"][0]["paused"] is True  # not resumed
        assert nr.get(held_key(url))  # the mark stays: the next publish, or a snapshot of its version, repairs it
        out = subprocess.run([sys.executable, "-m", "wsync", "status", "--server", url, "--writer-lock", etcd_server.url,
                              "--timeout", "3", "--json"], capture_output=True, text=True, timeout=120)
        row = json.loads(out.stdout)["servers"][0]
        assert out.returncode == 1 and row["state"] == "paused", out.stdout
        assert "left by a dead writer of run 'default/torn-run', maybe torn" in row["why"], row
    finally:
        nr.delete(held_key(url))
        c.continue_generation()
        c.close()
        nr.close()
