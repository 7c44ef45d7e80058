"""The fleet's state, as an operator asks for it (``wsync status``): each server's version, whether it answers or is
paused, whether it is in rotation, and how far behind the fleet's newest version it is.

Everything is read from outside, as a readiness probe would: the servers' own answers (``/model_info``'s
``weight_version``; ``/health``, where SGLang generates a token, so a paused one does not answer it), the registries' entries (a server
a publisher took out of rotation keeps ``out_of_rotation/<host:port>`` there, with why and since when: ``torn: ...``
for one left paused on a half-loaded sync), the routers' worker lists, and the newest version announced on disk in
name resolution.

    >>> from bridge.fleet.status import fleet_status
    >>> fleet_status(servers=["http://127.0.0.1:1"], timeout=0.5).healthy
    False
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from bridge.client import ServerClient
from bridge.errors import BridgeError
from bridge.fleet.discovery import Registry, RouterServers, open_sources
from bridge.fleet.fleet import is_behind, newest_version
from bridge.fleet.router import normalize_url
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL

__all__ = ["FleetStatus", "ServerStatus", "fleet_status"]


@dataclass
class ServerStatus:
    """One server as seen from outside. ``state``: ``ok`` (answers, in rotation, on the newest version), ``behind``,
    ``paused`` (it answers ``/model_info`` but generates nothing), ``out`` (out of rotation, ``why`` says why),
    or ``down`` (no answer)."""

    url: str
    state: str
    version: str | None = None
    behind: int | None = None  # versions behind the newest; None when either is not a number
    in_rotation: bool | None = None  # None: no router or registry says
    why: str | None = None
    since: float | None = None  # when it was taken out of rotation (seconds since the epoch)


@dataclass
class FleetStatus:
    newest: str | None  # the newest version: announced on disk, or served by any server
    servers: list[ServerStatus] = field(default_factory=list)
    announced: str | None = None

    @property
    def healthy(self) -> bool:
        """Every server answers, in rotation, on the newest version (and there is at least one)."""
        return bool(self.servers) and all(s.state == "ok" for s in self.servers)

    def to_json(self) -> str:
        return json.dumps({"healthy": self.healthy, "newest": self.newest, "announced": self.announced,
                           "servers": [asdict(s) for s in self.servers]}, indent=2)

    def table(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        rows = [("SERVER", "STATE", "VERSION", "BEHIND", "ROTATION", "WHY")]
        for s in self.servers:
            rotation = {True: "in", False: "out", None: "-"}[s.in_rotation]
            why = s.why or ""
            if s.since is not None:
                why = f"{why} ({now - s.since:.0f} s ago)"
            rows.append((s.url, s.state, s.version or "-", "-" if s.behind is None else str(s.behind), rotation, why))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5]).rstrip() for r in rows]
        verdict = ("healthy: every server on the newest version, in rotation" if self.healthy else
                   f"not healthy: {sum(s.state != 'ok' for s in self.servers)} of {len(self.servers)} servers not ok"
                   if self.servers else "no servers found")
        head = f"newest version: {self.newest or '-'}" + (f" (announced on disk: {self.announced})"
                                                          if self.announced else "")
        return "\n".join([head, *lines, verdict])


def fleet_status(servers: Sequence[str] = (), registries: Sequence[str] = (), *, experiment: str = DEFAULT_EXPERIMENT,
                 trial: str = DEFAULT_TRIAL, name_resolve: str | None = None, timeout: float = 5.0,
                 writer_lock: str | None = None) -> FleetStatus:
    """The state of every server listed in ``servers`` or found in ``registries`` (etcd://, file://, router+http://;
    as a publisher finds them), each asked within ``timeout`` seconds, at once. ``name_resolve``: where disk versions
    are announced (their newest is then the fleet's newest). ``writer_lock``: the trainers' writer lock, where a
    paused server a dead trainer left is told (:mod:`bridge.fleet.abandoned`)."""
    sources = open_sources(list(servers), list(registries), experiment, trial, timeout=timeout)
    try:
        listed = {src: src.urls() for src in sources}  # (each asked once: a router's list is an HTTP call)
        urls = list(dict.fromkeys(u for found in listed.values() for u in found))
        out = {}  # url -> (why, since), from the registries' out_of_rotation entries
        routed: set[str] | None = None
        registered = False
        for src, found in listed.items():
            if isinstance(src, Registry):
                registered = True
                out.update(_out_of_rotation(src))
            elif isinstance(src, RouterServers):
                routed = (routed or set()) | set(found)
        urls += [u for u in out if u not in urls]  # taken out of a router: the registry still remembers them
    finally:
        for src in sources:
            src.close()
    announced = _announced(name_resolve, experiment, trial) if name_resolve else None
    with cf.ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        answers = dict(zip(urls, pool.map(lambda u: _ask(u, timeout), urls)))
    dead = _dead_writers(writer_lock, [u for u, (v, healthy) in answers.items() if v is not None and not healthy])
    served = [v for v, _ in answers.values() if v is not None]
    newest = newest_version([*served, None if announced is None else str(announced)])
    rows = []
    for url in urls:
        version, healthy = answers[url]
        why, since = out.get(url, (None, None))
        in_rotation = None
        if routed is not None or registered:
            in_rotation = why is None and (routed is None or url in routed)
        behind = int(newest) - int(version) if newest and version and version.isdigit() else None
        if version is None:
            state = "down"
        elif in_rotation is False:
            state, why = "out", why or "not listed by the router"
        elif not healthy:
            state, why = "paused", dead.get(url, why)
        elif newest is not None and is_behind(version, newest):
            state = "behind"
        else:
            state = "ok"
        rows.append(ServerStatus(url, state, version, behind, in_rotation, why, since))
    return FleetStatus(newest, rows, str(announced) if announced is not None else None)


def _dead_writers(writer_lock: str | None, urls: list[str]) -> dict[str, str]:
    """url -> why, for each of ``urls`` a writer that died holding it left paused (its mark in ``writer_lock``)."""
    if not writer_lock or not urls:
        return {}
    from bridge.fleet.abandoned import abandoned_mark
    from bridge.name_resolve import make_name_resolve

    nr = make_name_resolve(writer_lock)
    try:
        marks = {u: abandoned_mark(nr, u) for u in urls}
    finally:
        nr.close()
    return {u: (f"left by a dead writer of run {m.get('run_id')!r}"
                + (", maybe torn" if m.get("may_tear", True) else "")
                + ": `wsync watch --writer-lock` gives it back")
            for u, m in marks.items() if m is not None}


def _ask(url: str, timeout: float) -> tuple[str | None, bool]:
    """(the version it serves, whether it generates); (None, False) when it does not answer. SGLang's ``/health``
    generates a token, so a paused one does not answer 200 within ``timeout``; the reference server says it is
    paused in ``/server_info``."""
    c = ServerClient(url, timeout=timeout)
    try:
        version = c.probe(timeout)
        states = c.server_info(timeout=timeout).get("internal_states") or []
        paused = any(isinstance(s, dict) and s.get("paused") for s in states)
        return version, not paused and c.health(timeout)
    except BridgeError:
        return None, False
    finally:
        c.close()


def _out_of_rotation(registry: Registry) -> dict[str, tuple[str | None, float | None]]:
    found = {}
    for value in registry.nr.get_subtree(registry.out_prefix):
        try:
            entry = json.loads(value)
            found[normalize_url(entry["url"])] = (entry.get("why"), entry.get("since"))
        except (ValueError, KeyError, TypeError):
            continue  # not one of the publisher's entries
    return found


def _announced(name_resolve: str, experiment: str, trial: str) -> int | None:
    from bridge.serving.subscriber import VersionSubscriber

    sub = VersionSubscriber(name_resolve, experiment, trial)
    try:
        latest = sub.latest()
        return latest.version if latest is not None else None
    finally:
        sub.close()
