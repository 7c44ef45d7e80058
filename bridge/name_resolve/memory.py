"""The in-process backend (``memory://name``): for tests, and for several components of one process."""

from __future__ import annotations

import threading
import time

from bridge.name_resolve.base import NameResolve, Watch, WatchEvent, check_prefix, is_under

__all__ = ["MemoryNameResolve"]


class _MemoryStore:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, tuple[str, float | None]] = {}  # key -> (value, expires_at)
        self.watches: list[tuple[str, Watch]] = []
        self.wakeup = threading.Condition(self.lock)
        self.reaper: threading.Thread | None = None

    def emit(self, ev: WatchEvent) -> None:  # holds the lock, so events keep the order of changes
        for prefix, w in self.watches:
            if is_under(prefix, ev.key):
                w.emit(ev)

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
                raise self._exists(key)
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
                raise self._not_found(name) from None

    def delete(self, name):
        s = self._store
        with s.lock:
            s.expire()
            if s.data.pop(name, None) is None:
                raise self._not_found(name)
            self._kept.discard(name)
            s.emit(WatchEvent("delete", name, None))

    def _list(self, prefix):
        with self._store.lock:
            self._store.expire()
            return sorted((k, v) for k, (v, _) in self._store.data.items() if is_under(prefix, k))

    def watch(self, prefix, callback=None, *, include_existing=False):
        prefix = check_prefix(prefix)
        w = Watch(prefix, callback)
        s = self._store
        with s.lock:
            s.expire()
            if include_existing:
                for k, (v, _) in sorted(s.data.items()):
                    if is_under(prefix, k):
                        w.emit(WatchEvent("put", k, v))
            s.watches.append((prefix, w))

        def unregister():
            with s.lock:
                s.watches = [(p, x) for p, x in s.watches if x is not w]

        w.on_cancel(unregister)
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
