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

Modules: ``base`` (keys, ``Announcement``, ``WatchEvent``/``Watch`` and the ``NameResolve`` interface),
``memory``, ``directory`` and ``etcd`` (one backend each); this one picks the backend for a URL.

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

import os
import tempfile
from urllib.parse import parse_qs, urlparse

from bridge.errors import ConfigError
from bridge.name_resolve.base import Announcement, NameResolve, Watch, WatchEvent, names
from bridge.name_resolve.directory import DirectoryNameResolve
from bridge.name_resolve.etcd import EtcdNameResolve
from bridge.name_resolve.memory import MemoryNameResolve

__all__ = [
    "DEFAULT_EXPERIMENT",
    "DEFAULT_TRIAL",
    "DEFAULT_URL",
    "user_folder",
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

def user_folder() -> str:
    """``<temp>/wsync_<user>``: where this user's defaults live (name resolution, snapshots), so that two
    users of one machine never read each other's announcements or snapshots with the default settings."""
    try:
        import getpass

        user = getpass.getuser()
    except (ImportError, KeyError, OSError):  # no login name (a container's bare uid)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    # No '-': help texts wrap at hyphens, and the path must read whole there.
    user = "".join(c if c.isalnum() or c in "_." else "_" for c in user) or "user"
    return os.path.join(tempfile.gettempdir(), f"wsync_{user}")


DEFAULT_URL = "file://" + os.path.join(user_folder(), "name_resolve")

DEFAULT_EXPERIMENT, DEFAULT_TRIAL = "default", "trial0"
"""The run a publisher, a watcher and a server belong to when none is named (keys ``wsync/<experiment>/<trial>/``)."""


def make_name_resolve(url: str | None = None) -> NameResolve:
    """The backend for ``url`` (``DEFAULT_URL``, ``<temp>/wsync_<user>/name_resolve``, when None).

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
