"""``wsync watch``: follow disk announcements and load each new snapshot into the servers.

The serving side of the disk transport. The trainer (``bridge.disk``) writes a snapshot, then announces
it under ``<root>/<experiment>/<trial>/update_weights_from_disk/<version>``; this watcher, one per
group of servers:

1. watches that prefix through the name-resolution backend (etcd watch; the directory backend's stat
   loop), starting with the announcements that already exist (so starting late catches up);
2. parses each announcement (``Announcement.from_json``) and drops versions not newer than the one
   loaded; when several are waiting, only the newest intact one is loaded;
3. makes sure the snapshot matches its manifest and the announced manifest sha256 before anything
   serves it. When every server is the reference server, the servers check it themselves in the pass
   that reads it (``wsync_manifest_sha256``), so the snapshot is read once; otherwise (real SGLang
   loads what it is given, or a callable) the watcher verifies it first (``verify_snapshot``). A
   snapshot that fails is refused and logged naming the file, and the next older waiting version is
   tried instead (so a corrupt newest snapshot never leaves the servers on weights older than an intact
   announced one);
4. asks every server concurrently to ``/update_weights_from_disk`` with ``weight_version=str(version)``
   and records, per server, the version it loaded (``status()``);
5. records the latency from the announcement's ``created_at`` to the first request (``latencies``,
   ``median_latency``).

Only the trial's current run is loaded: each disk publisher writes its id into each announcement
(``Announcement.run``) and, when it starts, the trial's run under ``<root>/<experiment>/<trial>/run``: its
lineage, the publishers of the run it continues (a restarted trainer) or itself alone when it starts a new
run (``new_run``). An announcement of a publisher outside that lineage (an earlier run of the same names,
whose versions were left announced) is never loaded, and logged once per publisher; one that names no
publisher (written by hand or by older writers) counts unless the run was started with ``new_run``.

Versions never go backwards: a duplicate or out-of-order announcement is ignored. A version that no
server accepted is not "loaded", so announcing it again retries it.

The publisher waiting for a version reads two things the watcher writes beside the announcements:

- ``<root>/<experiment>/<trial>/watchers/<id>``: this watcher's presence, a key with a TTL of
  :data:`WATCHER_TTL_S` kept alive while it runs (``run_forever``, ``catch_up``) and deleted by ``stop()``.
  A publisher that finds none fails at once, naming ``wsync watch``, instead of waiting for a load that
  nobody will make.
- ``<root>/<experiment>/<trial>/load_failed/<version>/<id>``: why this watcher's servers did not load
  ``version`` (the servers' own errors, or the verification's), with the servers and the announcement's
  manifest sha256. The publisher raises that reason at once instead of after ``wait_loaded_timeout``.

Example (a callable instead of servers, as in the tests):
    >>> from bridge.name_resolve import make_name_resolve
    >>> loaded = []
    >>> w = DiskWatcher(make_name_resolve("memory://watch-doc"), "exp", "t0", lambda path, v: loaded.append(v))
    >>> w.catch_up() is None, w.status()
    (True, {'apply': None})
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable

from bridge.client import ServerClient, ServerGroup
from bridge.errors import BridgeError, ConfigError, SnapshotError
from bridge.fleet import normalize_url
from bridge.log import fmt_bytes, get_logger
from bridge.metrics import SYNC, WATCH
from bridge.name_resolve import (
    Announcement,
    NameResolve,
    WatchEvent,
    make_name_resolve,
    names,
)
from bridge.protocol import SNAPSHOT_INVALID
from bridge.serving.subscriber import parse_announcement

__all__ = ["DiskWatcher"]

log = get_logger(__name__)

WATCHER_TTL_S = 10.0
"""A watcher's presence key vanishes this long after its process died (it is refreshed while it lives)."""
FAILURE_TTL_S = 3600.0
"""A load failure report is kept this long (the publisher reads it within its wait; this bounds leftovers)."""

ApplyFn = Callable[[str, int], object]
"""``apply(path, version)``: load the snapshot at ``path``; raise to report a failure."""


class DiskWatcher:
    """Loads every new announced snapshot of one trial into a group of servers (see the module docstring).

    Args:
        name_resolve: a ``NameResolve`` or its URL (a URL's client is closed by ``stop()``).
        experiment, trial: whose announcements to follow.
        servers: a ``bridge.client.ServerGroup`` (anything with ``.clients`` whose items have ``.url`` and
            ``update_weights_from_disk``, and ``.map(fn)``), or a callable ``apply(path, version)``.
        on_loaded: called with the ``Announcement`` after a version was loaded by at least one server.
        root: the key root (``names``' default ``wsync``).
        abort_all_requests: passed to ``/update_weights_from_disk`` (in-flight requests are aborted first).
        request_timeout: seconds per load request (None: the client's default).
        writer_lock: the trainers' ``writer_lock`` (a name-resolution URL): each :meth:`heal` gives back a server a
            dead trainer left paused (:mod:`bridge.fleet.abandoned`). None: not looked for.
    """

    def __init__(
        self,
        name_resolve: NameResolve | str,
        experiment: str,
        trial: str,
        servers,
        *,
        on_loaded: Callable[[Announcement], object] | None = None,
        root: str = "wsync",
        abort_all_requests: bool = False,
        request_timeout: float | None = None,
        writer_lock: str | None = None,
    ) -> None:
        self._owns_nr = isinstance(name_resolve, str)
        self.nr = make_name_resolve(name_resolve) if self._owns_nr else name_resolve
        self.prefix = names.update_weights_from_disk_root(experiment, trial, root)
        self.experiment, self.trial, self.root = experiment, trial, root
        self.id = uuid.uuid4().hex[:12]
        self._presence: str | None = None  # the presence key, once registered
        if callable(servers) and not hasattr(servers, "clients"):
            self._apply: ApplyFn | None = servers
            self._group = None
            targets = ["apply"]
        elif hasattr(servers, "clients") and hasattr(servers, "map"):
            self._apply, self._group = None, servers
            targets = [c.url for c in servers.clients]
            if hasattr(servers, "claim_run"):  # the run id a publisher to (experiment, trial) sends too
                servers.claim_run(f"{experiment}/{trial}")
        else:
            raise ConfigError(f"servers must be a ServerGroup or a callable apply(path, version), got {servers!r}")
        self.on_loaded = on_loaded
        self.abort_all_requests = abort_all_requests
        self.request_timeout = request_timeout
        self.writer_lock = writer_lock
        self._locks: NameResolve | None = None  # writer_lock's name resolution, opened at the first heal
        self._reported: set = set()  # servers left paused and torn by a dead trainer, reported once each
        self.latencies: list[float] = []
        """Seconds from each loaded announcement's ``created_at`` to its first load request."""
        self._status: dict[str, int | None] = dict.fromkeys(targets)
        self._latest: int | None = None
        self._loaded: Announcement | None = None  # the announcement of _latest
        self._pending: dict[int, Announcement] = {}
        self._other_runs: set[str | None] = set()  # runs whose announcements were ignored (logged once each)
        self._rejected: dict[tuple[int, str], tuple[str, list[str]]] = {}  # -> (why, servers)
        self._cond = threading.Condition()
        self._load_lock = threading.Lock()  # one load at a time, whoever calls
        self._stop = threading.Event()
        self._watch = None
        self._thread: threading.Thread | None = None

    # -- what it has done ----------------------------------------------------------------------

    def status(self) -> dict[str, int | None]:
        """Server URL (``"apply"`` for a callable) -> the version it last loaded, None before any."""
        with self._cond:
            return dict(self._status)

    @property
    def latest_version(self) -> int | None:
        """The newest version loaded by at least one server."""
        with self._cond:
            return self._latest

    @property
    def median_latency(self) -> float | None:
        """Median seconds from announcement to first load request, None before any load."""
        with self._cond:
            return statistics.median(self.latencies) if self.latencies else None

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until ``version`` (or a newer one) is loaded; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._latest is not None and self._latest >= version, timeout)

    # -- running -------------------------------------------------------------------------------

    def register(self) -> None:
        """Announce this watcher's presence for the trial (``watchers/<id>``, kept alive; see the module
        docstring). ``run_forever`` and ``catch_up`` call it; ``stop()`` removes it. Idempotent."""
        if self._presence is not None:
            return
        key = f"{names.watchers(self.experiment, self.trial, self.root)}/{self.id}"
        value = {"host": socket.gethostname(), "pid": os.getpid(), "servers": list(self._status)}
        self.nr.add(key, json.dumps(value), ttl=WATCHER_TTL_S, keepalive=True, replace=True)
        self._presence = key

    def _unregister(self) -> None:
        key, self._presence = self._presence, None
        if key is not None:
            try:
                self.nr.delete(key)
            except BridgeError as e:  # expired meanwhile, or the backend is gone: it runs out on its own
                log.debug("could not remove %s: %s", key, e)

    def _report_failure(self, ann: Announcement, why: str, servers: list[str]) -> None:
        """Tell the publisher waiting for ``ann`` why this watcher's servers did not load it."""
        key = f"{names.load_failures(self.experiment, self.trial, ann.version, self.root)}/{self.id}"
        value = {"watcher": self.id, "reason": why, "servers": servers, "manifest_sha256": ann.manifest_sha256}
        try:
            self.nr.add(key, json.dumps(value), ttl=FAILURE_TTL_S, replace=True)
        except BridgeError as e:  # the publisher then waits its wait_loaded_timeout, as without a report
            log.warning("could not report the failed load of version %d in %s: %s", ann.version, self.nr.url, e)

    def catch_up(self) -> int | None:
        """Load the newest announcement that exists now, if newer than the loaded one; returns the latest."""
        self.register()
        found = []
        for key in self.nr.find_subtree(self.prefix):
            try:
                ann = parse_announcement(self.prefix, key, self.nr.get(key))
            except BridgeError as e:  # deleted meanwhile, or malformed (already logged)
                log.debug("skipping %s: %s", key, e)
                continue
            if ann is not None:
                found.append(ann)
                WATCH.announced(ann.version, ann.created_at)
        self._load_newest(found)
        return self.latest_version

    def run_forever(self) -> None:
        """Follow announcements until ``stop()``; existing ones are caught up first. Runs once per watcher."""
        self.register()
        self._watch = self.nr.watch(self.prefix, self._on_event, include_existing=True)
        log.info("watching %s in %s for %d target(s)", self.prefix, self.nr.url, len(self._status))
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending or self._stop.is_set())
                    if self._stop.is_set():
                        return
                    waiting = list(self._pending.values())
                    self._pending.clear()
                self._load_newest(waiting)
        finally:
            self._watch.cancel()

    def start(self) -> threading.Thread:
        """Run ``run_forever`` on a daemon thread; ``stop()`` ends it."""
        self._thread = threading.Thread(target=self.run_forever, name="wsync-disk-watcher", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """End ``run_forever`` (after a load in progress), cancel the watch, close an owned client."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._unregister()
        if self._owns_nr:
            self.nr.close()
        if self._locks is not None:
            self._locks.close()
            self._locks = None

    # -- internals -----------------------------------------------------------------------------

    def _on_event(self, ev: WatchEvent) -> None:
        if ev.type != "put":
            return
        ann = parse_announcement(self.prefix, ev.key, ev.value)
        if ann is None:
            return
        WATCH.announced(ann.version, ann.created_at)
        with self._cond:
            if self._latest is not None and ann.version <= self._latest:
                log.debug("ignoring version %d: version %d is loaded", ann.version, self._latest)
                return
            self._pending[ann.version] = ann
            self._cond.notify_all()

    def _load_newest(self, anns: list[Announcement]) -> None:
        """Load the newest of ``anns`` whose snapshot is intact; the older ones are superseded by it."""
        newest_first = sorted(anns, key=lambda a: a.version, reverse=True)
        for i, ann in enumerate(newest_first):
            if self._load(ann) not in ("corrupt", "other run"):
                skipped = [a.version for a in newest_first[i + 1 :]]
                if skipped:
                    log.info("versions %s superseded by version %d before loading", sorted(skipped), ann.version)
                return

    def _load(self, ann: Announcement) -> str:
        """Verify and load one version: ``"loaded"``, ``"failed"`` (no server took it), ``"corrupt"`` (refused
        by verification, now or before), ``"stale"`` (not newer than the loaded version) or ``"other run"``
        (announced by a run that is not the trial's current one)."""
        with self._load_lock:
            v = ann.version
            with self._cond:
                if self._latest is not None and v <= self._latest:
                    return "stale"
            run = self._current_run()
            if run is not None and not (ann.run in run["lineage"] or (ann.run is None and not run["new_run"])):
                if ann.run not in self._other_runs:
                    self._other_runs.add(ann.run)
                    log.warning("ignoring version %d in %s: announced by %s, not by the trial's current run %s "
                                "(a later publisher of %s/%s started a new run); no version of that run is loaded "
                                "(logged once per publisher)",
                                v, self.nr.url, ann.run or "an unnamed publisher", run["run"], self.experiment, self.trial)
                return "other run"
            if (v, ann.manifest_sha256) in self._rejected:
                self._report_failure(ann, *self._rejected[v, ann.manifest_sha256])  # announced again: say it again
                return "corrupt"
            servers_verify = self._servers_verify()
            if not servers_verify:
                from bridge.snapshot import verify_snapshot  # (torch: only where a server does not verify)

                try:
                    verify_snapshot(ann.path, ann.manifest_sha256)
                except SnapshotError as e:
                    return self._refuse(ann, str(e), list(self._status))
            latency = time.time() - ann.created_at
            t0 = time.perf_counter()
            results = self._send(ann, servers_verify)
            seconds = time.perf_counter() - t0
            ok = [target for target, err in results if err is None]
            if not results:  # no server yet (a registry that lists none): the version the next one to join gets
                with self._cond:
                    self._latest, self._loaded = v, ann
                    self._cond.notify_all()
                log.info("version %d announced while no server is listed: a server that joins is brought to it", v)
                return "loaded"
            invalid = [(target, err) for target, err in results if getattr(err, "reason", None) == SNAPSHOT_INVALID]
            if invalid and not ok:  # the servers' own check of the snapshot, as verify_snapshot's above
                return self._refuse(ann, "; ".join(f"{target} found: {getattr(err, 'message', err)}" for target, err in invalid),
                                    [target for target, _ in results])
            # The reference server stages a load and applies all of it or nothing; SGLang loads in place.
            after = ("It keeps its weights; the next version is tried" if servers_verify else
                     "A failed disk load may leave a server's weights undefined: it is retried with the next "
                     "version; restart it if it keeps failing")
            for target, err in results:
                if err is not None:
                    log.error("%s failed to load version %d from %s: %s. %s", target, v, ann.path, err, after)
            if not ok:
                self._report_failure(ann, "; ".join(f"{target}: {getattr(err, 'message', err)}" for target, err in results),
                                     [target for target, _ in results])
                WATCH.failed("load_failed")
                return "failed"
            with self._cond:
                for target in ok:
                    self._status[target] = v
                self._latest, self._loaded = v, ann
                self.latencies.append(latency)
                self._cond.notify_all()
            WATCH.loaded_version(v, seconds)
            log.info(
                "version %d loaded on %d/%d target(s): announce->request %.3f s, load %.2f s (%s, %.2f GiB/s)",
                v, len(ok), len(results), latency, seconds, fmt_bytes(ann.total_bytes),
                ann.total_bytes / max(seconds, 1e-9) / 2**30,
            )
            if self.on_loaded is not None:
                try:
                    self.on_loaded(ann)
                except Exception:
                    log.exception("on_loaded callback failed for version %d", v)
            return "loaded"

    def _refuse(self, ann: Announcement, why: str, servers: list[str]) -> str:
        WATCH.failed("snapshot_refused")
        self._rejected[ann.version, ann.manifest_sha256] = (f"the snapshot was refused: {why}", servers)
        self._report_failure(ann, *self._rejected[ann.version, ann.manifest_sha256])
        loaded = self.latest_version
        log.error("refusing version %d: %s; trying the newest older announced version instead (%s)", ann.version, why,
                  f"this watcher last loaded version {loaded}" if loaded is not None else "this watcher has loaded none yet")
        return "corrupt"

    def _current_run(self) -> dict | None:
        """The trial's run (``names.run``: ``run``, ``lineage``, ``new_run``), None when none is recorded."""
        try:
            d = json.loads(self.nr.get(names.run(self.experiment, self.trial, self.root)))
        except (BridgeError, ValueError):  # none recorded (or unreadable): every announcement counts
            return None
        if not isinstance(d, dict) or not isinstance(d.get("run"), str):
            return None
        lineage = [r for r in d.get("lineage") or [d["run"]] if isinstance(r, str)]
        return {"run": d["run"], "lineage": lineage, "new_run": bool(d.get("new_run"))}

    def _servers_verify(self) -> bool:
        """True when every server is the reference server, which verifies a snapshot as it reads it."""
        if self._group is None or not self._group.clients:
            return False
        try:
            return all(c.can.verifies_snapshots for c in self._group.clients)
        except BridgeError as e:  # a server that cannot say: verify here, and let its load request report it
            log.debug("cannot tell whether every server verifies snapshots (%s); verifying here", e)
            return False

    def _send(self, ann: Announcement, servers_verify: bool = False) -> list[tuple[str, BaseException | None]]:
        if self._apply is not None:
            try:
                self._apply(ann.path, ann.version)
                return [("apply", None)]
            except Exception as e:
                return [("apply", e)]

        return list(self._group.map(lambda client: self._send_one(client, ann, servers_verify))) \
            if self._group.clients else []

    def _send_one(self, client, ann: Announcement, servers_verify: bool) -> tuple[str, BaseException | None]:
        # Errors come back as data, so that one server's failure does not hide the others' results.
        try:
            client.update_weights_from_disk(model_path=ann.path, weight_version=str(ann.version),
                                            abort_all_requests=self.abort_all_requests, timeout=self.request_timeout,
                                            **({"manifest_sha256": ann.manifest_sha256} if servers_verify else {}))
            return client.url, None
        except Exception as e:
            return client.url, e

    # -- a fleet that changes --------------------------------------------------------------------

    def give_back_abandoned(self) -> dict[str, str]:
        """With ``writer_lock``: every server a trainer that died mid-sync left paused is resumed, from the loaded
        snapshot where that sync may have torn it (:func:`bridge.fleet.abandoned.give_back_abandoned`); url -> what
        was done, for each one found."""
        if self.writer_lock is None or self._group is None:
            return {}
        from bridge.fleet.abandoned import give_back_abandoned

        with self._load_lock:
            if self._locks is None:
                self._locks = make_name_resolve(self.writer_lock)
            return give_back_abandoned(self._group.clients, self._locks, self.writer_lock, self._loaded,
                                       self._reported)

    def follow(self, urls: list[str]) -> None:
        """Load into exactly ``urls`` from now on (the servers a registry lists now: ``wsync watch
        --server-registry``); a server that joins is brought to the loaded version by the next :meth:`heal`."""
        if self._group is None:
            raise ConfigError("a watcher given a callable has no servers to follow")
        with self._load_lock:
            known = {c.url: c for c in self._group.clients}
            wanted = [normalize_url(u) for u in urls]
            if sorted(wanted) == sorted(known):
                return
            kw = getattr(self._group, "client_kw", {})
            clients = [known.get(u) or ServerClient(u, **kw) for u in wanted]
            group = ServerGroup(clients, allow_empty=True, **kw)
            group.claim_run(f"{self.experiment}/{self.trial}")
            old, self._group = self._group, group
            old.close(clients=False)
            for url in set(known) - set(wanted):
                known[url].close()
            with self._cond:
                self._status = {u: self._status.get(u) for u in wanted}
        added, gone = sorted(set(wanted) - set(known)), sorted(set(known) - set(wanted))
        log.info("servers now %s%s%s", wanted or "none", f"; joined {added}" if added else "",
                 f"; gone {gone}" if gone else "")

    def heal(self, probe_timeout: float = 5.0) -> list[str]:
        """Give back every server a dead trainer left paused (:meth:`give_back_abandoned`); then bring every server
        that serves another version than the loaded one (one that joined, or restarted on its base weights) to it,
        from its snapshot; a server ahead of it, or that does not answer within ``probe_timeout``, is left alone.
        Returns the URLs brought to the loaded version."""
        if self._group is None:
            return []
        self.give_back_abandoned()
        with self._load_lock:
            ann = self._loaded
            if ann is None or not self._group.clients:
                return []

            def behind(client) -> bool:
                try:
                    served = str(client.model_info(timeout=probe_timeout).get("weight_version"))
                except BridgeError:
                    return False  # down or busy: the next round asks again
                return served != str(ann.version) and not (served.isdigit() and int(served) > ann.version)

            stale = [c for c, b in zip(self._group.clients, self._group.map(behind)) if b]
            brought = []
            for client in stale:
                try:  # learned again: a server restarted at this URL may be another one now
                    verify = client.learn(probe_timeout).verifies_snapshots
                except BridgeError:
                    verify = False  # its load request reports why
                url, err = self._send_one(client, ann, servers_verify=verify)
                if err is None:
                    brought.append(url)
                    with self._cond:
                        self._status[url] = ann.version
                    log.warning("%s served another version: loaded version %d into it (%s)", url, ann.version,
                                ann.path)
                else:
                    log.error("%s serves another version and could not load version %d: %s", url, ann.version, err)
        SYNC.repaired.labels("watcher").inc(len(brought))
        return brought

