"""Every rank's own writer of a disk sync (``disk_writers="all"``): each rank writes the shards of the buckets it owns,
beside rank 0's snapshot folder (:mod:`bridge.transports.disk`)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import (
    BridgeError,
    ConfigError,
    SnapshotError,
    SyncError,
    SyncTimeout,
)
from bridge.failpoints import failpoint
from bridge.log import fmt_bytes, get_logger
from bridge.tensors import host_buffer
from bridge.transports.base import Plan, remove_file
from bridge.transports.sink import Sink

__all__ = ["ShardWriter"]

logger = get_logger(__name__)


class ShardWriter(Sink):
    """Every rank's sink of a disk sync with ``disk_writers="all"``: writes the shards of its buckets.

    Driven by the publisher on every rank: ``begin`` (with rank 0's temporary directory), then for each
    bucket this rank owns ``buffer`` (the gather target) and ``send`` (write it in the background),
    ``settle`` (wait for the last write; this rank's file entries), or ``abort`` after a failure.
    """

    stops_before_abort = True  # its files are in the temporary folder rank 0's abort removes

    def __init__(self, config, rank: int, world: int):
        self.rank, self.world = rank, world
        self.wait_s = config.group_timeout
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="wsync-shard")
        self._dir: str | None = None
        self._version = 0
        self._n = 0
        self._pending: tuple[str, cf.Future] | None = None  # (shard file name, its write)
        self._written: dict[str, dict] = {}
        self._paths: list[str] = []
        self._bytes = 0
        self._stop = threading.Event()

    def owner(self, k: int) -> int:
        """The rank that gathers and writes bucket ``k``. Round robin: a rank's buckets are
        ``world_size`` apart, so its write of one overlaps the gathers of the next ones."""
        return k % self.world

    def begin(self, opened: str, plan: Plan) -> None:
        """``opened``: the snapshot's temporary folder, from rank 0's ``DiskTransport.begin``."""
        self._dir, self._version, self._n = opened, plan.version, len(plan.buckets)
        self._pending, self._written, self._paths, self._bytes = None, {}, [], 0
        self._stop = threading.Event()  # a new one: a write of an aborted sync still sees its own set

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        """The buffer bucket ``k`` is gathered into, once this rank's previous shard is written (so it
        holds at most two buckets)."""
        self._wait()
        if k == self.rank and not os.path.isdir(self._dir):
            raise ConfigError(
                f"trainer rank {self.rank} does not see the snapshot's temporary directory {self._dir}: with "
                "disk_writers='all' every trainer rank writes into snapshot_root, so it must be one filesystem "
                "for all of them (one host, or a shared filesystem at the same path); or use disk_writers='rank0'"
            )
        return host_buffer(bucket.nbytes)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None = None) -> None:
        """Write bucket ``k`` (in ``buf``) as shard ``k + 1`` in the background."""
        from bridge.snapshot import shard_name, write_shard

        fname = shard_name(k + 1, self._n)
        path = os.path.join(self._dir, fname)
        stop, rank = self._stop, self.rank

        def between() -> None:
            if stop.is_set():
                raise SyncError("the sync was aborted")
            failpoint(f"write:{k}", rank)

        def write() -> tuple[str, dict]:
            if stop.is_set():
                raise SyncError("the sync was aborted")
            return fname, write_shard(path, unflatten_bucket(buf, bucket.specs), between)

        self._paths.append(path)
        self._pending = (fname, self._pool.submit(write))

    def settle(self) -> dict[str, dict]:
        """Wait for this rank's last write; file name -> entry of every shard this rank wrote."""
        self._wait()
        if self._written:
            logger.debug("rank %d wrote %d shards, %s", self.rank, len(self._written), fmt_bytes(self._bytes))
        written, self._written, self._paths = self._written, {}, []
        return written

    def abort(self, seconds: float) -> None:
        """Stop writing (waiting at most ``seconds`` for a write in progress) and remove this rank's
        files of the failed sync. Never raises."""
        self._stop.set()
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending[1].result(timeout=seconds)
            except Exception:  # the failure, if it is this one, was already reported through the agreement
                pass
        for path in self._paths:
            remove_file(path, "the shard of a failed sync")
        self._paths, self._written = [], {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # a write still going was aborted already

    def _wait(self) -> None:
        from bridge.snapshot.writer import write_error

        pending, self._pending = self._pending, None
        if pending is None:
            return
        fname, future = pending
        try:
            fname, entry = future.result(timeout=self.wait_s)
        except cf.TimeoutError:
            raise SyncTimeout(
                f"trainer rank {self.rank} did not finish writing {fname} of snapshot v{self._version} within "
                f"group_timeout={self.wait_s:g} s"
            ) from None
        except BridgeError:
            raise
        except Exception as e:  # disk full, permissions, ...: the rank-0 writer's message, naming the shard
            raise SnapshotError(f"{fname}: {write_error(os.path.dirname(self._dir), self._version, e, self._bytes)}") from e
        self._written[fname] = entry
        self._bytes += entry["tensor_bytes"]

