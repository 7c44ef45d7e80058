"""One writer at a time: a server takes weight changes from one named writer, whose lease it renews while
it works; another writer is refused, naming the holder, until that lease expired or its holder ended it.

Against the reference server (its own lease, ``/wsync/writer_lease``): two 2-rank trainers of different
runs publishing into one server at once never make it serve a mix, and the refused one is told which run
holds it; a trainer SIGKILLed mid-sync is taken over only after its lease expired. Against real SGLang,
which has no lease, the same guarantee comes from a lock with a lease in name resolution
(``writer_lock``): ``tests/test_sglang_code.py`` runs it against SGLang 0.5.23's own code.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from bridge.client import ServerClient
from bridge.errors import ServerError
from bridge.protocol import ANOTHER_WRITER
from tests import sync_bodies as sb
from tests.dist_utils import run_ranks
from tests.fixtures_server import Trainer, local_model, random_weights

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(strict_versions=True)


def _writer(url: str, writer: str, run: str) -> ServerClient:
    c = ServerClient(url, timeout=30)
    c.claim_run(run)
    c.name_writer(writer)
    return c


def _state(url: str) -> dict:
    return ServerClient(url).server_info()["internal_states"][0]


def _wait_free(url: str, timeout: float = 15.0) -> None:
    """Until no writer holds the server (a test that left a lease behind must not fail the next one)."""
    deadline = time.monotonic() + timeout
    while _state(url)["writer_lease"] is not None:
        assert time.monotonic() < deadline, _state(url)
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------- the server's lease


def test_another_writer_is_refused_naming_the_holder_until_it_ends(server):
    a, b = _writer(server.url, "writer-a", "one/A"), _writer(server.url, "writer-b", "one/B")
    anonymous = ServerClient(server.url)
    before = anonymous.weights_checksum()
    a.take_writer_lease(30)
    try:
        a.begin_weight_update()
        refused = [lambda: b.take_writer_lease(30), b.begin_weight_update, lambda: b.update_weight_version("99"),
                   lambda: b.update_weights_from_disk("/nonexistent", weight_version="99"), b.end_weight_update,
                   b.abort_weight_update, anonymous.abort_weight_update, anonymous.end_weight_update,
                   lambda: anonymous.update_weight_version("99")]
        for call in refused:
            with pytest.raises(ServerError) as e:
                call()
            assert e.value.status == 409 and e.value.reason == ANOTHER_WRITER, e.value
            assert "one/A" in e.value.message and "writer-a" in e.value.message, e.value.message
        assert _state(server.url)["update_session_open"]  # nothing of the refused requests touched A's session
        a.end_weight_update()
    finally:
        a.release_writer_lease()
    assert anonymous.weights_checksum() == before
    b.take_writer_lease(30)  # ended by its holder: free at once
    b.begin_weight_update()
    b.end_weight_update()
    b.release_writer_lease()
    assert _state(server.url)["writer_lease"] is None


def test_an_expired_lease_is_taken_over_and_its_session_discarded_first(server):
    import torch

    a, b = _writer(server.url, "writer-a", "two/A"), _writer(server.url, "writer-b", "two/B")
    before = ServerClient(server.url).weights_checksum()
    with Trainer([a]) as trainer:
        a.take_writer_lease(1.5)
        a.pause_generation("retract")
        a.begin_weight_update()
        out = trainer.send([(NORM, torch.full((128,), 3.0, dtype=torch.bfloat16))], weight_version="77")
        assert out[0]["success"], out
        with pytest.raises(ServerError, match="two/A") as e:
            b.take_writer_lease(5)  # A's lease is live: refused
        assert e.value.reason == ANOTHER_WRITER
        deadline = time.monotonic() + 10  # A stops renewing: it expires, and the server lifts A's pause
        while _state(server.url)["writer_lease"] is not None or _state(server.url)["paused"]:
            assert time.monotonic() < deadline, _state(server.url)
            time.sleep(0.1)
        assert not _state(server.url)["update_session_open"]
        with pytest.raises(ServerError, match="aborted.*lease.*expired"):  # A's session was discarded, never applied
            a.end_weight_update()
        b.take_writer_lease(5)
        try:
            with pytest.raises(ServerError, match="two/B") as e:  # now B holds it
                a.take_writer_lease(5)
            assert e.value.reason == ANOTHER_WRITER
            b.begin_weight_update()
            b.end_weight_update()
        finally:
            b.release_writer_lease()
    assert ServerClient(server.url).weights_checksum() == before


def test_taking_the_server_discards_a_session_its_writer_no_longer_holds_a_lease_for(server):
    a, b = _writer(server.url, "writer-a", "three/A"), _writer(server.url, "writer-b", "three/B")
    anonymous = ServerClient(server.url)
    a.take_writer_lease(30)
    a.begin_weight_update()
    a.release_writer_lease()  # A let go of the server but left its session open (its end never came)
    with pytest.raises(ServerError, match="already open.*three/A"):  # a client that names no writer does not
        anonymous.begin_weight_update()                            # take anything over
    b.take_writer_lease(30)
    try:
        assert not _state(server.url)["update_session_open"]  # discarded when B took the server
        b.begin_weight_update()
        b.end_weight_update()
    finally:
        b.release_writer_lease()


def test_the_lease_route_checks_its_fields(server):
    for body, field in (({}, "wsync_writer"), ({"wsync_writer": "w", "lease_s": 0}, "lease_s"),
                        ({"wsync_writer": "w", "lease_s": 1e9}, "lease_s"), ({"wsync_writer": 5}, "wsync_writer"),
                        ({"wsync_writer": "w", "release": "yes"}, "release")):
        r = requests.post(server.url + "/wsync/writer_lease", json=body, timeout=10)
        assert r.status_code == 400 and field in r.text, (body, r.text)
    assert _state(server.url)["writer_lease"] is None


def test_a_resume_can_release_the_lease_in_the_same_request(server):
    """The publisher's last step of a sync is one request: ``/continue_generation`` with
    ``wsync_release_lease`` resumes, then lets go of this writer's lease (another writer takes it at once);
    a bad field is refused, and a writer that holds nothing releases nothing."""
    a, b = _writer(server.url, "writer-a", "one/A"), _writer(server.url, "writer-b", "one/B")
    for body, field in (({"wsync_release_lease": "yes", "wsync_writer": "w"}, "wsync_release_lease"),
                        ({"wsync_release_lease": True}, "wsync_writer")):
        r = requests.post(server.url + "/continue_generation", json=body, timeout=10)
        assert r.status_code == 400 and field in r.text, (body, r.text)
    a.take_writer_lease(30)
    a.pause_generation(mode="retract")
    b.continue_generation(release_lease=True)  # not b's lease: resumed, a keeps the server
    assert _state(server.url)["writer_lease"]["writer"] == "writer-a", _state(server.url)
    a.pause_generation(mode="retract")
    out = a.continue_generation(release_lease=True)
    assert out["writer_lease"] == "Writer lease released." and _state(server.url)["writer_lease"] is None, out
    assert _state(server.url)["paused"] is False
    b.take_writer_lease(30)
    b.release_writer_lease()


def test_a_pause_can_take_the_lease_in_the_same_request(server):
    """The publisher's first step of a sync on one server is one request: ``/pause_generation`` with
    ``wsync_lease_s`` takes this writer's lease, then pauses, and with ``wsync_begin_session`` opens the update
    session; while another writer holds the server it is refused (409, naming the holder) with nothing paused,
    and a refused session lifts the pause again; a bad field is refused before anything happens."""
    a, b = _writer(server.url, "writer-a", "four/A"), _writer(server.url, "writer-b", "four/B")
    for body, field in (({"wsync_lease_s": 5}, "wsync_writer"), ({"wsync_lease_s": "5", "wsync_writer": "w"},
                        "wsync_lease_s"), ({"wsync_lease_s": 0, "wsync_writer": "w"}, "lease_s"),
                        ({"wsync_lease_s": 5, "wsync_writer": 7}, "wsync_writer"),
                        ({"wsync_begin_session": "yes"}, "wsync_begin_session")):
        r = requests.post(server.url + "/pause_generation", json=body, timeout=10)
        assert r.status_code == 400 and field in r.text, (body, r.text)
        assert _state(server.url)["paused"] is False and _state(server.url)["writer_lease"] is None
    a.pause_generation(mode="retract", take_lease=30)
    try:
        assert _state(server.url)["paused"] is True and _state(server.url)["writer_lease"]["writer"] == "writer-a"
        a.continue_generation()
        with pytest.raises(ServerError, match="four/A") as e:
            b.pause_generation(mode="retract", take_lease=30)
        assert e.value.status == 409 and e.value.reason == ANOTHER_WRITER, e.value
        assert _state(server.url)["paused"] is False, "a refused take paused the server"
    finally:
        a.release_writer_lease()
    anonymous = ServerClient(server.url)
    anonymous.begin_weight_update()  # a session of a client that names no writer: B's session is refused
    with pytest.raises(ServerError, match="already open"):
        b.pause_generation(mode="retract", take_lease=30, begin_session=True)
    assert _state(server.url)["paused"] is False, "a refused session left the server paused"
    b.release_writer_lease()  # the lease was taken before the refusal: held, as after a separate take
    anonymous.pause_generation(mode="retract")  # paused before the request (out of rotation, say): stays paused
    with pytest.raises(ServerError, match="already open"):
        b.pause_generation(mode="retract", take_lease=30, begin_session=True)
    assert _state(server.url)["paused"] is True, "a refused session lifted a pause it did not make"
    b.release_writer_lease()
    anonymous.continue_generation()
    anonymous.end_weight_update()
    out = b.pause_generation(mode="retract", take_lease=30, begin_session=True)
    assert "session started" in out["session"] and _state(server.url)["update_session_open"], out
    b.end_weight_update()
    b.continue_generation(release_lease=True)
    assert _state(server.url)["writer_lease"] is None and _state(server.url)["paused"] is False


# ---------------------------------------------------------------------------------------------- two trainers at once


def _trainer(url: str, trial: str, seed: int, versions: int, hold: float):
    """Every rank: train, then publish versions 1..``versions``, each retried while another writer holds the
    server; rank 0 reads back what the server serves after each publish."""
    import random

    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError

    if hold:  # this trainer's syncs last a while, so that the other one meets them
        os.environ["WSYNC_FAILPOINTS"] = f"bucket:1@0=sleep:{hold}"
    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(servers=[url], experiment="two", trial=trial, bucket_mb=0.1,
                                          group_timeout=20, http_timeout=20, progress=False, writer_lease=5))
    records = []
    try:
        for v in range(1, versions + 1):
            sb.train_step(engine, seed * 1000 + v)
            own = sb.own_checksums(engine)
            refusals = []
            for _ in range(600):  # a count, not a clock: every rank makes the same decision
                try:
                    pub.publish(engine, version=v)
                    break
                except BridgeError as e:
                    if ANOTHER_WRITER not in str(e):
                        raise
                    refusals.append(str(e))
                    time.sleep(0.02 + 0.1 * random.random())
            else:
                raise AssertionError(f"{trial} never got the server for v{v}")
            served = ServerClient(url).weights_checksum() if engine.rank == 0 else None
            records.append((v, own, served, refusals))
    finally:
        pub.close()
        engine.destroy()
    return records


def _poll(url: str, stop: threading.Event, seen: list) -> None:
    c = ServerClient(url, timeout=30)
    while not stop.is_set():
        seen.append(c.weights_checksum())
        time.sleep(0.02)


def test_two_trainers_on_one_server_never_serve_a_mix(server):
    """Two 2-rank trainers of different runs, 20 versions each, several buckets per version, at once."""
    _wait_free(server.url)
    initial = ServerClient(server.url).weights_checksum()
    stop, seen = threading.Event(), []
    poller = threading.Thread(target=_poll, args=(server.url, stop, seen), daemon=True)
    poller.start()
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            runs = {trial: pool.submit(run_ranks, _trainer, 2, (server.url, trial, seed, 20, hold), None, 900)
                    for trial, seed, hold in (("A", 1, 0.3), ("B", 2, 0.0))}
            records = {trial: f.result()[0] for trial, f in runs.items()}
    finally:
        stop.set()
        poller.join(30)
    complete = {("initial", initial["weight_version"]): initial["checksums"]}
    for trial, recs in records.items():
        assert [r[0] for r in recs] == list(range(1, 21))
        for v, own, _, _ in recs:
            complete[(f"two/{trial}", str(v))] = own

    def which(answer: dict) -> tuple[str, str]:
        got = answer["checksums"]
        match = [key for key, want in complete.items() if all(got.get(n) == c for n, c in want.items())]
        assert match, f"the server served a mix (label {answer['weight_version']}): no complete version has its tensors"
        assert match[0][1] == answer["weight_version"], f"{match[0]} served under the label {answer['weight_version']}"
        return match[0]

    served = [which(a) for a in seen] + [which(r[2]) for recs in records.values() for r in recs]
    last: dict[str, int] = {}
    for run, label in served[: len(seen)]:  # the poller's view, in time order
        if run != "initial":
            assert int(label) >= last.get(run, 0), f"{run}'s label went down: {last[run]} then {label}"
            last[run] = int(label)
    refusals = {trial: [m for r in recs for m in r[3]] for trial, recs in records.items()}
    assert refusals["A"] or refusals["B"], "the trainers never met: the test proved nothing"
    for trial, other in (("A", "two/B"), ("B", "two/A")):
        for m in refusals[trial]:
            assert other in m, f"trainer {trial} was refused without being told the other run: {m}"
    print(f"{len(seen)} polls, {len(set(served))} distinct versions served, refusals: A {len(refusals['A'])}, "
          f"B {len(refusals['B'])}")


# ---------------------------------------------------------------------------------------------- a killed writer

_HOLDER = """
import os, sys
from bridge import PublisherConfig, WeightPublisher
from tests.fixtures_server import Trainer, local_model, random_weights
pub = WeightPublisher(PublisherConfig(servers=[sys.argv[1]], experiment="kill", trial="A", bucket_mb=0.1,
                                      progress=False, writer_lease=float(sys.argv[2])))
pub.publish(local_model(random_weights(seed=5)), version=1)
"""


def test_a_killed_trainer_is_taken_over_only_after_its_lease_expired(server):
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError

    _wait_free(server.url)
    lease = 3.0
    # Built before the kill: the new trainer's first attempt must come while the dead one's lease still runs
    # (a model built after it took longer than the lease on a busy machine, and no refusal was seen).
    refusals, weights = [], random_weights(seed=6)
    model = local_model(weights)
    env = {**os.environ, "WSYNC_FAILPOINTS": "bucket:1@0=sleep:120"}  # it stops mid-sync and waits there
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, server.url, str(lease)], env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            state = _state(server.url)
            held = state["writer_lease"]
            if held and held["run_id"] == "kill/A" and state["update_session_open"]:
                break
            assert time.monotonic() < deadline and holder.poll() is None, state
            time.sleep(0.05)
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        left = held["expires_in"]
    finally:
        holder.kill()
        holder.wait()
    with WeightPublisher(PublisherConfig(servers=[server.url], experiment="kill", trial="B", bucket_mb=0.1,
                                         progress=False, writer_lease=lease)) as pub:
        while True:
            try:
                pub.publish(model, version=1)
                break
            except BridgeError as e:
                assert ANOTHER_WRITER in str(e) and time.monotonic() - killed < 30, e
                refusals.append(str(e))
                time.sleep(0.1)
    taken = time.monotonic() - killed
    print(f"lease {lease} s, {left:.2f} s left at the kill; taken over {taken:.2f} s after it, {len(refusals)} refusals")
    assert refusals and all("kill/A" in m for m in refusals), refusals
    assert left - 0.3 <= taken <= lease + 3, (left, taken)
    got = ServerClient(server.url).weights_checksum()
    assert got["weight_version"] == "1" and sb.holds(got["checksums"], _bf16_checksums(weights))


def _bf16_checksums(weights: dict) -> dict:
    from bridge.digest import tensor_checksum

    return {n: tensor_checksum(t) for n, t in weights.items()}


def test_a_lock_released_after_close_is_left_to_run_out(tmp_path):
    """An abort's per-server thread that outlived its wait may let go of a lock after the publisher closed the
    lease (and its name resolution): nothing is raised in that thread; the lock runs out on its own."""
    from bridge.client import ServerGroup
    from bridge.transports.lease import WriterLease

    group = ServerGroup(["http://127.0.0.1:9"])
    lease = WriterLease(group, run_id="x/y", seconds=2, lock_url=f"file://{tmp_path}")
    lease.close()
    lease.release_one(group.clients[0], "lock")  # raised AttributeError ('NoneType' has no 'delete') before
