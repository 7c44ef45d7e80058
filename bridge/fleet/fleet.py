""":class:`Fleet`: the servers of one publisher, found and probed at the start of every publish, and kept in
rotation only while they serve the fleet's version.

Rank 0 of a :class:`bridge.WeightPublisher` drives it:

1. ``prepare`` (before anything moves): list the servers of every source (:mod:`bridge.fleet.discovery`),
   probe each with a short timeout (``probe_timeout``), and exclude the ones that do not answer: each
   exclusion is logged once at WARNING, and a dead server is taken out of the router. A server that
   answers but whose weights may be torn (a failed sync on a server that does not stage, a failed
   commit) or that serves another version than the fleet (restarted, newly joined) is taken out of
   rotation and paused before the sync, and the sync brings it to the new version (every sync sends every
   tensor: the delta encoding sends an anchor while a server is out of rotation); when the transport has a complete snapshot of the fleet's version it is loaded at once
   instead. Fewer servers answering than ``min_servers`` fails the publish here, before anything moves.
2. ``committed`` (after the transport's commit): every server that took the version is put (back) into
   rotation; one whose commit failed stays paused and out of rotation, so no two servers in rotation
   serve different versions once the publish returns. Below ``min_servers`` the publish fails.
3. ``failed`` (after a failed sync): the servers the transport left paused (torn, or not known to be
   clean) are taken out of rotation until a publish repairs them.

An :class:`bridge.AdapterPublisher` drives the same fleet with ``follows_version=False`` (:mod:`bridge.lora.servers`):
found, probed, dead servers excluded and out of rotation, ``min_servers``, back in rotation once they took an
adapter version; the weights' version is not its concern, so no server is paused for it.

"In rotation" means: listed by the router (``router+http://``), not marked under ``out_of_rotation/`` in a
registry, and not paused. A server taken out is remembered, so it is probed again at every publish even
once no source lists it (a router from which it was removed) until it is back.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

from bridge.client import ServerClient, ServerGroup
from bridge.errors import BridgeError, SyncError, SyncTimeout
from bridge.fleet.discovery import RouterServers, ServerSource, StaticServers, open_sources
from bridge.log import get_logger
from bridge.metrics import SYNC

__all__ = ["Down", "Fleet", "is_behind", "list_servers", "newest_version", "probe_servers", "registries_of"]

logger = get_logger(__name__)


def registries_of(config) -> list[str]:
    """The registry URLs of a :class:`bridge.PublisherConfig` (``server_registry``: one URL or several)."""
    reg = config.server_registry
    if not reg:
        return []
    return [reg] if isinstance(reg, str) else list(reg)


class Fleet:
    """The servers one publisher syncs (rank 0 only); see the module docstring."""

    def __init__(self, config, run_id: str, follows_version: bool = True, new_run: bool = False):
        self.config = config
        self.run_id = run_id
        self.follows_version = follows_version
        """Whether a server behind the fleet's weight version is taken out of rotation and paused until the sync
        brings it there (the weights' publisher); an adapter publisher's fleet does not (it loads no weights)."""
        self.probe_timeout = min(config.probe_timeout, config.http_timeout)
        self.sources: list[ServerSource] = open_sources(config.servers, registries_of(config), config.experiment,
                                                        config.trial, timeout=self.probe_timeout)
        self.clients: dict[str, ServerClient] = {}
        self.out: dict[str, str] = {}
        """url -> why, for every server this fleet took out of rotation (until it takes a version)."""
        self.torn: dict[str, str] = {}
        """url -> why, for every server whose weights may be partly changed."""
        self.excluded: dict[str, str] = {}
        """url -> why, for every server that did not answer the last probe."""
        self.version: str | None = None
        """The version every server in rotation serves (None before the first publish found one)."""
        self.group: ServerGroup | None = None
        self.served: dict[str, str] = {}
        """url -> the version it served when the last ``prepare`` probed it (the servers that answered)."""
        self.status: dict[str, str] = {}
        self._listed: dict[int, list[str]] = {}  # source index -> what it listed at the last publish
        self._new_run = new_run  # the first publish may start the run over (PublisherConfig.new_run)
        self._pool = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="wsync-fleet")

    # ------------------------------------------------------------------ before the sync

    def prepare(self, snapshot: Callable[[], object] | None = None) -> ServerGroup:
        """The servers of this sync: every one that answers the probe (see the module docstring).

        Raises:
            SyncError: fewer than ``min_servers`` answer (nothing has moved).
        """
        urls = self._discover()
        found = self._probe(urls)
        live = [u for u in urls if not isinstance(found[u], Down)]
        self.served = {u: found[u] for u in live}
        self.status = {}
        for u in urls:
            if u not in live:
                self._exclude(u, found[u])
            elif self.excluded.pop(u, None) is not None:
                logger.warning("server %s answers again (serves version %s)", u, found[u])
        fleet = None  # the version every server in rotation must serve (none for a fleet that does not follow it)
        if self.follows_version:
            fleet = self.version if self.version is not None else newest_version(found[u] for u in live)
        for u in live:
            why = self.torn.get(u)
            if why is None and fleet is not None:
                why = self._behind(u, found[u], fleet)
            if why is None and u in self.out:
                why = self.out[u]
            if why is not None:
                self._take_out(u, why, pause=self.follows_version)
        if snapshot is not None and fleet is not None:
            self._repair_from_snapshot([u for u in live if u in self.out], snapshot, fleet)
        if len(live) < self.config.min_servers:
            raise SyncError(self._too_few(urls, len(live)))
        self.group = self._group(live)
        self.group.out_of_rotation = {u: self.out[u] for u in live if u in self.out}
        return self.group

    def _discover(self) -> list[str]:
        """Every server some source lists now, then every one this fleet took out, in first-seen order."""
        urls: list[str] = []
        for i, src in enumerate(self.sources):
            try:
                self._listed[i] = src.urls()
            except BridgeError as e:  # a registry or router that is down: go on with what it listed last
                logger.warning("cannot list the servers of %s (%s); using its last list", src.url, e)
            urls += self._listed.get(i, [])
        urls += list(self.out) + list(self.excluded)
        return list(dict.fromkeys(urls))

    def _probe(self, urls: list[str]) -> dict[str, str | Down]:
        return probe_servers(urls, self._client, self.probe_timeout, self._pool)

    def _exclude(self, url: str, down) -> None:
        why = str(down)
        self.status[url] = f"excluded: {why}"
        c = self.clients.pop(url, None)  # a server that comes back is asked its info again (it may differ)
        if c is not None:
            c.close()
        if url not in self.excluded:
            logger.warning("server %s is excluded from this publish and out of rotation: %s", url, why)
            self.excluded[url] = why
            if url not in self.out:
                self._take_out(url, f"excluded: {why}", pause=False)

    def _repair_from_snapshot(self, urls: list[str], snapshot, fleet: str) -> None:
        """Load the newest complete snapshot into servers out of rotation, when it is the fleet's version."""
        try:
            ann = snapshot()
        except BridgeError as e:
            logger.warning("cannot read the newest snapshot to repair %s: %s", urls, e)
            return
        if ann is None or str(ann.version) != fleet:
            return
        for u in urls:
            c = self.clients[u]
            try:
                c.update_weights_from_disk(ann.path, weight_version=str(ann.version),
                                           manifest_sha256=ann.manifest_sha256, timeout=self.config.http_timeout)
                if c.probe(self.probe_timeout) != fleet:
                    continue
                c.continue_generation()
            except BridgeError as e:
                logger.warning("could not repair %s from the snapshot of version %s: %s", u, fleet, e)
                continue
            logger.warning("server %s repaired from the snapshot of version %s (%s)", u, fleet, ann.path)
            SYNC.repaired.labels("publisher").inc()
            self.torn.pop(u, None)
            self._put_back(u)

    # ------------------------------------------------------------------ between publishes

    @property
    def has_rotation(self) -> bool:
        """Some source can take a server out of rotation (a router or a registry; a fixed list cannot)."""
        return any(not isinstance(s, StaticServers) for s in self.sources)

    def guard(self, snapshot: Callable[[], object] | None = None) -> list[str]:
        """Between publishes (:class:`bridge.fleet.guard.FleetGuard`): every server the sources list is probed, and one
        in rotation that serves a version behind the fleet's (it restarted, or joined, on its base weights) is taken
        out of rotation and paused now, instead of at the next publish; where the transport has a complete snapshot
        of the fleet's version it is loaded from it and put back at once. Returns the servers taken out."""
        fleet = self.version
        if fleet is None:
            return []
        urls = [u for u in self._discover() if u not in self.out and u not in self.excluded]
        found = self._probe(urls)
        whys = {u: self._behind(u, found[u], fleet) for u in urls if not isinstance(found[u], Down)}
        behind = [u for u, why in whys.items() if why is not None]
        for u in behind:
            logger.warning("server %s %s, between two publishes: out of rotation until it is repaired", u, whys[u])
            self._take_out(u, whys[u], pause=True)
        if behind and snapshot is not None:
            self._repair_from_snapshot(behind, snapshot, fleet)
        return behind

    # ------------------------------------------------------------------ after the sync

    def committed(self, version: int, statuses: dict[str, str]) -> dict[str, str]:
        """The transport committed ``version``: ``statuses`` says how each server of the sync ended. Puts
        the ones that took it (back) into rotation, takes the others out; returns the status of every
        server found (the excluded ones too).

        Raises:
            SyncError: fewer than ``min_servers`` took the version (the ones that did serve it).
        """
        ok = [u for u, s in statuses.items() if s == "ok"]
        if ok and self.follows_version:
            self.version = str(version)
        for u, s in statuses.items():
            if s == "ok":
                self.torn.pop(u, None)
                self._put_back(u)
            else:
                if s.startswith("torn"):
                    self.torn[u] = s
                self._take_out(u, s, pause=False)  # the transport left it paused
        if ok:
            if self._new_run:  # the run is started; later versions only go up
                self._new_run = False
                for c in self.clients.values():
                    c.claim_run(self.run_id)
        status = {**self.status, **statuses}
        if statuses and len(ok) < self.config.min_servers:  # (a disk publish that waits for none has none)
            raise SyncError(f"version {version} reached {len(ok)} server(s), fewer than min_servers="
                            f"{self.config.min_servers}: " + "; ".join(f"{u}: {s}" for u, s in status.items()))
        return status

    def failed(self, held: dict[str, str]) -> str:
        """A sync failed; ``held`` are the servers the transport left paused (url -> ``torn: ...`` or
        ``failed: ...``). Takes them out of rotation; a line for the error message."""
        for u, s in held.items():
            if s.startswith("torn"):
                self.torn[u] = s
            self._take_out(u, s, pause=False)
        if not held:
            return ""
        return ("out of rotation until a publish repairs them: "
                + ", ".join(f"{u} ({s})" for u, s in held.items()))

    # ------------------------------------------------------------------ rotation

    def _take_out(self, url: str, why: str, pause: bool) -> None:
        self.out[url] = why
        for src in self.sources:
            try:
                src.take_out(url, why)
            except BridgeError as e:
                logger.warning("could not take %s out of rotation in %s: %s", url, src.url, e)
        if pause and url in self.clients:
            try:
                self.clients[url].pause_generation("abort")
            except BridgeError as e:
                logger.warning("could not pause %s, which is out of rotation (%s): %s", url, why, e)

    def _put_back(self, url: str) -> None:
        why = self.out.pop(url, None)
        was_out = why is not None
        for i, src in enumerate(self.sources):
            if not was_out and not (isinstance(src, RouterServers) and url not in self._listed.get(i, [])):
                continue
            try:
                src.put_back(url)
            except BridgeError as e:
                logger.warning("could not put %s back into rotation in %s: %s", url, src.url, e)
        if was_out:
            logger.warning("server %s is in rotation at version %s (it was out: %s)", url, self.version, why)

    # ------------------------------------------------------------------ helpers

    def _client(self, url: str) -> ServerClient:
        c = self.clients.get(url)
        if c is None:
            cfg = self.config
            c = ServerClient(url, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key, timeout=cfg.http_timeout)
            c.claim_run(self.run_id, new_run=self._new_run)
            self.clients[url] = c
        return c

    def _group(self, live: list[str]) -> ServerGroup | None:
        if not live:
            return None
        if self.group is not None and self.group.urls == live:
            return self.group
        old, self.group = self.group, ServerGroup([self.clients[u] for u in live])
        if old is not None:
            old.close(clients=False)
        return self.group

    def _behind(self, url: str, served: str, fleet: str) -> str | None:
        """Why a server that answered ``served`` is behind the fleet's version, or None. One that is restarted, on
        its base weights, maybe as another release or with other flags: what it can do is learned again (a failure
        is left to the sync to meet). SGLang < 0.5.1 has no version to compare: never behind."""
        c = self.clients[url]
        if not c.features.weight_version or not is_behind(served, fleet):
            return None
        try:
            c.learn(self.probe_timeout)
        except BridgeError as e:
            logger.debug("cannot learn again what %s can do: %s", url, e)
        return f"serves version {served}, behind the fleet's {fleet}"

    def _too_few(self, urls: list[str], n: int) -> str:
        where = ", ".join(s.url for s in self.sources)
        if not urls:
            return f"no server found in {where}; start servers (or register them), or wait until they registered"
        reasons = [s.removeprefix("excluded: ") for s in self.status.values()]
        if n == 0 and reasons and all(r.startswith("cannot reach ") for r in reasons):  # the cause is the fix: say it first
            return "; ".join(reasons) + f" (no server answers; min_servers={self.config.min_servers})"
        return (f"only {n} of {len(urls)} server(s) answer, fewer than min_servers={self.config.min_servers}: "
                + "; ".join(f"{u}: {s}" for u, s in self.status.items())
                + "; start or repair servers, or lower min_servers")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.group is not None:
            self.group.close(clients=False)
        for c in self.clients.values():
            c.close()
        for src in self.sources:
            try:
                src.close()
            except BridgeError as e:
                logger.debug("closing %s: %s", src.url, e)


def list_servers(registries, experiment: str, trial: str, timeout: float = 5.0) -> dict[str, str | None]:
    """url -> the version it serves (None: no answer), for every server the registries list now."""
    sources = open_sources([], list(registries), experiment, trial, timeout=timeout)
    try:
        urls = list(dict.fromkeys(u for src in sources for u in src.urls()))
    finally:
        for src in sources:
            src.close()

    def version_of(url: str) -> str | None:
        c = ServerClient(url, timeout=timeout)
        try:
            return c.probe(timeout)
        except BridgeError:
            return None
        finally:
            c.close()

    with cf.ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        return dict(zip(urls, pool.map(version_of, urls)))


def probe_servers(urls: list[str], client_of: Callable[[str], ServerClient], timeout: float,
                  pool: cf.Executor) -> dict[str, str | Down]:
    """url -> the version the server serves, or why it does not count (a :class:`Down`): every server asked at once
    on ``pool``, each within ``timeout`` seconds (``probe_timeout``)."""
    def probe(url: str):
        try:
            return client_of(url).probe(timeout)
        except SyncTimeout:
            return Down(f"no answer within {timeout:g} s (probe_timeout)")
        except BridgeError as e:
            return Down(str(e))

    futures = {u: pool.submit(probe, u) for u in urls}
    return {u: f.result() for u, f in futures.items()}


class Down:
    """Why a probed server does not count."""

    def __init__(self, why: str):
        self.why = why

    def __str__(self) -> str:
        return self.why


def newest_version(versions) -> str | None:
    """The highest numbered version among ``versions`` (labels such as ``default`` do not count), or None."""
    numeric = [int(v) for v in versions if isinstance(v, str) and v.isdigit()]
    return str(max(numeric)) if numeric else None


def is_behind(served: str, fleet: str) -> bool:
    """True when a server that serves ``served`` is behind the fleet's version: an older version, or a label
    that is no version of this run (``default``, a base model). A server ahead of it (another publisher of
    the same run gave it a newer version, as the demo's broadcast and disk publishers take turns) is not."""
    served, fleet = str(served), str(fleet)
    if served.isdigit() and fleet.isdigit():
        return int(served) < int(fleet)
    return served != fleet and not served.isdigit()
