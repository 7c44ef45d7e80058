"""``ServerClient``: one server's weight-update API, spoken in that server's SGLang dialect.

See :mod:`bridge.client` for the dialect rules, the keys and the errors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from bridge.client.capabilities import Capabilities
from bridge.client.connection import Connection
from bridge.client.lora import LoraRoutes
from bridge.client.updates import WeightUpdateRoutes
from bridge.errors import BridgeError, ConfigError, ServerError, SessionAlreadyOpen, SyncTimeout
from bridge.log import get_logger
from bridge.protocol import ProtocolFeatures

__all__ = ["ServerClient"]

# The package's name, not this file's: one logger for the whole package.
logger = get_logger(__package__)

_PAUSE_MODES = ("abort", "retract", "in_place")


class ServerClient(WeightUpdateRoutes, LoraRoutes):
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
        self._given_version = version
        self._can: Capabilities | None = None  # learned from the server info (learn)
        self._spec: dict | None = None  # the reference server's weights spec, read once (weights_spec)
        self._paused_mode: str | None = None  # what this client last paused the server with
        self._run: dict[str, Any] = {}  # the project's run fields, see claim_run
        # Weight-changing requests sent (counted before each goes out): a server that does not stage may hold
        # part of a sync's weights as soon as this grew during the sync.
        self.updates_sent = 0
        self._writer: str | None = None  # the project's writer field, see name_writer

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r}, version={self._given_version or (self._can and self._can.version)!r})"

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
    def can(self) -> Capabilities:
        """What this server can do (:class:`bridge.client.capabilities.Capabilities`), learned from its server info
        at the first use, and again by :meth:`learn` (a fleet does when a server may have restarted)."""
        if self._can is None:
            self.learn()
        return self._can  # type: ignore[return-value]

    def learn(self, timeout: float | None = None) -> Capabilities:
        """Read the server info and learn what the server can do now (:attr:`can`).

        Raises:
            ServerError / SyncTimeout: it does not answer, or not as an SGLang server.
        """
        info = self.server_info(timeout)
        version = self._given_version or info.get("version")
        if not version:
            raise ServerError(self.url, "server info has no 'version'; is this an SGLang server?", 200, "/server_info")
        self._can = Capabilities.from_server_info(info, str(version))
        return self._can

    @property
    def version(self) -> str:
        """The server's SGLang version (``/server_info`` ``version``)."""
        return self._given_version or self.can.version

    @property
    def features(self) -> ProtocolFeatures:
        """What this server's protocol version supports."""
        if self._given_version is not None and self._can is None:
            return ProtocolFeatures.from_version(self._given_version)
        return self.can.features

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of this server (its share of the weight-update group's world size)."""
        return self.can.tp_size

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

    def name_writer(self, writer: str | None) -> None:
        """Name the writer (one publisher) of the weight-changing requests that follow (``wsync_writer``, to the
        reference server only, which refuses any other writer while one holds its lease)."""
        self._writer = writer

    def _with_run(self, body: dict) -> dict:
        if (self._run or self._writer) and self.can.extensions:
            body.update(self._run)
            if self._writer is not None:
                body["wsync_writer"] = self._writer
        return body

    def take_writer_lease(self, seconds: float, starts_sync: bool = False, renew_only: bool = False) -> dict:
        """Project extension, reference server only (``/wsync/writer_lease``): take or renew the server for this
        writer (:meth:`name_writer`) for ``seconds`` after its last request; meanwhile it refuses weight changes
        from anyone else. ``starts_sync``: discard a session this writer left open; ``renew_only``: never take.
        Raises ServerError, ``reason`` ANOTHER_WRITER (HTTP 409), naming the run and writer holding the server."""
        body = {"wsync_writer": self._writer, "lease_s": float(seconds), "starts_sync": bool(starts_sync),
                "renew_only": bool(renew_only), "wsync_run_id": self._run.get("wsync_run_id")}
        return self._http.call("POST", "/wsync/writer_lease", body)

    def release_writer_lease(self) -> dict:
        """Project extension, reference server only: end this writer's lease (a no-op when it holds none)."""
        return self._http.call("POST", "/wsync/writer_lease", {"wsync_writer": self._writer, "release": True})

    def server_info(self, timeout: float | None = None) -> dict:
        """``/server_info``; servers older than 0.5.6 answer 404 there and are asked ``/get_server_info``."""
        known = self._given_version is not None or self._can is not None
        first = self.features.server_info_route if known else "/server_info"
        try:
            return self._http.call("GET", first, timeout=timeout)
        except ServerError as e:
            if e.status != 404 or first == "/get_server_info":
                raise
            return self._http.call("GET", "/get_server_info", timeout=timeout)

    def probe(self, timeout: float) -> str:
        """The weight version the server serves, every call within ``timeout`` seconds (what it can do too, the first
        time): whether a server is there to sync, before anything waits on it.

        Raises:
            ServerError / SyncTimeout: it does not answer, or not as an SGLang server.
        """
        if self._can is None:
            self.learn(timeout)
        return str(self.model_info(timeout=timeout).get("weight_version"))

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

    def health_generate(self, timeout: float = 10.0) -> None:
        """``/health_generate``: SGLang answers 200 once it generated a token (the reference server once its model
        loaded).

        Raises:
            ServerError / SyncTimeout: it did not, with its answer.
        """
        self._http.call("GET", "/health_generate", timeout=timeout, text=True)

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

    def pause_generation(self, mode: str = "abort", take_lease: float | None = None, begin_session: bool = False) -> dict:
        """``/pause_generation``; the mode is sent only to servers that know it (>= 0.5.6).

        Reference server only, each in the same request: ``take_lease`` takes this writer's lease for that
        many seconds first (:meth:`take_writer_lease` with ``starts_sync``; refused the same way, with nothing
        paused); ``begin_session`` opens the update session once paused (:meth:`begin_weight_update`; refused
        with the pause lifted again).

        While paused ``in_place`` the requests keep their KV cache, so this client sends every update
        with ``flush_cache=False`` until :meth:`continue_generation` (SGLang < 0.5.22 asserts on the
        refused flush and dies; later ones fail the update).
        """
        if mode not in _PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {_PAUSE_MODES}, got {mode!r}")
        body = {"mode": mode} if self.features.pause_mode else {}
        if take_lease is not None or begin_session:
            if not self.can.writer_lease:
                raise ConfigError(f"{self.url} ({self.can.kind}) takes no writer lease: its pause takes no lease and "
                                  "opens no session")
            self._with_run(body)
            if take_lease is not None:
                body["wsync_lease_s"] = float(take_lease)
            if begin_session:
                body["wsync_begin_session"] = True
        if mode != "abort" and not self.features.pause_mode:
            logger.warning("%s (SGLang %s) has no pause modes; it pauses in abort mode", self.url, self.version)
        out = self._http.call("POST", "/pause_generation", body)
        self._paused_mode = mode if self.features.pause_mode else "abort"
        return out

    def continue_generation(self, release_lease: bool = False) -> dict:
        """``/continue_generation``. ``release_lease`` (reference server only, ignored elsewhere): release this
        writer's lease in the same request, once resumed."""
        body = {"wsync_writer": self._writer, "wsync_release_lease": True} if release_lease and self._writer and self.can.writer_lease else {}
        out = self._http.call("POST", "/continue_generation", body)
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
        self.updates_sent += 1
        out = self._http.call("POST", route, self._with_run(body), timeout=timeout)
        v = body.get("weight_version")
        if v is not None and self._paused_mode is not None and self.features.version_lost_when_paused:
            self.update_weight_version(v, abort_all_requests=False)
        return out

    def _flush(self, flush_cache: bool) -> bool:
        """The ``flush_cache`` to send: never while this client has the server paused in place, nor paused by
        retracting where that version refuses the flush (:attr:`ProtocolFeatures.flush_refused_while_retracted`)."""
        refused = self._paused_mode == "in_place" or (self._paused_mode == "retract"
                                                      and self.features.flush_refused_while_retracted)
        if flush_cache and refused:
            logger.debug("%s: paused (%s), so the update is sent with flush_cache=False", self.url, self._paused_mode)
            return False
        return bool(flush_cache)

    def flush_cache(self) -> str:
        return self._http.call("POST", "/flush_cache", text=True)

    # ------------------------------------------------------------------ sessions and versions

    def begin_weight_update(self) -> dict:
        """Open an update session (SGLang >= 0.5.21); elsewhere a no-op that reports success.

        Raises:
            SessionAlreadyOpen: a session is open already (the server's message says so; neither SGLang nor
                the reference server gives a machine-readable reason for it).
        """
        try:
            return self._session("/begin_weight_update")
        except ServerError as e:
            if "already" in e.message or "end_weight_update" in e.message:
                raise SessionAlreadyOpen(e.server, e.message, e.status, e.route, e.reason) from None
            raise

    def end_weight_update(self) -> dict:
        """Close the update session (SGLang >= 0.5.21; the reference server swaps weights here)."""
        return self._session("/end_weight_update")

    def _session(self, route: str) -> dict:
        """A session route; a server without sessions (< 0.5.21) has nothing to open or close."""
        if not self.features.needs_session:
            return {"success": True, "message": f"SGLang {self.version} needs no update session"}
        return self._http.call("POST", route, self._with_run({}))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """``/update_weight_version`` (SGLang >= 0.5.1)."""
        if not self.features.weight_version:
            raise ConfigError(f"{self.url} runs SGLang {self.version}, which has no weight versions (needs >= 0.5.1)")
        return self._http.call(
            "POST", "/update_weight_version",
            self._with_run({"new_version": str(new_version), "abort_all_requests": abort_all_requests}),
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` rows of a served tensor as (nested) float lists (debug route; every
        SGLang release the client speaks has it, with this body). SGLang answers only for model classes
        with their own ``get_weights_by_name`` (Llama and its kin, not Qwen2), 400 for a name it does not
        know, and one list per data-parallel replica when ``dp_size`` > 1."""
        return self._http.call("POST", "/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)})

    def weights_spec(self) -> dict | None:
        """Project extension: ``/wsync/weights_spec`` of the reference server, ``{"dtype", "model_type",
        "params": {name: {"shape", "dtype"}}, "aliases": {name: served name}}``, asked once per client (a
        server that comes back after the fleet excluded it gets a new client); None for real SGLang, which
        has no route listing its parameters."""
        if not self.can.extensions:
            return None
        if self._spec is None:
            self._spec = self._http.call("GET", "/wsync/weights_spec")
        return self._spec

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict:
        """Project extension, reference server only: ``/wsync/weights_checksum``.

        Returns ``{"weight_version", "checksums": {name: sha256}, "dtypes": {name: str}}`` where each
        checksum is :func:`bridge.digest.tensor_checksum` of the served tensor.
        """
        return self._http.call("POST", "/wsync/weights_checksum", {"names": list(names) if names is not None else None})

    def weights_digest(self, names: Sequence[str]) -> dict:
        """Project extension, reference server only: ``/wsync/weights_checksum`` with ``digest``.

        Returns ``{"weight_version", "run_id", "digest"}``: the sum of :func:`bridge.digest.served_digest_part`
        over the named served tensors (16 hex digits), the version and the run (None: unknown) it serves.
        """
        return self._http.call("POST", "/wsync/weights_checksum", {"names": list(names), "digest": True})

    def close(self) -> None:
        self._http.close()
