"""``WeightUpdateMeta``: one weight update described as data, the shape AReaL-style trainers pass around.

``engine.upload_weights(meta)`` (see ``trainer.FSDPEngine``) turns it into a publish. ``type`` is the
transport, as ``PublisherConfig(transport=...)`` takes it: ``"broadcast"`` (``"nccl"`` is accepted as an
alias), ``"colocated"``, ``"disk"`` or any other registered one (:mod:`bridge.transports`); the remaining
fields map one to one onto :class:`bridge.publisher.core.PublisherConfig`.

Example:
    >>> meta = WeightUpdateMeta(type="nccl", version=3, servers=["http://127.0.0.1:30000"], bucket_mb=64)
    >>> meta.publisher_config().transport, meta.publisher_config().bucket_mb
    ('broadcast', 64)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bridge.errors import ConfigError
from bridge.publisher.core import PublisherConfig

__all__ = ["WeightUpdateMeta"]


@dataclass(kw_only=True)
class WeightUpdateMeta:
    type: str
    """The transport: ``broadcast`` (alias ``nccl``), ``colocated``, ``disk`` or another registered one."""
    version: int
    """The version this update publishes (strictly increasing)."""
    servers: list[str] = field(default_factory=list)
    """Server URLs (broadcast and colocated: the targets; disk: servers to wait for)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Any other PublisherConfig field (bucket_mb, name_resolve, snapshot_root, experiment, trial, ...)."""

    def __init__(self, *, type: str, version: int, servers=(), **options: Any):
        known = PublisherConfig.keywords()
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown weight-update option(s) {unknown}; known: {sorted(known - {'transport', 'servers'})}")
        self.type, self.version, self.servers, self.options = type, version, list(servers), options

    def publisher_config(self) -> PublisherConfig:
        return PublisherConfig(transport=self.type, servers=self.servers, **self.options)

    def config_key(self) -> tuple:
        """Two metas with the same key can share one publisher (and its process group)."""
        return (self.type, tuple(self.servers), tuple(sorted((k, repr(v)) for k, v in self.options.items())))
