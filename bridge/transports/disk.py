"""Disk: an HF snapshot written bucket by bucket, announced in name resolution once complete.

``begin`` checks the version against the newest one announced for (experiment, trial), checks that
the servers to wait for answer (a dead server fails the publish now, not after ``wait_loaded_timeout``),
and opens a :class:`bridge.snapshot.SnapshotWriter` under a temporary name. ``send`` writes the bucket's
tensors (shards are closed at the bucket size, so rank 0 holds at most about two buckets). ``commit``
finishes the snapshot (fsync, rename into ``<root>/v<version>``), then announces it under
``<root>/<experiment>/<trial>/update_weights_from_disk/<version>``, optionally waits until every server
reports the version, and garbage-collects old snapshots. ``abort`` removes the temporary directory:
a version that was not complete is never announced, and one that was announced can be loaded.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import BridgeError, ServerError, SnapshotError, SyncError, VersionError
from bridge.log import get_logger
from bridge.tensors import dtype_from_str
from bridge.transports.base import Plan, Transport

__all__ = ["DiskTransport", "default_snapshot_root"]

logger = get_logger(__name__)

UNREACHABLE_GRACE_S = 3.0
"""A server that refuses connections for this long while we wait for it to load is reported dead."""


def default_snapshot_root() -> str:
    return os.path.join(tempfile.gettempdir(), "wsync-snapshots")


class DiskTransport(Transport):
    name = "disk"

    def __init__(self, config, servers):
        from bridge.name_resolve import DEFAULT_URL, make_name_resolve, names

        super().__init__(config)
        self.servers = servers
        self.root = config.snapshot_root or default_snapshot_root()
        # The same default as `wsync watch`, so a trainer and a watcher on one machine meet with no flags.
        self.url = config.name_resolve or DEFAULT_URL
        self.names = names
        self.writer = None
        os.makedirs(self.root, exist_ok=True)
        self.nr = make_name_resolve(self.url)
        # A liveness key: it vanishes within its TTL when this trainer dies, so watchers and operators
        # can tell a dead publisher from a slow one. Announcements themselves are permanent.
        self.nr.add(self._key("publisher"), f"{socket.gethostname()}:{os.getpid()}", ttl=10, keepalive=True, replace=True)

    @classmethod
    def commit_seconds(cls, config) -> float:
        return 3 * config.http_timeout + (config.wait_loaded_timeout if config.wait_loaded else 0.0)

    def _key(self, leaf: str) -> str:
        return f"{self.names.trial_root(self.config.experiment, self.config.trial)}/{leaf}"

    def announced_versions(self) -> list[int]:
        prefix = self.names.update_weights_from_disk_root(self.config.experiment, self.config.trial)
        versions = (self.names.version_of(k) for k in self.nr.find_subtree(prefix))
        return sorted(v for v in versions if v is not None)

    # ------------------------------------------------------------------ lifecycle

    def begin(self, plan: Plan) -> None:
        from bridge.snapshot import SnapshotWriter

        versions = self.announced_versions()
        if versions and plan.version < versions[-1]:
            raise VersionError(
                f"version {plan.version} is older than version {versions[-1]} already announced for "
                f"{self.config.experiment}/{self.config.trial} in {self.url}; publish version {versions[-1] + 1} "
                "or later, or use another trial"
            )
        if self.config.wait_loaded and self.servers is not None:
            self.servers.model_info()  # a server that is down fails the publish before anything is written
        self.writer = SnapshotWriter(
            self.root, plan.version, config=_model_config(plan.source), tokenizer=getattr(plan.source, "tokenizer", None),
            dtype=dtype_from_str(self.config.serving_dtype), max_shard_bytes=max(1, self.config.bucket_bytes),
        )
        self._t_write = time.perf_counter()

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        # The writer holds these views of ``buf`` until their shard is written (at the next bucket at
        # the latest, shards being bucket-sized): at most about two buckets alive on rank 0.
        for name, tensor in unflatten_bucket(buf, bucket.specs):
            self.writer.add(name, tensor)

    def commit(self, plan: Plan) -> dict:
        from bridge.name_resolve import Announcement
        from bridge.snapshot import gc_snapshots

        writer, self.writer = self.writer, None
        try:
            info = writer.finish()
        except SnapshotError as e:
            if "different content" in str(e):
                raise VersionError(f"version {plan.version} was already published with different weights; "
                                   f"publish them under a higher version ({e})") from e
            raise
        plan.phases["write"] = time.perf_counter() - self._t_write
        t = time.perf_counter()
        ann = Announcement(version=plan.version, path=info.path, manifest_sha256=info.manifest_sha256,
                           total_bytes=info.total_bytes, created_at=time.time())
        key = self.names.update_weights_from_disk(self.config.experiment, self.config.trial, plan.version)
        ttl = self.config.announce_ttl
        self.nr.add(key, ann.to_json(), ttl=ttl, keepalive=ttl is not None, replace=True)
        plan.phases["announce"] = time.perf_counter() - t
        logger.info("announced version %d at %s (%s)", plan.version, key, info.path)
        servers = {}
        if self.config.wait_loaded and self.servers is not None:
            t = time.perf_counter()
            servers = self._wait_loaded(plan.version)
            plan.phases["load"] = time.perf_counter() - t
        try:
            gc_snapshots(self.root, keep=self.config.keep_snapshots, protect=[plan.version])
        except (OSError, BridgeError) as e:
            logger.warning("garbage collection of old snapshots failed: %s", e)
        failed = {u: s for u, s in servers.items() if s != "ok"}
        if failed:
            # The version is announced and complete: a watcher will still load it. Say so.
            raise SyncError(f"version {plan.version} is announced at {info.path}, but servers did not load it: {failed}")
        return {"servers": servers, "path": info.path, "retried": bool(getattr(info, "existed", False)),
                "bytes": info.total_bytes}

    def abort(self, reason: str) -> str:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.abort()
            return "nothing was announced; the temporary snapshot of this version was removed"
        return ""

    def close(self) -> None:
        if self.writer is not None:
            self.abort("closed")
        try:
            self.nr.delete(self._key("publisher"))
        except BridgeError:
            pass
        self.nr.close()

    # ------------------------------------------------------------------ waiting for the servers

    def _wait_loaded(self, version: int) -> dict[str, str]:
        """Wait (bounded) until every server reports ``version``; a server that stays unreachable for
        :data:`UNREACHABLE_GRACE_S` is reported at once instead of after the whole timeout."""
        want, cfg = str(version), self.config
        status = {c.url: "waiting" for c in self.servers.clients}
        down_since: dict[str, float] = {}
        deadline = time.monotonic() + cfg.wait_loaded_timeout
        delay = 0.01
        while time.monotonic() < deadline:
            for c in self.servers.clients:
                if status[c.url] in ("ok",) or status[c.url].startswith("unreachable for"):
                    continue
                try:
                    seen = str(c.model_info().get("weight_version"))
                except ServerError as e:
                    since = down_since.setdefault(c.url, time.monotonic())
                    if e.status is None and time.monotonic() - since >= UNREACHABLE_GRACE_S:
                        status[c.url] = f"unreachable for {UNREACHABLE_GRACE_S:g} s: {e}"
                    continue
                down_since.pop(c.url, None)
                status[c.url] = "ok" if seen == want else f"serves version {seen}"
            if all(s == "ok" or s.startswith("unreachable for") for s in status.values()):
                break
            time.sleep(delay)
            delay = min(0.2, delay * 2)
        return {u: (s if s == "ok" or s.startswith("unreachable for") else
                    f"did not load version {want} within wait_loaded_timeout={cfg.wait_loaded_timeout:g} s ({s})")
                for u, s in status.items()}


def _model_config(source):
    for obj in (source, getattr(source, "module", None), getattr(source, "model", None)):
        cfg = getattr(obj, "model_config", None) or getattr(obj, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
    return None
