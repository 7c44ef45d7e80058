"""Collecting old snapshots: keep the newest versions and the protected ones, remove the rest."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable

from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.snapshot.manifest import DEL_PREFIX, TMP_PREFIX, list_snapshots, snapshot_dir

__all__ = ["discard_version", "gc_snapshots"]

# The package's name, not this file's: one logger for the whole package.
log = get_logger(__package__)


def gc_snapshots(
    root: str | os.PathLike,
    keep: int,
    protect: Iterable[int] = (),
    *,
    stale_tmp_seconds: float = 3600.0,
    before_remove: Callable[[int], None] | None = None,
) -> list[int]:
    """Delete all but the newest ``keep`` versions under ``root``, never those in ``protect``.

    Temporary directories (``.tmp-v*`` of writes, ``.del-v*`` of deletions) are removed only when
    untouched for ``stale_tmp_seconds``, so a write in progress is never disturbed. A version directory
    is first renamed to ``.del-v<N>-...`` so that it disappears from ``list_snapshots`` at once.
    ``before_remove(version)`` runs before each version is removed (the disk transport withdraws its
    announcement there); if it raises, that version is kept (logged) and the others go on.

    Returns:
        The deleted versions, ascending.

    Raises:
        ConfigError: ``keep`` is negative.

    Example:
        >>> import tempfile, torch
        >>> from bridge.snapshot import write_snapshot
        >>> root = tempfile.mkdtemp()
        >>> for v in range(4): _ = write_snapshot(root, v, [("w", torch.zeros(1))])
        >>> gc_snapshots(root, keep=1, protect=[0]), list_snapshots(root)
        ([1, 2], [0, 3])
    """
    if not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"keep must be an int >= 0, got {keep!r}")
    root = os.fspath(root)
    protected = {int(v) for v in protect}
    versions = list_snapshots(root)
    kept = set(versions[max(0, len(versions) - keep):] if keep else []) | protected
    removed = []
    for v in versions:
        if v in kept:
            continue
        if before_remove is not None:
            try:
                before_remove(v)
            except Exception as e:  # keep the snapshot rather than leave what points at it dangling
                log.warning("keeping snapshot v%d under %s: %s", v, root, e)
                continue
        if discard_version(root, v):
            removed.append(v)
    now = time.time()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith((TMP_PREFIX, DEL_PREFIX)):
            full = os.path.join(root, name)
            try:
                age = now - os.stat(full).st_mtime
            except FileNotFoundError:
                continue
            if age > stale_tmp_seconds:
                log.warning("removing stale temporary snapshot directory %s (untouched for %.0f s)", full, age)
                shutil.rmtree(full, ignore_errors=True)
    if removed:
        log.info("snapshot gc under %s: removed versions %s, kept %s", root, removed, sorted(kept & set(versions)))
    return removed


def discard_version(root: str | os.PathLike, version: int) -> bool:
    """Remove ``<root>/v<version>``: renamed to ``.del-v<N>-...`` first (it leaves ``list_snapshots`` at
    once, and a new write of the version may take its name), then deleted. False if it was not there."""
    root = os.fspath(root)
    doomed = os.path.join(root, f"{DEL_PREFIX}{version}-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(snapshot_dir(root, version), doomed)
    except FileNotFoundError:
        return False  # someone else collected it
    shutil.rmtree(doomed, ignore_errors=True)
    return True
