"""The public Python API: version semantics, retries, the result object, config validation.

One trainer process (no torch.distributed) publishing a plain HF model into a real reference server.
"""

from __future__ import annotations

import pytest
import torch

import bridge
from bridge import ConfigError, PublisherConfig, VersionError, WeightPublisher


def test_public_surface_is_explicit():
    assert bridge.__all__ == sorted(bridge.__all__)
    for name in bridge.__all__:
        assert getattr(bridge, name) is not None


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory.many([dict(model=tiny_model_dir)])[0]


@pytest.fixture()
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def _served_checksums(server, model):
    from bridge.digest import tensor_checksum
    from bridge.sources import ModuleSource

    want = {s.name: tensor_checksum(p.detach().to(torch.bfloat16)) for s, p in
            ((s, ModuleSource(model)._params[s.name]) for s in ModuleSource(model).param_specs())}
    return server.client.weights_checksum(list(want))["checksums"] == want


def test_broadcast_versions_retries_and_result(server, model):
    with WeightPublisher(PublisherConfig(servers=[server.url], bucket_mb=0.5, progress=False)) as pub:
        r1 = pub.publish(model, version=5)
        assert (r1.version, r1.transport, r1.servers) == (5, "broadcast", {server.url: "ok"})
        assert r1.bytes == sum(p.numel() * 2 for n, p in model.named_parameters() if n != "lm_head.weight")
        assert r1.seconds > 0 and r1.gbps > 0 and r1.buckets >= 2 and not r1.retried
        assert r1.to_json()["gbps"] == r1.gbps
        assert server.client.model_info()["weight_version"] == "5"
        # A retry of the same version with the same weights is safe, and says it was a retry (again too).
        assert pub.publish(model, version=5).retried
        assert pub.publish(model, version=5).retried
        # An older version is refused before anything is sent.
        with pytest.raises(VersionError, match="older"):
            pub.publish(model, version=4)
        # The same version with other weights is refused, and the servers keep serving version 5.
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)
        before = server.client.weights_checksum()
        with pytest.raises(VersionError, match="different weights"):
            pub.publish(model, version=5)
        assert server.client.weights_checksum() == before  # nothing of the refused weights is served
        # New weights under a new version go through, bit-exact.
        assert pub.publish(model, version=6).servers == {server.url: "ok"}
        assert _served_checksums(server, model)


def test_disk_versions_and_wait_loaded(server, model, tmp_path):
    from bridge.client import ServerGroup
    from inference_adapter.watcher import DiskWatcher

    nr = f"file://{tmp_path / 'nr'}"
    watcher = DiskWatcher(nr, "api", "t0", ServerGroup([server.url]))
    watcher.start()
    try:
        cfg = PublisherConfig(transport="disk", servers=[server.url], name_resolve=nr, snapshot_root=str(tmp_path / "s"),
                              experiment="api", trial="t0", progress=False)
        with WeightPublisher(cfg) as pub:
            r = pub.publish(model, version=10)
            assert r.servers == {server.url: "ok"} and r.path.endswith("v10") and r.bytes > 0
            assert server.client.model_info()["weight_version"] == "10"
            assert pub.publish(model, version=10).retried  # identical snapshot: idempotent
            with pytest.raises(VersionError):
                pub.publish(model, version=9)
        # A second publisher of the same trial (e.g. a restarted trainer) cannot go backwards either.
        with WeightPublisher(cfg) as pub2:
            with pytest.raises(VersionError, match="already announced"):
                pub2.publish(model, version=3)
    finally:
        watcher.stop()


def test_a_restarted_trainer_goes_back_in_versions_only_when_it_starts_a_new_run(server_factory, tiny_model_dir, model):
    """The run id (experiment/trial) and new_run reach the server, which refuses a version going back otherwise."""
    strict = server_factory(model=tiny_model_dir, strict_versions=True)
    cfg = dict(servers=[strict.url], bucket_mb=0.5, progress=False, experiment="api", trial="runs")
    with WeightPublisher(PublisherConfig(**cfg)) as pub:
        pub.publish(model, version=7)
    with WeightPublisher(PublisherConfig(**cfg)) as restarted, pytest.raises(VersionError) as e:
        restarted.publish(model, version=1)  # the same run counting from 1 again
    assert "older than the served version 7" in str(e.value) and "new_run" in str(e.value)
    info = strict.client.server_info()["internal_states"][0]
    assert strict.client.model_info()["weight_version"] == "7" and not info["update_session_open"]
    with WeightPublisher(PublisherConfig(**cfg, new_run=True)) as fresh:
        fresh.publish(model, version=1)
        fresh.publish(model, version=2)  # later versions of the new run claim nothing more
    with WeightPublisher(PublisherConfig(**cfg)) as again, pytest.raises(VersionError):
        again.publish(model, version=1)
    with WeightPublisher(PublisherConfig(**{**cfg, "trial": "another"})) as other:
        other.publish(model, version=1)  # another trial is another run
    assert strict.client.model_info()["weight_version"] == "1"
    assert _served_checksums(strict, model)


@pytest.mark.parametrize("kwargs, match", [
    (dict(transport="carrier-pigeon", servers=["x"]), "transport"),
    (dict(servers=[]), "at least one server"),
    (dict(servers=["x"], bucket_mb=0), "bucket_mb"),
    (dict(servers=["x"], serving_dtype="float8"), "dtype"),
    (dict(servers=["x"], load_format="zip"), "load_format"),
    (dict(servers=["x"], group_timeout=-1), "group_timeout"),
    (dict(server_registry="http://x:1"), "router\\+http"),  # a router is router+http://, not a server URL
    (dict(servers=["x"], min_servers=0), "min_servers"),
    (dict(servers=["x"], probe_timeout=0), "probe_timeout"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PublisherConfig(**kwargs)


def test_an_option_of_another_transport_is_refused_naming_its_transport():
    from bridge.transports.disk import DiskOptions

    with pytest.raises(ConfigError, match="keep_snapshots is an option of the disk transport, not of broadcast"):
        PublisherConfig(transport="broadcast", servers=["x"], keep_snapshots=5)
    with pytest.raises(ConfigError, match="name_resolve is an option of the disk transport, not of broadcast"):
        PublisherConfig(transport="nccl", servers=["x"], name_resolve="memory://")  # an alias: its own name
    with pytest.raises(ConfigError, match="pause_mode is an option of the broadcast(,| and) colocated.* transports, not of disk"):
        PublisherConfig(transport="disk", pause_mode="abort")
    with pytest.raises(ConfigError, match="pause_mode is an option of .*, not of disk"):
        PublisherConfig(transport="disk", options=DiskOptions(), pause_mode="abort")
    assert "keep_snapshots" in PublisherConfig.keywords("disk") and "keep_snapshots" not in PublisherConfig.keywords("nccl")


def test_help_shows_the_shared_settings():
    import inspect

    params = inspect.signature(PublisherConfig).parameters
    assert {"transport", "servers", "bucket_mb", "encoding", "options", "transport_options"} <= set(params)
    assert params["transport"].default == "broadcast" and params["transport"].kind is inspect.Parameter.KEYWORD_ONLY


def test_bad_version_values():
    pub = WeightPublisher(servers=["http://127.0.0.1:1"], progress=False)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(VersionError):
            pub.publish(torch.nn.Linear(1, 1), version=bad)


def test_two_trials_on_the_default_snapshot_root_do_not_collide(model, tmp_path):
    """Each trial gets its own folder under <temp>/wsync_<user>/snapshots: one trial's garbage collection or
    version numbers never touch another's announced snapshots."""
    import os
    import shutil
    import uuid

    from bridge.snapshot import verify_snapshot
    from bridge.transports.disk import default_snapshot_root

    experiment = f"api-{uuid.uuid4().hex[:8]}"
    paths = {}
    try:
        for trial in ("a", "b"):
            cfg = PublisherConfig(transport="disk", name_resolve=f"file://{tmp_path / 'nr'}", experiment=experiment,
                                  trial=trial, keep_snapshots=1, progress=False)
            with WeightPublisher(cfg) as pub:
                paths[trial] = [pub.publish(model, version=v).path for v in (1, 2)]
        assert paths["a"][-1] == os.path.join(default_snapshot_root(experiment, "a"), "v2")
        assert paths["a"][-1] != paths["b"][-1]
        for trial in ("a", "b"):  # each trial's newest announced version is still there, intact
            verify_snapshot(paths[trial][-1])
        with pytest.raises(ConfigError, match="snapshot folder"):
            default_snapshot_root(experiment, "..")
    finally:
        shutil.rmtree(os.path.join(default_snapshot_root(), experiment), ignore_errors=True)


def test_a_second_update_session_is_refused_as_already_open(server):
    """The refusal is its own error type (the publisher branches on it, never on the message's text)."""
    from bridge.errors import ServerError, SessionAlreadyOpen

    c = server.client
    c.begin_weight_update()
    try:
        with pytest.raises(SessionAlreadyOpen) as e:
            c.begin_weight_update()
        assert isinstance(e.value, ServerError) and e.value.status == 400 and e.value.server == server.url
    finally:
        c.abort_weight_update()


def test_preset_models_built_in_threads_at_once_are_the_seeded_ones(tmp_path):
    """``make_model_dir`` from several threads at once (the launchers start servers concurrently) writes the seeded
    weights every time: torch's generator is the process's, and two builds drawing from it in turn built other
    weights (a LoRA adapter then met another base on the server than the trainer's)."""
    import concurrent.futures as cf

    import torch
    from safetensors.torch import load_file

    from bridge.local.presets import build_model, make_model_dir

    with cf.ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(lambda i: make_model_dir(tmp_path / f"m{i}", "tiny" if i % 2 else "tiny-llama"), range(4)))
    for i, d in enumerate(dirs):
        want = build_model("tiny" if i % 2 else "tiny-llama").state_dict()
        got = load_file(f"{d}/model.safetensors")
        assert all(torch.equal(got[n], want[n]) for n in got), d
