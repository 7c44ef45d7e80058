"""The reference server as a real process: SGLang's routes, atomic updates, failure handling, auth.

Oracles: the trainer's own tensors (served tensors must be bit-equal after a sync) and a local
transformers model with the same weights in the same dtype (greedy outputs must be identical).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import threading
import time

import pytest
import requests
import torch

from bridge.client import ServerClient, ServerGroup
from bridge.digest import tensor_checksum
from bridge.errors import ServerError
from bridge.protocol import SESSION_REQUIRED_MESSAGE
from tests.fixtures_server import GROUP_TIMEOUT, Trainer, greedy, local_model, random_weights

PROMPT = [5, 72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def servers(server_factory) -> dict:
    """Three servers started together: SGLang 0.5.23, 0.5.2, and 0.5.23 with API keys."""
    main, old, auth = server_factory.many([
        {},
        {"extra_args": ["--protocol-version", "0.5.2"]},
        {"extra_args": ["--api-key", "user-key", "--admin-api-key", "admin-key"], "api_key": "user-key"},
    ])
    return {"main": main, "old": old, "auth": auth}


@pytest.fixture(scope="module")
def ref_server(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def client(ref_server) -> ServerClient:
    return ref_server.client


@pytest.fixture
def trainer(client):
    with Trainer([client]) as t:
        yield t


def served(client: ServerClient) -> dict:
    """(version, checksum of every tensor): what must not change when an update fails."""
    r = client.weights_checksum()
    return {"version": r["weight_version"], "checksums": r["checksums"]}


def sync(trainer: Trainer, weights: dict, version: str, *, flattened=True, buckets=2) -> None:
    """One complete session update, as the publisher does it; asserts success."""
    c = trainer.clients[0]
    c.begin_weight_update()
    items = list(weights.items())
    chunks = [items[i::buckets] for i in range(buckets)]
    for k, chunk in enumerate(chunks):
        chunk.sort(key=lambda kv: -kv[1].element_size())
        [r] = trainer.send(chunk, flattened=flattened, weight_version=version if k == buckets - 1 else None)
        assert not isinstance(r, Exception), r
    c.end_weight_update()


def expect_failure(result, *fragments: str) -> ServerError:
    assert isinstance(result, ServerError), f"expected a ServerError, got {result!r}"
    assert result.status == 400, result
    for frag in fragments:
        assert frag in result.message, f"{frag!r} not in {result.message!r}"
    return result


# ---------------------------------------------------------------------------------------------- routes


def test_info_routes_speak_sglang(ref_server, client):
    info = client.model_info()
    assert info["weight_version"] == "default" or info["weight_version"]
    assert info["is_generation"] is True and info["architectures"] == ["Qwen2ForCausalLM"]
    assert info["model_type"] == "qwen2" and "model_path" in info and "tokenizer_path" in info
    assert requests.get(ref_server.url + "/get_model_info").json()["model_path"] == info["model_path"]
    si = client.server_info()
    assert si["version"] == "0.5.23" and si["tp_size"] == 1 and si["dp_size"] == 1
    assert requests.get(ref_server.url + "/get_server_info").json()["version"] == "0.5.23"
    assert client.features.needs_session and client.tp_size == 1
    assert client.health()
    assert requests.get(ref_server.url + "/health_generate").status_code == 200
    for method in ("GET", "POST"):
        r = requests.request(method, ref_server.url + "/flush_cache")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    rows = client.get_weights_by_name("model.norm.weight", truncate_size=5)
    assert len(rows) == 5 and all(isinstance(x, float) for x in rows)
    with pytest.raises(ServerError, match="Get parameter by name failed") as e:
        client.get_weights_by_name("model.nope.weight")
    assert e.value.status == 400 and e.value.route == "/get_weights_by_name"


def test_invalid_bodies_are_400_naming_the_field(ref_server):
    r = requests.post(ref_server.url + "/init_weights_update_group",
                      json={"master_address": "127.0.0.1", "master_port": "not-a-port", "rank_offset": 1})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "master_port" in r.json()["message"] and "world_size" in r.json()["message"]
    r = requests.post(ref_server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": "x"}})
    assert r.status_code == 400 and "max_new_tokens" in r.json()["error"]["message"]
    r = requests.post(ref_server.url + "/init_weights_update_group",
                      json={"master_address": "127.0.0.1", "master_port": "1", "rank_offset": 1, "world_size": 2})
    assert r.status_code == 400 and "nccl" in r.json()["message"] and "gloo" in r.json()["message"]


# ---------------------------------------------------------------------------------------------- updates


def test_session_update_is_atomic_bit_exact_and_versioned(client, trainer):
    w = random_weights(seed=1)
    before = served(client)
    client.begin_weight_update()
    items = sorted(w.items())
    half = len(items) // 2
    # The tied lm_head.weight is accepted and skipped, as SGLang does.
    bucket1 = items[:half] + [("lm_head.weight", w["model.embed_tokens.weight"])]
    [r] = trainer.send(bucket1, flattened=True)
    assert r["success"], r
    # Staged, not served: a generation and /model_info still see the old weights and version.
    assert served(client) == before
    out = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert out["meta_info"]["weight_version"] == before["version"]
    [r] = trainer.send(items[half:], flattened=False, weight_version="v1")
    assert r["success"], r
    assert served(client) == before
    assert "v1" in client.end_weight_update()["message"]

    now = served(client)
    assert now["version"] == "v1" and client.model_info()["weight_version"] == "v1"
    for name, t in w.items():
        assert now["checksums"][name] == tensor_checksum(t), name
    assert now["checksums"]["lm_head.weight"] == tensor_checksum(w["model.embed_tokens.weight"])
    rows = client.get_weights_by_name("model.layers.0.mlp.up_proj.weight", truncate_size=10_000)
    assert torch.equal(torch.tensor(rows, dtype=torch.float32), w["model.layers.0.mlp.up_proj.weight"].float())


def test_greedy_generation_matches_hf_generate(client, trainer):
    w = random_weights(seed=2)
    sync(trainer, w, "v-greedy")
    model = local_model(w)
    expected = greedy(model, PROMPT, 24)
    for _ in range(2):  # deterministic
        out = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 24})
        assert out["output_ids"] == expected
        assert out["meta_info"]["weight_version"] == "v-greedy"
        assert out["meta_info"]["completion_tokens"] == len(expected)
        assert out["meta_info"]["prompt_tokens"] == len(PROMPT) and out["meta_info"]["cached_tokens"] == 0
    # Text in, batched in, logprobs out.
    tok_prompt = client.generate(text="Hello, ", sampling_params={"temperature": 0, "max_new_tokens": 24})
    from bridge.local.presets import build_tokenizer

    tp = build_tokenizer()("Hello, ")["input_ids"]
    assert tok_prompt["output_ids"] == greedy(model, tp, 24)
    batch = client.generate(input_ids=[PROMPT, tp], sampling_params={"temperature": 0, "max_new_tokens": 24},
                            return_logprob=True)
    assert [b["output_ids"] for b in batch] == [expected, tok_prompt["output_ids"]]
    lps = batch[0]["meta_info"]["output_token_logprobs"]
    assert [x[1] for x in lps] == expected and all(x[0] <= 0 and x[2] is None for x in lps)
    long = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_sampling_params(client):
    sp = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 12, "sampling_seed": 7}
    a = client.generate(input_ids=PROMPT, sampling_params=sp)
    b = client.generate(input_ids=PROMPT, sampling_params=sp)
    assert a["output_ids"] == b["output_ids"]  # same seed, same weights
    g = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12})
    stop_tok = g["output_ids"][3]
    s = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_tok]})
    assert s["output_ids"] == g["output_ids"][: g["output_ids"].index(stop_tok) + 1]
    assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    ig = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                            "stop_token_ids": [stop_tok], "ignore_eos": True})
    assert ig["output_ids"] == g["output_ids"]
    if g["text"][2:4].strip():
        st = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 12, "stop": [g["text"][2:4]]})
        assert st["meta_info"]["finish_reason"] == {"type": "stop", "matched": g["text"][2:4]}
        assert not st["text"].count(g["text"][2:4])


def test_per_tensor_subset_update_leaves_the_rest(client, trainer):
    before = served(client)
    w = random_weights(seed=3)
    subset = {n: w[n] for n in ("model.norm.weight", "model.layers.1.self_attn.o_proj.weight")}
    sync(trainer, subset, "v-subset", flattened=False, buckets=1)
    now = served(client)
    assert now["version"] == "v-subset"
    for n, cs in before["checksums"].items():
        want = tensor_checksum(subset[n]) if n in subset else cs
        assert now["checksums"][n] == want, n


def _bad(kind: str):
    """(tensors announced and sent, announce override, wire override, flattened, expected fragments)."""
    good = ("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))
    mlp = ("model.layers.0.mlp.down_proj.weight", torch.ones(128, 256, dtype=torch.bfloat16))
    if kind == "name":
        return [("model.layers.7.mlp.up_proj.weight", torch.ones(256, 128, dtype=torch.bfloat16)), good], None, None, True, \
            ["'model.layers.7.mlp.up_proj.weight' is not a parameter"]
    if kind == "shape":
        return [(mlp[0], torch.ones(256, 128, dtype=torch.bfloat16)), good], None, None, False, \
            ["has shape [256, 128] but the served parameter has shape [128, 256]"]
    if kind == "dtype":
        return [good, (mlp[0], mlp[1].to(torch.int32))], None, None, True, ["sent as int32 but served as bfloat16",
                                                                             "send floating-point weights"]
    if kind == "bucket_bytes_more":
        buf = torch.cat([mlp[1].reshape(-1).view(torch.uint8), good[1].view(torch.uint8), torch.zeros(64, dtype=torch.uint8)])
        return [mlp, good], None, [buf], True, ["broadcast more than the 65792 bytes"]
    if kind == "bucket_bytes_fewer":
        buf = torch.cat([mlp[1].reshape(-1).view(torch.uint8), good[1].view(torch.uint8)])[:-256]
        return [mlp, good], None, [buf], True, ["broadcast fewer than the 65792 bytes"]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["name", "shape", "dtype", "bucket_bytes_more", "bucket_bytes_fewer"])
def test_bad_update_is_rejected_and_nothing_changes(client, trainer, kind):
    before = served(client)
    tensors, announce, wire, flattened, fragments = _bad(kind)
    client.begin_weight_update()
    ok = [("model.layers.0.input_layernorm.weight", torch.full((128,), 3.0, dtype=torch.bfloat16))]
    [r] = trainer.send(ok, weight_version="never")  # a good first bucket, staged then discarded
    assert r["success"]
    [r] = trainer.send(tensors, flattened=flattened, announce=announce, wire=wire)
    e = expect_failure(r, *fragments, f"still serving weight version {before['version']}")
    assert "session was aborted" in e.message
    with pytest.raises(ServerError, match="No weight update session is open.*aborted"):
        client.end_weight_update()
    assert served(client) == before
    # The broadcast was received and discarded, so the same group still works.
    sync(trainer, {"model.norm.weight": torch.full((128,), 2.0, dtype=torch.bfloat16)}, before["version"], buckets=1)


def test_float32_weights_for_a_bf16_model_are_cast_as_sglang_casts_them(client, trainer):
    """SGLang's loaders copy a received tensor into its parameter, casting it: a float32 tensor sent for a bfloat16
    parameter is served as its bfloat16 cast, as real SGLang serves it (SGLang's own test_update_weights_from_tensor
    sends float32 tensors to a bf16 model)."""
    w = torch.randn(128, 256)
    client.begin_weight_update()
    [r] = trainer.send([("model.layers.0.mlp.down_proj.weight", w)], weight_version="f32")
    assert r["success"], r
    client.end_weight_update()
    now = served(client)
    assert now["version"] == "f32"
    assert now["checksums"]["model.layers.0.mlp.down_proj.weight"] == tensor_checksum(w.to(torch.bfloat16))


def test_unknown_group_and_missing_session(client, trainer):
    before = served(client)
    t = [("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))]
    [r] = trainer.send(t, group_name="no-such-group", broadcast=False)
    expect_failure(r, SESSION_REQUIRED_MESSAGE)  # outside a session SGLang 0.5.23 says that first
    client.begin_weight_update()
    [r] = trainer.send(t, group_name="no-such-group", broadcast=False)
    expect_failure(r, "Group no-such-group not in", "Please call init_weights_update_group first")  # (session ended)
    [r] = trainer.send(t, weight_version="outside")  # 0.5.23: no begin_weight_update
    expect_failure(r, SESSION_REQUIRED_MESSAGE)
    assert served(client) == before


def test_undecodable_request_drops_the_group(client, trainer):
    before = served(client)
    t = [("model.norm.weight", torch.ones(128, dtype=torch.bfloat16))]
    client.begin_weight_update()
    [r] = trainer.send(t, announce={"dtypes": ["bf16"]})  # the client passes it on; SGLang has no torch.bf16
    expect_failure(r, "not a torch dtype name", "'bfloat16'", "init_weights_update_group again")
    client.begin_weight_update()  # the refusal ended the session
    with pytest.raises(ServerError, match="not in"):
        client.update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[128]], group_name=trainer.group_name)
    assert served(client) == before


def _dying_trainer(url: str, port: int, group: str, when: str) -> None:
    """Pauses generation, opens a session, and dies mid-broadcast or between two requests."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import threading

    import torch.distributed as dist

    from bridge.client import ServerClient
    from bridge.process_group import init_custom_process_group

    c = ServerClient(url)
    th = threading.Thread(target=c.init_weights_update_group, args=("127.0.0.1", port, 1, 2, group, "gloo"))
    th.start()
    pg = init_custom_process_group(master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                                   group_name=group, backend="gloo", timeout=20)
    th.join()
    c.pause_generation("retract")
    c.begin_weight_update()
    names, shapes = ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"], [[128], [256, 128]]
    if when == "between_requests":
        names, shapes = names[:1], shapes[:1]
    th = threading.Thread(target=c.update_weights_from_distributed, args=(names, ["bfloat16"] * len(names), shapes),
                          kwargs=dict(group_name=group, weight_version="died"), daemon=True)
    th.start()
    dist.broadcast(torch.zeros(128, dtype=torch.bfloat16), src=0, group=pg)
    # between_requests: the request completes; mid_broadcast: the server waits for a second tensor.
    th.join(timeout=10 if when == "between_requests" else 0.5)
    os._exit(3)


@pytest.mark.parametrize("when", ["mid_broadcast", "between_requests"])
def test_trainer_dying_leaves_previous_weights_and_serving(client, when):
    from bridge.process_group import find_free_port

    before = served(client)
    group = f"dying-{when}"
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_dying_trainer, args=(client.url, find_free_port(), group, when))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 3
    # The server notices the dead trainer (a failed receive, or its watchdog), discards what was staged
    # and the session, drops the group and continues the generation the trainer paused.
    deadline = time.monotonic() + GROUP_TIMEOUT + 30
    while True:
        state = client.server_info()["internal_states"][0]
        if group not in state["weight_update_groups"] and not state["paused"]:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert not state["update_session_open"]
    assert served(client) == before
    out = client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 3}, timeout=30)
    assert out["meta_info"]["weight_version"] == before["version"]


def test_model_info_answers_during_a_broadcast(client, trainer):
    before = client.model_info()["weight_version"]
    client.begin_weight_update()
    t = ("model.norm.weight", torch.full((128,), 0.5, dtype=torch.bfloat16))
    f = trainer.pool.submit(client.update_weights_from_distributed, [t[0]], ["bfloat16"], [[128]],
                            group_name=trainer.group_name, weight_version="mid")
    deadline = time.monotonic() + 30
    while client.server_info()["internal_states"][0]["receiving_on_group"] != trainer.group_name:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The server is now blocked inside the broadcast; its info routes still answer.
    assert client.model_info()["weight_version"] == before
    assert client.server_info()["internal_states"][0]["update_session_open"]
    import torch.distributed as dist

    dist.broadcast(t[1], src=0, group=trainer.pg)
    assert f.result(timeout=30)["success"]
    client.end_weight_update()
    assert client.model_info()["weight_version"] == "mid"


# ---------------------------------------------------------------------------------------------- disk


def test_disk_update(client, tmp_path):
    from bridge.local.presets import make_model_dir

    path = make_model_dir(tmp_path / "seed2", "tiny", seed=2)
    r = client.update_weights_from_disk(path, weight_version="disk-1")
    assert r["success"] and r["num_paused_requests"] == 0
    info = client.model_info()
    assert info["weight_version"] == "disk-1" and info["model_path"] == path
    from safetensors.torch import load_file

    files = load_file(os.path.join(path, "model.safetensors"))
    sums = client.weights_checksum()["checksums"]
    for n, t in files.items():
        assert sums[n] == tensor_checksum(t.to(torch.bfloat16)), n


def test_disk_update_failures_change_nothing(client, tiny_model_dir, tmp_path):
    before = served(client)
    with pytest.raises(ServerError, match="does not exist") as e:
        client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="x")
    assert e.value.status == 400
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    f = corrupt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ServerError, match="Failed to get weights iterator"):
        client.update_weights_from_disk(str(corrupt), weight_version="x")
    assert served(client) == before


def test_disk_snapshot_is_verified(client, tmp_path):
    snapshot = pytest.importorskip("bridge.snapshot")
    w = random_weights(seed=4)
    info = snapshot.write_snapshot(str(tmp_path), 5, list(w.items()))
    client.update_weights_from_disk(info.path, weight_version="5")
    assert served(client)["checksums"]["model.norm.weight"] == tensor_checksum(w["model.norm.weight"])
    before = served(client)
    info = snapshot.write_snapshot(str(tmp_path), 6, list(random_weights(seed=5).items()))
    shard = next(p for p in os.listdir(info.path) if p.endswith(".safetensors"))
    data = bytearray(open(os.path.join(info.path, shard), "rb").read())
    data[-10] ^= 0xFF  # a flipped bit in the tensor data; only the manifest's checksums catch it
    open(os.path.join(info.path, shard), "wb").write(bytes(data))
    with pytest.raises(ServerError, match=shard):
        client.update_weights_from_disk(info.path, weight_version="6")
    assert served(client) == before


# ---------------------------------------------------------------------------------------------- pause


def _wait_running(client, n=1):
    deadline = time.monotonic() + 60
    while client.server_info()["internal_states"][0]["running_requests"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_pause_abort_and_continue(client):
    long = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
    box = {}
    th = threading.Thread(target=lambda: box.update(r=client.generate(input_ids=PROMPT, sampling_params=long)))
    th.start()
    _wait_running(client)
    assert client.pause_generation("abort")["status"] == "ok"
    th.join(timeout=30)
    assert box["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert box["r"]["meta_info"]["completion_tokens"] < 1500
    # While paused, new generations wait.
    # ignore_eos: the module's server serves whatever weights earlier tests left, which may stop early.
    short = {"max_new_tokens": 3, "ignore_eos": True}
    th = threading.Thread(target=lambda: box.update(r2=client.generate(input_ids=PROMPT, sampling_params=short)))
    th.start()
    th.join(timeout=0.5)
    assert th.is_alive()
    client.continue_generation()
    th.join(timeout=30)
    assert box["r2"]["meta_info"]["finish_reason"]["type"] == "length"


def test_generations_during_updates_see_one_version(client, trainer):
    ws = {f"g{i}": random_weights(seed=10 + i) for i in range(2)}
    oracles = {v: greedy(local_model(w), PROMPT, 30, ignore_eos=True) for v, w in ws.items()}
    sync(trainer, ws["g0"], "g0")
    results, stop = [], threading.Event()

    def loop():
        while not (results and stop.is_set()):
            results.append(client.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 30,
                                                                              "ignore_eos": True}))

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for th in threads:
        th.start()
    for v in ("g1", "g0", "g1"):
        sync(trainer, ws[v], v)  # no pause: each swap waits for the generations in flight
    stop.set()
    for th in threads:
        th.join(timeout=60)
    assert results
    for r in results:
        assert r["output_ids"] == oracles[r["meta_info"]["weight_version"]]


# ---------------------------------------------------------------------------------------------- other servers


def test_old_protocol_server(servers):
    c = servers["old"].client
    assert c.version == "0.5.2" and not c.features.needs_session and not c.features.flattened_bucket
    before = served(c)
    w = {"model.norm.weight": torch.full((128,), 0.25, dtype=torch.bfloat16)}
    with Trainer([c]) as t:
        assert c.begin_weight_update()["success"]  # client no-op
        [r] = t.send(list(w.items()), weight_version="old-1")  # no session needed
        assert r["success"] and "Weight version updated to old-1" in r["message"]
        assert served(c)["version"] == "old-1"
        assert served(c)["checksums"]["model.norm.weight"] == tensor_checksum(w["model.norm.weight"])
    # Routes 0.5.2 lacks answer 404, as SGLang 0.5.2's do; the /get_* info routes answer.
    for route in ("/server_info", "/model_info"):
        assert requests.get(c.url + route).status_code == 404
    assert requests.get(c.url + "/get_server_info").json()["version"] == "0.5.2"
    for route in ("/begin_weight_update", "/end_weight_update", "/destroy_weights_update_group"):
        assert requests.post(c.url + route, json={}).status_code == 404
    assert requests.get(c.url + "/get_weight_version").json() == {"weight_version": "old-1"}
    assert before["version"] == "default"


def test_api_keys(servers):
    url = servers["auth"].url

    def call(method, route, key=None, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.request(method, url + route, headers=headers, **kw).status_code

    assert call("GET", "/health") == 200
    assert call("GET", "/model_info") == 401
    assert call("GET", "/model_info", "user-key") == 200
    assert call("GET", "/model_info", "admin-key") == 401  # normal routes take the api key only
    body = {"new_version": "k", "abort_all_requests": False}
    assert call("POST", "/update_weight_version", json=body) == 401
    assert call("POST", "/update_weight_version", "user-key", json=body) == 401  # admin routes: admin key only
    assert call("POST", "/update_weight_version", "admin-key", json=body) == 200
    with pytest.raises(ServerError) as e:
        ServerClient(url, api_key="user-key").update_weight_version("x")
    assert e.value.status == 401
    # A server with both keys: the client sends each route the key SGLang's auth decides for it.
    both = ServerClient(url, api_key="user-key", admin_api_key="admin-key")
    assert both.update_weight_version("y")["new_version"] == "y" and both.model_info()["weight_version"] == "y"
    assert ServerGroup([url], api_key="user-key", admin_api_key="admin-key").weight_versions() == {url: "y"}


def test_weights_checker_answers_501_naming_why(client):
    """SGLang's ``/weights_checker`` (0.5.6+) checksums its runners' own tensor layout; the reference server
    answers 501 naming its own checksum route instead of a bare 404."""
    for method in ("GET", "POST"):
        r = requests.request(method, client.url + "/weights_checker", json={"action": "checksum"}, timeout=10)
        assert r.status_code == 501, r.text
        assert r.json()["success"] is False and "/wsync/weights_checksum" in r.json()["message"]
