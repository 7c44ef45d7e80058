"""The project's exception hierarchy.

Foreign exceptions (requests, grpc, torch.distributed, safetensors) are translated into these at the
boundary where they happen, so callers handle one small family:

    BridgeError
    ├── ConfigError          a flag, config field or argument is wrong (also a ValueError)
    ├── ServerError          an inference server answered with an error, or could not be reached
    │   ├── ServerUnreachable    no connection to a server at all (refused, unknown host, ...)
    │   └── SessionAlreadyOpen   a server refused to open an update session: one is open already
    ├── SyncTimeout          something did not finish within its configured timeout (also a TimeoutError)
    ├── SyncError            a weight sync failed; servers keep serving their previous version
    │   └── DeltaBaseMismatch    a server refused a delta: it does not serve the delta's base
    ├── VersionError         a version was refused (not strictly increasing, unknown, ...)
    ├── SnapshotError        a snapshot on disk is missing, incomplete or corrupt
    │   └── SnapshotConflict     the version's snapshot exists already, with other content
    └── NameResolveError     the name-resolution backend failed
        └── NameEntryNotFound
"""

from __future__ import annotations

__all__ = [
    "BridgeError",
    "ConfigError",
    "DeltaBaseMismatch",
    "NameEntryExists",
    "NameEntryNotFound",
    "NameResolveError",
    "ServerError",
    "ServerUnreachable",
    "SessionAlreadyOpen",
    "SnapshotConflict",
    "SnapshotError",
    "SyncError",
    "SyncTimeout",
    "VersionError",
]


class BridgeError(Exception):
    """Base of every error this project raises on purpose.

    Attributes (set by :mod:`bridge.publisher.agreement` on the error a failed step raises on every rank):
        interrupt: the KeyboardInterrupt or SystemExit this rank caught in the step, for the caller to
            raise again after the clean-up; None otherwise.
        agreement_broken: True when a rank left (died): it takes part in no further exchange.
    """

    interrupt: BaseException | None = None
    agreement_broken: bool = False


class ConfigError(BridgeError, ValueError):
    """A user-supplied value is wrong; the message names the value, the expectation and the fix."""


class ServerError(BridgeError):
    """An inference server answered with an error or could not be reached.

    Attributes:
        server: the server's base URL.
        status: the HTTP status code, or None when no answer came back.
        message: the server's own message (SGLang's ``message`` field), or the transport error.
        reason: the reference server's machine-readable cause (``wsync_reason``, e.g.
            ``bridge.protocol.SNAPSHOT_INVALID``), None from real SGLang.
    """

    def __init__(self, server: str, message: str, status: int | None = None, route: str | None = None,
                 reason: str | None = None):
        self.server = server
        self.status = status
        self.route = route
        self.message = message
        self.reason = reason
        where = f"{server}{route or ''}"
        code = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{where}{code}: {message}")


class ServerUnreachable(ServerError):
    """No connection to a server could be made; the message is one line, the cause and the fix first
    (``cannot reach URL: connection refused; check the address and that the server runs``)."""

    def __str__(self) -> str:
        return self.message


class SessionAlreadyOpen(ServerError):
    """A server refused to open a weight-update session (``/begin_weight_update``) because one is open
    already: this client's, or one another writer left (:class:`bridge.transports.ServerSessions` tells)."""


class SyncTimeout(BridgeError, TimeoutError):
    """A step of a sync (HTTP call, rendezvous, broadcast) exceeded its timeout."""


class SyncError(BridgeError):
    """A weight sync failed part-way; the servers keep serving the last complete version."""


class DeltaBaseMismatch(SyncError):
    """A server refused a delta because it does not serve the delta's base (``wsync_reason:
    delta_base_mismatch``), before any weight changed; the publisher answers with an anchor."""


class VersionError(BridgeError, ValueError):
    """A version was refused, e.g. publishing a version that is not newer than the last one."""


class SnapshotError(BridgeError):
    """A snapshot directory is missing, incomplete, or fails verification against its manifest."""


class SnapshotConflict(SnapshotError):
    """A snapshot of this version exists already with other content: versions are immutable."""


class NameResolveError(BridgeError):
    """The name-resolution backend (etcd, directory, memory) failed."""


class NameEntryNotFound(NameResolveError, KeyError):
    """A key does not exist (or did not appear before the wait timed out)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return Exception.__str__(self)


class NameEntryExists(NameResolveError):
    """A key already exists and replace=False was asked."""
