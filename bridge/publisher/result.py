"""What one ``publish()`` returns: :class:`PublishResult` (re-exported by :mod:`bridge.publisher.core`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PublishResult"]


@dataclass
class PublishResult:
    """What one publish did. ``servers`` maps each server URL to ``"ok"`` or its error message."""

    version: int
    transport: str
    bytes: int
    seconds: float
    buckets: int = 0
    servers: dict[str, str] = field(default_factory=dict)
    path: str | None = None
    retried: bool = False
    peak_extra_bytes: int = 0
    """Rank 0's peak extra host (or device) memory during the transfer, measured."""
    phases: dict[str, float] = field(default_factory=dict)
    encoding: str = "full"  # what was sent: full, delta, or anchor (a full sync of the delta encoding)
    anchor_reason: str | None = None  # why a delta publisher sent an anchor
    changed_fraction: float | None = None  # delta encoding: the fraction of the elements changed since the base
    base_bytes: int = 0  # delta encoding: this rank's memory for its base (its shard in the serving dtype)

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second) of the bytes on the wire."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d
