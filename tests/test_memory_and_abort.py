"""SGLang's ``/abort_request`` and ``/release_memory_occupation`` / ``/resume_memory_occupation`` on the reference server.

SGLang 0.5.23's semantics (``http_server.py``, ``tokenizer_manager.abort_request``, the scheduler's
``release_memory_occupation``): an abort names a request in flight (or all), an unknown or empty rid aborts nothing;
memory is released only when idle (requests waiting out a pause do not count), by tags (``kv_cache``, ``weights``,
``cuda_graph``; none means all), and resumed by tags. Beyond SGLang, the reference server refuses what would crash
or corrupt SGLang: a release while requests run, resuming a tag that is not released, a weight update while the
weights are released; and generations wait while any tag is released.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from bridge.errors import ServerError
from tests.fixtures_server import Trainer, random_weights

PROMPT = [5, 72, 101, 108, 108, 111, 44, 32]
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory()


def _post(server, route: str, body: dict | None = None) -> requests.Response:
    return requests.post(server.url + route, json=body or {}, timeout=30)


def _state(server) -> dict:
    return server.client.server_info()["internal_states"][0]


def _wait_running(server, n: int = 1) -> None:
    deadline = time.monotonic() + 60
    while _state(server)["running_requests"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _generate(server, rid: str, sp: dict = LONG) -> tuple[threading.Thread, dict]:
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(r=server.client.generate(input_ids=PROMPT, sampling_params=sp,
                                                                              rid=rid)))
    th.start()
    return th, box


def test_abort_request_ends_the_named_generation_only(server):
    a, box_a = _generate(server, "keep-me")
    b, box_b = _generate(server, "end-me")
    _wait_running(server, 2)
    for body in ({"rid": "no-such-rid"}, {"rid": ""}, {}):  # nothing to abort
        assert _post(server, "/abort_request", body).status_code == 200
    assert _state(server)["running_requests"] == 2
    r = _post(server, "/abort_request", {"rid": "end-me"})
    assert r.status_code == 200 and r.content == b""
    b.join(timeout=60)
    meta = box_b["r"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < LONG["max_new_tokens"]
    assert meta["weight_versions"][0]["start"] == 0  # 0.5.23 reports spans on aborted requests too
    assert a.is_alive()
    assert _post(server, "/abort_request", {"abort_all": True}).status_code == 200
    a.join(timeout=60)
    assert box_a["r"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_release_and_resume_memory_by_tags(server):
    c = server.client
    th, box = _generate(server, "long-running")
    _wait_running(server)
    r = _post(server, "/release_memory_occupation", {"tags": ["weights"]})
    assert r.status_code == 400 and "idle" in r.json()["message"]  # SGLang's scheduler asserts (and dies) here
    assert _post(server, "/abort_request", {"abort_all": True}).status_code == 200
    th.join(timeout=60)

    r = _post(server, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    assert r.status_code == 200 and r.json() is None
    assert _state(server)["released_memory"] == ["kv_cache", "weights"]
    assert _post(server, "/resume_memory_occupation", {"tags": ["cuda_graph"]}).status_code == 400  # not released
    assert _post(server, "/release_memory_occupation", {"tags": ["gpu"]}).status_code == 400

    # Generations wait while any tag is released.
    th, box = _generate(server, "after-release", {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    th.join(timeout=0.5)
    assert th.is_alive()

    # No weight update while the weights are released: refused, nothing applied.
    before = c.weights_checksum()
    w = random_weights(seed=51)
    with Trainer([c]) as trainer:
        c.begin_weight_update()
        [r] = trainer.send(list(w.items()), flattened=True, weight_version="released-v1")
        assert not isinstance(r, Exception), r
        with pytest.raises(ServerError, match="released"):
            c.end_weight_update()
        assert c.weights_checksum() == before
        # Resumed weights (as verl does before a sync), the kv cache still released: the update applies.
        assert _post(server, "/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
        c.begin_weight_update()
        [r] = trainer.send(list(w.items()), flattened=True, weight_version="released-v1")
        assert not isinstance(r, Exception), r
        c.end_weight_update()
    assert c.weights_checksum()["weight_version"] == "released-v1"
    assert th.is_alive()
    assert _post(server, "/resume_memory_occupation", {}).status_code == 400  # weights is no longer released
    assert requests.get(server.url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30).status_code == 200
    th.join(timeout=60)
    assert box["r"]["meta_info"]["finish_reason"]["type"] == "length"
    assert _state(server)["released_memory"] == []


def test_a_release_while_paused_by_retract_is_idle(server):
    c = server.client
    th, box = _generate(server, "parked")
    _wait_running(server)
    c.pause_generation("retract")
    assert _post(server, "/release_memory_occupation", {}).status_code == 200  # SGLang's ignore_waiting
    c.continue_generation()
    th.join(timeout=0.5)
    assert th.is_alive()  # still released
    assert _post(server, "/resume_memory_occupation", {}).status_code == 200
    assert _post(server, "/abort_request", {"abort_all": True}).status_code == 200
    th.join(timeout=60)
    assert box["r"]["meta_info"]["finish_reason"]["type"] == "abort"
