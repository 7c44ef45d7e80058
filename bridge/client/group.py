"""``ServerGroup``: the servers that receive the same weights, each call fanned out to all of them at once."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from bridge.client.server import ServerClient
from bridge.errors import BridgeError, ConfigError, ServerError, SyncTimeout
from bridge.log import get_logger

__all__ = ["ServerGroup"]

# The package's name, not this file's: one logger for the whole package.
logger = get_logger(__package__)
T = TypeVar("T")


class ServerGroup:
    """A set of servers that receive the same weights; each call fans out to all of them concurrently.

    Rank layout of the weight-update group: the trainer is rank 0, server ``i`` takes ranks
    ``rank_offsets()[i] .. + tp_size - 1``, ``world_size() = 1 + sum(tp_size)``.

    Args:
        servers: URLs or ready :class:`ServerClient` objects, in rank order.
        api_key: for URLs given as strings.
        admin_api_key: for URLs given as strings: the servers' ``--admin-api-key`` (control routes).
        timeout: per-call timeout for clients built from URLs.
        allow_empty: a group of no servers (yet) is valid: a disk watcher that follows a registry.
    """

    def __init__(
        self, servers: Sequence[str | ServerClient], *, api_key: str | None = None, admin_api_key: str | None = None,
        timeout: float = 60.0, allow_empty: bool = False,
    ):
        self.client_kw = dict(api_key=api_key, admin_api_key=admin_api_key, timeout=timeout)
        """What clients built from URLs get (a group that grows builds its new ones alike)."""
        if not servers and not allow_empty:
            raise ConfigError("a ServerGroup needs at least one server")
        self.clients: list[ServerClient] = [
            s if isinstance(s, ServerClient) else ServerClient(s, api_key=api_key, admin_api_key=admin_api_key, timeout=timeout)
            for s in servers
        ]
        urls = [c.url for c in self.clients]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"a server is listed twice: {urls}")
        self.out_of_rotation: dict[str, str] = {}
        """url -> why, for servers of this group that are out of rotation (their weights are stale or may be
        torn): a sync that fails leaves them paused instead of resuming them (:mod:`bridge.fleet`)."""
        self._pool = cf.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)), thread_name_prefix="wsync-http")

    @property
    def pool(self) -> cf.ThreadPoolExecutor:
        """The fan-out threads (at least two per server), kept from sync to sync: each thread keeps its HTTP
        connections open, so a sync's requests do not open new ones."""
        return self._pool

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    def __len__(self) -> int:
        return len(self.clients)

    def __iter__(self):
        return iter(self.clients)

    def rank_offsets(self) -> list[int]:
        """Group rank of each server's first TP rank: ``1 + sum of the previous servers' tp_size``."""
        offsets, nxt = [], 1
        for c in self.clients:
            offsets.append(nxt)
            nxt += c.tp_size
        return offsets

    def world_size(self) -> int:
        return 1 + sum(c.tp_size for c in self.clients)

    def submit(self, fn: Callable[[ServerClient], T]) -> list[cf.Future]:
        """Start ``fn(client)`` for every server; the futures come back in server order."""
        return [self._pool.submit(fn, c) for c in self.clients]

    def map(self, fn: Callable[[ServerClient], T], *, timeout: float | None = None) -> list[T]:
        """Run ``fn(client)`` on every server concurrently and wait for all.

        Raises:
            ServerError / SyncTimeout: the first failure in server order (each names its server); a
                foreign exception is wrapped in ServerError naming the server.
            SyncTimeout: ``timeout`` seconds passed before every server answered.
        """
        futures = self.submit(fn)
        done, pending = cf.wait(futures, timeout=timeout)
        if pending:
            late = [c.url for c, f in zip(self.clients, futures) if f in pending]
            raise SyncTimeout(f"no answer within {timeout:g} s from {late}")
        results, errors = [], []
        for c, f in zip(self.clients, futures):
            e = f.exception()
            if e is None:
                results.append(f.result())
            elif isinstance(e, BridgeError):
                errors.append(e)
            else:
                errors.append(ServerError(c.url, f"{type(e).__name__}: {e}"))
        if errors:
            for e in errors[1:]:
                logger.warning("also failed: %s", e)
            raise errors[0]
        return results

    # ------------------------------------------------------------------ fan-out conveniences

    def pause_generation(self, mode: str = "abort") -> list[dict]:
        return self.map(lambda c: c.pause_generation(mode))

    def continue_generation(self) -> list[dict]:
        return self.map(lambda c: c.continue_generation())

    def claim_run(self, run_id: str | None, new_run: bool = False) -> None:
        """:meth:`ServerClient.claim_run` for every server."""
        for c in self.clients:
            c.claim_run(run_id, new_run)

    def begin_weight_update(self) -> list[dict]:
        return self.map(lambda c: c.begin_weight_update())

    def end_weight_update(self) -> list[dict]:
        return self.map(lambda c: c.end_weight_update())

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> list[dict]:
        return self.map(lambda c: c.update_weight_version(new_version, abort_all_requests))

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, **kwargs: Any) -> list[dict]:
        return self.map(lambda c: c.update_weights_from_disk(model_path, weight_version=weight_version, **kwargs))

    def model_info(self) -> list[dict]:
        return self.map(lambda c: c.model_info())

    def weight_versions(self) -> dict[str, str]:
        """url -> the ``weight_version`` each server reports on ``/model_info``."""
        infos = self.model_info()
        return {c.url: str(i.get("weight_version")) for c, i in zip(self.clients, infos)}

    def close(self, clients: bool = True) -> None:
        """Stop the fan-out threads and, unless ``clients`` is False (they are shared), close the clients."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients if clients else ():
            c.close()

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
