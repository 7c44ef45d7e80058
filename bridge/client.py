"""HTTP client for SGLang's weight-update API: one server (:class:`ServerClient`) or many (:class:`ServerGroup`).

A real SGLang server and the project's reference server look the same to the caller. The client reads
the server's SGLang version once (``/server_info`` ``version``, or ``/get_server_info`` on servers older
than 0.5.6, which have no ``/server_info``) and speaks that version's dialect
(:class:`bridge.protocol.ProtocolFeatures`): it uses the info routes the server has, omits fields an old
server does not know, turns ``begin/end_weight_update`` into no-ops where sessions do not exist, never
asks for a cache flush while generations are paused in place (SGLang asserts or fails there), and
refuses up front what the server cannot do (a flattened bucket for a server older than 0.5.6; the
project's shared-memory extension for a server that is not the reference server), so the trainer
learns it before it starts a broadcast.

Keys follow SGLang's ``srt/utils/auth.py``: the control routes (:data:`bridge.protocol.ADMIN_ROUTES`)
carry ``admin_api_key`` when one is given, every other route carries ``api_key``.

Errors are the project's own (:mod:`bridge.errors`): an HTTP error or ``success: false`` raises
``ServerError(server, message, status, route)`` with the server's message; a connection failure raises
``ServerError`` with ``status=None``; an answer that does not come within the call's timeout raises
``SyncTimeout`` naming the server and route.

Example:
    >>> c = ServerClient("http://127.0.0.1:30000")                      # doctest: +SKIP
    >>> c.features.needs_session                                         # doctest: +SKIP
    True
    >>> group = ServerGroup(["127.0.0.1:30000", "127.0.0.1:30001"])     # doctest: +SKIP
    >>> group.rank_offsets(), group.world_size()                         # doctest: +SKIP
    ([1, 2], 3)
    >>> group.weight_versions()                                          # doctest: +SKIP
    {'http://127.0.0.1:30000': 'default', 'http://127.0.0.1:30001': 'default'}
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import requests
import torch

from bridge.errors import BridgeError, ConfigError, ServerError, SyncTimeout, VersionError
from bridge.log import get_logger
from bridge.protocol import ADMIN_ROUTES, DEFAULT_GROUP_NAME, SHM_LOAD_FORMAT, VERSION_GOES_BACK, ProtocolFeatures
from bridge.tensors import dtype_to_str

__all__ = ["ServerClient", "ServerGroup"]

logger = get_logger(__name__)
T = TypeVar("T")

_PAUSE_MODES = ("abort", "retract", "in_place")


def _normalize_url(url: str) -> str:
    url = str(url).strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


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
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        self.url = _normalize_url(url)
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self._info: dict | None = None
        self._paused_mode: str | None = None  # what this client last paused the server with
        self.timeout = float(timeout)
        self._version = version
        self._features: ProtocolFeatures | None = None
        self._tp_size: int | None = None
        self._run: dict[str, Any] = {}  # the project's run fields, see claim_run
        self._local = threading.local()  # one requests.Session per thread: Session is not thread-safe

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r}, version={self._version!r})"

    # ------------------------------------------------------------------ transport

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            self._local.session = s
        return s

    def _headers(self, route: str) -> dict[str, str]:
        key = self.admin_api_key if (route in ADMIN_ROUTES and self.admin_api_key) else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _call(
        self,
        method: str,
        route: str,
        body: dict | None = None,
        *,
        timeout: float | None = None,
        text: bool = False,
        check_success: bool = True,
    ) -> Any:
        """One HTTP call; returns the decoded JSON (or text) or raises ServerError/SyncTimeout."""
        t = self.timeout if timeout is None else float(timeout)
        try:
            r = self._session().request(method, self.url + route, json=body, headers=self._headers(route),
                                        timeout=(min(t, 10.0), t))
        except requests.exceptions.ConnectTimeout as e:
            raise ServerError(self.url, f"cannot connect: {e}", None, route) from e
        except requests.exceptions.Timeout as e:
            raise SyncTimeout(f"{self.url}{route}: no answer within {t:g} s (http_timeout; raise it if the server is only slow)") from e
        except requests.exceptions.RequestException as e:
            raise ServerError(self.url, f"cannot reach server: {e}", None, route) from e
        try:
            data = r.json() if r.content else None
        except ValueError:
            data = None
        if not 200 <= r.status_code < 300:
            reason = data.get("wsync_reason") if isinstance(data, dict) else None
            if reason == VERSION_GOES_BACK:
                raise VersionError(
                    f"{self.url}{route}: {_message(data, r)} (a trainer starts a new run with "
                    "PublisherConfig(new_run=True), `wsync train --new-run`, or another experiment/trial)")
            raise ServerError(self.url, _message(data, r), r.status_code, route, reason=reason if isinstance(reason, str) else None)
        if check_success and isinstance(data, dict) and data.get("success") is False:
            raise ServerError(self.url, _message(data, r), r.status_code, route)
        if text:
            return r.text
        return data

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
            return self._call("GET", self.features.server_info_route)
        try:
            return self._call("GET", "/server_info")
        except ServerError as e:
            if e.status != 404:
                raise
            return self._call("GET", "/get_server_info")

    def model_info(self, timeout: float | None = None) -> dict:
        """``/model_info`` (``/get_model_info`` before 0.5.6): carries the served ``weight_version``."""
        return self._call("GET", self.features.model_info_route, timeout=timeout)

    def health(self, timeout: float = 5.0) -> bool:
        """True when ``/health`` answers 200 (SGLang's answers 503 while paused or busy updating)."""
        try:
            self._call("GET", "/health", timeout=timeout)
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
        return self._call("POST", "/generate", body, timeout=timeout)

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
        out = self._call("POST", "/pause_generation", body)
        self._paused_mode = mode if self.features.pause_mode else "abort"
        return out

    def continue_generation(self) -> dict:
        out = self._call("POST", "/continue_generation", {})
        self._paused_mode = None
        return out

    def _record_version(self, out: Any, body: dict) -> Any:
        """SGLang 0.5.6 drops the version of an update made while paused (its tokenizer side skips the
        recording; 0.5.1-0.5.5 record it in the HTTP route, 0.5.7 fixed it): set it explicitly."""
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
        return self._call("POST", "/flush_cache", text=True)

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
        return self._call("POST", "/init_weights_update_group", body, timeout=timeout)

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
    ) -> dict:
        """Announce one broadcast request; the trainer broadcasts the tensors concurrently.

        Per tensor (``load_format=None``): one ``dist.broadcast(src=0)`` per tensor in ``names`` order.
        ``load_format="flattened_bucket"``: one uint8 buffer (:mod:`bridge.buckets` layout).

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
        if weight_version is not None:
            if f.weight_version:
                body["weight_version"] = str(weight_version)
            else:
                logger.warning("%s (SGLang %s) does not track weight versions; %r not sent", self.url, f.version, weight_version)
        return self._record_version(
            self._call("POST", "/update_weights_from_distributed", self._with_run(body), timeout=timeout), body)

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
        if weight_version is not None:
            if self.features.weight_version:
                body["weight_version"] = str(weight_version)
            else:
                logger.warning("%s (SGLang %s) does not track weight versions; %r not sent", self.url, self.features.version, weight_version)
        return self._record_version(
            self._call("POST", "/update_weights_from_tensor", self._with_run(body), timeout=timeout), body)

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
        return self._call("POST", "/wsync/abort_weight_update", {})

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Drop the group on the server; on servers without the route (< 0.5.3) a logged no-op."""
        if not self.features.destroy_group:
            msg = f"SGLang {self.version} has no /destroy_weights_update_group; the group stays open on the server"
            logger.warning("%s: %s", self.url, msg)
            return {"success": True, "message": msg}
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

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
        if weight_version is not None:
            if self.features.weight_version:
                body["weight_version"] = str(weight_version)
            else:
                logger.warning("%s (SGLang %s) does not track weight versions; %r not sent", self.url, self.version, weight_version)
        out = self._call("POST", "/update_weights_from_disk", self._with_run(body), timeout=timeout)
        return self._record_version(out, body)

    def begin_weight_update(self) -> dict:
        """Open an update session (SGLang >= 0.5.21); elsewhere a no-op that reports success."""
        if not self.features.needs_session:
            return {"success": True, "message": f"SGLang {self.version} needs no update session"}
        return self._call("POST", "/begin_weight_update", self._with_run({}))

    def end_weight_update(self) -> dict:
        """Close the update session (SGLang >= 0.5.21; the reference server swaps weights here)."""
        if not self.features.needs_session:
            return {"success": True, "message": f"SGLang {self.version} needs no update session"}
        return self._call("POST", "/end_weight_update", {})

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """``/update_weight_version`` (SGLang >= 0.5.1)."""
        if not self.features.weight_version:
            raise ConfigError(f"{self.url} runs SGLang {self.version}, which has no weight versions (needs >= 0.5.1)")
        return self._call(
            "POST", "/update_weight_version",
            self._with_run({"new_version": str(new_version), "abort_all_requests": abort_all_requests}),
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of a served tensor as (nested) float lists (debug route)."""
        return self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)})

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict:
        """Project extension, reference server only: ``/wsync/weights_checksum``.

        Returns ``{"weight_version", "checksums": {name: sha256}, "dtypes": {name: str}}`` where each
        checksum is :func:`bridge.protocol.tensor_checksum` of the served tensor.
        """
        return self._call("POST", "/wsync/weights_checksum", {"names": list(names) if names is not None else None})

    def close(self) -> None:
        s = getattr(self._local, "session", None)
        if s is not None:
            s.close()
            self._local.session = None


def _message(data: Any, r: requests.Response) -> str:
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            v = data.get(key)
            if isinstance(v, dict):
                v = v.get("message") or v
            if v:
                return str(v)
    text = (r.text or "").strip()
    if r.status_code == 404 and not text.startswith("{"):
        return f"route not found ({text or 'Not Found'})"
    return text[:2000] or f"HTTP {r.status_code} without a body"


class ServerGroup:
    """A set of servers that receive the same weights; each call fans out to all of them concurrently.

    Rank layout of the weight-update group: the trainer is rank 0, server ``i`` takes ranks
    ``rank_offsets()[i] .. + tp_size - 1``, ``world_size() = 1 + sum(tp_size)``.

    Args:
        servers: URLs or ready :class:`ServerClient` objects, in rank order.
        api_key: for URLs given as strings.
        admin_api_key: for URLs given as strings: the servers' ``--admin-api-key`` (control routes).
        timeout: per-call timeout for clients built from URLs.
    """

    def __init__(
        self, servers: Sequence[str | ServerClient], *, api_key: str | None = None, admin_api_key: str | None = None,
        timeout: float = 60.0,
    ):
        if not servers:
            raise ConfigError("a ServerGroup needs at least one server")
        self.clients: list[ServerClient] = [
            s if isinstance(s, ServerClient) else ServerClient(s, api_key=api_key, admin_api_key=admin_api_key, timeout=timeout)
            for s in servers
        ]
        urls = [c.url for c in self.clients]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"a server is listed twice: {urls}")
        self._pool = cf.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)), thread_name_prefix="wsync-http")

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
