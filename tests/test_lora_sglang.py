"""LoRA adapters into SGLang 0.5.23's own adapter code (the ``sglang_code`` tier; issue 37).

One harness server per module (:mod:`tests.sglang_harness.serve` ``--enable-lora``, what runs and what is stubbed
in :mod:`tests.sglang_harness.lora_serve`): SGLang's HTTP app parses the client's bodies, its tokenizer manager,
``LoRARegistry``, scheduler, worker (the allowlisted unpickler, the ``expected_checksums`` check) and
``LoRAManager`` load and unload the adapter, and the harness reports the sha256 of every tensor SGLang's
``LoRAAdapter`` was handed.

Then what the client's replace (unload, then load: SGLang refuses a name that is loaded) does on SGLang's own
code with generations asking for the adapter by its stable name.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import requests

from tests.dist_utils import run_ranks
from tests.test_lora import lora_engine

pytestmark = pytest.mark.sglang_code

PROMPT = [5, 17, 42, 9, 3, 77]


@pytest.fixture(scope="module")
def sglang_lora(tiny_model_dir):
    from tests.sglang_harness import installed, launch

    assert installed("0.5.23"), "SGLang 0.5.23 is not installed: run scripts/install_sglang.sh"
    # HF_HUB_OFFLINE: SGLang's implicit reload of a tensors adapter asks the hub for a repo named "__tensor__"
    with launch("0.5.23", tiny_model_dir, extra_args=["--enable-lora", "--max-lora-rank", "16"],
                env={"HF_HUB_OFFLINE": "1"}) as s:
        yield s


TRAFFIC_THREADS = 4


def _traffic(url: str, name: str, stop: threading.Event, answers: list, errors: list) -> None:
    """A client thread: generations asking for ``name`` until ``stop``; each answer's adapter id, each error."""
    with requests.Session() as s:
        while not stop.is_set():
            r = s.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
                                                "lora_path": name}, timeout=120)
            if r.status_code == 200:
                answers.append(r.json()["meta_info"].get("harness_lora_id"))
            else:
                errors.append(f"HTTP {r.status_code}: {r.text[:300]}")


def _publish_into_sglang(url: str, root: str, nr_url: str):
    """Two publishes by tensors, then four by disk, each after a training step; rank 0 reads, after each, what
    SGLang's code holds under the name and asks for a generation with the adapter. From the second publish by
    disk on, 4 client threads on rank 0 ask for the adapter by its name all along."""
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum
    from tests.sync_bodies import train_step

    engine = lora_engine()
    checks, stop, answers, errors, threads = [], threading.Event(), [], [], []
    try:
        for via, versions in (("tensors", (1, 2)), ("disk", (1, 2, 3, 4))):
            name = f"policy-{via}"
            pub = AdapterPublisher(AdapterPublisherConfig(name=name, via=via, servers=[url], root=root,
                                                          name_resolve=nr_url))
            try:
                for version in versions:
                    if via == "disk" and version == 2 and engine.rank == 0:
                        threads = [threading.Thread(target=_traffic, args=(url, name, stop, answers, errors),
                                                    daemon=True) for _ in range(TRAFFIC_THREADS)]
                        for t in threads:
                            t.start()
                    train_step(engine, seed=version)
                    res = pub.publish(engine, version=version)
                    mine = engine.gather_adapter()  # collective
                    if mine is None:
                        continue
                    view = requests.get(url + "/wsync_harness/lora", timeout=30).json()
                    c = ServerClient(url)
                    try:
                        out = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path=name)
                    finally:
                        c.close()
                    link = os.path.join(root, name, "current")
                    checks.append(dict(via=via, version=res.version, served=view["loaded"].get(name),
                                       link_target=os.readlink(link) if os.path.islink(link) else None,
                                       registry_id=view["registry"].get(name),
                                       want={n: tensor_checksum(t) for n, t in mine.items()},
                                       generation_id=out["meta_info"].get("harness_lora_id")))
            finally:
                pub.close()
        stop.set()
        for t in threads:
            t.join(120)
        return dict(checks=checks, answers=len(answers), errors=errors) if engine.rank == 0 else None
    finally:
        stop.set()
        engine.destroy()


def test_publisher_loads_the_trainers_adapter_through_sglang_own_code(sglang_lora, tmp_path):
    """By tensors and by disk, a first load and replaces: SGLang's app, registry and LoRAManager hold the adapter
    under its stable name, every tensor SGLang's LoRAAdapter was handed equal to the trainer's, and a generation
    asking for the name acquires that adapter; by disk, 4 threads asking for it during 3 replaces get no error."""
    out, _ = run_ranks(_publish_into_sglang, 2, args=(sglang_lora.url, str(tmp_path / "adapters"),
                                                      f"file://{tmp_path}/nr"), timeout=240)
    checks = out["checks"]
    assert [(c["via"], c["version"]) for c in checks] == [("tensors", 1), ("tensors", 2)] + [
        ("disk", v) for v in (1, 2, 3, 4)]
    assert out["errors"] == [] and out["answers"] >= TRAFFIC_THREADS, out  # by disk: no generation refused
    ids = set()
    for c in checks:
        served = c["served"]
        assert served is not None, (c["via"], c["version"], sglang_lora.log_tail())
        assert served["checksums"] == c["want"], (c["via"], c["version"])
        assert len(c["want"]) == 28 and served["r"] == 4  # A and B of 7 projections on 2 layers
        assert served["lora_id"] == c["registry_id"] == c["generation_id"]
        if c["via"] == "tensors":
            assert served["lora_path"] == "__tensor__"
        else:  # the stable link (what SGLang reloads an unloaded name from), showing this version's directory
            assert served["lora_path"].endswith(os.path.join("policy-disk", "current")), served["lora_path"]
            assert c["link_target"] == f"v{c['version']}"
        ids.add(served["lora_id"])
    assert len(ids) == len(checks)  # every publish a load of its own


def _broadcast_into_sglang(url: str):
    """via='broadcast' to real SGLang: what each rank raised."""
    from bridge import AdapterPublisher, AdapterPublisherConfig

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-bc", via="broadcast", servers=[url]))
    try:
        pub.publish(engine, version=1)
    except Exception as e:  # compared across ranks by the test
        return f"{type(e).__name__}: {e}"
    finally:
        pub.close()
        engine.destroy()
    return None


def test_an_adapter_by_broadcast_is_refused_for_sglang_before_anything_moves(sglang_lora):
    """SGLang has no distributed adapter route: the client refuses ``load_adapter_from_distributed`` before it sends
    anything, and ``via='broadcast'`` fails on every rank once the servers are found, before any group or load."""
    from bridge.client import ServerClient
    from bridge.errors import ConfigError

    c = ServerClient(sglang_lora.url)
    try:
        with pytest.raises(ConfigError, match=r"is not the reference server \(wsync serve\): SGLang has no route .* "
                                              r"publish it by disk \(via='disk'\)"):
            c.load_adapter_from_distributed("policy-bc", {}, names=["x"], dtypes=["float32"], shapes=[[1]],
                                            group_name="g")
    finally:
        c.close()
    failed = run_ranks(_broadcast_into_sglang, 2, args=(sglang_lora.url,), timeout=120)
    assert failed[0] and failed[0] == failed[1], failed
    assert failed[0].startswith("ConfigError") and "publish failed at adapter:servers" in failed[0], failed[0]
    assert "only the reference server (wsync serve) takes" in failed[0] and sglang_lora.url in failed[0], failed[0]
    assert "policy-bc" not in (sglang_lora.lora()["loaded"] or {})


# ------------------------------------------------------------------ the replace (unload, then load) on SGLang's code

HOLD_S = 300.0  # an in-flight generation's length: it ends when the test releases it (/wsync_harness/release_holds)
BOUND_S = 60.0  # the longest any step here may take on 2 loaded cores (every wait polls for its state)


def _parts(seed: int) -> tuple[dict, dict]:
    """A seeded adapter's ``(adapter_config, tensors)`` (tests/test_lora_server.py's rank-8 PEFT adapter)."""
    from peft import get_peft_model_state_dict

    from tests.test_lora_server import _peft_model

    model = _peft_model(seed)
    import json

    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    return config, {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}


def _until(what: str, fn, server):
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError(f"not within {BOUND_S} s: {what}\n{server.lora()}\n{server.log_tail()}")


class _Gen(threading.Thread):
    """One generation asking for ``name`` (held in flight for ``hold`` s unless released), its answer or error."""

    def __init__(self, url: str, name: str, hold: float = 0.0):
        super().__init__(daemon=True)
        self.url, self.name, self.hold = url, name, hold
        self.out = self.error = None

    def run(self):
        sp = {"max_new_tokens": 2, "custom_params": {"harness_hold_s": self.hold}}
        r = requests.post(self.url + "/generate", json={"input_ids": PROMPT, "sampling_params": sp,
                                                        "lora_path": self.name}, timeout=HOLD_S + BOUND_S)
        if r.status_code == 200:
            self.out = r.json()
        else:
            self.error = f"HTTP {r.status_code}: {r.text}"


def _start(threads):
    for t in threads:
        t.start()
    return threads


def _join(threads):
    for t in threads:
        t.join(HOLD_S + BOUND_S)
        assert not t.is_alive()


def _replace_with_traffic(server, name: str, replace, in_flight: int, arrivals: int):
    """``replace()`` (the client's unload-then-load) while ``in_flight`` generations hold the served adapter and
    ``arrivals`` more ask for the name once SGLang has unregistered it; returns (old id, in-flight, arrivals,
    replace's error or None)."""
    old_id = server.lora()["registry"][name]
    held = _start([_Gen(server.url, name, HOLD_S) for _ in range(in_flight)])
    _until("the in-flight generations hold the adapter", lambda: server.lora()["counters"].get(old_id) == in_flight,
           server)
    outcome = {}

    def run():
        try:
            replace()
        except Exception as e:  # the test reads it
            outcome["error"] = e

    rt = threading.Thread(target=run, daemon=True)
    rt.start()
    _until("SGLang's unload unregistered the name and waits for the generations",
           lambda: name in server.lora()["pending_unloads"], server)
    late = _start([_Gen(server.url, name) for _ in range(arrivals)])
    _until("the arrivals wait for the tokenizer's lora_update_lock",
           lambda: server.lora()["update_lock_waiters"] == arrivals, server)
    requests.post(server.url + "/wsync_harness/release_holds", timeout=30)
    _join(held + late)
    rt.join(BOUND_S)
    assert not rt.is_alive()
    return old_id, held, late, outcome.get("error")


def test_replace_from_tensors_on_sglang_refuses_the_generations_arriving_in_its_gap(sglang_lora):
    """SGLang 0.5.23, no pause, by tensors: the unload waits for the generations that acquired the adapter (they
    finish on it); a generation asking for the name meanwhile tries SGLang's implicit reload from the cached path,
    which for a tensors adapter is ``__tensor__``, and is refused; then the client's load serves the new adapter."""
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    (cfg1, t1), (cfg2, t2) = _parts(1), _parts(2)
    c = ServerClient(sglang_lora.url)
    c.load_adapter_from_tensors("swap-t", cfg1, t1, replace=True)
    old_id, held, late, error = _replace_with_traffic(
        sglang_lora, "swap-t", lambda: ServerClient(sglang_lora.url).load_adapter_from_tensors(
            "swap-t", cfg2, t2, version="2", replace=True), in_flight=2, arrivals=3)
    assert error is None, error
    assert [g.error for g in held] == [None, None]
    assert {g.out["meta_info"]["harness_lora_id"] for g in held} == {old_id}  # in flight: the old adapter to the end
    refused = [g.error for g in late if g.error is not None]
    assert len(refused) == 3 and all("Failed to implicitly load LoRA adapter swap-t" in e for e in refused), refused
    view = sglang_lora.lora()
    assert view["loaded"]["swap-t"]["checksums"] == {n: tensor_checksum(x) for n, x in t2.items()}
    after = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path="swap-t")
    assert after["meta_info"]["harness_lora_id"] == view["registry"]["swap-t"] != old_id
    c.unload_adapter("swap-t")


def _point(link: str, target: str) -> None:
    tmp = f"{link}.tmp"
    os.symlink(os.path.basename(target), tmp)
    os.replace(tmp, link)


def test_replace_from_a_stable_path_on_sglang_refuses_nothing(sglang_lora, tmp_path):
    """SGLang 0.5.23, no pause, by disk from a stable path switched to the new adapter before the replace: a
    generation arriving in the gap makes SGLang reload the name from that path (the new adapter) and is served;
    the client's load then finds the name loaded from its own path, which is the replace done. No refusal, the
    in-flight generations finish on the old adapter, and the new one serves."""
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum
    from tests.test_lora_server import _save

    for seed in (1, 2):
        _save(seed, str(tmp_path / f"v{seed}"))
    stable = str(tmp_path / "current")
    _point(stable, str(tmp_path / "v1"))
    _, t2 = _parts(2)
    c = ServerClient(sglang_lora.url)
    c.load_adapter_from_path("swap-d", stable, replace=True)

    def replace():
        _point(stable, str(tmp_path / "v2"))
        ServerClient(sglang_lora.url).load_adapter_from_path("swap-d", stable, version="2", replace=True)

    old_id, held, late, error = _replace_with_traffic(sglang_lora, "swap-d", replace, in_flight=1, arrivals=2)
    assert error is None, error
    assert held[0].error is None and held[0].out["meta_info"]["harness_lora_id"] == old_id
    assert [g.error for g in late] == [None, None]
    view = sglang_lora.lora()
    new_id = view["registry"]["swap-d"]
    assert new_id != old_id and {g.out["meta_info"]["harness_lora_id"] for g in late} == {new_id}
    assert view["loaded"]["swap-d"]["checksums"] == {n: tensor_checksum(x) for n, x in t2.items()}
    c.unload_adapter("swap-d")


def test_unload_while_paused_in_place_waits_until_generation_continues(sglang_lora):
    """miles 2780 on SGLang's own code: paused ``in_place``, a generation that acquired the adapter stays in the
    scheduler, so SGLang's unload waits for its counter for as long as the pause lasts (here the client's read
    timeout ends the wait on its side; the server's unload goes on waiting); a publisher that paused in place
    and then replaced the adapter would wait forever for itself. After ``continue_generation`` the generation
    ends on the old adapter and the unload completes."""
    from bridge.client import ServerClient
    from bridge.errors import SyncTimeout

    cfg1, t1 = _parts(1)
    c = ServerClient(sglang_lora.url)
    c.load_adapter_from_tensors("paused", cfg1, t1, replace=True)
    old_id = sglang_lora.lora()["registry"]["paused"]
    held = _start([_Gen(sglang_lora.url, "paused", HOLD_S)])
    _until("the generation holds the adapter", lambda: sglang_lora.lora()["counters"].get(old_id) == 1, sglang_lora)
    c.pause_generation(mode="in_place")
    try:
        requests.post(sglang_lora.url + "/wsync_harness/release_holds", timeout=30)  # only the pause holds it now
        with pytest.raises(SyncTimeout):  # it cannot end while paused, whatever the timeout
            c.unload_adapter("paused", timeout=2.0)
        view = sglang_lora.lora()
        assert "paused" in view["pending_unloads"] and view["counters"].get(old_id) == 1 and held[0].is_alive()
    finally:
        c.continue_generation()
    _join(held)
    assert held[0].error is None and held[0].out["meta_info"]["harness_lora_id"] == old_id
    _until("the unload completed", lambda: not sglang_lora.lora()["pending_unloads"], sglang_lora)
    assert "paused" not in sglang_lora.lora()["registry"]


def test_the_older_body_through_sglang_0_5_8s_own_code(tiny_model_dir):
    """SGLang 0.5.8 takes one ``serialized_tensors`` string: the client sends it to a 0.5.8 server, whose own app,
    tokenizer manager, worker and LoRAManager load it (every tensor equal), then replace it (unload, then load),
    and the 0.5.23 shape (a per-rank list) is refused by that app."""
    from bridge.client import ServerClient
    from bridge.client.lora import tensors_body
    from bridge.digest import tensor_checksum
    from bridge.protocol import ProtocolFeatures
    from tests.sglang_harness import installed, launch

    assert installed("0.5.8"), "SGLang 0.5.8 is not installed: run scripts/install_sglang.sh"
    cfg, t = _parts(3)
    with launch("0.5.8", tiny_model_dir, extra_args=["--enable-lora"], env={"HF_HUB_OFFLINE": "1"}) as s:
        c = ServerClient(s.url)
        assert c.features.version == "0.5.8"
        c.load_adapter_from_tensors("old", cfg, t, replace=True)
        view = s.lora()
        assert view["loaded"]["old"]["checksums"] == {n: tensor_checksum(x) for n, x in t.items()}
        out = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path="old")
        assert out["meta_info"]["harness_lora_id"] == view["registry"]["old"]
        cfg2, t2 = _parts(4)
        c.load_adapter_from_tensors("old", cfg2, t2, replace=True)
        assert s.lora()["loaded"]["old"]["checksums"] == {n: tensor_checksum(x) for n, x in t2.items()}
        newer, held = tensors_body(ProtocolFeatures.from_version("0.5.23"), 1, "other", cfg, t)
        r = requests.post(s.url + "/load_lora_adapter_from_tensors", json=newer, timeout=60)
        held.close()
        assert 400 <= r.status_code < 500 and "serialized_tensors" in r.text, r.text[:300]
        assert "other" not in s.lora()["registry"]
        # Through the client: the field SGLang's app names, not the whole body it echoes (payload and all).
        from bridge.errors import ServerError

        with pytest.raises(ServerError) as refused:
            c._http.call("POST", "/load_lora_adapter_from_tensors", newer)
        assert "body.serialized_tensors: Field required" in str(refused.value), str(refused.value)[:300]
        assert len(str(refused.value)) < 500, str(refused.value)[:300]
