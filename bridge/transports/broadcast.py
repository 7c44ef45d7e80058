"""Broadcast: one custom process group from trainer rank 0 to every server rank, one broadcast per bucket.

``begin``: on the first sync (or after a failed one) rank 0 sends ``/init_weights_update_group`` to
every server concurrently, each with its ``rank_offset``, and joins the group itself as rank 0; then it
pauses generation and opens the update sessions. ``send``: ``/update_weights_from_distributed`` to every
server plus an asynchronous broadcast of the bucket (``flattened_bucket``: one broadcast of the flat
buffer; ``per_tensor``, servers older than SGLang 0.5.6: one per tensor). ``settle``: every server's
answer and the broadcast, against one deadline. ``commit``: ``/end_weight_update`` (the reference
server swaps weights and version here), then resume. ``abort``: destroy the group on both sides (the
reference server drops what it staged), discard the sessions, resume.

**One request for the whole sync** (``atomic_mb``): real SGLang loads each request as soon as it received
it, so a sync that fails after some buckets leaves it torn. But every release receives all of a request's
tensors before it loads any of them. A full sync of at most ``atomic_mb`` to servers that load as they
arrive is therefore sent as one per-tensor request, announced with the first bucket and answered after
the last; the buckets still travel one after the other (rank 0 holds two at most), one broadcast per
tensor. If the sync fails, no such server loaded anything unless it received every tensor, so it keeps
its version and is resumed.

Every group gets a fresh name (``<group_name>-<8 hex>``): a group whose destroy failed on some
server keeps its name there, and must not block the next one.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import ipaddress
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from bridge.buckets import Bucket
from bridge.errors import BridgeError, ConfigError, SyncError, SyncTimeout
from bridge.log import get_logger
from bridge.process_group import (
    default_backend,
    destroy_custom_process_group,
    find_free_port,
    init_custom_process_group,
    route_source,
)
from bridge.tensors import host_buffer
from bridge.transports.base import (
    Plan,
    ServerSessions,
    SessionOptions,
    Transport,
    bucket_answers,
    deadline_left,
    is_local,
    option,
)
from bridge.transports.registry import register

__all__ = ["BroadcastOptions", "BroadcastTransport", "destroy_on", "is_local", "is_loopback", "make_group",
           "master_address_for", "teardown_group"]

logger = get_logger(__name__)


@dataclass(kw_only=True)
class BroadcastOptions(SessionOptions):
    """The broadcast transport's options: how servers pause and load (:class:`SessionOptions`), and where
    they meet trainer rank 0 for the weight-update group."""

    group_name: str = option("wsync_weight_update", "name of the weight-update process group (the store "
                                                      "prefix both sides use)")
    master_address: str | None = option(None, "address of trainer rank 0 as the servers reach it (default: "
                                              "127.0.0.1 if every server is local, else this host's address)")
    master_port: int | None = option(None, "port of the weight-update group's rendezvous (default: a free port)")
    atomic_mb: float = option(1024.0, "a full sync of at most this many MB reaches servers that load buckets as "
                                      "they arrive (real SGLang) as one request, received whole before any of it is "
                                      "loaded, so a failed sync leaves them on their version; each holds that much "
                                      "more memory during the sync (every TP rank the whole tensors). Larger syncs "
                                      "go bucket by bucket, and one that fails part-way leaves such servers torn, "
                                      "out of rotation until a publish repairs them; 0: always bucket by bucket")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.master_address is not None and not self.master_address.strip():
            raise ConfigError("master_address must not be empty (leave it out to let the kernel choose)")
        if not self.group_name:
            raise ConfigError("group_name must not be empty")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master_port must be a port number (1-65535), got {self.master_port}")
        if isinstance(self.atomic_mb, bool) or not isinstance(self.atomic_mb, (int, float)) or not self.atomic_mb >= 0:
            raise ConfigError(f"atomic_mb must be a number of MB, 0 or more, got {self.atomic_mb!r}")


@register
class BroadcastTransport(Transport):
    name = "broadcast"
    aliases = ("nccl", "xccl", "distributed")
    Options = BroadcastOptions
    encodings = ("full", "delta")

    @staticmethod
    def check_servers(config, urls) -> None:
        """A loopback master_address only with local servers (also the ones found in a registry, checked at
        each sync's begin)."""
        remote = [u for u in urls if not is_local(u)]
        if remote and config.master_address and is_loopback(config.master_address):
            raise ConfigError(
                f"master_address={config.master_address} is a loopback address, which the servers on other hosts "
                f"({', '.join(remote)}) cannot reach; set master_address (wsync train --master-address) to this "
                "host's address on their network, or leave it out: the address of the interface that routes to "
                "them is found by itself"
            )

    def __init__(self, config, servers):
        super().__init__(config, servers)
        self.backend = config.backend or default_backend()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.pg: dist.ProcessGroup | None = None
        self.group_name: str | None = None
        self.load_format = "flattened_bucket"
        self._inflight = None  # (k, broadcast works, HTTP futures, buffer)
        self._whole: _WholeSync | None = None  # this sync goes as one request (see the module docstring)
        self._group_init_s = 0.0  # this sync's seconds creating the weight-update group (0 when it was kept)

    # ------------------------------------------------------------------ lifecycle

    def begin(self, plan: Plan) -> None:
        self.check_servers(self.config, self.servers.urls)
        self.load_format = self._pick_load_format()
        self._whole = self._whole_sync(plan)
        if self._whole is not None:
            self.load_format = "per_tensor"
        lease = self.writer_lease()
        lease.may_tear = self._whole is None and not all(c.can.staged for c in self.servers.clients)
        self.sessions = ServerSessions(self.servers, self.config.pause_mode, lease)
        self.sessions.open()
        t = time.perf_counter()
        self._ensure_group()
        self._group_init_s = time.perf_counter() - t

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        if self.device.type == "cpu":  # gloo: a CUDA trainer's bucket lands in pinned host memory
            return host_buffer(bucket.nbytes)
        return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        if self._whole is not None:
            self._send_whole(k, bucket, buf, version)
            return
        cfg, last = self.config, version is not None
        fields = bucket.request_fields()
        futures = self.servers.submit(
            lambda c: c.update_weights_from_distributed(
                **fields, group_name=self.group_name,
                load_format="flattened_bucket" if self.load_format == "flattened_bucket" else None,
                flush_cache=last, weight_version=str(version) if last and c.can.staged else None,
                timeout=cfg.group_timeout + cfg.http_timeout,
            )
        )
        if self.load_format == "flattened_bucket":
            works = [dist.broadcast(buf, src=0, group=self.pg, async_op=True)]
        else:
            works = [
                dist.broadcast(buf[o : o + s.nbytes].view(s.dtype).view(s.shape), src=0, group=self.pg, async_op=True)
                for s, o in zip(bucket.specs, bucket.offsets)
            ]
        self._inflight = (k, works, futures, buf)

    def settle(self) -> None:
        """Wait for every server's answer, then the broadcast, against one deadline."""
        if self._inflight is None:
            return
        if self._whole is not None:
            self._settle_whole()
            return
        (k, works, futures, _), self._inflight = self._inflight, None
        cfg = self.config
        deadline = time.monotonic() + cfg.group_timeout + cfg.http_timeout
        try:
            # On an error, a server that refused the bucket may not have joined its broadcast: the group is
            # not trustworthy any more (abort tears it down; the next publish builds a new one).
            bucket_answers(self.servers.clients, futures, k, cfg.group_timeout + cfg.http_timeout,
                           "group_timeout + http_timeout")
            error = _first_error(works, lambda w: w.wait(timedelta(seconds=deadline_left(deadline))))
        finally:
            works.clear()  # see _first_error
        if error is not None:
            raise SyncError(f"broadcast of bucket {k} failed: {error}")

    def commit(self, plan: Plan, reports: list) -> dict:
        self._whole = None
        return {"servers": self.sessions.commit(plan.version), "phases": {"group_init": self._group_init_s}}

    def abort(self, reason: str) -> str:
        self._inflight = None
        whole, self._whole = self._whole, None
        name, had_group = self.group_name, self.pg is not None
        self._close_group()  # a server still receiving gives up now, not after its group's timeout
        if self.sessions is None:
            return ""

        def first(c) -> None:
            if whole is not None:
                whole.loaded_nothing(c, self.sessions)
            if had_group:
                self._destroy_on(c, name)

        # Per server: drop its group (the reference server drops what it staged), discard, resume.
        self.sessions.abort(first=first if had_group or whole is not None else None)
        return self.sessions.serving()

    def _close_group(self) -> None:
        """Destroy the group here and let go of it: gloo closes its connections only when the group's last reference
        goes (destroying it only unregisters it), and real SGLang waits for a broadcast until its connection closes
        or its own group timeout (30 minutes) runs out."""
        if self.pg is not None:
            destroy_custom_process_group(self.pg)
            self.pg = self.group_name = None
            gc.collect()

    # ------------------------------------------------------------------ one request for the whole sync

    def _whole_sync(self, plan: Plan) -> _WholeSync | None:
        """A full sync of at most ``atomic_mb`` with a server that loads buckets as they arrive goes as one request
        (auto and per_tensor load formats only: flattened_bucket asked for is kept)."""
        cfg = self.config
        if (plan.encoded is not None or cfg.load_format == "flattened_bucket" or not cfg.atomic_mb
                or plan.nbytes > cfg.atomic_mb * 2**20 or all(c.can.staged for c in self.servers.clients)):
            return None
        return _WholeSync(plan)

    def _send_whole(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        """Bucket ``k`` of a sync sent as one request: the request goes out with bucket 0, then each bucket as one
        broadcast per tensor, in the request's order."""
        cfg, whole = self.config, self._whole
        if bucket.specs != whole.buckets[k].specs:
            raise SyncError(f"bucket {k} is not the one planned at begin; the sync cannot go as one request")
        if k == 0:
            fields = whole.request_fields()
            whole.futures = self.servers.submit(
                lambda c: c.update_weights_from_distributed(
                    **fields, group_name=self.group_name, load_format=None, flush_cache=True,
                    weight_version=str(whole.version) if c.can.staged else None,
                    timeout=len(whole.buckets) * (cfg.group_timeout + cfg.http_timeout),
                )
            )
        works = [
            dist.broadcast(buf[o : o + s.nbytes].view(s.dtype).view(s.shape), src=0, group=self.pg, async_op=True)
            for s, o in zip(bucket.specs, bucket.offsets)
        ]
        whole.sent = k + 1
        self._inflight = (k, works, whole.futures if version is not None else None, buf)

    def _settle_whole(self) -> None:
        """The broadcasts of the bucket in flight, polled against one deadline while watching the answers: a server
        that refused the request (it never joins the broadcasts) fails the sync at once. After the last bucket,
        every server's answer."""
        (k, works, answers, _), self._inflight = self._inflight, None
        cfg, whole = self.config, self._whole
        bound = cfg.group_timeout + cfg.http_timeout
        deadline = time.monotonic() + bound
        try:
            while not all(w.is_completed() for w in works):
                refused = [i for i, f in enumerate(whole.futures) if f.done() and f.exception() is not None]
                if refused:
                    bucket_answers([self.servers.clients[i] for i in refused], [whole.futures[i] for i in refused],
                                   k, bound, "group_timeout + http_timeout")
                if time.monotonic() > deadline:
                    raise SyncTimeout(f"broadcast of bucket {k} did not end within {bound:g} s "
                                      "(group_timeout + http_timeout)")
                time.sleep(0.002)
            error = _first_error(works, lambda w: w.wait())  # completed: raises its error, if it failed
        finally:
            works.clear()  # see _first_error
        if error is not None:
            raise SyncError(f"broadcast of bucket {k} failed: {error}")
        if answers is not None:
            bucket_answers(self.servers.clients, answers, k, bound, "group_timeout + http_timeout")

    def use_servers(self, servers) -> None:
        """A group is made for one set of servers: another set (a server died, or joined) gets a new one, and
        so does a set with a server out of rotation (:mod:`bridge.fleet`): one restarted at the same URL has
        lost the group, and this publish repairs it. The old one is dropped here and on the servers that stay
        (a dead one is not waited for)."""
        changed = servers is None or servers.urls != self.servers.urls
        if self.pg is not None and (changed or servers.out_of_rotation):
            self._teardown_group(keep=set(servers.urls) if servers is not None else set())
        super().use_servers(servers)

    def close(self) -> None:
        self._teardown_group()
        if self.sessions is not None:
            self.sessions.close()

    # ------------------------------------------------------------------ the group

    def _pick_load_format(self) -> str:
        wanted = self.config.load_format
        old = [c.url for c in self.servers.clients if not c.features.flattened_bucket]
        if wanted == "flattened_bucket" and old:
            raise ConfigError(f"servers {old} cannot take flattened buckets (SGLang too old); use load_format='per_tensor' or 'auto'")
        if wanted != "auto":
            return wanted
        return "per_tensor" if old else "flattened_bucket"

    def _ensure_group(self) -> None:
        if self.pg is not None:
            return
        cfg = self.config
        self.pg, self.group_name = make_group(
            self.servers, prefix=cfg.group_name, master_address=cfg.master_address, master_port=cfg.master_port,
            backend=self.backend, group_timeout=cfg.group_timeout, http_timeout=cfg.http_timeout)

    def _teardown_group(self, keep: set[str] | None = None) -> None:
        """Destroy the group here and ask the servers (those in ``keep`` only, when given) to drop theirs
        (best effort, bounded)."""
        pg, name, self.pg, self.group_name = self.pg, self.group_name, None, None
        clients = [c for c in self.servers.clients if keep is None or c.url in keep]
        teardown_group(pg, name, clients)

    @staticmethod
    def _destroy_on(c, name: str) -> None:
        destroy_on(c, name)


def _first_error(works: list, wait) -> str | None:
    """``wait(work)`` for each broadcast of ``works``; the first one's error, as text. The caller lets go of the works
    (``works.clear()``) before it raises: a gloo work holds the group's connections, so one kept alive by an
    exception's traceback would keep a server that still receives waiting for its own group timeout after abort
    closed the group."""
    for w in works:
        try:
            wait(w)
        except RuntimeError as e:
            return str(e)
    return None


class _WholeSync:
    """A sync sent as one request (see the module docstring): its buckets, the request's answers, how many buckets
    went out."""

    def __init__(self, plan: Plan) -> None:
        self.version, self.buckets = plan.version, plan.buckets
        self.futures: list = []
        self.sent = 0

    def request_fields(self) -> dict:
        specs = [s for b in self.buckets for s in b.specs]
        return Bucket(specs).request_fields() if specs else {"names": [], "dtypes": [], "shapes": []}

    def loaded_nothing(self, c, sessions: ServerSessions, wait_s: float = 3.0) -> None:
        """After a failed sync: tell ``sessions`` that ``c`` loaded nothing of it, when its request failed (it gives up
        receiving once the group is destroyed; waited for up to ``wait_s``) before the last bucket went out, or with
        SGLang's "Failed to receive weights" (0.5.21 on). A server that answered success, failed after every bucket
        went out (its loader may have run), or did not answer, may be torn."""
        if not self.futures:
            sessions.loaded_nothing(c)  # the request never went out
            return
        f = self.futures[sessions.servers.clients.index(c)]
        try:
            f.result(timeout=wait_s)
        except cf.TimeoutError:
            return
        except BridgeError as e:
            if self.sent < len(self.buckets) or "Failed to receive weights" in str(e):
                sessions.loaded_nothing(c)


def make_group(servers, *, prefix: str, master_address: str | None, master_port: int | None, backend: str,
               group_timeout: float, http_timeout: float) -> tuple[dist.ProcessGroup, str]:
    """A fresh weight-update group (``<prefix>-<8 hex>``) of trainer rank 0 (this process) and every server of
    ``servers`` (a :class:`bridge.client.ServerGroup`): ``/init_weights_update_group`` to every server at once,
    each with its ``rank_offset``, while this process joins as rank 0; ``(group, name)``.

    Raises:
        SyncError: a server refused to join (at once, not after group_timeout).
        SyncTimeout: the servers did not join within group_timeout (the error names the address they were told).
        ConfigError: no address of this host reaches the servers (:func:`master_address_for`).
    """
    address = master_address_for(servers.urls, master_address)
    port = master_port or find_free_port("0.0.0.0" if address != "127.0.0.1" else address)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    world_size = servers.world_size()
    offset_of = dict(zip(servers.urls, servers.rank_offsets()))
    logger.info("creating weight-update group %s at %s:%d (%s, world size %d)", name, address, port, backend, world_size)
    deadline = time.monotonic() + group_timeout + http_timeout
    futures = servers.submit(
        lambda c: c.init_weights_update_group(
            master_address=address, master_port=port, rank_offset=offset_of[c.url], world_size=world_size,
            group_name=name, backend=backend, timeout=group_timeout,
        )
    )
    try:
        pg = _join_unless_refused(futures, servers.clients, lambda: init_custom_process_group(
            master_address=address, master_port=port, world_size=world_size, rank=0,
            group_name=name, backend=backend, timeout=group_timeout,
        ))
    except SyncTimeout as e:
        failed = [f"{c.url}: {f.exception()}" for c, f in zip(servers.clients, futures) if f.done() and f.exception()]
        missing = [c.url for c, f in zip(servers.clients, futures) if not f.done()]
        raise SyncTimeout(
            f"servers did not join the weight-update group within group_timeout={group_timeout:g} s: "
            f"{'; '.join(failed) or missing or '?'} ({e}); they were told to meet trainer rank 0 at "
            f"{address}:{port}: if they cannot reach it, set master_address and master_port (wsync train "
            "--master-address, --master-port) to an address and port they can reach"
        ) from e
    try:
        for c, f in zip(servers.clients, futures):
            try:
                f.result(timeout=deadline_left(deadline))
            except FutureTimeout:
                raise SyncTimeout(f"{c.url}: no answer to init_weights_update_group within "
                                  f"{group_timeout + http_timeout:.0f} s (group_timeout + http_timeout)") from None
    except BaseException:  # a server that joined and did not answer: the group is not trusted (dropped both sides)
        teardown_group(pg, name, servers.clients)
        raise
    return pg, name


def teardown_group(pg: dist.ProcessGroup | None, name: str | None, clients) -> None:
    """Destroy group ``pg`` here and ask each of ``clients`` to drop its side (best effort, bounded: a refusal or
    an unreachable server is logged, never raised)."""
    if pg is None:
        return
    destroy_custom_process_group(pg)
    for c in clients:
        try:
            destroy_on(c, name)
        except BridgeError as e:
            logger.debug("destroy_weights_update_group on %s: %s", c.url, e)


def destroy_on(c, name: str) -> None:
    """Ask server ``c`` to drop group ``name`` (servers too old for ``/destroy_weights_update_group`` are skipped)."""
    if c.features.destroy_group:
        c.destroy_weights_update_group(group_name=name)


def _join_unless_refused(futures, clients, join):
    """Run ``join()`` (the blocking rendezvous), but fail at once when a server refuses to join,
    instead of after group_timeout. The abandoned rendezvous ends by its own timeout."""
    box: list = []

    def run() -> None:
        try:
            box.append(("ok", join()))
        except BaseException as e:  # handed to the caller's thread
            box.append(("error", e))

    worker = threading.Thread(target=run, name="wsync-rendezvous", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
        refused = [(c, f.exception()) for c, f in zip(clients, futures) if f.done() and f.exception() is not None]
        if refused and worker.is_alive():
            c, e = refused[0]
            raise SyncError(f"{c.url} refused to join the weight-update group: {e}")
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def master_address_for(urls: list[str], given: str | None) -> str:
    """The address the servers reach trainer rank 0 at: ``given``; else 127.0.0.1 when every server is on
    this host; else the address of this host's interface that routes to the first remote server, as the
    kernel chooses it (a UDP socket connected to the server, then ``getsockname``: nothing is sent). The
    host name's address is no answer: it is 127.0.0.1 or 127.0.1.1 on many hosts."""
    if given:
        return given
    remote = [u for u in urls if not is_local(u)]
    if not remote:
        return "127.0.0.1"
    parsed = urlparse(remote[0] if "://" in remote[0] else "http://" + remote[0])
    try:
        return route_source(parsed.hostname, parsed.port or 80)
    except OSError as e:
        raise ConfigError(f"cannot find this host's address on the way to {remote[0]} ({e}); set master_address "
                          "(wsync train --master-address) to the address the servers reach this host at") from e


def is_loopback(address: str) -> bool:
    """True for an address only this host can reach (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
