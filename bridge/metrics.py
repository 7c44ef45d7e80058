"""Prometheus metrics: what the publisher, the watcher and the reference server did, for a scraper.

Off by default. ``PublisherConfig(metrics_port=9400)`` (``wsync train --metrics-port 9400``) serves the publisher's
from trainer rank 0, ``wsync watch --metrics-port`` the watcher's, each at ``http://HOST:PORT/metrics`` from a
thread of the process (:func:`serve_metrics`); the reference server answers ``/metrics`` on its own port when
started with SGLang's ``--enable-metrics``, with SGLang's names for what SGLang also counts. Names follow
Prometheus' conventions: base units (seconds, bytes), ``_total`` on counters, one metric per thing measured.

================================== ========= ==================== =============================================
name                               type      labels               what
================================== ========= ==================== =============================================
``wsync_sync_seconds``             histogram transport, encoding  one committed publish, from prepare to commit
``wsync_sync_bytes_total``         counter   transport, encoding  bytes on the wire of committed publishes
``wsync_sync_failures_total``      counter   transport, kind      failed publishes, by error class
``wsync_published_version``        gauge                          the last version committed
``wsync_last_sync_timestamp_seconds`` gauge                       when it committed (Unix time)
``wsync_servers``                  gauge     state                servers of the last publish: ok, excluded
``wsync_servers_excluded_total``   counter                        servers a publish went on without
``wsync_servers_repaired_total``   counter   by                   servers brought back to the fleet's version
``wsync_watch_loaded_version``     gauge                          the version the watcher's servers serve
``wsync_watch_lag_versions``       gauge                          newest announced minus loaded
``wsync_watch_lag_seconds``        gauge                          since the newest announcement not loaded yet
``wsync_watch_load_seconds``       histogram                      one version into the servers
``wsync_watch_failures_total``     counter   kind                 versions not loaded, by why
================================== ========= ==================== =============================================
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from bridge.errors import ConfigError

__all__ = ["SYNC", "WATCH", "check_metrics_port", "serve_metrics"]

logger = logging.getLogger(__name__)

# From a tiny model on loopback (tens of ms) to a large one over a slow link (minutes).
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class SyncMetrics:
    """The publisher's metrics (every rank records the same figures; rank 0 serves them)."""

    def __init__(self, registry=REGISTRY):
        self.seconds = Histogram("wsync_sync_seconds", "Seconds of one committed publish, from prepare to commit",
                                 ["transport", "encoding"], buckets=SECONDS_BUCKETS, registry=registry)
        self.bytes = Counter("wsync_sync_bytes", "Bytes on the wire of committed publishes", ["transport", "encoding"],
                             registry=registry)
        self.failures = Counter("wsync_sync_failures", "Failed publishes, by the error's class",
                                ["transport", "kind"], registry=registry)
        self.version = Gauge("wsync_published_version", "The last version a publish committed", registry=registry)
        self.last = Gauge("wsync_last_sync_timestamp_seconds", "Unix time the last publish committed",
                          registry=registry)
        self.servers = Gauge("wsync_servers", "Servers of the last publish: ok, or excluded (it went on without them)",
                             ["state"], registry=registry)
        self.excluded = Counter("wsync_servers_excluded", "Servers a publish went on without", registry=registry)
        self.repaired = Counter("wsync_servers_repaired", "Servers brought back to the fleet's version between or "
                                                          "before publishes", ["by"], registry=registry)

    def committed(self, result) -> None:
        """A :class:`bridge.publisher.result.PublishResult` that committed."""
        self.seconds.labels(result.transport, result.encoding).observe(result.seconds)
        self.bytes.labels(result.transport, result.encoding).inc(result.bytes)
        self.version.set(result.version)
        self.last.set(time.time())
        excluded = sum(1 for v in result.servers.values() if v != "ok")
        self.servers.labels("ok").set(len(result.servers) - excluded)
        self.servers.labels("excluded").set(excluded)
        self.excluded.inc(excluded)

    def failed(self, transport: str, error: BaseException) -> None:
        self.failures.labels(transport, type(error).__name__).inc()


class WatchMetrics:
    """The disk watcher's metrics."""

    def __init__(self, registry=REGISTRY):
        self.loaded = Gauge("wsync_watch_loaded_version", "The version the watcher last loaded into its servers",
                            registry=registry)
        self.lag_versions = Gauge("wsync_watch_lag_versions", "Newest announced version minus the loaded one",
                                  registry=registry)
        self.lag_seconds = Gauge("wsync_watch_lag_seconds", "Seconds since the newest announcement that is not loaded "
                                                            "yet (0 when caught up)", registry=registry)
        self.load_seconds = Histogram("wsync_watch_load_seconds", "Seconds to load one version into the servers",
                                      buckets=SECONDS_BUCKETS, registry=registry)
        self.failures = Counter("wsync_watch_failures", "Announced versions the watcher did not load, by why",
                                ["kind"], registry=registry)
        self._announced: tuple[int, float] | None = None  # newest announced version, when it was seen
        self._loaded: int | None = None
        self._lock = threading.Lock()
        self.lag_seconds.set_function(self._lag_seconds)

    def announced(self, version: int, at: float | None = None) -> None:
        """An announcement of ``version`` seen, made at Unix time ``at`` (default: now)."""
        with self._lock:
            if self._announced is None or version > self._announced[0]:
                self._announced = (version, time.time() if at is None else at)
        self._update_lag()

    def loaded_version(self, version: int, seconds: float | None = None) -> None:
        if seconds is not None:  # first: a scrape that sees the version sees its load counted
            self.load_seconds.observe(seconds)
        with self._lock:
            self._loaded = version if self._loaded is None else max(self._loaded, version)
        self.loaded.set(version)
        self._update_lag()

    def failed(self, kind: str) -> None:
        self.failures.labels(kind).inc()

    def _update_lag(self) -> None:
        with self._lock:
            if self._announced is not None:
                self.lag_versions.set(max(0, self._announced[0] - (self._loaded or 0)))

    def _lag_seconds(self) -> float:
        with self._lock:
            if self._announced is None or (self._loaded or 0) >= self._announced[0]:
                return 0.0
            return time.time() - self._announced[1]


SYNC = SyncMetrics()
WATCH = WatchMetrics()

_served: dict[int, str] = {}
_serve_lock = threading.Lock()


def check_metrics_port(port: object) -> None:
    """ConfigError unless ``port`` is a port number (``PublisherConfig`` checks ``metrics_port`` with it when built)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"metrics_port must be a port number (1-65535), got {port!r}")


def serve_metrics(port: int, host: str = "0.0.0.0") -> str:
    """Serve this process's metrics at ``http://host:port/metrics`` from a daemon thread (once per port; again
    is a no-op). Returns the URL.

    Raises:
        ConfigError: the port is not a port number, or another process holds it.
    """
    check_metrics_port(port)
    with _serve_lock:
        if port not in _served:
            try:
                start_http_server(port, addr=host)
            except OSError as e:
                raise ConfigError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}); choose another "
                                  "--metrics-port") from None
            _served[port] = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/metrics"
            logger.info("metrics at %s", _served[port])
        return _served[port]
