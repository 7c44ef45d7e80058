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
* **Real SGLang and a trainer without CUDA** (SGLang on its CPU engine, on this host): named shared memory
  (:mod:`bridge.transports.shared_tensors`). Rank 0 gathers each bucket into one of two reused segments and
  posts SGLang's plain payload, the bucket's tensors as views of that segment pickled by name
  (``load_format`` unset), which SGLang's scheduler maps and loads without a copy. Any SGLang release; no
  SGLang needed on the trainer's side.
* **Anything else** is a ConfigError before any byte moves: CUDA IPC into SGLang older than 0.5.6 (no
  flattened buckets, other module paths in the pickle) or without SGLang importable on the trainer host, or a
  mix of reference and real servers in one publisher.

Every server URL must be a loopback address.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import os

import torch

from bridge.buckets import Bucket
from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.protocol import SHM_LOAD_FORMAT
from bridge.transports import cuda_ipc
from bridge.transports.base import (
    Plan,
    ServerSessions,
    SessionOptions,
    Transport,
    bucket_answers,
    is_local,
)
from bridge.transports.registry import register
from bridge.transports.shared_tensors import SharedBuckets
from bridge.transports.shm import remove, shm_buffer, sweep_stale_files

__all__ = ["ColocatedTransport", "shm_buffer", "sweep_stale_files"]

logger = get_logger(__name__)

SHARED_MIN_RELEASE = (0, 5, 1)
"""The first SGLang release that loads the tensors it is handed on its own device (earlier ones move them to CUDA)."""

@register
class ColocatedTransport(Transport):
    name = "colocated"
    Options = SessionOptions
    encodings = ("full", "delta")

    def __init__(self, config, servers):
        super().__init__(config, servers)
        self.handover = "files"  # files (reference server), cuda_ipc or shared (real SGLang): see _choose_handover
        self.device: torch.device | None = None  # the buckets' CUDA device (cuda_ipc)
        self._shared: SharedBuckets | None = None  # the two reused segments (shared)
        self._inflight = None  # (k, futures, path or buffer)
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
        self.handover = self._choose_handover()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.handover == "cuda_ipc" else None
        if self.handover == "shared" and self._shared is None:
            self._shared = SharedBuckets()
        self.sessions = ServerSessions(self.servers, self.config.pause_mode, self.writer_lease())
        self.sessions.open()

    def _choose_handover(self) -> str:
        """``files`` when every server is the reference server; for real SGLang ``cuda_ipc`` from a trainer with
        CUDA, ``shared`` from one without; a ConfigError naming the server and the fix otherwise. Reads server
        info only."""
        reference = self.servers.map(lambda c: c.can.colocated == "files")
        if all(reference):
            return "files"
        real = [c for c, ref in zip(self.servers.clients, reference) if not ref]
        if any(reference):
            raise ConfigError(
                f"the colocated transport mixes the wsync reference server (shared-memory files) with real SGLang "
                f"(CUDA IPC) at {[c.url for c in real]}; publish to each kind with a publisher of its own"
            )
        if not torch.cuda.is_available():  # SGLang on its CPU engine, on this host (every URL is a loopback one)
            for c in real:
                if c.features.release < SHARED_MIN_RELEASE:
                    raise ConfigError(
                        f"{c.url} runs SGLang {c.version}, which moves every tensor it is handed to a CUDA device; "
                        f"a trainer without CUDA hands real SGLang its weights in shared memory, which needs SGLang >= "
                        f"{'.'.join(map(str, SHARED_MIN_RELEASE))}; upgrade it, or use transport='broadcast' or 'disk'"
                    )
            return "shared"
        need = ".".join(map(str, cuda_ipc.MIN_RELEASE))
        for c in real:
            if c.features.release < cuda_ipc.MIN_RELEASE:
                raise ConfigError(
                    f"{c.url} runs SGLang {c.version}; the colocated transport hands real SGLang its weights as "
                    f"flattened buckets of CUDA IPC handles, which needs SGLang >= {need} on the server (older "
                    "releases cannot decode the payload); upgrade it, or use transport='broadcast' or 'disk'"
                )
        cuda_ipc.sglang_code()  # importable here, before anything is paused
        return "cuda_ipc"

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        if self.handover == "cuda_ipc":
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        if self.handover == "shared":
            return self._shared.buffer(k, bucket.nbytes)
        buf, path = shm_buffer(bucket.nbytes, k)
        self._paths.append(path)
        return buf

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        cfg, last = self.config, version is not None
        if self.handover == "cuda_ipc":
            flattened = cfg.load_format != "per_tensor"
            entries = {c.url: cuda_ipc.serialize_bucket(bucket, buf, c.tp_size, flattened) for c in self.servers.clients}
            load_format, held = (cuda_ipc.FLATTENED if flattened else None), buf
        elif self.handover == "shared":
            entries = {c.url: self._shared.serialize(bucket, buf, c.tp_size) for c in self.servers.clients}
            load_format, held = None, buf
        else:
            entry = {"path": self._paths[-1], "nbytes": bucket.nbytes, **bucket.request_fields(), "pid": os.getpid()}
            entry = base64.b64encode(json.dumps(entry).encode()).decode()
            entries = {c.url: [entry] * c.tp_size for c in self.servers.clients}
            load_format, held = SHM_LOAD_FORMAT, self._paths[-1]
        futures = self.servers.submit(
            lambda c: c.update_weights_from_tensor(
                entries[c.url], load_format=load_format, flush_cache=last,
                weight_version=str(version) if last and c.can.staged else None, timeout=cfg.http_timeout,
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
        if self._shared is not None and inflight is not None and not all(f.done() for f in inflight[1]):
            self._shared.set_aside()  # a server that has not answered may still read them: never written again
        if inflight is not None and self.handover == "cuda_ipc":
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
        if self._shared is not None:
            self._shared.close()
        if self.sessions is not None:
            self.sessions.close()

    def _unlink(self, path: str) -> None:
        if path in self._paths:
            self._paths.remove(path)
        remove(path)
