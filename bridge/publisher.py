"""Versioned weight publishing: one sync of a trainer's weights into every server.

A :class:`WeightPublisher` is created once by the training script and ``publish(source, version)`` is
called collectively by every trainer rank after each step. Three transports:

**broadcast** (alias ``nccl``), the fast path. Step by step, and which process runs each step:

1. rank 0, first sync only: sends ``/init_weights_update_group`` to every server concurrently (each with
   its ``rank_offset``), joins the custom group itself as rank 0, then awaits the HTTP answers.
2. rank 0: ``/pause_generation`` on every server, then ``/begin_weight_update`` where the server's
   protocol needs a session (SGLang >= 0.5.21).
3. every rank, per bucket: gathers the bucket's DTensors (a collective) in the same fixed order; rank 0
   casts them to the serving dtype and packs them into one uint8 buffer.
4. rank 0, per bucket: waits for the previous bucket (its broadcast and every server's HTTP answer),
   then posts ``/update_weights_from_distributed`` to every server and starts the broadcast of this
   bucket asynchronously, so the gather of bucket k+1 overlaps the broadcast of bucket k. At most two
   buckets are alive on rank 0. Before each bucket every rank learns from rank 0 whether to go on, so
   no rank runs ahead of rank 0 by more than one bucket and all ranks stop together on an error.
5. rank 0: the last bucket carries ``weight_version``; then ``/end_weight_update`` and
   ``/continue_generation``. Every rank learns the outcome from rank 0 and raises the same
   :class:`SyncError` on failure (the group is torn down and rebuilt at the next publish).

**colocated**: trainer and servers on the same host. The same bucket pipeline as broadcast (steps 2-5,
same error agreement, version and fingerprint semantics), but without a process group: rank 0 gathers
each bucket straight into a file under ``/dev/shm`` (``wsync-<pid>-<uuid>-<k>``, mapped shared) and
posts ``/update_weights_from_tensor`` to every server, which copies the bytes out; the file is unlinked
once every server answered, and on any error. CPU tensors cannot be pickled across HTTP (SGLang issue
#4551), so this uses the project's ``load_format="wsync_shm"`` extension, which only the reference
server understands: each serialized entry is base64 of the JSON object ``{"path", "nbytes", "names",
"dtypes", "shapes"}`` (no pickle). Every server URL must be a loopback address. (On GPU, real SGLang
takes CUDA IPC handles on the same route; that path is not implemented here.)

**disk**: every rank takes part in the gather; rank 0 streams the tensors into an HF snapshot written
under a temporary name, fsynced and renamed into place (``bridge.snapshot``), then announces it under
``<root>/<experiment>/<trial>/update_weights_from_disk/<version>`` in name resolution. A watcher on the
serving side (``wsync watch``) loads it into every server; with ``wait_loaded`` the publisher waits
until the given servers report the version.

Version semantics: versions are integers, strictly increasing per publisher (and, for disk, per
(experiment, trial) in name resolution). Publishing an older version, or the same version with
different content, raises :class:`VersionError`; publishing the same version with the same content
again (a retry) is safe and re-sends it. A version that failed to publish was never completed, so
retrying it is allowed.

Example (one process, a reference server started with ``wsync serve --preset tiny``):

    >>> from bridge import WeightPublisher, PublisherConfig          # doctest: +SKIP
    >>> pub = WeightPublisher(PublisherConfig(servers=["http://127.0.0.1:30000"]))  # doctest: +SKIP
    >>> result = pub.publish(model, version=1)                       # doctest: +SKIP
    >>> result.version, result.servers                               # doctest: +SKIP
    (1, {'http://127.0.0.1:30000': 'ok'})
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import tempfile
import time
import uuid
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bridge.buckets import Bucket, pack_one, plan_buckets, unflatten_bucket
from bridge.errors import BridgeError, ConfigError, ServerError, SyncError, SyncTimeout, VersionError
from bridge.log import fmt_bytes, get_logger
from bridge.memory import PeakMemory
from bridge.process_group import default_backend, destroy_custom_process_group, find_free_port, init_custom_process_group
from bridge.protocol import SHM_LOAD_FORMAT
from bridge.sources import WeightSource, as_source
from bridge.tensors import ParamSpec, dtype_from_str

__all__ = ["PublishResult", "PublisherConfig", "WeightPublisher"]

logger = get_logger(__name__)

TRANSPORTS = ("broadcast", "colocated", "disk")

_ALIASES = {"nccl": "broadcast", "xccl": "broadcast", "distributed": "broadcast"}


def _default_bucket_mb() -> float:
    # Enough bytes per HTTP round trip, and several buckets per model so the gather of one overlaps the
    # broadcast of the previous one. On 2 CPU cores 32 MiB measured fastest on both bench presets
    # (wsync bench); NCCL links want larger buckets.
    return 512.0 if torch.cuda.is_available() else 32.0


@dataclass(kw_only=True)
class PublisherConfig:
    """How and where to publish. Checked in ``__post_init__``."""

    transport: str = "broadcast"
    """``broadcast`` (alias ``nccl``): a custom process group, one broadcast per bucket; ``colocated``:
    servers on this host, buckets handed over in ``/dev/shm`` files via ``/update_weights_from_tensor``
    (``load_format="wsync_shm"``, reference server); ``disk``: HF snapshots announced in name resolution."""
    servers: Sequence[str] = ()
    """Base URLs of the servers (required for broadcast and colocated, loopback only for colocated; for
    disk, servers to wait for)."""
    experiment: str = "default"
    """Experiment name: part of the announcement keys."""
    trial: str = "trial0"
    """Trial name: part of the announcement keys."""
    name_resolve: str | None = None
    """Name-resolution URL for disk: ``etcd://host:port``, ``file:///path`` or ``memory://``.
    Default: a directory under the system temp folder, the same one ``wsync watch`` follows."""
    snapshot_root: str | None = None
    """Directory that receives one ``v<version>`` snapshot per version (disk). Default: a temp dir."""
    keep_snapshots: int = 3
    """Snapshots kept on disk (the newest ones); older ones are garbage-collected."""
    bucket_mb: float = field(default_factory=_default_bucket_mb)
    """Byte budget of one broadcast bucket, in MiB. Rank 0 holds at most about two buckets."""
    serving_dtype: str = "bfloat16"
    """dtype the servers serve; weights are cast to it on the way (fp32 master -> bf16)."""
    load_format: str = "auto"
    """``auto`` (flattened buckets when every server supports them), ``flattened_bucket`` or ``per_tensor``."""
    pause_mode: str = "abort"
    """``/pause_generation`` mode during a broadcast sync: abort, retract, in_place, or ``none`` to not pause."""
    group_name: str = "wsync_weight_update"
    """Name of the custom process group (the store prefix both sides use)."""
    master_address: str | None = None
    """Address of trainer rank 0 as the servers reach it. Default: 127.0.0.1 if every server is local."""
    master_port: int | None = None
    """Port for the group's rendezvous. Default: a free port."""
    backend: str | None = None
    """``nccl`` or ``gloo``; default: nccl with CUDA, gloo without."""
    http_timeout: float = 60.0
    """Seconds for each HTTP call to a server."""
    group_timeout: float = 60.0
    """Seconds for the group rendezvous and for each broadcast to complete."""
    wait_loaded: bool = True
    """Disk: wait until every server in ``servers`` reports the new version."""
    wait_loaded_timeout: float = 120.0
    """Disk: seconds to wait for the servers to load an announced version."""
    announce_ttl: float | None = None
    """Disk: TTL of announcements (seconds, kept alive while the publisher lives); None = permanent."""
    api_key: str | None = None
    """Bearer key for the servers' control routes."""
    progress: bool = True
    """Show a progress bar for syncs that take longer than a second."""

    def __post_init__(self) -> None:
        self.transport = _ALIASES.get(self.transport, self.transport)
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS} (or 'nccl'), got {self.transport!r}")
        self.servers = [s.rstrip("/") for s in self.servers]
        if self.transport in ("broadcast", "colocated") and not self.servers:
            raise ConfigError(f"the {self.transport} transport needs at least one server URL (servers=[...])")
        if self.transport == "colocated":
            remote = [s for s in self.servers if not _is_local(s)]
            if remote:
                raise ConfigError(
                    f"the colocated transport hands weights over in this host's shared memory, so every server must "
                    f"be local (a loopback URL such as http://127.0.0.1:30000); not local: {remote}"
                )
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        dtype_from_str(self.serving_dtype)
        if self.load_format not in ("auto", "flattened_bucket", "per_tensor"):
            raise ConfigError(f"load_format must be auto, flattened_bucket or per_tensor, got {self.load_format!r}")
        if self.pause_mode not in ("abort", "retract", "in_place", "none"):
            raise ConfigError(f"pause_mode must be abort, retract, in_place or none, got {self.pause_mode!r}")
        for name in ("http_timeout", "group_timeout", "wait_loaded_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.keep_snapshots < 1:
            raise ConfigError(f"keep_snapshots must be >= 1, got {self.keep_snapshots}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)


@dataclass
class PublishResult:
    """What one publish did. ``servers`` maps each server URL to ``"ok"`` or its error message."""

    version: int
    transport: str
    bytes: int
    seconds: float
    buckets: int = 0
    servers: dict[str, str] = field(default_factory=dict)
    path: str | None = None
    retried: bool = False
    peak_extra_bytes: int = 0
    """Broadcast: rank 0's peak extra host (or device) memory during the transfer, measured."""
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) of the bytes on the wire."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d


def _is_local(url: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(url if "://" in url else "http://" + url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class _Inflight:
    """One bucket on the wire: its broadcast work(s), the servers' HTTP futures, its buffer and, for the
    colocated transport, the shared-memory file that backs the buffer."""

    def __init__(self, index: int, works: list, futures: list[Future], buffer: torch.Tensor, path: str | None = None):
        self.index, self.works, self.futures, self.buffer, self.path = index, works, futures, buffer, path


class WeightPublisher:
    """Publishes versioned weights to a set of servers. See the module docstring for the protocol."""

    def __init__(self, config: PublisherConfig | None = None, **kwargs):
        if config is None:
            config = PublisherConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either a PublisherConfig or keyword arguments, not both")
        self.config = config
        self.last_version: int | None = None
        self._last_fingerprint: int | None = None
        self._pg: dist.ProcessGroup | None = None
        self._servers = None
        self._disk = None
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        backend = config.backend or default_backend()
        # Buckets live where the weight-update group can send them from.
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    # ---------------------------------------------------------------- public API

    @property
    def servers(self):
        """The :class:`bridge.client.ServerGroup` of the configured servers (rank 0 only talks to them)."""
        if self._servers is None and self.config.servers:
            from bridge.client import ServerGroup

            self._servers = ServerGroup(self.config.servers, api_key=self.config.api_key, timeout=self.config.http_timeout)
        return self._servers

    def publish(self, source: WeightSource | torch.nn.Module, version: int) -> PublishResult:
        """Publish ``source``'s weights as ``version``. Collective: every trainer rank calls it.

        Returns:
            A :class:`PublishResult` (the same figures on every rank).
        Raises:
            VersionError: ``version`` is older than the last published one, or equal with other content.
            SyncError / SyncTimeout / ServerError: the sync failed; servers keep their previous version.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise VersionError(f"version must be a non-negative integer, got {version!r}")
        if self.last_version is not None and version < self.last_version:
            raise VersionError(
                f"version {version} is older than the last published version {self.last_version}; "
                "versions must strictly increase"
            )
        source = as_source(source)
        if self.config.transport in ("broadcast", "colocated"):
            return self._publish_broadcast(source, version)
        return self._publish_disk(source, version)

    def close(self) -> None:
        """Tear the weight-update group down on both sides and stop background work."""
        if self._pg is not None:
            self._teardown_group()
        if self._disk is not None:
            self._disk.close()
            self._disk = None

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- shared helpers

    def _wire_specs(self, source: WeightSource) -> list[ParamSpec]:
        dtype = dtype_from_str(self.config.serving_dtype)
        # Only floating tensors are cast: integer buffers keep their dtype.
        return [s.with_dtype(dtype) if s.dtype.is_floating_point else s for s in source.param_specs()]

    def _agree(self, payload: Any) -> Any:
        """Rank 0's ``payload`` on every rank (identity in a single process)."""
        if self._world == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _check_fingerprint(self, version: int, fingerprint: int) -> bool:
        """True when this is a retry of the last version with identical content; raise if content differs."""
        if self.last_version is None or version != self.last_version:
            return False
        if fingerprint != self._last_fingerprint:
            raise VersionError(
                f"version {version} was already published with different weights; "
                "publish the new weights under a higher version"
            )
        return True

    # ---------------------------------------------------------------- broadcast

    def _load_format(self) -> str:
        if self.config.load_format != "auto":
            if self.config.load_format == "flattened_bucket":
                old = [c.url for c in self.servers.clients if not c.features.flattened_bucket]
                if old:
                    raise ConfigError(f"servers {old} are older than SGLang 0.5.10 and cannot take flattened buckets; use load_format='per_tensor' or 'auto'")
            return self.config.load_format
        ok = all(c.features.flattened_bucket for c in self.servers.clients)
        return "flattened_bucket" if ok else "per_tensor"

    def _ensure_group(self) -> None:
        if self._pg is not None:
            return
        cfg, servers = self.config, self.servers
        address = cfg.master_address or ("127.0.0.1" if all(_is_local(u) for u in servers.urls) else _host_ip())
        port = cfg.master_port or find_free_port("0.0.0.0" if address != "127.0.0.1" else address)
        backend = cfg.backend or default_backend()
        world_size = servers.world_size()
        offsets = servers.rank_offsets()
        logger.info("creating weight-update group %s at %s:%d (%s, world size %d)", cfg.group_name, address, port, backend, world_size)
        offset_of = dict(zip(servers.urls, offsets))
        futures = servers.submit(
            lambda c: c.init_weights_update_group(
                master_address=address, master_port=port, rank_offset=offset_of[c.url], world_size=world_size,
                group_name=cfg.group_name, backend=backend, timeout=cfg.group_timeout + cfg.http_timeout,
            )
        )
        try:
            pg = init_custom_process_group(
                master_address=address, master_port=port, world_size=world_size, rank=0,
                group_name=cfg.group_name, backend=backend, timeout=cfg.group_timeout,
            )
        except SyncTimeout as e:
            missing = [c.url for c, f in zip(servers.clients, futures) if not f.done() or f.exception() is not None]
            errors = [f"{c.url}: {f.exception()}" for c, f in zip(servers.clients, futures) if f.done() and f.exception()]
            raise SyncTimeout(f"servers did not join the weight-update group: {missing or '?'} {'; '.join(errors)} ({e})") from e
        self._pg = pg
        try:
            for f in futures:
                f.result(timeout=cfg.http_timeout)
        except BaseException:
            self._teardown_group()
            raise

    def _teardown_group(self) -> None:
        """Destroy the group locally and ask the servers to drop theirs (best effort, bounded).

        A no-op for the colocated transport, which has no group."""
        if self.config.transport != "broadcast":
            return
        pg, self._pg = self._pg, None
        destroy_custom_process_group(pg)
        if self.servers is None:
            return
        for c in self.servers.clients:
            try:
                if c.features.destroy_group:
                    c.destroy_weights_update_group(group_name=self.config.group_name)
            except BridgeError as e:
                logger.debug("destroy_weights_update_group on %s: %s", c.url, e)

    def _send(self, k: int, bucket: Bucket, buf: torch.Tensor, load_format: str, version: int | None,
              path: str | None = None) -> _Inflight:
        cfg = self.config
        fields = bucket.request_fields()
        is_last = version is not None
        if cfg.transport == "colocated":
            entry = base64.b64encode(json.dumps({"path": path, "nbytes": bucket.nbytes, **fields}).encode()).decode()
            futures = self.servers.submit(
                lambda c: c.update_weights_from_tensor(
                    [entry] * c.tp_size, load_format=SHM_LOAD_FORMAT, flush_cache=is_last,
                    weight_version=str(version) if is_last else None, timeout=cfg.http_timeout,
                )
            )
            return _Inflight(k, [], futures, buf, path)
        futures = self.servers.submit(
            lambda c: c.update_weights_from_distributed(
                **fields, group_name=cfg.group_name,
                load_format="flattened_bucket" if load_format == "flattened_bucket" else None,
                flush_cache=is_last, weight_version=str(version) if is_last else None,
                timeout=cfg.group_timeout + cfg.http_timeout,
            )
        )
        if load_format == "flattened_bucket":
            works = [dist.broadcast(buf, src=0, group=self._pg, async_op=True)]
        else:
            works = [
                dist.broadcast(buf[o : o + s.nbytes].view(s.dtype).view(s.shape), src=0, group=self._pg, async_op=True)
                for s, o in zip(bucket.specs, bucket.offsets)
            ]
        return _Inflight(k, works, futures, buf)

    def _wait(self, inflight: _Inflight) -> None:
        """Wait for one bucket: every server's HTTP answer, then the broadcast, all bounded in time."""
        cfg = self.config
        deadline = time.monotonic() + cfg.group_timeout + cfg.http_timeout
        errors = []
        for c, f in zip(self.servers.clients, inflight.futures):
            try:
                f.result(timeout=max(0.1, deadline - time.monotonic()))
            except FutureTimeout:
                errors.append(f"{c.url}: no answer to bucket {inflight.index} within {cfg.group_timeout + cfg.http_timeout:.0f} s")
            except BridgeError as e:
                errors.append(str(e))
        if errors:
            # A server that refused the bucket may not have joined its broadcast: the group is not
            # trustworthy any more, and it is rebuilt at the next publish.
            raise SyncError("; ".join(errors))
        for w in inflight.works:
            try:
                w.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except RuntimeError as e:
                raise SyncError(f"broadcast of bucket {inflight.index} failed: {e}") from e

    def _publish_broadcast(self, source: WeightSource, version: int) -> PublishResult:
        cfg = self.config
        t0 = time.perf_counter()
        specs = self._wire_specs(source)
        buckets = plan_buckets(specs, cfg.bucket_bytes)
        total = sum(b.nbytes for b in buckets)
        error: str | None = None
        colocated = cfg.transport == "colocated"
        load_format = SHM_LOAD_FORMAT if colocated else "flattened_bucket"
        session = False
        paused = False
        phases: dict[str, float] = {}
        crc, retried = 0, False
        if self._rank == 0:
            try:
                if not colocated:
                    load_format = self._load_format()
                    tg = time.perf_counter()
                    self._ensure_group()
                    phases["group_init"] = time.perf_counter() - tg
                if cfg.pause_mode != "none":
                    self.servers.pause_generation(mode=cfg.pause_mode)
                    paused = True
                self._begin_session()
                session = True
            except BridgeError as e:
                error = f"could not start the sync: {e}"
        error = self._agree(error)
        t_start = time.perf_counter()
        bar = _progress(cfg.progress and self._rank == 0, total, f"sync v{version}")
        with PeakMemory() as memory:
            if error is None:
                error, crc, retried = self._transfer(source, buckets, version, load_format, bar)
        bar.close()
        peak = max(memory.extra_bytes, memory.device_extra_bytes)
        try:
            outcome = self._finish_broadcast(version, error, session, paused, crc, retried)
        except Exception as e:  # never leave the other ranks waiting for an outcome
            logger.exception("finishing the sync failed")
            outcome = {"error": error or f"finishing the sync failed: {e}", "servers": {}, "retried": False,
                       "fingerprint": crc, "serving": ""} if self._rank == 0 else None
        if outcome is not None:
            outcome["peak"] = peak
        outcome = self._agree(outcome)
        t_end = time.perf_counter()
        if outcome["error"]:
            if outcome["error"].startswith("VersionError: "):
                raise VersionError(outcome["error"].removeprefix("VersionError: ") + f"; {outcome['serving']}")
            raise SyncError(f"weight sync of version {version} failed: {outcome['error']}; {outcome['serving']}")
        retried = outcome["retried"]
        self.last_version, self._last_fingerprint = version, outcome["fingerprint"]
        phases["transfer"] = t_end - t_start
        result = PublishResult(
            version=version, transport=cfg.transport, bytes=total, seconds=t_end - t0, buckets=len(buckets),
            servers=outcome["servers"], retried=retried, peak_extra_bytes=outcome["peak"], phases=phases,
        )
        logger.log(
            logging.INFO if self._rank == 0 else logging.DEBUG,
            "published version %d by %s: %s in %d buckets (%s) in %.2f s, %.2f GB/s, peak extra memory %s%s",
            version, cfg.transport, fmt_bytes(total), len(buckets), load_format, result.seconds, result.gbps,
            fmt_bytes(result.peak_extra_bytes), " (retry of identical weights)" if retried else "",
        )
        return result

    def _transfer(self, source: WeightSource, buckets: list[Bucket], version: int, load_format: str,
                  bar) -> tuple[str | None, int, bool]:
        """Every rank: gather, pack and send each bucket, pipelined; returns (error, fingerprint, retried).

        Rank 0 settles bucket k-1 (every server answered, broadcast done) only after bucket k is gathered,
        so the gather overlaps the transfer; then all ranks agree whether to go on.
        """
        error, crc, retried, inflight = None, 0, False, None
        last = len(buckets) - 1
        colocated = self.config.transport == "colocated"
        paths: list[str] = []  # colocated: every shared-memory file this sync created (rank 0)
        try:
            for k, bucket in enumerate(buckets):
                path = None
                if self._rank != 0:
                    buf = None
                elif colocated:
                    buf, path = _shm_buffer(bucket.nbytes, k)
                    paths.append(path)
                else:
                    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self._device)
                _gather_into(source, bucket, buf)
                if self._rank == 0:
                    crc = _fingerprint(buf, crc)
                    if k == last:
                        # Decided before the last bucket (which carries the version) leaves rank 0, so other
                        # weights never land under a version that is already published.
                        try:
                            retried = self._check_fingerprint(version, crc)
                        except VersionError as e:
                            error = f"VersionError: {e}"
                    error = self._settle(inflight, buckets, bar) or error
                    inflight = None
                error = self._agree(error)
                if error is not None:
                    return error, crc, retried
                if self._rank == 0:
                    inflight = self._send(k, bucket, buf, load_format, version if k == last else None, path=path)
                del buf
            return (self._settle(inflight, buckets, bar) if self._rank == 0 else None), crc, retried
        finally:
            for p in paths:  # normally each is gone once its bucket settled; this covers errors
                _unlink(p)

    def _settle(self, inflight: _Inflight | None, buckets: list[Bucket], bar) -> str | None:
        """Wait for the bucket on the wire; its error message, or None."""
        if inflight is None:
            return None
        try:
            self._wait(inflight)
        except BridgeError as e:
            return str(e)
        finally:
            if inflight.path is not None:
                # Every server answered (or gave up on) this bucket: it copied the bytes out already.
                inflight.buffer = None
                _unlink(inflight.path)
        bar.update(buckets[inflight.index].nbytes)
        return None

    def _begin_session(self) -> None:
        needs = [c for c in self.servers.clients if c.features.needs_session]
        if not needs:
            return
        for c in needs:
            try:
                c.begin_weight_update()
            except ServerError as e:
                if "already" not in e.message and "end_weight_update" not in e.message:
                    raise
                # A session left open by a trainer that died mid-sync: close it, then open ours.
                logger.warning("%s had an update session open (a previous sync died); closing it", c.url)
                c.end_weight_update()
                c.begin_weight_update()

    def _finish_broadcast(self, version: int, error: str | None, session: bool, paused: bool, crc: int,
                          retried: bool) -> dict | None:
        """Rank 0: close the sync on every server (commit on success, tear down on failure), resume."""
        if self._rank != 0:
            return None
        servers = {c.url: "ok" for c in self.servers.clients}
        if error is None and session:
            for c in self.servers.clients:
                try:
                    c.end_weight_update()  # the reference server swaps weights and version here
                except BridgeError as e:
                    error = error or str(e)
                    servers[c.url] = str(e)
        if error is not None:
            # Destroying the group makes the reference server drop what it staged; SGLang has loaded the
            # buckets it received and must be re-synced (the next publish rebuilds the group and does).
            self._teardown_group()
            if session:
                for c in self.servers.clients:
                    try:
                        if not c.features.needs_session:
                            continue
                        if self.config.transport == "colocated":
                            _discard_session(c)
                        else:
                            c.end_weight_update()
                    except BridgeError:
                        pass  # already closed by the teardown (or by the server refusing a bucket)
            servers = {u: ("failed" if s == "ok" else s) for u, s in servers.items()}
        if paused:
            try:
                self.servers.continue_generation()
            except BridgeError as e:
                logger.warning("continue_generation failed: %s", e)
        serving = ""
        if error is not None:
            try:
                serving = "servers now serve " + ", ".join(f"{u}: version {v}" for u, v in self.servers.weight_versions().items())
            except BridgeError:
                serving = "some servers could not be asked which version they serve"
        return {"error": error, "servers": servers, "retried": retried, "fingerprint": crc, "serving": serving}

    # ---------------------------------------------------------------- disk

    def _stream(self, source: WeightSource, specs: list[ParamSpec]):
        """Collective: (name, full tensor in the wire dtype) bucket by bucket; None off rank 0."""
        for bucket in plan_buckets(specs, self.config.bucket_bytes):
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8) if self._rank == 0 else None
            _gather_into(source, bucket, buf)
            if buf is None:
                yield from ((s.name, None) for s in bucket.specs)
            else:
                yield from unflatten_bucket(buf, bucket.specs)

    def _publish_disk(self, source: WeightSource, version: int) -> PublishResult:
        from bridge.disk import DiskPublisher

        if self._disk is None:
            self._disk = DiskPublisher(self.config, rank=self._rank)
        t0 = time.perf_counter()
        specs = self._wire_specs(source)
        outcome = None
        error = None
        if self._rank == 0:
            try:
                self._disk.check_version(version)
            except BridgeError as e:
                error = str(e)
        error = self._agree(error)
        if error is not None:
            raise VersionError(error)
        stream = self._stream(source, specs)
        try:
            outcome = self._disk.write_and_announce(version, stream, source)
        except BridgeError as e:
            outcome = {"error": f"{type(e).__name__}: {e}"}
        outcome = self._agree(outcome)
        if outcome.get("error"):
            raise SyncError(f"disk publish of version {version} failed: {outcome['error']}")
        self.last_version = version
        result = PublishResult(
            version=version, transport="disk", bytes=outcome["bytes"], seconds=time.perf_counter() - t0,
            servers=outcome["servers"], path=outcome["path"], retried=outcome["retried"], phases=outcome["phases"],
        )
        logger.log(
            logging.INFO if self._rank == 0 else logging.DEBUG,
            "published version %d to disk: %s at %s in %.2f s, %.2f GB/s", version, fmt_bytes(result.bytes),
            result.path, result.seconds, result.gbps,
        )
        return result


def _gather_into(source: WeightSource, bucket: Bucket, buf: torch.Tensor | None) -> None:
    """Collective: fill rank 0's wire buffer with the bucket, by the source's fast path when it has one."""
    gather = getattr(source, "gather_bucket", None)
    if gather is not None:
        gather(bucket, buf)
        return
    index = bucket.index() if buf is not None else None
    for spec, full in source.iter_full_tensors(bucket.specs):
        if buf is not None:
            offset, wire = index[spec.name]
            pack_one(buf, offset, wire, full)
        del full


def _discard_session(c) -> None:
    """Close a failed colocated sync's session without applying it.

    There is no group whose teardown would abort the session (as for broadcast), so the reference server
    is asked to discard it (``/wsync/abort_weight_update``, a project extension). Real SGLang has no such
    route; it has already loaded what it received, so its session is just closed (and the next publish
    re-syncs every tensor).
    """
    try:
        c.abort_weight_update()
    except ServerError as e:
        if e.status != 404:
            raise
        c.end_weight_update()


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _shm_buffer(nbytes: int, k: int) -> tuple[torch.Tensor, str]:
    """A uint8 tensor of ``nbytes`` backed by a new shared-memory file (mode 0600); (tensor, path)."""
    path = os.path.join(_shm_dir(), f"wsync-{os.getpid()}-{uuid.uuid4().hex}-{k}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)
    try:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), path
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path
    except BaseException:
        _unlink(path)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove shared-memory file %s: %s", path, e)


def _fingerprint(buf: torch.Tensor, crc: int) -> int:
    """Running checksum of the bytes sent, to tell a retry of the same weights from new weights."""
    if buf.device.type == "cpu":
        return zlib.crc32(buf.numpy(), crc)  # ~5 GB/s, negligible next to the transfer
    words = buf[: buf.numel() // 8 * 8].view(torch.int64)
    return hash((crc, int(words.sum()), int(words[::1009].sum()), buf.numel()))


def _host_ip() -> str:
    """This host's address as other hosts see it (set ``master_address`` when this guess is wrong)."""
    return socket.gethostbyname(socket.gethostname())


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    # delay=1: the bar only appears for syncs that take longer than a second.
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, delay=1.0, leave=False)


def default_snapshot_root() -> str:
    return os.path.join(tempfile.gettempdir(), "wsync-snapshots")
