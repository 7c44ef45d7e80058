"""The reference server refuses what it must not load, and never crashes, freezes or answers 5xx.

One server per module (0.5.23, a 2 s receive bound, one allowed disk root, versions that may not go back). Each test sends something
wrong and checks three things: a 4xx that names what was wrong, ``/health`` answering throughout (within
ROUTE_S), and the served weights and version unchanged afterwards.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import requests
import torch

from bridge.client import ServerClient
from bridge.errors import ConfigError, ServerError
from tests.fixtures_server import GROUP_TIMEOUT, Trainer, local_model, random_weights
from tests.sync_bodies import answers_within

PROMPT = [5, 72, 101, 108, 108, 111, 44, 32]
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
NORM = "model.norm.weight"  # 128 bfloat16 values: the smallest tensor of the tiny preset
RECEIVE_TIMEOUT_S = 2.0  # the module server's --receive-timeout
# How long a route may take while something wrong is in flight. /health does no work (routes/info.py) and
# the weight routes wait only for the weight operation in progress, so each answers in milliseconds unless
# the server waits on what a request sent it (a FIFO, bytes that never come): the longest it may wait for
# that is its own bound for bytes a client announced, --receive-timeout. A frozen server never answers
# (a FIFO in a manifest froze every weight route for 65 s); a loaded machine still answers within it.
ROUTE_S = RECEIVE_TIMEOUT_S


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict:
    """An allowed disk root and a directory outside it."""
    return {"allowed": str(tmp_path_factory.mktemp("allowed-root")), "outside": str(tmp_path_factory.mktemp("outside"))}


@pytest.fixture(scope="module")
def server(server_factory, roots):
    return server_factory(extra_args=["--disk-root", roots["allowed"], "--receive-timeout", f"{RECEIVE_TIMEOUT_S:g}"],
                          strict_versions=True)


@pytest.fixture(scope="module")
def client(server) -> ServerClient:
    return server.client


def served(client: ServerClient) -> dict:
    r = client.weights_checksum()
    return {"version": r["weight_version"], "checksums": r["checksums"]}


def post(client: ServerClient, route: str, body, timeout: float = 30) -> requests.Response:
    """POST raw bytes (or a JSON-able object) without the client's own checks."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(client.url + route, data=data, headers={"content-type": "application/json"}, timeout=timeout)


def message(r: requests.Response) -> str:
    j = r.json()
    return j["error"]["message"] if "error" in j else j["message"]


def assert_health_fast(client: ServerClient) -> None:
    """``/health`` answers within ROUTE_S (the request's timeout: a server that does not answers nothing)."""
    assert requests.get(client.url + "/health", timeout=ROUTE_S).status_code == 200


def snapshot(root: str, version: int, weights: dict | None = None) -> str:
    """A complete wsync snapshot of the tiny preset's shapes under ``root``."""
    from bridge.snapshot import write_snapshot

    return write_snapshot(root, version, list((weights or random_weights(seed=version)).items())).path


def bucket_entry(tensor: torch.Tensor, name: str = NORM, **extra) -> tuple[str, str]:
    """A wsync_shm file holding one tensor, and its base64 descriptor."""
    fd, path = tempfile.mkstemp(prefix="wsync-test-", dir=SHM)
    with os.fdopen(fd, "wb") as f:
        f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    desc = {"path": path, "nbytes": tensor.numel() * tensor.element_size(), "names": [name],
            "dtypes": [str(tensor.dtype).removeprefix("torch.")], "shapes": [list(tensor.shape)], **extra}
    return path, base64.b64encode(json.dumps(desc).encode()).decode()


# ---------------------------------------------------------------------------------------------- 1: versions


@pytest.mark.parametrize("bad", ["\ud800", "", "x" * (1 << 20), "line\nbreak"], ids=["surrogate", "empty", "1MB", "control"])
def test_bad_versions_are_refused_and_the_server_keeps_answering(client, roots, bad):
    before = served(client)
    r = post(client, "/update_weight_version", {"new_version": bad})
    assert r.status_code == 400 and "new_version" in message(r), r.text[:300]
    r = post(client, "/update_weights_from_disk", {"model_path": snapshot(roots["allowed"], 1), "weight_version": bad})
    assert r.status_code == 400 and "weight_version" in message(r), r.text[:300]
    for route in ("/model_info", "/server_info"):
        assert requests.get(client.url + route, timeout=10).status_code == 200
    out = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert out["meta_info"]["weight_version"] == before["version"]
    assert served(client) == before


# ---------------------------------------------------------------------------------------------- 4: malformed input


MALFORMED = {
    "deep-json-disk": ("/update_weights_from_disk", b'{"model_path": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    "deep-json-generate": ("/generate", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    "huge-world-size": ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                                       "rank_offset": 1, "world_size": 10**20, "backend": "gloo"},
                        "world_size"),
    "stop-token-out-of-range": ("/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 3, "min_new_tokens": 2, "stop_token_ids": [10**6]}}, "stop_token_ids"),
    "huge-sampling-seed": ("/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.7, "sampling_seed": 2**70}}, "sampling_seed"),
    "nan-literal": ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"temperature": NaN}}', "NaN"),
    "null-byte-path": ("/update_weights_from_disk", {"model_path": "/tmp/a\u0000b"}, "model_path"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_is_a_400_naming_the_field(client, case):
    route, body, fragment = MALFORMED[case]
    before = served(client)
    r = post(client, route, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert fragment in message(r), message(r)
    assert_health_fast(client)
    assert served(client) == before


def test_non_finite_weights_are_refused_at_load(client, roots):
    before = served(client)
    with Trainer([client]) as t:
        client.begin_weight_update()
        nan = torch.full((128,), float("nan"), dtype=torch.bfloat16)
        [r] = t.send([(NORM, nan)], flattened=True, weight_version="nan")  # checked while the next bucket comes
        assert r["success"], r
        with pytest.raises(ServerError, match=f"nothing applied.*{NORM}.*not finite") as e:
            client.end_weight_update()
        assert e.value.status == 400
    w = random_weights(seed=3)
    w["model.layers.0.mlp.up_proj.weight"][0, 0] = float("inf")
    with pytest.raises(ServerError, match="not finite") as e:
        client.update_weights_from_disk(snapshot(roots["allowed"], 30, w), weight_version="inf")
    assert "model.layers.0.mlp.up_proj.weight" in e.value.message
    assert served(client) == before
    out = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0.8, "max_new_tokens": 4})
    assert out["meta_info"]["weight_version"] == before["version"]


# ---------------------------------------------------------------------------------------------- 2: oversized broadcast


@pytest.mark.parametrize("factor", [3, 100, 40_000])  # 40 000 x 256 bytes: 10 MB where 256 were announced
def test_a_broadcast_far_over_its_announced_size_is_refused_not_fatal(client, factor):
    before = served(client)
    with Trainer([client]) as t:
        client.begin_weight_update()
        announced = torch.ones(128, dtype=torch.bfloat16)
        wire = torch.ones(256 * factor + 4096, dtype=torch.uint8)
        [r] = t.send([(NORM, announced)], flattened=True, wire=[wire], weight_version="over")
        assert isinstance(r, ServerError) and r.status == 400 and "more than the 256 bytes" in r.message, r
        assert_health_fast(client)
        # The extra bytes landed in the receive's reserve: the group is still usable.
        client.begin_weight_update()
        [r] = t.send([(NORM, before_norm(client))], flattened=True, weight_version=before["version"])
        assert r["success"], r
        client.end_weight_update()
    assert served(client) == before


def before_norm(client: ServerClient) -> torch.Tensor:
    rows = client.get_weights_by_name(NORM, truncate_size=128)
    return torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------- 3: FIFOs


def test_a_fifo_in_a_checkpoint_is_refused_without_freezing(client, roots, tiny_model_dir):
    before = served(client)
    d = os.path.join(roots["allowed"], "fifo-model")
    shutil.copytree(tiny_model_dir, d)
    os.remove(os.path.join(d, "model.safetensors"))
    os.mkfifo(os.path.join(d, "model.safetensors"))
    box = {}
    th = threading.Thread(target=lambda: box.update(r=post(client, "/update_weights_from_disk", {"model_path": d})))
    th.start()
    for _ in range(5):
        assert_health_fast(client)
        time.sleep(0.1)
    th.join(timeout=10)
    assert not th.is_alive(), "the disk update with a FIFO did not answer"
    assert box["r"].status_code == 400 and "not a regular file" in message(box["r"]), box["r"].text
    assert served(client) == before


def test_a_fifo_as_shm_path_is_refused_and_releases_the_update_lock(client):
    path = os.path.join(SHM, f"wsync-test-fifo-{os.getpid()}")
    os.mkfifo(path)
    try:
        desc = {"path": path, "nbytes": 256, "names": [NORM], "dtypes": ["bfloat16"], "shapes": [[128]]}
        client.begin_weight_update()
        r = post(client, "/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(json.dumps(desc).encode()).decode()],
            "load_format": "wsync_shm"}, timeout=10)
        assert r.status_code == 400 and "not a regular file" in message(r), r.text
        assert client.begin_weight_update()["success"]  # the update lock is free
        client.abort_weight_update()
    finally:
        os.remove(path)


# ---------------------------------------------------------------------------------------------- fail-safe 6


# A control route queued behind the 40 paused generations would answer only once they were released: never,
# or when the server's watchdog lifts the pause of a session idle for --group-timeout. So each must answer
# while all 40 still wait (checked, not timed), and that timeout is how long the test waits for one.
CONTROL_S = GROUP_TIMEOUT


def test_control_routes_answer_with_40_generations_waiting_in_a_pause(client):
    """Relative, not timed: each control route answers while all 40 generations are still waiting."""
    client.pause_generation("retract")
    results = []
    threads = [threading.Thread(target=lambda: results.append(client.generate(
        input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 1}, timeout=120))) for _ in range(40)]
    for th in threads:
        th.start()
    control = ServerClient(client.url, timeout=CONTROL_S)
    try:
        deadline = time.monotonic() + 30
        while client.server_info()["internal_states"][0]["running_requests"] < 40:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for call in (control.begin_weight_update, control.end_weight_update):
            assert call()["success"]
            state = client.server_info()["internal_states"][0]
            assert not results and state["running_requests"] == 40 and state["paused"], (call.__name__, state)
    finally:
        control.continue_generation()  # the route that releases them: one queued behind them never answers
        for th in threads:
            th.join(timeout=120)
    assert len(results) == 40


# ---------------------------------------------------------------------------------------------- colocated trainer dies


def test_a_colocated_session_whose_trainer_is_killed_is_discarded(client):
    before = served(client)
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    path, entry = bucket_entry(torch.full((128,), 7.0, dtype=torch.bfloat16), pid=trainer.pid)
    try:
        client.pause_generation("retract")
        client.begin_weight_update()
        r = client.update_weights_from_tensor([entry], load_format="wsync_shm", weight_version="stale")
        assert r["success"], r
        with pytest.raises(ServerError, match="already open.*abort_weight_update") as e:
            client.begin_weight_update()
        assert e.value.status == 400
        trainer.kill()  # not reaped yet: a zombie counts as gone too
        t0 = time.monotonic()
        while True:
            state = client.server_info()["internal_states"][0]
            if not state["update_session_open"] and not state["paused"]:
                break
            assert time.monotonic() - t0 < 4, state
            time.sleep(0.1)
    finally:
        trainer.kill()
        trainer.wait()
        os.remove(path)
    assert served(client) == before
    with pytest.raises(ServerError, match=f"aborted.*{trainer.pid}"):  # nothing stale is left to commit
        client.end_weight_update()
    client.begin_weight_update()  # the next publisher starts cleanly
    client.abort_weight_update()


def test_a_colocated_descriptor_without_pid_is_accepted(client):
    before = served(client)
    path, entry = bucket_entry(before_norm(client))
    try:
        client.begin_weight_update()
        assert client.update_weights_from_tensor([entry], load_format="wsync_shm")["success"]
        client.end_weight_update()
    finally:
        os.remove(path)
    assert served(client) == before


# ---------------------------------------------------------------------------------------------- 6: disk roots


def test_disk_loads_are_confined_to_the_allowed_roots(client, roots):
    before = served(client)
    outside = snapshot(roots["outside"], 40)
    with pytest.raises(ServerError, match="outside the directories this server loads from") as e:
        client.update_weights_from_disk(outside, weight_version="outside")
    assert roots["allowed"] in e.value.message and "--disk-root" in e.value.message
    link = os.path.join(roots["allowed"], "link-out")
    os.symlink(outside, link)  # inside by name, outside once resolved
    with pytest.raises(ServerError, match="outside the directories"):
        client.update_weights_from_disk(link, weight_version="link")
    assert served(client) == before


def test_by_default_only_the_wsync_snapshot_root_and_the_model_directory_load(server_factory, tiny_model_dir, tmp_path):
    """Without --disk-root the server loads from the roots it knows of, not from the whole temp folder."""
    from bridge.transports.disk import default_snapshot_root

    srv = server_factory(model=tiny_model_dir, default_disk_roots=True, strict_versions=True)
    before = served(srv.client)
    with pytest.raises(ServerError, match="outside the directories this server loads from") as e:
        srv.client.update_weights_from_disk(snapshot(str(tmp_path), 50), weight_version="50")
    assert "--disk-root" in e.value.message
    assert served(srv.client) == before
    os.makedirs(default_snapshot_root(), exist_ok=True)
    root = tempfile.mkdtemp(prefix="test-default-root-", dir=default_snapshot_root())
    try:
        assert srv.client.update_weights_from_disk(snapshot(root, 51), weight_version="51")["success"]
        assert served(srv.client)["version"] == "51"
        # The base weights can always be reloaded from the served model's own directory.
        assert srv.client.update_weights_from_disk(tiny_model_dir, weight_version="52")["success"]
        assert served(srv.client)["checksums"] == before["checksums"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # A publisher whose snapshot root the server does not load from fails before writing anything,
    # naming the fix, instead of waiting wait_loaded_timeout for a load that cannot happen.
    from bridge import PublisherConfig, WeightPublisher

    outside = tmp_path / "pub"
    cfg = PublisherConfig(transport="disk", servers=[srv.url], name_resolve=f"file://{tmp_path / 'nr'}",
                          snapshot_root=str(outside), new_run=True, progress=False)
    t0 = time.monotonic()
    with WeightPublisher(cfg) as pub, pytest.raises(ConfigError, match="--disk-root") as e:
        pub.publish(local_model(random_weights(seed=53)), version=53)
    assert time.monotonic() - t0 < 20 and str(outside) in str(e.value)
    assert not [d for d in os.listdir(outside) if not d.startswith("name_resolve")] and served(srv.client)["version"] == "52"


def test_manifest_entries_that_leave_the_snapshot_are_refused(client, roots):
    from bridge.snapshot import MANIFEST_NAME

    before = served(client)
    stolen = snapshot(roots["outside"], 41)  # a file the server must not open, with its manifest entry
    inside = snapshot(roots["allowed"], 42)
    with open(os.path.join(inside, MANIFEST_NAME)) as f:
        manifest = json.load(f)
    escape = os.path.relpath(os.path.join(stolen, "model.safetensors"), inside)
    assert escape.startswith("..")
    manifest["files"][escape] = manifest["files"].pop("model.safetensors")
    for entry in manifest["tensors"].values():
        entry["file"] = escape
    with open(os.path.join(inside, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f)
    os.remove(os.path.join(inside, "model.safetensors"))
    with pytest.raises(ServerError, match="leaves the snapshot directory") as e:
        client.update_weights_from_disk(inside, weight_version="escape")
    assert "checksum" not in e.value.message
    assert served(client) == before


def _with_extra_entry(root: str, version: int, make, size: int, checksum: str) -> str:
    """A complete snapshot whose manifest also lists ``notes.txt`` (made by ``make(path)``) with ``size`` and
    ``checksum``: a crafted manifest, as a hostile writer of the snapshot root could leave."""
    from bridge.snapshot import MANIFEST_NAME

    path = snapshot(root, version)
    make(os.path.join(path, "notes.txt"))
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        manifest = json.load(f)
    manifest["files"]["notes.txt"] = {"bytes": size, "checksum": checksum}
    with open(os.path.join(path, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f)
    return path


def _refused_at_once(client, path: str, version: str) -> requests.Response:
    """POST the disk load on a thread; meanwhile the weight routes must answer, each within ROUTE_S, and the
    load must be refused within ROUTE_S of being sent."""
    box: dict = {}

    def load() -> None:
        box.update(r=post(client, "/update_weights_from_disk", {"model_path": path, "weight_version": version}),
                   at=time.monotonic())

    th = threading.Thread(target=load)
    label = served(client)["version"]
    t0 = time.monotonic()
    th.start()
    for _ in range(3):
        for route, body in (("/update_weight_version", {"new_version": label, "abort_all_requests": False}),
                            ("/wsync/weights_checksum", {"names": [NORM]})):
            assert post(client, route, body, timeout=ROUTE_S).status_code == 200, route
        time.sleep(0.05)
    th.join(timeout=30)
    assert not th.is_alive() and box["at"] - t0 < ROUTE_S, "the crafted snapshot was not refused at once"
    return box["r"]


def test_a_manifest_entry_that_is_a_fifo_is_refused_at_once(client, roots):
    before = served(client)
    path = _with_extra_entry(roots["allowed"], 43, os.mkfifo, 0, "00000000")  # what a FIFO measures
    r = _refused_at_once(client, path, "fifo-entry")
    assert 400 <= r.status_code < 500 and "notes.txt" in message(r) and "not a regular file" in message(r), r.text
    assert served(client) == before


def test_a_manifest_entry_that_links_outside_reveals_nothing_of_it(client, roots):
    import zlib

    from bridge.snapshot.checksums import crc_hex

    before = served(client)
    secret = b"SECRET-" + b"x" * 1230  # 1237 bytes: a size no message may carry
    outside = os.path.join(roots["outside"], "secret.txt")
    with open(outside, "wb") as f:
        f.write(secret)
    true_crc = crc_hex(zlib.crc32(secret))
    for version, size in ((44, len(secret)), (45, len(secret) + 1)):  # its true size and crc, then a wrong size
        path = _with_extra_entry(roots["allowed"], version, lambda p: os.symlink(outside, p), size, true_crc)
        r = _refused_at_once(client, path, f"link-{version}")
        text = r.text
        assert 400 <= r.status_code < 500 and "notes.txt" in message(r) and "leaves the snapshot" in message(r), text
        for leak in (outside, roots["outside"], "secret", "SECRET", str(len(secret)), true_crc):
            assert leak not in text, (leak, text)
    assert served(client) == before


def test_a_manifestless_checkpoint_inside_the_roots_still_loads(client, roots, tiny_model_dir):
    d = os.path.join(roots["allowed"], "plain-hf")
    shutil.copytree(tiny_model_dir, d)
    assert client.update_weights_from_disk(d, weight_version="plain")["success"]
    assert served(client)["version"] == "plain"


# ---------------------------------------------------------------------------------------------- 5: bytes that never come


def test_an_announced_bucket_whose_bytes_never_come_gives_up_at_its_bound(client, roots):
    before = served(client)
    path = snapshot(roots["allowed"], 50)
    with Trainer([client]) as t:
        client.begin_weight_update()
        box = {}
        th = threading.Thread(target=lambda: box.update(r=t.send([(NORM, torch.ones(128, dtype=torch.bfloat16))],
                                                                 flattened=True, broadcast=False)))
        t0 = time.monotonic()
        th.start()
        while client.server_info()["internal_states"][0]["receiving_on_group"] != t.group_name:
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
        # A disk update waits only for the receive's bound (2 s here), not the group timeout (20 s).
        assert client.update_weights_from_disk(path, weight_version="after-stall")["success"]
        waited = time.monotonic() - t0
        th.join(timeout=30)
        [r] = box["r"]
        assert isinstance(r, ServerError) and "did not arrive within 2" in r.message and "init_weights_update_group" in r.message
        assert waited < 8, waited
        assert t.group_name not in client.server_info()["internal_states"][0]["weight_update_groups"]
    assert served(client)["version"] == "after-stall" != before["version"]


# ---------------------------------------------------------------------------------------------- 7: versions across runs


def test_an_older_version_is_refused_unless_a_new_run_starts(client, roots):
    def set_version(v: str, **run) -> requests.Response:
        return post(client, "/update_weight_version", {"new_version": v, "abort_all_requests": False, **run})

    assert set_version("20", wsync_new_run=True).status_code == 200
    r = set_version("19")  # a restarted trainer of the same (anonymous) run
    assert r.status_code == 400 and "older than the served version 20" in message(r) and "wsync_new_run" in message(r)
    assert set_version("20").status_code == 200  # the same version again is fine
    assert set_version("3", wsync_run_id="run-a").status_code == 200  # a run id that changes starts a new run
    r = set_version("2", wsync_run_id="run-a")
    assert r.status_code == 400 and "run 'run-a'" in message(r) and "wsync_run_id" in message(r)
    before = served(client)
    r = post(client, "/update_weights_from_disk", {"model_path": snapshot(roots["allowed"], 60), "weight_version": "1",
                                                   "wsync_run_id": "run-a"})
    assert r.status_code == 400 and "older than the served version 3" in message(r)
    assert served(client) == before
    # A session: the run is claimed at begin; the bucket carrying the older version is refused. It carries
    # other bytes than the served ones, so that applying it anyway would show.
    client.begin_weight_update()
    path, entry = bucket_entry(before_norm(client))
    other_path, other = bucket_entry(torch.full((128,), 9.0, dtype=torch.bfloat16))
    try:
        r = post(client, "/update_weights_from_tensor", {"serialized_named_tensors": [other], "load_format": "wsync_shm",
                                                         "weight_version": "2"})
        assert r.status_code == 400 and "older than the served version 3" in message(r), r.text
        assert not client.server_info()["internal_states"][0]["update_session_open"]
        assert served(client) == before, "the refused bucket changed the served weights"
        assert post(client, "/begin_weight_update", {"wsync_run_id": "run-b"}).status_code == 200
        r = post(client, "/update_weights_from_tensor", {"serialized_named_tensors": [entry], "load_format": "wsync_shm",
                                                         "weight_version": "1"})
        assert r.status_code == 200, r.text
        client.end_weight_update()
    finally:
        os.remove(path)
        os.remove(other_path)
    assert served(client) == {**before, "version": "1"}  # the accepted bucket carried the served bytes
    r = post(client, "/update_weight_version", {"new_version": "x", "wsync_run_id": 5})
    assert r.status_code == 400 and "wsync_run_id" in message(r)


def test_a_disk_load_is_checked_against_the_announced_manifest_digest(client, roots):
    from bridge.protocol import SNAPSHOT_INVALID

    path = snapshot(roots["allowed"], 70)
    with open(os.path.join(path, "wsync-manifest.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    before = served(client)
    for bad in (5, "ABC", "0" * 63):
        r = post(client, "/update_weights_from_disk", {"model_path": path, "wsync_manifest_sha256": bad})
        assert r.status_code == 400 and "wsync_manifest_sha256" in message(r), r.text
    r = post(client, "/update_weights_from_disk", {"model_path": path, "weight_version": "70", "wsync_manifest_sha256": "0" * 64})
    assert r.status_code == 400 and "announcement says" in message(r) and r.json()["wsync_reason"] == SNAPSHOT_INVALID
    assert served(client) == before
    r = post(client, "/update_weights_from_disk", {"model_path": path, "weight_version": "70", "wsync_manifest_sha256": digest})
    assert r.status_code == 200, r.text
    assert served(client)["version"] == "70"


def test_the_raw_bench_receive_survives_an_oversized_broadcast(client):
    import torch.distributed as dist

    with Trainer([client]) as t:
        f = t.pool.submit(post, client, "/wsync/bench/recv_raw", {"group_name": t.group_name, "nbytes": 256})
        dist.broadcast(torch.ones(1 << 20, dtype=torch.uint8), src=0, group=t.pg)
        r = f.result(timeout=30)
        assert r.status_code == 400 and "more than the 256 bytes" in message(r), r.text
    assert_health_fast(client)


def test_a_session_with_no_trainer_known_is_discarded_after_the_idle_timeout(server_factory):
    quick = server_factory(extra_args=["--group-timeout", "2"], strict_versions=True).client
    before = served(quick)
    path, entry = bucket_entry(torch.full((128,), 5.0, dtype=torch.bfloat16))  # an older publisher: no pid
    try:
        quick.pause_generation("retract")
        quick.begin_weight_update()
        assert quick.update_weights_from_tensor([entry], load_format="wsync_shm", weight_version="idle")["success"]
        t0 = time.monotonic()
        while quick.server_info()["internal_states"][0]["update_session_open"]:
            assert time.monotonic() - t0 < 6
            time.sleep(0.1)
    finally:
        os.remove(path)
    assert not quick.server_info()["internal_states"][0]["paused"]
    with pytest.raises(ServerError, match="no request came for 2 s"):
        quick.end_weight_update()
    assert served(quick) == before


# ---------------------------------------------------------------------------------------------- 8: torn weights stay paused


def test_a_stalled_sync_after_an_in_place_bucket_leaves_the_server_paused(server_factory):
    """A server that loads buckets as they arrive (SGLang's way: the 0.5.5 dialect) took one bucket of a sync,
    then its trainer stalls: the receive of the next gives up at its bound and drops the group, but the
    weights now mix two versions under the old label, so the server stays paused instead of resuming (it
    resumed, and served the mix, when the trainer's own hold came first under load: seen in CI). The
    writer's /continue_generation, after the next complete sync, resumes it."""
    srv = server_factory(extra_args=["--protocol-version", "0.5.5", "--receive-timeout", f"{RECEIVE_TIMEOUT_S:g}"])
    client = srv.client
    with Trainer([client]) as t:
        client.pause_generation("abort")
        [r] = t.send([(NORM, torch.full((128,), 2.0, dtype=torch.bfloat16))])
        assert r["success"], r
        [r] = t.send([(NORM, torch.ones(128, dtype=torch.bfloat16))], broadcast=False)  # its bytes never come
        assert isinstance(r, ServerError) and "did not arrive within" in r.message, r
    # the receive's failure came after its bound, and the watchdog runs every second: two rounds of it
    assert not answers_within(srv.url, 2 * 1.0 + 1.0)
    client.continue_generation()  # the writer resumes it (here: the torn bucket is the only change)
    assert answers_within(srv.url, 30)
