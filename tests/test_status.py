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
