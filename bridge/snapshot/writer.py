"""Writing a snapshot: stream tensors into a temporary directory, fsync, rename it into place."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Iterable

import torch

from bridge.errors import BridgeError, ConfigError, SnapshotConflict, SnapshotError
from bridge.log import fmt_bytes, get_logger
from bridge.snapshot.checksums import crc_extend, crc_hex
from bridge.snapshot.manifest import (
    CHECKSUM_ALGORITHM,
    CONTENT_KEYS,
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    SAFETENSORS_CODE,
    SAFETENSORS_ORDER,
    TMP_PREFIX,
    SnapshotInfo,
    check_version,
    read_manifest_bytes,
    shard_name,
    snapshot_dir,
)
from bridge.tensors import dtype_from_str, dtype_to_str

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "SnapshotWriter", "write_error", "write_shard", "write_snapshot"]

# The package's name, not this file's: one logger for the whole package.
log = get_logger(__package__)

DEFAULT_MAX_SHARD_BYTES = 1 << 30


class SnapshotWriter:
    """Streams named tensors into a new snapshot directory and publishes it atomically.

    Use it as a context manager: an exception inside the block removes the temporary directory.

    Args:
        root: directory holding the versions (created when missing).
        version: the weight version (an int >= 0); the snapshot lands in ``<root>/v<version>``.
        config: a ``transformers.PretrainedConfig`` or a dict, written as ``config.json``.
        tokenizer: an object with ``save_pretrained`` (a HF tokenizer), or the path of a directory whose
            tokenizer files are copied.
        generation_config: a ``transformers.GenerationConfig`` or a dict (``generation_config.json``).
        dtype: cast every tensor to this dtype on write (``torch.bfloat16`` or a name like ``"bf16"``);
            None keeps each tensor's dtype.
        max_shard_bytes: a shard is closed before it would exceed this many bytes of tensor data (a
            larger tensor gets a shard of its own). Bounds the memory the writer holds.

    Example:
        >>> import tempfile, torch
        >>> with SnapshotWriter(tempfile.mkdtemp(), 0) as w:
        ...     w.add("w", torch.zeros(3))
        ...     info = w.finish()
        >>> info.version
        0
    """

    def __init__(
        self,
        root: str | os.PathLike,
        version: int,
        *,
        config=None,
        tokenizer=None,
        generation_config=None,
        dtype: torch.dtype | str | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        self.root = os.fspath(root)
        self.version = check_version(version)
        self.dtype = None if dtype is None else dtype_from_str(dtype)
        if self.dtype is not None and self.dtype not in SAFETENSORS_CODE:
            raise ConfigError(f"snapshot dtype {dtype!r} cannot be stored in safetensors; use bf16, fp16 or fp32")
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        if config is not None and not (isinstance(config, dict) or hasattr(config, "to_json_string")):
            raise ConfigError(f"config must be a transformers PretrainedConfig or a dict, got {type(config).__name__}")
        if tokenizer is not None and not (hasattr(tokenizer, "save_pretrained") or os.path.isdir(tokenizer)):
            raise ConfigError(f"tokenizer must be a HF tokenizer or an existing directory, got {tokenizer!r}")
        self.max_shard_bytes = max_shard_bytes
        self.config, self.tokenizer, self.generation_config = config, tokenizer, generation_config
        self.final_dir = snapshot_dir(self.root, self.version)
        self._t0 = time.perf_counter()
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self._placed: list[str] = []  # shards other processes wrote under their final names (add_shard)
        self._tensors: dict[str, dict] = {}
        self._files: dict[str, dict] = {}
        self._tensor_bytes = 0
        self._done = False
        try:
            os.makedirs(self.root, exist_ok=True)
            self.tmp_dir = os.path.join(self.root, f"{TMP_PREFIX}{self.version}-{uuid.uuid4().hex[:12]}")
            os.mkdir(self.tmp_dir)
        except OSError as e:
            raise write_error(self.root, self.version, e, 0) from e

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add one tensor (any device; moved to CPU and cast to ``dtype``); may write a full shard to disk.

        A CPU tensor that needs no cast is held by reference until its shard is written (at the latest by
        ``finish()``): do not modify it in place before then. Tensors from a gather are fresh each time.

        Raises:
            ConfigError: the name repeats or the dtype cannot be stored.
            SnapshotError: the write failed (disk full, ...); the temporary directory is already removed.
        """
        self._check_open()
        try:
            if name in self._tensors or any(n == name for n, _ in self._pending):
                raise ConfigError(f"tensor {name!r} appears twice in snapshot v{self.version}")
            dtype = self.dtype or tensor.dtype
            if dtype not in SAFETENSORS_CODE:
                raise ConfigError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store here")
            nbytes = tensor.numel() * dtype.itemsize
            if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
                self._flush_shard()  # before copying, so at most one shard is held
            t = tensor.detach()
            if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
                t = t.to(device="cpu", dtype=dtype).contiguous()
            # else no copy: a copy into fresh pages (page faults) can cost as much as the write itself.
            # The caller must not modify the tensor until its shard is written.
            self._pending.append((name, t))
            self._pending_bytes += nbytes
            self._tensor_bytes += nbytes
        except BaseException as e:
            self._fail(e)

    def add_shard(self, fname: str, entry: dict) -> None:
        """Record a shard that another process wrote into ``tmp_dir`` with :func:`write_shard`.

        For writers that share the snapshot's filesystem (trainer ranks on one host, or on a shared
        filesystem): each writes its shards straight under their final names, ``shard_name(i, n)``, and
        this writer, given every ``(fname, entry)``, writes the index and the manifest and publishes the
        directory as usual. Not to be mixed with :meth:`add` in one snapshot.

        Raises:
            ConfigError: the writer already streams tensors, or a file or tensor name repeats.
            SnapshotError: the file is missing or has another size than ``entry`` says (the temporary
                directory is already removed).
        """
        self._check_open()
        try:
            if self._pending or self._shards:
                raise ConfigError(f"snapshot v{self.version}: add_shard() cannot be mixed with add()")
            if fname in self._files:
                raise ConfigError(f"shard {fname!r} appears twice in snapshot v{self.version}")
            twice = [n for n in entry["tensors"] if n in self._tensors]
            if twice:
                raise ConfigError(f"tensors {twice} appear twice in snapshot v{self.version}")
            try:
                size = os.path.getsize(os.path.join(self.tmp_dir, fname))
            except FileNotFoundError:
                raise SnapshotError(
                    f"shard {fname} of snapshot v{self.version} is not in {self.tmp_dir}: was it written on a "
                    "filesystem this process does not share?"
                ) from None
            if size != entry["bytes"]:
                raise SnapshotError(f"shard {fname} of snapshot v{self.version} has {size} bytes, its writer wrote {entry['bytes']}")
            self._record_shard(fname, entry)
            self._placed.append(fname)
            self._tensor_bytes += entry["tensor_bytes"]
        except BaseException as e:
            self._fail(e)

    def finish(self) -> SnapshotInfo:
        """Write the last shard and the metadata, fsync, and rename the directory to its final name.

        Returns:
            The ``SnapshotInfo`` of the published snapshot.

        Raises:
            ConfigError: no tensor was added.
            SnapshotError: the write failed, or ``<root>/v<version>`` already holds a different snapshot.
        """
        self._check_open()
        try:
            if not self._pending and not self._shards and not self._placed:
                raise ConfigError(f"snapshot v{self.version} has no tensors; add at least one before finish()")
            if self._pending:
                self._flush_shard()
            self._name_shards()
            self._write_metadata()
            manifest_bytes, created_at = self._write_manifest()
            fsync_path(self.tmp_dir, directory=True)
            info = self._publish(manifest_bytes, created_at)
        except BaseException as e:
            self._fail(e)
        self._done = True
        return info

    def abort(self) -> None:
        """Remove the temporary directory; nothing is published. Safe to call twice."""
        self._done = True
        self._pending.clear()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    # -- internals -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._done:
            raise SnapshotError(f"snapshot v{self.version} is already finished or aborted; start a new writer")

    def _fail(self, e: BaseException):
        self.abort()
        if isinstance(e, BridgeError) or not isinstance(e, Exception):
            raise e
        raise write_error(self.root, self.version, e, self._tensor_bytes) from e

    def _flush_shard(self) -> None:
        tmp_name = f"shard-{len(self._shards) + 1:05d}.safetensors.part"
        entry = write_shard(os.path.join(self.tmp_dir, tmp_name), self._pending)
        self._record_shard(tmp_name, entry)
        self._shards.append((tmp_name, list(entry["tensors"])))
        self._pending = []
        self._pending_bytes = 0

    def _record_shard(self, fname: str, entry: dict) -> None:
        for name, tensor in entry["tensors"].items():
            self._tensors[name] = {"file": fname, **tensor}
        self._files[fname] = {"bytes": entry["bytes"], "checksum": entry["checksum"]}

    def _name_shards(self) -> None:
        if self._placed:
            # Written by their ranks under their final names: check that they are the complete set.
            n = len(self._placed)
            expected = {shard_name(i, n) for i in range(1, n + 1)}
            if set(self._placed) != expected:
                raise SnapshotError(
                    f"snapshot v{self.version} got shards {sorted(self._placed)}, not the {n} files "
                    f"{sorted(expected)} of a complete snapshot"
                )
        else:
            n = len(self._shards)
            renames = {}
            for i, (tmp_name, _) in enumerate(self._shards, 1):
                renames[tmp_name] = shard_name(i, n)
                os.rename(os.path.join(self.tmp_dir, tmp_name), os.path.join(self.tmp_dir, renames[tmp_name]))
            self._files = {renames[k]: v for k, v in self._files.items()}
            for entry in self._tensors.values():
                entry["file"] = renames[entry["file"]]
        if n > 1:
            index = {
                "metadata": {"total_size": self._tensor_bytes},
                "weight_map": {name: entry["file"] for name, entry in sorted(self._tensors.items())},
            }
            self._write_small(INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")

    def _write_metadata(self) -> None:
        for fname, cfg in (("config.json", self.config), ("generation_config.json", self.generation_config)):
            if cfg is not None:
                self._write_small(fname, _config_json(cfg).encode())
        if self.tokenizer is not None:
            before = set(os.listdir(self.tmp_dir))
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(self.tmp_dir)
            else:
                for fname in sorted(os.listdir(self.tokenizer)):
                    if _is_tokenizer_file(fname):
                        shutil.copyfile(os.path.join(self.tokenizer, fname), os.path.join(self.tmp_dir, fname))
            for fname in sorted(set(os.listdir(self.tmp_dir)) - before):
                path = os.path.join(self.tmp_dir, fname)
                if os.path.isfile(path):
                    with open(path, "rb") as f:
                        self._record_small(fname, f.read())
                    fsync_path(path)

    def _write_small(self, fname: str, data: bytes) -> None:
        _write_synced(os.path.join(self.tmp_dir, fname), data)
        self._record_small(fname, data)

    def _record_small(self, fname: str, data: bytes) -> None:
        self._files[fname] = {"bytes": len(data), "checksum": crc_hex(zlib.crc32(data))}

    def _write_manifest(self) -> tuple[bytes, float]:
        created_at = time.time()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "created_at": created_at,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "total_bytes": sum(f["bytes"] for f in self._files.values()),
            "tensor_bytes": self._tensor_bytes,
            "files": dict(sorted(self._files.items())),
            "tensors": self._tensors,
        }
        data = json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"
        # Not recorded in the manifest's own file list: ``total_bytes`` excludes the manifest.
        _write_synced(os.path.join(self.tmp_dir, MANIFEST_NAME), data)
        return data, created_at

    def _publish(self, manifest_bytes: bytes, created_at: float) -> SnapshotInfo:
        total = json.loads(manifest_bytes)["total_bytes"]
        try:
            # rename(2) refuses to replace a non-empty directory, so a concurrent writer of the same
            # version cannot clobber a published snapshot.
            os.rename(self.tmp_dir, self.final_dir)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return self._same_as_existing(manifest_bytes)
        fsync_path(self.root, directory=True)
        seconds = time.perf_counter() - self._t0
        log.info(
            "snapshot v%d written: %d tensors, %s in %.2f s (%.2f GiB/s) -> %s",
            self.version, len(self._tensors), fmt_bytes(total), seconds,
            total / max(seconds, 1e-9) / 2**30, self.final_dir,
        )
        return SnapshotInfo(self.final_dir, self.version, total, hashlib.sha256(manifest_bytes).hexdigest(),
                            seconds, created_at)

    def _same_as_existing(self, manifest_bytes: bytes) -> SnapshotInfo:
        new = json.loads(manifest_bytes)
        try:
            old_bytes = read_manifest_bytes(self.final_dir)
            old = json.loads(old_bytes)
        except (SnapshotError, ValueError) as e:
            raise SnapshotError(
                f"{self.final_dir} already exists and is not a readable wsync snapshot ({e}); "
                f"remove it or write a new version"
            ) from None
        if {k: old.get(k) for k in CONTENT_KEYS} != {k: new[k] for k in CONTENT_KEYS}:
            raise SnapshotConflict(
                f"{self.final_dir} already exists with different content; versions are immutable: "
                f"write version {self.version} only once, or use a new version number"
            )
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        log.info("snapshot v%d already published with the same content at %s", self.version, self.final_dir)
        return SnapshotInfo(self.final_dir, self.version, old["total_bytes"], hashlib.sha256(old_bytes).hexdigest(),
                            time.perf_counter() - self._t0, float(old["created_at"]), existed=True)


def write_shard(path: str, tensors: list[tuple[str, torch.Tensor]], between: Callable[[], None] | None = None) -> dict:
    """Write one safetensors shard of ``tensors`` (contiguous CPU tensors of storable dtypes) to ``path``
    and fsync it; its manifest entry: ``bytes``, ``checksum``, ``tensor_bytes`` and ``tensors`` (name ->
    dtype, shape, checksum). ``between`` is called after the header and after each tensor (raising
    there stops the write; the caller removes the file).

    Tensors are laid out in safetensors' own order (by dtype, itemsize descending, then by name): every
    tensor starts aligned to its itemsize, and the shard is byte-identical to what
    ``safetensors.torch.save`` writes.
    """
    tensors = sorted(tensors, key=lambda nt: (SAFETENSORS_ORDER.index(SAFETENSORS_CODE[nt[1].dtype]), nt[0]))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_CODE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors pads the header to 8 bytes
    prefix = struct.pack("<Q", len(header_bytes)) + header_bytes
    file_crc = zlib.crc32(prefix)
    entries: dict[str, dict] = {}
    with open(path, "wb") as f:
        f.write(prefix)
        for name, t in tensors:
            if between is not None:
                between()
            data = _raw_bytes(t)
            f.write(data)
            tensor_crc = zlib.crc32(data)
            file_crc = crc_extend(file_crc, tensor_crc, data)
            entries[name] = {"dtype": dtype_to_str(t.dtype), "shape": list(t.shape), "checksum": crc_hex(tensor_crc)}
        if between is not None:
            between()
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(prefix) + offset, "checksum": crc_hex(file_crc), "tensor_bytes": offset, "tensors": entries}


def write_snapshot(
    root: str | os.PathLike,
    version: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    config=None,
    tokenizer=None,
    generation_config=None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> SnapshotInfo:
    """Write ``tensors`` as snapshot ``version`` under ``root`` (see ``SnapshotWriter`` for the arguments).

    ``tensors`` is consumed lazily, one tensor at a time; an exception raised by it is reported as a
    ``SnapshotError`` (chained to the original) after the temporary directory is removed. Writing a
    version again with the same content returns the existing snapshot's info; with different content it
    raises.

    Returns:
        The ``SnapshotInfo`` of ``<root>/v<version>``.

    Raises:
        SnapshotError: the write failed (the message says why, e.g. disk full) and nothing was published,
            or the version already exists with different content.
        ConfigError: a bad argument, a repeated tensor name, or no tensors.

    Example:
        >>> import tempfile, torch
        >>> write_snapshot(tempfile.mkdtemp(), 1, {"a": torch.zeros(1)}.items()).version
        1
    """
    with SnapshotWriter(root, version, config=config, tokenizer=tokenizer, generation_config=generation_config,
                        dtype=dtype, max_shard_bytes=max_shard_bytes) as writer:
        try:
            for name, tensor in tensors:
                writer.add(name, tensor)
        except Exception as e:  # the source failed (a gather, a read): undone and reported like a write error
            writer._fail(e)
        return writer.finish()


# -- helpers --------------------------------------------------------------------------------------


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # Little-endian raw bytes of a contiguous CPU tensor, without a copy (bf16 has no numpy dtype).
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _config_json(cfg) -> str:
    # A transformers config writes its own JSON (what its save_pretrained writes); a dict is written as is.
    if hasattr(cfg, "to_json_string"):
        return cfg.to_json_string()
    return json.dumps(dict(cfg), indent=2, sort_keys=True) + "\n"


def _is_tokenizer_file(fname: str) -> bool:
    return (fname.startswith(("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens", "chat_template"))
            or fname.endswith((".model", ".tiktoken")))


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: str, *, directory: bool = False) -> None:
    # A directory is fsynced so that the names created or renamed in it survive a crash, not only the data.
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(root: str, version: int, e: BaseException, nbytes: int) -> SnapshotError:
    """The SnapshotError for a write of snapshot ``version`` under ``root`` that failed with ``e`` after
    ``nbytes`` of tensors: a full disk says how much is free and how to make room. For every writer of a
    snapshot's files (this module's, and the disk transport's per-rank shard writers)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = fmt_bytes(shutil.disk_usage(root).free)
        except OSError:
            free = "unknown"
        return SnapshotError(
            f"disk full while writing snapshot v{version} under {root} (after {fmt_bytes(nbytes)} of tensors; "
            f"{free} free now); nothing was published and the temporary directory was removed. Free space, "
            f"keep fewer versions (gc_snapshots) or point the snapshot root at a larger disk"
        )
    return SnapshotError(
        f"writing snapshot v{version} under {root} failed ({type(e).__name__}: {e}); nothing was published "
        f"and the temporary directory was removed"
    )
