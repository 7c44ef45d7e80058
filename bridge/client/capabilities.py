"""What one server can do: :class:`Capabilities`, learned from its server info once per publish.

Real SGLang and the project's reference server speak the same weight-update protocol, but not every server
does everything: the reference server stages a session's buckets where SGLang loads each as it arrives, only
SGLang started with the delta loader takes a delta, only the reference server takes the project's fields and
routes. Everything that differs by server is a field or property of this one object; the code that sends
reads it (``client.can.staged``), and never asks which server it is.

:meth:`bridge.client.ServerClient.learn` reads it from ``/server_info`` (``/get_server_info`` before 0.5.6), once
per server, and again whenever the server may have restarted: a publish's fleet (:class:`bridge.fleet.Fleet`)
makes a new client for a server that answers again after it did not, and learns again what a server that answers
behind the fleet's version can do (it restarted on its base weights, maybe as another release or with other
flags). Not at every probe: SGLang's ``/server_info`` waits for its scheduler, which a server in the middle of an
update does not answer until the update ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.protocol import DELTA_LOADER, ZSTD_SGLANG, ProtocolFeatures

__all__ = ["Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What one server can do (see the module docstring)."""

    version: str
    """Its SGLang version (``version`` in its server info)."""
    features: ProtocolFeatures
    """What its protocol version supports (routes, fields, sessions, pause modes)."""
    extensions: bool = False
    """It takes the project's fields and routes (``wsync_*``: the run and writer of each weight change, the writer
    lease, snapshot manifests, the weights spec and digest, shared-memory payloads, deltas): the reference server
    (``wsync_reference_server`` in its server info). Real SGLang ignores such fields or has no such route."""
    tp_size: int = 1
    """Tensor-parallel ranks: its share of a weight-update group's world size."""
    dp_size: int = 1
    """Data-parallel replicas: ``/get_weights_by_name`` answers one list per replica when there are several."""
    served_dtype: str | None = None
    """The dtype it was started with; None where it does not say (SGLang's ``auto``: the model's own)."""
    disk_roots: tuple[str, ...] | None = None
    """The directories it loads snapshots from (the reference server's ``--disk-roots``); None: any it can read."""
    loaders: tuple[str, ...] = ()
    """The loaders it was started with (SGLang's ``--custom-weight-loader``)."""

    @classmethod
    def from_server_info(cls, info: dict[str, Any], version: str) -> Capabilities:
        """What the server info ``info`` says (``version``: the server's, read from it or given)."""
        loaders = info.get("custom_weight_loader")
        roots = info.get("wsync_disk_roots")
        dtype = info.get("dtype")
        return cls(
            version=str(version), features=ProtocolFeatures.from_version(str(version)),
            extensions=bool(info.get("wsync_reference_server")),
            tp_size=int(info.get("tp_size") or 1), dp_size=int(info.get("dp_size") or 1),
            served_dtype=str(dtype).removeprefix("torch.") if dtype and dtype != "auto" else None,
            disk_roots=tuple(str(r) for r in roots) if isinstance(roots, list) else None,
            loaders=tuple(str(x) for x in loaders) if isinstance(loaders, list) else (),
        )

    @property
    def kind(self) -> str:
        """What it is, for messages: ``the reference server`` or ``SGLang 0.5.23``."""
        return "the reference server" if self.extensions else f"SGLang {self.version}"

    # ------------------------------------------------------------------ weight updates

    @property
    def staged(self) -> bool:
        """It stages a session's buckets and applies them, with their version, only at ``/end_weight_update``
        (the reference server from 0.5.21's dialect on). False: it loads each bucket in place as it arrives
        (real SGLang, and older dialects), so a sync that fails after a bucket leaves it torn."""
        return self.extensions and self.features.needs_session

    @property
    def delta(self) -> str | None:
        """How it takes a delta: ``native`` (the reference server checks the base and applies it while staging),
        ``loader`` (real SGLang started with ``--custom-weight-loader`` :data:`bridge.protocol.DELTA_LOADER`), or
        None (it cannot)."""
        if self.extensions:
            return "native"
        return "loader" if DELTA_LOADER in self.loaders else None

    @property
    def fp8_delta(self) -> bool:
        """It applies an FP8 delta (the reference server; SGLang's loader applies serving-dtype deltas only)."""
        return self.extensions

    @property
    def zstd_records(self) -> bool:
        """It can read zstd-compressed delta records: SGLang requires ``zstandard`` from :data:`ZSTD_SGLANG` on;
        the reference server refuses a record it cannot read with a reason, before it applies anything."""
        return self.extensions or self.features.release >= ZSTD_SGLANG

    @property
    def colocated(self) -> str:
        """How it takes weights from a trainer on its host: ``files`` (the reference server's shared-memory
        files) or ``sglang`` (SGLang's own ``/update_weights_from_tensor`` payload)."""
        return "files" if self.extensions else "sglang"

    @property
    def verifies_snapshots(self) -> bool:
        """It checks a snapshot against its manifest as it reads it (``wsync_manifest_sha256``)."""
        return self.extensions

    # ------------------------------------------------------------------ writers

    @property
    def writer_lease(self) -> bool:
        """It holds itself for one writer (``/wsync/writer_lease``, a pause that takes the lease and opens the
        session), discards the session of a writer that lost it, and refuses a version older than the served
        one unless a new run starts. Real SGLang does none of it: the project's writer lock (a key in etcd)
        stands in."""
        return self.extensions

    @property
    def digests_weights(self) -> bool:
        """It answers the digest of what it serves (``/wsync/weights_digest``); real SGLang's served weights are
        known by the label the publisher recorded for them (:mod:`bridge.publisher.labels`)."""
        return self.extensions

    # ------------------------------------------------------------------ LoRA

    @property
    def lora_replace(self) -> str:
        """How it replaces an adapter under its name: ``one step`` (the reference server's ``wsync_replace``: a
        generation never finds it missing), or ``unload then load`` (real SGLang, which reloads an unloaded name
        from its last path for a generation asking for it in between, and cannot reload a tensors adapter)."""
        return "one step" if self.extensions else "unload then load"

    @property
    def lora_copies_tensors(self) -> bool:
        """It copies the tensors of an adapter loaded from tensors before it answers (the reference server); real
        SGLang keeps the same-host tensors it is handed as the adapter's CPU weights."""
        return self.extensions

    @property
    def lora_over_group(self) -> bool:
        """It loads an adapter broadcast over a weight-update group (``/wsync/load_lora_adapter_from_distributed``)."""
        return self.extensions
