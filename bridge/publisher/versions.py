"""The publisher's version and retry decisions, in one place (:class:`Versions`).

* A version older than the last published one is a :class:`VersionError` before anything else.
* The last version again is a retry: safe only with the weights published then. Every rank tells for its own
  shards: by a digest of them, taken on a thread while the buckets of each new version travel and waited for at
  settle (the weights may change once ``publish()`` returns), or, for an encoding that keeps what it published
  (``Encoding.fingerprints`` False: the delta's base), by the encoding's ``differs``. Other weights, or weights
  that cannot be compared, on any rank are a VersionError on every rank before any byte moves.
* A sync that a server refused for its encoding before applying anything (:class:`DeltaBaseMismatch`: the
  server does not serve the delta's base) is published again at once, in the same ``publish()`` call, with
  every tensor: ``Plan.forced`` says why.
"""

from __future__ import annotations

from concurrent.futures import Future

from bridge.errors import DeltaBaseMismatch, VersionError

__all__ = ["Versions"]


class Versions:
    """One rank's record of the last version it published, and what tells a retry of it safe. ``encoding``: the
    weights' encoding, which may keep what it published (an adapter publisher has none: it tells a retry by the
    checksums of what it sent)."""

    def __init__(self, encoding=None):
        self.encoding = encoding
        self.last: int | None = None
        self.forced: str | None = None  # why the next sync must send every tensor (a server refused a delta)
        self._taking: Future | None = None  # this sync's digest of this rank's shards (None: none taken)
        self._taken = False  # this sync takes one (False on a retry: the weights are the same)
        self._published: int | None = None  # the last version's digest

    def check(self, version: int) -> None:
        """A VersionError for a version that is not a non-negative integer, or older than the last one."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise VersionError(f"version must be a non-negative integer, got {version!r}")
        if self.last is not None and version < self.last:
            raise VersionError(f"version {version} is older than the last published version {self.last}; "
                               "versions must strictly increase")

    def encoding_refused(self, error: DeltaBaseMismatch) -> str:
        """A server refused the sync for its encoding (nothing was applied): why it is published again at once, as
        the same version, with every tensor; so are the next ones until one commits (:attr:`forced`)."""
        self.forced = f"a server refused the delta: {error}"
        return self.forced

    def is_retry(self, version: int) -> bool:
        return version == self.last

    def differs(self, source, specs) -> str | None:
        """Every rank, on a retry (in the prepare step, before the encoding's prepare changes anything): why this
        rank's weights are not the ones it published, or cannot be shown to be; None when they are."""
        if not self.encoding.fingerprints:
            return self.encoding.differs(source, specs)
        digest = source.digest()
        if digest is None:
            return "the weight source has no local_digest(), so a retry cannot be told from new weights"
        return None if digest == self._published else "other weights"

    def fingerprint(self, source) -> None:
        """Every rank, in the prepare step of a new version: start taking this rank's digest (on a thread)."""
        self._taken = self.encoding is not None and self.encoding.fingerprints
        self._taking = source.digest_in_background() if self._taken else None

    def fingerprinted(self) -> None:
        """Every rank, at settle: the digest is taken (an error taking it fails the sync)."""
        if self._taking is not None:
            self._taking.result()

    def refused(self, version: int, why: list[str]) -> VersionError:
        """The error of a retry whose weights differ (``why``: each rank that says so, and why)."""
        return VersionError(f"version {version} was already published with different weights, or with weights "
                            f"that cannot be compared ({'; '.join(why)}); publish the new weights under a higher "
                            "version")

    def committed(self, version: int) -> None:
        """Every rank: ``version`` is live; its digest is the one a retry compares with."""
        if self._taken:
            self._published = self._taking.result() if self._taking is not None else None
        self.last, self.forced, self._taking, self._taken = version, None, None, False

    def failed(self) -> None:
        """Every rank: the sync failed (the last version and its digest stay)."""
        self._taking, self._taken = None, False
