"""Real SGLang in the loop: SGLang 0.5.23's whole server (``python -m sglang.launch_server``: HTTP server,
tokenizer manager, scheduler and detokenizer processes) on CPU, started by the project's launcher, with every path
the project claims for SGLang driven into it by a 2-rank FSDP2 trainer.

Three servers live for the module. Two of the ``tiny-llama`` preset: SGLang's Llama answers ``/get_weights_by_name``
for every tensor, so every served tensor is read back and compared with the trainer's (SGLang's Qwen2 has no such
method: on a Qwen2 what can be checked from outside is the version SGLang reports and its greedy answer, and SGLang's
own Qwen2 ``load_weights`` is compared tensor by tensor in the ``sglang_code`` tier). ``llama`` is started with the
delta loader; ``spare`` takes the generating clients, and with ``llama`` makes the fleet of two that the fault tests
cut in half. ``lora``, the ``tiny`` Qwen2 with SGLang's LoRA enabled, takes the adapters. Versions only go up on a
server shared by the tests: each test publishes from its own block.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests import sync_bodies as sb
from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.real_sglang, pytest.mark.usefixtures("real_sglang_alive")]

LOADER = "bridge.serving.sglang_delta_loader.load_delta"
LLAMA = "tiny-llama"
BOUNDS = dict(group_timeout=20, http_timeout=20)
# A dead trainer rank is known to rank 0 only when its step's bound ran out: short enough for the test, twice what a
# real server under CI's load was once seen to take to join the group.
DEAD_RANK_BOUNDS = dict(group_timeout=8, http_timeout=8)
# SGLang's LoRA on CPU: the torch-native backend, every projection (the trainer's LoraConfig targets them all).
LORA_FLAGS = ["--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", "8", "--max-loras-per-batch", "2",
              "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OFFLINE = {"HF_HUB_OFFLINE": "1"}  # SGLang's reload of an adapter that came by tensors asks the hub for "__tensor__"


@pytest.fixture(scope="module")
def servers(real_sglang):
    llama, spare, lora = real_sglang.start([dict(preset=LLAMA, extra_args=["--custom-weight-loader", LOADER]),
                                            dict(preset=LLAMA), dict(preset="tiny", extra_args=LORA_FLAGS, env=OFFLINE)])
    return SimpleNamespace(llama=llama, spare=spare, lora=lora, all=real_sglang)


# ---------------------------------------------------------------------------------------------- the oracles


def served_mismatches(url: str, full: dict[str, torch.Tensor]) -> list[str]:
    """The trainer's tensors (``full``, HF names) that the server does not serve bit-equal in bfloat16, read back
    one by one through SGLang's ``/get_weights_by_name`` (q/k/v and gate/up as their slices of SGLang's stacked
    tensors; float32 lists of the bf16 values, so the comparison is exact)."""
    from bridge.client import ServerClient

    c = ServerClient(url, timeout=30)
    bad = []
    for name, t in full.items():
        want = t.to(torch.bfloat16).to(torch.float32)
        got = torch.tensor(c.get_weights_by_name(name, truncate_size=want.shape[0]), dtype=torch.float32)
        if got.shape != want.shape or not torch.equal(got, want):
            bad.append(name)
    return bad


def own_full(engine) -> dict[str, torch.Tensor] | None:
    """Every tensor of the trainer, whole (collective; rank 0 gets them, the others None)."""
    full = {s.name: t.clone() for s, t in engine.iter_full_tensors() if t is not None}
    return full if engine.rank == 0 else None


def greedy_expected(engine, full: dict, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy answer on the trainer's weights in bfloat16 (what SGLang serves)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(engine.model_config, dtype=torch.bfloat16).eval()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in full.items()}, strict=False)
    model.tie_weights()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def left_as_it_was(url: str, version: int, full: dict | None) -> dict:
    """A server right after a failed sync: answers a generation at once (not paused), labelled ``version``, a new
    update session opens (none was left open), and (``full``: the trainer's weights of ``version``) serves them."""
    from bridge.client import ServerClient

    c = ServerClient(url, timeout=15)
    t = time.monotonic()
    try:
        answer = c.generate(input_ids=[1, 4, 5], sampling_params={"temperature": 0, "max_new_tokens": 1})
        generate = dict(seconds=time.monotonic() - t, version=answer["meta_info"]["weight_version"])
    except Exception as e:  # a paused server holds the generation until the timeout
        generate = dict(error=str(e))
    version_now = c.model_info()["weight_version"]
    c.begin_weight_update()
    c.end_weight_update()
    return dict(generate=generate, version=version_now, expected=str(version),
                mismatched=served_mismatches(url, full) if full is not None else None)


def assert_left(state: dict, where: str) -> None:
    assert "seconds" in state["generate"], f"{where}: no generation answered: {state['generate']}"
    assert state["version"] == state["expected"] == state["generate"]["version"], f"{where}: {state}"
    assert state["mismatched"] in (None, []), f"{where}: torn: {state['mismatched'][:5]}"


# ---------------------------------------------------------------------------------------------- every path


def _publish_and_read_back(url: str, first: int, steps: int, config: dict):
    """Every rank: train and publish ``steps`` versions from ``first`` (a step between each), then compare every
    served tensor with the trainer's (rank 0). ``config["cost_model"]`` False: the delta's cost model never turns a
    delta into a full sync (where the test is about the deltas' path, not about which one is faster here)."""
    from bridge import PublisherConfig, WeightPublisher

    config = dict(config)
    if not config.pop("cost_model", True):
        from tests.test_delta import without_cost_model

        without_cost_model()
    engine = sb.engine(LLAMA)
    pub = WeightPublisher(PublisherConfig(servers=[url], bucket_mb=0.1, progress=False, **{**BOUNDS, **config}))
    try:
        results = []
        for v in range(first, first + steps):
            sb.train_step(engine, v)
            r = pub.publish(engine, version=v)
            results.append(dict(version=r.version, servers=r.servers, encoding=r.encoding, buckets=r.buckets,
                                bytes=r.bytes))
        full = own_full(engine)
        if engine.rank != 0:
            return None
        from bridge.client import ServerClient

        return dict(results=results, mismatched=served_mismatches(url, full), total=len(full),
                    version=ServerClient(url).model_info()["weight_version"])
    finally:
        pub.close()
        engine.destroy()


@pytest.mark.parametrize("transport,first", [("broadcast", 100), ("colocated", 200)])
def test_every_served_tensor_equals_the_trainers(servers, transport, first):
    """Broadcast (the whole sync in one request, and bucket by bucket) and colocated (the buckets in shared memory,
    SGLang's plain per-tensor payload): after each run every tensor real SGLang serves is the trainer's."""
    for i, config in enumerate([dict(), dict(atomic_mb=0)] if transport == "broadcast" else [dict()]):
        v0 = first + 10 * i
        rank0, _ = run_ranks(_publish_and_read_back, 2, args=(servers.llama.url, v0, 3, dict(transport=transport, **config)),
                             timeout=300)
        assert [r["version"] for r in rank0["results"]] == [v0, v0 + 1, v0 + 2], rank0
        assert all(r["servers"] == {servers.llama.url: "ok"} and r["buckets"] > 1 for r in rank0["results"]), rank0
        assert rank0["mismatched"] == [], f"{transport} {config}: {rank0['mismatched'][:5]} of {rank0['total']} differ"
        assert rank0["version"] == str(v0 + 2)
    assert servers.llama.alive()


def _mapped_segments(server) -> list[str]:
    """The project's shared-memory files that a process of the server has mapped now."""
    import psutil

    found = []
    for proc in [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]:
        with open(f"/proc/{proc.pid}/maps") as f:
            found += [line.split()[-1] for line in f if "/wsync-" in line]
    return found


def test_a_colocated_bucket_leaves_nothing_mapped_or_waiting(servers):
    """A colocated bucket real SGLang refuses (outside an update session: refused before it is unpickled) answers at
    once and leaves no segment mapped in any of the server's processes; one it loads is let go of once answered; the
    segments are removed when the publisher closes."""
    from bridge.buckets import flatten_tensors, plan_buckets
    from bridge.client import ServerClient
    from bridge.errors import ServerError
    from bridge.local.presets import build_model
    from bridge.tensors import ParamSpec
    from bridge.transports.shared_tensors import SharedBuckets

    c = ServerClient(servers.llama.url)
    weights = {n: p.detach().to(torch.bfloat16) for n, p in build_model(LLAMA, seed=5).named_parameters()}
    bucket = plan_buckets([ParamSpec(n, tuple(t.shape), t.dtype) for n, t in weights.items()], 1 << 30)[0]
    shared = SharedBuckets()
    try:
        buf = shared.buffer(0, bucket.nbytes)
        flatten_tensors(bucket, weights, out=buf)
        entries = shared.serialize(bucket, buf, c.tp_size)
        with pytest.raises(ServerError, match="begin_weight_update"):
            c.update_weights_from_tensor(entries, timeout=30)
        assert _mapped_segments(servers.llama) == []
        c.begin_weight_update()
        try:
            c.update_weights_from_tensor(entries, timeout=30)
        finally:
            c.update_weight_version("segments")
            c.end_weight_update()
        assert _mapped_segments(servers.llama) == []
        assert served_mismatches(servers.llama.url, {"model.norm.weight": weights["model.norm.weight"]}) == []
        paths = [seg.path for seg in shared._segments if seg is not None]
        assert paths and all(os.path.exists(p) for p in paths)
    finally:
        shared.close()
    assert not any(os.path.exists(p) for p in paths)


def test_deltas_through_sglangs_loader_with_anchors(servers):
    """The delta encoding into real SGLang started with ``--custom-weight-loader bridge.serving.sglang_delta_loader.load_delta``:
    anchors where due (the first sync, every third), deltas between them, and every served tensor the trainer's. (On
    loopback a delta of this small model is not clearly faster than the full sync, so the cost model is off here; the
    zstd stage, which ``auto`` leaves to slow links, is on, so SGLang's scheduler decodes it too.)"""
    rank0, _ = run_ranks(_publish_and_read_back, 2, args=(servers.llama.url, 300, 6, dict(
        transport="broadcast", encoding="delta", delta_anchor_every=3, delta_max_fraction=1.0, cost_model=False,
        delta_zstd="on")),
        timeout=300)
    kinds = [r["encoding"] for r in rank0["results"]]
    assert kinds[0] == "anchor" and "delta" in kinds and kinds.count("anchor") >= 2, kinds
    anchor = rank0["results"][0]["bytes"]
    assert all(r["bytes"] < anchor for r in rank0["results"] if r["encoding"] == "delta"), rank0["results"]
    assert rank0["mismatched"] == [], rank0["mismatched"][:5]
    assert rank0["version"] == "305"


def _publish_disk(nr: str, root: str, first: int, steps: int):
    """Every rank: publish ``steps`` versions by disk (announced in ``nr``); rank 0 returns the trainer's tensors."""
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine(LLAMA)
    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr, snapshot_root=root, experiment="real",
                                          trial=f"disk{first}", progress=False, **BOUNDS))
    try:
        for v in range(first, first + steps):
            sb.train_step(engine, v)
            pub.publish(engine, version=v)
        return own_full(engine)
    finally:
        pub.close()
        engine.destroy()


def _wait_version(url: str, version: int, seconds: float) -> str:
    from bridge.client import ServerClient

    c, deadline = ServerClient(url), time.monotonic() + seconds
    while (now := c.model_info()["weight_version"]) != str(version) and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def test_disk_with_wsync_watch_and_with_disk_watcher(servers, tmp_path):
    """Disk: snapshots announced in a directory, loaded into real SGLang by ``wsync watch`` (the command, as a user
    runs it) and by :class:`inference_adapter.DiskWatcher` (the API); every served tensor is the trainer's."""
    from bridge.client import ServerGroup
    from inference_adapter import DiskWatcher

    url, nr, root = servers.llama.url, f"file://{tmp_path / 'nr'}", str(tmp_path / "snap")
    watch = subprocess.Popen([sys.executable, "-m", "wsync", "watch", "--server", url, "--name-resolve", nr,
                              "--experiment", "real", "--trial", "disk400"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        full = run_ranks(_publish_disk, 2, args=(nr, root, 400, 2), timeout=300)[0]
        assert _wait_version(url, 401, 30) == "401"
        assert served_mismatches(url, full) == []
    finally:
        watch.send_signal(signal.SIGINT)
        out = watch.communicate(timeout=30)[0]
    assert "401" in out, out[-2000:]

    watcher = DiskWatcher(nr, "real", "disk500", ServerGroup([url]))
    watcher.start()
    try:
        full = run_ranks(_publish_disk, 2, args=(nr, root, 500, 2), timeout=300)[0]
        assert _wait_version(url, 501, 30) == "501"
        assert served_mismatches(url, full) == []
    finally:
        watcher.stop()


# ---------------------------------------------------------------------------------------------- generation


def _publish_while_generating(url: str, mode: str, first: int, n: int):
    """Every rank: 4 client threads (rank 0) generate throughout while ``n`` versions are published by broadcast with
    ``pause_mode=mode``, a training step between each; then rank 0 compares a greedy answer with transformers'."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.client import ServerClient

    engine = sb.engine(LLAMA)
    pub = WeightPublisher(PublisherConfig(servers=[url], pause_mode=mode, bucket_mb=0.1, progress=False, **BOUNDS))
    stop, answers, errors = threading.Event(), [], []

    def client(i: int) -> None:
        c = ServerClient(url, timeout=60)
        while not stop.is_set():
            try:
                out = c.generate(input_ids=[1] + [3 + b for b in f"rev {i}=".encode()],
                                 sampling_params={"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
                answers.append(dict(thread=i, meta=out["meta_info"]))
            except Exception as e:  # counted: the test expects none
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)] if engine.rank == 0 else []
    try:
        for t in threads:
            t.start()
        published = []
        for v in range(first, first + n):
            sb.train_step(engine, v)
            published.append(pub.publish(engine, version=v).version)
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(120)
        full = own_full(engine)
        if engine.rank != 0:
            return None
        prompt = [1] + [3 + b for b in b"rev hello="]
        got = ServerClient(url).generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
        return dict(published=published, answers=answers, errors=errors, greedy=got["output_ids"],
                    expected=greedy_expected(engine, full, prompt, 8), version=got["meta_info"]["weight_version"])
    finally:
        stop.set()
        pub.close()
        engine.destroy()


@pytest.mark.parametrize("mode,first", [("abort", 1000), ("retract", 2000), ("in_place", 3000)])
def test_ten_publishes_while_four_clients_generate(servers, mode, first):
    """In each pause mode SGLang 0.5.23 has: 10 broadcast publishes with training steps between them while 4 client
    threads generate: no request fails (none is aborted but by ``abort``), each thread sees versions only go up, and
    the spans SGLang reports (``meta_info.weight_versions``) cover each answer's tokens with published versions in
    order; then SGLang's greedy answer is transformers' on the trainer's weights."""
    r = run_ranks(_publish_while_generating, 2, args=(servers.spare.url, mode, first, 10), timeout=400)[0]
    assert r["errors"] == [], r["errors"][:3]
    assert r["published"] == list(range(first, first + 10))
    labels = {str(v) for v in r["published"]} | {str(first - 1000 + 9) if first > 1000 else "default"}
    aborted = [a for a in r["answers"] if a["meta"]["finish_reason"]["type"] == "abort"]
    if mode != "abort":
        assert not aborted, f"{len(aborted)} of {len(r['answers'])} aborted under pause_mode={mode}"
    done = [a for a in r["answers"] if a["meta"]["finish_reason"]["type"] != "abort"]
    assert len(done) >= 8, f"only {len(done)} answers in {mode}"
    last_seen: dict[int, int] = {}
    for a in done:
        spans, meta = a["meta"]["weight_versions"], a["meta"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == meta["completion_tokens"], meta
        assert all(x["end"] == y["start"] for x, y in zip(spans, spans[1:])), spans
        assert all(s["version"] in labels for s in spans), (spans, sorted(labels))
        numbers = [int(s["version"]) for s in spans if s["version"] != "default"]
        assert numbers == sorted(numbers) and spans[-1]["version"] == meta["weight_version"], spans
        if numbers:
            assert numbers[0] >= last_seen.get(a["thread"], 0), f"thread {a['thread']} went back: {spans}"
            last_seen[a["thread"]] = numbers[-1]
    assert r["version"] == str(first + 9)
    assert r["greedy"] == r["expected"], (r["greedy"], r["expected"])


# ---------------------------------------------------------------------------------------------- LoRA


def _adapters_while_generating(url: str, root: str, nr: str, via: str, n: int):
    """Every rank: ``n`` adapter publishes by ``via`` with a training step before each, while 4 client threads (rank 0)
    generate with ``lora_path`` all along; after each publish rank 0 compares SGLang's greedy answer with the adapter
    to the trainer's PEFT model on the same base weights."""
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from tests.test_lora import lora_engine
    from wsync.demo import _with_adapter

    engine = lora_engine(lr=3e-2)
    name = f"policy-{via}"
    pub = AdapterPublisher(AdapterPublisherConfig(name=name, via=via, servers=[url], root=root, name_resolve=nr))
    stop, answers, errors, cache, checks = threading.Event(), [], [], {}, []
    prompt = [1] + [3 + b for b in b"rev wsync="]

    def client() -> None:
        c = ServerClient(url, timeout=60)
        while not stop.is_set():
            try:
                out = c.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 4}, lora_path=name)
                answers.append(out["output_ids"])
            except Exception as e:  # counted: by disk none is expected
                errors.append(str(e)[:300])

    threads = []
    try:
        for v in range(1, n + 1):
            sb.train_step(engine, v)
            seconds = pub.publish(engine, version=v).seconds
            adapter = engine.gather_adapter()  # collective
            if engine.rank != 0:
                continue
            if v == 1:  # the adapter exists now: the clients start
                threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
                for t in threads:
                    t.start()
            base = cache.get("base")
            if base is None:
                from bridge.local.presets import build_model

                base = cache["base"] = build_model("tiny").to(torch.bfloat16).eval()
            model = _with_adapter(cache, base, engine.adapter_config(), {k: t.to(torch.bfloat16) for k, t in adapter.items()})
            with torch.no_grad():
                ids = torch.tensor([prompt])
                want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            got = ServerClient(url).generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8},
                                             lora_path=name)["output_ids"]
            checks.append(dict(version=v, seconds=seconds, equal=got == want[:len(got)] and len(got) > 0, got=got, want=want))
        stop.set()
        for t in threads:
            t.join(60)
        return dict(checks=checks, answers=len(answers), errors=errors) if engine.rank == 0 else None
    finally:
        stop.set()
        pub.close()
        engine.destroy()


@pytest.mark.parametrize("via", ["disk", "tensors"])
def test_ten_adapter_publishes_while_four_clients_generate_with_it(servers, tmp_path, via):
    """LoRA into real SGLang (``--enable-lora --lora-backend torch_native``): 10 adapter publishes by disk and by tensors
    with training steps between them while 4 clients generate with ``lora_path``; after each, SGLang's greedy answer
    with the adapter is the trainer's PEFT model's. SGLang cannot replace a loaded adapter: it is unloaded, then
    loaded. By disk no request is refused in that gap (SGLang reloads the publisher's ``current`` link, already the new
    version); by tensors a generation arriving in it is refused, with SGLang's own one-line error (docs/lora.md)."""
    r = run_ranks(_adapters_while_generating, 2, args=(servers.lora.url, str(tmp_path / "adapters"),
                                                        f"file://{tmp_path / 'nr'}", via, 10), timeout=400)[0]
    assert [c["version"] for c in r["checks"]] == list(range(1, 11))
    assert all(c["equal"] for c in r["checks"]), "; ".join(f"v{c['version']}: {c['got']} against the trainer's {c['want']}" for c in r["checks"])
    assert r["answers"] >= 10, r
    if via == "disk":
        assert r["errors"] == [], r["errors"][:3]
    else:
        assert all("\n" not in e for e in r["errors"]), r["errors"][:3]
    print(f"{via}: {r['answers']} answers, {len(r['errors'])} refused in the unload-then-load gaps; publish seconds "
          f"{[round(c['seconds'], 3) for c in r['checks']]}")


# ---------------------------------------------------------------------------------------------- refusals


def test_sglangs_own_http_weight_update_tests(servers, tmp_path):
    """SGLang's own HTTP tests of /update_weights_from_disk (a model and back, a path that does not exist,
    abort_all_requests), /update_weights_from_tensor (float32 tensors while generations run paused in_place and by
    retract) and /get_weights_by_name, their steps and checks (:mod:`tests.sglang_own_checks`), against real SGLang;
    ``tests/test_sglang_own_tests.py`` runs the same against the reference server."""
    from bridge.local.presets import make_model_dir
    from tests import sglang_own_checks as own

    own.run_all(servers.spare.url, make_model_dir(tmp_path / "other", LLAMA, seed=1))


def _differences(url: str) -> dict:
    """What a server answers where docs/guarantees.md says real SGLang 0.5.23 and the reference server differ."""
    import concurrent.futures as cf

    import requests

    from bridge.client import ServerClient
    from bridge.errors import ServerError

    def post(route: str, body: dict) -> tuple[int, str]:
        r = requests.post(url + route, json=body, timeout=60)
        return r.status_code, r.text

    from tests.sglang_own_checks import long_tokens

    out, c, n, alone = {}, ServerClient(url, timeout=60), long_tokens(url), long_tokens(url, clients=1)
    with cf.ThreadPoolExecutor(4) as pool:  # a flush while generations run
        running = [pool.submit(c.generate, input_ids=[1, 4, 5], sampling_params={
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}) for _ in range(4)]
        time.sleep(1.0)
        out["flush"] = post("/flush_cache", {})
        [f.result() for f in running]
    with requests.post(url + "/generate", json={"input_ids": [1, 4, 5], "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}, timeout=60, stream=True) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    out["stream"] = [len(ch["output_ids"]) for ch in chunks]
    with cf.ThreadPoolExecutor(1) as pool:  # what an aborted generation's finish_reason says
        running = pool.submit(c.generate, input_ids=[1, 4, 5], sampling_params={
            "temperature": 0, "max_new_tokens": alone, "ignore_eos": True})
        time.sleep(1.0)
        post("/abort_request", {"abort_all": True})
        out["aborted"] = running.result()["meta_info"]["finish_reason"]
    info = c.model_info()
    label = info["weight_version"]

    def spans_across(*changes: tuple[str, dict]) -> tuple[list[str], list[str], list]:
        """The version spans of two long generations across ``changes`` (route, body): a plain one, then a streamed
        one, which tells when they run. Once it gave its first tokens the changes are posted in order; once they
        answered and it gave 8 tokens more (or, while they are unanswered, 15 s after its first tokens: a change may
        wait for the generations, as the reference server's relabel does), both are aborted, which ends them with their
        spans. (Counted from the answers, not from the first tokens: on a loaded machine real SGLang's relabel once
        answered near a 5 s cut, which then left the streamed one no token on the new label.) The spans of each (the
        plain one's first), and the changes' answers."""
        body = {"input_ids": [1, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 1500,
                                                             "ignore_eos": True}}
        with cf.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(c.generate, **body)
            with requests.post(url + "/generate", json={**body, "stream": True}, timeout=120, stream=True) as r:
                answers = last = first = answered = aborted = None
                for line in r.iter_lines(decode_unicode=True):
                    if not line.startswith("data: {"):
                        continue
                    last, now = json.loads(line[6:]), time.monotonic()
                    n = len(last["output_ids"])
                    if answers is None:
                        answers, first = pool.submit(lambda: [post(route, body) for route, body in changes]), now
                    if answered is None and answers.done():
                        answered = n
                    if aborted is None and ((answered is not None and n >= answered + 8)
                                            or (answered is None and now - first > 15)):
                        aborted = post("/abort_request", {"abort_all": True})
            spans = [[span["version"] for span in a["meta_info"]["weight_versions"]] for a in (plain.result(), last)]
            return spans[0], spans[1], answers.result()

    def parked(mode: str, version: str) -> tuple[list[str], list[str], tuple[int, str]]:
        """A weight change while generations are parked by ``mode``: their spans, and the update's answer."""
        plain, streamed, answers = spans_across(("/pause_generation", {"mode": mode}), ("/update_weights_from_disk", {
            "model_path": info["model_path"], "weight_version": version, "flush_cache": False}),
            ("/continue_generation", {}))
        return plain, streamed, answers[1]

    out["retract_spans"], out["retract_streamed"], out["retract_update"] = parked("retract", "897")
    # (The streamed generation's spans where both kinds behave alike: it surely ran before the change, where the plain
    # one, submitted first, may still wait for its first decoding step on a loaded machine.)
    _, out["in_place_spans"], out["in_place_update"] = parked("in_place", "898")
    out["spans"] = spans_across(("/update_weight_version", {"new_version": "899"}))[1]  # unpaused: a relabel
    out["relabel"] = post("/update_weight_version", {"new_version": "900"})
    out["older"] = post("/update_weight_version", {"new_version": "899"})
    out["checker"] = post("/weights_checker", {})
    out["n2"] = post("/generate", {"input_ids": [1, 4, 5], "sampling_params": {"n": 2, "max_new_tokens": 2}})
    out["version_routes"] = [requests.get(url + r, timeout=30).status_code for r in ("/get_weight_version",
                                                                                      "/weight_version")]
    c.begin_weight_update()  # an update refused inside a session: is the session still open?
    try:
        c.update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[128]], group_name="no-such-group")
    except ServerError as e:
        out["refused"] = e.status
    out["end"] = post("/end_weight_update", {})
    post("/update_weight_version", {"new_version": label})  # (the shared real server keeps its label)
    return out


def test_what_real_sglang_does_differently_from_the_reference_server(servers, server_factory, tmp_path):
    """docs/guarantees.md's "What real SGLang does differently", asked of both servers side by side: real SGLang
    refuses a flush while requests run, takes an older version label, checksums its own layout at /weights_checker,
    generates n=2, and keeps an update session open after a refused update; the reference server answers otherwise,
    as that page lists. Neither serves /get_weight_version or /weight_version at 0.5.23."""
    from bridge.local.presets import make_model_dir

    ref = server_factory(model=make_model_dir(tmp_path / "llama", LLAMA), preset=None, strict_versions=True)
    real, emulated = _differences(servers.spare.url), _differences(ref.url)
    assert real["flush"] == (400, "Flush cache failed.\n") and emulated["flush"][0] == 200, (real, emulated)
    assert real["relabel"][0] == real["older"][0] == emulated["relabel"][0] == 200
    assert emulated["older"][0] == 400 and "older than the served version" in emulated["older"][1]
    assert real["checker"][0] == 200 and "qkv_proj" in real["checker"][1]  # SGLang's own stacked layout
    assert emulated["checker"][0] == 501 and "/wsync/weights_checksum" in emulated["checker"][1]
    assert real["n2"][0] == 200 and len(json.loads(real["n2"][1])) == 2
    assert emulated["n2"][0] == 400 and "n=1" in emulated["n2"][1]
    assert real["version_routes"] == emulated["version_routes"] == [404, 404]
    assert real["refused"] == emulated["refused"] == 400
    assert real["end"][0] == 200 and emulated["end"][0] == 400 and "aborted" in emulated["end"][1], (real, emulated)
    # A relabel while a generation runs: SGLang applies it between two decoding steps (two spans), the reference
    # server once the generation ended (one).
    assert real["spans"] == [real["spans"][0], "899"] and emulated["spans"] == [emulated["spans"][0]], (real, emulated)
    # A generation parked by retract across a weight change: SGLang keeps its tokens (their span, then the new
    # version's); the reference server starts it again from its prompt (the new version's span only).
    assert real["retract_update"][0] == emulated["retract_update"][0] == 200, (real, emulated)
    assert real["retract_spans"] == [real["retract_spans"][0], "897"] != ["897"], (real, emulated)
    assert emulated["retract_spans"] == ["897"], (real, emulated)
    for streamed in (real["retract_streamed"], emulated["retract_streamed"]):  # it keeps what it sent, on both
        assert streamed == [streamed[0], "897"] != ["897"], (real, emulated)
    # Parked in_place across a weight change: both keep the generation's tokens and go on under the new weights.
    assert real["in_place_update"][0] == emulated["in_place_update"][0] == 200, (real, emulated)
    assert real["in_place_spans"] == emulated["in_place_spans"] == ["897", "898"], (real, emulated)
    # Where they answer alike: /generate streams the answer so far as it grows, a chunk per token where the decoding
    # loop keeps up (real SGLang's detokenizer sends two tokens in one chunk when it falls behind); an abort says
    # "Aborted".
    for stream in (real["stream"], emulated["stream"]):
        assert stream[-1] == 12 and all(a < b for a, b in zip(stream, stream[1:])), (real["stream"], emulated["stream"])
    assert emulated["stream"] == list(range(1, 13)) and len(real["stream"]) >= 6, (real["stream"], emulated["stream"])
    assert real["aborted"] == emulated["aborted"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                       "err_type": None}, (real["aborted"], emulated["aborted"])
    assert servers.spare.alive()


def _publish_model(url: str, preset: str, version: int, steps: int, config: dict):
    """Every rank: train ``preset`` for ``steps`` steps, publish ``version``; what publish() answered or raised, the
    trainer's tensors (rank 0)."""
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine(preset)
    pub = WeightPublisher(PublisherConfig(servers=[url], progress=False, **{**BOUNDS, **config}))
    try:
        for s in range(steps):
            sb.train_step(engine, version * 10 + s)
        try:
            got = ("ok", pub.publish(engine, version=version).servers)
        except Exception as e:
            got = (type(e).__name__, str(e))
        return dict(got=got, full=own_full(engine))
    finally:
        pub.close()
        engine.destroy()


def _requests_seen(server, route: str) -> int:
    with open(server.log_path, errors="replace") as f:
        return sum(f'"POST {route} ' in line for line in f)


def test_a_model_real_sglang_cannot_take_is_refused_before_any_byte_moves(servers):
    """A Qwen2 trainer (q/k/v biases, a tied head) into SGLang serving a Llama: every rank raises the same ConfigError
    naming the differences, and SGLang was never paused nor sent an update (its own access log), its weights as
    they were."""
    url = servers.llama.url
    before = run_ranks(_publish_model, 2, args=(url, LLAMA, 600, 1, {}), timeout=300)[0]
    assert before["got"][0] == "ok", before["got"]
    pauses, updates = _requests_seen(servers.llama, "/pause_generation"), _requests_seen(servers.llama, "/update_weights")
    r0, r1 = run_ranks(_publish_model, 2, args=(url, "tiny", 601, 1, {}), timeout=300)
    assert r0["got"][0] == r1["got"][0] == "ConfigError", r0["got"]
    assert r0["got"][1] == r1["got"][1] and "q_proj.bias" in r0["got"][1], r0["got"][1]
    assert _requests_seen(servers.llama, "/pause_generation") == pauses
    assert _requests_seen(servers.llama, "/update_weights") == updates
    assert_left(left_as_it_was(url, 600, before["full"]), "after the refusal")


def test_a_new_process_publishing_the_served_version_with_other_weights_is_refused(servers):
    """A trainer publishes version 700; a new trainer process of the same run publishes 700 with other weights: every
    rank raises VersionError before anything moves, and SGLang keeps serving the first trainer's 700. The same
    weights again are a safe retry."""
    url = servers.llama.url
    first = run_ranks(_publish_model, 2, args=(url, LLAMA, 700, 1, {}), timeout=300)[0]
    assert first["got"][0] == "ok", first["got"]
    updates = _requests_seen(servers.llama, "/update_weights")
    r0, r1 = run_ranks(_publish_model, 2, args=(url, LLAMA, 700, 2, {}), timeout=300)
    assert r0["got"][0] == r1["got"][0] == "VersionError", r0["got"]
    assert "other weights" in r0["got"][1], r0["got"][1]
    assert _requests_seen(servers.llama, "/update_weights") == updates
    assert_left(left_as_it_was(url, 700, first["full"]), "after the refused relabel")
    again = run_ranks(_publish_model, 2, args=(url, LLAMA, 700, 1, {}), timeout=300)[0]
    assert again["got"][0] == "ok", again["got"]


def test_wsync_train_on_a_tokenizer_without_a_bos_token(servers, tmp_path):
    """``wsync train --model DIR`` with a tokenizer that has no BOS token (as Qwen2's own) trains and publishes into
    real SGLang."""
    from transformers import AutoTokenizer

    from bridge.local.presets import make_model_dir

    model = make_model_dir(tmp_path / "model", LLAMA)
    tok = AutoTokenizer.from_pretrained(model)
    tok.bos_token = None
    tok.save_pretrained(model)
    assert AutoTokenizer.from_pretrained(model).bos_token_id is None
    out = subprocess.run([sys.executable, "-m", "wsync", "train", "--model", model, "--steps", "2", "--publish",
                          "broadcast", "--server", servers.spare.url, "--start-version", "4000"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "published v4001" in out.stdout, out.stdout
    assert _wait_version(servers.spare.url, 4001, 5) == "4001"


# ---------------------------------------------------------------------------------------------- faults


class Acting:
    """The engine as a weight source that runs ``act()`` on ``rank`` when it gathers its ``call``-th bucket."""

    def __init__(self, engine, rank: int, call: int, act) -> None:
        self.engine, self.rank, self.call, self.act, self.calls = engine, rank, call, act, 0

    def param_specs(self):
        return self.engine.param_specs()

    def iter_full_tensors(self, specs=None):
        return self.engine.iter_full_tensors(specs)

    def local_digest(self):
        return self.engine.local_digest()

    def local_shards(self, specs):
        return self.engine.local_shards(specs)

    def gather_bucket(self, bucket, out, group=None, dst: int = 0):
        self.calls += 1
        if self.engine.rank == self.rank and self.calls == self.call:
            self.act()
        self.engine.gather_bucket(bucket, out, group=group, dst=dst)


def _die_noting_when(path: str) -> None:
    """Write this moment (``time.monotonic()``: one clock for every process of the host) to ``path``, then die."""
    with open(path, "w") as f:
        f.write(repr(time.monotonic()))
    os._exit(9)


def _rank_dies_mid_sync(urls: list[str], first: int, died: str):
    """Every rank: publish ``first``, train; then rank 1 dies inside the gather of the third bucket of ``first + 1``,
    noting the moment in ``died``. Rank 0 returns what it raised, how long after the death, and the state each server
    was left in."""
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine(LLAMA)
    pub = WeightPublisher(PublisherConfig(servers=urls, bucket_mb=0.05, progress=False, **DEAD_RANK_BOUNDS))
    pub.publish(engine, version=first)
    before = own_full(engine)
    sb.train_step(engine, first)

    try:
        pub.publish(Acting(engine, rank=1, call=3, act=functools.partial(_die_noting_when, died)), version=first + 1)
        return ("ok", "", 0.0, {})
    except Exception as e:
        with open(died) as f:
            seconds = time.monotonic() - float(f.read())
        return (type(e).__name__, str(e), seconds, {u: left_as_it_was(u, first, before) for u in urls})
    finally:
        pub.close()


def test_a_trainer_rank_killed_mid_sync(servers, tmp_path):
    """Rank 1 SIGKILLed mid-broadcast into two real SGLang servers: rank 0 raises within ``dead_rank_bound``; both
    servers answer at once, on the previous version, every tensor the previous one (the sync went as one request,
    received whole before any of it would be loaded), with no session left open."""
    from bridge import PublisherConfig
    from bridge.publisher.bounded import dead_rank_bound

    urls = [servers.llama.url, servers.spare.url]
    r0, r1 = run_ranks(_rank_dies_mid_sync, 2, args=(urls, 5000, str(tmp_path / "died")), timeout=300, may_die=(1,))
    assert r1 is None
    kind, message, seconds, states = r0
    assert kind in ("SyncError", "SyncTimeout"), message
    bound = dead_rank_bound(PublisherConfig(servers=urls, **DEAD_RANK_BOUNDS))
    assert 0 < seconds < bound + 3, f"{seconds:.1f} s after the death against {bound:g} s: {message}"
    for url, state in states.items():
        assert_left(state, url)


def _dies_holding(url: str, lock: str, trial: str, first: int, saved: str, torn: bool, root: str):
    """Rank 0 alone, holding ``url`` through the writer lock ``lock``: publish ``first`` (its weights saved to
    ``saved``), train, then SIGKILL itself at bucket 2 of ``first + 1``, the server paused mid-sync. ``torn``: ``first``
    is also written as a snapshot (under ``root``, announced in ``lock``'s name resolution) and both go bucket by bucket
    (``atomic_mb=0``), so the server has loaded the first buckets of ``first + 1``; else each goes as one request."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.failpoints import ENV

    engine = sb.engine(LLAMA)
    common = dict(trial=trial, bucket_mb=0.05, progress=False, **DEAD_RANK_BOUNDS)
    if torn:  # the snapshot of ``first``, announced for no server yet
        with WeightPublisher(PublisherConfig(transport="disk", name_resolve=lock, snapshot_root=root, **common)) as disk:
            disk.publish(engine, version=first)
    pub = WeightPublisher(PublisherConfig(servers=[url], atomic_mb=0 if torn else 1024, writer_lock=lock, writer_lease=3,
                                          **common))
    pub.publish(engine, version=first)
    torch.save(own_full(engine), saved)
    sb.train_step(engine, first)
    os.environ[ENV] = "bucket:2@0=SIGKILL"
    pub.publish(engine, version=first + 1)


@pytest.mark.parametrize("torn", [False, True], ids=["one-request", "torn"])
def test_a_server_a_dead_trainer_left_paused_is_resumed_by_wsync_watch(servers, etcd_server, tmp_path, torn):
    """A trainer holding real SGLang through ``writer_lock`` is SIGKILLed mid-sync: SGLang stays paused (it has no
    watchdog) and no publish follows; ``wsync status --writer-lock`` says who left it so, and whether that sync may
    have torn it. ``wsync watch --writer-lock`` finds the dead writer's mark without its lock and resumes the server:
    at once where the sync went as one request (its weights were never touched), from the snapshot of its version
    where it went bucket by bucket. It answers on the last complete version, every tensor that version's."""
    from bridge.client import ServerClient
    from bridge.errors import BridgeError

    url, trial, saved = servers.spare.url, f"abandoned{os.getpid()}{torn:d}", str(tmp_path / "first.pt")
    version = 7100 if torn else 7000
    assert run_ranks(_dies_holding, 1, args=(url, etcd_server.url, trial, version, saved, torn, str(tmp_path / "snap")),
                     timeout=300, may_die=(0,)) == [None]
    first = torch.load(saved)
    status = subprocess.run([sys.executable, "-m", "wsync", "status", "--server", url, "--writer-lock", etcd_server.url,
                             "--timeout", "3", "--json"], capture_output=True, text=True, timeout=120)
    row = json.loads(status.stdout)["servers"][0]
    assert status.returncode == 1 and row["state"] == "paused", status.stdout  # a generation waits
    assert f"left by a dead writer of run 'default/{trial}'" in row["why"], row
    assert ("maybe torn" in row["why"]) == torn, row
    watch = subprocess.Popen([sys.executable, "-m", "wsync", "watch", "--server", url, "--name-resolve",
                              etcd_server.url, "--trial", trial, "--writer-lock", etcd_server.url, "--heal-every", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    c = ServerClient(url, timeout=3)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the watcher resumed it
            try:
                c.generate(input_ids=[1, 4, 5], sampling_params={"max_new_tokens": 1})
                break
            except BridgeError as e:
                assert time.monotonic() < deadline and watch.poll() is None, f"never resumed: {e}"
        state = left_as_it_was(url, version, first)
    finally:
        watch.send_signal(signal.SIGINT)
        log = watch.communicate(timeout=60)[0]
    assert "was left paused by a dead writer" in log and f"run 'default/{trial}'" in log, log[-3000:]
    assert ("resumed from its snapshot" in log) == torn, log[-3000:]
    assert_left(state, url)


def _interrupted_mid_sync(urls: list[str], first: int):
    """Every rank: publish ``first``, train; then rank 0 gets a real SIGINT at bucket 2 of ``first + 1``."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.failpoints import ENV

    engine = sb.engine(LLAMA)
    pub = WeightPublisher(PublisherConfig(servers=urls, bucket_mb=0.05, progress=False, **BOUNDS))
    pub.publish(engine, version=first)
    before = own_full(engine)
    sb.train_step(engine, first)
    os.environ[ENV] = "bucket:2@0=SIGINT"
    t = time.monotonic()
    try:
        pub.publish(engine, version=first + 1)
        got = ("ok", "")
    except BaseException as e:  # KeyboardInterrupt on rank 0, SyncError on rank 1
        got = (type(e).__name__, str(e))
    finally:
        del os.environ[ENV]
    seconds = time.monotonic() - t
    states = {u: left_as_it_was(u, first, before) for u in urls} if engine.rank == 0 else None
    pub.close()
    engine.destroy()
    return dict(got=got, seconds=seconds, states=states)


def test_ctrl_c_mid_sync(servers):
    """A real SIGINT on rank 0 in the middle of a broadcast into two real SGLang servers: rank 0 raises
    KeyboardInterrupt, rank 1 the SyncError that names it, within the bucket's bound; both servers answer at once
    on the previous version and weights."""
    from bridge import PublisherConfig
    from bridge.publisher.bounded import bucket_bound

    urls = [servers.llama.url, servers.spare.url]
    r0, r1 = run_ranks(_interrupted_mid_sync, 2, args=(urls, 6000), timeout=300)
    assert r0["got"][0] == "KeyboardInterrupt", r0["got"]
    assert r1["got"][0] == "SyncError" and "interrupted" in r1["got"][1], r1["got"]
    bound = bucket_bound(PublisherConfig(servers=urls, **BOUNDS))
    assert max(r0["seconds"], r1["seconds"]) < bound, (r0["seconds"], r1["seconds"], bound)
    for url, state in r0["states"].items():
        assert_left(state, url)


def _server_dies_mid_sync(registry: str, survivor: str, victim_pgid: int, first: int):
    """Every rank: publish ``first`` to the fleet a router lists, train; rank 0 SIGKILLs one server while gathering the
    third bucket of ``first + 1``; then publish ``first + 1`` again. Rank 0 returns both outcomes, the survivor's
    state after the failure, and whether it serves the trainer's tensors at the end."""
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine(LLAMA)
    pub = WeightPublisher(PublisherConfig(server_registry=registry, bucket_mb=0.05, progress=False, min_servers=1,
                                          probe_timeout=3, **BOUNDS))
    first_servers = pub.publish(engine, version=first).servers
    before = own_full(engine)
    sb.train_step(engine, first)
    try:
        pub.publish(Acting(engine, rank=0, call=3, act=lambda: os.killpg(victim_pgid, signal.SIGKILL)), version=first + 1)
        failed = ("ok", "")
    except Exception as e:
        failed = (type(e).__name__, str(e))
    left = left_as_it_was(survivor, first, before) if engine.rank == 0 and failed[0] != "ok" else None
    try:
        again = ("ok", pub.publish(engine, version=first + 1).servers)
    except Exception as e:
        again = (type(e).__name__, str(e))
    full = own_full(engine)
    pub.close()
    engine.destroy()
    if engine.rank != 0:
        return None
    return dict(first=first_servers, failed=failed, survivor=left, again=again,
                mismatched=served_mismatches(survivor, full))


def test_one_of_two_real_servers_behind_smg_killed_mid_sync(servers, router_factory):
    """Two real SGLang workers behind SGLang's gateway ``smg``, the publisher finding them through it: a publish
    reaches both; one SIGKILLed in the middle of the next broadcast fails it on every rank, the survivor keeps
    its version and weights and answers at once; the next publish goes on without the dead one, which leaves the
    router, and generation through the router answers from the new version, served bit-equal."""
    router = router_factory("smg", [servers.llama.url, servers.spare.url])
    survivor = servers.llama.url
    r0 = run_ranks(_server_dies_mid_sync, 2, args=(f"router+{router.url}", survivor, servers.spare.process.pid, 7000),
                   timeout=300)[0]
    servers.all.kill(servers.spare)
    assert r0["first"] == {servers.llama.url: "ok", servers.spare.url: "ok"}, r0["first"]
    assert r0["failed"][0] in ("SyncError", "SyncTimeout"), r0["failed"]
    assert_left(r0["survivor"], "the survivor")
    assert r0["again"][0] == "ok" and r0["again"][1].get(survivor) == "ok", r0["again"]
    assert r0["mismatched"] == [], r0["mismatched"][:5]
    assert router.workers() == [survivor]
    assert router.generate()["meta_info"]["weight_version"] == "7001"


def test_sglangs_memory_routes_ignore_an_unknown_tag_and_die_of_resuming_one_not_released(servers, server_factory):
    """``/release_memory_occupation`` of a tag SGLang does not know: ignored (200); the reference server answers 400.
    ``/resume_memory_occupation`` of a tag not released: SGLang's scheduler raises ``KeyError`` and the server dies
    (run last: it takes the real tier's last server with it); the reference server answers 400 and serves on."""
    import requests

    ref = server_factory(preset=LLAMA)
    unknown = {"tags": ["no-such-tag"]}
    assert requests.post(servers.llama.url + "/release_memory_occupation", json=unknown, timeout=60).status_code == 200
    assert requests.post(ref.url + "/release_memory_occupation", json=unknown, timeout=60).status_code == 400
    assert requests.post(ref.url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=60).status_code == 400
    assert ref.client.model_info()["weight_version"]
    try:
        requests.post(servers.llama.url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=60)
    except requests.ConnectionError:
        pass  # the route's answer, or the connection it went out on, goes with the server
    deadline = time.monotonic() + 30
    while servers.llama.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not servers.llama.alive(), "SGLang served on after resuming a tag it had not released"
    with open(servers.llama.log_path, errors="replace") as f:
        assert "KeyError: 'kv_cache'" in f.read()
    servers.all.kill(servers.llama)  # (its death was this test's point)
