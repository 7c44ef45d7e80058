"""The lifecycle every transport follows, the per-rank part of a sync, and the server bookkeeping that
broadcast and colocated share.

:class:`bridge.publisher.WeightPublisher` drives one sync as a fixed sequence of steps; after each
step every trainer rank learns every rank's outcome (:mod:`bridge.agreement`), so all ranks go on or
all raise the same error. A transport only says how bytes move. Which process runs each method:

============  ========  ==================================================================================
method        who       what
============  ========  ==================================================================================
``begin``     rank 0    open the sync: check the version, connect (process group), pause generation, open
                        update sessions. Nothing has moved yet. What it returns reaches every rank's part.
``buffer``    rank 0    the uint8 tensor bucket ``k`` is gathered into (every rank then gathers into it).
``send``      rank 0    put bucket ``k`` on its way; may return before it arrived (the gather of bucket
                        ``k+1`` overlaps it). The last bucket carries the version.
``settle``    rank 0    wait until the bucket in flight arrived everywhere; raise if it did not. At most
                        one bucket is in flight, so rank 0 holds at most about two buckets.
``commit``    rank 0    make the version live on every server (end the session, or announce a snapshot),
                        given what every rank's part reported at settle.
``abort``     rank 0    after a failure on any rank, at any step: leave every server serving its previous
                        version, unpaused, with no open session. Bounded in time, never raises; returns
                        a line saying what the servers serve now.
``close``     rank 0    release connections (the publisher is closed).
============  ========  ==================================================================================

Every rank also has a :class:`RankPart`, made by ``Transport.rank_part``: which rank receives bucket
``k`` (``owner``), and what that rank does with it (``buffer``, ``send``), what it reports at ``settle``,
how it stops (``abort``). The default part sends every bucket from rank 0 through the transport's
methods above; disk with ``disk_writers="all"`` gives every rank a part that writes its own shards
(:class:`bridge.transports.disk.ShardWriter`), which is how a transport gives its ranks work of their
own without the driver knowing it.

A transport also declares, as class attributes: ``name`` and ``aliases`` (it registers itself with
:func:`bridge.transports.register`), ``Options`` (a dataclass of its own settings, checked in its
``__post_init__``), ``needs_servers``, and ``source_needs`` (the optional capabilities of a weight
source it cannot do without, see :class:`bridge.sources.CheckedSource`).

Failure handling lives once, in the driver: a transport raises whatever it meets and the driver turns
it into one agreed error, calls ``abort`` on rank 0 and re-raises on every rank. When rank 0's own step
failed, it calls ``abort`` at once, before the other ranks answer (unless ``gives_back_early`` is False),
so that servers are not kept paused while it waits for a rank that died; ``abort`` must therefore be
idempotent. Adding a transport is one new module (README, "Adding a transport")::

    @register
    class FileTransport(Transport):
        name = "file"
        def send(self, k, bucket, buf, version): ...
        def commit(self, plan, reports): ...
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch

from bridge.buckets import Bucket
from bridge.errors import BridgeError, ConfigError, DeltaBaseMismatch, ServerError, SyncError, VersionError
from bridge.failpoints import armed, failpoint
from bridge.log import get_logger
from bridge.protocol import DELTA_BASE_MISMATCH

__all__ = ["NoOptions", "Plan", "RankPart", "ServerSessions", "SessionOptions", "Transport", "is_local", "option"]

logger = get_logger(__name__)


@dataclass
class Plan:
    """What one sync moves: known on every rank before the first byte moves."""

    version: int
    buckets: list[Bucket]
    source: Any = None
    """The :class:`bridge.sources.WeightSource` being published."""
    digest: int | None = None
    """The combined digest of every rank's shards (None when the source cannot tell)."""
    local_digest: Any = None
    """This rank's digest while it is computed in the background (a Future), for a new version."""
    retried: bool = False
    """True when this republishes the last version with identical weights (a safe retry)."""
    phases: dict[str, float] = field(default_factory=dict)
    encoded: Any = None
    """What the encoding (:mod:`bridge.encodings`) planned for this sync; None for ``full``."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def option(default: Any, help: str) -> Any:
    """A field of a transport's ``Options``; ``help`` is what ``wsync train --help`` shows for its flag."""
    return field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class NoOptions:
    """The options of a transport that has none of its own."""


@dataclass(kw_only=True)
class SessionOptions:
    """Options of the transports that pause the servers and update them in sessions (broadcast, colocated)."""

    pause_mode: str = option("abort", "how servers pause during a sync (SGLang's /pause_generation mode): "
                                      "abort, retract, in_place, or none to not pause")
    load_format: str = option("auto", "auto (flattened buckets when every server takes them), flattened_bucket "
                                      "or per_tensor")

    def __post_init__(self) -> None:
        if self.pause_mode not in ("abort", "retract", "in_place", "none"):
            raise ConfigError(f"pause_mode must be abort, retract, in_place or none, got {self.pause_mode!r}")
        if self.load_format not in ("auto", "flattened_bucket", "per_tensor"):
            raise ConfigError(f"load_format must be auto, flattened_bucket or per_tensor, got {self.load_format!r}")


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
    """The encodings (:mod:`bridge.encodings`) this transport can carry."""

    gives_back_early = True
    """``abort`` may run on rank 0 as soon as rank 0's own step failed, before the other ranks answered
    (it only touches the servers). False when it must wait for the other ranks (disk: their writers)."""

    def __init__(self, config, servers):
        self.config = config
        self.servers = servers
        """A :class:`bridge.client.ServerGroup` of ``config.servers``, or None without servers."""

    @classmethod
    def check_config(cls, config) -> None:
        """Checks across the shared settings and the options (the options check themselves alone)."""
        if cls.needs_servers and not config.servers:
            raise ConfigError(f"the {cls.name} transport needs at least one server URL (servers=[...])")

    @classmethod
    def rank_part(cls, config, transport: Transport | None, rank: int, world: int) -> RankPart:
        """This rank's part of every sync (``transport`` is rank 0's, None on the other ranks)."""
        return RankPart(transport)

    @classmethod
    def commit_seconds(cls, config) -> float:
        """How long ``commit`` may take (every rank waits that long for rank 0 at most): end the
        sessions and resume by default."""
        return 3 * config.http_timeout

    def begin(self, plan: Plan) -> Any:
        """Rank 0: open the sync; what it returns is handed to every rank's ``RankPart.begin``."""

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        """Rank 0: a uint8 tensor of ``bucket.nbytes`` for bucket ``k`` (CPU by default)."""
        return torch.empty(bucket.nbytes, dtype=torch.uint8)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        """Rank 0: put bucket ``k`` on its way; ``version`` is set on the last bucket only."""
        raise NotImplementedError

    def settle(self) -> None:
        """Rank 0: wait for the bucket in flight, if any."""

    def commit(self, plan: Plan, reports: list) -> dict:
        """Rank 0: make ``plan.version`` live; ``reports`` are what every rank's part returned at settle
        (rank order). Returns what :class:`PublishResult` reports (``servers``: url -> "ok" or its error;
        optionally ``path``, ``bytes`` and ``retried``)."""
        raise NotImplementedError

    def abort(self, reason: str) -> str:
        """Rank 0: undo an open sync (see the module docstring); a line on what the servers serve now."""
        return ""

    def close(self) -> None:
        """Rank 0: release connections."""


class RankPart:
    """One trainer rank's part of a sync, on every rank. This default sends every bucket from rank 0
    through its transport; the other ranks only take part in the gathers."""

    stops_before_abort = False
    """True when every rank's part must have stopped (``abort``) before rank 0's transport aborts (its
    files live in the folder rank 0 removes); the driver then waits for all of them."""

    def __init__(self, transport: Transport | None = None):
        self.transport = transport

    def owner(self, k: int) -> int:
        """The rank bucket ``k`` is gathered to (when the source can gather to any rank; else rank 0)."""
        return 0

    def begin(self, opened: Any, plan: Plan) -> None:
        """A sync starts; ``opened`` is what rank 0's ``Transport.begin`` returned."""

    def buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        """On the rank bucket ``k`` is gathered to: the buffer it is gathered into."""
        return self.transport.buffer(k, bucket)

    def send(self, k: int, bucket: Bucket, buf: torch.Tensor, version: int | None) -> None:
        """On the rank bucket ``k`` was gathered to: pass it on (``version`` on the last bucket only)."""
        self.transport.settle()  # bucket k-1 arrived first: one bucket in flight at most
        self.transport.send(k, bucket, buf, version)

    def settle(self) -> Any:
        """Every bucket was handed on: wait for this rank's own work; what it returns reaches ``commit``."""
        return None

    def abort(self, seconds: float) -> None:
        """The sync failed: stop this rank's work within ``seconds`` and remove what it made. Never raises."""

    def close(self) -> None:
        """The publisher is closed."""


class ServerSessions:
    """Pause, update sessions and resume on a :class:`bridge.client.ServerGroup`, server by server.

    Each server's state is tracked on its own, so a failure on one server (it refuses to pause, say)
    still resumes the others that were paused, and a failed sync discards the sessions that were opened.
    """

    def __init__(self, servers, pause_mode: str):
        self.servers, self.pause_mode = servers, pause_mode
        self.paused: list = []
        self.in_session: list = []
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, len(servers.clients)), thread_name_prefix="wsync-session")

    def open(self) -> None:
        """Pause every server (unless ``pause_mode`` is none), then open a session where one is needed."""
        if self.pause_mode != "none":
            done, errors = self._each(lambda c: c.pause_generation(mode=self.pause_mode), self.servers.clients)
            self.paused += done
            _raise_first(errors, "pause generation")
        done, errors = self._each(self._begin, [c for c in self.servers.clients if c.features.needs_session])
        self.in_session += done
        _raise_first(errors, "open an update session")

    @staticmethod
    def _begin(c) -> None:
        try:
            c.begin_weight_update()
        except ServerError as e:
            if "already" not in e.message and "end_weight_update" not in e.message:
                raise
            # A session left open by a trainer that died mid-sync: discard it (never commit it), then
            # open ours.
            logger.warning("%s had an update session open (a previous sync died); discarding it", c.url)
            discard_session(c)
            c.begin_weight_update()

    def commit(self, version: int | None = None) -> dict[str, str]:
        """Make ``version`` live on every server, then resume: end every session (the reference server
        swaps weights and version there). Real SGLang loaded every bucket as it arrived, so its label is
        set here, only now that every bucket arrived everywhere (``/update_weight_version``, inside the
        session): a sync that failed earlier never labels what it loaded.

        Servers commit concurrently. Failpoint ``commit:<i>`` fires before server ``i`` commits, once
        servers 0..i-1 have (so a test can fail a commit half-way)."""
        clients, in_session = self.servers.clients, set(self.in_session)
        futures: list[cf.Future] = []
        for i, c in enumerate(clients):
            futures.append(self._pool.submit(self._end, i, c, c in in_session, version, list(futures)))
        errors = [(c, f.exception()) for c, f in zip(clients, futures) if f.exception() is not None]
        failed = {c for c, _ in errors}
        self.in_session = [c for c in self.in_session if c in failed]
        _raise_first(errors, "commit the update")
        return self.resume()

    @staticmethod
    def _end(i: int, c, in_session: bool, version: int | None, earlier: list[cf.Future]) -> None:
        if armed(f"commit:{i}", 0):
            cf.wait(earlier)
            failpoint(f"commit:{i}", 0)
        if version is not None and not c.stages_updates and c.features.weight_version:
            c.update_weight_version(str(version))
        if in_session:
            c.end_weight_update()

    def resume(self) -> dict[str, str]:
        """Resume every paused server; url -> "ok" or why it could not be resumed (logged, not raised)."""
        status = {c.url: "ok" for c in self.servers.clients}
        done, errors = self._each(lambda c: c.continue_generation(), self.paused)
        for c, e in errors:
            status[c.url] = f"could not resume generation: {e}"
            logger.warning("%s: continue_generation failed: %s", c.url, e)
        self.paused = [c for c in self.paused if c not in done]
        return status

    def abort(self, first=None, seconds: float = 5.0) -> None:
        """Discard every open session and resume every paused server; never raises.

        Each server on its own thread (``first(client)``, then discard, then resume), so a server that
        does not answer never delays the others: they are resumed within milliseconds. Returns after at
        most ``seconds``; a server still not answered is left to its thread."""
        in_session, paused = set(self.in_session), set(self.paused)
        self.in_session, self.paused = [], []

        def one(c) -> None:
            for what, call, needed in (("clean up", first, first is not None), ("discard the update session",
                                       discard_session, c in in_session), ("resume generation",
                                       lambda c: c.continue_generation(), c in paused)):
                if not needed:
                    continue
                try:
                    call(c)
                except Exception as e:  # best effort, per server and per call
                    logger.warning("%s: could not %s: %s", c.url, what, e)

        threads = [threading.Thread(target=one, args=(c,), name="wsync-abort-server", daemon=True)
                   for c in self.servers.clients]
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def serving(self) -> str:
        """What every server serves now, in one line (for error messages)."""
        futures = [(c, self._pool.submit(lambda c=c: c.model_info().get("weight_version"))) for c in self.servers.clients]
        deadline = time.monotonic() + 2.0
        seen = []
        for c, f in futures:
            try:
                seen.append(f"{c.url}: version {f.result(timeout=deadline_left(deadline))}")
            except (BridgeError, cf.TimeoutError):
                seen.append(f"{c.url}: no answer")
        return "servers now serve " + ", ".join(seen)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _each(self, fn, clients: list) -> tuple[list, list[tuple]]:
        """Run ``fn(client)`` on each client concurrently: (clients that succeeded, [(client, error)])."""
        futures = [(c, self._pool.submit(fn, c)) for c in clients]
        done, errors = [], []
        for c, f in futures:
            e = f.exception()  # each call is bounded by the client's own HTTP timeout
            if e is None:
                done.append(c)
            else:
                errors.append((c, e))
        return done, errors


def _raise_first(errors: list[tuple], what: str) -> None:
    if errors:
        for c, e in errors[1:]:
            logger.warning("%s: also could not %s: %s", c.url, what, e)
        raise errors[0][1]


def discard_session(c) -> None:
    """Close a failed sync's session without applying it.

    The reference server discards what it staged (``/wsync/abort_weight_update``, a project
    extension). Real SGLang has no such route: it loads buckets as they arrive, so there is nothing
    to discard; its session is only closed, and the next publish re-sends every tensor.
    """
    try:
        c.abort_weight_update()
    except ServerError as e:
        if e.status == 400 and "no weight update session" in e.message.lower():
            return  # already discarded (the reference server does when its group is destroyed)
        if e.status != 404:
            raise
        c.end_weight_update()


def bucket_answers(clients: list, futures: list, k: int, seconds: float, setting: str) -> None:
    """Wait, against one deadline of ``seconds``, for every server's answer to bucket ``k``.

    Raises:
        VersionError: every server that failed refused the bucket's version (nothing was applied).
        SyncError: the failures, one per server (a server that did not answer in time names ``setting``).
    """
    deadline = time.monotonic() + seconds
    errors: list[BridgeError | str] = []
    for c, f in zip(clients, futures):
        try:
            f.result(timeout=deadline_left(deadline))
        except cf.TimeoutError:
            errors.append(f"{c.url}: no answer to bucket {k} within {seconds:g} s ({setting})")
        except BridgeError as e:
            errors.append(e)
    if errors:
        if any(getattr(e, "reason", None) == DELTA_BASE_MISMATCH for e in errors):
            raise DeltaBaseMismatch("; ".join(map(str, errors)))
        refused = all(isinstance(e, VersionError) for e in errors)
        raise (VersionError if refused else SyncError)("; ".join(map(str, errors)))


def is_local(url: str) -> bool:
    """True for a loopback URL (the server runs on this host)."""
    host = urlparse(url if "://" in url else "http://" + url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def deadline_left(deadline: float) -> float:
    """Seconds left until ``deadline`` (time.monotonic), at least 0.1."""
    return max(0.1, deadline - time.monotonic())


def remove_file(path: str, what: str) -> None:
    """Remove ``path`` if it is still there; a failure is logged (naming ``what``), never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("could not remove %s %s: %s", what, path, e)
