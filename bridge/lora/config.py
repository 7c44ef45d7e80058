"""What an :class:`~bridge.lora.publisher.AdapterPublisher` is configured with, where it announces, and what one publish
returns."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from bridge.config import Fleet, RunIdentity, Timeouts
from bridge.errors import ConfigError
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL
from bridge.tensors import dtype_from_str
from bridge.transports.base import SessionOptions

__all__ = ["VIAS", "AdapterPublishResult", "AdapterPublisherConfig", "adapter_key"]

VIAS = ("disk", "tensors", "broadcast")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def adapter_key(experiment: str, trial: str, name: str, version: int, root: str = "wsync") -> str:
    """``<root>/<experiment>/<trial>/lora_adapters/<name>/<version>``: the announcement of one adapter version
    (a JSON object: ``name``, ``version``, ``path``, ``checksums``)."""
    from bridge.name_resolve import names

    return f"{names.trial_root(experiment, trial, root)}/lora_adapters/{name}/{version}"


@dataclass(kw_only=True, slots=True)
class AdapterPublisherConfig:
    """Where and how an adapter goes. Checked when built."""

    name: str
    """The adapter's stable name on the servers (SGLang's ``lora_name``; what ``lora_path`` asks for)."""
    via: str = "disk"
    """``disk`` (a PEFT adapter directory, any host that sees ``root``), ``tensors`` (servers on this host) or
    ``broadcast`` (reference servers on any host, over a weight-update group)."""
    servers: Sequence[str] = ()
    """Base URLs of the servers that serve the adapter."""
    server_registry: str | Sequence[str] | None = None
    """Where more servers are found, read again at every publish, as ``PublisherConfig.server_registry``
    (``etcd://``, ``file:///dir``, ``router+http://``; servers registered for ``experiment``/``trial``)."""
    min_servers: int = 1
    """With servers or a registry: a publish fails (before anything is loaded) when fewer servers answer."""
    probe_timeout: float = 5.0
    """Seconds each server has to answer the probe before every publish (at most ``http_timeout``); one that does
    not is excluded from that publish, as from a full one."""
    root: str | None = None
    """Disk: the folder of the adapter directories, ``<root>/<name>/v<version>`` (default: a folder under
    the temporary directory, per experiment and trial)."""
    keep: int = 3
    """Disk: adapter directories kept, the newest ones (at least 2: the previous one is the way back)."""
    name_resolve: str | None = None
    """Disk: where versions are announced (etcd://, file://, memory://; default: the project's default)."""
    experiment: str = DEFAULT_EXPERIMENT
    trial: str = DEFAULT_TRIAL
    dtype: str | None = None
    """The dtype the adapter travels and is served in (default: the trainer's, float32)."""
    http_timeout: float = 60.0
    """Seconds one server call may take."""
    gather_timeout: float = 120.0
    """Seconds the gather step may take on every rank."""
    api_key: str | None = None
    admin_api_key: str | None = None
    group_timeout: float = 60.0
    """Broadcast: seconds for the group's rendezvous and for each broadcast."""
    master_address: str | None = None
    """Broadcast: this host's address as the servers reach it (default: 127.0.0.1 with local servers only, else the
    address of the interface that routes to them)."""
    master_port: int | None = None
    """Broadcast: the group's rendezvous port (default: a free one)."""
    writer_lease: float = 10.0
    """Seconds each server stays reserved for this publisher after its last word, renewed while a publish runs, as
    ``PublisherConfig.writer_lease``: while one trainer publishes, another one's adapter publish is refused."""
    writer_lock: str | None = None
    """Name resolution (``etcd://``, ``file://``) holding a lock per server, for servers without the reference
    server's writer lease (real SGLang), as ``PublisherConfig.writer_lock``."""
    backend: str | None = None
    """Broadcast: ``gloo`` or ``nccl`` (default: :func:`bridge.process_group.default_backend`; the reference server
    on CPU takes gloo)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"adapter name must be letters, digits, '.', '_' or '-' (a path component), got {self.name!r}")
        if self.via not in VIAS:
            raise ConfigError(f"via must be one of {', '.join(VIAS)} (an adapter goes by disk, on one host by tensors, "
                              f"or to reference servers by broadcast), got {self.via!r}")
        # The full publisher's groups check the settings they share, with the same messages.
        fleet = Fleet(servers=self.servers, server_registry=self.server_registry, min_servers=self.min_servers,
                      probe_timeout=self.probe_timeout)
        self.servers = list(fleet.servers)
        registry = fleet.server_registry
        self.server_registry = ([registry] if isinstance(registry, str) else list(registry)) if registry else None
        Timeouts(http_timeout=self.http_timeout, group_timeout=self.group_timeout)
        RunIdentity(experiment=self.experiment, trial=self.trial)
        SessionOptions(writer_lease=self.writer_lease, writer_lock=self.writer_lock)
        if self.via in ("tensors", "broadcast") and not self.servers and not self.server_registry:
            raise ConfigError(f"via={self.via!r} sends the adapter to servers: give servers=[URL, ...] or "
                              "server_registry=URL")
        self._check_broadcast()
        if self.keep < 2:
            raise ConfigError(f"keep must be >= 2 (the previous adapter is what a failed publish goes back to), got {self.keep}")
        if self.dtype is not None:
            dtype_from_str(self.dtype)  # raises ConfigError naming the dtype
        if not self.gather_timeout > 0:
            raise ConfigError(f"gather_timeout must be a positive number of seconds, got {self.gather_timeout}")
        if self.root is None:
            import tempfile

            self.root = os.path.join(tempfile.gettempdir(), f"wsync_{os.getuid()}", "adapters", self.experiment, self.trial)

    def _check_broadcast(self) -> None:
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend must be gloo or nccl (or None: nccl with CUDA, gloo without), got {self.backend!r}")
        if self.master_port is not None and (isinstance(self.master_port, bool) or not isinstance(self.master_port, int)
                                             or not 0 < self.master_port < 65536):
            raise ConfigError(f"master_port must be a port number (1-65535), got {self.master_port!r}")
        if self.master_address is not None and not str(self.master_address).strip():
            raise ConfigError("master_address must not be empty (leave it out: 127.0.0.1 for servers on this host, "
                              "else this host's address on the way to them)")


@dataclass(frozen=True, slots=True)
class AdapterPublishResult:
    """What one adapter publish did (the same on every rank)."""

    name: str
    version: int
    via: str
    bytes: int
    seconds: float
    path: str | None
    """Disk: the adapter directory the servers loaded."""
    checksums: dict[str, str]
    """sha256 of every tensor as sent (:func:`bridge.digest.tensor_checksum`)."""
    phases: dict[str, float]
    """Seconds of each step on this rank (rank 0's: the gather, the write, the servers' loads...)."""
    retried: bool = False
    """The last version published again with the same weights: the servers already served it, nothing was loaded."""
