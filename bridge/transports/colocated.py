"""Colocated (CPU): trainer and servers on one host, buckets handed over in shared-memory files.

Rank 0 gathers each bucket straight into a file under ``/dev/shm`` (``wsync-<pid>-<uuid>-<k>``, mode
0600, mapped shared) and posts ``/update_weights_from_tensor`` to every server, which copies the bytes
out; the file is unlinked once every server answered, and on any error. CPU tensors cannot be pickled
across HTTP (SGLang issue #4551), so this uses the project's ``load_format="wsync_shm"`` extension,
which only the reference server understands: each serialized entry is base64 of the JSON object
``{"path", "nbytes", "names", "dtypes", "shapes", "pid"}`` (no pickle). ``pid`` is the trainer's: the
server discards a session whose trainer died. Every server URL must be a loopback address.

The space of every bucket file is reserved with ``posix_fallocate`` before it is mapped: a full
``/dev/shm`` (Docker's default is 64 MiB) is an error that says so, not a SIGBUS. Files left by a
trainer that was killed are swept at the next start.
"""

from __future__ import annotations

import base64
import errno
import glob
import json
import os
import tempfile
import uuid

import torch

from bridge.buckets import Bucket
from bridge.errors import ConfigError
from bridge.log import fmt_bytes, get_logger
from bridge.protocol import SHM_LOAD_FORMAT
from bridge.transports.base import Plan, ServerSessions, Transport, bucket_answers

__all__ = ["ColocatedTransport", "sweep_stale_files"]

logger = get_logger(__name__)

PREFIX = "wsync-"


class ColocatedTransport(Transport):
    name = "colocated"

    def __init__(self, config, servers):
        super().__init__(config)
        self.servers = servers
        self.sessions: ServerSessions | None = None
        self._inflight = None  # (k, futures, path)
        self._paths: list[str] = []
        sweep_stale_files()

    def begin(self, plan: Plan) -> None:
        # wsync_shm is a reference-server extension: real SGLang would unpickle the entry and its scheduler die.
        # Refuse before anything is paused, gathered or written (ConfigError naming the server).
        self.servers.map(lambda c: c.require_reference_server(f"the colocated transport (load_format={SHM_LOAD_FORMAT!r})"))
        self.sessions = ServerSessions(self.servers, self.config.pause_mode)
        self.sessions.open()

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        buf, path = shm_buffer(bucket.nbytes, k)
        self._paths.append(path)
        return buf

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        cfg, last, path = self.config, version is not None, self._paths[-1]
        entry = {"path": path, "nbytes": bucket.nbytes, **bucket.request_fields(), "pid": os.getpid()}
        entry = base64.b64encode(json.dumps(entry).encode()).decode()
        futures = self.servers.submit(
            lambda c: c.update_weights_from_tensor(
                [entry] * c.tp_size, load_format=SHM_LOAD_FORMAT, flush_cache=last,
                weight_version=str(version) if last else None, timeout=cfg.http_timeout,
            )
        )
        self._inflight = (k, futures, path)

    def settle(self) -> None:
        if self._inflight is None:
            return
        (k, futures, path), self._inflight = self._inflight, None
        try:
            bucket_answers(self.servers.clients, futures, k, self.config.http_timeout, "http_timeout")
        finally:
            # Every server answered (or gave up on) this bucket: it copied the bytes out already.
            self._unlink(path)

    def commit(self, plan: Plan) -> dict:
        return {"servers": self.sessions.commit()}

    def abort(self, reason: str) -> str:
        self._inflight = None
        for p in list(self._paths):
            self._unlink(p)
        if self.sessions is None:
            return ""
        self.sessions.abort()
        return self.sessions.serving()

    def close(self) -> None:
        for p in list(self._paths):
            self._unlink(p)
        if self.sessions is not None:
            self.sessions.close()

    def _unlink(self, path: str) -> None:
        if path in self._paths:
            self._paths.remove(path)
        _unlink(path)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shm_buffer(nbytes: int, k: int, directory: str | None = None) -> tuple[torch.Tensor, str]:
    """A uint8 tensor of ``nbytes`` backed by a new file in ``directory`` (default :func:`shm_dir`)
    whose space is reserved; (tensor, path)."""
    directory = directory or shm_dir()
    path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}-{k}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            # Reserve the pages now: writing into a mapped sparse file on a full tmpfs is a SIGBUS.
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        _unlink(path)
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise ConfigError(
                f"not enough shared memory for a {fmt_bytes(nbytes)} bucket in {directory} "
                f"({fmt_bytes(_free_bytes(directory))} free): "
                "lower bucket_mb (--bucket-mb), or give the container more shared memory (docker --shm-size)"
            ) from e
        raise
    os.close(fd)
    try:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), path
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path
    except BaseException:
        _unlink(path)
        raise


def sweep_stale_files() -> list[str]:
    """Remove bucket files left by trainers that no longer run (killed mid-sync); the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(shm_dir(), f"{PREFIX}*-*-*")):
        pid = os.path.basename(path)[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            _unlink(path)
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory bucket files left by dead trainers", len(removed))
    return removed


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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove shared-memory file %s: %s", path, e)
