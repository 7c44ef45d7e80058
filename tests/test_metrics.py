"""Prometheus metrics, scraped over HTTP as Prometheus scrapes them, during real publishes: the publisher's
(``metrics_port``), the watcher's (``wsync watch --metrics-port``) and the reference server's
(``--enable-metrics``, ``/metrics``), against real reference servers and a watcher process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bridge import PublisherConfig, WeightPublisher
from bridge.errors import BridgeError
from tests.test_fleet import _train


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of one scrape."""
    r = requests.get(url, timeout=10)
    r.raise_for_status()
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return _samples(r.text)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    """The sample ``name`` whose labels include ``labels`` (0.0 when there is none, as for a counter not yet set)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def test_publisher_server_and_watcher_metrics_scraped_during_real_publishes(server_factory, tiny_model_dir, model,
                                                                             tmp_path):
    a, b = server_factory.many([dict(model=tiny_model_dir, extra_args=["--enable-metrics"]),
                                dict(model=tiny_model_dir)])
    assert requests.get(b.url + "/metrics", timeout=10).status_code == 404  # only with --enable-metrics, as SGLang
    port = _port()
    metrics = f"http://127.0.0.1:{port}/metrics"
    before = _samples(generate_latest().decode())  # this process may have published before (other tests), unserved
    pub = WeightPublisher(PublisherConfig(servers=[a.url, b.url], metrics_port=port, progress=False, group_timeout=20,
                                          http_timeout=20))
    try:
        for v in (1, 2):
            _train(model, v)
            res = pub.publish(model, version=v)
        got = _scrape(metrics)
        assert _value(got, "wsync_published_version") == 2
        count = _value(got, "wsync_sync_seconds_count", transport="broadcast", encoding="full")
        assert count - _value(before, "wsync_sync_seconds_count", transport="broadcast", encoding="full") == 2, got
        moved = _value(got, "wsync_sync_bytes_total", transport="broadcast", encoding="full") - \
            _value(before, "wsync_sync_bytes_total", transport="broadcast", encoding="full")
        assert moved == 2 * res.bytes > 0
        assert _value(got, "wsync_servers", state="ok") == 2 and _value(got, "wsync_servers", state="excluded") == 0
        assert abs(_value(got, "wsync_last_sync_timestamp_seconds") - time.time()) < 60

        os.kill(b.process.pid, signal.SIGKILL)  # the next publish goes on without it (min_servers=1), and says so
        b.process.wait(10)
        _train(model, 3)
        pub.publish(model, version=3)
        got = _scrape(metrics)
        assert _value(got, "wsync_servers", state="excluded") == 1 and _value(got, "wsync_servers", state="ok") == 1
        assert _value(got, "wsync_servers_excluded_total") - _value(before, "wsync_servers_excluded_total") == 1

        os.kill(a.process.pid, signal.SIGKILL)  # no server left: a failed publish, counted by its error's class
        a.process.wait(10)
        with pytest.raises(BridgeError) as failed:
            pub.publish(model, version=4)
        got = _scrape(metrics)
        kind = type(failed.value).__name__
        assert _value(got, "wsync_sync_failures_total", transport="broadcast", kind=kind) - \
            _value(before, "wsync_sync_failures_total", transport="broadcast", kind=kind) == 1, got
        assert _value(got, "wsync_published_version") == 3
    finally:
        pub.close()


def test_the_reference_servers_metrics_follow_requests_versions_and_pauses(server_factory, tiny_model_dir):
    s = server_factory(model=tiny_model_dir, extra_args=["--enable-metrics", "--served-model-name", "m"])
    got = _scrape(s.url + "/metrics")
    assert _value(got, "sglang:num_requests_total", model_name="m", engine_type="unified") == 0
    r = requests.post(s.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True, "temperature": 0}}, timeout=60)
    r.raise_for_status()
    requests.post(s.url + "/update_weight_version", json={"new_version": "7"}, timeout=10).raise_for_status()
    requests.post(s.url + "/pause_generation", json={"mode": "abort"}, timeout=10).raise_for_status()
    got = _scrape(s.url + "/metrics")
    assert _value(got, "sglang:num_requests_total") == 1 and _value(got, "sglang:num_aborted_requests_total") == 0
    assert _value(got, "sglang:prompt_tokens_total") == 3 and _value(got, "sglang:generation_tokens_total") == 4
    assert _value(got, "sglang:num_running_reqs") == 0 and _value(got, "sglang:num_queue_reqs") == 0
    assert _value(got, "wsync_server_weight_version") == 7 and _value(got, "wsync_server_paused") == 1
    assert _value(got, "wsync_server_torn") == 0


def test_wsync_watch_metrics_show_the_loaded_version_and_its_lag(server_factory, tiny_model_dir, model, tmp_path):
    s = server_factory(model=tiny_model_dir)
    nr, root, port = f"file://{tmp_path / 'nr'}", str(tmp_path / "snap"), _port()
    metrics = f"http://127.0.0.1:{port}/metrics"
    watch = subprocess.Popen([sys.executable, "-m", "wsync", "watch", "--name-resolve", nr, "--experiment", "m",
                              "--trial", "t", "--server", s.url, "--metrics-port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pub = WeightPublisher(PublisherConfig(transport="disk", servers=[s.url], name_resolve=nr, snapshot_root=root,
                                          experiment="m", trial="t", progress=False, wait_loaded_timeout=60))
    try:
        from bridge.name_resolve import make_name_resolve, names

        registry = make_name_resolve(nr)  # the watcher serves its metrics, then registers: a publish waits for both
        deadline = time.monotonic() + 60
        while _scrape_or_empty(metrics) == {} or not registry.find_subtree(names.watchers("m", "t")):
            assert watch.poll() is None and time.monotonic() < deadline, watch.stderr.read() if watch.poll() else ""
            time.sleep(0.2)
        registry.close()
        for v in (1, 2):
            _train(model, v)
            pub.publish(model, version=v)  # returns once the server serves it; the watcher counts it just after
            deadline = time.monotonic() + 10
            while _value(got := _scrape(metrics), "wsync_watch_loaded_version") != v and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _value(got, "wsync_watch_loaded_version") == v, got
            assert _value(got, "wsync_watch_lag_versions") == 0 and _value(got, "wsync_watch_lag_seconds") == 0
        assert _value(got, "wsync_watch_load_seconds_count") == 2
    finally:
        pub.close()
        watch.terminate()
        watch.wait(30)


def _scrape_or_empty(url: str) -> dict:
    try:
        return _scrape(url)
    except requests.ConnectionError:
        return {}
