"""The HTTP side of one server: a session per thread, the key each route takes, failures as the project's errors.

:class:`bridge.client.ServerClient` decides what to send (the server's dialect); this module only sends
it and turns what comes back into JSON or one of :mod:`bridge.errors`.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import requests

from bridge.errors import ConfigError, ServerError, ServerUnreachable, SyncTimeout, VersionError
from bridge.protocol import ADMIN_ROUTES, VERSION_GOES_BACK

__all__ = ["Connection"]

# A server that does not accept the connection within this many seconds is down, whatever the call's timeout.
_CONNECT_TIMEOUT_S = 10.0
IDLE_REUSE_S = 2.0
"""A thread's connection idle for longer is replaced by a new one: SGLang (uvicorn, ``SGLANG_TIMEOUT_KEEP_ALIVE``)
and the reference server close a keep-alive connection after 5 s idle, and a request sent on it as it closes
is reset (a publish after a training step of about 5 s)."""


class Connection:
    """HTTP calls to one server's base URL.

    Args:
        url: base URL, e.g. ``http://10.0.0.3:30000`` (``host:port`` and a trailing slash are accepted).
        api_key: sent as ``Authorization: Bearer <key>`` on every route that is not a control route, and
            on the control routes too when no ``admin_api_key`` is given.
        admin_api_key: sent on the control routes (:data:`bridge.protocol.ADMIN_ROUTES`), as SGLang's
            ``srt/utils/auth.py`` expects.
        timeout: seconds for every call that does not take its own ``timeout``.

    Attributes:
        url: the normalized base URL (no trailing slash).
    """

    def __init__(self, url: str, *, api_key: str | None, admin_api_key: str | None, timeout: float):
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        self.url = _normalize_url(url)
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeout = float(timeout)
        self._local = threading.local()  # one requests.Session per thread: Session is not thread-safe

    def call(
        self,
        method: str,
        route: str,
        body: dict | None = None,
        *,
        timeout: float | None = None,
        text: bool = False,
        check_success: bool = True,
    ) -> Any:
        """One HTTP call; the decoded JSON (or, with ``text``, the body as text).

        Raises:
            ServerError: the server is unreachable (``status=None``), answers an HTTP error, or answers
                ``success: false`` (unless ``check_success`` is False); with the server's message.
            VersionError: the reference server refused a weight version older than the served one.
            SyncTimeout: no answer within ``timeout`` (default: this connection's).
        """
        t = self.timeout if timeout is None else float(timeout)
        try:
            r = self._session().request(method, self.url + route, json=body, headers=self._headers(route),
                                        timeout=(min(t, _CONNECT_TIMEOUT_S), t))
            self._local.used = time.monotonic()
        except requests.exceptions.ConnectTimeout as e:
            raise ServerError(self.url, f"cannot connect: {e}", None, route) from e
        except requests.exceptions.Timeout as e:
            raise SyncTimeout(f"{self.url}{route}: no answer within {t:g} s (http_timeout; raise it if the server is only slow)") from e
        except requests.exceptions.ConnectionError as e:
            raise unreachable(self.url, route, e) from e
        except requests.exceptions.RequestException as e:
            raise ServerError(self.url, f"cannot reach server: {e}", None, route) from e
        try:
            data = r.json() if r.content else None
        except ValueError:
            data = None
        if not 200 <= r.status_code < 300:
            raise self._refusal(route, data, r)
        if check_success and isinstance(data, dict) and data.get("success") is False:
            raise ServerError(self.url, _message(data, r), r.status_code, route)
        return r.text if text else data

    def close(self) -> None:
        """Close this thread's session (another thread's closes with its thread)."""
        s = getattr(self._local, "session", None)
        if s is not None:
            s.close()
            self._local.session = None

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is not None and time.monotonic() - getattr(self._local, "used", 0.0) > IDLE_REUSE_S:
            s.close()  # its connection may be closing on the server's side (IDLE_REUSE_S)
            s = None
        if s is None:
            s = requests.Session()
            self._local.session = s
        return s

    def _headers(self, route: str) -> dict[str, str]:
        key = self.admin_api_key if (route in ADMIN_ROUTES and self.admin_api_key) else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _refusal(self, route: str, data: Any, r: requests.Response) -> ServerError | VersionError:
        """The error for an HTTP error answer; the reference server's ``wsync_reason`` says which."""
        reason = data.get("wsync_reason") if isinstance(data, dict) else None
        if reason == VERSION_GOES_BACK:
            return VersionError(
                f"{self.url}{route}: {_message(data, r)} (a trainer starts a new run with "
                "PublisherConfig(new_run=True), `wsync train --new-run`, or another experiment/trial)")
        return ServerError(self.url, _message(data, r), r.status_code, route, reason=reason if isinstance(reason, str) else None)


def _normalize_url(url: str) -> str:
    url = str(url).strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


MESSAGE_CHARS = 1000
"""A server's message is cut to this many characters (a refused body may be echoed whole, payload and all)."""
_VALIDATION = re.compile(r"^\d+ validation errors?:")
_FIELD = re.compile(r"'loc': \(([^)]*)\), 'msg': '([^']*)'")


def _message(data: Any, r: requests.Response) -> str:
    """The server's own words: SGLang answers ``message`` (``error_message`` on its LoRA routes), FastAPI
    ``detail``, others ``error``."""
    if isinstance(data, dict):
        for key in ("message", "error_message", "error", "detail"):
            v = data.get(key)
            if isinstance(v, dict):
                v = v.get("message") or v
            if v:
                return _brief(v)
    text = (r.text or "").strip()
    if r.status_code == 404 and not text.startswith("{"):
        return f"route not found ({text or 'Not Found'})"
    return _brief(text) or f"HTTP {r.status_code} without a body"


def _brief(v: Any) -> str:
    """``v`` as one readable message: a request validation error as ``field: problem`` for each field, without the
    ``input`` it echoes (FastAPI lists them in ``detail``; SGLang's app writes them as text, one dict per line);
    anything else cut to :data:`MESSAGE_CHARS`."""
    fields = None
    if isinstance(v, list) and v and all(isinstance(e, dict) and "loc" in e and "msg" in e for e in v):
        fields = [(".".join(map(str, e["loc"])), e["msg"]) for e in v]
    elif isinstance(v, str) and _VALIDATION.match(v):
        fields = [(".".join(p.strip(" '\"") for p in loc.split(",") if p.strip()), msg) for loc, msg in _FIELD.findall(v)]
    if fields:
        return "request refused: " + "; ".join(f"{loc}: {msg}" for loc, msg in fields)
    text = str(v)
    return text if len(text) <= MESSAGE_CHARS else f"{text[:MESSAGE_CHARS]}... ({len(text)} characters)"


def unreachable(url: str, route: str | None, e: BaseException) -> ServerUnreachable:
    """One line for a connection that could not be made: the cause (from the innermost OS error, not
    urllib3's report, which repeats the URL), then the fix; urllib3's text only with --debug / WSYNC_DEBUG=1."""
    import socket

    from bridge.log import debug_enabled

    cause, seen, x = None, set(), e
    while x is not None and id(x) not in seen and cause is None:
        seen.add(id(x))
        for a in (x, *getattr(x, "args", ())):
            if isinstance(a, ConnectionRefusedError):
                cause = "connection refused"
            elif isinstance(a, socket.gaierror):
                cause = "unknown host"
            elif isinstance(a, ConnectionResetError):
                cause = "connection reset"
            elif isinstance(a, OSError) and a.strerror and cause is None and a is not x:
                cause = a.strerror[0].lower() + a.strerror[1:]
            if cause:
                break
        x = x.__cause__ or x.__context__ or getattr(x, "reason", None)
    message = f"cannot reach {url}: {cause or 'no connection'}; check the address and that the server runs"
    if debug_enabled():
        message += f" ({e})"
    return ServerUnreachable(url, message, None, route)
