"""Every trainer rank learns every rank's outcome of each step of a sync, within a bounded time.

A sync is a sequence of steps (prepare, one per bucket, commit). Inside a step each rank does its own
part (rank 0 talks to the servers, every rank gathers shards); any exception there, of any type, is
caught and becomes that rank's outcome. Then :meth:`Agreement.step` exchanges the outcomes of all
ranks, and either every rank goes on or every rank raises the same error. So no rank can run ahead into
a collective that another rank, which has already failed, will never join; a trainer that catches the
error and goes on never finds another rank still blocked.

The exchange goes through the default group's key-value store (a TCP store that every
``torch.distributed`` job has), not through a collective: each wait has its own timeout, and a rank that
died or hangs shows up as a :class:`SyncTimeout` naming the ranks that did not arrive, after at most the
step's bound.

Interrupts: a ``KeyboardInterrupt`` or ``SystemExit`` raised in a step is that rank's failure like any
other (the error it raises carries it as ``.interrupt``, for the caller to re-raise after the clean-up);
a SIGINT or SIGTERM held by :mod:`bridge.publisher.interrupts` fails the step it arrived in, once the step's own
work is done. A rank that leaves in the middle of a sync (:meth:`Agreement.leave`) tells the others, so
they fail at their next exchange instead of waiting for it until the step's bound.

Which error is raised: the one that happened first (by wall clock, then by rank). A failure on one rank
usually makes the others fail a little later in a collective (a gather that times out because the
failed rank never joined); the first one is the cause, the later ones are its consequences.

    agree = Agreement(rank, world, store)
    digest = agree.step("prepare", lambda: local_digest(), timeout=30)  # -> [digest of rank 0, of rank 1, ...]
"""

from __future__ import annotations

import itertools
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from bridge.errors import (
    BridgeError,
    ConfigError,
    DeltaBaseMismatch,
    NameResolveError,
    SnapshotError,
    SyncError,
    SyncTimeout,
    VersionError,
)
from bridge.log import get_logger
from bridge.publisher.interrupts import Interrupted, pending

__all__ = ["Agreement", "StepFailed", "describe", "in_step", "note_failure_time", "raise_agreed"]

logger = get_logger(__name__)

_instances = itertools.count()

# Errors that keep their class when they cross ranks: the caller may handle them differently (a
# VersionError means "publish a higher version", a ConfigError "fix the setting"). Anything else,
# the project's ServerError included, arrives as a SyncError that names the rank, the step and the cause.
_KEEP_CLASS = {c.__name__: c for c in (ConfigError, VersionError, SyncTimeout, SnapshotError, NameResolveError, SyncError,
                                        DeltaBaseMismatch)}
# Not errors but interrupts: the message says the rank was interrupted, not that it failed.
_INTERRUPTS = ("Interrupted", "KeyboardInterrupt", "SystemExit")


class StepFailed:
    """One rank's failure in one step, as it travels to the other ranks."""

    def __init__(self, rank: int, step: str, error: BaseException, gone: bool = False):
        self.rank, self.step, self.at = rank, step, getattr(error, _FAILED_AT, None) or time.time()
        self.kind = type(error).__name__
        self.message = describe(error)
        self.traceback = "".join(traceback.format_exception(error))
        self.gone = gone
        """The rank left the sync (:meth:`Agreement.leave`): it takes part in no further exchange."""

    def to_exception(self) -> BridgeError:
        """The error every rank raises: the same class (for the project's own kinds) and the same text."""
        cls = _KEEP_CLASS.get(self.kind)
        if cls is not None:
            error = cls(f"{self.message} (rank {self.rank}, {self.step})")
        elif self.kind in _INTERRUPTS:
            how = self.message if self.kind == "Interrupted" else f"{self.kind}: {self.message}"
            error = SyncError(f"rank {self.rank} was interrupted at {self.step} ({how})")
        else:
            error = SyncError(f"rank {self.rank} failed at {self.step}: {self.kind}: {self.message}")
        if self.gone:
            error.agreement_broken = True  # the rank that left takes part in no further exchange
        return error


_FAILED_AT = "wsync_failed_at"


def note_failure_time(error: BaseException) -> None:
    """Record when ``error`` happened, for a rank that does clean-up before the step's exchange: the
    errors that clean-up causes on other ranks must not look earlier than their cause."""
    if getattr(error, _FAILED_AT, None) is None:
        try:
            setattr(error, _FAILED_AT, time.time())
        except AttributeError:  # an exception type that takes no attributes: its creation time will do
            pass


def raise_agreed(failure: BridgeError, error: BridgeError) -> NoReturn:
    """Raise ``error``, what every rank raises for the agreed ``failure`` once its clean-up is done; on the rank
    where the failure was an interrupt raised in a step (Ctrl-C, SIGTERM: ``failure.interrupt``), that interrupt,
    from ``error``: it ends the program, after the same clean-up. Both publishers end a failed publish here."""
    if failure.interrupt is not None:
        raise failure.interrupt from error
    raise error from None


STEP_ATTR = "wsync_step"


def in_step(error: BaseException, step: str) -> None:
    """Mark ``error`` as raised in ``step``, a part of a larger agreed step: the error every rank raises names it
    (and carries it as ``wsync_step``). The first mark stays."""
    if getattr(error, STEP_ATTR, None) is None:
        try:
            setattr(error, STEP_ATTR, step)
        except AttributeError:  # an exception type that takes no attributes: the step's own name will do
            pass


def describe(error: BaseException) -> str:
    """A one-line description of ``error`` (its message, or its type when the message is empty)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


class Agreement:
    """Exchanges each step's outcome between the ranks of one process group (see the module docstring).

    Args:
        rank, world: this rank and the number of ranks.
        store: the key-value store all ranks share (default: the default group's store). None with
            ``world == 1``.
    """

    def __init__(self, rank: int = 0, world: int = 1, store: dist.Store | None = None):
        self.rank, self.world = rank, world
        if world > 1 and store is None:
            store = dist.distributed_c10d._get_default_store()
        self._store = store
        self._seq = 0
        self._name = ""  # the last exchange this rank entered
        # Publishers are created in the same order on every rank, so the n-th of each rank meets the
        # n-th of the others under its own keys.
        self._ns = f"wsync/agree/{next(_instances)}"

    @classmethod
    def of_default_group(cls) -> Agreement:
        """The agreement among all ranks of the default group (a single-process one without a group)."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def step(self, name: str, fn: Callable[[], Any], *, timeout: float,
             on_failure: Callable[[], None] | None = None) -> list[Any]:
        """Run ``fn`` here, then exchange outcomes; every rank's return value, in rank order.
        ``on_failure()`` runs here, before the exchange, when this rank's own part failed (never raising).

        Raises (the same on every rank):
            the first failure of any rank, translated by :meth:`StepFailed.to_exception`;
            SyncTimeout: some rank did not finish ``name`` within ``timeout`` seconds (it died or hangs).
        """
        interrupt = None  # a KeyboardInterrupt or SystemExit raised here, for the caller to re-raise
        try:
            outcome: Any = ("ok", fn())
        except BaseException as e:  # any type: a rank that raised must still tell the others
            logger.debug("rank %d failed at %s", self.rank, name, exc_info=True)
            if not isinstance(e, Exception):
                interrupt = e
            # A step of several parts names the part that failed (``wsync_step`` on the error, see :func:`in_step`).
            outcome = ("failed", StepFailed(self.rank, getattr(e, STEP_ATTR, None) or name, e))
        else:
            signal_name = pending()
            if signal_name is not None:  # held since during this step: the step fails, now that it is done
                outcome = ("failed", StepFailed(self.rank, name, Interrupted(signal_name)))
        if outcome[0] == "failed" and on_failure is not None:
            try:
                on_failure()
            except Exception as e:  # clean-up must not hide the step's own failure
                logger.warning("clean-up after %s failed on rank %d: %s", name, self.rank, e)
        try:
            outcomes = self.exchange(name, outcome, timeout=timeout)
        except BridgeError as e:
            e.interrupt = interrupt
            raise
        failures = sorted((o[1] for o in outcomes if o[0] == "failed"), key=lambda f: (f.at, f.rank))
        if failures:
            first = failures[0]
            if first.rank == self.rank:
                logger.debug("the cause, on this rank:\n%s", first.traceback)
            error = first.to_exception()
            setattr(error, STEP_ATTR, first.step)
            error.interrupt = interrupt
            if any(f.gone for f in failures):
                error.agreement_broken = True
            raise error
        return [o[1] for o in outcomes]

    def leave(self, error: BaseException) -> None:
        """This rank leaves the sync now, outside any step (``error`` escaped the publish): tell the other
        ranks at the exchange they wait in, or at the next one, so that they fail at once; never raises."""
        if self.world == 1:
            return
        try:
            if self._seq == 0 or self._store.check([self._key(self._seq, self.rank)]):
                self._seq += 1  # this rank's outcome of the current step is out: the others meet it at the next
            failed = StepFailed(self.rank, f"after {self._name}" if self._name else "the start", error, gone=True)
            self._store.set(self._key(self._seq, self.rank), pickle.dumps(("failed", failed)))
        except Exception as e:  # the store is gone too: the others time out, as for a dead rank
            logger.debug("could not tell the other ranks that rank %d left: %s", self.rank, e)

    def finish(self, timeout: float) -> None:
        """The last meeting of these ranks: the other ranks say they are done with every exchange, and rank 0,
        which hosts the store under torchrun, waits for them (at most ``timeout``), so that it does not exit and
        take the store away while another rank still reads the last step's outcomes. Never raises."""
        if self.world == 1:
            return
        key = f"{self._ns}/finished/{{}}"
        try:
            if self.rank != 0:
                self._store.set(key.format(self.rank), b"1")
            else:
                self._store.wait([key.format(r) for r in range(1, self.world)], timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as e:  # a rank that died or left: nothing more to wait for
            logger.debug("rank %d: the last meeting of the ranks ended early: %s", self.rank, e)

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._ns}/{seq}/{rank}"

    def exchange(self, name: str, value: Any, *, timeout: float,
                 missing: Callable[[list[int]], str] | None = None) -> list[Any]:
        """Every rank's ``value`` for this step, in rank order (a plain all-gather through the store).
        ``missing(ranks)``: the message of the SyncTimeout when those ranks did not come within ``timeout``."""
        if self.world == 1:
            return [value]
        self._seq += 1
        self._name = name
        keys = [self._key(self._seq, r) for r in range(self.world)]
        try:
            self._store.set(keys[self.rank], pickle.dumps(value))
            if self._seq > 2:
                # Every rank has read step seq-2 (they all wrote seq-1 after it): drop this rank's old key.
                self._store.delete_key(self._key(self._seq - 2, self.rank))
            self._store.wait(keys, timedelta(seconds=timeout))
            # One round trip for the other ranks' values; this rank's own is not read back.
            others = iter(self._store.multi_get([k for r, k in enumerate(keys) if r != self.rank]))
            return [value if r == self.rank else pickle.loads(next(others)) for r in range(self.world)]
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, dist.DistNetworkError):  # the store itself is gone, with the rank that hosts it
                error = SyncTimeout(
                    f"lost the trainer ranks' key-value store during {name} (the rank that hosts it, rank 0 under "
                    f"torchrun, died): {describe(e)}"
                )
            else:
                absent = self._missing(keys)
                error = SyncTimeout(missing(absent) if missing is not None and absent else
                    f"ranks {absent or '?'} did not finish {name} within {timeout:.0f} s (a trainer rank died or "
                    f"hangs; raise group_timeout / http_timeout if it is only slow): {describe(e)}"
                )
            error.agreement_broken = True  # the ranks no longer meet: no further exchange can succeed
            raise error from e

    def _missing(self, keys: list[str]) -> list[int]:
        try:
            return [r for r, k in enumerate(keys) if not self._store.check([k])]
        except (RuntimeError, dist.DistError):
            return []
