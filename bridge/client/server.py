"""``ServerClient``: one server's weight-update API, spoken in that server's SGLang dialect.

See :mod:`bridge.client` for the dialect rules, the keys and the errors.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import torch

from bridge.client.connection import Connection
from bridge.errors import BridgeError, ConfigError, ServerError, SyncTimeout
from bridge.log import get_logger
from bridge.protocol import DEFAULT_GROUP_NAME, SHM_LOAD_FORMAT, ProtocolFeatures
from bridge.tensors import dtype_to_str

__all__ = ["ServerClient"]

# The package's name, not this file's: log lines keep the logger name they had before the split.
logger = get_logger(__package__)

_PAUSE_MODES = ("abort", "retract", "in_place")


def _wire_dtype(d: str | torch.dtype) -> str:
    # SGLang resolves getattr(torch, name): the bare attribute name, never "torch.bfloat16".
    return dtype_to_str(d) if isinstance(d, torch.dtype) else str(d).removeprefix("torch.")


class ServerClient:
    """One inference server (real SGLang or the reference server).

    Args:
        url: base URL, e.g. ``http://10.0.0.3:30000`` (``host:port`` is accepted).
        api_key: sent as ``Authorization: Bearer <key>`` on the routes SGLang opens with ``--api-key``
            (generate, info, health) and, when no ``admin_api_key`` is given, on the control routes too.
        admin_api_key: the server's ``--admin-api-key``: sent on the control routes (weight updates, pause,
            flush, debug reads), which accept only that key when the server has one.
        timeout: seconds for every call that does not take its own ``timeout``.
        version: the server's SGLang version, to skip the ``/server_info`` lookup (mostly for tests).

    Attributes:
        url: the normalized base URL (no trailing slash); error messages and ``ServerGroup`` use it.
    """

    def __init__(
        self, url: str, *, api_key: str | None = None, admin_api_key: str | None = None, timeout: float = 60.0,
        version: str | None = None,
    ):
        self._http = Connection(url, api_key=api_key, admin_api_key=admin_api_key, timeout=timeout)
        self.url = self._http.url
        self._version = version
        self._info: dict | None = None  # the server info, read once
        self._features: ProtocolFeatures | None = None
        self._tp_size: int | None = None
        self._paused_mode: str | None = None  # what this client last paused the server with
        self._run: dict[str, Any] = {}  # the project's run fields, see claim_run

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r}, version={self._version!r})"

    @property
    def api_key(self) -> str | None:
        return self._http.api_key

    @property
    def admin_api_key(self) -> str | None:
        return self._http.admin_api_key

    @property
    def timeout(self) -> float:
        """Seconds for every call that does not take its own ``timeout``."""
        return self._http.timeout

    # ------------------------------------------------------------------ discovery

    @property
    def version(self) -> str:
        """The server's SGLang version (``/server_info`` ``version``), read once."""
        if self._version is None:
            self._load_server_info()
        return self._version  # type: ignore[return-value]

    @property
    def features(self) -> ProtocolFeatures:
        """What this server's protocol version supports."""
        if self._features is None:
            self._features = ProtocolFeatures.from_version(self.version)
        return self._features

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of this server (its share of the weight-update group's world size)."""
        if self._tp_size is None:
            self._load_server_info()
        return self._tp_size  # type: ignore[return-value]

    @property
    def is_reference_server(self) -> bool:
        """True when the server says it is the project's reference server (``wsync_reference_server`` in
        its server info); real SGLang never does."""
        if self._info is None:
            self._load_server_info()
        return bool((self._info or {}).get("wsync_reference_server"))

    @property
    def stages_updates(self) -> bool:
        """True when the server stages a session's buckets and applies them, with their version, only at
        ``/end_weight_update`` (the reference server from 0.5.21's dialect on). Real SGLang, and older
        dialects, load each bucket as it arrives."""
        return self.is_reference_server and self.features.needs_session

    @property
    def custom_weight_loaders(self) -> list[str]:
        """The loaders real SGLang was started with (``--custom-weight-loader``, in its server info)."""
        if self._info is None:
            self._load_server_info()
        loaders = (self._info or {}).get("custom_weight_loader")
        return [str(x) for x in loaders] if isinstance(loaders, list) else []

    @property
    def disk_roots(self) -> list[str] | None:
        """The directories a reference server loads snapshots from (``wsync_disk_roots`` in its server
        info, resolved); None for real SGLang, which loads any directory it can read."""
        if self._info is None:
            self._load_server_info()
        roots = (self._info or {}).get("wsync_disk_roots")
        return [str(r) for r in roots] if isinstance(roots, list) else None

    def claim_run(self, run_id: str | None, new_run: bool = False) -> None:
        """Say which run the weight-changing requests that follow belong to (project fields).

        The reference server refuses a weight version older than the one it serves unless the request
        starts a new run: ``run_id`` other than the served version's run, or ``new_run=True`` (an explicit
        reset). The fields ``wsync_run_id``/``wsync_new_run`` go only to a server that says it is the
        reference server; real SGLang has no such check, and its request parsing would ignore them anyway.
        """
        self._run = {"wsync_run_id": run_id} if run_id is not None else {}
        if new_run:
            self._run["wsync_new_run"] = True

    def _with_run(self, body: dict) -> dict:
        if self._run and self.is_reference_server:
            body.update(self._run)
        return body

    def _load_server_info(self) -> None:
        info = self.server_info()
        self._info = info
        if self._version is None:
            v = info.get("version")
            if not v:
                raise ServerError(self.url, "server info has no 'version'; is this an SGLang server?", 200, "/server_info")
            self._version = str(v)
        tp = info.get("tp_size") or 1
        self._tp_size = int(tp)

    def server_info(self) -> dict:
        """``/server_info``; servers older than 0.5.6 answer 404 there and are asked ``/get_server_info``."""
        if self._features is not None or self._version is not None:
            return self._http.call("GET", self.features.server_info_route)
        try:
            return self._http.call("GET", "/server_info")
        except ServerError as e:
            if e.status != 404:
                raise
            return self._http.call("GET", "/get_server_info")

    def model_info(self, timeout: float | None = None) -> dict:
        """``/model_info`` (``/get_model_info`` before 0.5.6): carries the served ``weight_version``."""
        return self._http.call("GET", self.features.model_info_route, timeout=timeout)

    def health(self, timeout: float = 5.0) -> bool:
        """True when ``/health`` answers 200 (SGLang's answers 503 while paused or busy updating)."""
        try:
            self._http.call("GET", "/health", timeout=timeout)
            return True
        except BridgeError:
            return False

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> dict:
        """Poll ``/model_info`` until it answers 200; return it.

        Raises:
            SyncTimeout: not ready within ``timeout`` seconds (the message carries the last error).
        """
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                return self.model_info(timeout=max(0.5, min(10.0, left)))
            except BridgeError as e:
                last = e
            if time.monotonic() + interval > deadline:
                raise SyncTimeout(f"{self.url} not ready within {timeout:g} s (last error: {last})")
            time.sleep(interval)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool = False,
        *,
        timeout: float | None = None,
        **extra: Any,
    ) -> dict | list[dict]:
        """``POST /generate``; a list of results for batched input."""
        if (text is None) == (input_ids is None):
            raise ConfigError("generate needs exactly one of text= or input_ids=")
        body: dict[str, Any] = {"text": text} if text is not None else {"input_ids": input_ids}
        body["sampling_params"] = sampling_params or {}
        if return_logprob:
            body["return_logprob"] = True
        body.update(extra)
        return self._http.call("POST", "/generate", body, timeout=timeout)

    def pause_generation(self, mode: str = "abort") -> dict:
        """``/pause_generation``; the mode is sent only to servers that know it (>= 0.5.6).

        While paused ``in_place`` the requests keep their KV cache, so this client sends every update
        with ``flush_cache=False`` until :meth:`continue_generation` (SGLang < 0.5.22 asserts on the
        refused flush and dies; later ones fail the update).
        """
        if mode not in _PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {_PAUSE_MODES}, got {mode!r}")
        body = {"mode": mode} if self.features.pause_mode else {}
        if mode != "abort" and not self.features.pause_mode:
            logger.warning("%s (SGLang %s) has no pause modes; it pauses in abort mode", self.url, self.version)
        out = self._http.call("POST", "/pause_generation", body)
        self._paused_mode = mode if self.features.pause_mode else "abort"
        return out

    def continue_generation(self) -> dict:
        out = self._http.call("POST", "/continue_generation", {})
        self._paused_mode = None
        return out

    def _post_update(self, route: str, body: dict, weight_version: str | None, timeout: float | None) -> dict:
        """Send a weight-changing request, with what every such request carries in this server's dialect.

        The ``weight_version`` goes only to a server that tracks versions (>= 0.5.1; older ones are told
        nothing, with a warning), the run fields only to the reference server (:meth:`claim_run`). SGLang
        0.5.6 drops the version of an update made while paused (its tokenizer side skips the recording;
        0.5.1-0.5.5 record it in the HTTP route, 0.5.7 fixed it), so there it is set again explicitly.
        """
        if weight_version is not None:
            if self.features.weight_version:
                body["weight_version"] = str(weight_version)
            else:
                logger.warning("%s (SGLang %s) does not track weight versions; %r not sent", self.url, self.version, weight_version)
        out = self._http.call("POST", route, self._with_run(body), timeout=timeout)
        v = body.get("weight_version")
        if v is not None and self._paused_mode is not None and self.features.version_lost_when_paused:
            self.update_weight_version(v, abort_all_requests=False)
        return out

    def _flush(self, flush_cache: bool) -> bool:
        """The ``flush_cache`` to send: never while this client has the server paused in place."""
        if flush_cache and self._paused_mode == "in_place":
            logger.debug("%s: paused in place, so the update is sent with flush_cache=False", self.url)
            return False
        return bool(flush_cache)

    def flush_cache(self) -> str:
        return self._http.call("POST", "/flush_cache", text=True)

    # ------------------------------------------------------------------ weight updates

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
        dtypes = [_wire_dtype(d) for d in dtypes]
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
        (CUDA IPC; CPU tensors cannot cross HTTP, SGLang issue #4551). The reference server instead takes the
        project extension ``load_format="wsync_shm"``: each entry is base64 of the JSON object
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

        The colocated transport calls this before any byte moves: SGLang has no ``wsync_shm`` format and
        its scheduler dies unpickling such an entry; with real SGLang use CUDA IPC on a GPU host.
        """
        if not self.is_reference_server:
            raise ConfigError(
                f"{self.url} (SGLang {self.version}) is not the wsync reference server, so it cannot take {what}; "
                "real SGLang takes co-located weights only as CUDA IPC handles on a GPU (use transport='broadcast' "
                "or 'disk' here)"
            )

    def abort_weight_update(self) -> dict:
        """Project extension, reference server only: ``/wsync/abort_weight_update`` discards the open update
        session without applying anything (real SGLang answers 404: it has no staging to discard)."""
        return self._http.call("POST", "/wsync/abort_weight_update", {})

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
        if manifest_sha256 is not None and self.is_reference_server:
            body["wsync_manifest_sha256"] = manifest_sha256
        return self._post_update("/update_weights_from_disk", body, weight_version, timeout)

    def begin_weight_update(self) -> dict:
        """Open an update session (SGLang >= 0.5.21); elsewhere a no-op that reports success."""
        if not self.features.needs_session:
            return self._no_session()
        return self._http.call("POST", "/begin_weight_update", self._with_run({}))

    def end_weight_update(self) -> dict:
        """Close the update session (SGLang >= 0.5.21; the reference server swaps weights here)."""
        if not self.features.needs_session:
            return self._no_session()
        return self._http.call("POST", "/end_weight_update", {})

    def _no_session(self) -> dict:
        """The answer of a session route on a server without sessions (< 0.5.21), which has nothing to open."""
        return {"success": True, "message": f"SGLang {self.version} needs no update session"}

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """``/update_weight_version`` (SGLang >= 0.5.1)."""
        if not self.features.weight_version:
            raise ConfigError(f"{self.url} runs SGLang {self.version}, which has no weight versions (needs >= 0.5.1)")
        return self._http.call(
            "POST", "/update_weight_version",
            self._with_run({"new_version": str(new_version), "abort_all_requests": abort_all_requests}),
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of a served tensor as (nested) float lists (debug route)."""
        return self._http.call("POST", "/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)})

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict:
        """Project extension, reference server only: ``/wsync/weights_checksum``.

        Returns ``{"weight_version", "checksums": {name: sha256}, "dtypes": {name: str}}`` where each
        checksum is :func:`bridge.protocol.tensor_checksum` of the served tensor.
        """
        return self._http.call("POST", "/wsync/weights_checksum", {"names": list(names) if names is not None else None})

    def close(self) -> None:
        self._http.close()
