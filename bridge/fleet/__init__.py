"""The fleet: where a publisher's servers come from, which of them answer, and which are in rotation.

* :mod:`bridge.fleet.discovery`: a fixed list, a registry in name resolution (etcd or a directory; servers
  keep their own entry alive with :class:`Registration`), or the workers of an ``sglang-router``/``smg``;
* :mod:`bridge.fleet.router`: the routers' worker list (``GET/POST/DELETE /workers``);
* :mod:`bridge.fleet.fleet`: :class:`Fleet`, which the publisher's rank 0 asks at the start of every
  publish for the servers of this sync, and tells how the sync ended;
* :mod:`bridge.fleet.status`: :func:`fleet_status`, the fleet as an operator sees it (``wsync status``).
"""

from __future__ import annotations

from bridge.fleet.discovery import check_registry_url, server_id, servers_prefix
from bridge.fleet.fleet import Fleet, list_servers, registries_of
from bridge.fleet.registration import Registration, answers_health
from bridge.fleet.router import Router, normalize_url
from bridge.fleet.status import FleetStatus, ServerStatus, fleet_status

__all__ = ["Fleet", "FleetStatus", "Registration", "Router", "ServerStatus", "answers_health", "check_registry_url",
           "fleet_status", "list_servers", "normalize_url", "registries_of", "server_id", "servers_prefix"]
