"""The client against SGLang's own code (the ``sglang_code`` tier): 0.5.23, 0.5.6 and 0.4.9 on CPU.

Each receiving server is :mod:`tests.sglang_harness.serve`: SGLang's HTTP app, tokenizer-side and
scheduler-side weight-update, pause/continue, abort and flush code, model-runner receive/load code and Qwen2
``load_weights`` (q/k/v and gate/up stacked) of that release, around a transformers forward pass (see that
module for exactly what is stubbed). Served tensors carry SGLang's names and are compared with the trainer's
through :func:`tests.sglang_harness.serve.sglang_layout`. ``scripts/install_sglang.sh`` installs the releases.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import requests
import torch

from bridge.client import ServerClient, ServerGroup
from bridge.digest import tensor_checksum
from bridge.errors import ConfigError, ServerError
from bridge.process_group import destroy_custom_process_group, find_free_port, init_custom_process_group
from bridge.protocol import parse_version
from tests import sync_bodies as sb
from tests.dist_utils import run_ranks
from tests.sglang_harness import VERSIONS, installed, launch
from tests.sglang_harness.serve import sglang_layout

pytestmark = pytest.mark.sglang_code


def _need(version: str) -> None:
    if not installed(version):
        pytest.skip(f"SGLang {version} is not installed (bash scripts/install_sglang.sh)")


# The newest release's whole server runs these in the real tier (tests/test_real_sglang.py): here the older ones.
older_releases = pytest.mark.older_releases
# One release stands for all (tests/conftest.py collects the newest only).
newest_release = pytest.mark.newest_release


@pytest.fixture(scope="module", params=VERSIONS)
def server(request, tiny_model_dir):
    _need(request.param)
    with launch(request.param, tiny_model_dir) as s:
        yield s


def _served_equal(srv, want: dict[str, torch.Tensor]) -> None:
    """Every tensor SGLang serves for ``want`` (HF names) is bit-equal: stacked ones (``qkv_proj``,
    ``gate_up_proj``, loaded by SGLang's Qwen2 ``load_weights``) to the trainer's q/k/v and gate/up slices."""
    want = sglang_layout(want)
    got = srv.checksums()["checksums"]
    bad = [n for n, t in want.items() if n in got and got[n] != tensor_checksum(t)]
    assert not bad, f"SGLang {srv.version}: served tensors differ from the trainer's: {bad[:5]}"
    missing = [n for n in want if n not in got]
    assert not missing, f"SGLang {srv.version} serves none of {missing}"  # every one (the tied head is neither sent nor served apart)


# ---------------------------------------------------------------------------------------------- discovery


def test_discovery_routes_and_version(server):
    c = ServerClient(server.url)
    assert c.version == server.version and c.tp_size == 1
    old = parse_version(server.version) < (0, 5, 6)
    # SGLang's own app: /server_info and /model_info exist only from 0.5.6.
    assert requests.get(server.url + "/server_info").status_code == (404 if old else 200)
    assert requests.get(server.url + "/model_info").status_code == (404 if old else 200)
    assert c.wait_ready(timeout=10)["model_path"]
    assert not c.can.extensions
    if c.features.weight_version:
        assert c.update_weight_version("v-set")["success"]
        assert c.model_info()["weight_version"] == "v-set"
        assert ServerGroup([server.url]).weight_versions() == {c.url: "v-set"}
    else:
        with pytest.raises(ConfigError, match="0.5.1"):
            c.update_weight_version("x")
    # /get_weight_version: 0.5.1-0.5.8 only.
    assert (requests.get(server.url + "/get_weight_version").status_code == 200) == c.features.get_weight_version_route
    assert server.alive()


# ---------------------------------------------------------------------------------------------- broadcast


def _train_and_publish(url: str, config: dict, steps: int, transport: str = "broadcast"):
    from bridge import PublisherConfig, WeightPublisher
    from wsync.tasks import make_batch

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(transport=transport, servers=[url], bucket_mb=0.25, group_timeout=60,
                                          progress=False, **config))
    out = []
    try:
        for step in range(1, steps + 1):
            engine.train_batch(make_batch(engine.tokenizer, 8, seed=step * 7 + engine.rank))
            res = pub.publish(engine, version=step)
            full = {s.name: t for s, t in engine.iter_full_tensors()}  # collective (None off rank 0)
            if engine.rank == 0:
                full = sglang_layout(full)  # SGLang's Qwen2 stacks q/k/v and gate/up on load
                c = ServerClient(url)
                got = requests.get(url + "/wsync_harness/weights", timeout=30).json()["checksums"]
                out.append(dict(
                    version=res.version, buckets=res.buckets, servers=res.servers,
                    bad=[n for n, t in full.items() if n in got and got[n] != tensor_checksum(t.to(torch.bfloat16))],
                    compared=len([n for n in full if n in got]), total=len(full),
                    stacked=len([n for n in full if n in got and (".qkv_proj." in n or ".gate_up_proj." in n)]),
                    reported=c.model_info().get("weight_version"),
                ))
        return out
    finally:
        pub.close()
        engine.destroy()


@older_releases
def test_publish_broadcast_bit_equal(server):
    """A 2-rank FSDP2 trainer publishes twice as one request (the default for a sync this small: one broadcast
    per tensor), then bucket by bucket (``atomic_mb=0``: flattened buckets where SGLang takes them, 0.5.x, per
    tensor on 0.4.9); every served tensor is bit-equal to the trainer's."""
    f = ServerClient(server.url).features
    for config in (dict(), dict(atomic_mb=0)):
        rank0, _ = run_ranks(_train_and_publish, 2, args=(server.url, config, 2), timeout=400)
        assert [r["version"] for r in rank0] == [1, 2], config
        for r in rank0:
            assert r["servers"] == {server.url: "ok"} and r["buckets"] > 1
            assert not r["bad"], f"SGLang {server.version} ({config}): {r['bad'][:5]} differ"
            assert r["compared"] == r["total"], r  # every tensor, not a sample
            assert r["stacked"] >= 3 * 2  # per layer: qkv weight and bias, gate_up (SGLang's stacking ran)
            if f.weight_version:
                assert r["reported"] == str(r["version"])
    assert server.alive()


# ---------------------------------------------------------------------------------------------- disk


@older_releases
def test_disk_load_bit_equal_and_version(server, tmp_path):
    from safetensors.torch import load_file

    from bridge.local.presets import make_model_dir

    d = make_model_dir(tmp_path / "m", "tiny", seed=11)
    c = ServerClient(server.url)
    r = c.update_weights_from_disk(d, weight_version="d11")
    assert r["success"], r
    want = {n: t.to(torch.bfloat16) for n, t in load_file(f"{d}/model.safetensors").items()}
    _served_equal(server, want)
    if c.features.weight_version:  # the version rides on the disk request from 0.5.1 (was 0.5.2)
        assert c.model_info()["weight_version"] == "d11"
    with pytest.raises(ServerError):
        c.update_weights_from_disk(str(tmp_path / "missing"))
    _served_equal(server, want)  # a failed load left the weights as they were


# ---------------------------------------------------------------------------------------------- control


def _one_bucket(c: ServerClient, weights: dict[str, torch.Tensor], *, flattened: bool, version: str | None,
                group: str, flush_cache: bool = True) -> dict:
    port = find_free_port()
    t = threading.Thread
    res: dict = {}
    th = t(target=lambda: res.update(init=c.init_weights_update_group("127.0.0.1", port, 1, 2, group, "gloo", 60)))
    th.start()
    pg = init_custom_process_group(master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                                   group_name=group, backend="gloo", timeout=30)
    th.join(60)
    try:
        items = sorted(weights.items(), key=lambda kv: -kv[1].element_size())
        fields = dict(names=[n for n, _ in items], dtypes=[x.dtype for _, x in items], shapes=[list(x.shape) for _, x in items])
        err: list = []

        def send():
            try:
                res["update"] = c.update_weights_from_distributed(
                    **fields, group_name=group, load_format="flattened_bucket" if flattened else None,
                    weight_version=version, flush_cache=flush_cache)
            except Exception as e:
                err.append(e)

        th = t(target=send)
        th.start()
        if flattened:
            torch.distributed.broadcast(torch.cat([x.reshape(-1).view(torch.uint8) for _, x in items]), src=0, group=pg)
        else:
            for _, x in items:
                torch.distributed.broadcast(x.contiguous(), src=0, group=pg)
        th.join(60)
        if err:
            raise err[0]
        res["destroy"] = c.destroy_weights_update_group(group)
        return res
    finally:
        destroy_custom_process_group(pg)


def test_pause_sessions_destroy_retry(server):
    c = ServerClient(server.url)
    w = {"model.norm.weight": torch.full((128,), 0.5, dtype=torch.bfloat16),
         "model.layers.0.mlp.down_proj.weight": torch.randn(128, 256).to(torch.bfloat16)}
    c.pause_generation("retract" if c.features.pause_mode else "abort")
    c.begin_weight_update()  # a real session on 0.5.21+, a no-op before
    r = _one_bucket(c, w, flattened=c.features.flattened_bucket, version="p1" if c.features.weight_version else None,
                    group="g-a")
    c.end_weight_update()
    c.continue_generation()
    assert r["init"]["success"] and r["update"]["success"] and r["destroy"]["success"]
    _served_equal(server, w)
    # Retry: the same group name again after destroy (a new one where the server cannot destroy: SGLang
    # 0.4.9 refuses a group name it has seen), per-tensor this time, same weights.
    c.begin_weight_update()
    r = _one_bucket(c, w, flattened=False, version=None, group="g-a" if c.features.destroy_group else "g-b")
    c.end_weight_update()
    assert r["update"]["success"]
    _served_equal(server, w)
    if c.features.needs_session:  # SGLang's own gate: no session, no update
        raw = requests.post(server.url + "/update_weights_from_distributed", json={
            "names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[128]]})
        assert raw.status_code == 400 and "begin_weight_update" in raw.json()["message"]
        assert requests.post(server.url + "/end_weight_update", json={}).status_code == 400  # none open
    else:
        assert requests.post(server.url + "/begin_weight_update", json={}).status_code == 404
    if not c.features.destroy_group:
        assert requests.post(server.url + "/destroy_weights_update_group", json={}).status_code == 404
    assert server.alive()


def _scheduler(srv) -> dict:
    """The harness's view of SGLang's own scheduler state: running / waiting request counts, paused flag."""
    return requests.get(srv.url + "/wsync_harness/scheduler", timeout=10).json()


def _until(check, seconds: float = 20.0) -> bool:
    """Whether ``check()`` came true within ``seconds`` (polled every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@older_releases
def test_pause_modes_with_a_request_in_flight(server):
    """SGLang's own scheduler handlers decide what a pause does to a running request: ``abort`` ends it
    (SGLang's ``abort_request`` marks it, the pause returns once it left), ``retract`` moves it back to the
    waiting queue (SGLang's ``pause_generation``), where SGLang's ``flush_cache`` ignores it, so an update
    asking for a flush succeeds; after ``continue`` the request finishes normally."""
    c = ServerClient(server.url)
    held: dict = {}

    def generate(key, hold):
        held[key] = c.generate(input_ids=[1, 2, 3], timeout=120,
                               sampling_params={"max_new_tokens": 2, "custom_params": {"harness_hold_s": hold}})

    def in_flight(key, hold):
        th = threading.Thread(target=generate, args=(key, hold))
        th.start()
        assert _until(lambda: _scheduler(server)["running"] == 1), _scheduler(server)  # (waiting, then running)
        return th

    th = in_flight("abort", 60)
    t0 = time.monotonic()
    c.pause_generation("abort")
    th.join(30)
    assert not th.is_alive() and time.monotonic() - t0 < 10  # not the 60 s hold: SGLang aborted it
    assert held["abort"]["meta_info"]["finish_reason"]["type"] == "abort"
    # (SGLang drops the aborted request from its running batch at its next step, which may come just after the answer)
    assert _until(lambda: _scheduler(server)["running"] == 0), _scheduler(server)
    c.continue_generation()
    if c.features.pause_mode:
        th = in_flight("retract", 2)
        c.pause_generation("retract")
        st = _scheduler(server)
        assert (st["running"], st["waiting"], st["paused"]) == (0, 1, True)
        w = {"model.norm.weight": torch.full((128,), 0.625, dtype=torch.bfloat16)}
        c.begin_weight_update()
        r = _one_bucket(c, w, flattened=c.features.flattened_bucket, version=None, group="g-rt", flush_cache=True)
        c.end_weight_update()
        assert r["update"]["success"] and server.alive()
        time.sleep(3)
        assert th.is_alive()  # paused: the retracted request waits
        c.continue_generation()
        th.join(30)
        assert held["retract"]["meta_info"]["finish_reason"]["type"] == "length"
        _served_equal(server, w)
    assert _scheduler(server) == {"running": 0, "waiting": 0, "paused": False}
    assert server.alive()


def test_shm_extension_refused_before_sending(server):
    c = ServerClient(server.url)
    with pytest.raises(ConfigError, match="not the wsync reference server"):
        c.update_weights_from_tensor(["e30="], load_format="wsync_shm")
    assert server.alive() and c.wait_ready(timeout=5)


# ---------------------------------------------------------------------------------------------- in place + flush


@pytest.mark.parametrize("version", ["0.5.6"])
def test_in_place_pause_never_asks_for_a_flush(version, tiny_model_dir):
    """Paused in place with a request in flight: the client's update succeeds (it sends flush_cache=False);
    the same update asking for a flush kills the server (0.5.6-0.5.21; 0.5.22+ fail the update). Real SGLang
    0.5.23 takes publishes paused in place while clients generate in tests/test_real_sglang.py."""
    _need(version)
    w = {"model.norm.weight": torch.full((128,), 0.75, dtype=torch.bfloat16)}
    with launch(version, tiny_model_dir) as srv:
        c = ServerClient(srv.url)
        def generate():  # in flight during the update; on 0.5.6 the server dies under it, as it should
            with contextlib.suppress(ServerError):
                c.generate(input_ids=[1, 2, 3], timeout=120,
                           sampling_params={"max_new_tokens": 2, "custom_params": {"harness_hold_s": 5}})

        gen = threading.Thread(target=generate)
        gen.start()
        deadline = time.monotonic() + 20
        while _scheduler(srv)["running"] == 0:  # the request is in flight (polled, not a fixed wait)
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        c.pause_generation("in_place")
        assert _scheduler(srv)["running"] == 1, _scheduler(srv)  # paused in place, still in flight
        c.begin_weight_update()
        r = _one_bucket(c, w, flattened=True, version="ip1", group="g-ip")
        c.end_weight_update()
        assert r["update"]["success"] and srv.alive()
        _served_equal(srv, w)
        # Without the client's guard: SGLang's own scheduler code refuses the flush.
        c._paused_mode = None
        c.begin_weight_update()
        if c.features.flush_asserts:
            with pytest.raises(Exception):  # noqa: B017 - any error: SGLang's scheduler refuses in its own way
                _one_bucket(c, w, flattened=True, version="ip2", group="g-ip2")
            deadline = time.monotonic() + 20
            while srv.alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not srv.alive() and "Cache flush failed" in srv.log_tail(200)
        else:
            with pytest.raises(ServerError, match="cache was not flushed"):
                _one_bucket(c, w, flattened=True, version="ip2", group="g-ip2")
            c.end_weight_update()
            c.continue_generation()
            assert srv.alive()
        gen.join(60)


# ---------------------------------------------------------------------------------------------- keys


@pytest.fixture(scope="module")
def keyed_llama(tmp_path_factory):
    """SGLang 0.5.23 with both keys, serving a Llama of the tiny preset's sizes (its model class answers
    ``/get_weights_by_name``, which the preflight asks); the key and the preflight tests share it."""
    _need("0.5.23")
    with launch("0.5.23", _llama_dir(tmp_path_factory.mktemp("llama")), api_key="user-key",
                admin_api_key="admin-key") as srv:
        yield srv


def test_api_key_and_admin_key(keyed_llama):
    """SGLang's own auth middleware with both keys: the client's admin key opens the control routes."""
    srv = keyed_llama
    both = ServerClient(srv.url, api_key="user-key", admin_api_key="admin-key")
    assert both.update_weight_version("k1")["success"] and both.model_info()["weight_version"] == "k1"
    both.pause_generation("retract")
    both.continue_generation()
    with pytest.raises(ServerError) as e:
        ServerClient(srv.url, api_key="user-key").update_weight_version("k2")
    assert e.value.status == 401
    with pytest.raises(ServerError) as e:
        ServerClient(srv.url, api_key="admin-key").model_info()
    assert e.value.status == 401
    assert ServerGroup([srv.url], api_key="user-key", admin_api_key="admin-key").weight_versions() == {srv.url: "k1"}


@older_releases
def test_colocated_from_a_trainer_without_cuda(server):
    """Colocated from a trainer without CUDA: each bucket in shared memory, handed over as SGLang's plain per-tensor
    payload. SGLang 0.5.6's own receive code serves it bit-equal (0.5.23's whole server takes it in the real tier);
    0.4.9 moves every tensor it is handed to CUDA, so it is refused before anything moves, naming the release."""
    from bridge import PublisherConfig, WeightPublisher

    if parse_version(server.version) < (0, 5, 1):
        pub = WeightPublisher(PublisherConfig(transport="colocated", servers=[server.url], progress=False))
        try:
            with pytest.raises(ConfigError, match=r"SGLang >= 0\.5\.1"):
                pub.publish(torch.nn.Linear(4, 4), version=1)
        finally:
            pub.close()
        assert server.alive() and ServerClient(server.url).features.release < (0, 5, 1)
        return
    rank0, _ = run_ranks(_train_and_publish, 2, args=(server.url, {}, 2, "colocated"), timeout=400)
    for r in rank0:
        assert r["servers"] == {server.url: "ok"} and r["buckets"] > 1
        assert not r["bad"] and r["compared"] == r["total"], r
        assert r["reported"] == str(r["version"])
    assert server.alive()


@newest_release
def test_a_refused_update_in_a_session_and_the_publishers_clean_up(server, ref_server):
    """A bucket refused inside a session (its group does not exist): SGLang 0.5.23's own scheduler keeps the
    session open (ending it answers 200), the reference server ends it (ending it answers 400, naming why;
    docs/guarantees.md states the difference). The publisher's clean-up after a failed sync
    (``discard_session``) leaves both without an open session, so the next sync can begin."""
    from bridge.transports.sessions import discard_session


    def refuse_one(c: ServerClient) -> None:
        c.begin_weight_update()
        with pytest.raises(ServerError) as ei:
            c.update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[128]], group_name="no-such-group")
        assert ei.value.status == 400

    sglang, ref = ServerClient(server.url), ref_server.client
    for c in (sglang, ref):  # what each answers to ending the session after the refusal
        refuse_one(c)
    assert sglang.end_weight_update()["success"]
    with pytest.raises(ServerError, match="aborted") as ei:
        ref.end_weight_update()
    assert ei.value.status == 400
    for c in (sglang, ref):  # the publisher's clean-up, then a new sync begins and ends
        refuse_one(c)
        discard_session(c)
        c.begin_weight_update()
        c.end_weight_update()
    assert server.alive()


# ---------------------------------------------------------------------------------------------- a label, one set of weights


def _publish_v23(url: str, steps: int, extra: dict) -> dict:
    """A new trainer: ``steps`` training steps, one publish of version 23; its outcome and (rank 0) its own
    weights as SGLang serves them (q/k/v and gate/up stacked)."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError

    engine = sb.engine()
    for s in range(steps):
        sb.train_step(engine, seed=s)
    pub = WeightPublisher(PublisherConfig(servers=[url], bucket_mb=0.25, group_timeout=60, progress=False, **extra))
    try:
        try:
            res = pub.publish(engine, version=23)
            out = {"ok": True, "retried": res.retried}
        except BridgeError as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        full = {s.name: t for s, t in engine.iter_full_tensors()}  # collective (None off rank 0)
        if engine.rank == 0:
            out["own"] = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in sglang_layout(full).items()}
        return out
    finally:
        pub.close()
        engine.destroy()


@newest_release
def test_a_new_process_cannot_relabel_real_sglang_with_other_weights(server, tmp_path, monkeypatch):
    """SGLang keeps no digest of what it serves: the publisher records one at commit beside the run (here in
    ``writer_lock``'s name resolution) and a new trainer process compares its own with it before anything moves.
    Other weights under the served version are refused; the same weights are a safe retry; ``new_run=True``
    passes; a label with no record (set outside wsync) cannot be compared, and is refused as such."""
    extra = {"writer_lock": f"file://{tmp_path / 'nr'}", "experiment": "relabel", "trial": server.version}

    def run(steps: int, **more) -> dict:
        rank0, rank1 = run_ranks(_publish_v23, 2, args=(server.url, steps, {**extra, **more}), timeout=400)
        assert {k: v for k, v in rank1.items()} == {k: v for k, v in rank0.items() if k != "own"}
        return rank0

    def served() -> dict:
        got = server.checksums()
        assert got["weight_version"] == "23", got["weight_version"]
        return got["checksums"]

    first = run(1)
    assert first["ok"], first
    assert {n: served()[n] for n in first["own"]} == first["own"]
    monkeypatch.setenv("WSYNC_FAILPOINTS", "begin@0=RuntimeError")  # a refusal any later would be a SyncError
    other = run(3)
    monkeypatch.delenv("WSYNC_FAILPOINTS")
    assert not other["ok"] and other["error"].startswith("VersionError: "), other
    assert f"{server.url} already serves version 23 with other weights" in other["error"], other["error"]
    assert {n: served()[n] for n in first["own"]} == first["own"], "the refused publish changed SGLang's weights"
    again = run(1)
    assert again["ok"] and again["retried"], again
    restarted = run(3, new_run=True)
    assert restarted["ok"] and not restarted["retried"], restarted
    assert {n: served()[n] for n in restarted["own"]} == restarted["own"]
    extra["writer_lock"] = f"file://{tmp_path / 'elsewhere'}"  # a trainer whose records live elsewhere
    unknown = run(3)
    assert not unknown["ok"] and "cannot be compared" in unknown["error"], unknown
    assert server.alive()


# ---------------------------------------------------------------------------------------------- one writer at a time

_HOLDER = """
import sys
from bridge import PublisherConfig, WeightPublisher
from tests.fixtures_server import local_model, random_weights
# atomic_mb=0: bucket by bucket, so SGLang's scheduler is free between buckets and answers the other trainer, which is
# then refused by the lock (a sync in one request keeps the scheduler receiving until its end: the other trainer waits).
pub = WeightPublisher(PublisherConfig(servers=[sys.argv[1]], experiment="lock", trial=sys.argv[2], bucket_mb=0.1,
                                      progress=False, writer_lease=2, writer_lock=sys.argv[3], atomic_mb=0))
pub.publish(local_model(random_weights(seed=7)), version=int(sys.argv[4]))
"""


@newest_release
def test_two_trainers_share_real_sglang_through_the_writer_lock(server, tmp_path):
    """SGLang has no writer lease: with ``writer_lock`` the publishers take a lock with a lease per server in
    name resolution. While one holds it mid-sync, another is refused naming its run and leaves its session
    alone (it completes); one SIGKILLed mid-sync is taken over once its lock ran out, and the session it left
    open on SGLang is discarded then, not before."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError
    from bridge.name_resolve import make_name_resolve
    from bridge.protocol import ANOTHER_WRITER
    from bridge.transports.lease import lock_key
    from tests.fixtures_server import local_model, random_weights

    lock = f"file://{tmp_path / 'locks'}"
    nr = make_name_resolve(lock)

    def holder(trial: str, version: int) -> subprocess.Popen:
        env = {**os.environ, "WSYNC_FAILPOINTS": "bucket:1@0=sleep:6" if trial == "A" else "bucket:1@0=sleep:60"}
        p = subprocess.Popen([sys.executable, "-c", _HOLDER, server.url, trial, lock, str(version)], env=env,
                             stderr=subprocess.PIPE, text=True)
        # Until its sync sleeps at bucket 1 (bucket 0 sent): a kill earlier, while SGLang's scheduler waits in a
        # receive or a group's rendezvous from it, would block SGLang itself until that times out.
        for line in p.stderr:
            sys.stderr.write(line)
            if "failpoint bucket:1 on rank 0: sleeping" in line:
                break
        assert p.poll() is None and nr.find_subtree("wsync/writer_lock") and _scheduler(server)["paused"], \
            "the holder never took the server"
        threading.Thread(target=lambda: [sys.stderr.write(line) for line in p.stderr], daemon=True).start()
        return p

    def publish_b(version: int, seed: int) -> list[str]:
        refusals = []
        with WeightPublisher(PublisherConfig(servers=[server.url], experiment="lock", trial="B", bucket_mb=0.1,
                                             progress=False, writer_lease=2, writer_lock=lock)) as pub:
            while True:
                try:
                    pub.publish(local_model(random_weights(seed=seed)), version=version)
                    return refusals
                except BridgeError as e:
                    assert ANOTHER_WRITER in str(e) and "lock/A" in str(e) and len(refusals) < 300, e
                    refusals.append(str(e))
                    time.sleep(0.1)

    a = holder("A", 11)  # holds the server 6 s mid-sync, then completes
    refused = publish_b(12, seed=8)
    assert a.wait(60) == 0, "the refused trainer broke the holder's sync"
    assert refused, "B was never refused"
    assert nr.find_subtree("wsync/writer_lock") == []
    _served_equal(server, random_weights(seed=8))  # then B's sync went through
    a = holder("A", 13)  # killed mid-sync: its session stays open on SGLang, paused
    a.send_signal(signal.SIGKILL)
    a.wait()
    killed = time.monotonic()
    assert nr.find_subtree("wsync/writer_lock") == [lock_key(server.url)]
    refused = publish_b(14, seed=9)
    taken = time.monotonic() - killed
    assert refused and taken >= 2 * 2 / 3 - 0.2, taken  # not before A's lock ran out (renewed every 2/3 s)
    _served_equal(server, random_weights(seed=9))
    assert ServerClient(server.url).model_info()["weight_version"] == "14" and not _scheduler(server)["paused"]
    nr.close()
    assert server.alive()


# ---------------------------------------------------------------------------------------------- preflight


def _llama_dir(path, **overrides) -> str:
    """The tiny preset's sizes as a Llama (tied head, as the preset): SGLang's Llama answers
    ``/get_weights_by_name``, its Qwen2 does not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bridge.local.presets import build_config, build_tokenizer

    q = build_config("tiny")
    cfg = LlamaConfig(**{**dict(
        vocab_size=q.vocab_size, hidden_size=q.hidden_size, intermediate_size=q.intermediate_size,
        num_hidden_layers=q.num_hidden_layers, num_attention_heads=q.num_attention_heads,
        num_key_value_heads=q.num_key_value_heads, max_position_embeddings=q.max_position_embeddings,
        rms_norm_eps=q.rms_norm_eps, tie_word_embeddings=True, pad_token_id=q.pad_token_id,
        bos_token_id=q.bos_token_id, eos_token_id=q.eos_token_id), **overrides})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return str(path)


_TOUCHED = ("init custom process group", "continue_generation", "Weight version changed")  # SGLang's own log lines


def _keyed_weights(url: str) -> dict:
    """The harness's checksums of what SGLang serves, through SGLang's key middleware."""
    r = requests.get(url + "/wsync_harness/weights", headers={"Authorization": "Bearer user-key"}, timeout=30)
    return r.json()["checksums"]


def _touched(log_path: str) -> int:
    with open(log_path, errors="replace") as f:
        return sum(any(t in line for t in _TOUCHED) for line in f)


def _publish_llamas(url: str, log_path: str, models: list[tuple[str, str]]) -> tuple[list[dict], list[str]]:
    """A new publisher per (Llama directory, serving dtype), each published as version 3 (its weights moved off the served
    ones); what each raised, what SGLang served and logged after it, and what the preflight said."""
    import logging

    from bridge.publisher import preflight_sglang

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())
    log = logging.getLogger(preflight_sglang.__name__)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    preflight_sglang._said.discard("unchecked")  # said once per process: this test's publishers are the first
    try:
        return [_publish_llama(url, log_path, d, i, dtype) for i, (d, dtype) in enumerate(models)], said
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _publish_llama(url: str, log_path: str, model_dir: str, i: int, serving_dtype: str = "bfloat16") -> dict:
    from transformers import LlamaForCausalLM

    from bridge import PublisherConfig, WeightPublisher

    m = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * (i + 1))
    touched = _touched(log_path)
    pub = WeightPublisher(PublisherConfig(servers=[url], progress=False, group_timeout=20, api_key="user-key",
                                          admin_api_key="admin-key", serving_dtype=serving_dtype))
    try:
        pub.publish(m, version=3)
        error = None
    except ConfigError as e:
        error = str(e)
    finally:
        pub.close()
    touched = _touched(log_path) - touched
    want = sglang_layout({n: p.detach().to(torch.bfloat16) for n, p in m.named_parameters()})
    got = _keyed_weights(url)
    return dict(error=error, touched=touched, served=got,
                equal=all(got.get(n) == tensor_checksum(t) for n, t in want.items()))


def test_real_sglang_serving_another_model_is_refused_before_any_byte_moves(keyed_llama, tmp_path):
    """SGLang 0.5.23's own ``/get_weights_by_name`` (its Llama's): a trainer of another layer count and MLP
    width, one of another hidden size, one of fewer layers and one of another serving dtype are each refused in
    the prepare step, naming each tensor with both shapes
    and the fix; SGLang never joined a group, paused or changed its weights. The matching model passes; what
    the route cannot tell is said once."""
    srv = keyed_llama
    served = _llama_dir(tmp_path / "served")  # the one the server was started with (same seed)
    deeper = _llama_dir(tmp_path / "deeper", num_hidden_layers=3, intermediate_size=192)
    narrower = _llama_dir(tmp_path / "narrower", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    shallower = _llama_dir(tmp_path / "shallower", num_hidden_layers=1)
    before = _keyed_weights(srv.url)
    bf16 = "bfloat16"
    results, said = _publish_llamas(srv.url, srv.log_path, [(deeper, bf16), (narrower, bf16), (shallower, bf16),
                                                            (served, "float32"), (served, bf16)])
    assert srv.alive(), srv.log_tail()
    deep, narrow, shallow, fp32, same = results
    for r in (deep, narrow, shallow, fp32):
        assert r["error"] and "the servers do not serve the trainer's model, nothing was sent" in r["error"], r["error"]
        assert "\n" not in r["error"]
        assert r["touched"] == 0 and r["served"] == before, "SGLang was touched for a model it does not serve"
    for r in (deep, narrow, shallow):
        assert "start the server with the trainer's model" in r["error"]
    # The MLP width shows in down_proj's trailing dim; the extra layer as a name SGLang does not know.
    assert "'model.layers.0.mlp.down_proj.weight' is [128, 192] in the trainer, [*, 256] served" in deep["error"]
    assert "'model.layers.2.self_attn.q_proj.weight' ([128, 128] in the trainer) is unknown to it" in deep["error"]
    assert "'model.embed_tokens.weight' is [272, 64] in the trainer, [*, 128] served" in narrow["error"]
    assert "'model.norm.weight' is [64] in the trainer, [more than 64] served" in narrow["error"]
    # A layer the trainer lacks (SGLang's loader would simply never update it).
    assert ("it has more layers than the trainer sends ('model.layers.1.self_attn.q_proj.weight' exists, the "
            "trainer's last layer is 0)") in shallow["error"], shallow["error"]
    # The dtype SGLang's server info states (its ServerArgs).
    assert "serves bfloat16 but serving_dtype='float32'; set serving_dtype='bfloat16'" in fp32["error"], fp32["error"]
    assert same["error"] is None and same["equal"] and same["touched"] > 0, same
    unchecked = [s for s in said if "not checked" in s]
    assert len(unchecked) == 1 and "the first dim of 2-D tensors" in unchecked[0], said


@newest_release
def test_preflight_says_once_what_a_silent_sglang_model_cannot_tell(server, caplog):
    """SGLang's Qwen2 has no ``get_weights_by_name``: its route answers 400 for every name, so the preflight
    stops after two requests, says so once, and leaves the names and shapes to SGLang's loader."""
    from bridge.local.presets import build_model
    from bridge.publisher import preflight_sglang
    from bridge.tensors import ParamSpec

    specs = [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in build_model("tiny").named_parameters()]
    preflight_sglang._said.discard(f"silent:{ServerClient(server.url).url}")  # said once per process
    with caplog.at_level("INFO", logger="bridge.publisher.preflight_sglang"):
        assert preflight_sglang.sglang_mismatch(specs, ServerClient(server.url)) is None
        assert preflight_sglang.sglang_mismatch(specs, ServerClient(server.url)) is None
    said = [r.getMessage() for r in caplog.records if "for none of" in r.getMessage()]
    assert len(said) == 1 and "Qwen2" in said[0], caplog.text
    assert server.alive()

# ---------------------------------------------------------------------------------------------- FP8


def _publish_fp8_snapshot(nr_url: str, root: str) -> str:
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine("small")  # its q/k/v and gate/up are multiples of 128 rows, as SGLang's stacked FP8 layers need
    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="fp8",
                                          trial="t0", encoding="fp8", progress=False))
    try:
        return pub.publish(engine, version=1).path
    finally:
        pub.close()
        engine.destroy()


def test_fp8_layer_is_what_sglang_fp8_linear_method_registers_and_loads(tmp_path):
    """What a 2-rank ``encoding="fp8"`` publish sends for layer 0 (its snapshot's tensors and quantization_config) has
    the names, dtypes and shapes SGLang 0.5.23's ``Fp8LinearMethod.create_weights`` registers for that config's
    block FP8 (q/k/v and gate/up stacked), and SGLang's own ``load_weights`` takes every one bit-exact."""
    import json
    import os
    import subprocess
    import sys

    from bridge.snapshot import read_snapshot
    from tests.sglang_harness import sglang_dir

    _need("0.5.23")
    path, _ = run_ranks(_publish_fp8_snapshot, 2, args=(f"file://{tmp_path / 'nr'}", str(tmp_path / "snap")), timeout=300)
    sent = {n.removeprefix("model.layers.0."): t for n, t in read_snapshot(path).items() if n.startswith("model.layers.0.")}
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    torch.save({"quantization_config": qc, "tensors": {"model.layers.0." + n: t.clone() for n, t in sent.items()}},
               tmp_path / "payload.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", "tests.sglang_harness.fp8_layers", "--sglang-dir", sglang_dir("0.5.23"),
                          "--model", path, "--payload", str(tmp_path / "payload.pt")], cwd=root, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("FP8_LAYERS ")]
    assert run.returncode == 0 and lines, f"exit {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    got = json.loads(lines[-1].removeprefix("FP8_LAYERS "))
    assert got["methods"] == ["Fp8LinearMethod"], got["methods"]
    stacked = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "mlp.gate_up_proj": ["gate_proj", "up_proj"],
               "self_attn.o_proj": ["o_proj"], "mlp.down_proj": ["down_proj"]}
    want = {}
    for sglang_name, parts in stacked.items():
        module = sglang_name.split(".")[0]
        for leaf in ("weight", "weight_scale_inv", "bias"):
            pieces = [sent.get(f"{module}.{p}.{leaf}") for p in parts]
            if all(t is not None for t in pieces):
                want[f"{sglang_name}.{leaf}"] = torch.cat(pieces)
    shapes = {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in want.items()}
    assert got["registered"] == shapes, f"SGLang registers {got['registered']}, the publisher sends {shapes}"
    assert shapes["self_attn.qkv_proj.weight"]["dtype"] == "float8_e4m3fn"
    assert shapes["mlp.down_proj.weight_scale_inv"] == {"dtype": "float32", "shape": [4, 12]}  # [512, 1536] in blocks
    assert sorted(got["loaded"]) == sorted(want)
    bad = [n for n, t in want.items() if got["sha"][n] != tensor_checksum(t)]
    assert not bad, f"SGLang's weight loading did not take these bit-exact: {bad}"
