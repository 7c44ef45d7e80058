"""FP8 deltas end to end (``encoding="fp8_delta"``): 2 trainer ranks on the ``small`` preset publish into a reference
server started with ``--quantization fp8``, an AdamW step at lr 1e-6 before each publish. The delta's base is what
the server serves: the FP8 bytes and the fp32 block scales. After every publish each served tensor equals, bit for
bit, a quantization of the trainer's own weights written in tests/test_fp8.py (not the project's function); most
publishes are deltas, a small fraction of the FP8 full bytes; a server whose bytes (here: one block scale) are not
the delta's base refuses it, and the same publish sends an anchor, the FP8 full sync.

On ``small`` with 2 ranks the k/v projections (128 rows) are not whole 128-row blocks on each rank, so their scales
are agreed across the ranks: both paths of the encoding run here."""

from __future__ import annotations

import base64
import json
import os

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.test_fp8 import FP8, _expected

pytestmark = pytest.mark.slow

TAMPERED = "model.layers.3.mlp.down_proj.weight_scale_inv"
VERSIONS = 7
MOVE_AT = 4  # before this version's publish, rank 1 raises the absmax of a block it shares with rank 0 (MOVED)
MOVED = "model.layers.0.self_attn.k_proj.weight"  # 128 rows: 64 on each rank, one row of 128x128 blocks
TAMPER_AT = 6  # before this version's publish, the server's bytes of TAMPERED change under the served label


def _step(engine, v: int) -> None:
    """One AdamW step at lr 1e-6 on 2 random sequences of 64 tokens per rank (as wsync bench)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-6
    ids = torch.randint(3, engine.model_config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(100 * v + engine.rank))
    engine.train_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


@torch.no_grad()
def _move_a_shared_scale(engine) -> None:
    """Rank 1: one element of its rows of MOVED, in the first block, set to 0.5 (far above every weight): the
    block's scale moves, and with it the FP8 bytes of rank 0's rows of that block, which did not change."""
    sh = next(s for s in engine.local_shards(engine.param_specs()) if s.spec.name == MOVED)
    sh.local.view(-1, sh.spec.shape[1])[3, 5] = 0.5


def _tamper(url: str, version: int) -> None:
    """Rank 0: the served scales of TAMPERED doubled, under the served label (one shared-memory bucket)."""
    from bridge.client import ServerClient
    from bridge.transports.colocated import shm_buffer

    c = ServerClient(url)
    got = c.weights_spec()["params"][TAMPERED]
    t = torch.full(got["shape"], 0.5, dtype=torch.float32)
    buf, path = shm_buffer(t.numel() * 4, 0)
    buf.copy_(t.reshape(-1).view(torch.uint8))
    entry = base64.b64encode(json.dumps({"path": path, "nbytes": t.numel() * 4, "names": [TAMPERED], "dtypes": ["float32"],
                                         "shapes": [got["shape"]]}).encode()).decode()
    try:
        c.begin_weight_update()
        c.update_weights_from_tensor([entry], load_format="wsync_shm", weight_version=str(version))
        c.end_weight_update()
    finally:
        os.unlink(path)


def _exact(engine, url: str) -> list[str]:
    """Collective; rank 0: the served tensors that differ from an independent quantization of the trainer's."""
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    full = {s.name: t for s, t in engine.iter_full_tensors()}
    if engine.rank != 0:
        return []
    want = _expected(full)
    got = ServerClient(url).weights_checksum(list(want))["checksums"]
    return [n for n, t in want.items() if got.get(n) != tensor_checksum(t)]


def _publish(url: str) -> list[dict]:
    from bridge import PublisherConfig, WeightPublisher
    from tests.test_delta import without_cost_model
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    without_cost_model()  # the FP8 delta's path and its anchors are the point
    engine = FSDPEngine(EngineConfig(preset="small", optimizer=OptimizerConfig(lr=1e-6)))
    engine.initialize()
    pub = WeightPublisher(PublisherConfig(transport="broadcast", servers=[url], bucket_mb=8, encoding="fp8_delta",
                                          group_timeout=60, http_timeout=60, progress=False))
    rows = []
    try:
        for v in range(1, VERSIONS + 1):
            if v > 1:
                _step(engine, v)
            if v == MOVE_AT and engine.rank == 1:
                _move_a_shared_scale(engine)
            if v == TAMPER_AT and engine.rank == 0:
                _tamper(url, v - 1)
            res = pub.publish(engine, version=v)
            rows.append(dict(version=v, encoding=res.encoding, reason=res.anchor_reason, bytes=res.bytes,
                             changed=res.changed_fraction, base_bytes=res.base_bytes, differ=_exact(engine, url)))
    finally:
        pub.close()
        engine.destroy()
    return rows


@pytest.fixture(scope="module")
def small_fp8_server(server_factory):
    return server_factory(preset="small", extra_args=FP8)


def test_fp8_deltas_are_bit_exact_small_and_a_base_mismatch_sends_an_anchor(small_fp8_server):
    rows, _ = run_ranks(_publish, 2, args=(small_fp8_server.url,), timeout=600)
    sent = [(r["version"], r["encoding"], r["reason"]) for r in rows]
    for r in rows:
        assert r["differ"] == [], f"v{r['version']}: served tensors differ from the quantized trainer: {r['differ'][:5]}"
    assert rows[0]["encoding"] == "anchor" and rows[0]["reason"] == "no base yet", sent
    full = rows[0]["bytes"]  # the FP8 full sync's bytes
    moved, tampered = rows[MOVE_AT - 1], rows[TAMPER_AT - 1]
    # The ranks agree the scales of MOVED from each one's block absmax: they moved, so the FP8 full sync goes.
    assert moved["encoding"] == "anchor" and "block scales" in moved["reason"] and MOVED in moved["reason"], sent
    assert tampered["encoding"] == "anchor" and "not the delta's base" in tampered["reason"], sent
    others = [r for r in rows[1:] if r["version"] not in (MOVE_AT, TAMPER_AT)]
    for r in others:  # a delta, or the full sync where the measured costs say it is as fast (delta_cost)
        assert r["encoding"] == "delta" or "delta_cost" in r["reason"], sent
    deltas = [r for r in others if r["encoding"] == "delta"]
    assert len(deltas) >= 3, f"most publishes must be deltas: {sent}"
    fractions = [r["bytes"] / full for r in deltas]
    print(f"\nFP8 full sync {full / 1e6:.2f} MB; FP8 deltas: " + ", ".join(f"{f:.2%}" for f in fractions)
          + " of it; changed: " + ", ".join(f"{r['changed']:.2%}" for r in deltas))
    assert max(fractions) <= 0.05, sent
    # Each rank's base: its FP8 bytes (1 per quantized element) and scales, under 2 bytes per parameter.
    assert 0 < rows[-1]["base_bytes"] < 48_402_944, rows[-1]


def _tiny_anchor_every(url: str) -> list[dict]:
    """Every rank: tiny (every projection's rows shared by the 2 ranks: agreed scales), anchors every 3 versions
    (decided before the diff: the base is requantized with the agreed scales beside the transfer); v3 fails once
    in its first delta bucket first (its base changes are undone, so v3 is a delta again); v6 published
    twice with the same weights (a retry, told safe from the FP8 base), then again after a step (refused)."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import SyncError, VersionError
    from tests.test_delta import without_cost_model
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    without_cost_model()  # which versions are anchors, and the failure inside a delta bucket, are the point
    engine = FSDPEngine(EngineConfig(preset="tiny", optimizer=OptimizerConfig(lr=1e-6)))
    engine.initialize()
    pub = WeightPublisher(PublisherConfig(transport="broadcast", servers=[url], bucket_mb=0.1, encoding="fp8_delta",
                                          delta_anchor_every=3, group_timeout=30, http_timeout=30, progress=False))
    rows = []
    try:
        for v in range(1, 7):
            if v > 1:
                _step(engine, v)
            if v == 3:  # a delta that fails on rank 1 in its first bucket: every rank's FP8 base is put back
                os.environ["WSYNC_FAILPOINTS"] = "delta:0@1"
                with pytest.raises(SyncError):
                    pub.publish(engine, version=v)
                del os.environ["WSYNC_FAILPOINTS"]
            res = pub.publish(engine, version=v)
            rows.append(dict(version=v, encoding=res.encoding, reason=res.anchor_reason, differ=_exact(engine, url)))
        rows.append(dict(retried=pub.publish(engine, version=6).retried))
        _step(engine, 7)
        with pytest.raises(VersionError, match="different weights"):
            pub.publish(engine, version=6)
    finally:
        pub.close()
        engine.destroy()
    return rows


def test_fp8_anchors_every_n_and_a_retry_on_tiny(server_factory):
    srv = server_factory(extra_args=FP8)
    rows, _ = run_ranks(_tiny_anchor_every, 2, args=(srv.url,), timeout=300)
    *rows, retry = rows
    sent = [(r["version"], r["encoding"], r["reason"]) for r in rows]
    assert all(r["differ"] == [] for r in rows), [(r["version"], r["differ"][:3]) for r in rows]
    assert rows[0]["reason"] == "no base yet" and "every 3 versions" in rows[3]["reason"], sent
    for r in rows[1:3] + rows[4:]:  # a delta, or an anchor the measured costs or moved agreed scales chose
        assert r["encoding"] == "delta" or "delta_cost" in r["reason"] or "block scales" in r["reason"], sent
    assert any(r["encoding"] == "delta" for r in rows[4:]), sent  # a delta on the base the early anchor refreshed
    assert retry == {"retried": True}
