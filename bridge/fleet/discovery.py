"""Where a publisher finds its servers, read again at the start of every publish, and how a server is
taken out of rotation there.

* a fixed list (``PublisherConfig(servers=[...])``): :class:`StaticServers`;
* a registry in name resolution (``etcd://host:port``, or ``file:///dir`` on one host): every server is an
  entry ``wsync/<experiment>/<trial>/servers/<id>`` whose value is ``{"url": ...}`` (a bare URL is read
  too), kept under a lease by the server (``wsync serve --register``) or by a sidecar for real SGLang
  (``wsync register``), so a server that dies drops out within the lease's TTL: :class:`Registry`. A
  server out of rotation is marked by the publisher under ``.../out_of_rotation/<id>`` (``{"url", "why",
  "since"}``), which whatever balances load over the registry must skip;
* the workers of an ``sglang-router`` or ``smg`` (``router+http://host:port``): :class:`RouterServers`.
  Out of rotation is out of the router's worker list.

``id`` is the server's ``host:port`` (:func:`server_id`), so a restarted server takes its old entry back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from urllib.parse import quote, urlparse

from bridge.errors import ConfigError, NameEntryNotFound
from bridge.fleet.router import Router, normalize_url
from bridge.log import get_logger

__all__ = ["Registry", "RouterServers", "ServerSource", "StaticServers", "check_registry_url",
           "open_sources", "server_id", "servers_prefix"]

logger = get_logger(__name__)

_SCHEMES = ("etcd", "etcd3", "file", "memory", "router+http", "router+https")


def server_id(url: str) -> str:
    """A server's id in a registry: its ``host:port`` (quoted so that it is one key component)."""
    u = urlparse(normalize_url(url))
    return quote(f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}", safe=":")


def servers_prefix(experiment: str, trial: str, leaf: str = "servers") -> str:
    """``wsync/<experiment>/<trial>/servers`` (or another ``leaf``): where a trial's servers register."""
    from bridge.name_resolve import names

    return f"{names.trial_root(experiment, trial)}/{leaf}"


def check_registry_url(url: str) -> str:
    """``url`` when it names a registry the fleet can read; else ConfigError naming the accepted forms."""
    scheme = urlparse(url).scheme if isinstance(url, str) else ""
    if scheme not in _SCHEMES:
        raise ConfigError(f"server registry {url!r}: use etcd://host:port, file:///abs/dir (one host) or "
                          "router+http://host:port (an sglang-router or smg)")
    return url


class ServerSource:
    """One place servers are listed."""

    url = ""

    def urls(self) -> list[str]:
        """The servers listed now (normalized URLs)."""
        raise NotImplementedError

    def take_out(self, url: str, why: str) -> None:
        """Take ``url`` out of rotation here (nothing for a fixed list)."""

    def put_back(self, url: str) -> None:
        """Put ``url`` back into rotation here."""

    def close(self) -> None:
        pass


class StaticServers(ServerSource):
    def __init__(self, urls: Sequence[str]):
        self._urls = [normalize_url(u) for u in urls]
        self.url = "servers=[...]"

    def urls(self) -> list[str]:
        return list(self._urls)


class Registry(ServerSource):
    """Entries under ``wsync/<experiment>/<trial>/servers`` in name resolution (etcd or a directory)."""

    def __init__(self, url: str, experiment: str, trial: str):
        from bridge.name_resolve import make_name_resolve

        self.url = url
        self.nr = make_name_resolve(url)
        self.prefix = servers_prefix(experiment, trial)
        self.out_prefix = servers_prefix(experiment, trial, "out_of_rotation")

    def urls(self) -> list[str]:
        found = []
        for value in self.nr.get_subtree(self.prefix):
            url = entry_url(value)
            if url is None:
                logger.warning("server registry %s: an entry under %s is not a server URL: %r", self.url, self.prefix,
                               value[:200])
            else:
                found.append(url)
        return found

    def take_out(self, url: str, why: str) -> None:
        value = json.dumps({"url": url, "why": why, "since": time.time()})
        self.nr.add(f"{self.out_prefix}/{server_id(url)}", value, replace=True)

    def put_back(self, url: str) -> None:
        try:
            self.nr.delete(f"{self.out_prefix}/{server_id(url)}")
        except NameEntryNotFound:
            pass

    def close(self) -> None:
        self.nr.close()


class RouterServers(ServerSource):
    """The workers of an sglang-router or smg (``router+http://host:port``)."""

    def __init__(self, url: str, timeout: float = 5.0):
        self.url = url
        self.router = Router(url.removeprefix("router+"), timeout=timeout)

    def urls(self) -> list[str]:
        return list(self.router.workers())

    def take_out(self, url: str, why: str) -> None:
        if not self.router.remove(url):
            logger.warning("router %s still lists %s after asking to remove it", self.router.url, url)

    def put_back(self, url: str) -> None:
        if not self.router.add(url):
            logger.warning("router %s does not list %s yet after adding it (it probes /model_info first)",
                           self.router.url, url)


def entry_url(value: str) -> str | None:
    """The server URL of a registry entry's value (``{"url": ...}`` or the bare URL), or None."""
    try:
        data = json.loads(value)
    except ValueError:
        data = value
    url = data.get("url") if isinstance(data, dict) else data
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return None
    return normalize_url(url)


def open_sources(servers: Sequence[str], registries: Sequence[str], experiment: str, trial: str,
                 timeout: float = 5.0) -> list[ServerSource]:
    """The sources of a publisher's servers: the fixed list (if any), then each registry."""
    out: list[ServerSource] = [StaticServers(servers)] if servers else []
    for url in registries:
        check_registry_url(url)
        out.append(RouterServers(url, timeout) if url.startswith("router+") else Registry(url, experiment, trial))
    return out
