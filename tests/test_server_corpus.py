"""A bad-input corpus against the reference server, with and without API keys.

Every control route gets wrong types, sizes, paths, encodings and nesting (and the keyed server wrong
credentials). After each request: no 5xx, an answer within ANSWER_S, ``/health`` within ROUTE_S, and the
served weights and version unchanged.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time

import pytest
import requests

from inference_adapter.server import ADMIN_ROUTES

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
NORM = "model.norm.weight"
BIG = "x" * (1 << 20)
DEEP = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
KEYS = {"admin": {"Authorization": "Bearer admin-key"}, "user": {"Authorization": "Bearer user-key"}, "none": {}}


RECEIVE_TIMEOUT_S = 2.0  # the servers' --receive-timeout
# A bad request is refused before any work, and /health does none (routes/info.py), so both answer in
# milliseconds unless the server waits on what a request sent it; the longest it may wait for that is its
# own bound for bytes a client announced, --receive-timeout. A frozen or dead server never answers; a
# loaded machine still answers within the bound. ANSWER_S leaves the request itself a whole group timeout.
ROUTE_S = RECEIVE_TIMEOUT_S
ANSWER_S = 10.0


@pytest.fixture(scope="module")
def servers(server_factory):
    receive = ["--receive-timeout", str(RECEIVE_TIMEOUT_S)]
    plain, keyed = server_factory.many([
        {"extra_args": receive},
        {"extra_args": [*receive, "--api-key", "user-key", "--admin-api-key", "admin-key"], "api_key": "user-key"},
    ])
    return {"plain": plain, "keyed": keyed}


def _shm_entry(**desc) -> str:
    full = {"path": os.path.join(SHM, "wsync-corpus-missing"), "nbytes": 256, "names": [NORM], "dtypes": ["bfloat16"],
            "shapes": [[128]], **desc}
    return base64.b64encode(json.dumps(full).encode()).decode()


def _route_cases() -> list[tuple[str, str, object]]:
    """(method, route, body): bodies are JSON-able objects, or raw bytes sent as they are."""
    generic = [b"", b"null", b"[]", b"123", b'"s"', b"{", b"\xff\xfe{}", b"\xef\xbb\xbf{}", DEEP,
               b'{"x": NaN}', b'{"x": "\\ud800"}', b'{"\\udc00": 1}']
    routes = ["/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
              "/update_weights_from_disk", "/update_weight_version", "/destroy_weights_update_group",
              "/pause_generation", "/continue_generation", "/end_weight_update", "/wsync/abort_weight_update",
              "/get_weights_by_name", "/wsync/weights_checksum", "/generate", "/wsync/bench/recv_raw",
              "/wsync/writer_lease", "/v1/completions", "/v1/chat/completions", "/abort_request",
              "/release_memory_occupation", "/resume_memory_occupation"]
    cases = [("POST", r, b) for r in routes for b in generic]
    init = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    cases += [("POST", "/init_weights_update_group", {**init, **bad}) for bad in (
        {"world_size": 10**20}, {"world_size": 0}, {"world_size": -1}, {"rank_offset": 0}, {"rank_offset": 5},
        {"master_port": 0}, {"master_port": 70000}, {"master_port": "x"}, {"master_port": 10**30},
        {"backend": "mpi"}, {"backend": "nccl"}, {"group_name": ""}, {"group_name": BIG}, {"master_address": [1]},
        {"master_address": None}, {"world_size": "2.5"})]
    dist = {"names": [NORM], "dtypes": ["bfloat16"], "shapes": [[128]], "group_name": "no-such-group"}
    cases += [("POST", "/update_weights_from_distributed", {**dist, **bad}) for bad in (
        {}, {"shapes": [[10**20]]}, {"shapes": [[-1]]}, {"names": [NORM, NORM]}, {"dtypes": ["float128"]},
        {"dtypes": ["_C"]}, {"load_format": "pickle"}, {"weight_version": "\ud800"}, {"names": "x"},
        {"shapes": [["a"]]}, {"group_name": BIG}, {"names": [BIG]})]
    tensor = {"load_format": "wsync_shm"}
    cases += [("POST", "/update_weights_from_tensor", {**tensor, "serialized_named_tensors": entries, **extra})
              for entries, extra in (
                  (["not base64!"], {}), ([base64.b64encode(b"not json").decode()], {}),
                  ([base64.b64encode(b"[1, 2]").decode()], {}), ([base64.b64encode(b"{}").decode()], {}),
                  ([_shm_entry(path="/etc/passwd")], {}), ([_shm_entry(path="../../etc/passwd")], {}),
                  ([_shm_entry(path=SHM + "/../../etc/passwd")], {}), ([_shm_entry(nbytes=-1)], {}),
                  ([_shm_entry(nbytes=True)], {}), ([_shm_entry(shapes=[[10**20]])], {}), ([_shm_entry(pid=-1)], {}),
                  ([_shm_entry(pid="1")], {}), ([_shm_entry(pid=2**22 + 12345)], {}), ([_shm_entry(dtypes=["x"])], {}),
                  ([_shm_entry()], {}), ([_shm_entry(), _shm_entry()], {}), ([], {}), ([_shm_entry()], {"load_format": None}),
                  ([base64.b64encode(BIG.encode()).decode()], {}))]
    cases += [("POST", "/update_weights_from_disk", {"model_path": p}) for p in (
        "/", "/etc", "", "relative/dir", "/tmp/a\u0000b", "/" + BIG, "/etc/passwd", "/proc/self", "/dev/null",
        tempfile.gettempdir() + "/../etc", 5, None)]
    cases += [("POST", "/update_weights_from_disk", {"model_path": "/", "weight_version": v}) for v in ("", BIG, 5)]
    cases += [("POST", "/update_weight_version", {"new_version": v}) for v in ("", BIG, "\ud800", "a\nb", None, 5, [1])]
    cases += [("POST", "/destroy_weights_update_group", {"group_name": g}) for g in ("none", BIG, 5)]
    cases += [("POST", "/pause_generation", {"mode": m}) for m in ("x", 1, None)]
    cases += [("POST", "/continue_generation", {"torch_empty_cache": "maybe"}),
              ("POST", "/begin_weight_update", {"selector": "x"})]
    cases += [("POST", "/get_weights_by_name", b) for b in (
        {}, {"name": BIG}, {"name": NORM, "truncate_size": -5}, {"name": NORM, "truncate_size": 10**20},
        {"name": NORM, "truncate_size": "x"})]
    cases += [("POST", "/wsync/weights_checksum", b) for b in ({"names": "x"}, {"names": [1]}, {"names": ["nope"]})]
    prompt = [5, 72, 101]
    cases += [("POST", "/generate", b) for b in (
        {}, {"text": "a", "input_ids": prompt}, {"input_ids": [-1]}, {"input_ids": [10**20]}, {"input_ids": [[]]},
        {"input_ids": []}, {"text": ["a", 1]}, {"text": ""}, {"text": "a", "sampling_params": [{}, {}]},
        {"text": ["a", "b"], "rid": ["x"]}, {"text": "a", "return_logprob": "x"}, {"text": "a", "stream": "x"},
        *[{"input_ids": prompt, "sampling_params": {**sp, "max_new_tokens": 2}} for sp in (
            {"max_new_tokens": -1}, {"temperature": -1}, {"temperature": "nan"}, {"temperature": "inf"},
            {"top_p": 0}, {"top_p": "nan"}, {"top_k": 0}, {"min_p": 2}, {"n": 2}, {"stop_token_ids": [-1]},
            {"stop_token_ids": [10**20]}, {"min_new_tokens": 2, "stop_token_ids": [10**6]}, {"seed": -1},
            {"sampling_sed": 2**70}, {"sampling_seed": 2**70}, {"stop": [BIG]}, {"frequency_penalty": 1},
            {"temperature": 1e-300}, {"top_k": 10**20})])]
    cases += [("POST", "/v1/completions", b) for b in (
        {}, {"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1]}, {"prompt": [10**20]}, {"prompt": ["a", 1]},
        {"prompt": "a", "max_tokens": -1}, {"prompt": "a", "max_tokens": "x"}, {"prompt": "a", "n": 2},
        {"prompt": "a", "temperature": -1}, {"prompt": "a", "top_p": 0}, {"prompt": "a", "seed": -1},
        {"prompt": "a", "logprobs": 1, "echo": True}, {"prompt": "a", "stop": [BIG], "max_tokens": 2},
        {"prompt": "a", "stream": "x"}, {"prompt": "a", "frequency_penalty": 1})]
    cases += [("POST", "/v1/chat/completions", b) for b in (
        {}, {"messages": []}, {"messages": "hi"}, {"messages": [1]}, {"messages": [{}]}, {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": [1, {"type": "image_url"}]}], "max_tokens": 2},
        {"messages": [{"role": "user", "content": {"a": 1}}], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": "x"},
        {"messages": [{"role": "user", "content": "a"}], "n": 2},
        {"messages": [{"role": "user", "content": BIG}], "max_tokens": 2})]
    cases += [("POST", "/abort_request", b) for b in ({"rid": 5}, {"rid": BIG}, {"abort_all": "maybe"}, {"rid": ["a"]})]
    cases += [("POST", route, b) for route in ("/release_memory_occupation", "/resume_memory_occupation") for b in (
        {"tags": "weights"}, {"tags": [1]}, {"tags": ["gpu"]}, {"tags": [BIG]})]
    cases += [("POST", "/resume_memory_occupation", b) for b in ({}, {"tags": ["weights"]})]  # nothing released
    cases += [("POST", "/wsync/writer_lease", b) for b in (
        {"wsync_writer": BIG}, {"wsync_writer": "w", "lease_s": "x"}, {"wsync_writer": "w", "lease_s": 1e308},
        {"wsync_writer": "w", "lease_s": -1}, {"wsync_writer": "w", "release": 1}, {"wsync_writer": ["w"]},
        {"wsync_writer": "w", "wsync_run_id": "\ud800"}, {"wsync_writer": "w", "starts_sync": "yes"})]
    cases += [("POST", "/wsync/bench/recv_raw", b) for b in (
        {"group_name": "none", "nbytes": 0}, {"group_name": "none", "nbytes": 10**20}, {"group_name": "none", "nbytes": 8},
        {"group_name": "", "nbytes": 8}, {"group_name": "none", "nbytes": 8, "extra": 1})]
    return cases


def _served(url: str, keyed: bool) -> tuple:
    headers = KEYS["admin" if keyed else "none"]
    r = requests.post(url + "/wsync/weights_checksum", json={}, headers=headers, timeout=30).json()
    return r["weight_version"], r["checksums"]


def _run(url: str, keyed: bool, cases: list) -> list[str]:
    """Send every case (with the key its route needs, if ``keyed``); the failures of the no-5xx /
    no-freeze / nothing-changed contract."""
    before = _served(url, keyed)
    problems = []
    for method, route, body in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        what = f"{method} {route} {data[:80]!r}"
        headers = KEYS["none" if not keyed else "admin" if route in ADMIN_ROUTES else "user"]
        try:
            r = requests.request(method, url + route, data=data, timeout=ANSWER_S,
                                 headers={"content-type": "application/json", **headers})
            if r.status_code >= 500:
                problems.append(f"{what}: HTTP {r.status_code} {r.text[:200]}")
        except requests.RequestException as e:
            problems.append(f"{what}: no answer ({type(e).__name__})")
        t0 = time.monotonic()
        try:
            requests.get(url + "/health", timeout=ROUTE_S).raise_for_status()
        except requests.RequestException as e:
            problems.append(f"{what}: /health did not answer within ROUTE_S={ROUTE_S} s ({e})")
            break
        if time.monotonic() - t0 > ROUTE_S:
            problems.append(f"{what}: /health took {time.monotonic() - t0:.2f} s (ROUTE_S={ROUTE_S} s)")
        if _served(url, keyed) != before:
            problems.append(f"{what}: the served weights or version changed")
            break
    return problems


def test_corpus_without_keys(servers):
    cases = _route_cases()
    assert len(cases) > 150
    assert _run(servers["plain"].url, False, cases) == []


def test_corpus_with_keys_and_bad_credentials(servers):
    url = servers["keyed"].url
    routes = ["/update_weight_version", "/update_weights_from_disk", "/generate", "/model_info", "/begin_weight_update"]
    bad_auth = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}, {"Authorization": "Basic YTpi"},
                {"Authorization": "Bearer " + "k" * 10_000}, {"Authorization": "Bearer admin-key user-key"}]
    for route in routes:
        for headers in bad_auth:
            r = requests.post(url + route, json={"new_version": "z", "model_path": "/"}, headers=headers, timeout=10)
            assert r.status_code in (401, 405), (route, headers.get("Authorization", "")[:20], r.status_code)
    # The user key does not open admin routes.
    r = requests.post(url + "/update_weight_version", json={"new_version": "z"}, headers={"Authorization": "Bearer user-key"})
    assert r.status_code == 401
    assert _run(url, True, _route_cases()) == []
