"""The custom process groups trainers broadcast on, and how the server notices a dead trainer.

A trainer that dies is noticed even between requests: the server's watchdog
(:class:`~inference_adapter.model_state.ModelState`) pings each group's TCP store, which group rank 0
(the trainer) hosts (:meth:`TrainerGroups.unreachable`). A dead trainer's group is dropped and its
session aborted; and if generation is paused, it continues on the previous weights, since the trainer
that paused it will not come back. A broadcast that fails (the trainer died, or stalled past
``--group-timeout``) does the same (see :mod:`inference_adapter.weight_updates`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from bridge.errors import BridgeError
from bridge.process_group import destroy_custom_process_group, init_custom_process_group
from inference_adapter.errors import RequestError

__all__ = ["MAX_WORLD_SIZE", "TrainerGroups"]

MAX_WORLD_SIZE = 1 << 16
"""Largest weight-update group accepted: far beyond any real deployment, small enough for gloo."""

_INIT_FAILED = "Failed to initialize custom process group"


class TrainerGroups:
    """The weight-update groups by name, the ones the server destroyed (and why), and the one being received on.

    Args:
        lock: the server's weight-operation lock (one at a time); every change of the groups happens
            under it, and :meth:`drop` and :meth:`receiving_on` expect the caller to hold it.
        log: the server's logger.
        timeout: ``--group-timeout``, for a group's rendezvous and each of its broadcasts.
        on_drop: called (lock held) with a dropped group's name and why, so that an update session that
            used the group is aborted.
    """

    def __init__(self, *, lock: threading.Lock, log, timeout: float, on_drop: Callable[[str, str], None]):
        self.lock = lock
        self.log = log
        self.timeout = timeout
        self.on_drop = on_drop
        self.pgs: dict[str, dist.ProcessGroup] = {}
        self.dead: dict[str, str] = {}  # group name -> why the server destroyed it
        self.nccl: set[str] = set()
        self.receiving: str | None = None  # the group a broadcast is being received on, for /server_info

    def names(self) -> list[str]:
        return sorted(self.pgs)

    def init(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> str:
        """Join the trainer's custom process group as rank ``rank_offset`` (TP rank 0); blocks for the rendezvous."""
        _check_group_request(master_port, rank_offset, world_size, group_name, backend)
        with self.lock:
            if group_name in self.pgs:
                self.log.warning("group %s is initialized again; dropping the old one", group_name)
                self.drop(group_name, "it was initialized again")
            self.dead.pop(group_name, None)
        self.log.info("joining group %s at %s:%s as rank %d/%d (%s)", group_name, master_address, master_port,
                      rank_offset, world_size, backend)
        try:
            pg = init_custom_process_group(
                master_address=master_address, master_port=int(master_port), world_size=world_size, rank=rank_offset,
                group_name=group_name, backend=backend, timeout=self.timeout,
            )
        except (BridgeError, RuntimeError, ValueError) as e:
            raise RequestError(f"{_INIT_FAILED}: {e}.") from e
        with self.lock:
            self.pgs[group_name] = pg
            if backend == "nccl":
                self.nccl.add(group_name)
        return "Succeeded to initialize custom process group."

    def destroy(self, group_name: str) -> str:
        """``/destroy_weights_update_group``: SGLang's answers."""
        with self.lock:
            if group_name not in self.pgs:
                raise RequestError("The group to be destroyed does not exist.")
            self.drop(group_name, "it was destroyed")
            self.dead.pop(group_name, None)
        return "Succeeded to destroy custom process group."

    def drop(self, name: str, why: str) -> None:
        """Caller holds the lock: destroy group ``name``, remember why, and abort a session that used it."""
        destroy_custom_process_group(self.pgs.pop(name, None))
        self.nccl.discard(name)
        self.dead[name] = why
        self.on_drop(name, why)

    def missing(self, name: str) -> RequestError:
        """SGLang's refusal of a request on a group that does not exist, with why the server destroyed it."""
        why = f" (the server destroyed it because {self.dead[name]})" if name in self.dead else ""
        return RequestError(f"Group {name} not in {self.names()}{why}. Please call init_weights_update_group first.")

    @contextmanager
    def receiving_on(self, name: str) -> Iterator[None]:
        """Caller holds the lock: report group ``name`` as receiving (``/server_info``) while the block runs."""
        self.receiving = name
        try:
            yield
        finally:
            self.receiving = None

    def unreachable(self) -> Iterator[tuple[str, dist.ProcessGroup, Exception]]:
        """Each group whose TCP store (hosted by group rank 0, the trainer) no longer answers, with the error."""
        from torch.distributed import distributed_c10d as c10d

        for name, pg in list(self.pgs.items()):
            store = c10d._world.pg_map.get(pg, (None, None))[1]
            if store is None:
                continue
            try:
                store.check(["wsync/alive"])
            except Exception as e:  # DistNetworkError / timeout: the trainer is gone
                yield name, pg, e

    def drop_unreachable(self, name: str, pg: dist.ProcessGroup, e: Exception) -> bool:
        """Drop a group :meth:`unreachable` found, unless an update holds the lock (a receive in progress on it
        fails by itself and cleans up; the next round tries again) or it was replaced. True if dropped."""
        if not self.lock.acquire(timeout=0.1):
            return False
        try:
            if self.pgs.get(name) is not pg:
                return False
            self.log.warning("the trainer of group %s is gone (%s); dropping the group", name, str(e).splitlines()[0])
            self.drop(name, "its trainer (group rank 0, the host of its store) is gone")
            return True
        finally:
            self.lock.release()

    def close(self) -> None:
        """Destroy every group (gloo aborts the process at exit otherwise)."""
        for name in list(self.pgs):
            destroy_custom_process_group(self.pgs.pop(name))


def _check_group_request(master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str) -> None:
    """RequestError for an ``/init_weights_update_group`` this server cannot join, before any rendezvous."""
    if backend not in ("gloo", "nccl"):
        raise RequestError(f"{_INIT_FAILED}: backend must be 'nccl' or 'gloo', got {backend!r}.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RequestError(
            f"{_INIT_FAILED}: backend 'nccl' needs CUDA, which this server does not have (the reference server "
            "runs on CPU); initialize the group with backend='gloo'."
        )
    if not 1 <= master_port <= 65535:
        raise RequestError(f"{_INIT_FAILED}: master_port {master_port} is not a TCP port (1..65535).")
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise RequestError(f"{_INIT_FAILED}: world_size {world_size} is outside 2..{MAX_WORLD_SIZE} (1 trainer + all "
                           "servers' TP ranks).")
    if not group_name or len(group_name) > 256:
        raise RequestError(f"{_INIT_FAILED}: group_name must be 1-256 characters.")
    if not 0 < rank_offset < world_size:
        raise RequestError(
            f"{_INIT_FAILED}: rank_offset {rank_offset} gives rank {rank_offset}, outside 1..{world_size - 1} (rank 0 "
            "is the trainer; world_size = 1 + all servers' TP ranks)."
        )
