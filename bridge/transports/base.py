"""The lifecycle every transport follows, which sink each rank uses, and the server bookkeeping that
broadcast and colocated share.

:class:`bridge.publisher.core.WeightPublisher` drives one sync as a fixed sequence of steps; after each
step every trainer rank learns every rank's outcome (:mod:`bridge.publisher.agreement`), so all ranks go on or
all raise the same error. A transport only says how bytes move. Which process runs each method:

============  ========  ==================================================================================
method        who       what
============  ========  ==================================================================================
``begin``     rank 0    open the sync: check the version, take the servers (one writer at a time,
                        :class:`ServerSessions`), connect (process group), pause generation, open update
                        sessions. Nothing has moved yet. What it returns reaches every rank's sink.
``buffer``    rank 0    the uint8 tensor bucket ``k`` is gathered into (every rank then gathers into it).
``send``      rank 0    put bucket ``k`` on its way; may return before it arrived (the gather of bucket
                        ``k+1`` overlaps it). The last bucket carries the version.
``settle``    rank 0    wait until every bucket sent arrived everywhere; raise if one did not. At most
                        one bucket is in flight, so rank 0 holds at most about two buckets.
``commit``    rank 0    make the version live on every server (end the session, or announce a snapshot),
                        given what every rank's sink reported at settle.
``abort``     rank 0    after a failure on any rank, at any step: leave every server serving its previous
                        version, unpaused, with no open session, and let go of it. Bounded in time, never
                        raises; returns a line saying what the servers serve now.
``close``     rank 0    release connections (the publisher is closed).
============  ========  ==================================================================================

Every rank also has a :class:`~bridge.transports.sink.Sink`, chosen by ``Transport.sink``: what receives
the buckets gathered to that rank (``buffer``, ``send``, ``settle``, ``abort``), and which rank receives
bucket ``k`` (``owner``). By default rank 0's sink is its transport (the methods above, one bucket in flight)
and the other ranks receive nothing; disk with ``disk_writers="all"`` gives every rank a sink that writes its
own shards (:class:`bridge.transports.shard_writer.ShardWriter`), which is how a transport gives its ranks work of
their own without the driver knowing it.

A transport also declares, as class attributes: ``name`` and ``aliases`` (it registers itself with
:func:`bridge.transports.register`), ``Options`` (a dataclass of its own settings, checked in its
``__post_init__``), ``needs_servers``, and ``source_needs`` (the optional capabilities of a weight
source it cannot do without, see :class:`bridge.sources.CheckedSource`).

Failure handling lives once, in the driver: a transport raises whatever it meets and the driver turns
it into one agreed error, calls ``abort`` on rank 0 and re-raises on every rank. When rank 0's own step
failed, it calls ``abort`` at once, before the other ranks answer (unless ``gives_back_early`` is False),
so that servers are not kept paused while it waits for a rank that died; ``abort`` must therefore be
idempotent. Adding a transport is one new module (docs/architecture.md, "Adding a transport")::

    @register
    class FileTransport(Transport):
        name = "file"
        def send(self, k, bucket, buf, version): ...
        def commit(self, plan, reports): ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from bridge.buckets import Bucket
from bridge.codecs.delta import DELTA_FIELD
from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.options import NoOptions, option
from bridge.publisher.plan import Plan
from bridge.transports.loader import LoaderSink
from bridge.transports.sessions import (  # noqa: F401 (re-exported: a transport of one file imports them from here)
    ServerSessions,
    bucket_answers,
    deadline_left,
    discard_session,
    pause_mode_for,
)
from bridge.transports.sink import Sink, TransportSink

__all__ = ["NoOptions", "Plan", "ServerSessions", "Sink", "SessionOptions", "Transport", "is_local", "option",
           "pause_mode_for"]

logger = get_logger(__name__)


@dataclass(kw_only=True)
class SessionOptions:
    """Options of the transports that pause the servers and update them in sessions (broadcast, colocated)."""

    pause_mode: str = option("auto", "how servers pause during a sync (SGLang's /pause_generation mode): auto "
                                     "(per server, a mode that keeps the requests in flight where its SGLang "
                                     "version has a safe one: retract or in_place; else abort), abort (ends them), "
                                     "retract, in_place, or none to not pause")
    load_format: str = option("auto", "auto (flattened buckets when every server takes them), flattened_bucket "
                                      "or per_tensor")
    writer_lease: float = option(10.0, "seconds a server stays reserved for this publisher after its last word: "
                                       "renewed while a sync runs, so a dead publisher blocks others that long")
    writer_lock: str | None = option(None, "name resolution (etcd://host:port or file:///dir) holding a lock per "
                                           "server for servers without the reference server's writer lease (real "
                                           "SGLang), so that two trainers never write into one at once")

    def __post_init__(self) -> None:
        if self.pause_mode not in ("auto", "abort", "retract", "in_place", "none"):
            raise ConfigError(f"pause_mode must be auto, abort, retract, in_place or none, got {self.pause_mode!r}")
        if self.load_format not in ("auto", "flattened_bucket", "per_tensor"):
            raise ConfigError(f"load_format must be auto, flattened_bucket or per_tensor, got {self.load_format!r}")
        if isinstance(self.writer_lease, bool) or not isinstance(self.writer_lease, (int, float)) or \
                not 0.5 <= self.writer_lease <= 3600:
            raise ConfigError(f"writer_lease must be 0.5-3600 seconds, got {self.writer_lease!r}")
        if self.writer_lock is not None and urlparse(str(self.writer_lock)).scheme not in ("etcd", "etcd3", "file", "memory"):
            raise ConfigError(f"writer_lock must be a name resolution URL (etcd://host:port or file:///dir), got "
                              f"{self.writer_lock!r}")


class Transport:
    """One way of moving a sync's buckets to the servers; see the module docstring for the lifecycle."""

    name = "?"
    aliases: tuple[str, ...] = ()
    Options: type = NoOptions
    needs_servers = True
    """A publisher of this transport without a server URL is a ConfigError."""
    source_needs: tuple[str, ...] = ()
    """Optional capabilities of the weight source this transport cannot do without (checked before
    anything moves): any of :data:`bridge.sources.CAPABILITIES`."""

    encodings: tuple[str, ...] = ("full",)
    """The encodings (:mod:`bridge.encodings`) this transport can carry; an encoding of plain named tensors
    (``Encoding.any_transport``: full, or a quantized one) goes through every transport."""

    sets_labels = True
    """The transport sets the servers' version labels itself at commit (broadcast, colocated); False when a
    watcher loads what it published (disk), whose snapshots are the record of what each version holds."""

    gives_back_early = True
    """``abort`` may run on rank 0 as soon as rank 0's own step failed, before the other ranks answered
    (it only touches the servers). False when it must wait for the other ranks (disk: their writers)."""

    def __init__(self, config, servers):
        self.config = config
        self.servers = servers
        """A :class:`bridge.client.ServerGroup` of ``config.servers``, or None without servers."""
        self.sessions: ServerSessions | None = None
        """The servers' update sessions of the sync in progress, for a transport that pauses the servers and
        updates them in sessions (broadcast, colocated); None otherwise."""
        self._writer_lease = None
        self._loader: LoaderSink | None = None  # the route of deltas into SGLang's loader (route)

    @classmethod
    def check_config(cls, config) -> None:
        """Checks across the shared settings and the options (the options check themselves alone)."""
        if cls.needs_servers and not config.servers and not config.server_registry:
            raise ConfigError(f"the {cls.name} transport needs at least one server: their URLs (servers=[...]) or where "
                              "to find them (server_registry=...)")
        cls.check_servers(config, config.servers)

    @staticmethod
    def check_servers(config, urls) -> None:
        """Checks of the server URLs themselves: the listed ones here, the ones a registry finds at each begin."""

    @classmethod
    def sink(cls, config, transport: Transport | None, rank: int, world: int) -> Sink:
        """The sink this rank hands its buckets to, every sync (``transport`` is rank 0's, None on the other
        ranks): the transport itself on rank 0, none elsewhere (they only take part in the gathers)."""
        return TransportSink(transport) if transport is not None else Sink()

    @classmethod
    def commit_seconds(cls, config) -> float:
        """How long ``commit`` may take (every rank waits that long for rank 0 at most): end the
        sessions and resume by default."""
        return 3 * config.http_timeout

    def begin(self, plan: Plan) -> Any:
        """Rank 0: open the sync; what it returns is handed to every rank's ``Sink.begin``."""

    def route(self, bucket: Bucket) -> Sink | None:
        """Rank 0: where ``bucket`` goes instead of this transport, or None (here). The one place a bucket's route is
        decided, from what the bytes are and what the servers can do: a delta to servers that take it through
        SGLang's custom loader goes there over HTTP (:class:`bridge.transports.loader.LoaderSink`), whatever the
        transport, since SGLang has no route that takes a ``load_format`` with bytes from a group or a file."""
        servers = self.servers
        if not bucket.extra or DELTA_FIELD not in bucket.extra or servers is None or not servers.clients:
            return None
        if not all(c.can.delta == "loader" for c in servers.clients):
            return None
        if self._loader is None or self._loader.servers is not servers:
            self._loader = LoaderSink(servers, self.config.http_timeout)
        return self._loader

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        """Rank 0: a uint8 tensor of ``bucket.nbytes`` for bucket ``k`` (CPU by default)."""
        return torch.empty(bucket.nbytes, dtype=torch.uint8)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        """Rank 0: put bucket ``k`` on its way; ``version`` is set on the last bucket only."""
        raise NotImplementedError

    def settle(self) -> None:
        """Rank 0: wait until every bucket sent arrived (the one in flight, if any); raise if one did not."""

    def commit(self, plan: Plan, reports: list) -> dict:
        """Rank 0: make ``plan.version`` live; ``reports`` are what every rank's sink returned at settle
        (rank order). Returns what :class:`PublishResult` reports (``servers``: url -> "ok" or its error;
        optionally ``path``, ``bytes``, ``retried`` and ``phases``, seconds by name of this transport's own phases),
        which every rank receives."""
        raise NotImplementedError

    def abort(self, reason: str) -> str:
        """Rank 0: undo an open sync (see the module docstring); a line on what the servers serve now."""
        return ""

    def close(self) -> None:
        """Rank 0: release connections."""

    def newest_snapshot(self):
        """Rank 0: the newest complete snapshot a server out of rotation can be repaired from (a
        :class:`bridge.name_resolve.Announcement`), or None; only a transport that writes snapshots (disk) has one."""
        return None

    def use_servers(self, servers) -> None:
        """Rank 0, before ``begin``: the servers of the next sync (the fleet found them at this publish;
        :mod:`bridge.fleet`). A transport that keeps state per server set (a process group) overrides it and
        calls this one; the writer lease follows the new set."""
        self.servers = servers
        if self._writer_lease is not None and servers is not None:
            self._writer_lease.use_servers(servers)

    def held(self) -> dict[str, str]:
        """Rank 0, after a sync: the servers it left paused on purpose, url -> ``torn: why`` or ``failed:
        why`` (their weights may be partly changed, or they did not take the version beside the others)."""
        return dict(self.sessions.held) if self.sessions is not None else {}

    def writer_lease(self):
        """This publisher's hold on its servers, one writer at a time (:class:`bridge.transports.lease.WriterLease`),
        made once: hand it to :class:`ServerSessions`, which takes it before pausing and releases it after."""
        if self._writer_lease is None:
            from bridge.transports.lease import WriterLease

            cfg, options = self.config, self.config.session_options
            if options is None:
                raise ConfigError(f"the {self.name} transport updates servers in sessions, so its Options must "
                                  f"be SessionOptions (or a subclass), not {type(cfg.options).__name__}")
            self._writer_lease = WriterLease(self.servers, run_id=f"{cfg.experiment}/{cfg.trial}",
                                             seconds=options.writer_lease, lock_url=options.writer_lock)
        return self._writer_lease


def is_local(url: str) -> bool:
    """True for a loopback URL (the server runs on this host)."""
    host = urlparse(url if "://" in url else "http://" + url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def remove_file(path: str, what: str) -> None:
    """Remove ``path`` if it is still there; a failure is logged (naming ``what``), never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove %s %s: %s", what, path, e)
