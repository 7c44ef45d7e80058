"""The etcd v3 backend (``etcd://host:port``): leases for TTLs, etcd watch streams, retries across restarts."""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass

from bridge.errors import BridgeError, NameResolveError
from bridge.log import get_logger
from bridge.name_resolve.base import NameResolve, Watch, WatchEvent, check_key, check_prefix, is_under

__all__ = ["EtcdNameResolve"]

# The package's name, not this file's: one logger for the whole package.
log = get_logger(__package__)

_INSTALL_HINT = "pip install 'wsync[etcd]'  (python3-etcd3, which provides `import etcd3`)"


def _import_etcd3():
    """Import the etcd v3 gRPC client (``python3-etcd3``, imported as ``etcd3``).

    python3-etcd3 ships protobuf code generated for protobuf >= 5, so it works in a process that already
    imported protobuf (transformers, wandb and SGLang all do) with no environment variable. The older
    ``etcd3`` 0.12 distribution installs the same module name but needs protobuf's pure-Python
    implementation chosen before protobuf's first import; it is recognised and refused with the fix.
    """
    try:
        import etcd3
        import etcd3.utils
    except ImportError as e:
        raise NameResolveError(f"the etcd backend needs an etcd client ({e}); {_INSTALL_HINT}") from e
    except TypeError as e:  # etcd3 0.12's generated code, rejected by protobuf >= 4
        raise NameResolveError(
            f"the installed `etcd3` package is the unmaintained etcd3 0.12, which cannot load with this protobuf "
            f"({str(e).splitlines()[0]}); replace it: pip uninstall -y etcd3 && {_INSTALL_HINT}") from e
    if not hasattr(etcd3.utils, "prefix_range_end"):
        raise NameResolveError(
            f"the installed `etcd3` package is {getattr(etcd3, '__version__', 'an old version')}, not python3-etcd3 "
            f">= 0.13; replace it: pip uninstall -y etcd3 && {_INSTALL_HINT}")
    return etcd3


def _etcd_errors(method):
    """Translate gRPC/etcd3 exceptions into NameResolveError, retrying transient ones (etcd down or
    restarting) with exponential backoff until the instance's ``retry_deadline``."""

    @functools.wraps(method)
    def wrapper(self: EtcdNameResolve, *args, **kwargs):
        deadline = time.monotonic() + self.retry_deadline
        delay = 0.05
        while True:
            try:
                return method(self, *args, **kwargs)
            except BridgeError:
                raise
            except Exception as e:
                what = self._describe(e)
                if not self._transient(e):
                    raise NameResolveError(f"etcd {self.url}: {method.__name__} failed: {what}") from e
                if self._closed.is_set() or time.monotonic() + delay > deadline:
                    raise NameResolveError(
                        f"etcd {self.url} unreachable for {self.retry_deadline:.0f} s ({what}); is etcd running "
                        f"and is the --name-resolve URL right?"
                    ) from e
                # One warning per outage and call; the retries themselves only at debug level.
                (log.warning if delay == 0.05 else log.debug)(
                    "etcd %s: %s failed (%s); retrying for up to %.0f s", self.url, method.__name__, what,
                    self.retry_deadline)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    return wrapper


@dataclass(slots=True)
class _Kept:
    value: str
    ttl: int
    lease_id: int


class EtcdNameResolve(NameResolve):
    """Backend on an etcd v3 server (``python3-etcd3`` gRPC client, imported as ``etcd3``).

    - TTLs are etcd leases (one per key, whole seconds, rounded up); kept-alive leases are refreshed every
      ttl/3 from one daemon thread. After an outage longer than the TTL the lease is gone: the keep-alive
      thread grants a new one and puts the key back (unless another process took it over meanwhile).
    - Every call retries transient gRPC failures (UNAVAILABLE, DEADLINE_EXCEEDED) with exponential
      backoff (0.05 s doubling to 2 s) for up to ``retry_deadline`` seconds, so an etcd restart is
      invisible to callers; other failures raise ``NameResolveError`` at once.
    - Watches are etcd watch streams, one thread each. A broken stream is re-opened from the revision
      after the last event it delivered, so no change is lost or repeated across a reconnect.

    Args:
        host, port: the etcd client endpoint.
        timeout: seconds per gRPC call.
        retry_deadline: seconds a call keeps retrying while etcd is unreachable.
        user, password: etcd authentication (both or neither).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, *, timeout: float = 5.0,
                 retry_deadline: float = 30.0, user: str | None = None, password: str | None = None) -> None:
        self.url = f"etcd://{host}:{port}"
        self.timeout, self.retry_deadline = timeout, retry_deadline
        self._etcd3 = _import_etcd3()
        import grpc
        from etcd3.etcdrpc import kv_pb2

        self._grpc, self._kv_pb2 = grpc, kv_pb2
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._kept: dict[str, _Kept] = {}
        self._keeper: threading.Thread | None = None
        self._watches: list[Watch] = []
        # Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s).
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        self._client = self._connect(host, port, options, user, password)
        self._watch_stub = self._etcd3.etcdrpc.WatchStub(self._client.channel)

    @_etcd_errors
    def _connect(self, host, port, options, user, password):
        # One endpoint whose failures are never remembered: the client's default marks an endpoint that
        # answered UNAVAILABLE as failed for 300 s, which would outlast an etcd restart; the retries here
        # (and gRPC's reconnect backoff) already pace the attempts.
        endpoint = self._etcd3.Endpoint(host, port, secure=False, time_retry=0, opts=options)
        return self._etcd3.MultiEndpointEtcd3Client([endpoint], timeout=self.timeout, user=user, password=password)

    def _transient(self, e: Exception) -> bool:
        ex = self._etcd3.exceptions
        if isinstance(e, (ex.ConnectionFailedError, ex.ConnectionTimeoutError)):
            return True
        codes = self._grpc.StatusCode
        return isinstance(e, self._grpc.RpcError) and e.code() in (codes.UNAVAILABLE, codes.DEADLINE_EXCEEDED)

    def _describe(self, e: Exception) -> str:
        if isinstance(e, self._grpc.RpcError) and hasattr(e, "code"):
            return f"{e.code().name}: {e.details()}"
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    @_etcd_errors
    def _put(self, key, value, ttl, keepalive, replace):
        c = self._client
        lease = c.lease(math.ceil(ttl)) if ttl is not None else None
        if replace:
            c.put(key, value, lease=lease)
        else:
            ok, _ = c.transaction(compare=[c.transactions.create(key) == 0],
                                  success=[c.transactions.put(key, value, lease=lease)], failure=[])
            if not ok:
                if lease is not None:
                    lease.revoke()
                raise self._exists(key)
        with self._lock:
            old = self._kept.pop(key, None)
            if keepalive:
                self._kept[key] = _Kept(value, math.ceil(ttl), lease.id)
                if self._keeper is None:
                    self._keeper = threading.Thread(target=self._keep_alive, name="wsync-etcd-keepalive", daemon=True)
                    self._keeper.start()
        if old is not None and (lease is None or old.lease_id != lease.id):
            self._revoke(old.lease_id)  # the key now hangs on the new lease (or none); the old one is empty

    def _revoke(self, lease_id: int) -> None:
        try:
            self._client.revoke_lease(lease_id)
        except Exception as e:  # an orphaned lease holds no keys and runs out on its own
            log.debug("revoking lease %x failed: %s", lease_id, self._describe(e))

    @_etcd_errors
    def get(self, name):
        value, _ = self._client.get(check_key(name))
        if value is None:
            raise self._not_found(name)
        return value.decode()

    @_etcd_errors
    def delete(self, name):
        check_key(name)
        with self._lock:
            kept = self._kept.pop(name, None)
        deleted = self._client.delete(name)
        if kept is not None:
            self._revoke(kept.lease_id)
        if not deleted:
            raise self._not_found(name)

    @_etcd_errors
    def _range(self, prefix: str):
        return self._client.get_prefix_response(prefix)

    def _list(self, prefix):
        resp = self._range(prefix)
        return sorted((kv.key.decode(), kv.value.decode()) for kv in resp.kvs if is_under(prefix, kv.key.decode()))

    def watch(self, prefix, callback=None, *, include_existing=False):
        prefix = check_prefix(prefix)
        resp = self._range(prefix)  # fixes the revision the stream starts after
        w = Watch(prefix, callback)
        if include_existing:
            for kv in sorted(resp.kvs, key=lambda kv: kv.key):
                key = kv.key.decode()
                if is_under(prefix, key):
                    w.emit(WatchEvent("put", key, kv.value.decode(), kv.mod_revision))
        stream = _EtcdWatchStream(self, w, prefix, resp.header.revision + 1)
        w.on_cancel(stream.stop)
        stream.thread.start()
        with self._lock:
            self._watches.append(w)
        return w

    def _keep_alive(self) -> None:
        outage = False  # warn once per outage, not once per refresh
        while True:
            with self._lock:
                kept = dict(self._kept)
            interval = max(min((k.ttl for k in kept.values()), default=3) / 3, 0.2)
            if self._closed.wait(interval / 2 if outage else interval):
                return
            for key, k in kept.items():
                try:
                    responses = list(self._client.refresh_lease(k.lease_id))
                    if not responses or responses[0].TTL <= 0:
                        self._regrant(key, k)
                    outage = False
                except Exception as e:
                    if isinstance(e, self._grpc.RpcError) and e.code() == self._grpc.StatusCode.NOT_FOUND:
                        self._regrant(key, k)
                        continue
                    if not outage:
                        log.warning("etcd %s: keep-alive of %s failed (%s); retrying", self.url, key, self._describe(e))
                    outage = True

    def _regrant(self, key: str, k: _Kept) -> None:
        """The lease ran out (etcd was unreachable for longer than the TTL): put the key back on a new one; unless
        it was deleted meanwhile (a lock released: putting it back would hold it for a TTL more, kept by no one)."""
        with self._lock:
            if self._kept.get(key) is not k:
                return
        try:
            c = self._client
            lease = c.lease(k.ttl)
            ok, _ = c.transaction(
                compare=[c.transactions.create(key) == 0], success=[c.transactions.put(key, k.value, lease=lease)],
                failure=[],
            )
            if not ok:
                value, _ = c.get(key)
                if value is not None and value.decode() != k.value:
                    log.warning("etcd %s: %s was taken over by another writer; no longer keeping it alive", self.url, key)
                    lease.revoke()
                    with self._lock:
                        self._kept.pop(key, None)
                    return
                c.put(key, k.value, lease=lease)
            with self._lock:
                still = self._kept.get(key) is k
                if still:
                    k.lease_id = lease.id
            if not still:  # deleted while it was put back: its new lease goes, and the key with it
                lease.revoke()
                return
            log.warning("etcd %s: lease of %s had expired; re-created it and put the key back", self.url, key)
        except Exception as e:
            log.warning("etcd %s: re-creating the lease of %s failed (%s); retrying", self.url, key, self._describe(e))

    def close(self):
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            watches, self._watches = self._watches, []
            kept, self._kept = list(self._kept.values()), {}
        for w in watches:
            w.cancel()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        for k in kept:
            self._revoke(k.lease_id)
        self._client.close()


class _EtcdWatchStream:
    """One etcd watch stream on its own thread, re-opened after failures from the next unseen revision."""

    def __init__(self, nr: EtcdNameResolve, w: Watch, prefix: str, start_revision: int) -> None:
        self.nr, self.w, self.prefix = nr, w, prefix
        self.next_revision = start_revision
        self._stop = threading.Event()
        self._call = None
        self._call_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"wsync-etcd-watch:{prefix}", daemon=True)

    def stop(self) -> None:
        self._stop.set()
        self._cancel_call()

    def _cancel_call(self) -> None:
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()

    def _requests(self, rpc, key: bytes, range_end: bytes, done: threading.Event):
        yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=key, range_end=range_end, start_revision=self.next_revision))
        # Keep the request side open while this stream lives; gRPC consumes this generator on a thread of
        # its own, which ``done`` releases when the stream ends.
        done.wait()

    def _run(self) -> None:
        nr, grpc = self.nr, self.nr._grpc
        rpc = nr._etcd3.etcdrpc
        key = self.prefix.encode()
        range_end = nr._etcd3.utils.prefix_range_end(key)
        delete = nr._kv_pb2.Event.DELETE
        delay, outage_logged = 0.05, False
        while not self._stop.is_set():
            done = threading.Event()
            try:
                with self._call_lock:
                    if self._stop.is_set():
                        return
                    self._call = nr._watch_stub.Watch(self._requests(rpc, key, range_end, done),
                                                      metadata=nr._client.metadata)
                for rs in self._call:
                    if outage_logged:
                        log.info("etcd %s: watch on %s re-established at revision %d", nr.url, self.prefix,
                                 self.next_revision)
                    delay, outage_logged = 0.05, False
                    if rs.compact_revision:
                        log.error("etcd %s: watch on %s lost changes before revision %d (compacted); resuming there",
                                  nr.url, self.prefix, rs.compact_revision)
                        self.next_revision = rs.compact_revision
                        break
                    for ev in rs.events:
                        k = ev.kv.key.decode()
                        self.next_revision = max(self.next_revision, ev.kv.mod_revision + 1)
                        if is_under(self.prefix, k):
                            if ev.type == delete:
                                self.w.emit(WatchEvent("delete", k, None, ev.kv.mod_revision))
                            else:
                                self.w.emit(WatchEvent("put", k, ev.kv.value.decode(), ev.kv.mod_revision))
                    if rs.canceled:
                        break
            except Exception as e:  # grpc.RpcError mostly; anything else must not end the watch silently
                if self._stop.is_set():
                    return
                if not outage_logged:
                    log.warning("etcd %s: watch on %s broke (%s); reconnecting", nr.url, self.prefix, nr._describe(e),
                                exc_info=not isinstance(e, grpc.RpcError))
                    outage_logged = True
            finally:
                done.set()
                self._cancel_call()
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, 2.0)
