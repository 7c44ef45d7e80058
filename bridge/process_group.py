"""The custom process group that joins trainer rank 0 with the inference ranks.

It is built exactly as SGLang builds its side (``init_custom_process_group`` in SGLang's
``srt/utils/common.py``): a TCP rendezvous, the store wrapped in ``PrefixStore(group_name, ...)``, then
``_new_process_group_helper`` and an identity rank map. Both sides must use the same ``group_name``
because it is the store prefix. It is independent of the default (FSDP) group, which already exists
in every process and could only be subdivided by ``new_group``.

Every collective on it is bounded by ``timeout``: when a peer dies or never joins, the caller gets an
exception after at most that long, instead of SGLang's default 30 minutes.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import socket
from collections.abc import Collection
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from bridge.errors import ConfigError, SyncTimeout
from bridge.publisher.bounded import call_within

__all__ = ["default_backend", "destroy_custom_process_group", "find_free_port", "init_custom_process_group",
           "interface_of", "route_source"]

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"

logger = logging.getLogger(__name__)


def default_backend() -> str:
    """``"nccl"`` where CUDA is available, otherwise ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def find_free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port that is free on ``host`` right now, and not one of ``avoid`` (ports picked for something
    that has not bound them yet).

    Picked at random below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``): a port the kernel hands
    out is in that range, where any outgoing connection may take it as its own local port before the caller binds
    it (``EADDRINUSE`` on listen, seen in the suite); below it, only another listener can. The kernel's choice when
    no port there is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    for port in _RANDOM.sample(range(_LOWEST_PICKED, low), min(64, max(0, low - _LOWEST_PICKED))):
        if port in avoid:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    while True:
        with socket.socket(family) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


_LOWEST_PICKED = 15000
"""The lowest port :func:`find_free_port` picks (above the well-known and registered services' usual ports)."""
_RANDOM = random.SystemRandom()  # the OS's randomness: forked processes do not share a sequence


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def route_source(host: str, port: int = 9) -> str:
    """This host's address on the way to ``host``, as the kernel routes it: a UDP socket connected to it,
    then ``getsockname`` (nothing is sent). ``host``'s own address when it is one of this host's.

    Raises:
        OSError: ``host`` does not resolve, or no route leads there.
    """
    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds the IPv4 ``address``; None when none does
    (or on a system without ``SIOCGIFADDR``)."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def _gloo_interface(master_address: str, master_port: int) -> str | None:
    """The interface gloo must bind the group's connections to: the one that routes to group rank 0.

    Left alone, gloo binds to the address this host's name resolves to, which is 127.0.0.1 (or 127.0.1.1)
    on many hosts: peers on other hosts are then told to connect to a loopback address. None when the
    user chose with ``GLOO_SOCKET_IFNAME``, when rank 0 is on this host's loopback, or when it cannot tell.
    """
    if os.environ.get(GLOO_IFNAME_ENV):
        return None
    try:
        local = route_source(master_address, master_port)
    except OSError:
        return None
    if local.startswith("127.") or ":" in local:
        return None
    return interface_of(local)


def _tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def init_custom_process_group(
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str | None = None,
    timeout: float = 60.0,
) -> dist.ProcessGroup:
    """Create (or join) the weight-update group; rank 0 hosts the TCP store.

    Args:
        master_address: host of group rank 0 (the trainer), reachable from every server.
        master_port: free TCP port on that host.
        world_size: 1 + the total number of inference ranks.
        rank: this process's rank in the group (0 for the trainer).
        group_name: store prefix; must equal the name sent in ``/init_weights_update_group``.
        backend: ``"nccl"`` or ``"gloo"``; default: :func:`default_backend`.
        timeout: seconds for the rendezvous and for every later collective on the group.

    Raises:
        ConfigError: bad rank/world size or an unknown backend.
        SyncTimeout: the other ranks did not join within ``timeout``.
    """
    backend = backend or default_backend()
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA, which this process does not have; use backend='gloo'")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ConfigError(f"need world_size >= 2 and 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    # torchrun sets this to True for its workers, and then rank 0 would not host a TCP store for the new
    # group: the servers would wait forever. It must be False before the rendezvous.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    # The rendezvous and gloo's connection set-up each wait up to the timeout, and the store client
    # retries: left alone, they add up to 2-3x ``timeout``. The caller gets its answer within
    # ``timeout``; a rendezvous that completes later anyway is torn down by its own thread.
    pg = call_within(
        lambda: _join(master_address, master_port, world_size, rank, group_name, backend, timeout), timeout,
        f"weight-update group {group_name!r}: not all {world_size} ranks joined {_tcp_url(master_address, master_port)}",
        bound_name="group_timeout", late=destroy_custom_process_group, thread_name=f"wsync-rendezvous-{group_name}",
    )
    logger.info("joined weight-update group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return pg


def _join(master_address: str, master_port: int, world_size: int, rank: int, group_name: str, backend: str,
          timeout: float) -> dist.ProcessGroup:
    td = timedelta(seconds=timeout)
    try:
        store, rank, world_size = next(
            c10d.rendezvous(_tcp_url(master_address, master_port), rank, world_size, timeout=td)
        )
        store.set_timeout(td)
        store = c10d.PrefixStore(group_name, store)
        kwargs = {"group_name": group_name, "timeout": td}
        params = inspect.signature(c10d._new_process_group_helper).parameters
        # torch 2.6 renamed pg_options -> backend_options.
        kwargs["backend_options" if "backend_options" in params else "pg_options"] = None
        iface = _gloo_interface(master_address, master_port) if backend == "gloo" else None
        if iface is not None:  # read by gloo when the group is made, from this process's environment
            logger.info("weight-update group %s: gloo binds to %s, the interface that routes to %s", group_name,
                        iface, master_address)
            os.environ[GLOO_IFNAME_ENV] = iface
        try:
            pg = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store, **kwargs)
        finally:
            if iface is not None:
                os.environ.pop(GLOO_IFNAME_ENV, None)
        pg = pg[0] if isinstance(pg, tuple) else pg
    except (RuntimeError, dist.DistStoreError) as e:  # DistStoreError subclasses RuntimeError on new torch
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise SyncTimeout(
                f"weight-update group {group_name!r}: not all {world_size} ranks joined "
                f"tcp://{master_address}:{master_port} within group_timeout={timeout:g} s ({e})"
            ) from e
        raise
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup | None) -> None:
    """Tear a group down; without this gloo aborts the process at exit."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception as e:  # a broken group (peer died) may fail to destroy cleanly; nothing left to do
        logger.debug("destroying weight-update group failed: %s", e)
