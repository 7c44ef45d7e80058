"""Reading a snapshot: verify it against its manifest, then load its tensors."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from bridge.errors import SnapshotError
from bridge.log import fmt_bytes, get_logger
from bridge.snapshot.checksums import COMBINE_MIN_BYTES, crc32_combine, crc_hex
from bridge.snapshot.manifest import (
    INDEX_NAME,
    MANIFEST_NAME,
    SAFETENSORS_DTYPE,
    SINGLE_NAME,
    SnapshotInfo,
    check_dir,
    open_entry,
    parse_manifest,
    read_manifest_bytes,
)
from bridge.tensors import dtype_to_str

__all__ = ["read_snapshot", "verify_snapshot"]

# The package's name, not this file's: one logger for the whole package.
log = get_logger(__package__)

_CHUNK = 16 << 20


def verify_snapshot(path: str | os.PathLike, expected_manifest_sha256: str | None = None) -> SnapshotInfo:
    """Check a snapshot against its manifest without loading it into tensors.

    Checks, in order: the manifest's sha256 (when ``expected_manifest_sha256`` is given), then for every
    file its size, and for safetensors files the header's tensors (names, dtypes, shapes) and the
    checksum of every tensor's bytes, then every file's checksum.

    Returns:
        The snapshot's ``SnapshotInfo`` (``seconds`` is the time verification took).

    Raises:
        SnapshotError: naming the file (and tensor) and what differs.

    Example:
        >>> import tempfile, torch
        >>> from bridge.snapshot import write_snapshot
        >>> info = write_snapshot(tempfile.mkdtemp(), 2, [("w", torch.ones(4))])
        >>> verify_snapshot(info.path, info.manifest_sha256).version
        2
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    manifest, digest, by_file = _checked_manifest(path, expected_manifest_sha256)
    _each_file(manifest, lambda fname, fentry: _verify_file(path, fname, fentry, by_file.get(fname, {})))
    seconds = time.perf_counter() - t0
    total = manifest["total_bytes"]
    log.debug("snapshot %s verified: %s in %.2f s", path, fmt_bytes(total), seconds)
    return SnapshotInfo(path, manifest["version"], total, digest, seconds, float(manifest["created_at"]))


def read_snapshot(path: str | os.PathLike, *, verify: bool = True,
                  expected_manifest_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a HF model directory (a wsync snapshot or a plain HF checkpoint).

    A snapshot with a manifest is verified and loaded in one pass: each safetensors file is mapped into
    memory, its checksums are taken from the mapped bytes, and the tensors are views of them (so
    verifying costs the checksums only, not a second read). Files are checked by a few threads at once.

    Args:
        path: the directory: sharded with ``model.safetensors.index.json``, a single
            ``model.safetensors``, or any ``*.safetensors`` files.
        verify: with a manifest present, check everything ``verify_snapshot`` checks. Directories
            without a manifest are read unverified.
        expected_manifest_sha256: as for ``verify_snapshot`` (the announced digest); the directory must
            then have a manifest.

    Returns:
        name -> CPU tensor, in file order.

    Raises:
        SnapshotError: the directory does not exist, holds no safetensors files, or fails verification.

    Example:
        >>> import tempfile, torch
        >>> from bridge.snapshot import write_snapshot
        >>> info = write_snapshot(tempfile.mkdtemp(), 0, [("w", torch.arange(3.0))])
        >>> read_snapshot(info.path)["w"].tolist()
        [0.0, 1.0, 2.0]
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    check_dir(path)
    if expected_manifest_sha256 is not None or (verify and os.path.exists(os.path.join(path, MANIFEST_NAME))):
        return _read_verified(path, expected_manifest_sha256)
    out: dict[str, torch.Tensor] = {}
    for fname in _weight_files(path):
        try:
            os.close(open_entry(path, fname))  # inside the directory, a regular file (never a FIFO)
            tensors = load_file(os.path.join(path, fname))
        except (SafetensorError, OSError, ValueError) as e:
            raise SnapshotError(f"snapshot {path}: cannot read {fname}: {e}") from e
        for name, t in tensors.items():
            if name in out:
                raise SnapshotError(f"snapshot {path}: tensor {name!r} appears in more than one file ({fname})")
            out[name] = t
    return out


# -- helpers --------------------------------------------------------------------------------------


def _checked_manifest(path: str, expected_manifest_sha256: str | None) -> tuple[dict, str, dict[str, dict[str, dict]]]:
    """The manifest, its sha256, and file -> {tensor -> entry}; checks what needs no file contents."""
    data = read_manifest_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    if expected_manifest_sha256 is not None and digest != expected_manifest_sha256:
        raise SnapshotError(
            f"snapshot {path}: {MANIFEST_NAME} has sha256 {digest}, the announcement says "
            f"{expected_manifest_sha256}; the directory was rewritten or the announcement is stale"
        )
    manifest = parse_manifest(path, data)
    by_file: dict[str, dict[str, dict]] = {}
    for tname, entry in manifest["tensors"].items():
        if entry["file"] not in manifest["files"]:
            raise SnapshotError(f"snapshot {path}: manifest puts tensor {tname!r} in {entry['file']}, a file it does not list")
        by_file.setdefault(entry["file"], {})[tname] = entry
    for fname in os.listdir(path):
        if fname.endswith(".safetensors") and fname not in manifest["files"]:
            raise SnapshotError(f"snapshot {path}: {fname} is not in the manifest; a loader would read it")
    return manifest, digest, by_file


_READ_THREADS = 4  # file reads and zlib.crc32 release the GIL


def _read_verified(path: str, expected_manifest_sha256: str | None) -> dict[str, torch.Tensor]:
    t0 = time.perf_counter()
    manifest, _, by_file = _checked_manifest(path, expected_manifest_sha256)

    def read_file(fname: str, fentry: dict) -> list[tuple[str, torch.Tensor]]:
        keep = fname.endswith(".safetensors")
        ranges, data = _verify_file(path, fname, fentry, by_file.get(fname, {}), keep=keep)
        return [(tname, _tensor_at(data, begin, end, dtype, shape)) for tname, begin, end, dtype, shape in ranges] if keep else []

    out = {name: t for part in _each_file(manifest, read_file) for name, t in part}
    log.debug("snapshot %s verified and read: %s in %.2f s", path, fmt_bytes(manifest["total_bytes"]),
              time.perf_counter() - t0)
    return out


def _each_file(manifest: dict, fn) -> list:
    """``fn(name, entry)`` for every file of the manifest, a few files at a time; results in manifest order.
    The first error raised is raised here (the other files' checks still finish)."""
    files = list(manifest["files"].items())
    if len(files) <= 1:
        return [fn(*f) for f in files]
    with ThreadPoolExecutor(min(_READ_THREADS, len(files)), thread_name_prefix="wsync-read") as pool:
        return list(pool.map(lambda f: fn(*f), files))


def _tensor_at(data: torch.Tensor, begin: int, end: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    raw = data[begin:end]
    if begin % dtype.itemsize:  # safetensors aligns its data; a file that does not is copied once more
        raw = raw.clone()
    return raw.view(dtype).view(shape)


class _Stream:
    """Byte ranges of an open file, read in chunks (verifying without keeping the bytes)."""

    def __init__(self, f, name: str):
        self.f, self.name, self.buf = f, name, bytearray(_CHUNK)

    def read(self, pos: int, n: int) -> bytes:
        self.f.seek(pos)
        return self.f.read(n)

    def crc(self, pos: int, end: int, crcs: list[int]) -> list[int]:
        # CRC of bytes [pos, end), continuing each running value in crcs.
        self.f.seek(pos)
        view = memoryview(self.buf)
        while pos < end:
            got = self.f.readinto(view[: min(len(self.buf), end - pos)])
            if not got:
                raise SnapshotError(f"unexpected end of file in {self.name} at byte {pos}")
            crcs = [zlib.crc32(view[:got], c) for c in crcs]
            pos += got
        return crcs


class _Whole:
    """A whole file mapped into memory (private, copy-on-write), so that the bytes verified are the bytes
    loaded: the tensors are views of the mapping, and reading costs no copy (as in safetensors' own
    ``load_file``). Snapshots are never rewritten in place, so the mapping cannot change under them."""

    def __init__(self, f, size: int):
        if size:
            self.data = torch.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        else:
            self.data = torch.empty(0, dtype=torch.uint8)
        self.view = memoryview(self.data.numpy())

    def read(self, pos: int, n: int) -> bytes:
        return bytes(self.view[pos : pos + n])

    def crc(self, pos: int, end: int, crcs: list[int]) -> list[int]:
        return [zlib.crc32(self.view[pos:end], c) for c in crcs]


def _verify_file(path: str, fname: str, fentry: dict, tensors: dict[str, dict], keep: bool = False):
    """Check one file against its manifest entry. Returns the safetensors tensors' (name, begin, end,
    dtype, shape), sorted by offset, and with ``keep`` the file's bytes as a uint8 tensor (else None)."""
    try:
        fd = open_entry(path, fname)  # inside the snapshot, a regular file, opened without blocking
    except FileNotFoundError:
        raise SnapshotError(f"snapshot {path}: file {fname} is missing") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size != fentry["bytes"]:
            raise SnapshotError(
                f"snapshot {path}: file {fname} has {size} bytes, the manifest says {fentry['bytes']} "
                f"({'truncated' if size < fentry['bytes'] else 'grown'})"
            )
        ranges = []
        src = _Whole(f, size) if keep else _Stream(f, fname)
        if fname.endswith(".safetensors"):
            ranges, head = _check_header(path, fname, src, size, tensors)
            file_crc = zlib.crc32(head)
            pos = len(head)
            for tname, begin, end, _, _ in ranges:
                if begin > pos:
                    file_crc = src.crc(pos, begin, [file_crc])[0]
                if end - begin < COMBINE_MIN_BYTES:
                    file_crc, tcrc = src.crc(begin, end, [file_crc, 0])
                else:  # one pass over the bytes; the file's CRC is combined arithmetically
                    (tcrc,) = src.crc(begin, end, [0])
                    file_crc = crc32_combine(file_crc, tcrc, end - begin)
                if crc_hex(tcrc) != tensors[tname]["checksum"]:
                    raise SnapshotError(
                        f"snapshot {path}: tensor {tname!r} in {fname} has checksum {crc_hex(tcrc)}, "
                        f"the manifest says {tensors[tname]['checksum']} (corrupt data)"
                    )
                pos = end
            if pos < size:
                file_crc = src.crc(pos, size, [file_crc])[0]
        else:
            file_crc = src.crc(0, size, [0])[0]
    if crc_hex(file_crc) != fentry["checksum"]:
        raise SnapshotError(
            f"snapshot {path}: file {fname} has checksum {crc_hex(file_crc)}, the manifest says "
            f"{fentry['checksum']} (corrupt data)"
        )
    return ranges, (src.data if keep else None)


def _check_header(path: str, fname: str, src, size: int, tensors: dict[str, dict]):
    raw = src.read(0, 8)
    (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (size,)
    if len(raw) < 8 or n > size - 8:
        raise SnapshotError(f"snapshot {path}: file {fname} has a corrupt safetensors header length")
    header_bytes = src.read(8, n)
    try:
        header = json.loads(header_bytes)
    except ValueError:
        raise SnapshotError(f"snapshot {path}: file {fname} has a corrupt safetensors header") from None
    header.pop("__metadata__", None)
    if set(header) != set(tensors):
        extra, missing = sorted(set(header) - set(tensors)), sorted(set(tensors) - set(header))
        raise SnapshotError(
            f"snapshot {path}: file {fname} holds tensors that differ from the manifest "
            f"(not in manifest: {extra[:5]}, missing from file: {missing[:5]})"
        )
    ranges = []
    for tname, h in header.items():
        want = tensors[tname]
        dtype = SAFETENSORS_DTYPE.get(h.get("dtype"))
        if dtype is None or dtype_to_str(dtype) != want["dtype"]:
            raise SnapshotError(
                f"snapshot {path}: tensor {tname!r} in {fname} has dtype {h.get('dtype')}, the manifest says {want['dtype']}"
            )
        if list(h.get("shape", [])) != list(want["shape"]):
            raise SnapshotError(
                f"snapshot {path}: tensor {tname!r} in {fname} has shape {h.get('shape')}, the manifest says {want['shape']}"
            )
        begin, end = (8 + n + int(x) for x in h["data_offsets"])
        if not (8 + n <= begin <= end <= size):
            raise SnapshotError(f"snapshot {path}: tensor {tname!r} in {fname} lies outside the file (truncated)")
        if end - begin != dtype.itemsize * math.prod(want["shape"]):
            raise SnapshotError(f"snapshot {path}: tensor {tname!r} in {fname} spans {end - begin} bytes, its dtype "
                                f"and shape need {dtype.itemsize * math.prod(want['shape'])}")
        ranges.append((tname, begin, end, dtype, list(want["shape"])))
    ranges.sort(key=lambda r: r[1])
    return ranges, raw + header_bytes


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        try:
            with os.fdopen(open_entry(path, INDEX_NAME), "rb") as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise SnapshotError(f"snapshot {path}: {INDEX_NAME} is unreadable ({e})") from None
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(path, SINGLE_NAME)):
        return [SINGLE_NAME]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise SnapshotError(f"snapshot {path} holds no .safetensors files")
    return files
