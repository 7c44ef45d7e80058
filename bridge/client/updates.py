"""The weight-update routes of :class:`bridge.client.ServerClient` (group, broadcast, tensors, disk), each spoken
in the server's SGLang dialect. A mixin: it uses the client's connection, features, run fields and flush rule
(:mod:`bridge.client.server`); split off to keep that module readable.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.protocol import DEFAULT_GROUP_NAME, SHM_LOAD_FORMAT, wire_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["WeightUpdateRoutes"]

# The package's name, not this file's: one logger for the whole package.
logger = get_logger(__package__)


class WeightUpdateRoutes:
    """The weight-changing routes of one server (mixed into :class:`bridge.client.ServerClient`)."""

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        timeout: float | None = None,
    ) -> dict:
        """Ask the server to join the custom process group; blocks until the trainer has joined too.

        Send it from a thread (or ``ServerGroup.submit``) and join the group on the trainer side
        concurrently (:func:`bridge.process_group.init_custom_process_group`, rank 0).
        """
        body = dict(
            master_address=master_address, master_port=int(master_port), rank_offset=int(rank_offset),
            world_size=int(world_size), group_name=group_name, backend=backend,
        )
        return self._http.call("POST", "/init_weights_update_group", body, timeout=timeout)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str | torch.dtype],
        shapes: Sequence[Sequence[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
        wsync_delta: dict | None = None,
    ) -> dict:
        """Announce one broadcast request; the trainer broadcasts the tensors concurrently.

        Per tensor (``load_format=None``): one ``dist.broadcast(src=0)`` per tensor in ``names`` order.
        ``load_format="flattened_bucket"``: one uint8 buffer (:mod:`bridge.buckets` layout).
        ``wsync_delta`` (reference server only): the buffer is a delta bucket and this its table
        (:mod:`bridge.encodings.delta_send`).

        Raises:
            ConfigError: the server's version cannot take this request (checked before sending, so the
                trainer does not start a broadcast nobody receives).
        """
        names = [str(n) for n in names]
        dtypes = [wire_dtype(d) for d in dtypes]
        shapes = [[int(x) for x in s] for s in shapes]
        if not len(names) == len(dtypes) == len(shapes):
            raise ConfigError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        f = self.features
        if load_format is not None and load_format != "flattened_bucket":
            raise ConfigError(f"load_format must be None or 'flattened_bucket', got {load_format!r}")
        if load_format == "flattened_bucket" and not f.flattened_bucket:
            raise ConfigError(
                f"{self.url} runs SGLang {f.version}, which has no load_format='flattened_bucket' (needs >= 0.5.6); "
                "send one broadcast per tensor (load_format=None)"
            )
        if f.batched_distributed:
            body: dict[str, Any] = dict(
                names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                flush_cache=self._flush(flush_cache), abort_all_requests=abort_all_requests,
            )
        else:
            if len(names) != 1:
                raise ConfigError(f"{self.url} runs SGLang {f.version}, which takes one tensor per request; got {len(names)}")
            body = dict(name=names[0], dtype=dtypes[0], shape=shapes[0])
        if load_format is not None:
            body["load_format"] = load_format
        if wsync_delta is not None:
            self.require_reference_server("a delta bucket on the weight-update group (wsync_delta)")
            body["wsync_delta"] = wsync_delta
        return self._post_update("/update_weights_from_distributed", body, weight_version, timeout)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str | bytes],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> dict:
        """``/update_weights_from_tensor``: co-located weights, handed over by reference.

        ``serialized_named_tensors`` has one entry per TP rank of the server (bytes are base64-encoded
        here). With real SGLang each entry is SGLang's ``MultiprocessingSerializer`` output for CUDA tensors
        (CUDA IPC). The reference server takes the same payload of same-host CPU tensors (torch's
        ``file_system`` sharing strategy; :mod:`inference_adapter.tensor_payload`), and also the project extension ``load_format="wsync_shm"``: each entry is base64 of the JSON object
        ``{"path": "/dev/shm/...", "nbytes": N, "names": [...], "dtypes": [...], "shapes": [...]}``
        describing a file that holds one flattened bucket (:mod:`bridge.buckets` layout).
        SGLang >= 0.5.21 (and the reference server emulating it) takes it only inside a
        ``begin_weight_update``/``end_weight_update`` session.

        Raises:
            ConfigError: ``load_format="wsync_shm"`` for a server that does not say it is the reference
                server (real SGLang would unpickle the entry in its scheduler and die); nothing is sent.
        """
        if load_format == SHM_LOAD_FORMAT:
            self.require_reference_server(f"load_format={SHM_LOAD_FORMAT!r}")
        if isinstance(serialized_named_tensors, (str, bytes)):
            raise ConfigError("serialized_named_tensors must be a list with one entry per TP rank, not a single string")
        entries = [
            base64.b64encode(e).decode() if isinstance(e, (bytes, bytearray)) else str(e) for e in serialized_named_tensors
        ]
        if not entries:
            raise ConfigError("serialized_named_tensors is empty; it needs one entry per TP rank")
        body: dict[str, Any] = dict(
            serialized_named_tensors=entries, load_format=load_format, flush_cache=self._flush(flush_cache),
            abort_all_requests=abort_all_requests,
        )
        return self._post_update("/update_weights_from_tensor", body, weight_version, timeout)

    def require_reference_server(self, what: str = "the shared-memory extension") -> None:
        """Raise ConfigError unless the server says it is the project's reference server.

        Called before any byte moves: SGLang has no ``wsync_shm`` format and its scheduler dies unpickling such an
        entry; the colocated transport hands real SGLang SGLang's own payload instead.
        """
        if not self.can.extensions:
            raise ConfigError(
                f"{self.url} (SGLang {self.version}) is not the wsync reference server, so it cannot take {what}; "
                "real SGLang takes co-located weights from the colocated transport (transport='colocated'), or use "
                "transport='broadcast' or 'disk'"
            )

    def abort_weight_update(self) -> dict:
        """Project extension, reference server only: ``/wsync/abort_weight_update`` discards the open update
        session without applying anything (real SGLang answers 404: it has no staging to discard)."""
        return self._http.call("POST", "/wsync/abort_weight_update", self._with_run({}))

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Drop the group on the server; on servers without the route (< 0.5.3) a logged no-op."""
        if not self.features.destroy_group:
            msg = f"SGLang {self.version} has no /destroy_weights_update_group; the group stays open on the server"
            logger.warning("%s: %s", self.url, msg)
            return {"success": True, "message": msg}
        return self._http.call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        timeout: float | None = None,
        manifest_sha256: str | None = None,
    ) -> dict:
        """Load an HF checkpoint directory (as seen from the server's host).

        ``manifest_sha256`` (a wsync snapshot's announced manifest digest) goes only to the reference
        server, which verifies the snapshot against it while reading it and refuses a mismatch with
        ``ServerError.reason == SNAPSHOT_INVALID``; real SGLang reads what it is given.
        """
        body: dict[str, Any] = dict(
            model_path=str(model_path), abort_all_requests=abort_all_requests, flush_cache=self._flush(flush_cache),
        )
        if manifest_sha256 is not None and self.can.verifies_snapshots:
            body["wsync_manifest_sha256"] = manifest_sha256
        return self._post_update("/update_weights_from_disk", body, weight_version, timeout)
