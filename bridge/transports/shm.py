"""Bucket files in this host's shared memory (``/dev/shm``), made by the colocated transport, and their clean-up:
``wsync-<pid>-<uuid>-<k>``, mode 0600, their space reserved before they are mapped (a full tmpfs is an error that
says so, not a SIGBUS); the files of a trainer that was killed are swept at the next start."""

from __future__ import annotations

import errno
import glob
import os
import tempfile
import uuid

import torch

from bridge.errors import ConfigError
from bridge.log import fmt_bytes, get_logger
from bridge.transports.base import remove_file

__all__ = ["PREFIX", "new_file", "remove", "shm_buffer", "shm_dir", "sweep_stale_files"]

logger = get_logger(__name__)

PREFIX = "wsync-"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def new_file(nbytes: int, tag: str, directory: str | None = None) -> str:
    """A new file ``wsync-<pid>-<uuid>-<tag>`` of ``nbytes`` in ``directory`` (default :func:`shm_dir`), its space
    reserved: writing into a mapped sparse file on a full tmpfs is a SIGBUS.

    Raises:
        ConfigError: not enough room there, with the fix.
    """
    directory = directory or shm_dir()
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}-{tag}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        remove(path)
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise ConfigError(
                f"not enough shared memory for a {fmt_bytes(nbytes)} bucket in {directory} "
                f"({fmt_bytes(_free_bytes(directory))} free): "
                "lower bucket_mb (--bucket-mb), or give the container more shared memory (docker --shm-size)"
            ) from e
        raise
    finally:
        os.close(fd)
    return path


def shm_buffer(nbytes: int, k: int, directory: str | None = None) -> tuple[torch.Tensor, str]:
    """A uint8 tensor of ``nbytes`` backed by a new file (:func:`new_file`); (tensor, path)."""
    path = new_file(nbytes, str(k), directory)
    try:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), path
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path
    except BaseException:
        remove(path)
        raise


def sweep_stale_files() -> list[str]:
    """Remove the bucket files left by trainers that no longer run (killed mid-sync); the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(shm_dir(), f"{PREFIX}*-*-*")):
        pid = os.path.basename(path)[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove(path)
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory bucket files left by dead trainers", len(removed))
    return removed


def remove(path: str) -> None:
    """Remove a bucket file if it is still there (a failure is logged, never raised)."""
    remove_file(path, "shared-memory file")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
