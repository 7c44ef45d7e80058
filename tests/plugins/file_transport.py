"""A toy transport from outside the project: each bucket is copied into a plain file, and the reference
server reads it from there.

It shows that a transport is one file: this module registers itself when imported (``WSYNC_PLUGINS``),
and then ``PublisherConfig(transport="file")``, ``wsync train --publish file --file-dir DIR`` and the
fault matrix (``tests/test_faults.py``) use it through the same driver as the project's own, with no
other file changed. The bytes reach the server as the reference server's ``wsync_shm`` entries (a file
path it maps and copies from), so it speaks only to the reference server, on this host.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from dataclasses import dataclass

from bridge.errors import ConfigError
from bridge.protocol import SHM_LOAD_FORMAT
from bridge.transports import SessionOptions, Transport, option, register
from bridge.transports.base import ServerSessions, bucket_answers, is_local, remove_file


@dataclass(kw_only=True)
class FileOptions(SessionOptions):
    file_dir: str | None = option(None, "folder the bucket files go through (default: the temp folder)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.file_dir is not None and not os.path.isdir(self.file_dir):
            raise ConfigError(f"file_dir {self.file_dir!r} is not a folder; create it or leave it out")


@register
class FileTransport(Transport):
    name = "file"
    Options = FileOptions
    source_needs = ("local_digest",)  # not needed to move bytes: here to show the check

    def __init__(self, config, servers):
        super().__init__(config, servers)
        self.dir = config.file_dir or tempfile.gettempdir()
        self.sessions: ServerSessions | None = None
        self._inflight = None  # (k, futures, path)

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        remote = [s for s in config.servers if not is_local(s)]
        if remote:
            raise ConfigError(f"the file transport needs servers on this host; not local: {remote}")

    def begin(self, plan) -> None:
        for c in self.servers.clients:
            c.require_reference_server("buckets in files (the file transport)")
        self.sessions = ServerSessions(self.servers, self.config.pause_mode, self.writer_lease())
        self.sessions.open()

    def send(self, k, bucket, buf, version) -> None:
        path = os.path.join(self.dir, f"wsync-file-{os.getpid()}-{k}")
        with open(path, "wb") as f:
            f.write(memoryview(buf.numpy()))
        entry = {"path": path, "nbytes": bucket.nbytes, **bucket.request_fields(), "pid": os.getpid()}
        entry = base64.b64encode(json.dumps(entry).encode()).decode()
        last = version is not None
        futures = self.servers.submit(lambda c: c.update_weights_from_tensor(
            [entry] * c.tp_size, load_format=SHM_LOAD_FORMAT, flush_cache=last,
            weight_version=str(version) if last and c.can.staged else None, timeout=self.config.http_timeout,
        ))
        self._inflight = (k, futures, path)

    def settle(self) -> None:
        if self._inflight is None:
            return
        (k, futures, path), self._inflight = self._inflight, None
        try:
            bucket_answers(self.servers.clients, futures, k, self.config.http_timeout, "http_timeout")
        finally:
            remove_file(path, "a bucket file")

    def commit(self, plan, reports) -> dict:
        return {"servers": self.sessions.commit(plan.version)}

    def abort(self, reason: str) -> str:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            remove_file(inflight[2], "a bucket file")
        if self.sessions is None:
            return ""
        self.sessions.abort()
        return self.sessions.serving()

    def close(self) -> None:
        if self.sessions is not None:
            self.sessions.close()
