"""A version label never names two sets of weights, whichever process publishes it (issue 35).

A trainer process that did not publish the version a server serves (a new process of the same run) cannot
publish that version again with other weights: it is refused with ``VersionError`` on every rank before
anything moves, and the server keeps the weights it served. The same weights from a new process are a safe
retry; ``new_run=True`` starts a new run. Each step below is a new 2-rank trainer (``run_ranks``), so no
publisher remembers what another published: broadcast, colocated and disk into the reference server, which
computes the digest of the weights it serves on request.
"""

from __future__ import annotations

import pytest

from bridge.client import ServerClient, ServerGroup
from tests import sync_bodies as sb
from tests.dist_utils import run_ranks

VERSION = 23


def _publish(url: str, steps: int, transport: str, extra: dict) -> dict:
    """A new trainer: ``steps`` training steps, then one publish of VERSION; its outcome and its own weights."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError

    engine = sb.engine()
    for s in range(steps):
        sb.train_step(engine, seed=s)
    pub = WeightPublisher(PublisherConfig(transport=transport, servers=[url], group_timeout=20, progress=False,
                                          **extra))
    try:
        try:
            res = pub.publish(engine, version=VERSION)
            outcome = {"ok": True, "retried": res.retried}
        except BridgeError as e:
            outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {**outcome, "own": sb.own_checksums(engine)}
    finally:
        pub.close()
        engine.destroy()


def _run(url: str, steps: int, transport: str, extra: dict, watch: tuple | None = None) -> dict:
    """One new 2-rank trainer; with ``watch`` (name resolution, experiment, trial) a watcher loads what it
    announces. Returns rank 0's outcome, after checking that every rank saw the same one."""
    watcher = None
    if watch is not None:
        from inference_adapter.watcher import DiskWatcher

        watcher = DiskWatcher(*watch, ServerGroup([url]))
        watcher.start()
    try:
        rank0, rank1 = run_ranks(_publish, 2, args=(url, steps, transport, extra), timeout=120)
    finally:
        if watcher is not None:
            watcher.stop()
    assert {k: v for k, v in rank1.items() if k != "own"} == {k: v for k, v in rank0.items() if k != "own"}
    return rank0


def _served(url: str) -> tuple[str, dict]:
    got = ServerClient(url).weights_checksum()
    return got["weight_version"], got["checksums"]


def _same(served: dict, own: dict) -> bool:
    return {n: served[n] for n in own} == own


@pytest.mark.parametrize("transport", ["broadcast", "colocated", "disk"])
def test_a_new_process_cannot_relabel_the_served_version_with_other_weights(server_factory, tiny_model_dir,
                                                                            tmp_path, monkeypatch, transport):
    server = server_factory(model=tiny_model_dir)
    extra, watch = {}, None
    if transport == "disk":
        nr = f"file://{tmp_path / 'nr'}"
        extra = dict(name_resolve=nr, snapshot_root=str(tmp_path / "snap"), experiment="relabel", trial="t0",
                     wait_loaded_timeout=60)
        watch = (nr, "relabel", "t0")

    first = _run(server.url, 1, transport, extra, watch)
    assert first["ok"], first
    version, served = _served(server.url)
    assert version == str(VERSION) and _same(served, first["own"])

    # Other weights under the same version; a failpoint at the begin step would turn a refusal that comes any
    # later (once something moved) into a SyncError.
    monkeypatch.setenv("WSYNC_FAILPOINTS", "begin@0=RuntimeError")
    other = _run(server.url, 3, transport, extra, watch)
    monkeypatch.delenv("WSYNC_FAILPOINTS")
    assert other["own"] != first["own"]
    assert not other["ok"], "a new process relabelled the served version with other weights"
    assert other["error"].startswith("VersionError: "), f"not refused before the begin step: {other['error']}"
    error = other["error"]
    assert "\n" not in error, error
    assert f"{server.url} already serves version {VERSION} with other weights" in error, error
    assert "new_run=True" in error, error
    assert _served(server.url) == (version, served), "the refused publish changed the served weights"

    again = _run(server.url, 1, transport, extra, watch)  # the first weights again: a safe retry
    assert again["ok"] and again["retried"], again
    assert again["own"] == first["own"]
    assert _served(server.url) == (version, served)


@pytest.mark.parametrize("transport", ["broadcast", "colocated"])
def test_new_run_may_publish_the_served_version_with_other_weights(server_factory, tiny_model_dir, transport):
    server = server_factory(model=tiny_model_dir)
    first = _run(server.url, 1, transport, {})
    assert first["ok"], first
    restarted = _run(server.url, 3, transport, {"new_run": True})
    assert restarted["ok"] and not restarted["retried"], restarted
    version, served = _served(server.url)
    assert version == str(VERSION) and _same(served, restarted["own"]) and not _same(served, first["own"])


def test_the_served_digest_does_not_depend_on_the_sharding():
    """Row shards of any number of ranks (FSDP2's ``torch.chunk`` rows) add up to the whole tensor's digest, as
    the reference server takes it; one bit flipped anywhere, or another tensor name, gives another digest."""
    import torch

    from bridge.digest import DIGEST_BLOCK, served_digest_part

    rows, cols = 1000, DIGEST_BLOCK // 3 + 7  # shards start inside blocks, and a chunk spans many blocks
    full = torch.randn(rows, cols).to(torch.bfloat16)
    whole = served_digest_part("w", full.reshape(-1))
    for world in (1, 2, 3, 8):
        per = -(-rows // world)
        parts = [served_digest_part("w", full[r * per:(r + 1) * per].reshape(-1), r * per * cols) for r in range(world)]
        assert sum(parts) % (1 << 64) == whole, world
    for i in (0, 1, rows * cols // 2, rows * cols - 1):
        flipped = full.reshape(-1).clone()
        flipped.view(torch.int16)[i] ^= 1
        assert served_digest_part("w", flipped) != whole, i
    assert served_digest_part("v", full.reshape(-1)) != whole
