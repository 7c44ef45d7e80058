"""The custom process groups a trainer broadcasts on, and the watchdog that notices a dead trainer.

A trainer that dies is noticed even between requests: a watchdog pings each group's TCP store, which
group rank 0 (the trainer) hosts. A dead trainer's group is dropped and its session aborted; and if
generation is paused, it continues on the previous weights, since the trainer that paused it will not
come back. A broadcast that fails (the trainer died, or stalled past ``--group-timeout``) does the same
(see :mod:`inference_adapter.weight_updates`).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from bridge.errors import BridgeError
from bridge.process_group import destroy_custom_process_group, init_custom_process_group
from inference_adapter.errors import RequestError

__all__ = ["GroupsMixin"]

MAX_WORLD_SIZE = 1 << 16
"""Largest weight-update group accepted: far beyond any real deployment, small enough for gloo."""


class GroupsMixin:
    """:class:`~inference_adapter.model_state.ModelState`'s process-group methods and trainer watchdog.

    Owns ``_groups``, ``_dead_groups``, ``_nccl_groups``, ``_receiving`` and the watchdog thread, set up
    by :meth:`_init_groups` (``inference_adapter.bench_routes`` uses them too). Group changes happen
    under the host's ``_update_lock``; dropping a group aborts a session that used it.
    """

    def _init_groups(self) -> None:
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._dead_groups: dict[str, str] = {}  # group name -> why the server destroyed it
        self._nccl_groups: set[str] = set()
        self._receiving: str | None = None  # the group a broadcast is being received on, for /server_info
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_trainers, name="wsync-trainer-watchdog", daemon=True)
        self._watchdog.start()

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                   backend: str) -> str:
        """Join the trainer's custom process group as rank ``rank_offset`` (TP rank 0); blocks for the rendezvous."""
        if backend not in ("gloo", "nccl"):
            raise RequestError(f"Failed to initialize custom process group: backend must be 'nccl' or 'gloo', got {backend!r}.")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RequestError(
                "Failed to initialize custom process group: backend 'nccl' needs CUDA, which this server does not "
                "have (the reference server runs on CPU); initialize the group with backend='gloo'."
            )
        if not 1 <= master_port <= 65535:
            raise RequestError(f"Failed to initialize custom process group: master_port {master_port} is not a TCP port "
                               "(1..65535).")
        if not 2 <= world_size <= MAX_WORLD_SIZE:
            raise RequestError(f"Failed to initialize custom process group: world_size {world_size} is outside "
                               f"2..{MAX_WORLD_SIZE} (1 trainer + all servers' TP ranks).")
        if not group_name or len(group_name) > 256:
            raise RequestError("Failed to initialize custom process group: group_name must be 1-256 characters.")
        rank = rank_offset
        if not 0 < rank < world_size:
            raise RequestError(
                f"Failed to initialize custom process group: rank_offset {rank_offset} gives rank {rank}, outside "
                f"1..{world_size - 1} (rank 0 is the trainer; world_size = 1 + all servers' TP ranks)."
            )
        with self._update_lock:
            if group_name in self._groups:
                self.log.warning("group %s is initialized again; dropping the old one", group_name)
                self._drop_group(group_name, "it was initialized again")
            self._dead_groups.pop(group_name, None)
        self.log.info("joining group %s at %s:%s as rank %d/%d (%s)", group_name, master_address, master_port, rank,
                      world_size, backend)
        try:
            pg = init_custom_process_group(
                master_address=master_address, master_port=int(master_port), world_size=world_size, rank=rank,
                group_name=group_name, backend=backend, timeout=self.group_timeout,
            )
        except (BridgeError, RuntimeError, ValueError) as e:
            raise RequestError(f"Failed to initialize custom process group: {e}.") from e
        with self._update_lock:
            self._groups[group_name] = pg
            if backend == "nccl":
                self._nccl_groups.add(group_name)
        return "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> str:
        with self._update_lock:
            if group_name not in self._groups:
                raise RequestError("The group to be destroyed does not exist.")
            self._drop_group(group_name, "it was destroyed")
            self._dead_groups.pop(group_name, None)
        return "Succeeded to destroy custom process group."

    def _drop_group(self, name: str, why: str) -> None:
        # Caller holds _update_lock.
        destroy_custom_process_group(self._groups.pop(name, None))
        self._nccl_groups.discard(name)
        self._dead_groups[name] = why
        if self._session is not None and name in self._session.groups:
            self._abort_session(f"group {name} was dropped during the session ({why})")

    def close(self) -> None:
        """Destroy every group (gloo aborts the process at exit otherwise)."""
        self._closing.set()
        for name in list(self._groups):
            destroy_custom_process_group(self._groups.pop(name))

    def _watch_trainers(self, interval: float = 1.0) -> None:
        """Notice a trainer that died between requests: its group's TCP store (hosted by group rank 0) is gone.

        Without this, a trainer killed between two buckets would leave its session open and generation
        paused forever. A dead trainer's group is dropped, its session aborted, and a pause lifted.
        """
        from torch.distributed import distributed_c10d as c10d

        while not self._closing.wait(interval):
            self._check_session_owner()  # a colocated trainer has no group: its pid is watched instead
            for name, pg in list(self._groups.items()):
                store = c10d._world.pg_map.get(pg, (None, None))[1]
                if store is None:
                    continue
                try:
                    store.check(["wsync/alive"])
                except Exception as e:  # noqa: BLE001 - DistNetworkError / timeout: the trainer is gone
                    self._trainer_gone(name, pg, e)

    def _trainer_gone(self, name: str, pg, e: Exception) -> None:
        # A receive in progress on this group fails by itself and cleans up; try again next round.
        if not self._update_lock.acquire(timeout=0.1):
            return
        try:
            if self._groups.get(name) is not pg:
                return
            self.log.warning("the trainer of group %s is gone (%s); dropping the group", name, str(e).splitlines()[0])
            self._drop_group(name, "its trainer (group rank 0, the host of its store) is gone")
            if self._paused:
                self.log.warning("continuing generation on the previous weights: the trainer that paused it is gone")
                self.resume()
        finally:
            self._update_lock.release()
