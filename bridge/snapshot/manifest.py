"""The snapshot format: directory layout, manifest, safetensors dtype codes and CRC-32 checksums.

Writer, reader and collector agree on the format through this module only; the manifest's fields and
the file names are pinned by ``tests/test_snapshot.py``.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass

import torch

from bridge.errors import ConfigError, SnapshotError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "SINGLE_NAME",
    "SnapshotInfo",
    "list_snapshots",
    "read_manifest",
    "shard_name",
    "snapshot_dir",
]

MANIFEST_NAME = "wsync-manifest.json"
FORMAT = "wsync-snapshot"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Temporary directories of writes in progress, and of deletions in progress (see gc_snapshots).
_TMP_PREFIX = ".tmp-v"
_DEL_PREFIX = ".del-v"
_VERSION_DIR = re.compile(r"^v(\d+)$")
# The keys of the manifest that describe content (everything but the write time); two writes of the
# same version are the same snapshot when these agree.
_CONTENT_KEYS = ("format", "format_version", "version", "checksum_algorithm", "total_bytes", "tensor_bytes",
                 "files", "tensors")

# safetensors' dtype codes for the dtypes a snapshot may hold.
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_ST_FROM_CODE = {code: dt for dt, code in _ST_DTYPES.items()}
# The order in which safetensors' serializer lays tensors out (its Dtype enum, descending).
_ST_ORDER = ["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
        _ST_FROM_CODE[_code] = getattr(torch, _name)


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
    return os.path.join(os.fspath(root), f"v{_check_version(version)}")


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
    data = _read_manifest_bytes(os.fspath(path))
    return _parse_manifest(os.fspath(path), data)


# -- helpers --------------------------------------------------------------------------------------


def _check_version(version) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"snapshot version must be an int >= 0, got {version!r}")
    return version


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


# CRC-32 combination (zlib's crc32_combine, which Python's zlib does not expose): the CRC of A+B from
# crc(A), crc(B) and len(B), in ~150 us. It saves a second pass over every large tensor: each tensor's
# CRC is computed once and folded into its file's CRC. Below this size a second pass is cheaper.
_COMBINE_MIN_BYTES = 512 << 10
_CRC_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _gf2_multmodp(a: int, b: int) -> int:
    # a(x) * b(x) modulo the CRC polynomial, in the reflected bit order zlib uses.
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p for k = 0..31
for _ in range(31):
    _X2N.append(_gf2_multmodp(_X2N[-1], _X2N[-1]))


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    p, n, k = 1 << 31, len2, 3  # x^(8 * len2) mod p
    while n:
        if n & 1:
            p = _gf2_multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _gf2_multmodp(p, crc1) ^ crc2


def _crc_extend(crc: int, data_crc: int, data: memoryview) -> int:
    """The CRC of (bytes with CRC ``crc``) + ``data``, given ``data_crc = crc32(data)``."""
    if data.nbytes < _COMBINE_MIN_BYTES:
        return zlib.crc32(data, crc)
    return _crc32_combine(crc, data_crc, data.nbytes)


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise SnapshotError(f"snapshot directory {path} does not exist")


def _read_manifest_bytes(path: str) -> bytes:
    _check_dir(path)
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise SnapshotError(
            f"snapshot {path} has no {MANIFEST_NAME}: it was not written by wsync, or not completely"
        ) from None


def _parse_manifest(path: str, data: bytes) -> dict:
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
