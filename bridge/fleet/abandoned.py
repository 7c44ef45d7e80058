"""Servers a trainer left paused when it died: found by its writer's mark, given back by the serving side.

A publisher pauses real SGLang for every sync and resumes it at the end, committed or not; a trainer whose rank 0
dies in between (killed, out of memory, its host gone) resumes nothing, and SGLang has no watchdog of its own (the
reference server has one). Where the trainers hold real SGLang through ``writer_lock``, each writer leaves a mark
beside its lock while it holds a server (:func:`bridge.transports.lease.held_key`); the lock runs out within the
writer's lease once it is dead, the mark stays. :func:`give_back_abandoned`, run by ``wsync watch --writer-lock`` at
every heal round, finds each server whose mark has no lock beside it, takes the lock itself (so no trainer starts a
sync meanwhile), and:

- resumes it where the dead writer's sync could not have changed its weights (one request for the whole sync,
  received whole before any of it is loaded: the default below ``atomic_mb``), on the version it served;
- else loads the newest complete snapshot first, when that is the version the server is labelled with (the sync
  that tore it had not relabelled it), then resumes it;
- else leaves it paused and says so (torn, and no snapshot of its version to repair it from: the next publish does).

Before it resumes a server, it closes the update session the dead writer left open (SGLang >= 0.5.21 finalizes its
runners there). Then it removes the mark and lets go of the lock.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from bridge.errors import BridgeError, NameEntryNotFound, ServerError
from bridge.log import get_logger
from bridge.metrics import SYNC
from bridge.transports.lease import WriterLease, held_key, lock_key
from bridge.transports.sessions import discard_session

__all__ = ["abandoned_mark", "give_back_abandoned"]

logger = get_logger(__name__)

REPAIRER_LEASE_S = 30.0
"""Seconds the lock a repair takes lasts past a repairer that dies during it."""


def abandoned_mark(nr, url: str) -> dict | None:
    """The mark of a writer that died holding the server at ``url`` (its run, name, since when, whether its sync may
    have torn the server), or None: no mark, or its writer still holds the lock."""
    try:
        raw = nr.get(held_key(url))
    except NameEntryNotFound:
        return None
    try:
        nr.get(lock_key(url))
        return None  # a live writer holds it
    except NameEntryNotFound:
        pass
    try:
        mark = json.loads(raw)
    except ValueError:
        mark = None
    return mark if isinstance(mark, dict) else {"may_tear": True}


def give_back_abandoned(clients, nr, lock_url: str, snapshot=None, reported: set | None = None) -> dict[str, str]:
    """Every server of ``clients`` a dead writer left held (:func:`abandoned_mark` in ``nr``, the name resolution of
    ``lock_url``), given back as the module docstring says. ``snapshot``: the newest complete snapshot's
    announcement (``version``, ``path``, ``manifest_sha256``), or None; ``reported``: the marks already reported as
    left paused (logged once each). Returns url -> what was done, for each one found; never raises (what failed is
    logged and returned)."""
    done = {}
    for c in clients:
        try:
            mark = abandoned_mark(nr, c.url)
        except BridgeError as e:
            logger.warning("cannot read the writer's mark of %s in %s: %s", c.url, lock_url, e)
            continue
        if mark is not None:
            done[c.url] = _give_back(c, lock_url, mark, snapshot, reported if reported is not None else set())
    return done


def _give_back(c, lock_url: str, mark: dict, snapshot, reported: set) -> str:
    who = f"writer {mark.get('writer')!r} of run {mark.get('run_id')!r}"
    since = mark.get("since")
    if isinstance(since, (int, float)):
        who += f", holding it since {time.time() - since:.0f} s ago"
    torn = bool(mark.get("may_tear", True))
    try:
        served = str(c.model_info().get("weight_version"))
    except BridgeError as e:
        return f"failed: {e}"
    if torn and (snapshot is None or str(snapshot.version) != served):
        have = f"the newest snapshot is version {snapshot.version}" if snapshot is not None else "no snapshot"
        key = (c.url, since)
        if key not in reported:
            reported.add(key)
            logger.error("%s was left paused by a dead %s, whose sync may have torn it; %s, not %s: left paused "
                         "until a publish repairs it", c.url, who, have, served)
        return f"torn: left paused ({have}; it is labelled {served})"
    # The lock, as a writer: no trainer starts a sync meanwhile. Its release removes the mark (this one's now).
    lease = WriterLease(SimpleNamespace(clients=[c]), run_id="wsync-watch", seconds=REPAIRER_LEASE_S, lock_url=lock_url)
    lease.may_tear = False
    try:
        lease.take()
    except BridgeError as e:  # a trainer took it meanwhile: it is that trainer's now
        lease.close()
        return f"taken meanwhile: {e}"
    try:
        if torn:
            c.update_weights_from_disk(snapshot.path, weight_version=served,
                                       manifest_sha256=getattr(snapshot, "manifest_sha256", None))
        if c.features.needs_session:
            _close_session(c)
        c.continue_generation()
    except BridgeError as e:
        logger.error("%s was left paused by a dead %s and could not be given back: %s", c.url, who, e)
        return f"failed: {e}"
    finally:
        lease.close()
    how = " from its snapshot" if torn else ""
    logger.warning("%s was left paused by a dead %s: resumed%s, serving version %s", c.url, who, how, served)
    SYNC.repaired.labels("watcher").inc()
    return f"resumed{how} on version {served}"


def _close_session(c) -> None:
    """Close the update session a dead writer left open, without applying anything (none open: nothing to do)."""
    try:
        discard_session(c)
    except ServerError as e:
        if "no weight-update session" not in e.message and "no weight update session" not in e.message.lower():
            raise
