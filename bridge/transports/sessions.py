"""Pause, update sessions, commit and resume on a set of servers, server by server: what the transports that
update servers in sessions (broadcast, colocated) share, and the wait for every server's answer to a bucket.

A server that loads buckets as they arrive and got some of a failed sync's is held paused (out of
rotation) instead of being resumed on a torn model; a writer lease (:mod:`bridge.transports.lease`) keeps
every other publisher off the servers for the sync.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

from bridge.errors import BridgeError, DeltaBaseMismatch, ServerError, SessionAlreadyOpen, SyncError, VersionError
from bridge.failpoints import armed, failpoint
from bridge.log import get_logger
from bridge.protocol import DELTA_BASE_MISMATCH
from bridge.publisher.bounded import each_within

__all__ = ["ServerSessions", "bucket_answers", "deadline_left", "discard_session", "pause_mode_for"]

logger = get_logger(__name__)


class ServerSessions:
    """Take the servers, pause, update sessions, resume and let go, on a :class:`bridge.client.ServerGroup`,
    server by server.

    Each server's state is tracked on its own, so a failure on one server (it refuses to pause, say)
    still resumes the others that were paused, and a failed sync discards the sessions that were opened.
    ``lease`` (:meth:`Transport.writer_lease`) makes this publisher the one writer of every server for the
    sync: taken before anything is paused, released once every server was resumed.
    """

    def __init__(self, servers, pause_mode: str, lease=None):
        self.servers, self.pause_mode, self.lease = servers, pause_mode, lease
        self.paused: list = []
        self.in_session: list = []
        self.held: dict[str, str] = {}
        """url -> ``torn: why`` or ``failed: why``: servers left paused on purpose after this sync (their
        weights may be partly changed, or they did not take the version beside the others)."""
        self._sent: dict[str, int] = {}  # each client's updates_sent when the sync opened
        self._untouched: set[str] = set()  # servers known to have loaded nothing of a failed sync
        self._pool = servers.pool  # the group's threads: their connections are open from the last sync

    def open(self) -> None:
        """Take every server (one writer at a time), pause it (unless ``pause_mode`` is none), then open a
        session where one is needed."""
        self._sent = {c.url: c.updates_sent for c in self.servers.clients}
        self._untouched = set()
        paused = False
        if self.lease is not None:
            paused = self.lease.take(self._pause_taking if self.pause_mode != "none" else None)
        if self.pause_mode != "none" and not paused:
            try:
                done, errors = self._each(lambda c: c.pause_generation(mode=pause_mode_for(c, self.pause_mode)),
                                          self.servers.clients)
            except BaseException:  # interrupted (Ctrl-C) mid-pause: any may be paused; resuming one that is not is harmless
                self.paused += self.servers.clients
                raise
            self.paused += done
            _raise_first(errors, "pause generation")
        done, errors = self._each(self._begin, [c for c in self.servers.clients
                                                if c.features.needs_session and c not in self.in_session])
        self.in_session += done
        _raise_first(errors, "open an update session")

    def _pause_taking(self, c, lease_s: float) -> None:
        """Pause ``c`` (one server: :meth:`WriterLease.take`), taking its writer lease and opening its session
        in the same request."""
        begin = c.features.needs_session
        try:
            c.pause_generation(mode=pause_mode_for(c, self.pause_mode), take_lease=lease_s, begin_session=begin)
        except BaseException as e:
            if not isinstance(e, Exception):  # interrupted (Ctrl-C) mid-request: it may be paused (resuming is
                self.paused.append(c)         # harmless); a session it may have opened goes with the lease
            raise
        self.paused.append(c)
        self.in_session += [c] if begin else []

    def _begin(self, c) -> None:
        try:
            c.begin_weight_update()
        except SessionAlreadyOpen:
            if c.can.writer_lease:
                # The reference server discarded, when this writer took it, any session of a writer that no
                # longer holds it; one still open belongs to a client that named no writer, or is live.
                raise
            # Real SGLang: a session another writer left open. Holding the server's writer lock, it was left
            # by a writer that is gone: discard it (never commit it) and open ours. Without a lock, nothing
            # tells a dead trainer's session from a live one's (docs/guarantees.md, "One writer at a time").
            if self.lease is None or not self.lease.guards(c):
                logger.warning("%s had an update session open, discarded without knowing whether its writer is "
                               "alive (no writer_lock): two trainers must not share a real SGLang server", c.url)
            else:
                logger.warning("%s had an update session open, left by a writer that is gone; discarding it", c.url)
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
        if len(errors) == len(clients):
            _raise_first(errors, "commit the update")
        for c, e in errors:  # the others took the version: these must not serve the old one beside them
            logger.warning("%s: commit failed: %s", c.url, e)
            self.hold(c, f"commit failed: {e}")
        self._sent = {}  # done: an abort after this (a later step failed) finds nothing half-loaded
        status = {**self.resume(release=True), **self.held}
        if self.lease is not None:  # what the resumes did not release (locks, servers not paused or held)
            self.lease.release()
        return status

    def may_be_torn(self, c) -> bool:
        """True when ``c`` loads buckets as they arrive and was sent some during this sync (open, not committed),
        unless the transport knows it loaded nothing (:meth:`loaded_nothing`)."""
        return (c.url in self._sent and not c.can.staged and c.updates_sent > self._sent[c.url]
                and c.url not in self._untouched)

    def loaded_nothing(self, c) -> None:
        """The transport knows that ``c`` loaded nothing of this failed sync (it is not torn)."""
        self._untouched.add(c.url)

    def hold(self, c, why: str) -> None:
        """Leave ``c`` paused (out of rotation) instead of resuming it; ``held`` says why. Never raises."""
        self.paused = [p for p in self.paused if p is not c]
        in_session = c in self.in_session
        self.in_session = [p for p in self.in_session if p is not c]
        if self.may_be_torn(c):
            self.held[c.url] = f"torn: {why} (it loads buckets as they arrive)"
        else:
            self.held[c.url] = f"failed: {why}"
            try:
                if in_session:
                    discard_session(c)
            except Exception as e:  # its state is unknown: as good as torn
                self.held[c.url] = f"torn: {why}; its update session could not be discarded ({e})"
        try:
            c.pause_generation("abort")
        except Exception as e:  # best effort: it is out of rotation either way
            logger.warning("%s: could not pause it (out of rotation: %s): %s", c.url, why, e)

    @staticmethod
    def _end(i: int, c, in_session: bool, version: int | None, earlier: list[cf.Future]) -> None:
        if armed(f"commit:{i}", 0):
            cf.wait(earlier)
            failpoint(f"commit:{i}", 0)
        if version is not None and not c.can.staged and c.features.weight_version:
            c.update_weight_version(str(version))
        if in_session:
            c.end_weight_update()

    def resume(self, release: bool = False) -> dict[str, str]:
        """Resume every paused server; url -> "ok" or why it could not be resumed (logged, not raised).
        ``release``: a server held by its own writer lease lets go of it in the same request."""
        status = {c.url: "ok" for c in self.servers.clients}
        lease = self.lease if release else None

        def resume_one(c) -> None:
            with_lease = lease is not None and lease.releases_on_resume(c)
            c.continue_generation(release_lease=with_lease)
            if with_lease:
                lease.forget(c)

        done, errors = self._each(resume_one, self.paused)
        for c, e in errors:
            status[c.url] = f"could not resume generation: {e}"
            logger.warning("%s: continue_generation failed: %s", c.url, e)
        self.paused = [c for c in self.paused if c not in done]
        return status

    def abort(self, first=None, seconds: float = 5.0) -> None:
        """Discard every open session and resume every paused server, but for the ones that must not serve
        (``held``: their weights may be torn, or they are out of rotation), which stay paused; never raises.

        Each server on its own thread (``first(client)``, then discard, then resume, then let go of its
        writer lease), so a server that does not answer never delays the others: they are resumed within
        milliseconds. Returns after at most ``seconds``; a server still not answered is left to its thread."""
        in_session, paused = set(self.in_session), set(self.paused)
        self.in_session, self.paused = [], []
        out = self.servers.out_of_rotation

        lease = self.lease
        taken = lease.held() if lease is not None else {}  # released once, by this abort

        def give_back(c) -> None:
            for what, call, needed in (("clean up", first, first is not None),
                                       ("discard the update session", discard_session, c in in_session)):
                if not needed:
                    continue
                try:
                    call(c)
                except Exception as e:  # best effort, per server and per call
                    logger.warning("%s: could not %s: %s", c.url, what, e)
                    if call is discard_session:
                        self.held[c.url] = f"torn: its update session could not be discarded ({e})"
            if self.may_be_torn(c):
                self.held.setdefault(c.url, "torn: the failed sync may have loaded part of its buckets (it loads "
                                            "them as they arrive)")
            elif c.url in out:
                self.held.setdefault(c.url, out[c.url])
            keep_paused = c.url in self.held  # never serve a torn or stale model: it stays paused
            try:
                if not keep_paused and c in paused:
                    c.continue_generation()
                elif keep_paused and c not in paused:
                    c.pause_generation("abort")
            except Exception as e:  # best effort, per server
                logger.warning("%s: could not %s: %s", c.url, "pause it" if keep_paused else "resume generation", e)
            if c.url in taken:  # let go of the server, once it is resumed (or held paused)
                lease.release_one(c, taken[c.url])

        each_within(give_back, self.servers.clients, seconds, thread_name="wsync-abort-server")
        if lease is not None:
            lease.stop_renewing()  # a server whose thread is still stuck: its lease runs out on its own

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
        if self.lease is not None:
            self.lease.close()

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


def pause_mode_for(c, mode: str) -> str:
    """The pause mode sent to ``c``: ``mode``, or for ``auto`` the one its SGLang version keeps requests with
    (:attr:`bridge.protocol.ProtocolFeatures.default_pause_mode`)."""
    return c.features.default_pause_mode if mode == "auto" else mode


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
        DeltaBaseMismatch: a server refused a delta bucket: it does not serve the delta's base (nothing was
            applied there; the publisher answers with an anchor).
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
        if any(isinstance(e, ServerError) and e.reason == DELTA_BASE_MISMATCH for e in errors):
            raise DeltaBaseMismatch("; ".join(map(str, errors)))
        refused = all(isinstance(e, VersionError) for e in errors)
        raise (VersionError if refused else SyncError)("; ".join(map(str, errors)))


def deadline_left(deadline: float) -> float:
    """Seconds left until ``deadline`` (time.monotonic), at least 0.1."""
    return max(0.1, deadline - time.monotonic())
