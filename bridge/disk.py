"""The disk transport, rank 0's side: write an HF snapshot, announce it, optionally wait for servers.

Used by :class:`bridge.publisher.WeightPublisher` for ``transport="disk"``. The order is what makes
it safe: the snapshot is complete, fsynced and renamed into place *before* the announcement is added,
so a version that is announced can always be loaded, and a version that failed is never announced.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import torch

from bridge.errors import BridgeError, SnapshotError, VersionError
from bridge.log import get_logger
from bridge.tensors import dtype_from_str

logger = get_logger(__name__)

__all__ = ["DiskPublisher"]


class DiskPublisher:
    """Holds the name-resolution client and snapshot root of one publisher (rank 0 does the I/O)."""

    def __init__(self, config, rank: int):
        from bridge.name_resolve import DEFAULT_URL, make_name_resolve, names
        from bridge.publisher import default_snapshot_root

        self.config = config
        self.rank = rank
        self.root = config.snapshot_root or default_snapshot_root()
        # The same default as `wsync watch`, so a trainer and a watcher on one machine meet with no flags.
        self.url = config.name_resolve or DEFAULT_URL
        self.names = names
        self.nr = None
        if rank == 0:
            os.makedirs(self.root, exist_ok=True)
            self.nr = make_name_resolve(self.url)
            # A liveness key: it vanishes within its TTL when this trainer dies, so watchers and
            # operators can tell a dead publisher from a slow one. Announcements themselves are permanent.
            self.nr.add(self._key("publisher"), f"{socket.gethostname()}:{os.getpid()}", ttl=10, keepalive=True, replace=True)

    def _key(self, leaf: str) -> str:
        return f"{self.names.trial_root(self.config.experiment, self.config.trial)}/{leaf}"

    def announced_versions(self) -> list[int]:
        prefix = self.names.update_weights_from_disk_root(self.config.experiment, self.config.trial)
        versions = (self.names.version_of(k) for k in self.nr.find_subtree(prefix))
        return sorted(v for v in versions if v is not None)

    def check_version(self, version: int) -> None:
        """Refuse a version older than the newest announced one (an equal one is checked by content)."""
        versions = self.announced_versions()
        if versions and version < versions[-1]:
            raise VersionError(
                f"version {version} is older than version {versions[-1]} already announced for "
                f"{self.config.experiment}/{self.config.trial}; versions must strictly increase"
            )

    def write_and_announce(self, version: int, stream: Iterator[tuple[str, torch.Tensor | None]],
                           source) -> dict | None:
        """Collective: every rank drains ``stream``; rank 0 writes, announces and returns the outcome."""
        if self.rank != 0:
            for _ in stream:
                pass
            return None
        from bridge.name_resolve import Announcement
        from bridge.snapshot import gc_snapshots, write_snapshot

        phases: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            info = write_snapshot(
                self.root, version, stream, config=_model_config(source), tokenizer=getattr(source, "tokenizer", None),
                dtype=dtype_from_str(self.config.serving_dtype),
            )
        except SnapshotError as e:
            for _ in stream:  # keep the other ranks' gathers going to the end
                pass
            if "exists" in str(e):
                raise VersionError(f"version {version} was already published with different weights ({e})") from e
            raise
        phases["write"] = time.perf_counter() - t0
        retried = bool(getattr(info, "existed", False))
        t1 = time.perf_counter()
        ann = Announcement(version=version, path=info.path, manifest_sha256=info.manifest_sha256,
                           total_bytes=info.total_bytes, created_at=time.time())
        key = self.names.update_weights_from_disk(self.config.experiment, self.config.trial, version)
        ttl = self.config.announce_ttl
        self.nr.add(key, ann.to_json(), ttl=ttl, keepalive=ttl is not None, replace=True)
        phases["announce"] = time.perf_counter() - t1
        logger.info("announced version %d at %s (%s)", version, key, info.path)
        servers = {}
        if self.config.wait_loaded and self.config.servers:
            t2 = time.perf_counter()
            servers = self._wait_loaded(version)
            phases["load"] = time.perf_counter() - t2
        try:
            gc_snapshots(self.root, keep=self.config.keep_snapshots, protect=[version])
        except (OSError, BridgeError) as e:
            logger.warning("garbage collection of old snapshots failed: %s", e)
        failed = {u: s for u, s in servers.items() if s != "ok"}
        return {
            "error": f"servers did not load version {version}: {failed}" if failed else None,
            "bytes": info.total_bytes, "path": info.path, "servers": servers, "retried": retried, "phases": phases,
        }

    def _wait_loaded(self, version: int) -> dict[str, str]:
        """Wait (bounded) until every configured server reports ``version``."""
        from bridge.client import ServerClient

        want = str(version)
        clients = [ServerClient(u, api_key=self.config.api_key, timeout=self.config.http_timeout) for u in self.config.servers]
        status = {c.url: "waiting" for c in clients}
        deadline = time.monotonic() + self.config.wait_loaded_timeout
        delay = 0.01
        while time.monotonic() < deadline:
            for c in clients:
                if status[c.url] == "ok":
                    continue
                try:
                    seen = str(c.model_info().get("weight_version"))
                except BridgeError as e:
                    status[c.url] = f"unreachable: {e}"
                    continue
                status[c.url] = "ok" if seen == want else f"serves version {seen}"
            if all(s == "ok" for s in status.values()):
                break
            time.sleep(delay)
            delay = min(0.2, delay * 2)
        return {u: (s if s == "ok" else f"did not load version {want} within {self.config.wait_loaded_timeout:.0f} s ({s})")
                for u, s in status.items()}

    def close(self) -> None:
        if self.nr is not None:
            try:
                self.nr.delete(self._key("publisher"))
            except BridgeError:
                pass
            self.nr.close()
            self.nr = None


def _model_config(source):
    for obj in (source, getattr(source, "module", None), getattr(source, "model", None)):
        cfg = getattr(obj, "model_config", None) or getattr(obj, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
    return None
