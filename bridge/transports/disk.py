"""Disk: an HF snapshot written bucket by bucket, announced in name resolution once complete.

``begin`` (rank 0) checks the version against the newest one announced for (experiment, trial), checks
that the servers to wait for answer (a dead server fails the publish now, not after
``wait_loaded_timeout``), and opens a :class:`bridge.snapshot.SnapshotWriter` under a temporary name.

Who writes the shards (``PublisherConfig.disk_writers``):

- ``"all"`` (default): every trainer rank writes a share. Bucket ``k`` is owned by rank
  ``k % world_size`` (:meth:`bridge.transports.shard_writer.ShardWriter.owner`); the bucket's full tensors are gathered to its owner
  (not to rank 0), and the owner's :class:`~bridge.transports.shard_writer.ShardWriter` writes them, in a background thread, as shard
  ``k + 1`` of ``n`` straight under its final HF name into the temporary directory, while the ranks
  gather the next buckets. The write bandwidth grows with the ranks (and writes overlap gathers), and a
  rank holds at most the shard it writes plus the bucket it gathers (it waits for its previous write
  before gathering a bucket it owns; ``scripts/bench_disk_writers.py`` compares it with the rank-0 writer). A source whose ``gather_bucket`` takes no ``dst`` has
  every bucket gathered to rank 0, which then writes them all (still in the background). Each rank reports its files (name, size, checksum, tensors with their checksums) at settle,
  through the agreement; rank 0 records them (``SnapshotWriter.add_shard``, which checks that every file
  is there with its size), then commits as below. **The ranks must share the snapshot root**: one
  host, or a shared filesystem mounted at the same path on every trainer host; a rank that does not
  see the temporary directory fails the sync with a ConfigError at its first bucket.
- ``"rank0"``: every bucket is gathered to rank 0, whose writer streams it into bucket-sized shards
  (rank 0 holds at most about two buckets); the other ranks write nothing. For trainer hosts without a
  shared filesystem.

A failed write on any rank (``WSYNC_FAILPOINTS="write:<k>@<rank>=OSError"`` injects one inside the write
of bucket ``k``'s shard, after its file was created) fails the bucket step or the settle of that rank, so every
rank raises the same error; every rank then stops its writer and removes its files, and only after all
have (one more exchange) rank 0 removes the temporary directory: nothing is announced, nothing is left.

``commit`` (rank 0) finishes the snapshot (index, manifest with checksums, fsync, rename into
``<root>/v<version>``), then announces it under ``<root>/<experiment>/<trial>/update_weights_from_disk/<version>``,
optionally waits until every server reports the version (a server whose watcher reports that it could
not load it fails at once with the watcher's reason; when no server loaded it and none will -- every
watcher registered for the trial failed it, or none is registered -- the announcement and the snapshot are
withdrawn and the publish fails: :meth:`DiskTransport._wait_loaded`), and garbage-collects old snapshots, withdrawing
each one's announcement first. ``abort`` removes the temporary directory: a version that was not complete is
never announced, and one that was announced can be loaded. Nothing of a failed publish blocks its retry: a
failed announce removes the snapshot it had renamed into place, and ``begin`` removes a final directory of
the version that was never announced (a publish that died between rename and announce).

Both ways of writing give the same files on disk, byte for byte the same format.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import (
    BridgeError,
    ConfigError,
    ServerError,
    SnapshotConflict,
    SyncError,
    VersionError,
)
from bridge.failpoints import failpoint
from bridge.log import get_logger
from bridge.name_resolve import DEFAULT_URL
from bridge.tensors import dtype_from_str
from bridge.transports.base import Plan, Transport, option
from bridge.transports.registry import register
from bridge.transports.shard_writer import ShardWriter
from bridge.transports.sink import Sink, TransportSink

__all__ = ["DiskOptions", "DiskTransport", "default_snapshot_root"]

logger = get_logger(__name__)

UNREACHABLE_GRACE_S = 3.0
"""A server that refuses connections for this long while we wait for it to load is reported dead."""
MAX_LINEAGE = 100
"""Publishers of one run remembered in its lineage (a restarted trainer continues the run it follows)."""
NO_WATCHER_GRACE_S = 5.0
"""With no watcher registered for the trial for this long (``wsync watch`` registers within a second of its
start), the wait for the servers ends: nobody would load the version."""


def default_snapshot_root(experiment: str | None = None, trial: str | None = None) -> str:
    """``<temp>/wsync_<user>/snapshots``, the reference server's default ``--disk-root`` (per user, as the
    default name resolution: two users never share a default); with ``experiment`` and ``trial``, the
    publisher's default snapshot root, one folder per trial under it (versions are ``v<N>`` directories
    and old ones are collected, so two trials must never share a root)."""
    from bridge.name_resolve import user_folder

    base = os.path.join(user_folder(), "snapshots")
    if experiment is None and trial is None:
        return base
    for what, name in (("experiment", experiment), ("trial", trial)):
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
            raise ConfigError(f"{what} {name!r} cannot name a snapshot folder; use a name without '/' that is not '.' or '..'")
    return os.path.join(base, experiment, trial)


@dataclass(kw_only=True)
class DiskOptions:
    """The disk transport's options: where snapshots go, where they are announced, whom to wait for."""

    name_resolve: str | None = option(None, "name resolution for announcements: etcd://host:port, file:///path "
                                            f"or memory:// (default: {DEFAULT_URL}); `wsync watch` follows the same",
                                      metavar="URL")
    snapshot_root: str | None = option(None, "folder that receives one v<version> snapshot per version, one per "
                                             "trial (default: "
                                             f"{os.path.join(default_snapshot_root(), '<experiment>', '<trial>')})",
                                       metavar="DIR")
    keep_snapshots: int = option(3, "snapshots kept on disk, the newest ones; older ones are garbage-collected")
    wait_loaded: bool = option(True, "wait until every server in --server reports the new version")
    wait_loaded_timeout: float = option(120.0, "seconds to wait for the servers to load an announced version")
    announce_ttl: float | None = option(None, "TTL of announcements in seconds, kept alive while the publisher "
                                              "lives (default: permanent)")
    disk_writers: str = option("all", "all: every trainer rank writes a share of the shards (the ranks must "
                                      "share snapshot_root: one host or a shared filesystem); rank0: rank 0 "
                                      "writes them all")

    def __post_init__(self) -> None:
        if self.disk_writers not in ("all", "rank0"):
            raise ConfigError(f"disk_writers must be all or rank0, got {self.disk_writers!r}")
        if self.keep_snapshots < 1:
            raise ConfigError(f"keep_snapshots must be >= 1, got {self.keep_snapshots}")
        if not self.wait_loaded_timeout > 0:
            raise ConfigError(f"wait_loaded_timeout must be a positive number of seconds, got {self.wait_loaded_timeout}")
        if self.announce_ttl is not None and not self.announce_ttl > 0:
            raise ConfigError(f"announce_ttl must be a positive number of seconds or None, got {self.announce_ttl}")


@register
class DiskTransport(Transport):
    name = "disk"
    Options = DiskOptions
    needs_servers = False  # the snapshot is announced; servers in the config are only waited for
    sets_labels = False  # a watcher loads each version: the snapshot is the record of what it holds
    gives_back_early = False  # the temporary snapshot goes only once every rank's writer has stopped

    def __init__(self, config, servers):
        from bridge.name_resolve import DEFAULT_URL, make_name_resolve, names

        super().__init__(config, servers)
        self.root = config.snapshot_root or default_snapshot_root(config.experiment, config.trial)
        # The same default as `wsync watch`, so a trainer and a watcher on one machine meet with no flags.
        self.url = config.name_resolve or DEFAULT_URL
        self.names = names
        self.writer = None
        os.makedirs(self.root, exist_ok=True)
        self.nr = make_name_resolve(self.url)
        # A liveness key: it vanishes within its TTL when this trainer dies, so watchers and operators
        # can tell a dead publisher from a slow one. Announcements themselves are permanent.
        self.nr.add(self._key("publisher"), f"{socket.gethostname()}:{os.getpid()}", ttl=10, keepalive=True, replace=True)
        # This publisher's run: it continues the trial's run (a restarted trainer), or with new_run starts a
        # new one; a watcher loads only the announcements of the current lineage, never what an earlier run
        # of the same names left behind.
        self.run = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        run_key = self.names.run(config.experiment, config.trial)
        lineage, new_run = [self.run], bool(config.new_run)
        if not config.new_run:
            try:
                prev = json.loads(self.nr.get(run_key))
                lineage += [r for r in prev.get("lineage", []) if isinstance(r, str)][:MAX_LINEAGE - 1]
                new_run = bool(prev.get("new_run"))
            except (BridgeError, ValueError, AttributeError):  # none recorded yet: the trial's first run
                pass
        self.nr.add(run_key, json.dumps({"run": self.run, "lineage": lineage, "new_run": new_run,
                                         "started_at": time.time()}), replace=True)

    @classmethod
    def commit_seconds(cls, config) -> float:
        return 3 * config.http_timeout + (config.wait_loaded_timeout if config.wait_loaded else 0.0)

    @classmethod
    def sink(cls, config, transport, rank: int, world: int) -> Sink:
        """With ``disk_writers="all"`` every rank writes the shards of its buckets; else rank 0 writes them."""
        if config.disk_writers == "all":
            return ShardWriter(config, rank, world)
        return TransportSink(transport) if transport is not None else Sink()

    def _key(self, leaf: str) -> str:
        return f"{self.names.trial_root(self.config.experiment, self.config.trial)}/{leaf}"

    def announced_versions(self) -> list[int]:
        prefix = self.names.update_weights_from_disk_root(self.config.experiment, self.config.trial)
        versions = (self.names.version_of(k) for k in self.nr.find_subtree(prefix))
        return sorted(v for v in versions if v is not None)

    def newest_snapshot(self):
        """The :class:`bridge.name_resolve.Announcement` of the newest version announced for this trial, or
        None: the fleet repairs a server that is behind (or torn) from it at once (:mod:`bridge.fleet`)."""
        from bridge.name_resolve import Announcement

        versions = self.announced_versions()
        if not versions:
            return None
        key = self.names.update_weights_from_disk(self.config.experiment, self.config.trial, versions[-1])
        return Announcement.from_json(self.nr.get(key))

    # ------------------------------------------------------------------ lifecycle

    def begin(self, plan: Plan) -> str:
        """Opens the snapshot under a temporary name; returns its folder (the ranks' writers write there)."""
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
            self._check_disk_roots()
        self._clear_unannounced(plan.version, versions)
        self.writer = SnapshotWriter(
            self.root, plan.version, config=plan.model_config, tokenizer=plan.source.tokenizer,
            dtype=dtype_from_str(self.config.serving_dtype), max_shard_bytes=max(1, self.config.bucket_bytes),
        )
        self._t_write = time.perf_counter()
        return self.writer.tmp_dir

    def _clear_unannounced(self, version: int, announced: list[int]) -> None:
        """A final directory of ``version`` that was never announced is what a publish that died between its
        rename and its announce left (a failed announce removes it itself): it must not block the retry."""
        from bridge.snapshot import snapshot_dir
        from bridge.snapshot.gc import discard_version

        if version not in announced and os.path.isdir(snapshot_dir(self.root, version)):
            logger.warning("removing %s: version %d was written there but never announced (a failed publish)",
                           snapshot_dir(self.root, version), version)
            discard_version(self.root, version)

    def _check_disk_roots(self) -> None:
        """A reference server loads only from its ``--disk-root`` directories: a snapshot root outside them
        fails here, before anything is written, instead of at the end of ``wait_loaded_timeout``."""
        from bridge.snapshot.manifest import under_roots

        root = os.path.realpath(self.root)
        for c in self.servers.clients:
            roots = c.can.disk_roots  # None: real SGLang, which loads any directory it can read
            if roots and not under_roots(root, roots):
                raise ConfigError(
                    f"{c.url} loads snapshots only from {', '.join(roots)} (its --disk-root), and the snapshot root "
                    f"{self.root} is outside: start the server with --disk-root {self.root}, or publish under "
                    "one of those directories (snapshot_root, wsync train --snapshot-root)"
                )

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        # The writer holds these views of ``buf`` until their shard is written (at the next bucket at
        # the latest, shards being bucket-sized): at most about two buckets alive on rank 0.
        for name, tensor in unflatten_bucket(buf, bucket.specs):
            self.writer.add(name, tensor)

    def commit(self, plan: Plan, reports: list) -> dict:
        """Finishes the snapshot around the shards the ranks wrote (``reports``: each rank's file name ->
        entry, from :meth:`bridge.transports.shard_writer.ShardWriter.settle`), announces it, waits for the servers."""
        from bridge.name_resolve import Announcement
        from bridge.snapshot import gc_snapshots

        writer, self.writer = self.writer, None
        shards = {fname: entry for written in reports if written for fname, entry in written.items()}
        for fname in sorted(shards):
            writer.add_shard(fname, shards[fname])
        try:
            info = writer.finish()
        except SnapshotConflict as e:
            raise VersionError(f"version {plan.version} was already published with different weights; "
                               f"publish them under a higher version ({e})") from e
        phases = {"write": time.perf_counter() - self._t_write}
        t = time.perf_counter()
        ann = Announcement(version=plan.version, path=info.path, manifest_sha256=info.manifest_sha256,
                           total_bytes=info.total_bytes, created_at=time.time(), run=self.run)
        key = self.names.update_weights_from_disk(self.config.experiment, self.config.trial, plan.version)
        ttl = self.config.announce_ttl
        try:
            failpoint("announce", 0)
            self.nr.add(key, ann.to_json(), ttl=ttl, keepalive=ttl is not None, replace=True)
        except BaseException:
            if not info.existed:  # nothing points at it: the retry of this version must find the name free
                from bridge.snapshot.gc import discard_version

                discard_version(self.root, plan.version)
            raise
        phases["announce"] = time.perf_counter() - t
        logger.info("announced version %d at %s (%s)", plan.version, key, info.path)
        servers = {}
        if self.config.wait_loaded and self.servers is not None:
            t = time.perf_counter()
            servers, unloadable = self._wait_loaded(plan.version, ann.manifest_sha256)
            phases["load"] = time.perf_counter() - t
            if unloadable is not None:
                # Nobody loaded it and nobody will: a version announced but served nowhere would be loaded by
                # the next watcher to start (or fail it again); withdraw it, and its files, now.
                self._withdraw_unloaded(plan.version, info)
                raise SyncError(f"{unloadable}; version {plan.version} was withdrawn (not announced, its snapshot "
                                "removed): publish again once the cause is fixed")
        try:
            gc_snapshots(self.root, keep=self.config.keep_snapshots, protect=[plan.version],
                         before_remove=self._withdraw)
        except (OSError, BridgeError) as e:
            logger.warning("garbage collection of old snapshots failed: %s", e)
        failed = {u: s for u, s in servers.items() if s != "ok"}
        if failed:
            # The version is announced and complete: a watcher will still load it. Say so.
            raise SyncError(f"version {plan.version} is announced at {info.path}, but servers did not load it: {failed}")
        return {"servers": servers, "path": info.path, "retried": info.existed,
                "bytes": info.total_bytes, "phases": phases}

    def _withdraw(self, version: int) -> None:
        """Before garbage collection removes snapshot ``version``: delete its announcement, if it points at
        that snapshot (the newest announced version is never collected: it is the one just published)."""
        from bridge.errors import NameEntryNotFound
        from bridge.name_resolve import Announcement
        from bridge.snapshot import snapshot_dir

        key = self.names.update_weights_from_disk(self.config.experiment, self.config.trial, version)
        try:
            ann = Announcement.from_json(self.nr.get(key))
        except (NameEntryNotFound, ConfigError):
            return  # not announced, or not ours to judge
        if os.path.realpath(ann.path) == os.path.realpath(snapshot_dir(self.root, version)):
            try:
                self.nr.delete(key)
            except NameEntryNotFound:
                pass

    def _withdraw_unloaded(self, version: int, info) -> None:
        """Withdraw the announcement of ``version`` that no server loaded, its failure reports, and its
        snapshot (unless it existed before this publish: a retry of a version published earlier)."""
        from bridge.errors import NameEntryNotFound

        key = self.names.update_weights_from_disk(self.config.experiment, self.config.trial, version)
        failures = self.names.load_failures(self.config.experiment, self.config.trial, version)
        for k in [key, *self.nr.find_subtree(failures)]:
            try:
                self.nr.delete(k)
            except NameEntryNotFound:
                pass
        if not info.existed:
            from bridge.snapshot.gc import discard_version

            discard_version(self.root, version)

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

    def _watch_cmd(self) -> str:
        cfg = self.config
        nr = "" if cfg.name_resolve is None else f" --name-resolve {self.url}"
        servers = " ".join(f"--server {c.url}" for c in self.servers.clients)
        return f"wsync watch{nr} --experiment {cfg.experiment} --trial {cfg.trial} {servers}"

    def _load_reports(self, version: int, manifest_sha256: str) -> tuple[set[str], list[dict]]:
        """The ids of the watchers registered for the trial, and their reports of a failed load of this
        announcement of ``version`` (:mod:`inference_adapter.watcher` writes both)."""
        cfg = self.config
        watchers = {k.rsplit("/", 1)[-1] for k in self.nr.find_subtree(self.names.watchers(cfg.experiment, cfg.trial))}
        reports = []
        for text in self.nr.get_subtree(self.names.load_failures(cfg.experiment, cfg.trial, version)):
            try:
                r = json.loads(text)
            except ValueError:
                continue
            if isinstance(r, dict) and r.get("manifest_sha256") == manifest_sha256 and isinstance(r.get("reason"), str):
                reports.append(r)
        return watchers, reports

    def _wait_loaded(self, version: int, manifest_sha256: str) -> tuple[dict[str, str], str | None]:
        """Wait (bounded) until every server reports ``version``; a server that stays unreachable for
        :data:`UNREACHABLE_GRACE_S` is reported at once instead of after the whole timeout, and so is a server
        whose watcher reported that it could not load the version (with the watcher's reason).

        Returns the status of each server, and, when no server loaded the version and none will, why: no
        watcher registered for the trial within :data:`NO_WATCHER_GRACE_S`, or every registered watcher
        reported that its servers could not load it (None otherwise)."""
        want, cfg = str(version), self.config
        status = {c.url: "waiting" for c in self.servers.clients}
        down_since: dict[str, float] = {}
        start = time.monotonic()
        deadline = start + cfg.wait_loaded_timeout
        delay = 0.01
        seen_watcher, all_failed, reasons = False, False, []
        next_read = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_read:  # name resolution: at most 10 reads a second
                next_read = time.monotonic() + 0.1
                try:
                    watchers, reports = self._load_reports(version, manifest_sha256)
                except BridgeError as e:  # name resolution unreachable: wait for the servers as before
                    logger.debug("cannot read the watchers' reports: %s", e)
                    watchers, reports = set(), []
                    seen_watcher = True
                seen_watcher = seen_watcher or bool(watchers)
                reasons = [r["reason"] for r in reports]
                failed_here = {u for r in reports for u in r.get("servers") or () if isinstance(u, str)}
                all_failed = bool(watchers) and watchers <= {r.get("watcher") for r in reports}
                for url, s in status.items():
                    if s == "waiting" or s.startswith("serves version"):
                        if url.rstrip("/") in {u.rstrip("/") for u in failed_here} or all_failed:
                            status[url] = f"failed to load version {want}: {'; '.join(reasons)}"
            if not seen_watcher and time.monotonic() - start >= min(NO_WATCHER_GRACE_S, cfg.wait_loaded_timeout):
                break
            for c in self.servers.clients:
                if status[c.url] in ("ok",) or status[c.url].startswith(("unreachable for", "failed to load")):
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
            if all(s == "ok" or s.startswith(("unreachable for", "failed to load")) for s in status.values()):
                break
            time.sleep(delay)
            delay = min(0.05, delay * 2)  # a load is noticed within 50 ms; model_info is cheap
        loaded = any(s == "ok" for s in status.values())
        unloadable = None
        if not loaded and not seen_watcher:
            unloadable = (f"no watcher loads experiment {cfg.experiment} trial {cfg.trial} from {self.url} (none "
                          f"registered within {min(NO_WATCHER_GRACE_S, cfg.wait_loaded_timeout):g} s): run "
                          f"`{self._watch_cmd()}` beside the servers")
            status = {u: (s if s.startswith("unreachable for") else "not loaded: no watcher") for u, s in status.items()}
        elif not loaded and all_failed:
            unloadable = f"no server could load version {want}: {'; '.join(reasons)}"
        return {u: (s if s == "ok" or s.startswith(("unreachable for", "failed to load", "not loaded")) else
                    f"did not load version {want} within wait_loaded_timeout={cfg.wait_loaded_timeout:g} s ({s})")
                for u, s in status.items()}, unloadable
