"""Colocated: trainer and servers on one host, buckets handed over by reference through ``/update_weights_from_tensor``.

Which way a bucket goes depends on the servers, decided in ``begin`` before anything is paused or moved:

* **The project's reference server** (it says so in its server info): shared-memory files. Rank 0 gathers
  each bucket straight into a file under ``/dev/shm`` (``wsync-<pid>-<uuid>-<k>``, mode 0600, mapped
  shared) and posts it to every server, which copies the bytes out; the file is unlinked once every server
  answered, and on any error. CPU tensors cannot be pickled across HTTP (SGLang issue #4551), so this uses
  the project's ``load_format="wsync_shm"`` extension, which only the reference server understands: each
  serialized entry is base64 of the JSON object ``{"path", "nbytes", "names", "dtypes", "shapes", "pid"}``
  (no pickle). ``pid`` is the trainer's: the server discards a session whose trainer died. The space of
  every bucket file is reserved with ``posix_fallocate`` before it is mapped: a full ``/dev/shm``
  (Docker's default is 64 MiB) is an error that says so, not a SIGBUS. Files left by a trainer that was
  killed are swept at the next start.
* **Real SGLang >= 0.5.6 and a trainer with CUDA**: CUDA IPC. Rank 0 gathers each bucket into a buffer on
  its current CUDA device and posts SGLang's own payload (:mod:`bridge.transports.cuda_ipc`: a flattened
  bucket, ``load_format="flattened_bucket"``, or with ``load_format="per_tensor"`` a list of named views;
  one entry per TP rank, built with SGLang's serializer from the trainer host's SGLang installation). The
  buffer is kept until every server answered. **Not yet run on a GPU**: the payload is checked by SGLang's
  own code on CPU only (``tests/test_cuda_ipc.py``; its ``gpu`` tests run it end to end on a CUDA host).
* **Anything else** is a ConfigError before any byte moves: real SGLang without CUDA here (it would unpickle
  a ``wsync_shm`` entry in its scheduler and die; use ``broadcast`` or ``disk``), SGLang older than 0.5.6
  (no flattened buckets, other module paths in the pickle), no SGLang importable on the trainer host, or a
  mix of reference and real servers in one publisher.

Every server URL must be a loopback address.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
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
from bridge.transports import cuda_ipc
from bridge.transports.base import (
    Plan,
    ServerSessions,
    SessionOptions,
    Transport,
    bucket_answers,
    is_local,
    remove_file,
)
from bridge.transports.registry import register

__all__ = ["ColocatedTransport", "sweep_stale_files"]

logger = get_logger(__name__)

PREFIX = "wsync-"


@register
class ColocatedTransport(Transport):
    name = "colocated"
    Options = SessionOptions
    encodings = ("full", "delta")

    def __init__(self, config, servers):
        super().__init__(config, servers)
        self.device: torch.device | None = None  # the buckets' CUDA device for real SGLang; None: shm files
        self._inflight = None  # (k, futures, path or CUDA buffer)
        self._paths: list[str] = []
        sweep_stale_files()

    @staticmethod
    def check_servers(config, urls) -> None:
        """Every server local (also the ones found in a registry, checked at each sync's begin)."""
        remote = [s for s in urls if not is_local(s)]
        if remote:
            raise ConfigError(
                f"the colocated transport hands weights over in this host's shared memory, so every server must "
                f"be local (a loopback URL such as http://127.0.0.1:30000); not local: {', '.join(remote)}; "
                "for servers on other hosts use the broadcast transport (wsync train --publish broadcast) or disk"
            )

    def begin(self, plan: Plan) -> None:
        self.check_servers(self.config, self.servers.urls)
        self.device = self._choose_device()
        self.sessions = ServerSessions(self.servers, self.config.pause_mode, self.writer_lease())
        self.sessions.open()

    def _choose_device(self) -> torch.device | None:
        """None (shared-memory files) when every server is the reference server, the CUDA device for real
        SGLang; a ConfigError naming the server and the fix otherwise. Reads server info only."""
        reference = self.servers.map(lambda c: c.is_reference_server)
        if all(reference):
            return None
        real = [c for c, ref in zip(self.servers.clients, reference) if not ref]
        if any(reference):
            raise ConfigError(
                f"the colocated transport mixes the wsync reference server (shared-memory files) with real SGLang "
                f"(CUDA IPC) at {[c.url for c in real]}; publish to each kind with a publisher of its own"
            )
        need = ".".join(map(str, cuda_ipc.MIN_RELEASE))
        for c in real:
            if c.features.release < cuda_ipc.MIN_RELEASE:
                raise ConfigError(
                    f"{c.url} runs SGLang {c.version}; the colocated transport hands real SGLang its weights as "
                    f"flattened buckets of CUDA IPC handles, which needs SGLang >= {need} on the server (older "
                    "releases cannot decode the payload); upgrade it, or use transport='broadcast' or 'disk'"
                )
        if not torch.cuda.is_available():
            # Real SGLang takes co-located weights only as CUDA IPC handles; wsync_shm would kill its scheduler.
            real[0].require_reference_server(
                f"the colocated transport's shared-memory buckets (load_format={SHM_LOAD_FORMAT!r}), and this "
                "trainer has no CUDA device for CUDA IPC"
            )
        cuda_ipc.sglang_code()  # importable here, before anything is paused
        return torch.device("cuda", torch.cuda.current_device())

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        if self.device is not None:
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        buf, path = shm_buffer(bucket.nbytes, k)
        self._paths.append(path)
        return buf

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        cfg, last = self.config, version is not None
        if self.device is not None:
            flattened = cfg.load_format != "per_tensor"
            entries = {c.url: cuda_ipc.serialize_bucket(bucket, buf, c.tp_size, flattened) for c in self.servers.clients}
            load_format, held = (cuda_ipc.FLATTENED if flattened else None), buf
        else:
            entry = {"path": self._paths[-1], "nbytes": bucket.nbytes, **bucket.request_fields(), "pid": os.getpid()}
            entry = base64.b64encode(json.dumps(entry).encode()).decode()
            entries = {c.url: [entry] * c.tp_size for c in self.servers.clients}
            load_format, held = SHM_LOAD_FORMAT, self._paths[-1]
        futures = self.servers.submit(
            lambda c: c.update_weights_from_tensor(
                entries[c.url], load_format=load_format, flush_cache=last,
                weight_version=str(version) if last and c.stages_updates else None, timeout=cfg.http_timeout,
            )
        )
        # The file (or the CUDA buffer the IPC handles point at) lives until every server answered.
        self._inflight = (k, futures, held)

    def settle(self) -> None:
        if self._inflight is None:
            return
        (k, futures, held), self._inflight = self._inflight, None
        try:
            bucket_answers(self.servers.clients, futures, k, self.config.http_timeout, "http_timeout")
        finally:
            # Every server answered (or gave up on) this bucket: it copied the bytes out already.
            if isinstance(held, str):
                self._unlink(held)

    def commit(self, plan: Plan, reports: list) -> dict:
        return {"servers": self.sessions.commit(plan.version)}

    def abort(self, reason: str) -> str:
        inflight, self._inflight = self._inflight, None
        if inflight is not None and isinstance(inflight[2], torch.Tensor):
            # A server may still be reading the CUDA buffer; torch's contract is that the producer keeps a
            # shared CUDA tensor while a consumer uses it. Each call is bounded by http_timeout.
            cf.wait(inflight[1], timeout=self.config.http_timeout)
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
    remove_file(path, "shared-memory file")
