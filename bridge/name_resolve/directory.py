"""The directory backend (``file:///abs/dir``): one atomically written file per key, watched by polling."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote, unquote

try:
    import fcntl
except ImportError:  # not POSIX: create-if-expired is then not exclusive across processes
    fcntl = None

from bridge.errors import ConfigError, NameResolveError
from bridge.log import get_logger
from bridge.name_resolve.base import NameResolve, Watch, WatchEvent, check_key, check_prefix, is_under

__all__ = ["DirectoryNameResolve"]

# The package's name, not this file's: one logger for the whole package.
log = get_logger(__package__)

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
    reader sees the old or the new entry, never a torn one. Create-if-absent (``replace=False``) runs under
    the directory's lock file (``.wsync-lock``, ``flock``), so that replacing an expired entry is exclusive
    too: an entry with a TTL kept alive is a lock with a lease (the publishers' writer locks).

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
            with self._exclusive():  # create-if-absent-or-expired is one step for every process
                try:
                    os.link(tmp, final)  # atomic create-if-absent, also on NFS
                except FileExistsError:
                    if self._live(self._read(final)):
                        raise self._exists(key) from None
                    os.replace(tmp, final)  # the old entry had expired
        except OSError as e:
            raise NameResolveError(f"cannot write {key!r} to {self.url}: {e}") from e
        finally:
            _unlink(tmp)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the directory's lock file (``.wsync-lock``, ``flock``): without it, two processes that both
        found an expired entry would both replace it and both believe they created it (a writer lock taken
        twice). Released by the kernel when its holder dies."""
        fd = os.open(os.path.join(self.path, ".wsync-lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

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
                try:
                    self._refresh(key)
                except (OSError, NameResolveError) as e:
                    log.warning("keep-alive of %s failed: %s", key, e)

    def _refresh(self, key: str) -> None:
        # delete() and add() of the same key wait, so a refresh never resurrects; and under the lock file,
        # another process's take of the key (once it expired) and this refresh never interleave.
        with self._lock, self._exclusive():
            ttl = self._kept.get(key)
            if ttl is None:
                return
            rec = self._read(self._file(key))
            if rec is None or rec.get("owner") != self._owner:
                log.info("kept-alive key %s was deleted or replaced by another process; no longer refreshing", key)
                del self._kept[key]
                return
            self._write(key, rec["value"], ttl, replace=True, written_at=rec["written_at"])

    def get(self, name):
        rec = self._read(self._file(check_key(name)))
        if not self._live(rec):
            raise self._not_found(name)
        return rec["value"]

    def delete(self, name):
        path = self._file(check_key(name))
        with self._lock:
            self._kept.pop(name, None)
            live = self._live(self._read(path))
            if not _unlink(path):
                live = False
        if not live:
            raise self._not_found(name)

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
            if not is_under(prefix, key):
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
                _unlink(entry.path)  # a dead process's entry, long expired
        for key in set(cache) - seen:
            del cache[key]
        return live

    def _list(self, prefix):
        return sorted((k, r["value"]) for k, r in self._scan(prefix, {}).items())

    def watch(self, prefix, callback=None, *, include_existing=False):
        prefix = check_prefix(prefix)
        w = Watch(prefix, callback)
        cache: dict = {}
        mtime = _mtime_ns(self.path)
        known = {k: (r["value"], r["written_at"]) for k, r in self._scan(prefix, cache).items()}
        if include_existing:
            for k in sorted(known):
                w.emit(WatchEvent("put", k, known[k][0]))
        stop = threading.Event()
        w.on_cancel(stop.set)
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
                    w.emit(WatchEvent("delete", key, None))
                elif known.get(key) != (live[key]["value"], live[key]["written_at"]):
                    known[key] = (live[key]["value"], live[key]["written_at"])
                    w.emit(WatchEvent("put", key, known[key][0]))
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
                _unlink(path)


def _unlink(path: str) -> bool:
    """Remove ``path``; False when it was already gone (another process removed it first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None
