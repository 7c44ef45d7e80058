"""One writer at a time on each server: the publisher's side of the writer lease.

A publisher (rank 0) is one writer, named by its run (``experiment/trial``) and an id of its own
(``host:pid:random``). Before a sync pauses anything it takes every server for itself, renews that while the
sync runs (a thread, every third of the lease), and releases it when the sync ended, committed or not:

* **the reference server** has a lease of its own (``/wsync/writer_lease``, :mod:`inference_adapter.writers`;
  with one server it is taken by the pause's request):
  while it is live the server refuses weight changes from anyone else (HTTP 409, ``wsync_reason``
  :data:`~bridge.protocol.ANOTHER_WRITER`, naming the holder's run and writer);
* **real SGLang** has none, so the same is done, when ``writer_lock`` names a name resolution
  (``etcd://host:port`` or ``file:///dir``), by a lock with a lease there, one key per server
  (``wsync/writer_lock/<url>``): an etcd lease, or an entry of the directory backend written under its lock
  file. Without ``writer_lock`` nothing stops two trainers from writing into one real SGLang server at once;
  they must not share one (docs/guarantees.md, "One writer at a time").

Either way a writer that dies holds its servers for at most its lease (``writer_lease``, 10 s by default)
after its last renewal; a live one keeps them as long as it works, so another trainer (a zombie's
replacement, say) is refused, told which run holds the server, and never takes a live sync over.

Beside each lock the writer leaves a mark with no lease, ``wsync/writer_held/<url>`` (its run, its name, since when,
and whether its sync may tear the server: :attr:`WriterLease.may_tear`), removed when it lets go of the server. A
mark without its lock is the sign of a writer that died holding the server, which real SGLang then keeps paused:
``wsync watch --writer-lock`` gives such a server back (:mod:`bridge.fleet.abandoned`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import threading
import time
import uuid
from urllib.parse import quote

from bridge.errors import BridgeError, NameEntryExists, NameEntryNotFound, ServerError
from bridge.log import get_logger
from bridge.protocol import ANOTHER_WRITER
from bridge.publisher.bounded import each_within

__all__ = ["WriterLease", "held_key", "lock_key"]

logger = get_logger(__name__)


def lock_key(url: str) -> str:
    """The name-resolution key of the writer lock of the server at ``url``."""
    return f"wsync/writer_lock/{quote(url, safe='')}"


def held_key(url: str) -> str:
    """The name-resolution key of the mark a writer leaves beside its lock while it holds the server at ``url``."""
    return f"wsync/writer_held/{quote(url, safe='')}"


class WriterLease:
    """Takes, renews and releases one publisher's hold on its servers (see the module docstring).

    Args:
        servers: the :class:`bridge.client.ServerGroup`; every client is told this writer's name.
        run_id: ``experiment/trial``.
        seconds: the lease (``writer_lease``).
        lock_url: ``writer_lock``: the name resolution for servers without a lease of their own, or None.
    """

    def __init__(self, servers, *, run_id: str, seconds: float, lock_url: str | None = None):
        self.servers, self.run_id, self.seconds, self.lock_url = servers, run_id, float(seconds), lock_url
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        for c in servers.clients:
            c.name_writer(self.writer)
        self._nr = None  # the lock's name resolution, made at the first take
        self._held: dict[str, str] = {}  # url -> "lease" (the server's own) or "lock" (name resolution)
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.may_tear = True
        """Whether this sync may leave a server that loads as it receives with part of its weights changed (its
        transport says, before it takes the servers): what a writer that died holding a server leaves in its mark."""

    def use_servers(self, servers) -> None:
        """The servers of the next sync (the fleet found another set): each new client is told this writer's name."""
        self.servers = servers
        for c in servers.clients:
            c.name_writer(self.writer)

    def guards(self, client) -> bool:
        """True when this sync holds ``client``'s server through a lease or a lock, so that no other wsync writer
        can be writing there: an update session found open there was left by a writer that is gone."""
        return client.url in self._held

    def take(self, pause=None) -> bool:
        """Take every server, all or none (what was taken is released again when one is refused).

        ``pause(client, seconds)``, when given, pauses a server taking its own lease in the same request
        (``pause_generation(take_lease=seconds)``): used when the sync has one server and it has a lease of its
        own, as nothing else could have been paused before it. Returns True when that pause was done here.

        Raises:
            ServerError: ``reason`` ANOTHER_WRITER, naming the run and writer that hold a server.
        """
        clients = self.servers.clients
        if pause is not None and len(clients) == 1 and clients[0].can.writer_lease:
            c = clients[0]
            with self._mutex:  # held before asking: an interrupted request is released by the abort
                self._held[c.url] = "lease"
            try:
                pause(c, self.seconds)
            except ServerError as e:
                if e.reason == ANOTHER_WRITER:
                    self.forget(c)
                raise
            self._start_renewing()
            return True
        if len(clients) == 1:  # no thread hand-off for one server
            outcomes = [self._take_one(clients[0])]
        else:
            with cf.ThreadPoolExecutor(len(clients), thread_name_prefix="wsync-lease") as pool:
                outcomes = list(pool.map(self._take_one, clients))
        errors = [e for e in outcomes if e is not None]
        if errors:
            self.release()
            raise errors[0]
        self._start_renewing()
        return False

    def _start_renewing(self) -> None:
        self._stop.set()  # a renewer of an earlier sync ends on its own event
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, args=(self._stop,), name="wsync-lease-renewer",
                                         daemon=True)
        self._renewer.start()

    def releases_on_resume(self, client) -> bool:
        """True when ``client``'s server is held by its own lease, which its resume can release in the same
        request (:meth:`forget` it once that succeeded)."""
        with self._mutex:
            return self._held.get(client.url) == "lease"

    def forget(self, client) -> None:
        """``client``'s server was let go of otherwise (its resume released the lease)."""
        with self._mutex:
            self._held.pop(client.url, None)

    def held(self) -> dict[str, str]:
        """What is held (url -> "lease" or "lock"), now forgotten: the caller releases each with
        :meth:`release_one` (a second caller finds nothing left to release)."""
        with self._mutex:
            held, self._held = self._held, {}
        return held

    def release_one(self, client, kind: str | None = None) -> None:
        """Release ``client``'s server, held as ``kind`` (default: as this lease holds it). Never raises; a lease
        left behind runs out on its own."""
        if kind is None:
            with self._mutex:
                kind = self._held.pop(client.url, None)
        nr = self._nr
        try:
            if kind == "lease":
                client.release_writer_lease()
            elif kind == "lock" and nr is not None:  # None: closed meanwhile (an abort's late thread)
                try:  # the mark first: a mark without a lock says its writer died
                    nr.delete(held_key(client.url))
                except NameEntryNotFound:
                    pass
                nr.delete(lock_key(client.url))
        except (BridgeError, OSError) as e:
            logger.warning("%s: could not release the writer %s (it runs out within %g s): %s", client.url, kind,
                           self.seconds, e)

    def release(self, seconds: float = 5.0) -> None:
        """Release every server still held and stop renewing; never raises, and returns within ``seconds``
        (a server that does not answer is left to its thread; its lease runs out on its own)."""
        self._stop.set()
        each_within(self.release_one, [c for c in self.servers.clients if c.url in self._held], seconds,
                    thread_name="wsync-lease-release")

    def stop_renewing(self) -> None:
        """Renew nothing any more (what is still held runs out within the lease)."""
        self._stop.set()

    def close(self) -> None:
        self.release()
        if self._nr is not None:
            self._nr.close()
            self._nr = None

    # ------------------------------------------------------------------ per server

    def _take_one(self, c) -> BaseException | None:
        try:
            if c.can.writer_lease:
                c.take_writer_lease(self.seconds, starts_sync=True)
                kind = "lease"
            elif self.lock_url is not None:
                self._lock(c)
                kind = "lock"
            else:
                return None  # real SGLang without a lock: nothing to take (docs/guarantees.md, "One writer at a time")
        except BaseException as e:  # reported by take(), after the others were tried
            return e
        with self._mutex:
            self._held[c.url] = kind
        return None

    def _lock(self, c) -> None:
        from bridge.name_resolve import make_name_resolve

        with self._mutex:  # the servers are taken concurrently
            if self._nr is None:
                self._nr = make_name_resolve(self.lock_url)
        value = json.dumps({"writer": self.writer, "run_id": self.run_id})
        # A lock that ran out between the add and the read is taken at once (a few tries), not refused.
        who = "a writer that let go of it as this one tried, three times; retry"
        for _ in range(3):
            try:
                self._nr.add(lock_key(c.url), value, ttl=self.seconds, keepalive=True, replace=False)
            except NameEntryExists:
                try:
                    other = json.loads(self._nr.get(lock_key(c.url)))
                    other = other if isinstance(other, dict) else {}
                except NameEntryNotFound:
                    continue
                except ValueError:
                    other = {}
                who = f"run {other.get('run_id')!r}, writer {other.get('writer')!r}"
                break
            else:
                mark = {"writer": self.writer, "run_id": self.run_id, "since": time.time(), "may_tear": self.may_tear}
                try:
                    self._nr.add(held_key(c.url), json.dumps(mark), replace=True)
                except BaseException:
                    self._nr.delete(lock_key(c.url))
                    raise
                return
        raise ServerError(
            c.url, f"another writer holds this server ({ANOTHER_WRITER}): {who}, by its lock in {self.lock_url} "
            f"(a lease of at most the holder's writer_lease after its last renewal). A server takes weight changes "
            "from one writer at a time; retry once that writer ended its sync, or stop the other trainer",
            None, "writer lock", reason=ANOTHER_WRITER)

    def _renew(self, stop: threading.Event) -> None:
        """Renew the servers' own leases every third of the lease while held (name resolution keeps its
        locks alive itself)."""
        while not stop.wait(self.seconds / 3):
            with self._mutex:
                leased = [c for c in self.servers.clients if self._held.get(c.url) == "lease"]
            for c in leased:
                try:
                    c.take_writer_lease(self.seconds, renew_only=True)  # one arriving after the release takes nothing
                except BridgeError as e:  # the sync's next request to it fails too, naming the cause
                    logger.warning("%s: could not renew the writer lease: %s", c.url, e)
