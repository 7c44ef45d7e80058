"""SGLang's router (``sglang-router``) and its successor gateway (``smg``), as the fleet uses them.

Both list their workers at ``GET /workers`` (``{"workers": [{"id", "url", "is_healthy", ...}], ...}``), add
one with ``POST /workers {"url": ...}`` (202: the router then probes the worker's ``/model_info`` and
``/server_info`` and lists it once they answered) and remove one with ``DELETE /workers/{id}`` (202).
Neither forwards a weight-update route (they answer 404), so weights always go to each worker directly;
the router is only where generation traffic goes, which is what "in rotation" means for it. Their own
health checks only mark a worker unhealthy (after interval x threshold, 60 s x 3 by default) and never
remove it: taking a worker out is the caller's job.
"""

from __future__ import annotations

import time

import requests

from bridge.errors import ConfigError, ServerError
from bridge.log import get_logger

__all__ = ["Router", "normalize_url"]

logger = get_logger(__name__)

LISTED_WAIT_S = 10.0
"""How long ``add`` and ``remove`` wait for the router's list to show the change (it applies them in the
background)."""


def normalize_url(url: str) -> str:
    """A server URL as the fleet compares them: a scheme, no trailing slash."""
    url = str(url).strip().rstrip("/")
    return url if "://" in url else "http://" + url


class Router:
    """The worker list of one router at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout: float = 5.0, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"router URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __repr__(self) -> str:
        return f"Router({self.url!r})"

    def _call(self, method: str, route: str, body: dict | None = None) -> dict:
        try:
            r = requests.request(method, self.url + route, json=body, headers=self._headers, timeout=self.timeout)
        except requests.RequestException as e:
            raise ServerError(self.url, f"cannot reach the router: {e}", None, route) from e
        if r.status_code == 404 and method == "DELETE":
            return {}
        if not 200 <= r.status_code < 300:
            raise ServerError(self.url, f"the router answered {r.status_code}: {r.text[:300]}", r.status_code, route)
        try:
            return r.json() if r.content else {}
        except ValueError:
            raise ServerError(self.url, f"the router's answer is not JSON: {r.text[:300]!r}; is this an sglang-router "
                                        "or smg?", r.status_code, route) from None

    def workers(self) -> dict[str, str]:
        """url -> the router's id of that worker, for every worker it lists."""
        data = self._call("GET", "/workers")
        listed = data.get("workers") if isinstance(data, dict) else None
        if not isinstance(listed, list):
            raise ServerError(self.url, f"GET /workers has no 'workers' list ({str(data)[:200]}); is this an "
                                        "sglang-router or smg?", 200, "/workers")
        return {normalize_url(w["url"]): str(w.get("id", "")) for w in listed if isinstance(w, dict) and w.get("url")}

    def add(self, url: str, wait: float = LISTED_WAIT_S) -> bool:
        """Put ``url`` in rotation; True once the router lists it (within ``wait`` seconds)."""
        url = normalize_url(url)
        if url in self.workers():
            return True
        self._call("POST", "/workers", {"url": url})
        return self._wait(lambda: url in self.workers(), wait)

    def remove(self, url: str, wait: float = LISTED_WAIT_S) -> bool:
        """Take ``url`` out of rotation; True once the router no longer lists it."""
        url = normalize_url(url)
        wid = self.workers().get(url)
        if wid is None:
            return True
        self._call("DELETE", f"/workers/{wid}")
        return self._wait(lambda: url not in self.workers(), wait)

    @staticmethod
    def _wait(done, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        delay = 0.02
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(delay)
            delay = min(0.2, delay * 2)
        return True
