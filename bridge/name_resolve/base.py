"""The name-resolution contract: keys, the announcement value, watches and the ``NameResolve`` interface.

Everything here is backend-neutral; ``memory``, ``directory`` and ``etcd`` implement ``NameResolve``
and ``bridge.name_resolve.make_name_resolve`` picks one by URL.
"""

from __future__ import annotations

import json
import math
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bridge.errors import ConfigError, NameEntryExists, NameEntryNotFound
from bridge.log import get_logger

__all__ = ["Announcement", "NameResolve", "Watch", "WatchEvent", "check_key", "check_prefix", "is_under", "names"]

# The package's name, not this file's: one logger for the whole package.
log = get_logger(__package__)

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
        return check_key(f"{root.strip('/')}/{experiment}/{trial}")

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

    def watchers(self, experiment: str, trial: str, root: str = "wsync") -> str:
        """``<root>/<experiment>/<trial>/watchers``: each running watcher keeps a key with a TTL under it, so a
        publisher knows whether anyone loads the trial's announcements."""
        return f"{self._base(experiment, trial, root)}/watchers"

    def load_failures(self, experiment: str, trial: str, version: int, root: str = "wsync") -> str:
        """``<root>/<experiment>/<trial>/load_failed/<version>``: a watcher whose servers could not load
        ``version`` says why under it (one key per watcher), where the publisher waiting for it reads it."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be an int >= 0, got {version!r}")
        return f"{self._base(experiment, trial, root)}/load_failed/{version}"

    def run(self, experiment: str, trial: str, root: str = "wsync") -> str:
        """``<root>/<experiment>/<trial>/run``: the trial's run, written by each disk publisher when it starts:
        a JSON object with ``run`` (that publisher's id), ``lineage`` (its id and those of the publishers it
        continues, newest first) and ``new_run`` (whether the oldest of them started a new run). A watcher
        loads only announcements of the lineage (``Announcement.run``)."""
        return f"{self._base(experiment, trial, root)}/run"

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
    run: str | None = None
    """The run id of the publisher that announced it (``names.run`` holds the trial's current one); None from
    writers that do not say. Written only when set."""

    @classmethod
    def from_snapshot(cls, info) -> Announcement:
        """The announcement of a ``bridge.snapshot.SnapshotInfo``."""
        return cls(info.version, info.path, info.manifest_sha256, info.total_bytes, info.created_at)

    def to_json(self) -> str:
        return json.dumps(
            {"version": self.version, "path": self.path, "manifest_sha256": self.manifest_sha256,
             "total_bytes": self.total_bytes, "created_at": self.created_at,
             **({"run": self.run} if self.run is not None else {})},
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
            run=d["run"] if isinstance(d.get("run"), str) and d["run"] else None,
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

    # backend side: a backend feeds the watch its events and says how to stop its source
    def emit(self, event: WatchEvent) -> None:
        """Deliver ``event`` (dropped once the watch is cancelled)."""
        if not self._cancelled.is_set():
            self._queue.put(event)

    def on_cancel(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the watch is cancelled (a failure there is logged, not raised)."""
        self._cleanups.append(fn)

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
        check_key(name)
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
        return [k for k, _ in self._list(check_prefix(prefix))]

    def get_subtree(self, prefix: str) -> list[str]:
        """The values of the keys at or under ``prefix``, in key order."""
        return [v for _, v in self._list(check_prefix(prefix))]

    def wait(self, name: str, timeout: float | None = None, poll: float | None = None) -> str:
        """Block until ``name`` exists and return its value (event-driven; no polling on etcd or memory).

        Args:
            timeout: seconds; None waits forever.
            poll: ignored (kept for AReaL's signature); the directory backend's stat interval is set on
                its constructor.

        Raises:
            NameEntryNotFound: the key did not appear within ``timeout``.
        """
        check_key(name)
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

    # One wording for every backend, so that callers and logs see the same errors whatever the URL.
    def _not_found(self, name: str) -> NameEntryNotFound:
        return NameEntryNotFound(f"{name!r} not found in {self.url}")

    def _exists(self, name: str) -> NameEntryExists:
        return NameEntryExists(f"{name!r} already exists in {self.url}; pass replace=True to overwrite")


# -- key checks, for the interface and every backend ----------------------------------------------


def check_key(key: str) -> str:
    """``key`` itself when it is a valid key: ``/``-separated, no empty, dot-leading or ``..`` component
    (the directory backend turns keys into file names); else ConfigError naming the bad part."""
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ConfigError(f"name_resolve key must be a non-empty path without leading/trailing '/', got {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith(".") or any(c in part for c in "\0\n"):
            raise ConfigError(f"name_resolve key {key!r} has a bad component {part!r}")
    return key


def check_prefix(prefix: str) -> str:
    """A prefix as a key: a trailing ``/`` (AReaL's idiom) is dropped, the rest checked as a key."""
    return check_key(prefix.rstrip("/") if isinstance(prefix, str) else prefix)


def is_under(prefix: str, key: str) -> bool:
    """True when ``key`` is ``prefix`` or below it, as a path: ``a/b`` holds ``a/b/c``, not ``a/bc``."""
    return key == prefix or key.startswith(prefix + "/")
