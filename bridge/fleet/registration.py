"""A server's own entry in a registry (``etcd://`` or ``file://``), kept alive while the server answers.

``wsync serve --register URL`` (the reference server registers itself) and the ``wsync register`` sidecar
(for real SGLang, which cannot) both run :meth:`Registration.follow`: every ``interval`` seconds they ask
the server's ``/health``; while it answers, the entry ``wsync/<experiment>/<trial>/servers/<host:port>``
holds ``{"url": ...}`` under a lease of ``ttl`` seconds (at most 30), which the name-resolution backend
refreshes every ``ttl / 3``; when it stops answering the entry is deleted, and when the process that
keeps it dies the lease runs out, so a crashed server drops out of the registry by itself. A clean exit
deletes the entry at once.

"Answers" means any HTTP answer of ``/health``, 503 included: SGLang answers 503 while it holds
generations (paused), and a server out of rotation is paused, yet it must stay findable to be repaired.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import requests

from bridge.errors import BridgeError, ConfigError
from bridge.fleet.discovery import check_registry_url, server_id, servers_prefix
from bridge.fleet.router import normalize_url
from bridge.log import get_logger

__all__ = ["DEFAULT_TTL_S", "MAX_TTL_S", "Registration", "answers_health"]

logger = get_logger(__name__)

DEFAULT_TTL_S = 10.0
"""The lease of a registry entry: it vanishes this long after its server (or sidecar) died."""
MAX_TTL_S = 30.0


def answers_health(url: str, timeout: float = 2.0) -> bool:
    """True when ``url``'s ``/health`` gives an HTTP answer (200, or 503 while it holds generations)."""
    try:
        r = requests.get(normalize_url(url) + "/health", timeout=timeout)
    except requests.RequestException:
        return False
    return r.status_code in (200, 503)


class Registration:
    """One server's entry in a registry; see the module docstring."""

    def __init__(self, registry: str, server_url: str, experiment: str, trial: str, ttl: float = DEFAULT_TTL_S):
        from bridge.name_resolve import make_name_resolve

        check_registry_url(registry)
        if registry.startswith("router+"):
            raise ConfigError(
                f"a server cannot register itself in a router ({registry}): the router would send it traffic before "
                "it serves the fleet's version. Register it in etcd:// or file:// and give the publisher both "
                "(PublisherConfig(server_registry=[registry, router]), wsync train --server-registry twice): it puts "
                "the server into the router once it serves the fleet's version")
        if not 0 < ttl <= MAX_TTL_S:
            raise ConfigError(f"a registration's ttl must be in (0, {MAX_TTL_S:g}] seconds, got {ttl}")
        self.registry = registry
        self.url = normalize_url(server_url)
        self.key = f"{servers_prefix(experiment, trial)}/{server_id(self.url)}"
        self.ttl = ttl
        self.nr = make_name_resolve(registry)
        self.registered = False

    def add(self) -> None:
        self.nr.add(self.key, json.dumps({"url": self.url}), ttl=self.ttl, keepalive=True, replace=True)
        self.registered = True
        logger.info("registered %s in %s as %s (ttl %g s)", self.url, self.registry, self.key, self.ttl)

    def remove(self) -> None:
        if not self.registered:
            return
        self.registered = False
        try:
            self.nr.delete(self.key)
        except BridgeError:  # it ran out, or another process took it over
            pass
        logger.info("removed %s from %s", self.url, self.registry)

    def follow(self, stop: threading.Event, interval: float = 1.0,
               alive: Callable[[], bool] | None = None) -> None:
        """Until ``stop`` is set: registered while ``alive()`` (default: the server answers ``/health``),
        removed while not; then removed, and the registry closed."""
        alive = alive or (lambda: answers_health(self.url, timeout=max(0.5, min(2.0, interval))))
        try:
            while not stop.is_set():
                up = alive()
                try:
                    if up and not self.registered:
                        self.add()
                    elif not up and self.registered:
                        logger.warning("%s does not answer /health; removing its registry entry", self.url)
                        self.remove()
                except BridgeError as e:  # the registry is down: try again at the next check
                    logger.warning("registry %s: %s", self.registry, e)
                stop.wait(interval)
        finally:
            self.close()

    def close(self) -> None:
        self.remove()
        self.nr.close()
