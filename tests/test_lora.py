"""LoRA (issue 37), the trainer side: a PEFT adapter trained on the FSDP2 engine and published alone.

One 2-rank gloo job trains the tiny preset's adapter (rank 4 on every projection) and returns what the
tests compare: the base weights before and after (unchanged), the adapter (changed), what the optimizer
holds, and the gathered adapter, which rank 0 loads into its own unsharded PEFT model as the oracle.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from bridge.errors import ConfigError
from tests.dist_utils import run_ranks
from tests.engine_bodies import unship

LORA = dict(rank=4, alpha=8.0)


def lora_engine(lr: float = 1e-2):
    from trainer import EngineConfig, FSDPEngine, LoraConfig, OptimizerConfig

    cfg = EngineConfig(preset="tiny", lora=LoraConfig(**LORA), optimizer=OptimizerConfig(lr=lr, weight_decay=0.0))
    return FSDPEngine(cfg).initialize()


def _train_body():
    from tests.engine_bodies import _ship
    from tests.sync_bodies import train_step

    engine = lora_engine()
    try:
        base0 = {s.name: t.clone() for s, t in engine.iter_full_tensors() if t is not None}
        adapter0 = engine.gather_adapter()
        adapter0 = {k: v.clone() for k, v in adapter0.items()} if adapter0 is not None else None
        for step in range(2):
            train_step(engine, seed=step)
        base1 = {s.name: t.clone() for s, t in engine.iter_full_tensors() if t is not None}
        adapter1 = engine.gather_adapter()
        # By tensors the publisher gathers into shared memory (file_system), which a same-host server maps: no copy
        shared = engine.gather_adapter(torch.bfloat16, shared=True)
        shared = None if shared is None else dict(
            equal=all(torch.equal(shared[n], t.to(torch.bfloat16)) for n, t in adapter1.items()) and set(shared) == set(adapter1),
            in_shm=all(t.untyped_storage().is_shared() for t in shared.values()))
        in_optimizer = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
        batch = _probe_batch()
        logits = engine.forward(batch)
        out = dict(base0=base0, base1=base1, adapter0=adapter0, adapter1=adapter1, config=engine.adapter_config(),
                   specs=[(s.name, s.shape) for s in engine.adapter_specs()], param_names=[s.name for s in engine.param_specs()],
                   in_optimizer=in_optimizer, logits=logits, shared=shared)
        return _ship(out) if engine.rank == 0 else None
    finally:
        engine.destroy()


def _probe_batch():
    from tensordict import TensorDict

    ids = torch.tensor([[1] + [b + 3 for b in b"rev hello="]])
    return TensorDict(input_ids=ids, attention_mask=torch.ones_like(ids), batch_size=[1])


def peft_oracle(adapter: dict[str, torch.Tensor], config: dict, base: dict[str, torch.Tensor] | None = None,
                dtype: torch.dtype = torch.float32):
    """The trainer's own model with the adapter, unsharded in this process: the tiny preset's base
    weights (or ``base``) in ``dtype`` wrapped by PEFT from ``config`` (which keeps the adapter in float32),
    the adapter's tensors loaded by PEFT's own loader."""
    import peft

    from bridge.local.presets import build_model

    model = build_model("tiny", 0)
    if base is not None:
        model.load_state_dict(base, strict=False)
        model.tie_weights()
    model.to(dtype)
    pm = peft.get_peft_model(model, peft.LoraConfig.from_peft_type(**{k: v for k, v in config.items()
                                                                      if k not in ("peft_type", "inference_mode")}, peft_type="LORA"))
    result = peft.set_peft_model_state_dict(pm, adapter)
    assert not [k for k in result.unexpected_keys], result.unexpected_keys
    return pm.eval()


@pytest.fixture(scope="module")
def trained():
    rank0, rank1 = run_ranks(_train_body, 2, timeout=180)
    assert rank1 is None
    return unship([rank0])[0]


def test_lora_trains_only_the_adapter(trained):
    base0, base1 = trained["base0"], trained["base1"]
    assert list(base0) == trained["param_names"] and "model.layers.0.self_attn.q_proj.weight" in base0
    assert not any("lora" in n or "base_layer" in n for n in base0), "param_specs are the base model's HF names"
    assert all(torch.equal(base0[n], base1[n]) for n in base0), "a frozen base weight changed"
    a0, a1 = trained["adapter0"], trained["adapter1"]
    names = [n for n, _ in trained["specs"]]
    assert list(a1) == names and len(names) == 2 * 7 * 2  # A and B on 7 projections of 2 layers
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert all(not torch.any(a0[n]) for n in names if ".lora_B." in n), "PEFT starts lora_B at zero"
    changed = [n for n in names if ".lora_B." in n and not torch.equal(a0[n], a1[n])]
    assert len(changed) == 14, f"every lora_B should move in 2 steps, moved: {changed}"
    assert trained["in_optimizer"] == sum(t.numel() for t in a1.values()), "the optimizer holds exactly the adapter"
    assert trained["config"]["r"] == 4 and trained["config"]["lora_alpha"] == 8.0
    assert sorted(trained["config"]["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_gathered_adapter_is_the_trainers_model(trained):
    """The gathered adapter, loaded by PEFT on the base weights, computes the sharded engine's logits."""
    pm = peft_oracle(trained["adapter1"], trained["config"], trained["base1"])
    with torch.no_grad():
        batch = _probe_batch()
        logits = pm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-5)
    assert trained["shared"] == {"equal": True, "in_shm": True}, "gathered into shared memory, bit-equal"


def test_lora_config_refusals():
    from trainer import EngineConfig, LoraConfig

    with pytest.raises(ConfigError, match="lora.rank must be an integer >= 1"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="lora.alpha"):
        LoraConfig(alpha=float("nan"))
    with pytest.raises(ConfigError, match="lora.target_modules must name"):
        LoraConfig(target_modules=())
    with pytest.raises(ConfigError, match="lora must be a LoraConfig"):
        EngineConfig(preset="tiny", lora={"rank": 4})
    assert LoraConfig(target_modules="q_proj,v_proj").target_modules == ("q_proj", "v_proj")


def test_adapter_publisher_config_refusals_for_broadcast():
    from bridge import AdapterPublisherConfig

    url = ["http://127.0.0.1:1"]
    for kwargs, message in [({}, "via='broadcast' sends the adapter to servers: give servers="),
                            ({"servers": url, "backend": "mpi"}, "backend must be gloo or nccl"),
                            ({"servers": url, "master_port": 0}, r"master_port must be a port number \(1-65535\)"),
                            ({"servers": url, "master_address": " "}, "master_address must not be empty"),
                            ({"servers": url, "group_timeout": 0}, "group_timeout must be a positive number")]:
        with pytest.raises(ConfigError, match=message):
            AdapterPublisherConfig(name="p", via="broadcast", **kwargs)
    with pytest.raises(ConfigError, match="via must be one of disk, tensors, broadcast"):
        AdapterPublisherConfig(name="p", via="nccl")


def test_safetensors_written_from_the_tensors_bytes_read_back_as_save_files(tmp_path):
    """write_safetensors (the adapter directory's file): what safetensors reads back is every tensor bit-equal, in
    dtype and shape, whether the tensors fill one buffer (one write), lie apart, are not contiguous or empty; a dtype
    outside its table goes through save_file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from bridge.snapshot.adapter import write_safetensors

    flat = torch.randn(700, dtype=torch.float32).to(torch.bfloat16)
    cases = {
        "one-buffer": {"a.lora_A.weight": flat[:160].view(16, 10), "a.lora_B.weight": flat[160:700].view(54, 10)},
        "apart": {"x": torch.randn(3, 5), "y": flat[5:25].view(4, 5), "t": torch.randn(6, 4).t(),
                  "empty": torch.zeros(0, 3, dtype=torch.float16), "i": torch.arange(7, dtype=torch.int64)},
        "one-storage-apart": {"p": flat[:10], "q": flat[20:30], "r": flat[10:20]},  # a gap, then backwards
        "save_file": {"c": torch.randn(2, 2, dtype=torch.complex64), "d": torch.randn(3)},
    }
    for case, tensors in cases.items():
        path = str(tmp_path / f"{case}.safetensors")
        write_safetensors(path, tensors, {"format": "pt"})
        back = load_file(path)
        assert set(back) == set(tensors), case
        for n, t in tensors.items():
            assert back[n].dtype == t.dtype and back[n].shape == t.shape and torch.equal(back[n], t), (case, n)
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}, case


def test_adapter_dir_in_place_first_made_durable_after(tmp_path):
    """write_adapter_dir(durable=False) puts the whole directory in place (the publisher's servers load it while
    sync_adapter_dir fsyncs it, before the announcement); sync_adapter_dir names a directory it cannot sync."""
    from safetensors.torch import load_file

    from bridge.errors import SnapshotError
    from bridge.snapshot.adapter import sync_adapter_dir, write_adapter_dir

    tensors = {"base_model.model.x.lora_A.weight": torch.randn(4, 8)}
    path = write_adapter_dir(str(tmp_path / "policy"), 3, tensors, {"r": 4}, durable=False)
    assert sorted(os.listdir(tmp_path / "policy")) == ["v3"] and sorted(os.listdir(path)) == [
        "adapter_config.json", "adapter_model.safetensors"]
    sync_adapter_dir(path)
    assert torch.equal(load_file(os.path.join(path, "adapter_model.safetensors"))["base_model.model.x.lora_A.weight"],
                       tensors["base_model.model.x.lora_A.weight"])
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(SnapshotError, match=r"could not write adapter directory .*v3 durably: .*No such file"):
        sync_adapter_dir(path)


# ---------------------------------------------------------------------------------------------- publish


def _disk_without_servers(root: str, nr_url: str):
    """Two versions by disk with no server to tell, then a third whose gather fails on rank 1 only."""
    import os

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy", via="disk", root=root, name_resolve=nr_url))
    try:
        results = []
        for version in (1, 2):
            train_step(engine, seed=version)
            results.append(pub.publish(engine, version=version))
        train_step(engine, seed=3)
        os.environ["WSYNC_FAILPOINTS"] = "adapter:gather@1=OSError"
        try:
            pub.publish(engine, version=3)
        except Exception as e:  # compared across ranks by the test
            failed = f"{type(e).__name__}: {e}"
        else:
            failed = None
        os.environ.pop("WSYNC_FAILPOINTS")
        mine = engine.gather_adapter()
        return dict(results=results, failed=failed, last=pub.last_version,
                    mine={n: t.clone() for n, t in mine.items()} if mine is not None else None)
    finally:
        pub.close()
        engine.destroy()


def test_disk_publish_writes_peft_dirs_and_a_fault_changes_nothing(tmp_path):
    import json
    import os

    from safetensors.torch import load_file

    from bridge.digest import tensor_checksum
    from bridge.lora.publisher import adapter_key
    from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL, make_name_resolve

    nr_url = f"file://{tmp_path}/nr"
    root = str(tmp_path / "adapters")
    rank0, rank1 = run_ranks(_disk_without_servers, 2, args=(root, nr_url), timeout=180)
    assert rank0["failed"] and rank0["failed"] == rank1["failed"], "every rank raises the same error"
    assert "adapter:gather" in rank0["failed"] and "rank 1" in rank0["failed"], rank0["failed"]
    assert rank0["last"] == rank1["last"] == 2
    v2 = rank0["results"][1]
    assert v2.path == os.path.join(root, "policy", "v2") and v2.version == 2
    assert sorted(os.listdir(os.path.join(root, "policy"))) == ["v1", "v2"], "nothing of the failed v3 is left"
    on_disk = load_file(os.path.join(v2.path, "adapter_model.safetensors"))
    assert {n: tensor_checksum(t) for n, t in on_disk.items()} == v2.checksums
    config = json.loads(open(os.path.join(v2.path, "adapter_config.json")).read())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    nr = make_name_resolve(nr_url)
    try:
        assert json.loads(nr.get(adapter_key(DEFAULT_EXPERIMENT, DEFAULT_TRIAL, "policy", 2)))["path"] == v2.path
        with pytest.raises(Exception, match="3"):
            nr.get(adapter_key(DEFAULT_EXPERIMENT, DEFAULT_TRIAL, "policy", 3))
    finally:
        nr.close()
    import peft

    from bridge.local.presets import build_model

    loaded = peft.PeftModel.from_pretrained(build_model("tiny", 0), v2.path)  # PEFT's own loader reads it
    assert loaded.peft_config["default"].r == 4


# ------------------------------------------------------------------------------- into the reference server

PROMPT = [1] + [b + 3 for b in b"rev hello="]
ROUNDS = 10  # publishes per transport (the count): training steps between them, tiny preset, rank 4 everywhere


def _expected_greedy(adapter: dict[str, torch.Tensor], config: dict) -> list[int]:
    """The trainer's own model with the adapter, as the server serves it: the base in bfloat16 (the server's
    dtype; the base never changes under LoRA), the adapter in its own dtype (PEFT's default upcast)."""
    pm = peft_oracle(adapter, config, dtype=torch.bfloat16)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    return out[0, len(PROMPT):].tolist()


def _check_served(engine, url: str, name: str, version: int) -> dict | None:
    """Rank 0: the served adapter's checksums against the trainer's own (gathered now), its version, and its
    greedy answer against the trainer's PEFT model (collective: every rank calls it)."""
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    mine = engine.gather_adapter()
    config = engine.adapter_config()
    if mine is None:
        return None
    c = ServerClient(url)
    try:
        served = c.adapter_checksums(name)
        out = c.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 8}, lora_path=name)
    finally:
        c.close()
    want = {n: tensor_checksum(t) for n, t in mine.items()}
    return dict(tensors_equal=served["checksums"] == want, n_tensors=len(want), version=served["wsync_lora_version"],
                answer_version=out["meta_info"].get("wsync_lora_version"), want_version=str(version),
                greedy_equal=out["output_ids"] == _expected_greedy({n: t.clone() for n, t in mine.items()}, config))


def _publish_into(url: str, via: str, root: str, nr_url: str, fault: str):
    """ROUNDS publishes with a training step before each, each checked; then one more with ``fault`` armed,
    which must leave the last version serving (checked against the adapter as it was then)."""
    import os
    import time

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from tests.sync_bodies import train_step

    engine = lora_engine()
    name = f"policy-{via}"
    pub = AdapterPublisher(AdapterPublisherConfig(name=name, via=via, servers=[url], root=root, name_resolve=nr_url))
    checks, results = [], []
    try:
        for version in range(1, ROUNDS + 1):
            train_step(engine, seed=version)
            results.append(pub.publish(engine, version=version))
            checks.append(_check_served(engine, url, name, version))
        base = None
        if via == "disk":  # the base model's full sync beside the adapter's: HF names, and the adapter survives it
            from bridge import PublisherConfig, WeightPublisher

            with WeightPublisher(PublisherConfig(servers=[url], group_timeout=20, progress=False)) as full:
                base = full.publish(engine, version=1).version
        before = _check_served(engine, url, name, ROUNDS)  # the adapter as served; training moves it next
        fault_at = time.time()
        train_step(engine, seed=ROUNDS + 1)
        os.environ["WSYNC_FAILPOINTS"] = fault
        try:
            pub.publish(engine, version=ROUNDS + 1)
        except Exception as e:  # compared across ranks by the test
            failed = f"{type(e).__name__}: {e}"
        else:
            failed = None
        os.environ.pop("WSYNC_FAILPOINTS")
        served_after = None
        if engine.rank == 0:
            from bridge.client import ServerClient

            c = ServerClient(url)
            served_after = c.adapter_checksums(name)
            c.close()
        return dict(checks=checks, results=results, failed=failed, fault_at=fault_at, before=before,
                    served_after=served_after, base=base)
    finally:
        pub.close()
        engine.destroy()


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> str:
    """Where the adapter directories of this module's publishes go: the LoRA servers' --disk-root."""
    return str(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lora_server(server_factory, adapter_root):
    return server_factory(extra_args=["--enable-lora"], disk_roots=[adapter_root])


def _generate_while(url: str, name: str, stop, seen: list, errors: list) -> None:
    """A client thread: generations with the adapter until ``stop``; (time, version) of each answer, and every
    error once the adapter was first served (before that the name is rightly unknown)."""
    import time

    from bridge.client import ServerClient

    c = ServerClient(url)
    try:
        while not stop.is_set():
            try:
                out = c.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 4}, lora_path=name)
                seen.append((time.time(), int(out["meta_info"]["wsync_lora_version"])))
            except Exception as e:  # counted by the test
                if seen:
                    errors.append(f"{type(e).__name__}: {e}")
    finally:
        c.close()


@pytest.mark.parametrize("via,fault", [("disk", "adapter:announce@0=RuntimeError"),
                                       ("tensors", "adapter:commit@1=RuntimeError"),
                                       ("broadcast", "adapter:commit@1=RuntimeError")])
def test_adapter_publishes_into_the_reference_server(lora_server, adapter_root, tmp_path, via, fault):
    """ROUNDS adapter publishes (2 ranks): the served adapter bit-equal to the trainer's, its greedy answer the
    trainer's PEFT model's, the version reported on each answer; 4 client threads meanwhile see no error and
    versions that only go up; a fault after the server loaded the next version leaves the previous one."""
    import threading

    stop, threads, seen, errors = threading.Event(), [], [[] for _ in range(4)], []
    for i in range(4):
        threads.append(threading.Thread(target=_generate_while, args=(lora_server.url, f"policy-{via}", stop, seen[i], errors),
                                        daemon=True))
        threads[-1].start()
    try:
        rank0, rank1 = run_ranks(_publish_into, 2, args=(lora_server.url, via, adapter_root,
                                                          f"file://{tmp_path}/nr", fault), timeout=240)
    finally:
        stop.set()
        for t in threads:
            t.join()
    for version, check in enumerate(rank0["checks"], 1):
        assert check["tensors_equal"] and check["n_tensors"] == 28, (version, check)
        assert check["version"] == check["answer_version"] == check["want_version"], check
        assert check["greedy_equal"], f"version {version}: the served answer is not the trainer's PEFT model's"
    assert rank0["failed"] and rank0["failed"] == rank1["failed"], "every rank raises the same error"
    assert rank0["served_after"]["wsync_lora_version"] == str(ROUNDS), "the previous adapter serves after the fault"
    before = rank0["before"]
    assert before["tensors_equal"] and before["greedy_equal"] and before["version"] == str(ROUNDS), before
    assert rank0["base"] == (1 if via == "disk" else None), "the full sync of the base beside the adapter"
    if via == "disk":  # the newest `keep` (3) directories stay (removed in the background, done by close()), v11's not
        import os

        assert sorted(os.listdir(os.path.join(adapter_root, "policy-disk"))) == ["v10", "v8", "v9"]
    assert rank0["served_after"]["checksums"] == {n: c for n, c in rank0["results"][-1].checksums.items()}
    assert not errors, f"{len(errors)} client errors while adapters were published: {errors[:3]}"
    for s in seen:
        versions = [v for t, v in s if t < rank0["fault_at"]]
        assert versions == sorted(versions), f"versions went down for a client: {versions}"
    assert any(s for s in seen), "the client threads got no answer"


@pytest.mark.parametrize("argv,message", [
    (["--lora-alpha", "3"], "add --lora-rank R"),
    (["--lora-rank", "0"], "lora.rank must be an integer >= 1"),
    (["--publish-adapter", "p"], "train one with --lora-rank R"),
    (["--lora-rank", "4", "--publish-adapter", "p", "--publish", "broadcast"], "via=.broadcast. sends the adapter to servers"),
    (["--lora-rank", "4", "--publish-adapter", "a/b", "--publish", "disk"], "adapter name must be"),
])
def test_train_lora_flags_refused(argv, message):
    from wsync.cli import build_parser
    from wsync.train import check_arguments

    args = build_parser().parse_args(["train", *argv])
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        check_arguments(args)


def test_train_publish_adapter_takes_the_server_registry():
    """``wsync train --publish-adapter`` finds its servers as the weights do: --server-registry, --min-servers."""
    from wsync.cli import build_parser
    from wsync.train import _adapter_config

    args = build_parser().parse_args(["train", "--lora-rank", "4", "--publish-adapter", "p", "--publish", "colocated",
                                      "--server-registry", "file:///tmp/registry", "--min-servers", "2"])
    cfg = _adapter_config(args)
    assert (cfg.via, cfg.servers, cfg.server_registry, cfg.min_servers) == ("tensors", [], ["file:///tmp/registry"], 2)
    plain = _adapter_config(build_parser().parse_args(["train", "--lora-rank", "4", "--publish-adapter", "p",
                                                       "--publish", "disk"]))
    assert (plain.server_registry, plain.min_servers) == (None, 1), "without the flags: the config's defaults"


def test_train_publish_adapter_by_broadcast_takes_the_group_flags():
    """``wsync train --publish-adapter NAME --publish broadcast``: the adapter over a weight-update group, with the
    weight broadcast's --group-timeout, --master-address, --master-port and --backend."""
    from wsync.cli import build_parser
    from wsync.train import _adapter_config, check_arguments

    args = build_parser().parse_args(["train", "--lora-rank", "4", "--publish-adapter", "p", "--publish", "broadcast",
                                      "--server", "http://10.0.0.2:30000", "--group-timeout", "7", "--master-address",
                                      "10.0.0.1", "--master-port", "29999", "--backend", "gloo"])
    check_arguments(args)
    cfg = _adapter_config(args)
    assert (cfg.via, cfg.servers, cfg.group_timeout, cfg.master_address, cfg.master_port, cfg.backend) == (
        "broadcast", ["http://10.0.0.2:30000"], 7.0, "10.0.0.1", 29999, "gloo")


@pytest.mark.slow
def test_demo_lora_end_to_end(tmp_path):
    """``wsync demo --lora --transport all``: the adapter alone by disk, by tensors and by broadcast, each server's
    answer with it the trainer's."""
    import json

    from tests.test_cli import wsync

    report = tmp_path / "out.json"
    out = wsync("demo", "--lora", "--transport", "all", "--steps", "2", "--json", str(report), "--workdir",
                str(tmp_path / "w"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Warning" not in out.stdout + out.stderr, "a library's warning the user cannot act on"
    data = json.loads(report.read_text())
    assert data["ok"] is True and data["lora"] is True
    assert [(s["step"], s["transport"]) for s in data["syncs"]] == [
        (step, via) for step in (1, 2) for via in ("disk", "tensors", "broadcast")]
    for s in data["syncs"]:
        assert s["bytes"] > 0
        for served in s["servers"].values():
            assert served["version"] == str(s["step"]) and served["answer"] == s["trainer_answer"]


def _fault_between_servers(urls: list[str], fault: str):
    """Version 1 into both servers, then version 2 with ``fault`` armed between the servers' loads."""
    import os

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-two", via="tensors", servers=urls))
    try:
        train_step(engine, seed=1)
        first = pub.publish(engine, version=1)
        train_step(engine, seed=2)
        os.environ["WSYNC_FAILPOINTS"] = fault
        try:
            pub.publish(engine, version=2)
        except Exception as e:  # compared across ranks by the test
            failed = f"{type(e).__name__}: {e}"
        else:
            failed = None
        os.environ.pop("WSYNC_FAILPOINTS")
        served = None
        if engine.rank == 0:
            served = {}
            for u in urls:
                c = ServerClient(u)
                served[u] = c.adapter_checksums("policy-two")
                c.close()
        return dict(first=first.checksums, failed=failed, served=served)
    finally:
        pub.close()
        engine.destroy()


@pytest.fixture(scope="module")
def second_lora_server(server_factory):
    return server_factory(extra_args=["--enable-lora"])


def test_a_fault_between_two_servers_puts_the_previous_adapter_back(lora_server, second_lora_server):
    """Server 0 loaded version 2 when the publish failed before server 1: server 0 goes back to version 1."""
    urls = [lora_server.url, second_lora_server.url]
    rank0, rank1 = run_ranks(_fault_between_servers, 2, args=(urls, "adapter:load:1@0=RuntimeError"), timeout=120)
    assert rank0["failed"] and rank0["failed"] == rank1["failed"] and "adapter:load" in rank0["failed"]
    for url, served in rank0["served"].items():
        assert served["wsync_lora_version"] == "1" and served["checksums"] == rank0["first"], url


def _one_writer_publish(url: str, trial: str, seed: int, fault: str | None):
    """One trainer (trial ``trial``): adapter ``policy-race`` version 1 into ``url``, with ``fault`` armed; what it
    raised, else the checksums it published."""
    import os

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-race", via="tensors", servers=[url], trial=trial))
    try:
        train_step(engine, seed=seed)
        if fault:
            os.environ["WSYNC_FAILPOINTS"] = fault
        try:
            return {"checksums": pub.publish(engine, version=1).checksums}
        except Exception as e:  # read by the test
            return {"failed": f"{type(e).__name__}: {e}"}
        finally:
            os.environ.pop("WSYNC_FAILPOINTS", None)
    finally:
        pub.close()
        engine.destroy()


def test_two_trainers_publishing_adapters_to_one_server_take_turns(lora_server):
    """An adapter publish holds its servers as a full sync does (the writer lease): while trainer A's publish runs
    (paused before its load), trainer B's publish to the same server is refused, naming A's run, and changes
    nothing; A's publish completes; once A let go, B's goes through."""
    import threading
    import time

    from bridge.client import ServerClient

    results = {}
    a = threading.Thread(target=lambda: results.update(
        a=run_ranks(_one_writer_publish, 1, args=(lora_server.url, "race-a", 1, "adapter:load:0@0=sleep:4"),
                    timeout=120)[0]), daemon=True)
    a.start()
    probe = ServerClient(lora_server.url)
    try:
        deadline = time.monotonic() + 60
        while probe.server_info()["internal_states"][0]["writer_lease"] is None:
            assert a.is_alive() and time.monotonic() < deadline, f"trainer A never held the server: {results}"
            time.sleep(0.05)
        (b,) = run_ranks(_one_writer_publish, 1, args=(lora_server.url, "race-b", 2, None), timeout=120)
        a.join(60)
        assert "another writer holds this server" in b.get("failed", ""), b
        assert "race-a" in b["failed"], b["failed"]
        assert "checksums" in results["a"], results["a"]
        served = probe.adapter_checksums("policy-race")
        assert served["wsync_lora_version"] == "1" and served["checksums"] == results["a"]["checksums"]
        assert probe.server_info()["internal_states"][0]["writer_lease"] is None, "A let go at its commit"
        (b,) = run_ranks(_one_writer_publish, 1, args=(lora_server.url, "race-b", 2, None), timeout=120)
        assert "checksums" in b, b
        assert probe.adapter_checksums("policy-race")["checksums"] == b["checksums"]
    finally:
        probe.close()


def _retries(url: str):
    """Version 1; version 1 again with the same weights; version 1 after a training step; version 2."""
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-retry", via="tensors", servers=[url], trial="retry"))
    try:
        train_step(engine, seed=1)
        first = pub.publish(engine, version=1)
        again = pub.publish(engine, version=1)
        train_step(engine, seed=2)
        try:
            pub.publish(engine, version=1)
            other = None
        except Exception as e:  # read by the test
            other = f"{type(e).__name__}: {e}"
        second = pub.publish(engine, version=2)
        return dict(first=(first.checksums, first.retried), again=(again.checksums, again.retried), other=other,
                    second=second.checksums)
    finally:
        pub.close()
        engine.destroy()


def test_an_adapter_version_published_again_is_a_safe_retry_only_with_the_same_weights(lora_server):
    """The full publisher's version rule: the last version again with the same weights returns at once (nothing
    loaded, ``retried``), with other weights it is a VersionError; the next version goes on."""
    from bridge.client import ServerClient

    (r,) = run_ranks(_retries, 1, args=(lora_server.url,), timeout=120)
    assert r["first"][1] is False and r["again"] == (r["first"][0], True), r
    assert r["other"] and r["other"].startswith("VersionError") and "already published with other weights" in r["other"]
    c = ServerClient(lora_server.url)
    try:
        served = c.adapter_checksums("policy-retry")
    finally:
        c.close()
    assert served["wsync_lora_version"] == "2" and served["checksums"] == r["second"]


def _register(registry: str, trial: str, url: str) -> None:
    """``url`` as a server entry of ``trial`` in the registry, as ``wsync serve --register`` writes it."""
    import json

    from bridge.fleet.discovery import server_id, servers_prefix
    from bridge.name_resolve import DEFAULT_EXPERIMENT, make_name_resolve

    nr = make_name_resolve(registry)
    try:
        nr.add(f"{servers_prefix(DEFAULT_EXPERIMENT, trial)}/{server_id(url)}", json.dumps({"url": url}), replace=True)
    finally:
        nr.close()


DEAD = "http://127.0.0.1:9"  # nothing listens there


def _publish_to_a_registry(registry: str, trial: str, second: str):
    """Version 1 with one server registered, version 2 after a second one and a dead one registered (found at that
    publish; the dead one excluded), then version 3 with min_servers above what answers."""
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-fleet", via="tensors", server_registry=registry,
                                                  trial=trial))
    try:
        out = {}
        for version in (1, 2):
            if version == 2 and engine.rank == 0:
                _register(registry, trial, second)
                _register(registry, trial, DEAD)
            train_step(engine, seed=version)
            out[version] = pub.publish(engine, version=version).checksums
        pub.config.min_servers = 3
        try:
            pub.publish(engine, version=3)
        except Exception as e:  # compared across ranks by the test
            out["failed"] = f"{type(e).__name__}: {e}"
        if engine.rank == 0:
            from bridge.fleet.discovery import Registry
            from bridge.name_resolve import DEFAULT_EXPERIMENT

            listed = Registry(registry, DEFAULT_EXPERIMENT, trial)
            out["out_of_rotation"] = [json.loads(v)["url"] for v in listed.nr.get_subtree(listed.out_prefix)]
            out["served"] = {}
            for u in listed.urls():
                if u == DEAD:
                    continue
                c = ServerClient(u)
                out["served"][u] = c.adapter_checksums("policy-fleet")
                c.close()
        return out
    finally:
        pub.close()
        engine.destroy()


def test_adapter_publishes_find_their_servers_in_a_registry(lora_server, second_lora_server, tmp_path):
    """server_registry (file://): the servers are found again at every publish; a server registered after
    version 1 gets version 2, and a dead one registered with it is excluded from the publish and taken out of
    rotation as by a full one (the same Fleet); fewer servers answering than min_servers fails the publish on every rank, naming the dead one, and changes
    nothing."""
    registry = f"file://{tmp_path}/registry"
    _register(registry, "lora-fleet", lora_server.url)
    rank0, rank1 = run_ranks(_publish_to_a_registry, 2, args=(registry, "lora-fleet", second_lora_server.url),
                             timeout=120)
    assert rank0["failed"] and rank0["failed"] == rank1["failed"], "every rank raises the same error"
    assert "min_servers=3" in rank0["failed"] and "2 of 3 server(s)" in rank0["failed"], rank0["failed"]
    assert f"{DEAD}: excluded" in rank0["failed"], rank0["failed"]
    assert rank0["out_of_rotation"] == [DEAD], "the dead server is marked out of rotation in the registry, none other"
    assert "publish failed at adapter:servers" in rank0["failed"], "the error names the part of the step that failed"
    assert sorted(rank0["served"]) == sorted([lora_server.url, second_lora_server.url])
    for url, served in rank0["served"].items():
        assert served["wsync_lora_version"] == "2" and served["checksums"] == rank0[2], url


def _unregister(registry: str, trial: str, url: str) -> None:
    from bridge.fleet.discovery import server_id, servers_prefix
    from bridge.name_resolve import DEFAULT_EXPERIMENT, make_name_resolve

    nr = make_name_resolve(registry)
    try:
        nr.delete(f"{servers_prefix(DEFAULT_EXPERIMENT, trial)}/{server_id(url)}")
    finally:
        nr.close()


def _broadcast_faults(registry: str, trial: str, urls: list[str], small: str):
    """By broadcast to the servers registered for ``trial`` (``urls``): version 1; version 2 with ``small`` (its
    --max-lora-rank below the adapter's rank) registered too; version 3 after it left; version 4 with a fault after
    every server loaded it; version 5; version 6 after the first server dropped the group (as a server restarted at
    its URL has lost it). After each: what every rank raised, what ``urls`` serve, their groups."""
    import os

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-bc", via="broadcast", server_registry=registry,
                                                  trial=trial, group_timeout=20))
    out: dict = {"published": {}, "failed": {}, "served": {}, "groups": {}}
    try:
        for version in (1, 2, 3, 4, 5, 6):
            if engine.rank == 0 and version in (2, 3):
                (_register if version == 2 else _unregister)(registry, trial, small)
            if engine.rank == 0 and version == 6:
                lost = ServerClient(urls[0])
                lost.destroy_weights_update_group(out["groups"][5][urls[0]][0])
                lost.close()
            train_step(engine, seed=version)
            if version == 4:
                os.environ["WSYNC_FAILPOINTS"] = "adapter:commit@0=RuntimeError"
            try:
                out["published"][version] = pub.publish(engine, version=version).checksums
            except Exception as e:  # compared across ranks by the test
                out["failed"][version] = f"{type(e).__name__}: {e}"
            os.environ.pop("WSYNC_FAILPOINTS", None)
            for u in urls if engine.rank == 0 else ():
                c = ServerClient(u)
                out["served"].setdefault(version, {})[u] = c.adapter_checksums("policy-bc")
                out["groups"].setdefault(version, {})[u] = c.server_info()["internal_states"][0]["weight_update_groups"]
                c.close()
        return out
    finally:
        pub.close()
        engine.destroy()


def test_broadcast_publish_refused_by_a_server_or_failed_keeps_the_previous_adapter(lora_server, second_lora_server,
                                                                                      server_factory, tmp_path):
    """via='broadcast', 2 ranks: a server that refuses the adapter (rank over its --max-lora-rank, SGLang's words)
    fails the publish on every rank with its message, and a fault after every server loaded it too; each time the
    servers serve the previous version, bit for bit; the group is made again for the next publish (a new server set
    or a failed publish: one group per server at a time, the old ones dropped on both sides), and again within the
    publish when a server lost it."""
    small = server_factory(extra_args=["--enable-lora", "--max-lora-rank", "2"])
    registry, urls = f"file://{tmp_path}/registry", [lora_server.url, second_lora_server.url]
    for u in urls:
        _register(registry, "lora-bc", u)
    rank0, rank1 = run_ranks(_broadcast_faults, 2, args=(registry, "lora-bc", urls, small.url), timeout=120)
    assert rank0["failed"] == rank1["failed"] and sorted(rank0["failed"]) == [2, 4], rank0["failed"]
    refused, fault = rank0["failed"][2], rank0["failed"][4]
    assert refused.startswith("SyncError") and "publish failed at adapter:load" in refused, refused
    assert small.url in refused and r"with rank 4 is incompatible" in refused and "`--max-lora-rank` (2)" in refused
    assert "adapter:commit" in fault and "rank 0" in fault, fault
    serving = {1: 1, 2: 1, 3: 3, 4: 3, 5: 5, 6: 6}  # after each publish: the version served
    for version, want in serving.items():
        for u in urls:
            served = rank0["served"][version][u]
            assert served["wsync_lora_version"] == str(want), (version, u, served)
            assert served["checksums"] == rank0["published"][want], (version, u)
    groups = rank0["groups"]
    for version in (1, 3, 4, 5, 6):
        assert [len(groups[version][u]) for u in urls] == [1, 1], (version, groups[version])
        assert groups[version][urls[0]] == groups[version][urls[1]] and groups[version][urls[0]][0].startswith(
            "wsync_lora_policy-bc-")
    assert groups[1] != groups[3] != groups[4], "a new server set and a failed publish each get a new group"
    assert groups[4] == groups[5] != groups[6], "the group is kept across publishes, and made again when lost"


def _interrupted_publish(url: str, via: str, root: str, nr_url: str, point: str):
    """Version 1, then version 2 with a real SIGINT sent at ``point`` (after the server loaded version 2), then
    version 2 for real: what each rank raised, and what the server served after the interrupt."""
    import os
    import signal

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from bridge.failpoints import ENV
    from tests.sync_bodies import train_step

    engine = lora_engine()
    name = f"policy-int-{via}"
    pub = AdapterPublisher(AdapterPublisherConfig(name=name, via=via, servers=[url], root=root, name_resolve=nr_url))
    try:
        train_step(engine, seed=1)
        first = pub.publish(engine, version=1).checksums
        train_step(engine, seed=2)
        os.environ[ENV] = point
        try:
            pub.publish(engine, version=2)
            got = ("no error", "", "")
        except BaseException as e:  # the test records whatever comes, the interrupt included
            cause = e.__cause__ or e.__context__
            got = (type(e).__name__, str(e), str(cause) if cause is not None else "")
        finally:
            del os.environ[ENV]
        handler_back = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        served = again = None
        if engine.rank == 0:
            c = ServerClient(url)
            served = c.adapter_checksums(name)
            c.close()
        again = pub.publish(engine, version=2).version  # the trainer goes on
        return dict(first=first, got=got, served=served, again=again, handler_back=handler_back)
    finally:
        pub.close()
        engine.destroy()


@pytest.mark.parametrize("via,point,rank", [("disk", "adapter:announce@0=SIGINT", 0),
                                            ("tensors", "adapter:commit@1=SIGINT", 1),
                                            ("broadcast", "adapter:commit@0=SIGINT", 0)])
def test_ctrl_c_during_an_adapter_publish_leaves_the_previous_adapter(lora_server, adapter_root, tmp_path, via,
                                                                      point, rank):
    """A real SIGINT to one rank after the server loaded the new version: that rank raises KeyboardInterrupt
    (after the clean-up), the other the SyncError it carries, both naming the interrupted rank; the server
    serves the previous adapter; the next publish goes through."""
    out = run_ranks(_interrupted_publish, 2, args=(lora_server.url, via, adapter_root, f"file://{tmp_path}/nr", point),
                    timeout=120)
    mine, other = out[rank]["got"], out[1 - rank]["got"]
    assert mine[0] == "KeyboardInterrupt", mine
    assert other[0] == "SyncError" and f"rank {rank} was interrupted" in other[1], other
    assert mine[2] == other[1], "every rank gets the same error (the interrupted one as the KeyboardInterrupt's cause)"
    assert out[0]["served"]["wsync_lora_version"] == "1" and out[0]["served"]["checksums"] == out[0]["first"]
    assert out[0]["again"] == out[1]["again"] == 2 and out[0]["handler_back"] and out[1]["handler_back"]


def _big_adapter(root: str):
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from trainer import EngineConfig, FSDPEngine, LoraConfig

    engine = FSDPEngine(EngineConfig(preset="small", lora=LoraConfig(rank=16))).initialize()
    pub = AdapterPublisher(AdapterPublisherConfig(name="big", via="disk", root=root, name_resolve="memory://big"))
    try:
        res = pub.publish(engine, version=1)
        return res.bytes
    finally:
        pub.close()
        engine.destroy()


def test_an_adapter_larger_than_the_ranks_store_messages(tmp_path):
    """The small preset's rank-16 adapter (9.3 MiB in float32) is more than one message of the trainer ranks'
    key-value store takes (8 MiB): the adapter must never travel through the agreement's exchange."""
    nbytes = run_ranks(_big_adapter, 2, args=(str(tmp_path),), timeout=180)
    assert nbytes[0] == nbytes[1] > 8 << 20


def _dcp_roundtrip(path: str):
    from tests.sync_bodies import train_step

    engine = lora_engine()
    try:
        train_step(engine, seed=1)
        saved = engine.gather_adapter()
        saved = {n: t.clone() for n, t in saved.items()} if saved is not None else None
        engine.save(path, weight_format="dcp", with_optim=True)
        train_step(engine, seed=2)
        engine.load(path, weight_format="dcp", with_optim=True)
        loaded = engine.gather_adapter()
        try:
            engine.save(path + "-hf")
        except ConfigError as e:
            refused = str(e)
        else:
            refused = None
        return dict(same=saved is None or all(torch.equal(saved[n], loaded[n]) for n in saved), refused=refused)
    finally:
        engine.destroy()


def test_a_lora_engine_checkpoints_in_dcp(tmp_path):
    """A DCP checkpoint brings the adapter back bit for bit; an HF save is refused (it would mix PEFT's names in)."""
    for out in run_ranks(_dcp_roundtrip, 2, args=(str(tmp_path / "ckpt"),), timeout=120):
        assert out["same"]
        assert out["refused"] and "weight_format='dcp'" in out["refused"]


def _one_run(url: str, root: str, nr_url: str, versions: list[int], fault: str | None):
    """A trainer run publishing ``versions`` of "policy-restart" by disk; ``fault`` armed for the last one."""
    import os

    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-restart", via="disk", servers=[url], root=root,
                                                  name_resolve=nr_url))
    out = dict(results=[], failed=[])
    try:
        for i, version in enumerate(versions):
            train_step(engine, seed=version)
            if fault and i == len(versions) - 1:
                os.environ["WSYNC_FAILPOINTS"] = fault
            try:
                out["results"].append(pub.publish(engine, version=version))
            except Exception as e:  # compared by the test
                out["failed"].append(f"{type(e).__name__}: {e}")
            os.environ.pop("WSYNC_FAILPOINTS", None)
        if engine.rank == 0:
            c = ServerClient(url)
            out["served"] = c.adapter_checksums("policy-restart")
            c.close()
        return out
    finally:
        pub.close()
        engine.destroy()


def test_a_restarted_trainer_that_fails_puts_the_last_runs_adapter_back(lora_server, adapter_root, tmp_path):
    """Run 1 publishes versions 1 and 2; run 2, a new trainer, is refused version 2 and then fails version 3 after
    the server loaded it: the server serves run 1's version 2 again, found through its announcement."""
    nr_url = f"file://{tmp_path}/nr"
    first, _ = run_ranks(_one_run, 2, args=(lora_server.url, adapter_root, nr_url, [1, 2], None), timeout=120)
    assert first["failed"] == [] and first["served"]["wsync_lora_version"] == "2"
    second, _ = run_ranks(_one_run, 2, args=(lora_server.url, adapter_root, nr_url, [2, 3], "adapter:announce@0=RuntimeError"),
                          timeout=120)
    refused, failed = second["failed"]
    assert refused.startswith("VersionError") and "version 2 is not above version 2 announced" in refused, refused
    assert "adapter:announce" in failed, failed
    assert second["served"]["wsync_lora_version"] == "2", "run 1's last adapter serves again"
    assert second["served"]["checksums"] == first["results"][-1].checksums


def _bf16_once(url: str):
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum
    from tests.sync_bodies import train_step

    engine = lora_engine()
    pub = AdapterPublisher(AdapterPublisherConfig(name="policy-bf16", via="tensors", servers=[url], dtype="bfloat16"))
    try:
        train_step(engine, seed=1)
        res = pub.publish(engine, version=1)
        mine = engine.gather_adapter(torch.bfloat16)
        if mine is None:
            return None
        c = ServerClient(url)
        served = c.adapter_checksums("policy-bf16")
        c.close()
        return dict(bytes=res.bytes, want={n: tensor_checksum(t) for n, t in mine.items()}, served=served)
    finally:
        pub.close()
        engine.destroy()


def test_an_adapter_served_in_bfloat16(lora_server):
    """``dtype="bfloat16"``: half the bytes, and the server holds the trainer's adapter cast to bfloat16 bit for bit."""
    out, _ = run_ranks(_bf16_once, 2, args=(lora_server.url,), timeout=120)
    assert out["served"]["checksums"] == out["want"] and set(out["served"]["dtypes"].values()) == {"bfloat16"}
    in_out = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 256), (128, 256), (256, 128)]  # q k v o gate up down
    assert out["bytes"] == 2 * sum(LORA["rank"] * (i + o) * 2 for i, o in in_out)  # 2 layers, A and B, 2 bytes each
