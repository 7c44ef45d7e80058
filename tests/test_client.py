"""ServerClient / ServerGroup / launcher against real reference-server processes, and ProtocolFeatures."""

from __future__ import annotations

import threading

import pytest
import requests
import torch
import torch.distributed as dist

from bridge.client import ServerClient, ServerGroup
from bridge.client.capabilities import Capabilities
from bridge.digest import tensor_checksum
from bridge.errors import ConfigError, ServerError, SyncTimeout
from bridge.process_group import destroy_custom_process_group, find_free_port, init_custom_process_group
from bridge.protocol import ProtocolFeatures, parse_version
from inference_adapter import launch_server, sglang_available
from tests.fixtures_server import random_weights

PROMPT = [5, 72, 101, 108, 108, 111]


# ---------------------------------------------------------------------------------------------- features


@pytest.mark.parametrize(
    "version, release, flags",
    [
        # A release candidate has its release's features; a post release its base release's.
        ("0.5.23rc1", (0, 5, 23), dict(needs_session=True)),
        ("0.5.10.post1", (0, 5, 10), dict(needs_session=False, flattened_bucket=True, pause_mode=True, get_weight_version_route=False)),
        ("0.5.9", (0, 5, 9), dict(flattened_bucket=True, pause_mode=True, destroy_group=True, get_weight_version_route=False)),
        ("0.5.0", (0, 5, 0), dict(weight_version=False, get_weight_version_route=False)),
        ("0.4.8", (0, 4, 8), dict(batched_distributed=False)),
    ],
)
def test_protocol_features(version, release, flags):
    """Releases whose own code no test runs: between two installed releases a gate keeps its side's value, and
    below the oldest one the client claims, updates take one tensor each. The gates of every installed release
    are read off that release's code (tests/test_sglang_versions.py::test_gates_match_sglang_code)."""
    f = ProtocolFeatures.from_version(version)
    assert f.release == release and f.version == version
    for k, v in flags.items():
        assert getattr(f, k) is v, k


@pytest.mark.parametrize("version, mode, flush_while_retracted", [
    ("0.4.9", "abort", True), ("0.5.5", "abort", True),  # no pause modes: every pause aborts
    ("0.5.6", "retract", True), ("0.5.8", "retract", True),  # the flush counts running batches only
    ("0.5.9", "in_place", False), ("0.5.20", "in_place", False),  # the flush counts the retracted requests
    ("0.5.21", "retract", True), ("0.5.23", "retract", True),  # a paused flush ignores them again
])
def test_the_default_pause_keeps_requests_where_the_version_can(version, mode, flush_while_retracted):
    """docs/guarantees.md, "A sync loses no generation": ``pause_mode="auto"`` pauses each server with a mode that loses no generation where
    its version has one whose update can still flush the cache; the client never asks a server paused so
    for a flush it would refuse (0.5.6-0.5.21 would die of it)."""
    f = ProtocolFeatures.from_version(version)
    assert f.default_pause_mode == mode
    assert f.flush_refused_while_retracted is not flush_while_retracted
    c = ServerClient("http://127.0.0.1:1", version=version)
    c._paused_mode = "retract" if f.pause_mode else None  # as pause_generation("retract") leaves it
    assert c._flush(True) is (flush_while_retracted or not f.pause_mode)
    c._paused_mode = "in_place"
    assert c._flush(True) is False


def test_the_sglang_extra_asks_for_the_oldest_release_the_colocated_transport_takes():
    """``pip install "wsync[sglang]"`` is for the trainer host's colocated transport (and for launching real
    SGLang, which the client speaks from 0.4.9): its lower bound is the colocated transport's minimum."""
    import pathlib
    import re

    from bridge.transports import cuda_ipc

    text = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()  # no tomllib on 3.10
    m = re.search(r'^sglang = \["sglang>=([0-9.]+)"\]$', text, re.M)
    assert m, "pyproject.toml: the sglang extra is not one 'sglang>=X' requirement"
    assert parse_version(m.group(1)) == cuda_ipc.MIN_RELEASE, (m.group(0), cuda_ipc.MIN_RELEASE)
    assert ProtocolFeatures.from_version(m.group(1)).flattened_bucket


def test_parse_version_refuses_garbage():
    assert parse_version("v0.5.3.dev4+gabc") == (0, 5, 3)
    with pytest.raises(ConfigError, match="cannot parse SGLang version"):
        parse_version("latest")


# ---------------------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def servers(server_factory):
    a, b, old = server_factory.many([{}, {}, {"extra_args": ["--protocol-version", "0.5.2"]}])
    return {"a": a, "b": b, "old": old}


def test_client_discovers_version_and_tp(servers):
    c = ServerClient(servers["a"].url.removeprefix("http://") + "/")
    assert c.url == servers["a"].url
    assert c.version == "0.5.23" and c.features.needs_session and c.tp_size == 1
    assert ServerClient(servers["old"].url).features.release == (0, 5, 2)


def test_what_a_server_can_do_is_learned_again_when_it_restarted_behind_the_fleet():
    """One object says what a server can do (``client.can``), learned once, and again by a publish's fleet for a
    server that answers behind the fleet's version: one restarted at the same URL as another release is spoken to
    as what it now is."""
    from bridge import PublisherConfig
    from bridge.fleet import Fleet
    from tests.fixtures_server import launch_forked

    port = find_free_port()
    first = launch_forked(port=port)
    fleet = Fleet(PublisherConfig(servers=[first.url], progress=False, probe_timeout=10), "e/t")
    try:
        fleet.prepare()
        c = fleet.clients[first.url]
        assert c.can.extensions and c.can.staged and c.can.delta == "native" and c.can.features.needs_session
    finally:
        first.stop()
    again = launch_forked(port=port, extra_args=["--protocol-version", "0.5.8"])
    try:
        assert c.probe(10.0) == "default" and c.can.staged, "learned once: a probe does not ask again"
        fleet.version = "3"  # as a commit of version 3 leaves it: the restarted server is behind
        fleet.prepare()
        assert c.can.version == "0.5.8" and not c.can.staged and not c.features.needs_session
        assert c.can.zstd_records  # the reference server reads or refuses zstd records whatever its dialect
    finally:
        fleet.close()
        again.stop()


def test_client_errors_are_the_projects_own(servers):
    dead = ServerClient(f"http://127.0.0.1:{find_free_port()}", timeout=5)
    with pytest.raises(ServerError) as e:
        dead.model_info()
    # Its version is not known yet, so the first call is the /server_info look-up.
    assert e.value.status is None and e.value.route == "/server_info" and dead.url in str(e.value)
    assert not dead.health()

    c = servers["a"].client
    with pytest.raises(ServerError) as e:
        c.update_weights_from_distributed(["x"], ["bfloat16"], [[1]], group_name="nope")
    assert e.value.status == 400 and e.value.route == "/update_weights_from_distributed"
    assert "must run between begin_weight_update" in e.value.message and c.url in str(e.value)  # 0.5.23 checks first
    with pytest.raises(ConfigError, match="exactly one of"):
        c.generate()

    c.pause_generation("abort")
    try:
        with pytest.raises(SyncTimeout, match=f"{c.url}/generate"):
            c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, timeout=0.5)
    finally:
        c.continue_generation()
    # Resumed: it generates again (ignore_eos, so a sampled end-of-sequence cannot cut it short).
    out = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2


def test_an_unreachable_server_is_one_line_with_the_cause_and_the_fix_first(monkeypatch):
    """A wrong port: the client and a publish say "cannot reach URL: connection refused; check the address ...",
    once, without urllib3's report (which names the URL three times); --debug / WSYNC_DEBUG=1 adds it back."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError
    from tests.fixtures_server import local_model

    url = f"http://127.0.0.1:{find_free_port()}"
    line = f"cannot reach {url}: connection refused; check the address and that the server runs"
    monkeypatch.delenv("WSYNC_DEBUG", raising=False)
    with pytest.raises(ServerError) as e:
        ServerClient(url, timeout=5).model_info()
    assert str(e.value) == line and e.value.status is None
    with WeightPublisher(PublisherConfig(servers=[url], progress=False)) as pub, pytest.raises(BridgeError) as e:
        pub.publish(local_model(random_weights(seed=1)), version=1)
    text = str(e.value)
    assert line in text and text.count(url) == 1 and "\n" not in text, text
    assert "HTTPConnectionPool" not in text and "Max retries" not in text and "start or repair" not in text, text
    monkeypatch.setenv("WSYNC_DEBUG", "1")
    with pytest.raises(ServerError) as e:
        ServerClient(url, timeout=5).model_info()
    assert str(e.value).startswith(line) and "Max retries" in str(e.value)


def test_old_server_dialect(servers):
    c = servers["old"].client
    assert "needs no update session" in c.begin_weight_update()["message"]
    assert "needs no update session" in c.end_weight_update()["message"]
    assert "stays open" in c.destroy_weights_update_group("g")["message"]
    with pytest.raises(ConfigError, match="0.5.6"):
        c.update_weights_from_distributed(["a"], [torch.bfloat16], [[1]], load_format="flattened_bucket")
    assert c.pause_generation("retract")["status"] == "ok"  # sent without a mode
    c.continue_generation()
    assert c.update_weight_version("old-v")["new_version"] == "old-v"
    # 0.5.2 has no /server_info or /model_info: the client found /get_server_info and reads /get_model_info.
    assert requests.get(c.url + "/server_info").status_code == 404
    assert c.model_info()["weight_version"] == "old-v" and c.wait_ready(timeout=5)["weight_version"] == "old-v"
    # The shared-memory extension is refused before anything is sent to a server that is not the reference server.
    fake = ServerClient(c.url, version="0.5.23")
    fake._can = Capabilities.from_server_info({"version": "0.5.23"}, "0.5.23")  # what real SGLang's info says
    with pytest.raises(ConfigError, match="not the wsync reference server"):
        fake.update_weights_from_tensor(["e30="], load_format="wsync_shm")
    assert c.can.extensions


def _sync_group(group: ServerGroup, weights: dict, version: str, *, flattened: bool, name: str) -> None:
    """What the publisher does: group init through submit, session, one bucket, end, destroy."""
    port = find_free_port()
    futures = group.submit(lambda c: c.init_weights_update_group(
        "127.0.0.1", port, group.rank_offsets()[group.urls.index(c.url)], group.world_size(), name, "gloo", 60))
    pg = init_custom_process_group(master_address="127.0.0.1", master_port=port, world_size=group.world_size(),
                                   rank=0, group_name=name, backend="gloo", timeout=30)
    try:
        for f in futures:
            f.result(timeout=60)
        group.begin_weight_update()
        items = sorted(weights.items(), key=lambda kv: -kv[1].element_size())
        fields = dict(names=[n for n, _ in items], dtypes=[t.dtype for _, t in items], shapes=[t.shape for _, t in items])
        futures = group.submit(lambda c: c.update_weights_from_distributed(
            **fields, group_name=name, load_format="flattened_bucket" if flattened else None, weight_version=version))
        if flattened:
            dist.broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in items]), src=0, group=pg)
        else:
            for _, t in items:
                dist.broadcast(t.contiguous(), src=0, group=pg)
        for f in futures:
            assert f.result(timeout=60)["success"]
        group.end_weight_update()
    finally:
        group.map(lambda c: c.destroy_weights_update_group(name))
        destroy_custom_process_group(pg)


@pytest.mark.parametrize("flattened", [True, False])
def test_group_broadcast_reaches_every_server(servers, flattened):
    """Trainer + two servers in one group (world size 3): a broadcast reaches both, bit for bit."""
    group = ServerGroup([servers["a"].url, servers["b"].url])
    assert group.rank_offsets() == [1, 2] and group.world_size() == 3
    w = random_weights(seed=20 + flattened)
    _sync_group(group, w, f"group-{flattened}", flattened=flattened, name=f"g3-{flattened}")
    assert group.weight_versions() == {u: f"group-{flattened}" for u in group.urls}
    for sums in group.map(lambda c: c.weights_checksum()["checksums"]):
        assert all(sums[n] == tensor_checksum(t) for n, t in w.items())
    group.close()


def test_mixed_version_group_per_tensor(servers):
    """A 0.5.23 and a 0.5.2 server in one group: the client speaks each one's dialect."""
    group = ServerGroup([servers["a"].client, servers["old"].client])
    w = {"model.norm.weight": torch.full((128,), 1.5, dtype=torch.bfloat16),
         "model.layers.1.mlp.gate_proj.weight": torch.full((256, 128), -0.5, dtype=torch.bfloat16)}
    _sync_group(group, w, "mixed", flattened=False, name="g-mixed")
    assert set(group.weight_versions().values()) == {"mixed"}
    for sums in group.map(lambda c: c.weights_checksum(list(w))["checksums"]):
        assert sums == {n: tensor_checksum(t) for n, t in w.items()}


def test_group_map_and_submit(servers):
    group = ServerGroup([servers["a"].url, servers["old"].url], timeout=30)
    assert [f.result()["weight_version"] for f in group.submit(lambda c: c.model_info())] == \
        [i["weight_version"] for i in group.model_info()]
    with pytest.raises(ServerError) as e:  # no session open on the 0.5.23 server; the 0.5.2 one has no sessions
        group.end_weight_update()
    assert e.value.server == servers["a"].url and "No weight update session is open" in e.value.message

    def boom(c):
        raise RuntimeError("not a bridge error")

    with pytest.raises(ServerError, match="RuntimeError: not a bridge error") as e:
        group.map(boom)
    assert e.value.server == servers["a"].url

    group.pause_generation("abort")
    try:
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("e", _catch(lambda: group.map(
            lambda c: c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}), timeout=0.5))))
        th.start()
        th.join(timeout=30)
        assert isinstance(box["e"], SyncTimeout) and servers["a"].url in str(box["e"])
    finally:
        group.continue_generation()
    versions = group.update_weight_version("gv")
    assert [v["new_version"] for v in versions] == ["gv", "gv"]
    assert group.weight_versions() == {servers["a"].url: "gv", servers["old"].url: "gv"}
    group.close()


def _catch(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


# ---------------------------------------------------------------------------------------------- launcher


def test_launcher_reports_early_exit_with_log_tail(tmp_path):
    with pytest.raises(ServerError, match="exited with code") as e:
        launch_server(model=str(tmp_path / "missing"), use_sglang=False, ready_timeout=120)
    assert "not a directory" in e.value.message


def test_launcher_serves_a_model_dir(tiny_model_dir):
    with launch_server(model=tiny_model_dir, use_sglang=False, dtype="float32", extra_args=["--weight-version", "w0"]) as s:
        assert s.kind == "reference" and s.alive()
        assert s.client.model_info()["weight_version"] == "w0"
        info = s.client.server_info()
        assert info["dtype"] == "float32" and info["model_path"] == tiny_model_dir
        sums = s.client.weights_checksum(["model.norm.weight"])
        assert sums["dtypes"]["model.norm.weight"] == "float32"
    assert not s.alive()


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang and CUDA")
def test_real_sglang_speaks_the_same_protocol(tiny_model_dir):
    with launch_server(model=tiny_model_dir, use_sglang=True, ready_timeout=600) as s:
        assert s.kind == "sglang"
        c = s.client
        assert c.features.release >= (0, 5, 10)
        out = c.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert out["meta_info"]["completion_tokens"] == 4 and "weight_version" in out["meta_info"]


def test_a_connection_idle_near_the_servers_keep_alive_is_not_reused(servers):
    """SGLang (uvicorn, ``SGLANG_TIMEOUT_KEEP_ALIVE`` 5 s) closes a keep-alive connection after 5 s idle, and a
    request sent on it as it closes is reset: seen beside two CPU hogs as "connection reset" at a publish's
    begin, the server alive, the steps about 5 s apart. A thread's connection idle for longer than
    ``IDLE_REUSE_S`` is replaced by a new one; a busy one is reused."""
    import time

    from bridge.client.connection import IDLE_REUSE_S, Connection

    assert IDLE_REUSE_S <= 5.0 / 2  # well inside the keep-alive of SGLang and the reference server
    conn = Connection(servers["a"].url, api_key=None, admin_api_key=None, timeout=10)
    conn.call("GET", "/health", text=True)
    first = conn._session()
    conn.call("GET", "/health", text=True)
    assert conn._session() is first  # reused while busy
    time.sleep(IDLE_REUSE_S + 0.5)
    conn.call("GET", "/health", text=True)
    assert conn._session() is not first  # idle past the bound: a new connection
