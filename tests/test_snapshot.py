"""Snapshots: atomic HF directories with a manifest. The file and manifest formats are pinned here."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import time
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from bridge.errors import ConfigError, SnapshotError
from bridge.snapshot import (
    MANIFEST_NAME,
    SnapshotWriter,
    gc_snapshots,
    list_snapshots,
    read_manifest,
    read_snapshot,
    snapshot_dir,
    verify_snapshot,
    write_snapshot,
)


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset's model: the oracle tensors, config, generation config and tokenizer."""
    from bridge.local.presets import build_model, build_tokenizer

    model = build_model("tiny", seed=1)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}, build_tokenizer()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _leftovers(root) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(".")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, tiny, dtype):
    model, sd, tok = tiny
    info = write_snapshot(tmp_path, 7, sd.items(), config=model.config, tokenizer=tok,
                          generation_config=model.generation_config, dtype=dtype)
    assert info.path == snapshot_dir(tmp_path, 7) == str(tmp_path / "v7")
    assert list_snapshots(tmp_path) == [7] and _leftovers(tmp_path) == []
    back = read_snapshot(info.path)
    assert list(sorted(back)) == sorted(sd)
    for name, t in sd.items():
        assert back[name].dtype == dtype and back[name].shape == t.shape
        assert torch.equal(_bits(back[name]), _bits(t.to(dtype))), name


def test_snapshot_loads_as_hf_model(tmp_path, tiny):
    import transformers

    model, sd, tok = tiny
    info = write_snapshot(tmp_path, 1, sd.items(), config=model.config, tokenizer=tok,
                          generation_config=model.generation_config, max_shard_bytes=300_000)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(info.path)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, sd[name]), name
    assert transformers.AutoTokenizer.from_pretrained(info.path).decode(tok("wsync")["input_ids"]) == "wsync"


def test_sharding_with_index(tmp_path):
    tensors = [(f"layer{i}.w", torch.randn(100, 50)) for i in range(5)]  # 20 kB each
    info = write_snapshot(tmp_path, 0, tensors, max_shard_bytes=45_000)
    files = sorted(f for f in os.listdir(info.path) if f.endswith(".safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with open(os.path.join(info.path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == 5 * 100 * 50 * 4
    assert set(index["weight_map"]) == {n for n, _ in tensors}
    for fname in files:  # every shard holds what the index says, read by safetensors itself
        with safe_open(os.path.join(info.path, fname), "pt") as f:
            assert set(f.keys()) == {n for n, v in index["weight_map"].items() if v == fname}
    back = read_snapshot(info.path)
    assert all(torch.equal(back[n], t) for n, t in tensors)


def test_single_shard_has_no_index(tmp_path):
    info = write_snapshot(tmp_path, 0, [("a", torch.ones(3))])
    assert sorted(os.listdir(info.path)) == ["model.safetensors", MANIFEST_NAME]


def test_shard_bytes_match_safetensors_reference_serializer(tmp_path):
    # Golden: a shard is exactly what safetensors.torch.save writes for the same tensors.
    tensors = {"z.w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a.b": torch.tensor([1.5, -2.0]).bfloat16(),
               "m.i": torch.tensor([3], dtype=torch.int64), "flag": torch.tensor([True, False])}
    info = write_snapshot(tmp_path, 0, tensors.items())
    with open(os.path.join(info.path, "model.safetensors"), "rb") as f:
        assert f.read() == save(tensors, metadata={"format": "pt"})


def _write_shard_in_a_process(path, tensors):
    from bridge.snapshot import write_shard

    return write_shard(path, tensors)


def test_shards_written_by_other_processes_make_the_same_snapshot(tmp_path, tiny):
    """What disk_writers="all" does: each shard written by its own process straight under its final name
    into the writer's temporary directory, recorded with add_shard. Every file, the index and the manifest
    (but its write time) are byte-identical to the streaming writer's with the same shard boundaries, and
    a missing or truncated shard fails the snapshot and removes the directory."""
    import multiprocessing as mp

    from bridge.snapshot import shard_name

    model, sd, tok = tiny
    items = [(n, t.to(torch.bfloat16)) for n, t in sd.items()]
    limit = 100_000  # the streaming writer closes a shard before a tensor that would not fit
    groups, size = [[]], 0
    for n, t in items:
        if groups[-1] and size + t.numel() * 2 > limit:
            groups.append([])
            size = 0
        groups[-1].append((n, t))
        size += t.numel() * 2
    assert len(groups) >= 3
    ref = write_snapshot(tmp_path / "ref", 0, items, config=model.config, tokenizer=tok, max_shard_bytes=limit)
    writer = SnapshotWriter(tmp_path / "new", 0, config=model.config, tokenizer=tok)
    with mp.get_context("spawn").Pool(2) as pool:
        entries = pool.starmap(_write_shard_in_a_process, [
            (os.path.join(writer.tmp_dir, shard_name(i, len(groups))), g) for i, g in enumerate(groups, 1)])
    for i, entry in reversed(list(enumerate(entries, 1))):  # any order
        writer.add_shard(shard_name(i, len(groups)), entry)
    info = writer.finish()
    verify_snapshot(info.path, info.manifest_sha256)
    assert sorted(os.listdir(info.path)) == sorted(os.listdir(ref.path))
    for fname in os.listdir(ref.path):
        with open(os.path.join(ref.path, fname), "rb") as a, open(os.path.join(info.path, fname), "rb") as b:
            if fname == MANIFEST_NAME:
                ma, mb = json.load(a), json.load(b)
                ma.pop("created_at"), mb.pop("created_at")
                assert ma == mb
            else:
                assert a.read() == b.read(), fname
    back = read_snapshot(info.path)
    assert all(torch.equal(_bits(back[n]), _bits(t)) for n, t in items)

    # A shard that is missing, or shorter than its writer reported: refused, nothing published.
    for damage in ("missing", "short"):
        writer = SnapshotWriter(tmp_path / damage, 1)
        paths = [os.path.join(writer.tmp_dir, shard_name(i, 2)) for i in (1, 2)]
        got = [_write_shard_in_a_process(p, g) for p, g in zip(paths, groups[:2])]
        if damage == "missing":
            os.unlink(paths[1])
        else:
            os.truncate(paths[1], got[1]["bytes"] - 1)
        writer.add_shard(shard_name(1, 2), got[0])
        with pytest.raises(SnapshotError, match=shard_name(2, 2)):
            writer.add_shard(shard_name(2, 2), got[1])
        assert list_snapshots(tmp_path / damage) == [] and _leftovers(tmp_path / damage) == []
    # Only some of the shards recorded: finish refuses to publish an incomplete set.
    writer = SnapshotWriter(tmp_path / "partial", 1)
    path = os.path.join(writer.tmp_dir, shard_name(2, 3))
    writer.add_shard(shard_name(2, 3), _write_shard_in_a_process(path, groups[0]))
    with pytest.raises(SnapshotError, match="complete snapshot"):
        writer.finish()
    assert list_snapshots(tmp_path / "partial") == [] and _leftovers(tmp_path / "partial") == []


def test_manifest_format_is_pinned(tmp_path):
    a, b = torch.arange(4, dtype=torch.float32), torch.ones(2, 3).bfloat16()
    info = write_snapshot(tmp_path, 5, [("a", a), ("b", b)], config={"model_type": "qwen2"})
    with open(os.path.join(info.path, MANIFEST_NAME), "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == info.manifest_sha256
    m = json.loads(raw)
    assert sorted(m) == ["checksum_algorithm", "created_at", "files", "format", "format_version", "tensor_bytes",
                         "tensors", "total_bytes", "version"]
    assert (m["format"], m["format_version"], m["checksum_algorithm"], m["version"]) == ("wsync-snapshot", 1, "crc32", 5)
    assert sorted(m["files"]) == ["config.json", "model.safetensors"]
    assert all(sorted(f) == ["bytes", "checksum"] for f in m["files"].values())
    assert m["tensors"] == {
        "a": {"file": "model.safetensors", "dtype": "float32", "shape": [4], "checksum": f"{zlib.crc32(_bits(a).numpy()):08x}"},
        "b": {"file": "model.safetensors", "dtype": "bfloat16", "shape": [2, 3],
              "checksum": f"{zlib.crc32(_bits(b).numpy()):08x}"},
    }
    for fname, entry in m["files"].items():
        with open(os.path.join(info.path, fname), "rb") as f:
            data = f.read()
        assert entry == {"bytes": len(data), "checksum": f"{zlib.crc32(data):08x}"}
    assert m["total_bytes"] == info.total_bytes == sum(e["bytes"] for e in m["files"].values())
    assert m["tensor_bytes"] == 16 + 12 and m["created_at"] == info.created_at
    assert read_manifest(info.path) == m


def test_truncated_file_is_named(tmp_path):
    info = write_snapshot(tmp_path, 0, [(f"w{i}", torch.randn(64)) for i in range(4)], max_shard_bytes=600)
    victim = os.path.join(info.path, "model-00002-of-00002.safetensors")
    os.truncate(victim, os.path.getsize(victim) - 10)
    with pytest.raises(SnapshotError, match=r"model-00002-of-00002\.safetensors has \d+ bytes.*truncated"):
        read_snapshot(info.path)


def test_corrupt_tensor_is_named(tmp_path):
    info = write_snapshot(tmp_path, 0, [("a", torch.zeros(64)), ("b", torch.zeros(64))])
    path = os.path.join(info.path, "model.safetensors")
    with open(path, "r+b") as f:  # flip one byte of the last tensor ("b" comes second by name)
        f.seek(os.path.getsize(path) - 1)
        f.write(b"\x01")
    for check in (verify_snapshot, read_snapshot):  # read_snapshot verifies the very bytes it loads
        with pytest.raises(SnapshotError, match=r"tensor 'b' in model\.safetensors has checksum .* manifest says"):
            check(info.path)
    read_snapshot(info.path, verify=False)  # unverified reads do not look


def test_altered_manifest_checksum_and_stale_announcement(tmp_path):
    info = write_snapshot(tmp_path, 0, [("a", torch.zeros(8))], config={"model_type": "qwen2"})
    mpath = os.path.join(info.path, MANIFEST_NAME)
    m = json.loads(open(mpath).read())
    m["files"]["config.json"]["checksum"] = "00000000"
    with open(mpath, "w") as f:
        json.dump(m, f)
    with pytest.raises(SnapshotError, match="announcement says"):
        verify_snapshot(info.path, info.manifest_sha256)
    with pytest.raises(SnapshotError, match="announcement says"):
        read_snapshot(info.path, expected_manifest_sha256=info.manifest_sha256)
    for check in (verify_snapshot, read_snapshot):
        with pytest.raises(SnapshotError, match=r"file config\.json has checksum"):
            check(info.path)


def _listing(path: str, name: str, size: int, checksum: str) -> None:
    """Add ``name`` to the manifest of the snapshot at ``path`` (a crafted manifest)."""
    mpath = os.path.join(path, MANIFEST_NAME)
    m = json.loads(open(mpath).read())
    m["files"][name] = {"bytes": size, "checksum": checksum}
    with open(mpath, "w") as f:
        json.dump(m, f)


def _within(seconds: float, fn, release) -> BaseException | None:
    """Run ``fn`` on a thread; the exception it raised (None if none). Fails if it takes longer than
    ``seconds`` (``release()`` then unblocks it, so the test does not hang)."""
    import threading

    box: list = []

    def run():
        try:
            fn()
            box.append(None)
        except BaseException as e:  # the caller asserts on it
            box.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        release()
        th.join(5)
        pytest.fail(f"blocked for more than {seconds} s")
    return box[0]


def test_every_manifest_entry_is_a_regular_file_opened_without_blocking(tmp_path):
    """A FIFO listed in the manifest (as a FIFO measures: 0 bytes, the empty checksum) is refused at once
    by the reader the watcher runs before real SGLang, instead of blocking until someone writes to it."""
    info = write_snapshot(tmp_path, 0, [("a", torch.zeros(8))])
    fifo = os.path.join(info.path, "notes.txt")
    os.mkfifo(fifo)
    _listing(info.path, "notes.txt", 0, "00000000")

    def release():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    for check in (verify_snapshot, read_snapshot):
        e = _within(1.0, lambda check=check: check(info.path), release)
        assert isinstance(e, SnapshotError) and "notes.txt" in str(e) and "not a regular file" in str(e), e


def test_a_manifest_entry_that_links_outside_is_refused_saying_nothing_of_its_target(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_bytes(b"SECRET-" + b"x" * 1230)
    info = write_snapshot(tmp_path / "root", 0, [("a", torch.zeros(8))])
    os.symlink(secret, os.path.join(info.path, "notes.txt"))
    crc = f"{zlib.crc32(secret.read_bytes()):08x}"
    for size in (1237, 1238):  # its true size, then a wrong one
        _listing(info.path, "notes.txt", size, crc)
        for check in (verify_snapshot, read_snapshot):
            with pytest.raises(SnapshotError, match="notes.txt.*leaves the snapshot") as e:
                check(info.path)
            for leak in (str(outside), "secret", "1237", crc):
                assert leak not in str(e.value), (leak, str(e.value))
    # A symlink that stays inside the snapshot is as good as the file it names.
    os.remove(os.path.join(info.path, "notes.txt"))
    (tmp_path / "root" / "v0" / "real.txt").write_bytes(b"inside")
    os.symlink("real.txt", os.path.join(info.path, "notes.txt"))
    _listing(info.path, "notes.txt", 6, f"{zlib.crc32(b'inside'):08x}")
    _listing(info.path, "real.txt", 6, f"{zlib.crc32(b'inside'):08x}")
    verify_snapshot(info.path)


def test_missing_dir_and_plain_hf_dir(tmp_path, tiny_model_dir):
    with pytest.raises(SnapshotError, match="does not exist"):
        read_snapshot(tmp_path / "nope")
    with pytest.raises(SnapshotError, match="does not exist"):
        verify_snapshot(tmp_path / "nope")
    plain = read_snapshot(tiny_model_dir)  # a HF dir without a manifest: read, not verified
    oracle = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert set(plain) == set(oracle) and all(torch.equal(plain[k], oracle[k]) for k in oracle)
    with pytest.raises(SnapshotError, match=f"no {MANIFEST_NAME}"):
        verify_snapshot(tiny_model_dir)


def test_incomplete_version_is_never_visible(tmp_path):
    seen = []

    def tensors():
        for i in range(4):
            yield f"w{i}", torch.randn(1000)
            seen.append((list_snapshots(tmp_path), os.path.exists(tmp_path / "v3"),
                         [len(os.listdir(tmp_path / d)) for d in os.listdir(tmp_path) if d.startswith(".tmp-v3-")]))

    write_snapshot(tmp_path, 3, tensors(), max_shard_bytes=8000)
    assert all(s[:2] == ([], False) for s in seen)
    # One shard (2 tensors) is on disk by the time the 4th tensor arrives: the writer streams.
    assert seen[2][2] == [1] and list_snapshots(tmp_path) == [3]


def test_failure_midway_is_undone(tmp_path):
    # Injected failure: the tensor source raises ENOSPC after the first shard was written.
    def tensors():
        yield "a", torch.randn(1000)
        yield "b", torch.randn(1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SnapshotError, match="disk full while writing snapshot v2"):
        write_snapshot(tmp_path, 2, tensors(), max_shard_bytes=4000)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="appears twice"):
        write_snapshot(tmp_path, 2, [("a", torch.zeros(1)), ("a", torch.zeros(1))])
    assert os.listdir(tmp_path) == []


def test_disk_full_on_real_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); test_failure_midway_is_undone covers it")
    try:
        root = mnt / "snapshots"
        write_snapshot(root, 0, [("small", torch.zeros(1000))])  # fits
        with pytest.raises(SnapshotError, match="disk full while writing snapshot v1") as e:
            write_snapshot(root, 1, [(f"w{i}", torch.randn(100_000)) for i in range(4)], max_shard_bytes=500_000)
        assert "nothing was published" in str(e.value)
        assert sorted(os.listdir(root)) == ["v0"] and list_snapshots(root) == [0]
        verify_snapshot(snapshot_dir(root, 0))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_gc_keeps_newest_and_protected(tmp_path):
    for v in range(6):
        write_snapshot(tmp_path, v, [("w", torch.full((2,), float(v)))])
    fresh_tmp, stale_tmp = tmp_path / ".tmp-v9-inprogress", tmp_path / ".tmp-v8-crashed"
    fresh_tmp.mkdir()
    stale_tmp.mkdir()
    os.utime(stale_tmp, (time.time() - 7200, time.time() - 7200))
    assert gc_snapshots(tmp_path, keep=2, protect=[1]) == [0, 2, 3]
    assert list_snapshots(tmp_path) == [1, 4, 5]
    assert fresh_tmp.exists() and not stale_tmp.exists()
    assert read_snapshot(snapshot_dir(tmp_path, 1))["w"].tolist() == [1.0, 1.0]
    assert gc_snapshots(tmp_path, keep=0, protect=[5]) == [1, 4] and list_snapshots(tmp_path) == [5]
    with pytest.raises(ConfigError):
        gc_snapshots(tmp_path, keep=-1)


def test_gc_keeps_everything_while_there_are_fewer_versions_than_keep(tmp_path):
    # The retention setting counts versions: with keep=3, the first three snapshots all stay.
    for v in (1, 2, 3):
        write_snapshot(tmp_path, v, [("w", torch.zeros(1))])
        assert gc_snapshots(tmp_path, keep=3, protect=[v]) == []
    assert list_snapshots(tmp_path) == [1, 2, 3]
    write_snapshot(tmp_path, 4, [("w", torch.zeros(1))])
    assert gc_snapshots(tmp_path, keep=3, protect=[4]) == [1]


def test_rewrite_is_idempotent_and_versions_are_immutable(tmp_path):
    tensors = [("a", torch.arange(5.0)), ("b", torch.ones(3))]
    first = write_snapshot(tmp_path, 4, tensors, config={"model_type": "qwen2"})
    again = write_snapshot(tmp_path, 4, tensors, config={"model_type": "qwen2"})
    assert (again.path, again.manifest_sha256, again.created_at) == (first.path, first.manifest_sha256, first.created_at)
    assert (first.existed, again.existed) == (False, True)
    assert _leftovers(tmp_path) == []
    with pytest.raises(SnapshotError, match="already exists with different content"):
        write_snapshot(tmp_path, 4, [("a", torch.zeros(5)), ("b", torch.ones(3))])
    assert _leftovers(tmp_path) == []
    assert verify_snapshot(first.path, first.manifest_sha256).version == 4


def test_writer_context_manager_and_bad_arguments(tmp_path):
    with pytest.raises(RuntimeError, match="trainer died"):
        with SnapshotWriter(tmp_path, 1) as w:
            w.add("a", torch.zeros(2))
            raise RuntimeError("trainer died")
    assert os.listdir(tmp_path) == []
    for bad in (dict(version=-1), dict(version=1, max_shard_bytes=0), dict(version=1, dtype="complex")):
        with pytest.raises(ConfigError):
            SnapshotWriter(tmp_path, **bad)
    with pytest.raises(ConfigError, match="no tensors"):
        write_snapshot(tmp_path, 1, [])
    assert os.listdir(tmp_path) == []


def test_crc_combination_matches_zlib(tmp_path):
    # The writer folds tensor CRCs into file CRCs arithmetically; zlib over the concatenation is the oracle.
    import random

    from bridge.snapshot.checksums import crc32_combine

    rng = random.Random(0)
    for _ in range(50):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = torch.randn(300_000)  # above the size where the writer combines instead of re-reading
    info = write_snapshot(tmp_path, 0, [("big", big), ("small", torch.ones(3))])
    with open(os.path.join(info.path, "model.safetensors"), "rb") as f:
        assert read_manifest(info.path)["files"]["model.safetensors"]["checksum"] == f"{zlib.crc32(f.read()):08x}"
    verify_snapshot(info.path)
