"""The serving side's view of disk announcements: each new version, in order, as it is announced.

:class:`VersionSubscriber` follows ``<root>/<experiment>/<trial>/update_weights_from_disk/`` with the
backend's watch (etcd's own watch; no polling) and yields :class:`~bridge.name_resolve.Announcement`
objects with strictly increasing versions: a duplicate or older announcement is skipped, so a consumer
never goes backwards. ``inference_adapter.DiskWatcher`` is the ready-made consumer that loads each
version into servers; use this class to do something else with them.

Example:
    >>> from bridge.name_resolve import Announcement, make_name_resolve, names
    >>> nr = make_name_resolve("memory://doc")
    >>> key = names.update_weights_from_disk("exp", "t0", 3)
    >>> nr.add(key, Announcement(version=3, path="/ckpt/v3", manifest_sha256="0" * 64, total_bytes=1, created_at=1.7e9).to_json())
    >>> sub = VersionSubscriber(nr, "exp", "t0")
    >>> sub.latest().version
    3
    >>> next(iter(sub)).path
    '/ckpt/v3'
    >>> sub.close()
"""

from __future__ import annotations

from collections.abc import Iterator

from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.name_resolve import Announcement, NameResolve, make_name_resolve, names

__all__ = ["VersionSubscriber", "parse_announcement"]

logger = get_logger(__name__)


def parse_announcement(prefix: str, key: str, value: str) -> Announcement | None:
    """The announcement stored at ``key`` under ``prefix``, or None (logged) when it is not a valid one."""
    version = names.version_of(key)
    if version is None or key.rsplit("/", 1)[0] != prefix:
        return None  # not an announcement key
    try:
        ann = Announcement.from_json(value)
    except ConfigError as e:
        logger.error("ignoring the announcement at %s: %s", key, e)
        return None
    if ann.version != version:
        logger.error("ignoring the announcement at %s: it names version %d", key, ann.version)
        return None
    return ann


class VersionSubscriber:
    """Yields each newly announced version of one (experiment, trial), never going backwards.

    Args:
        name_resolve: a ``NameResolve`` or its URL (``etcd://host:port``, ``file:///dir``, ``memory://``).
        experiment, trial: whose announcements to follow.
        after: yield only versions newer than this one (default: start with the newest announced).
        timeout: for iteration: stop after this many seconds without a new version (None: never).
    """

    def __init__(self, name_resolve: NameResolve | str, experiment: str, trial: str, *, after: int | None = None,
                 timeout: float | None = None, root: str = "wsync"):
        self._owns = isinstance(name_resolve, str)
        self.nr = make_name_resolve(name_resolve) if self._owns else name_resolve
        self.prefix = names.update_weights_from_disk_root(experiment, trial, root)
        self.last = after
        self.timeout = timeout
        self._watch = None

    def announced(self) -> list[Announcement]:
        """Every valid announcement present now, oldest first."""
        out = []
        for key in self.nr.find_subtree(self.prefix):
            ann = self._parse(key, None)
            if ann is not None:
                out.append(ann)
        return sorted(out, key=lambda a: a.version)

    def latest(self) -> Announcement | None:
        """The newest announcement present now, or None."""
        anns = self.announced()
        return anns[-1] if anns else None

    def __iter__(self) -> Iterator[Announcement]:
        if self.last is None:
            newest = self.latest()
            if newest is not None:
                self.last = newest.version
                yield newest
        self._watch = self.nr.watch(self.prefix, include_existing=True)
        while True:
            ev = self._watch.get(self.timeout)
            if ev is None:
                return
            if ev.type != "put":
                continue
            ann = self._parse(ev.key, ev.value)
            if ann is None or (self.last is not None and ann.version <= self.last):
                continue
            self.last = ann.version
            yield ann

    def _parse(self, key: str, value: str | None) -> Announcement | None:
        if value is None:
            try:
                value = self.nr.get(key)
            except KeyError:
                return None  # deleted meanwhile
        return parse_announcement(self.prefix, key, value)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._owns:
            self.nr.close()
