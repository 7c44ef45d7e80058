"""Name resolution: a small key-value service through which trainers announce snapshots and servers.

One interface (AReaL's ``name_resolve`` shape), three backends chosen by URL with ``make_name_resolve``:

    etcd://host:port          a real etcd v3 server: leases for TTLs, etcd watches, retries and
                              reconnects across an etcd restart (``EtcdNameResolve``)
    file:///abs/dir           a directory, the zero-setup default: several processes on one machine or
                              on a shared file system (``DirectoryNameResolve``)
    memory://[name]           in-process, for tests (``MemoryNameResolve``)

Keys are ``/``-separated paths (``names`` builds the project's keys). A prefix in ``get_subtree``,
``find_subtree`` and ``watch`` is a path: ``a/b`` matches ``a/b`` and ``a/b/...`` but not ``a/bc``.

TTLs: ``add(..., ttl=T)`` makes a key vanish T seconds later; with ``keepalive=True`` the owning
process refreshes it (every T/3) so it lives as long as the process does and vanishes at most T seconds
after the process dies (``kill -9`` included). ``close()`` stops the refreshes and removes the kept-alive
keys at once; keys with a TTL but no keep-alive run out on their own.

Example:
    >>> nr = make_name_resolve("memory://doc")
    >>> key = names.update_weights_from_disk("exp", "trial", 3)
    >>> key
    'wsync/exp/trial/update_weights_from_disk/3'
    >>> nr.add(key, "hello")
    >>> nr.get(key), nr.find_subtree(names.update_weights_from_disk_root("exp", "trial"))
    ('hello', ['wsync/exp/trial/update_weights_from_disk/3'])
    >>> nr.close()
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import re
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlparse

from bridge.errors import BridgeError, ConfigError, NameEntryExists, NameEntryNotFound, NameResolveError
from bridge.log import get_logger

__all__ = [
    "DEFAULT_URL",
    "Announcement",
    "DirectoryNameResolve",
    "EtcdNameResolve",
    "MemoryNameResolve",
    "NameResolve",
    "Watch",
    "WatchEvent",
    "make_name_resolve",
    "names",
]

log = get_logger(__name__)

DEFAULT_URL = "file://" + os.path.join(tempfile.gettempdir(), "wsync", "name_resolve")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


# -- keys and the announcement value --------------------------------------------------------------


class _Names:
    """The project's keys (AReaL's layout under a ``root`` that defaults to ``wsync``)."""

    @staticmethod
    def _base(experiment: str, trial: str, root: str) -> str:
        for what, v in (("experiment", experiment), ("trial", trial)):
            if not isinstance(v, str) or not v or "/" in v:
                raise ConfigError(f"{what} must be a non-empty name without '/', got {v!r}")
        if not isinstance(root, str) or not root.strip("/"):
            raise ConfigError(f"the key root must be a non-empty path, got {root!r}")
        return _check_key(f"{root.strip('/')}/{experiment}/{trial}")

    def trial_root(self, experiment: str, trial: str, root: str = "wsync") -> str:
        """``<root>/<experiment>/<trial>``: every key of one trial lives under it."""
        return self._base(experiment, trial, root)

    def update_weights_from_disk(self, experiment: str, trial: str, version: int | str, root: str = "wsync") -> str:
        """``<root>/<experiment>/<trial>/update_weights_from_disk/<version>``: one announcement per version.

        ``version=""`` gives the prefix with a trailing ``/`` (AReaL's idiom); prefer
        ``update_weights_from_disk_root``.
        """
        if version != "" and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ConfigError(f"version must be an int >= 0, got {version!r}")
        return f"{self.update_weights_from_disk_root(experiment, trial, root)}/{version}"

    def update_weights_from_disk_root(self, experiment: str, trial: str, root: str = "wsync") -> str:
        """The prefix under which the announcements of one trial live (what a watcher watches)."""
        return f"{self._base(experiment, trial, root)}/update_weights_from_disk"

    def gen_servers(self, experiment: str, trial: str, root: str = "wsync") -> str:
        """``<root>/<experiment>/<trial>/gen_servers``: servers register under it with ``add_subentry``."""
        return f"{self._base(experiment, trial, root)}/gen_servers"

    @staticmethod
    def version_of(key: str) -> int | None:
        """The version at the end of an announcement key, or None when the last component is not one."""
        last = key.rstrip("/").rsplit("/", 1)[-1]
        return int(last) if last.isdigit() else None


names = _Names()


@dataclass(frozen=True, slots=True)
class Announcement:
    """The value of an ``update_weights_from_disk`` key: where snapshot ``version`` lies and how to check it.

    Wire form (pinned by tests): a JSON object with exactly these keys; unknown keys are ignored so that
    newer writers stay readable.
    """

    version: int
    """The weight version of the snapshot."""
    path: str
    """The snapshot directory, as the servers see it."""
    manifest_sha256: str
    """sha256 of the snapshot's ``wsync-manifest.json`` (lowercase hex)."""
    total_bytes: int
    """Bytes of the snapshot's files."""
    created_at: float
    """Unix time at which the snapshot was complete; latencies are measured from it."""

    @classmethod
    def from_snapshot(cls, info) -> Announcement:
        """The announcement of a ``bridge.snapshot.SnapshotInfo``."""
        return cls(info.version, info.path, info.manifest_sha256, info.total_bytes, info.created_at)

    def to_json(self) -> str:
        return json.dumps(
            {"version": self.version, "path": self.path, "manifest_sha256": self.manifest_sha256,
             "total_bytes": self.total_bytes, "created_at": self.created_at},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Announcement:
        """Parse and validate an announcement.

        Raises:
            ConfigError: the text is not a JSON object, or a field is missing or malformed (named).
        """
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"announcement is not valid JSON ({e}): {text[:200]!r}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"announcement must be a JSON object, got {type(d).__name__}")

        def field(name, ok, expectation):
            if name not in d:
                raise ConfigError(f"announcement field {name!r} is missing; expected {expectation}")
            if not ok(d[name]):
                raise ConfigError(f"announcement field {name!r} = {d[name]!r}; expected {expectation}")
            return d[name]

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        return cls(
            version=field("version", is_int, "an int >= 0"),
            path=field("path", lambda v: isinstance(v, str) and v != "", "a non-empty path string"),
            manifest_sha256=field("manifest_sha256", lambda v: isinstance(v, str) and bool(_SHA256.match(v)),
                                  "64 lowercase hex digits"),
            total_bytes=field("total_bytes", is_int, "an int >= 0"),
            created_at=float(field("created_at", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and math.isfinite(v) and v > 0, "a Unix time in seconds")),
        )


# -- the interface --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix."""

    type: str
    """``"put"`` (created or changed) or ``"delete"`` (deleted or expired)."""
    key: str
    value: str | None
    """The new value; None for deletes."""
    revision: int | None = None
    """etcd's mod revision (etcd backend only)."""


_STOP = object()


class Watch:
    """Handle of a running watch. ``cancel()`` stops it (idempotent; also on leaving a ``with`` block).

    With a callback, events are delivered in order on a dedicated thread (an exception in the callback
    is logged and the watch goes on). Without one, iterate the handle or call ``get(timeout)``.
    """

    def __init__(self, prefix: str, callback: Callable[[WatchEvent], None] | None = None) -> None:
        self.prefix = prefix
        self._callback = callback
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._cleanups: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        if callback is not None:
            self._thread = threading.Thread(target=self._dispatch, name=f"wsync-watch:{prefix}", daemon=True)
            self._thread.start()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def get(self, timeout: float | None = None) -> WatchEvent | None:
        """The next event, or None after ``timeout`` seconds or once the watch is cancelled."""
        assert self._callback is None, "a watch with a callback delivers events to the callback"
        try:
            ev = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev is _STOP:
            self._queue.put(_STOP)
            return None
        return ev

    def __iter__(self) -> Iterator[WatchEvent]:
        while (ev := self.get()) is not None:
            yield ev

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        for fn in self._cleanups:
            try:
                fn()
            except Exception as e:  # the watch is going away; a failed clean-up is not the caller's problem
                log.debug("watch %s clean-up failed: %s", self.prefix, e)
        self._queue.put(_STOP)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    # backend side
    def _emit(self, event: WatchEvent) -> None:
        if not self._cancelled.is_set():
            self._queue.put(event)

    def _dispatch(self) -> None:
        while (ev := self._queue.get()) is not _STOP:
            try:
                self._callback(ev)
            except Exception:
                log.exception("watch callback for %s failed on %s %s", self.prefix, ev.type, ev.key)


class NameResolve:
    """The name-resolution interface. Backends implement the methods that raise NotImplementedError.

    All methods are thread-safe. Errors of the backend (etcd unreachable past the retry deadline, an
    unwritable directory) surface as ``NameResolveError``.
    """

    url: str = ""

    def add(self, name: str, value: str, *, ttl: float | None = None, keepalive: bool = False,
            replace: bool = False) -> None:
        """Store ``value`` under ``name``.

        Args:
            ttl: seconds after which the key vanishes (None: never).
            keepalive: refresh the TTL from a background thread while this process lives (needs ``ttl``).
            replace: overwrite an existing key; otherwise an existing key raises ``NameEntryExists``.
        """
        _check_key(name)
        if not isinstance(value, str):
            raise ConfigError(f"name_resolve values are strings; got {type(value).__name__} for {name!r}")
        if ttl is not None and not ttl > 0:
            raise ConfigError(f"ttl must be positive seconds or None, got {ttl!r}")
        if keepalive and ttl is None:
            raise ConfigError(f"keepalive=True needs a ttl (add {name!r} with e.g. ttl=30)")
        self._put(name, value, ttl, keepalive, replace)

    def add_subentry(self, name: str, value: str, *, ttl: float | None = None, keepalive: bool = False) -> str:
        """Add ``value`` under a new unique key ``<name>/<random>``; returns that key."""
        sub = f"{name.rstrip('/')}/{uuid.uuid4().hex[:12]}"
        self.add(sub, value, ttl=ttl, keepalive=keepalive)
        return sub

    def get(self, name: str) -> str:
        """The value of ``name``. Raises ``NameEntryNotFound`` when it does not exist (or has expired)."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Delete ``name`` (and stop keeping it alive). Raises ``NameEntryNotFound`` when it does not exist."""
        raise NotImplementedError

    def find_subtree(self, prefix: str) -> list[str]:
        """The keys at or under ``prefix``, sorted."""
        return [k for k, _ in self._list(_check_prefix(prefix))]

    def get_subtree(self, prefix: str) -> list[str]:
        """The values of the keys at or under ``prefix``, in key order."""
        return [v for _, v in self._list(_check_prefix(prefix))]

    def wait(self, name: str, timeout: float | None = None, poll: float | None = None) -> str:
        """Block until ``name`` exists and return its value (event-driven; no polling on etcd or memory).

        Args:
            timeout: seconds; None waits forever.
            poll: ignored (kept for AReaL's signature); the directory backend's stat interval is set on
                its constructor.

        Raises:
            NameEntryNotFound: the key did not appear within ``timeout``.
        """
        _check_key(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.watch(name, include_existing=True) as w:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                ev = w.get(timeout=None if left is None else max(left, 0.0))
                if ev is None:
                    raise NameEntryNotFound(f"{name!r} did not appear in {self.url} within {timeout} s")
                if ev.type == "put" and ev.key == name:
                    return ev.value

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None] | None = None, *,
              include_existing: bool = False) -> Watch:
        """Follow changes at or under ``prefix`` from now on.

        Args:
            callback: called with each ``WatchEvent`` in order on a watch thread; None to iterate the
                returned handle instead.
            include_existing: first deliver a ``put`` for every key that exists now, consistently with
                the changes that follow (nothing is missed or seen twice in between).

        Returns:
            The ``Watch`` handle; ``cancel()`` it when done.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Stop keep-alives, remove this instance's kept-alive keys and cancel its watches. Idempotent."""
        raise NotImplementedError

    def __enter__(self) -> NameResolve:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # backend side
    def _put(self, key: str, value: str, ttl: float | None, keepalive: bool, replace: bool) -> None:
        raise NotImplementedError

    def _list(self, prefix: str) -> list[tuple[str, str]]:
        raise NotImplementedError


def make_name_resolve(url: str | None = None) -> NameResolve:
    """The backend for ``url`` (``DEFAULT_URL``, a directory under the system temp dir, when None).

    Accepted: ``etcd://host[:port]`` (port 2379; ``?timeout=S&retry_deadline=S``; user:password@ for
    auth), ``file:///absolute/dir`` (``?poll=S``), ``memory://[name]`` (instances with the same name
    share one store in this process).

    Raises:
        ConfigError: the URL has an unknown scheme or a bad form.
        NameResolveError: the etcd client library cannot be loaded.
    """
    url = url or DEFAULT_URL
    u = urlparse(url)
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}

    def num(key, default):
        try:
            return float(q.pop(key, default))
        except ValueError:
            raise ConfigError(f"name_resolve URL {url!r}: {key} must be a number of seconds") from None

    if u.scheme in ("etcd", "etcd3"):
        if not u.hostname:
            raise ConfigError(f"name_resolve URL {url!r} has no host; use etcd://host:2379")
        nr = EtcdNameResolve(u.hostname, u.port or 2379, timeout=num("timeout", 5.0),
                             retry_deadline=num("retry_deadline", 30.0), user=u.username, password=u.password)
    elif u.scheme == "file":
        if u.netloc or not os.path.isabs(u.path):
            raise ConfigError(f"name_resolve URL {url!r} must name an absolute directory: file:///abs/path")
        nr = DirectoryNameResolve(u.path, poll_interval=num("poll", 0.05))
    elif u.scheme == "memory":
        nr = MemoryNameResolve(u.netloc + u.path)
    else:
        raise ConfigError(
            f"unknown name_resolve URL {url!r}; use etcd://host:port, file:///abs/dir or memory://name"
        )
    if q:
        raise ConfigError(f"name_resolve URL {url!r}: unknown option(s) {sorted(q)}")
    return nr


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ConfigError(f"name_resolve key must be a non-empty path without leading/trailing '/', got {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith(".") or any(c in part for c in "\0\n"):
            raise ConfigError(f"name_resolve key {key!r} has a bad component {part!r}")
    return key


def _check_prefix(prefix: str) -> str:
    return _check_key(prefix.rstrip("/") if isinstance(prefix, str) else prefix)


def _under(prefix: str, key: str) -> bool:
    return key == prefix or key.startswith(prefix + "/")


# -- memory ---------------------------------------------------------------------------------------


class _MemoryStore:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, tuple[str, float | None]] = {}  # key -> (value, expires_at)
        self.watches: list[tuple[str, Watch]] = []
        self.wakeup = threading.Condition(self.lock)
        self.reaper: threading.Thread | None = None

    def emit(self, ev: WatchEvent) -> None:  # holds the lock, so events keep the order of changes
        for prefix, w in self.watches:
            if _under(prefix, ev.key):
                w._emit(ev)

    def expire(self) -> float | None:  # holds the lock; returns the next expiry time
        now = time.time()
        for key, (_, exp) in list(self.data.items()):
            if exp is not None and exp <= now:
                del self.data[key]
                self.emit(WatchEvent("delete", key, None))
        pending = [exp for _, exp in self.data.values() if exp is not None]
        return min(pending) if pending else None

    def reap_forever(self) -> None:
        with self.lock:
            while True:
                nxt = self.expire()
                self.wakeup.wait(timeout=None if nxt is None else max(nxt - time.time(), 0.01))


_MEMORY_STORES: dict[str, _MemoryStore] = {}
_MEMORY_LOCK = threading.Lock()


class MemoryNameResolve(NameResolve):
    """In-process backend (tests). Instances created with the same ``name`` share one store.

    A kept-alive key never expires while its instance is open; ``close()`` deletes it, as process death
    would.
    """

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        with _MEMORY_LOCK:
            self._store = _MEMORY_STORES.setdefault(name, _MemoryStore())
        self._kept: set[str] = set()
        self._watches: list[Watch] = []

    def _put(self, key, value, ttl, keepalive, replace):
        s = self._store
        with s.lock:
            s.expire()
            if key in s.data and not replace:
                raise NameEntryExists(f"{key!r} already exists in {self.url}; pass replace=True to overwrite")
            s.data[key] = (value, None if ttl is None or keepalive else time.time() + ttl)
            (self._kept.add if keepalive else self._kept.discard)(key)
            s.emit(WatchEvent("put", key, value))
            if ttl is not None and not keepalive:
                if s.reaper is None:
                    s.reaper = threading.Thread(target=s.reap_forever, name="wsync-memory-ttl", daemon=True)
                    s.reaper.start()
                s.wakeup.notify_all()

    def get(self, name):
        with self._store.lock:
            self._store.expire()
            try:
                return self._store.data[name][0]
            except KeyError:
                raise NameEntryNotFound(f"{name!r} not found in {self.url}") from None

    def delete(self, name):
        s = self._store
        with s.lock:
            s.expire()
            if s.data.pop(name, None) is None:
                raise NameEntryNotFound(f"{name!r} not found in {self.url}")
            self._kept.discard(name)
            s.emit(WatchEvent("delete", name, None))

    def _list(self, prefix):
        with self._store.lock:
            self._store.expire()
            return sorted((k, v) for k, (v, _) in self._store.data.items() if _under(prefix, k))

    def watch(self, prefix, callback=None, *, include_existing=False):
        prefix = _check_prefix(prefix)
        w = Watch(prefix, callback)
        s = self._store
        with s.lock:
            s.expire()
            if include_existing:
                for k, (v, _) in sorted(s.data.items()):
                    if _under(prefix, k):
                        w._emit(WatchEvent("put", k, v))
            s.watches.append((prefix, w))

        def unregister():
            with s.lock:
                s.watches = [(p, x) for p, x in s.watches if x is not w]

        w._cleanups.append(unregister)
        self._watches.append(w)
        return w

    def close(self):
        for w in self._watches:
            w.cancel()
        self._watches.clear()
        s = self._store
        with s.lock:
            for key in self._kept:
                if s.data.pop(key, None) is not None:
                    s.emit(WatchEvent("delete", key, None))
            self._kept.clear()


# -- directory ------------------------------------------------------------------------------------

# A change within this many seconds of a scan may share the directory's mtime with the scan (kernel
# timestamps are coarse, NFS coarser), so a directory this recently modified is rescanned each tick.
_COARSE_MTIME_S = 1.0
# Expired entries of dead processes are removed by readers only after this grace period, so that a
# live owner that was merely slow to refresh is not raced.
_EXPIRED_GRACE_S = 60.0


class DirectoryNameResolve(NameResolve):
    """Backend on a directory: one file per key, written atomically; a shared file system works too.

    Layout: every key is one file ``<dir>/<url-quoted key>.entry`` (flat, so that every change touches the
    directory itself) holding JSON ``{"key", "value", "expires_at", "written_at", "owner"}``. Writes go to a
    temporary file that is renamed into place (``os.replace``; ``os.link`` for create-if-absent), so a
    reader sees the old or the new entry, never a torn one.

    TTL: ``expires_at`` is stored with the value and expired entries read as absent; a keep-alive thread
    rewrites its entries every ttl/3. TTLs across machines assume synchronised clocks.

    Watch: the standard library has no inotify, so a thread stats the directory every ``poll_interval``
    seconds and rescans it only when its mtime moved (or was recent, or an entry is due to expire). This
    is the one backend that polls; etcd uses real watches. On NFS, directory attribute caching can delay
    changes by the mount's ``actimeo``; mount with a small ``actimeo`` or use etcd across machines.
    """

    def __init__(self, path: str | os.PathLike, *, poll_interval: float = 0.05) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.url = f"file://{self.path}"
        if not poll_interval > 0:
            raise ConfigError(f"poll interval must be positive seconds, got {poll_interval!r}")
        self.poll_interval = poll_interval
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise NameResolveError(f"cannot create the name_resolve directory {self.path}: {e}") from e
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._kept: dict[str, float] = {}  # key -> ttl
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._watches: list[Watch] = []

    def _file(self, key: str) -> str:
        fname = quote(key, safe="") + ".entry"
        if len(fname.encode()) > 255:
            raise ConfigError(f"name_resolve key {key!r} is too long for the directory backend (max ~240 bytes)")
        return os.path.join(self.path, fname)

    def _read(self, path: str) -> dict | None:
        try:
            with open(path, "rb") as f:
                rec = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("unreadable name_resolve entry %s (%s); treating it as absent", path, e)
            return None
        return rec

    @staticmethod
    def _live(rec: dict | None, now: float | None = None) -> bool:
        return rec is not None and (rec.get("expires_at") is None or rec["expires_at"] > (now or time.time()))

    def _write(self, key: str, value: str, ttl: float | None, replace: bool, written_at: float | None = None) -> None:
        now = time.time()
        # written_at identifies one add(); a keep-alive refresh keeps it, so watchers see no change.
        rec = {"key": key, "value": value, "expires_at": None if ttl is None else now + ttl,
               "written_at": written_at or now, "owner": self._owner}
        final = self._file(key)
        tmp = os.path.join(self.path, f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "w") as f:
                json.dump(rec, f)
            if replace:
                os.replace(tmp, final)
                return
            try:
                os.link(tmp, final)  # atomic create-if-absent, also on NFS
            except FileExistsError:
                if self._live(self._read(final)):
                    raise NameEntryExists(f"{key!r} already exists in {self.url}; pass replace=True to overwrite") from None
                os.replace(tmp, final)  # the old entry had expired
        except OSError as e:
            raise NameResolveError(f"cannot write {key!r} to {self.url}: {e}") from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _put(self, key, value, ttl, keepalive, replace):
        with self._lock:
            self._write(key, value, ttl, replace)
            if keepalive:
                self._kept[key] = ttl
                if self._keeper is None:
                    self._keeper = threading.Thread(target=self._keep_alive, name="wsync-file-keepalive", daemon=True)
                    self._keeper.start()
            else:
                self._kept.pop(key, None)

    def _keep_alive(self) -> None:
        while True:
            with self._lock:
                kept = dict(self._kept)
            interval = max(min(kept.values(), default=3.0) / 3, 0.05)
            if self._stop.wait(interval):
                return
            for key in kept:
                with self._lock:  # delete() and add() of the same key wait, so a refresh never resurrects
                    ttl = self._kept.get(key)
                    if ttl is None:
                        continue
                    rec = self._read(self._file(key))
                    if rec is None or rec.get("owner") != self._owner:
                        log.info("kept-alive key %s was deleted or replaced by another process; no longer refreshing", key)
                        del self._kept[key]
                        continue
                    try:
                        self._write(key, rec["value"], ttl, replace=True, written_at=rec["written_at"])
                    except NameResolveError as e:
                        log.warning("keep-alive of %s failed: %s", key, e)

    def get(self, name):
        rec = self._read(self._file(_check_key(name)))
        if not self._live(rec):
            raise NameEntryNotFound(f"{name!r} not found in {self.url}")
        return rec["value"]

    def delete(self, name):
        path = self._file(_check_key(name))
        with self._lock:
            self._kept.pop(name, None)
            live = self._live(self._read(path))
            try:
                os.unlink(path)
            except FileNotFoundError:
                live = False
        if not live:
            raise NameEntryNotFound(f"{name!r} not found in {self.url}")

    def _scan(self, prefix: str, cache: dict[str, tuple[tuple, dict | None]]) -> dict[str, dict]:
        """Live records at or under ``prefix``; ``cache`` (key -> (stat signature, record)) saves re-reads."""
        now = time.time()
        live: dict[str, dict] = {}
        seen = set()
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            if not entry.name.endswith(".entry"):
                continue
            key = unquote(entry.name[: -len(".entry")])
            if not _under(prefix, key):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            seen.add(key)
            if key in cache and cache[key][0] == sig:
                rec = cache[key][1]
            else:
                rec = self._read(entry.path)
                cache[key] = (sig, rec)
            if self._live(rec, now):
                live[key] = rec
            elif rec is not None and rec.get("expires_at") is not None and now - rec["expires_at"] > _EXPIRED_GRACE_S:
                try:  # a dead process's entry, long expired
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
        for key in set(cache) - seen:
            del cache[key]
        return live

    def _list(self, prefix):
        return sorted((k, r["value"]) for k, r in self._scan(prefix, {}).items())

    def watch(self, prefix, callback=None, *, include_existing=False):
        prefix = _check_prefix(prefix)
        w = Watch(prefix, callback)
        cache: dict = {}
        mtime = _mtime_ns(self.path)
        known = {k: (r["value"], r["written_at"]) for k, r in self._scan(prefix, cache).items()}
        if include_existing:
            for k in sorted(known):
                w._emit(WatchEvent("put", k, known[k][0]))
        stop = threading.Event()
        w._cleanups.append(stop.set)
        t = threading.Thread(target=self._watch_loop, args=(w, prefix, cache, known, mtime, stop),
                             name=f"wsync-file-watch:{prefix}", daemon=True)
        t.start()
        self._watches.append(w)
        return w

    def _watch_loop(self, w: Watch, prefix: str, cache: dict, known: dict[str, tuple[str, float]], mtime: int | None,
                    stop: threading.Event) -> None:
        next_expiry = math.inf
        while not stop.wait(self.poll_interval):
            now = time.time()
            current = _mtime_ns(self.path)
            if current == mtime and (current is None or now - current / 1e9 > _COARSE_MTIME_S) and now < next_expiry:
                continue
            mtime = current
            live = self._scan(prefix, cache)
            # Changes found in one scan are delivered in the order they were written.
            for key in sorted(set(live) | set(known), key=lambda k: (live[k]["written_at"] if k in live else now, k)):
                if key not in live:
                    del known[key]
                    w._emit(WatchEvent("delete", key, None))
                elif known.get(key) != (live[key]["value"], live[key]["written_at"]):
                    known[key] = (live[key]["value"], live[key]["written_at"])
                    w._emit(WatchEvent("put", key, known[key][0]))
            expiries = [r["expires_at"] for r in live.values() if r.get("expires_at") is not None]
            next_expiry = min(expiries, default=math.inf)

    def close(self):
        self._stop.set()
        for w in self._watches:
            w.cancel()
        self._watches.clear()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        with self._lock:
            kept, self._kept = list(self._kept), {}
        for key in kept:
            path = self._file(key)
            rec = self._read(path)
            if rec is not None and rec.get("owner") == self._owner:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


# -- etcd -----------------------------------------------------------------------------------------

_PROTOBUF_HINT = (
    "the etcd backend (etcd3 0.12) needs protobuf's pure-Python implementation, but protobuf was already "
    "imported in this process with the {impl!r} implementation. Start the process with "
    "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in its environment, or create the etcd name_resolve "
    "before anything imports protobuf"
)


def _import_etcd3():
    """Import etcd3, selecting protobuf's pure-Python implementation first (etcd3 0.12's generated code
    is rejected by the default upb implementation of protobuf >= 4 with "Descriptors cannot be created
    directly"). The variable is process-wide: later protobuf users in this process also get the
    pure-Python implementation, which is slower but compatible."""
    if "etcd3" in sys.modules:
        return sys.modules["etcd3"]
    impl = sys.modules.get("google.protobuf.internal.api_implementation")
    if impl is not None and impl.Type() != "python":
        raise NameResolveError(_PROTOBUF_HINT.format(impl=impl.Type()))
    os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
    try:
        with warnings.catch_warnings():  # etcd3's generated code uses descriptor calls protobuf deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            import etcd3
    except ImportError as e:
        raise NameResolveError(f"the etcd backend needs the etcd3 package ({e}); pip install etcd3") from e
    except TypeError as e:
        if "Descriptors cannot be created directly" in str(e):
            impl = os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
            raise NameResolveError(_PROTOBUF_HINT.format(impl=impl)) from e
        raise
    return etcd3


def _etcd_errors(method):
    """Translate gRPC/etcd3 exceptions into NameResolveError, retrying transient ones (etcd down or
    restarting) with exponential backoff until the instance's ``retry_deadline``."""

    @functools.wraps(method)
    def wrapper(self: EtcdNameResolve, *args, **kwargs):
        deadline = time.monotonic() + self.retry_deadline
        delay = 0.05
        while True:
            try:
                return method(self, *args, **kwargs)
            except BridgeError:
                raise
            except Exception as e:
                what = self._describe(e)
                if not self._transient(e):
                    raise NameResolveError(f"etcd {self.url}: {method.__name__} failed: {what}") from e
                if self._closed.is_set() or time.monotonic() + delay > deadline:
                    raise NameResolveError(
                        f"etcd {self.url} unreachable for {self.retry_deadline:.0f} s ({what}); is etcd running "
                        f"and is the --name-resolve URL right?"
                    ) from e
                # One warning per outage and call; the retries themselves only at debug level.
                (log.warning if delay == 0.05 else log.debug)(
                    "etcd %s: %s failed (%s); retrying for up to %.0f s", self.url, method.__name__, what,
                    self.retry_deadline)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    return wrapper


@dataclass(slots=True)
class _Kept:
    value: str
    ttl: int
    lease_id: int


class EtcdNameResolve(NameResolve):
    """Backend on an etcd v3 server (``etcd3`` client).

    - TTLs are etcd leases (one per key, whole seconds, rounded up); kept-alive leases are refreshed every
      ttl/3 from one daemon thread. After an outage longer than the TTL the lease is gone: the keep-alive
      thread grants a new one and puts the key back (unless another process took it over meanwhile).
    - Every call retries transient gRPC failures (UNAVAILABLE, DEADLINE_EXCEEDED) with exponential
      backoff (0.05 s doubling to 2 s) for up to ``retry_deadline`` seconds, so an etcd restart is
      invisible to callers; other failures raise ``NameResolveError`` at once.
    - Watches are etcd watch streams, one thread each. A broken stream is re-opened from the revision
      after the last event it delivered, so no change is lost or repeated across a reconnect.

    Args:
        host, port: the etcd client endpoint.
        timeout: seconds per gRPC call.
        retry_deadline: seconds a call keeps retrying while etcd is unreachable.
        user, password: etcd authentication (both or neither).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, *, timeout: float = 5.0,
                 retry_deadline: float = 30.0, user: str | None = None, password: str | None = None) -> None:
        self.url = f"etcd://{host}:{port}"
        self.timeout, self.retry_deadline = timeout, retry_deadline
        self._etcd3 = _import_etcd3()
        import grpc

        from etcd3.etcdrpc import kv_pb2

        self._grpc, self._kv_pb2 = grpc, kv_pb2
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._kept: dict[str, _Kept] = {}
        self._keeper: threading.Thread | None = None
        self._watches: list[Watch] = []
        # Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s).
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        self._client = self._connect(host, port, options, user, password)
        self._watch_stub = self._etcd3.etcdrpc.WatchStub(self._client.channel)

    @_etcd_errors
    def _connect(self, host, port, options, user, password):
        return self._etcd3.client(host, port, timeout=self.timeout, user=user, password=password,
                                  grpc_options=options)

    def _transient(self, e: Exception) -> bool:
        ex = self._etcd3.exceptions
        if isinstance(e, (ex.ConnectionFailedError, ex.ConnectionTimeoutError)):
            return True
        codes = self._grpc.StatusCode
        return isinstance(e, self._grpc.RpcError) and e.code() in (codes.UNAVAILABLE, codes.DEADLINE_EXCEEDED)

    def _describe(self, e: Exception) -> str:
        if isinstance(e, self._grpc.RpcError) and hasattr(e, "code"):
            return f"{e.code().name}: {e.details()}"
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    @_etcd_errors
    def _put(self, key, value, ttl, keepalive, replace):
        c = self._client
        lease = c.lease(math.ceil(ttl)) if ttl is not None else None
        if replace:
            c.put(key, value, lease=lease)
        else:
            ok, _ = c.transaction(compare=[c.transactions.create(key) == 0],
                                  success=[c.transactions.put(key, value, lease=lease)], failure=[])
            if not ok:
                if lease is not None:
                    lease.revoke()
                raise NameEntryExists(f"{key!r} already exists in {self.url}; pass replace=True to overwrite")
        with self._lock:
            old = self._kept.pop(key, None)
            if keepalive:
                self._kept[key] = _Kept(value, math.ceil(ttl), lease.id)
                if self._keeper is None:
                    self._keeper = threading.Thread(target=self._keep_alive, name="wsync-etcd-keepalive", daemon=True)
                    self._keeper.start()
        if old is not None and (lease is None or old.lease_id != lease.id):
            self._revoke(old.lease_id)  # the key now hangs on the new lease (or none); the old one is empty

    def _revoke(self, lease_id: int) -> None:
        try:
            self._client.revoke_lease(lease_id)
        except Exception as e:  # an orphaned lease holds no keys and runs out on its own
            log.debug("revoking lease %x failed: %s", lease_id, self._describe(e))

    @_etcd_errors
    def get(self, name):
        value, _ = self._client.get(_check_key(name))
        if value is None:
            raise NameEntryNotFound(f"{name!r} not found in {self.url}")
        return value.decode()

    @_etcd_errors
    def delete(self, name):
        _check_key(name)
        with self._lock:
            kept = self._kept.pop(name, None)
        deleted = self._client.delete(name)
        if kept is not None:
            self._revoke(kept.lease_id)
        if not deleted:
            raise NameEntryNotFound(f"{name!r} not found in {self.url}")

    @_etcd_errors
    def _range(self, prefix: str):
        return self._client.get_prefix_response(prefix)

    def _list(self, prefix):
        resp = self._range(prefix)
        return sorted((kv.key.decode(), kv.value.decode()) for kv in resp.kvs if _under(prefix, kv.key.decode()))

    def watch(self, prefix, callback=None, *, include_existing=False):
        prefix = _check_prefix(prefix)
        resp = self._range(prefix)  # fixes the revision the stream starts after
        w = Watch(prefix, callback)
        if include_existing:
            for kv in sorted(resp.kvs, key=lambda kv: kv.key):
                key = kv.key.decode()
                if _under(prefix, key):
                    w._emit(WatchEvent("put", key, kv.value.decode(), kv.mod_revision))
        stream = _EtcdWatchStream(self, w, prefix, resp.header.revision + 1)
        w._cleanups.append(stream.stop)
        stream.thread.start()
        with self._lock:
            self._watches.append(w)
        return w

    def _keep_alive(self) -> None:
        outage = False  # warn once per outage, not once per refresh
        while True:
            with self._lock:
                kept = dict(self._kept)
            interval = max(min((k.ttl for k in kept.values()), default=3) / 3, 0.2)
            if self._closed.wait(interval / 2 if outage else interval):
                return
            for key, k in kept.items():
                try:
                    responses = list(self._client.refresh_lease(k.lease_id))
                    if not responses or responses[0].TTL <= 0:
                        self._regrant(key, k)
                    outage = False
                except Exception as e:
                    if isinstance(e, self._grpc.RpcError) and e.code() == self._grpc.StatusCode.NOT_FOUND:
                        self._regrant(key, k)
                        continue
                    if not outage:
                        log.warning("etcd %s: keep-alive of %s failed (%s); retrying", self.url, key, self._describe(e))
                    outage = True

    def _regrant(self, key: str, k: _Kept) -> None:
        """The lease ran out (etcd was unreachable for longer than the TTL): put the key back on a new one."""
        try:
            c = self._client
            lease = c.lease(k.ttl)
            ok, _ = c.transaction(
                compare=[c.transactions.create(key) == 0], success=[c.transactions.put(key, k.value, lease=lease)],
                failure=[],
            )
            if not ok:
                value, _ = c.get(key)
                if value is not None and value.decode() != k.value:
                    log.warning("etcd %s: %s was taken over by another writer; no longer keeping it alive", self.url, key)
                    lease.revoke()
                    with self._lock:
                        self._kept.pop(key, None)
                    return
                c.put(key, k.value, lease=lease)
            log.warning("etcd %s: lease of %s had expired; re-created it and put the key back", self.url, key)
            with self._lock:
                if key in self._kept:
                    self._kept[key].lease_id = lease.id
        except Exception as e:
            log.warning("etcd %s: re-creating the lease of %s failed (%s); retrying", self.url, key, self._describe(e))

    def close(self):
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            watches, self._watches = self._watches, []
            kept, self._kept = list(self._kept.values()), {}
        for w in watches:
            w.cancel()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        for k in kept:
            self._revoke(k.lease_id)
        self._client.close()


class _EtcdWatchStream:
    """One etcd watch stream on its own thread, re-opened after failures from the next unseen revision."""

    def __init__(self, nr: EtcdNameResolve, w: Watch, prefix: str, start_revision: int) -> None:
        self.nr, self.w, self.prefix = nr, w, prefix
        self.next_revision = start_revision
        self._stop = threading.Event()
        self._call = None
        self._call_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"wsync-etcd-watch:{prefix}", daemon=True)

    def stop(self) -> None:
        self._stop.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def _requests(self, rpc, key: bytes, range_end: bytes, done: threading.Event):
        yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=key, range_end=range_end, start_revision=self.next_revision))
        # Keep the request side open while this stream lives; gRPC consumes this generator on a thread of
        # its own, which ``done`` releases when the stream ends.
        done.wait()

    def _run(self) -> None:
        nr, grpc = self.nr, self.nr._grpc
        rpc = nr._etcd3.etcdrpc
        key = self.prefix.encode()
        range_end = nr._etcd3.utils.increment_last_byte(key)
        delete = nr._kv_pb2.Event.DELETE
        delay, outage_logged = 0.05, False
        while not self._stop.is_set():
            done = threading.Event()
            try:
                with self._call_lock:
                    if self._stop.is_set():
                        return
                    self._call = nr._watch_stub.Watch(self._requests(rpc, key, range_end, done),
                                                      metadata=nr._client.metadata)
                for rs in self._call:
                    if outage_logged:
                        log.info("etcd %s: watch on %s re-established at revision %d", nr.url, self.prefix,
                                 self.next_revision)
                    delay, outage_logged = 0.05, False
                    if rs.compact_revision:
                        log.error("etcd %s: watch on %s lost changes before revision %d (compacted); resuming there",
                                  nr.url, self.prefix, rs.compact_revision)
                        self.next_revision = rs.compact_revision
                        break
                    for ev in rs.events:
                        k = ev.kv.key.decode()
                        self.next_revision = max(self.next_revision, ev.kv.mod_revision + 1)
                        if _under(self.prefix, k):
                            if ev.type == delete:
                                self.w._emit(WatchEvent("delete", k, None, ev.kv.mod_revision))
                            else:
                                self.w._emit(WatchEvent("put", k, ev.kv.value.decode(), ev.kv.mod_revision))
                    if rs.canceled:
                        break
            except Exception as e:  # grpc.RpcError mostly; anything else must not end the watch silently
                if self._stop.is_set():
                    return
                if not outage_logged:
                    log.warning("etcd %s: watch on %s broke (%s); reconnecting", nr.url, self.prefix, nr._describe(e),
                                exc_info=not isinstance(e, grpc.RpcError))
                    outage_logged = True
            finally:
                done.set()
                with self._call_lock:
                    if self._call is not None:
                        self._call.cancel()
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, 2.0)
