"""The servers of an adapter publish: the full publisher's :class:`bridge.fleet.Fleet`, which finds them again at the
start of every publish (the fixed list, then each registry or router), probes them (one that does not answer within
``probe_timeout`` is excluded from that publish, logged once, and taken out of rotation until it took an adapter
version again) and counts ``min_servers`` on the ones that answer; and the writer lease
(:class:`bridge.transports.lease.WriterLease`), which holds them for this writer alone while the publish runs.

What an adapter fleet does not follow is the weights' version: a server that serves older weights is the weights
publisher's to repair, and an adapter is loaded into it as into any other."""

from __future__ import annotations

from bridge.fleet.fleet import Fleet

__all__ = ["AdapterServers"]


class AdapterServers:
    """Rank 0's servers of one :class:`~bridge.lora.publisher.AdapterPublisher` (see the module docstring)."""

    def __init__(self, config):
        self.config = config
        self.current: list = []
        """A client of each server of this publish, found by :meth:`find`."""
        self._fleet: Fleet | None = None  # opened at the first publish that names servers
        self._lease = None  # this publisher's hold on its servers while a publish runs

    def close(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None
        if self._fleet is not None:
            self._fleet.close()
            self._fleet = None

    def find(self) -> int:
        """The servers of this publish, found and probed again; their number. Fewer than ``min_servers`` answering
        (when any server is configured) fails the publish before anything is loaded, with the full publisher's
        message."""
        cfg = self.config
        if not (cfg.servers or cfg.server_registry):
            self.current = []
            return 0
        if self._fleet is None:
            self._fleet = Fleet(cfg, f"{cfg.experiment}/{cfg.trial}", follows_version=False)
        group = self._fleet.prepare()
        self.current = list(group.clients) if group is not None else []
        if cfg.via == "broadcast":  # before anything moves
            from bridge.lora.broadcast import require_reference_servers

            require_reference_servers(self.current)
        return len(self.current)

    def take(self) -> None:
        """Every server of this publish, for this writer alone until the publish ended (committed or undone),
        as a full sync takes them: another trainer's publish is refused meanwhile, naming this run, and a dead one
        holds them for ``writer_lease`` at most."""
        from bridge.transports.lease import WriterLease

        if not self.current:
            return
        group = self._fleet.group
        if self._lease is None:
            cfg = self.config
            self._lease = WriterLease(group, run_id=f"{cfg.experiment}/{cfg.trial}", seconds=cfg.writer_lease,
                                      lock_url=cfg.writer_lock)
            self._lease.may_tear = False  # each server loads an adapter in one request
        else:
            self._lease.use_servers(group)
        self._lease.take()

    def committed(self, version: int) -> None:
        """Every server of this publish took ``version``: the ones out of rotation (excluded at an earlier publish,
        back now) are put back; then the servers are let go."""
        if self._fleet is not None and self.current:
            self._fleet.committed(version, {c.url: "ok" for c in self.current})
        self.release()

    def release(self) -> None:
        """Let go of the servers (the publish committed, or was undone)."""
        if self._lease is not None:
            self._lease.release()

    def clients(self) -> list:
        """A client of each server of this publish (found by :meth:`find`)."""
        return self.current
