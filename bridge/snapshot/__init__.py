"""Versioned HF snapshots on disk: written atomically, verified against a manifest before anyone loads them.

A snapshot is a Hugging Face model directory that SGLang's ``/update_weights_from_disk`` (and
``from_pretrained``) can load as is, plus ``wsync-manifest.json``:

    <root>/v<version>/
        model.safetensors                      (one shard) or
        model-00001-of-0000N.safetensors ...   + model.safetensors.index.json (several shards)
        config.json, generation_config.json, tokenizer files   (when given)
        wsync-manifest.json

Protocol (trainer rank 0 writes, or every trainer rank writes its share; a watcher or server reads):

1. ``SnapshotWriter`` creates ``<root>/.tmp-v<version>-<random>`` and streams tensors into it one at a
   time (fed by a collective gather); at most one shard is held in memory. Shards get temporary names
   because the shard count is only known at the end. Or, when the shards are known in advance (one per
   bucket of a sync), each trainer rank writes its own with ``write_shard`` straight under its final
   name into the same temporary directory (the ranks share the filesystem), and rank 0's writer
   records them with ``add_shard``; the result on disk is the same.
2. ``finish()`` renames the shards to their HF names, writes the index, config and tokenizer files and
   the manifest, fsyncs every file and the directory, then renames the directory to ``<root>/v<version>``
   and fsyncs ``<root>``. A directory under its final name is therefore always complete; a failed write
   removes its temporary directory and publishes nothing.
3. The writer announces ``(path, manifest_sha256)``; the reader calls ``verify_snapshot`` (sizes and
   checksums of every file, dtype/shape/checksum of every tensor) before loading.

Checksums are CRC-32 (``zlib.crc32``), several times faster than sha256 or blake2b, so checking a snapshot costs less
than reading it. CRC-32
detects truncation and corruption, not tampering; the manifest itself is pinned by the sha256 that
travels in the announcement.

Modules: ``manifest`` (layout, manifest), ``checksums`` (the CRC-32s), ``writer`` (steps 1 and 2), ``reader``
(step 3, and loading) and ``gc`` (removing old versions).

Example:
    >>> import tempfile, torch
    >>> root = tempfile.mkdtemp()
    >>> info = write_snapshot(root, 3, [("w", torch.ones(2, 2))], dtype="bf16")
    >>> info.path == snapshot_dir(root, 3), list_snapshots(root)
    (True, [3])
    >>> read_snapshot(info.path)["w"].dtype
    torch.bfloat16
"""

from __future__ import annotations

from bridge.snapshot.gc import gc_snapshots
from bridge.snapshot.manifest import (
    CHECKSUM_ALGORITHM,
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    SINGLE_NAME,
    SnapshotInfo,
    list_snapshots,
    read_manifest,
    shard_name,
    snapshot_dir,
)
from bridge.snapshot.reader import read_snapshot, verify_snapshot
from bridge.snapshot.writer import DEFAULT_MAX_SHARD_BYTES, SnapshotWriter, write_shard, write_snapshot

__all__ = [
    "CHECKSUM_ALGORITHM",
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "SINGLE_NAME",
    "SnapshotInfo",
    "SnapshotWriter",
    "gc_snapshots",
    "list_snapshots",
    "read_manifest",
    "read_snapshot",
    "shard_name",
    "snapshot_dir",
    "verify_snapshot",
    "write_shard",
    "write_snapshot",
]
