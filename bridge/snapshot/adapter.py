"""PEFT adapter directories on disk (``adapter_model.safetensors`` + ``adapter_config.json``), each version written
atomically (a temporary directory, fsync, rename) and the stable link ``current`` switched to the one served."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from bridge.failpoints import failpoint
from bridge.snapshot.writer import fsync_path

__all__ = ["ADAPTER_FILE", "CONFIG_FILE", "CURRENT_LINK", "point_current", "remove_old_versions", "sync_adapter_dir",
           "write_adapter_dir", "write_safetensors"]

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
CURRENT_LINK = "current"
"""``<root>/<name>/current``: a symlink to the version served, the path real SGLang servers load (:func:`point_current`)."""

def write_adapter_dir(folder: str, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict, *,
                      durable: bool = True) -> str:
    """Write a PEFT adapter directory ``<folder>/v<version>`` atomically (temporary directory, fsync, rename);
    its path. A directory of that version already there (a failed publish's) is replaced.

    The safetensors file is written from the tensors' own bytes (:func:`write_safetensors`: one write for an adapter
    gathered flat); the two files and the temporary directory are fsynced at once, the journal's commits shared.
    ``durable=False``: nothing is fsynced (the directory still appears whole, by the rename): call
    :func:`sync_adapter_dir` before announcing it (:class:`AdapterPublisher` runs it while the servers load it).

    Raises:
        SnapshotError: the write failed (the disk is full, the folder is not writable).
    """
    from bridge.errors import SnapshotError

    final = os.path.join(folder, f"v{version}")
    tmp = os.path.join(folder, f".tmp-v{version}-{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(tmp)
        write_safetensors(os.path.join(tmp, ADAPTER_FILE), tensors, {"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(adapter_config, f, indent=2, sort_keys=True)
        if durable:
            _fsync_all([(os.path.join(tmp, ADAPTER_FILE), False), (os.path.join(tmp, CONFIG_FILE), False), (tmp, True)])
        failpoint("adapter:rename", 0)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        if durable:
            fsync_path(folder, directory=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise SnapshotError(f"could not write adapter version {version} into {folder}: {e}; free space or choose "
                                "another root") from None
        raise
    return final


def sync_adapter_dir(path: str) -> None:
    """Make an adapter directory written with ``durable=False`` durable: its two files, itself and its folder (the
    rename) fsynced at once.

    Raises:
        SnapshotError: an fsync failed.
    """
    from bridge.errors import SnapshotError

    try:
        _fsync_all([(os.path.join(path, ADAPTER_FILE), False), (os.path.join(path, CONFIG_FILE), False), (path, True),
                    (os.path.dirname(path), True)])
    except OSError as e:
        raise SnapshotError(f"could not write adapter directory {path} durably: {e}; free space or choose another "
                            "root") from None


_FSYNCS = ThreadPoolExecutor(3, thread_name_prefix="wsync-adapter-fsync")


def _fsync_all(paths: list[tuple[str, bool]]) -> None:
    """fsync every ``(path, is_directory)`` at once (all but the first on :data:`_FSYNCS`, the first here): the
    filesystem commits them together instead of one after the other. Raises the first OSError."""
    futures = [_FSYNCS.submit(fsync_path, p, directory=d) for p, d in paths[1:]]
    try:
        fsync_path(paths[0][0], directory=paths[0][1])
    finally:
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of ``tensors`` (in their order), written from their own bytes: the header, then each
    tensor's bytes, tensors that lie side by side in one storage in one write (an adapter gathered flat: the whole
    data in one write, no copy). safetensors' ``save_file`` writes anything else (a tensor not on the CPU, a dtype
    outside the format's common ones). Read back by safetensors (and so PEFT and SGLang) as ``save_file``'s."""
    from safetensors.torch import save_file

    items = [(str(n), t.detach()) for n, t in tensors.items()]
    if not items or any(t.device.type != "cpu" or t.dtype not in _ST_DTYPES for _, t in items):
        save_file({n: t.contiguous() for n, t in items}, path, metadata=metadata)
        return
    items = [(n, t.contiguous()) for n, t in items]
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    spans: list[list] = []  # [storage, first byte, end byte]: the data, adjacent tensors merged
    offset = 0
    for n, t in items:
        size = t.numel() * t.element_size()
        header[n] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
        if size == 0:
            continue
        storage, start = t.untyped_storage(), t.storage_offset() * t.element_size()
        if spans and spans[-1][0].data_ptr() == storage.data_ptr() and spans[-1][2] == start:
            spans[-1][2] = start + size
        else:
            spans.append([storage, start, start + size])
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data 8-byte aligned, as safetensors writes it
    with open(path, "wb", buffering=0) as f:
        _write_all(f, len(head).to_bytes(8, "little") + head)
        for storage, start, end in spans:
            _write_all(f, torch.empty(0, dtype=torch.uint8).set_(storage, start, (end - start,)).numpy())


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def point_current(path: str) -> str:
    """Point ``<folder>/current`` at the adapter directory ``path`` (``<folder>/v<version>``): a relative symlink
    renamed over the old one (atomic); the link's path, the stable path real SGLang servers load the adapter by."""
    folder = os.path.dirname(path)
    link = os.path.join(folder, CURRENT_LINK)
    tmp = os.path.join(folder, f".tmp-{CURRENT_LINK}-{uuid.uuid4().hex[:12]}")
    os.symlink(os.path.basename(path), tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_path(folder, directory=True)
    return link


def remove_old_versions(folder: str, keep: int) -> None:
    """Keep the ``keep`` newest ``v<version>`` directories of ``folder``."""
    versions = sorted(int(d[1:]) for d in os.listdir(folder) if d.startswith("v") and d[1:].isdigit())
    for v in versions[:-keep]:
        shutil.rmtree(os.path.join(folder, f"v{v}"), ignore_errors=True)
