"""The servers of an adapter publish, as a full publish has them: found again at its start (the fixed list, then each
registry), probed (one that does not answer within ``probe_timeout`` is excluded from that publish, logged once), and
held for this writer alone while the publish runs (:class:`bridge.transports.lease.WriterLease`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from bridge.errors import SyncError
from bridge.log import get_logger

__all__ = ["AdapterServers"]

logger = get_logger(__name__)


class AdapterServers:
    """Rank 0's servers of one :class:`~bridge.lora.publisher.AdapterPublisher` (see the module docstring)."""

    def __init__(self, config):
        self.config = config
        self.current: list[str] = []
        """The servers of this publish, found at its start."""
        self.excluded: dict[str, str] = {}
        """url -> why, each server that did not answer the last probe."""
        self._clients: dict = {}  # URL -> client, for every server found so far
        self._sources = None  # where the servers are found (bridge.fleet.discovery), opened once
        self._lease = None  # this publisher's hold on its servers while a publish runs

    def close(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None
        for c in self._clients.values():
            c.close()
        for source in self._sources or ():
            source.close()
        self._clients, self._sources = {}, None

    def find(self) -> int:
        """The servers of this publish, found again (the fixed list, then each registry); their number.
        Fewer than ``min_servers`` (when any server is configured) fails the publish before anything is loaded."""
        from bridge.fleet.discovery import open_sources

        cfg = self.config
        if self._sources is None:
            self._sources = open_sources(cfg.servers, cfg.server_registry or (), cfg.experiment, cfg.trial,
                                         timeout=cfg.http_timeout)
        urls: list[str] = []
        for source in self._sources:
            urls += [u.rstrip("/") for u in source.urls() if u.rstrip("/") not in urls]
        live = self._answering(urls)
        if (cfg.servers or cfg.server_registry) and len(live) < cfg.min_servers:
            where = ", ".join(s.url for s in self._sources)
            down = "".join(f"; {u} excluded: {why}" for u, why in self.excluded.items() if u in urls)
            raise SyncError(f"{len(live)} of {len(urls)} server(s) found in {where} answer, fewer than "
                            f"min_servers={cfg.min_servers}{down}; start or register more servers (wsync serve "
                            "--register) or lower min_servers")
        self.current = live
        if cfg.via == "broadcast":  # before anything moves
            from bridge.lora.broadcast import require_reference_servers

            require_reference_servers(self.clients())
        return len(live)

    def take(self) -> None:
        """Every server of this publish, for this writer alone until the publish ended (committed or undone),
        as a full sync takes them (:class:`bridge.transports.lease.WriterLease`): another trainer's publish is
        refused meanwhile, naming this run, and a dead one holds them for ``writer_lease`` at most."""
        from types import SimpleNamespace

        from bridge.transports.lease import WriterLease

        if not self.current:
            return
        servers = SimpleNamespace(clients=self.clients())
        if self._lease is None:
            cfg = self.config
            self._lease = WriterLease(servers, run_id=f"{cfg.experiment}/{cfg.trial}", seconds=cfg.writer_lease,
                                      lock_url=cfg.writer_lock)
            self._lease.may_tear = False  # each server loads an adapter in one request
        else:
            self._lease.use_servers(servers)
        self._lease.take()

    def release(self) -> None:
        """Let go of the servers (the publish committed, or was undone)."""
        if self._lease is not None:
            self._lease.release()

    def _answering(self, urls: list[str]) -> list[str]:
        """The servers of ``urls`` that answer the probe within ``probe_timeout``; each one that does not is
        excluded from this publish, logged once until it answers again."""
        from bridge.fleet.fleet import Down, probe_servers

        timeout = min(self.config.probe_timeout, self.config.http_timeout)
        with ThreadPoolExecutor(max(1, min(16, len(urls))), thread_name_prefix="wsync-adapter-probe") as pool:
            found = {u: str(v) if isinstance(v, Down) else None
                     for u, v in probe_servers(urls, self._client, timeout, pool).items()}
        for url, why in found.items():
            if why is None and self.excluded.pop(url, None) is not None:
                logger.warning("adapter %r: server %s answers again", self.config.name, url)
            elif why is not None:
                gone = self._clients.pop(url, None)  # asked its info again when it is back (it may have changed)
                if gone is not None:
                    gone.close()
                if url not in self.excluded:
                    logger.warning("adapter %r: server %s is excluded from this publish: %s", self.config.name, url, why)
                self.excluded[url] = why
        return [u for u in urls if found[u] is None]

    def _client(self, url: str):
        from bridge.client import ServerClient

        cfg = self.config
        if url not in self._clients:
            client = ServerClient(url, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key, timeout=cfg.http_timeout)
            client.claim_run(f"{cfg.experiment}/{cfg.trial}")  # the servers' version rule and lease name this run
            self._clients[url] = client
        return self._clients[url]

    def clients(self) -> list:
        """A client of each server of this publish (found by :meth:`find`)."""
        return [self._client(u) for u in self.current]
