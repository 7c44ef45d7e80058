"""The delta encoding (``PublisherConfig(encoding="delta")``) end to end, into reference-server processes.

The oracle is the trainer itself, as in the broadcast tests: after every publish each served tensor is
bit-equal to the trainer's own weights cast to bf16. A server's refusal of a delta whose base it does not
serve is checked first on its own (a delta bucket handed over by hand, the served bytes compared before
and after), then through the publisher, which answers with an anchor.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys

import pytest
import torch

from bridge.client import ServerClient
from bridge.codecs.delta import DELTA_TENSOR, changed_positions, choose, write_record
from bridge.codecs.pieces import combine_digest, piece_crc
from bridge.digest import tensor_checksum
from bridge.errors import ServerError
from bridge.protocol import DELTA_BASE_MISMATCH
from bridge.transports.colocated import shm_buffer
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory(model=tiny_model_dir)


# ------------------------------------------------------------------ a delta bucket by hand (the shm path)


def _put(c: ServerClient, named: dict[str, torch.Tensor], version: str, table: dict | None = None) -> dict:
    """One session with one shared-memory bucket: whole tensors, or (``table``) a delta bucket."""
    if table is None:
        data = torch.cat([t.reshape(-1).view(torch.uint8) for t in named.values()])
        fields = {"names": list(named), "dtypes": ["bfloat16"] * len(named), "shapes": [list(t.shape) for t in named.values()]}
    else:
        data = named[DELTA_TENSOR]
        fields = {"names": [DELTA_TENSOR], "dtypes": ["uint8"], "shapes": [[data.numel()]], "wsync_delta": table}
    with _shm_entry(data, fields) as entry:
        c.begin_weight_update()
        c.update_weights_from_tensor([entry], load_format="wsync_shm", weight_version=version)  # a refusal ends the session
        return c.end_weight_update()


@contextlib.contextmanager
def _shm_entry(data: torch.Tensor, fields: dict):
    """A ``wsync_shm`` entry carrying ``data`` (uint8) in a shared-memory file, removed afterwards (later tests
    check that this process leaves no such file)."""
    buf, path = shm_buffer(data.numel(), 0)
    buf.copy_(data)
    try:
        yield base64.b64encode(json.dumps({"path": path, "nbytes": data.numel(), **fields}).encode()).decode()
    finally:
        os.unlink(path)


def _delta_of(name: str, old: torch.Tensor, new: torch.Tensor, base_version: str, digest: int) -> tuple[dict, dict]:
    flat_old, flat_new = old.reshape(-1), new.reshape(-1)
    count = int((flat_old.view(torch.int16) != flat_new.view(torch.int16)).sum())
    kind, nbytes = choose(flat_new.numel(), count, 2)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    write_record(out, 0, kind, 0, flat_new, changed_positions(flat_new, flat_old, kind) if kind != 4 else None, count)
    table = {"base_version": base_version, "base_digest": digest, "world": 1, "whole": [], "names": [name],
             "dtypes": ["bfloat16"], "shapes": [list(new.shape)]}
    return {DELTA_TENSOR: out}, table


def _shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "torch-only"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_the_diff_finds_exactly_the_elements_whose_bits_changed(dtype, numpy, monkeypatch):
    """The encoder compares a word (8 bytes) at a time, then the elements of the words that differ: it must find
    exactly the elements whose bits differ (-0.0 against 0.0 and a NaN's payload included, at both ends, in a
    length the words do not cover, in a view that does not start on a word), with numpy (the CPU's path) and
    with torch alone (the GPU's path, and the loader's where numpy is missing)."""
    from bridge.encodings.delta import DeltaEncoding

    if not numpy:
        monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError

    enc = DeltaEncoding.__new__(DeltaEncoding)
    enc._buffers = {}
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    g = torch.Generator().manual_seed(7)
    for n in (1, 3, 4, 8, 4099, 10_000):
        base = torch.randint(0, 120, (n + 1,), generator=g, dtype=torch.int32).to(torch.uint8 if dtype == torch.uint8
                                                                                   else torch.int8).to(dtype)
        for offset in (0, 1):
            old = base[offset:offset + n] if offset + n <= base.numel() else base[:n]
            new = old.clone()
            flip = torch.rand(n, generator=g) < 0.05
            flip[0] = flip[-1] = True
            bits = new.view(ints)
            bits[flip] ^= 1  # the lowest bit: a value a float compare may call equal (0.0 / -0.0 is the sign bit)
            if dtype.is_floating_point and n > 4:
                new[1], old[1] = 0.0, -0.0  # equal as floats, different bits
                new[2], old[2] = float("nan"), float("nan")
                flip[1], flip[2] = True, False  # two NaNs of the same bits are no change
            want = torch.nonzero(new.view(ints) != old.view(ints)).squeeze(1)
            got = enc._changed(new, old, dtype.itemsize)
            assert torch.equal(got, want), (dtype, n, offset, got[:10], want[:10])


def test_a_delta_to_a_server_on_another_base_is_refused_before_any_weight_changes(server, tiny_model_dir):
    c = ServerClient(server.url)
    name = "model.layers.0.mlp.down_proj.weight"
    # Known bytes as version 100 (the base), and their digest as a trainer of one rank takes it.
    base = torch.randn(_shapes(tiny_model_dir)[name], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    _put(c, {name: base}, "100")
    digest = combine_digest([(name, 0, base.numel(), piece_crc(base.reshape(-1), 0, base.numel()))])
    new = base.clone()
    new.view(-1)[::97] += 1
    before = c.weights_checksum()

    for why, version, dig in (("another version", "99", digest), ("other bytes, same version", "100", digest ^ 1)):
        records, table = _delta_of(name, base, new, version, dig)
        with pytest.raises(ServerError) as e:
            _put(c, records, "101", table)
        assert e.value.reason == DELTA_BASE_MISMATCH, f"{why}: {e.value}"
        assert c.weights_checksum() == before, f"{why}: a refused delta changed the served weights or version"

    records, table = _delta_of(name, base, new, "100", digest)  # the right base: applied, bit-exact
    _put(c, records, "101", table)
    got = c.weights_checksum([name])
    assert got["weight_version"] == "101"
    assert got["checksums"][name] == tensor_checksum(new)


def test_the_server_applies_every_record_kind_bit_exact(server, tiny_model_dir):
    """One delta bucket by hand whose tensors each travel in another kind (gaps in 8 and 16 bits, with and
    without zstd, int positions, a bitmask, dense): the reference server serves the new bytes exactly."""
    from bridge.codecs.delta import BITMASK, DENSE, GAPS8, GAPS16, SPARSE32, ZSTD, encode_sparse

    c = ServerClient(server.url)
    shapes = _shapes(tiny_model_dir)
    names = sorted((n for n in shapes if len(shapes[n]) == 2), key=lambda n: -torch.Size(shapes[n]).numel())[:6]
    g = torch.Generator().manual_seed(5)
    base = {n: torch.randn(shapes[n], generator=g).to(torch.bfloat16) for n in names}
    _put(c, base, "300")
    digest = combine_digest([(n, 0, t.numel(), piece_crc(t.reshape(-1), 0, t.numel())) for n, t in base.items()])
    out, at, new, kinds = torch.zeros(1 << 22, dtype=torch.uint8), 0, {}, []
    plan = ((GAPS8, 100, False), (GAPS8 | ZSTD, 100, True), (GAPS16, 1000, False), (SPARSE32, 5000, False),
            (BITMASK, 3, False), (DENSE, 1, False))
    for i, (n, (want, every, zstd)) in enumerate(zip(names, plan)):
        a = base[n].reshape(-1)
        b = a.clone()
        b.view(torch.int16)[torch.arange(i, b.numel(), every)] ^= 3  # a small step's change: the low bits
        pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
        if want & ZSTD or want in (GAPS8, GAPS16):
            kind, body = encode_sparse(b.numel(), pos, b[pos], zstd=zstd)
            at += write_record(out[at:], i, kind, 0, b, None, pos.numel(), body=body)
        else:
            kind = want
            at += write_record(out[at:], i, kind, 0, b, changed_positions(b, a, kind) if kind != DENSE else None,
                               pos.numel())
        kinds.append(kind)
        new[n] = b.view(base[n].shape)
    assert kinds == [k for k, _, _ in plan], kinds
    table = {"base_version": "300", "base_digest": digest, "world": 1, "whole": [], "names": names,
             "dtypes": ["bfloat16"] * len(names), "shapes": [list(shapes[n]) for n in names]}
    _put(c, {DELTA_TENSOR: out[:at].clone()}, "301", table)
    got = c.weights_checksum(names)
    assert got["weight_version"] == "301"
    assert got["checksums"] == {n: tensor_checksum(t) for n, t in new.items()}


# ------------------------------------------------------------------ through the publisher, on 2 trainer ranks


def _engine(lr: float):
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    e = FSDPEngine(EngineConfig(preset="tiny", optimizer=OptimizerConfig(lr=lr)))
    e.initialize()
    return e


def without_cost_model() -> None:
    """In this rank's process: the delta's measured costs never send a full sync instead of a delta. For the tests whose
    point is the delta's path, not which sync is faster here (on 2 loaded cores a loopback delta of the tiny model can
    cost about what its full sync does). The cost model is tested on its own (``tests/test_delta_codec.py``) and in
    ``test_at_lr_1e6_a_delta_moves_at_most_3_percent``."""
    from bridge.encodings.delta import DeltaEncoding

    DeltaEncoding._costlier_than_full = lambda self, *a, **k: None


def _publisher(transport: str, urls: list[str], **kw):
    from bridge import PublisherConfig, WeightPublisher

    kw.setdefault("delta_max_fraction", 0.5)  # lr 1e-5 changes about a quarter of the tiny model's elements
    kw.setdefault("delta_zstd", "on")  # the stage auto leaves to slow links: its records go through the server too
    return WeightPublisher(PublisherConfig(transport=transport, servers=urls, bucket_mb=0.25, encoding="delta",
                                           group_timeout=20, http_timeout=20, progress=False, **kw))


def _row(engine, urls: list[str], res) -> dict:
    """Collective: what ``res`` reports, and (rank 0) whether every server serves the trainer's own bytes."""
    from tests import sync_bodies as sb

    own = sb.own_checksums(engine)
    equal = None
    if engine.rank == 0:
        equal = {u: ServerClient(u).weights_checksum(list(own)) == {"weight_version": str(res.version), "checksums": own,
                                                                   "dtypes": {n: "bfloat16" for n in own}}
                 for u in urls}
    shard = sum(s.local.numel() for s in engine.local_shards(engine.param_specs()) if s.local is not None)
    return dict(version=res.version, encoding=res.encoding, reason=res.anchor_reason, bytes=res.bytes,
                full=None, changed=res.changed_fraction, base_bytes=res.base_bytes, shard=shard,
                peak=res.peak_extra_bytes, equal=equal)


def _twenty_deltas(urls: list[str], transport: str, publishes: int):
    from tests import sync_bodies as sb

    without_cost_model()
    engine = _engine(1e-5)
    pub = _publisher(transport, urls)
    rows = []
    try:
        for v in range(1, publishes + 1):
            sb.train_step(engine, v)
            rows.append(_row(engine, urls, pub.publish(engine, version=v)))
        final = sb.check_served(engine, urls, publishes)
    finally:
        pub.close()
        engine.destroy()
    return rows, final


@pytest.mark.parametrize("transport,publishes", [("broadcast", 21)])
def test_consecutive_delta_publishes_with_training_between_are_bit_exact(server, transport, publishes):
    (rows, final), (rows1, _) = run_ranks(_twenty_deltas, 2, args=([server.url], transport, publishes), timeout=400)
    assert [r["encoding"] for r in rows] == ["anchor"] + ["delta"] * (publishes - 1), rows
    assert rows[0]["reason"] == "no base yet"
    for r in rows:
        assert r["equal"] == {server.url: True}, f"v{r['version']}: the served tensors are not the trainer's"
    for r in rows[1:]:  # (the v1 anchor is a full sync: test_broadcast.py bounds its memory, at a real bucket size)
        assert r["peak"] <= 2.5 * 0.25 * 2**20, f"v{r['version']}: rank 0 held {r['peak']} bytes"
        assert 0 < r["changed"] < 1 and r["bytes"] < rows[0]["bytes"] / 2, r
    for rank_rows in (rows, rows1):  # each rank's base: its shard in bf16, 2 bytes per parameter
        assert all(r["base_bytes"] == 2 * r["shard"] for r in rank_rows), rank_rows[-1]
    assert final[server.url]["tensors_equal"] and final[server.url]["answer_equal"], final


def _restart_tamper_fail(url: str, pid: int, model_dir: str):
    """Every rank: v1 (anchor), v2 (delta); the server restarted (v3: an anchor, the fleet took it out of
    rotation); v4 (delta); the server's bytes changed behind the publisher's back under the same label (v5:
    refused delta, then an anchor); v6 fails in the middle of a delta bucket on rank 1, v6 again fails at
    settle on rank 1, v6 then succeeds."""
    import os
    import signal
    from urllib.parse import urlparse

    from bridge.errors import SyncError
    from inference_adapter.launcher import launch_server
    from tests import sync_bodies as sb

    without_cost_model()  # failures inside a delta's bucket are the point (once the costs sent a full sync instead)
    engine = _engine(1e-5)
    # Colocated (broadcast's delta syncs are tested above; a restarted server's new group under broadcast is
    # tests/test_broadcast.py's): the encoding's choices are the same on both.
    pub = _publisher("colocated", [url])
    restarted, rows, failures = None, [], []
    try:
        for v in (1, 2, 3, 4, 5, 6):
            sb.train_step(engine, v)
            if v == 3 and engine.rank == 0:  # a restarted server serves its checkpoint again
                os.kill(pid, signal.SIGKILL)
                restarted = launch_server(model=model_dir, port=urlparse(url).port, extra_args=[
                    "--allow-version-rollback", "--group-timeout", "20"], env={"OMP_NUM_THREADS": "1"})
            if v == 5 and engine.rank == 0:  # other bytes under the served label
                name = "model.layers.1.mlp.up_proj.weight"
                c = ServerClient(url)
                shape = {s.name: s.shape for s in engine.param_specs()}[name]
                _put(c, {name: torch.zeros(shape, dtype=torch.bfloat16)}, "4")
            if v == 6:
                was = ServerClient(url).weights_checksum()["checksums"] if engine.rank == 0 else None  # v5's
                for point in ("delta:0@1", "settle@1"):
                    os.environ["WSYNC_FAILPOINTS"] = point
                    try:
                        pub.publish(engine, version=6)
                    except SyncError as e:
                        failures.append((point, str(e), sb.serving_now(url) if engine.rank == 0 else None, was))
                    finally:
                        del os.environ["WSYNC_FAILPOINTS"]
            rows.append(_row(engine, [url], pub.publish(engine, version=v)))
    finally:
        pub.close()
        engine.destroy()
        if restarted is not None:
            restarted.stop()
    return rows, failures


def test_restarted_server_refused_delta_and_failed_delta_sync(server_factory, tiny_model_dir):
    from tests import sync_bodies as sb

    srv = server_factory(model=tiny_model_dir)
    (rows, failures), (rows1, failures1) = run_ranks(_restart_tamper_fail, 2, args=(srv.url, srv.process.pid, tiny_model_dir),
                                                     timeout=400)
    # Each failed v6 raised on both ranks and left the server on v5, unpaused, with no session open, serving
    # exactly what it served (checked first: otherwise it shows only later, as the next delta refused for its
    # base); the base stayed at v5, so the next publish was a delta, bit-exact.
    assert [f[0] for f in failures] == [f[0] for f in failures1] == ["delta:0@1", "settle@1"]
    for point, _, now, was in failures:
        assert now["version"] == "5" and now["paused"] is False and now["session_open"] is False, (point, now)
        assert now["checksums"] == was, f"{point}: the failed sync changed the served weights"
        sb.assert_resumed(now, point)
    got = [(r["version"], r["encoding"]) for r in rows]
    assert got == [(1, "anchor"), (2, "delta"), (3, "anchor"), (4, "delta"), (5, "anchor"), (6, "delta")], rows
    # The fleet finds the restarted server on another version before anything moves (it is out of rotation
    # until this anchor repairs it), so no delta is sent to it first.
    assert "out of rotation" in rows[2]["reason"] and "behind the fleet's 2" in rows[2]["reason"], rows[2]
    assert "refused the delta" in rows[4]["reason"] and "not the delta's base" in rows[4]["reason"], rows[4]
    assert all(r["equal"] == {srv.url: True} for r in rows), rows


def _held_then_repaired(urls: list[str]):
    """Every rank: v1 (anchor), v2 (delta); v3 commits on the first server and fails on the second, which the
    fleet holds paused and out of rotation on v2; v4 must repair it: an anchor to both; v5 a delta again."""
    import os

    from bridge.failpoints import ENV
    from tests import sync_bodies as sb

    engine = _engine(1e-5)
    pub = _publisher("broadcast", urls)
    rows, held = [], None
    try:
        for v in range(1, 6):
            sb.train_step(engine, v)
            if v == 3:
                os.environ[ENV] = "commit:1@0=RuntimeError"
            try:
                res = pub.publish(engine, version=v)
            finally:
                os.environ.pop(ENV, None)
            if v == 3:
                held = res.servers
            rows.append(_row(engine, urls, res))
    finally:
        pub.close()
        engine.destroy()
    return rows, held


def test_a_server_held_after_a_failed_commit_is_repaired_by_an_anchor(server_factory, tiny_model_dir):
    """The publish after a commit that failed on one of two servers sends every tensor (an anchor naming the
    held server), not a delta against the version that server never took; both then serve the trainer's bytes."""
    a, b = server_factory.many([dict(model=tiny_model_dir)] * 2)
    [(rows, held)] = run_ranks(_held_then_repaired, 1, args=([a.url, b.url],), timeout=300)
    got = [(r["version"], r["encoding"]) for r in rows]
    assert got == [(1, "anchor"), (2, "delta"), (3, "delta"), (4, "anchor"), (5, "delta")], rows
    assert held[a.url] == "ok" and held[b.url].startswith("failed: commit failed"), held
    assert rows[2]["equal"] == {a.url: True, b.url: False}, rows[2]  # b stayed on v2, paused
    # Decided before anything moved (no delta sent to b first, refused, then retried as an anchor).
    assert rows[3]["reason"].startswith("out of rotation until a full sync repairs it: " + b.url), rows[3]
    assert all(r["equal"] == {a.url: True, b.url: True} for r in rows[3:]), rows


def test_wsync_train_encoding_delta(server):
    import subprocess
    import sys

    def wsync(*args):
        return subprocess.run([sys.executable, "-m", "wsync", "train", *args], capture_output=True, text=True, timeout=300)

    refused = wsync("--publish", "disk", "--encoding", "delta", "--server", server.url)
    assert refused.returncode == 2 and "broadcast or colocated" in refused.stderr.strip().splitlines()[-1], refused.stderr
    out = wsync("--nproc", "1", "--steps", "3", "--lr", "1e-5", "--publish", "broadcast", "--encoding", "delta",
                "--delta-max-fraction", "0.5", "--server", server.url)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if "published" in ln]
    assert len(lines) == 3 and "anchor (no base yet)" in lines[0], out.stdout
    assert all(ln.endswith(" delta") for ln in lines[1:]), out.stdout


def test_a_staged_delta_is_not_applied_on_bytes_that_changed_after_its_base_was_checked(server, tiny_model_dir):
    """A delta staged in a session, then a disk load outside the session: end_weight_update applies nothing
    (the delta's base is gone) and says so; the disk load's bytes stay served."""
    c = ServerClient(server.url)
    name = "model.layers.0.mlp.gate_proj.weight"
    base = torch.randn(_shapes(tiny_model_dir)[name], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _put(c, {name: base}, "200")
    digest = combine_digest([(name, 0, base.numel(), piece_crc(base.reshape(-1), 0, base.numel()))])
    new = base.clone()
    new.view(-1)[::7] += 1
    records, table = _delta_of(name, base, new, "200", digest)
    data = records[DELTA_TENSOR]
    with _shm_entry(data, {"names": [DELTA_TENSOR], "dtypes": ["uint8"], "shapes": [[data.numel()]],
                           "wsync_delta": table}) as entry:
        c.begin_weight_update()
        c.update_weights_from_tensor([entry], load_format="wsync_shm", weight_version="201")
    c.update_weights_from_disk(tiny_model_dir, weight_version="300")
    loaded = c.weights_checksum()
    with pytest.raises(ServerError, match="changed after the delta's base was checked"):
        c.end_weight_update()
    assert c.weights_checksum() == loaded


def _anchors_decided_early(url: str):
    """Every rank: anchors every 3 versions (decided before diffing; the base copied beside the transfer), then
    a publisher whose delta_max_fraction is below what one step changes (its rank estimates it from a sample);
    v7 fails once at settle first (the half-copied base is dropped: v7 is then an anchor with no base). v4 (an
    early anchor) and v5 (a delta) are published twice with the same weights: safe retries (the second v5 an
    early anchor); v5 again after a step: refused."""
    import os

    from bridge.errors import SyncError, VersionError
    from tests import sync_bodies as sb

    without_cost_model()  # which versions are anchors is the point (once the costs sent v3 in full)
    engine = _engine(1e-5)
    rows, retried = [], []
    for kw, versions in (({"delta_anchor_every": 3}, range(1, 6)), ({"delta_max_fraction": 0.01}, range(6, 9))):
        pub = _publisher("broadcast", [url], **kw)
        try:
            for v in versions:
                sb.train_step(engine, v)
                if v == 7:
                    os.environ["WSYNC_FAILPOINTS"] = "settle@1"
                    with pytest.raises(SyncError):
                        pub.publish(engine, version=v)
                    del os.environ["WSYNC_FAILPOINTS"]
                rows.append(_row(engine, [url], pub.publish(engine, version=v)))
                if v in (4, 5):
                    retried.append(pub.publish(engine, version=v).retried)
            sb.train_step(engine, 50)
            with pytest.raises(VersionError, match="different weights"):
                pub.publish(engine, version=versions[-1])
        finally:
            pub.close()
    engine.destroy()
    return rows, retried


def test_anchors_decided_before_the_diff_refresh_the_base(server):
    (rows, retried), _ = run_ranks(_anchors_decided_early, 2, args=(server.url,), timeout=400)
    assert retried == [True, True]
    got = [(r["version"], r["encoding"]) for r in rows]
    assert got == [(1, "anchor"), (2, "delta"), (3, "delta"), (4, "anchor"), (5, "delta"),
                   (6, "anchor"), (7, "anchor"), (8, "anchor")], rows  # (6: a new publisher, no base yet)
    assert "every 3 versions" in rows[3]["reason"] and "from a sample" in rows[7]["reason"], rows
    assert rows[6]["reason"] == "no base yet", rows[6]  # v7 after its failed try
    assert all(r["equal"] == {server.url: True} for r in rows), rows  # v5: a delta on the base refreshed at v4


def _at_lr_1e6(url: str, preset: str):
    """Every rank: ``preset``, an anchor, 5 warm-up steps at lr 1e-6 (each published), then 3 steps at lr 1e-6
    and one at 1e-5, each published; what each publish sent, and whether the server serves the trainer's bytes."""
    from bridge import PublisherConfig, WeightPublisher
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    engine = FSDPEngine(EngineConfig(preset=preset, optimizer=OptimizerConfig(lr=1e-6)))
    engine.initialize()
    pub = WeightPublisher(PublisherConfig(transport="broadcast", servers=[url], bucket_mb=32, encoding="delta",
                                          group_timeout=60, http_timeout=60, progress=False))
    rows = []
    try:
        for v, lr in enumerate([None] + [1e-6] * 8 + [1e-5], start=1):
            if lr is not None:  # one AdamW step on 2 random sequences of 64 tokens per rank (as wsync bench)
                for group in engine.optimizer.param_groups:
                    group["lr"] = lr
                ids = torch.randint(3, engine.model_config.vocab_size, (2, 64),
                                    generator=torch.Generator().manual_seed(100 * v + engine.rank))
                engine.train_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
            res = pub.publish(engine, version=v)
            rows.append(dict(version=v, lr=lr, encoding=res.encoding, reason=res.anchor_reason, bytes=res.bytes,
                             changed=res.changed_fraction))
        from tests import sync_bodies as sb

        final = sb.check_served(engine, [url], len(rows))
    finally:
        pub.close()
        engine.destroy()
    return rows, final


def test_at_lr_1e6_a_delta_moves_at_most_3_percent(server_factory):
    """Issue 36: on preset many (Qwen2.5-7B's 339 tensors at 1/14 of its width; the bench measures small and medium),
    after 5 warm-up steps at lr 1e-6, every delta moves at most 3 % of the full
    bytes and nothing but a delta goes unless the measured costs say the full sync is as fast (on loopback
    with 2 shared cores the diff costs about what the full sync does, so that can happen; over a link it does
    not: docs/benchmark.md); never the fixed fraction. At lr 1e-5 what goes is a delta, or an anchor the
    measured costs chose. The server ends bit-exact."""
    srv = server_factory(preset="many")
    (rows, final), _ = run_ranks(_at_lr_1e6, 2, args=(srv.url, "many"), timeout=600)
    full, sent = rows[0]["bytes"], [(r["version"], r["encoding"], r["reason"]) for r in rows]
    assert rows[0]["encoding"] == "anchor", rows[0]
    measured = rows[6:9]
    # Deltas go (beside two CPU-bound processes the diff cost about what the full sync did, and the measured costs
    # sent the full sync for all three measured versions once, after deltas for versions 2-4: a choice the test
    # allows for each of them below, so it cannot demand a delta among those three alone).
    assert any(r["encoding"] == "delta" for r in rows[1:9]), sent
    for r in measured:
        # (the target is 5 %; int32 positions + values took 4.1 % here, gaps + zstd take about 2 %)
        assert r["bytes"] <= 0.03 * full if r["encoding"] == "delta" else "delta_cost" in r["reason"], (sent, r, full)
    last = rows[9]
    assert last["encoding"] == "delta" or "delta_cost" in last["reason"], last
    assert final[srv.url]["tensors_equal"], final
