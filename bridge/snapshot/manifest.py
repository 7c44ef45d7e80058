"""The snapshot format: directory layout, manifest and safetensors dtype codes.

Writer, reader and collector agree on the format through this module (and ``checksums``, the CRC-32
the manifest records); the manifest's fields and the file names are pinned by ``tests/test_snapshot.py``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass

import torch

from bridge.errors import ConfigError, SnapshotError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CONTENT_KEYS",
    "DEL_PREFIX",
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "SAFETENSORS_CODE",
    "SAFETENSORS_DTYPE",
    "SAFETENSORS_ORDER",
    "SINGLE_NAME",
    "TMP_PREFIX",
    "SnapshotInfo",
    "check_dir",
    "check_version",
    "list_snapshots",
    "open_entry",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
    "shard_name",
    "snapshot_dir",
    "under_roots",
]

MANIFEST_NAME = "wsync-manifest.json"
FORMAT = "wsync-snapshot"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Temporary directories of writes in progress, and of deletions in progress (see gc_snapshots).
TMP_PREFIX = ".tmp-v"
DEL_PREFIX = ".del-v"
_VERSION_DIR = re.compile(r"^v(\d+)$")
# The keys of the manifest that describe content (everything but the write time); two writes of the
# same version are the same snapshot when these agree.
CONTENT_KEYS = ("format", "format_version", "version", "checksum_algorithm", "total_bytes", "tensor_bytes",
                "files", "tensors")

# safetensors' dtype codes for the dtypes a snapshot may hold.
SAFETENSORS_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
SAFETENSORS_DTYPE = {code: dt for dt, code in SAFETENSORS_CODE.items()}
# The order in which safetensors' serializer lays tensors out (its Dtype enum, descending).
SAFETENSORS_ORDER = ["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        SAFETENSORS_CODE[getattr(torch, _name)] = _code
        SAFETENSORS_DTYPE[_code] = getattr(torch, _name)


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A complete snapshot on disk: what an announcement carries."""

    path: str
    """The final directory, ``snapshot_dir(root, version)``."""
    version: int
    """The weight version the snapshot holds."""
    total_bytes: int
    """Bytes of every file of the snapshot except the manifest."""
    manifest_sha256: str
    """sha256 (hex) of the manifest file's bytes; readers compare it before loading."""
    seconds: float
    """Wall time of the write (or of the verification, for ``verify_snapshot``)."""
    created_at: float
    """Unix time at which the manifest was written."""
    existed: bool = False
    """True when the version was already published with the same content (an idempotent re-write)."""


def snapshot_dir(root: str | os.PathLike, version: int) -> str:
    """The final directory of ``version`` under ``root``: ``<root>/v<version>``."""
    return os.path.join(os.fspath(root), f"v{check_version(version)}")


def under_roots(real: str, roots: list[str]) -> bool:
    """True when the resolved path ``real`` is one of ``roots`` (resolved directories) or lies below one:
    the rule for what a reference server loads (its ``--disk-root``), as the server and a publisher
    apply it."""
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def shard_name(i: int, n: int) -> str:
    """The HF file name of shard ``i`` (1-based) of ``n``: ``model.safetensors`` when ``n == 1``, else
    ``model-0000i-of-0000n.safetensors``."""
    return SINGLE_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"


def list_snapshots(root: str | os.PathLike) -> list[int]:
    """Versions of the complete snapshots under ``root``, ascending (``[]`` when ``root`` is missing)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    versions = []
    for name in names:
        m = _VERSION_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            versions.append(int(m.group(1)))
    return sorted(versions)


def read_manifest(path: str | os.PathLike) -> dict:
    """The parsed ``wsync-manifest.json`` of a snapshot directory.

    Raises:
        SnapshotError: the directory or its manifest is missing or unreadable.
    """
    data = read_manifest_bytes(os.fspath(path))
    return parse_manifest(os.fspath(path), data)


# -- checks shared by writer and reader ----------------------------------------------------------


def check_version(version) -> int:
    """``version`` itself when it can name a snapshot (an int >= 0, not a bool); else ConfigError."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"snapshot version must be an int >= 0, got {version!r}")
    return version


def check_dir(path: str) -> None:
    """SnapshotError unless ``path`` is an existing directory."""
    if not os.path.isdir(path):
        raise SnapshotError(f"snapshot directory {path} does not exist")


def read_manifest_bytes(path: str) -> bytes:
    """The manifest file's raw bytes (what its announced sha256 is taken of); SnapshotError when missing,
    or when it is not a regular file inside ``path`` (:func:`open_entry`)."""
    check_dir(path)
    try:
        fd = open_entry(path, MANIFEST_NAME)
    except FileNotFoundError:
        raise SnapshotError(
            f"snapshot {path} has no {MANIFEST_NAME}: it was not written by wsync, or not completely"
        ) from None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def open_entry(path: str, name: str) -> int:
    """Open the file ``name`` of the snapshot directory ``path`` for reading, as every file of a snapshot is
    opened (weights, index, manifest, and any other file its manifest lists); a file descriptor.

    ``name`` must be a plain file name that resolves, symlinks included, to a file directly inside ``path``,
    and that file must be a regular file: it is opened with ``O_NONBLOCK`` and checked with ``fstat``, so a
    FIFO (or a device) is refused at once instead of blocking the reader until someone writes to it. A
    refusal never says anything about where a symlink leads, or about the file there.

    Raises:
        FileNotFoundError: there is no such file (the caller says what that means).
        SnapshotError: the name or its target leaves the directory, or it is not a regular file.
    """
    where = os.path.realpath(path)
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
        raise SnapshotError(f"snapshot {path}: the entry {str(name)[:80]!r} leaves the snapshot directory; entries "
                            "must be plain file names inside it")
    real = os.path.realpath(os.path.join(where, name))
    if os.path.dirname(real) != where:
        raise SnapshotError(f"snapshot {path}: {name} leaves the snapshot directory (a symlink to somewhere else); "
                            "every file of a snapshot must lie inside it")
    try:  # O_NOFOLLOW: a name swapped for a symlink since it was resolved fails here
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SnapshotError(f"snapshot {path}: {name} cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SnapshotError(f"snapshot {path}: {name} is not a regular file (a FIFO, device or directory would "
                            "block or mislead the reader)")
    return fd


def parse_manifest(path: str, data: bytes) -> dict:
    """The manifest in ``data``, checked for the format version, the checksum algorithm and the fields
    every reader relies on; SnapshotError naming what is wrong."""
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise SnapshotError(f"snapshot {path}: {MANIFEST_NAME} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise SnapshotError(f"snapshot {path}: {MANIFEST_NAME} is not a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot {path}: manifest format_version {manifest.get('format_version')!r}, this wsync reads "
            f"{FORMAT_VERSION}; use the wsync version that wrote it"
        )
    if manifest.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise SnapshotError(f"snapshot {path}: unknown checksum_algorithm {manifest.get('checksum_algorithm')!r}")
    for key, kind in (("version", int), ("created_at", (int, float)), ("total_bytes", int), ("files", dict),
                      ("tensors", dict)):
        if not isinstance(manifest.get(key), kind):
            raise SnapshotError(f"snapshot {path}: manifest field {key!r} is missing or malformed")
    return manifest
