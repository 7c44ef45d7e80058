""":class:`WeightPublisher`: drives one sync through the agreed steps (the lifecycle: :mod:`bridge.publisher`)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from bridge.buckets import plan_buckets
from bridge.config import PublisherConfig
from bridge.encodings import encoding_class
from bridge.encodings.base import Outgoing, Transfer
from bridge.errors import BridgeError, DeltaBaseMismatch
from bridge.failpoints import failpoint
from bridge.log import fmt_bytes, get_logger, progress_bar
from bridge.metrics import SYNC, serve_metrics
from bridge.process_group import default_backend
from bridge.publisher.agreement import describe, note_failure_time, raise_agreed
from bridge.publisher.bounded import (
    ABORT_WAIT_S,
    CLOSE_WAIT_S,
    SLACK_S,
    abort_within,
    bucket_bound,
    pending_aborts,
    publish_call_bound,
)
from bridge.publisher.labels import LabelCheck, Labels
from bridge.publisher.lifecycle import Publisher
from bridge.publisher.memory import PeakMemory
from bridge.publisher.preflight import check_servers_serve
from bridge.publisher.result import PublishResult
from bridge.publisher.versions import Versions
from bridge.sources import CheckedSource, WeightSource, check_source
from bridge.tensors import ParamSpec, dtype_from_str
from bridge.transports import Plan, Sink, Transport, transport_class

__all__ = ["PublishResult", "PublisherConfig", "WeightPublisher"]

logger = get_logger(__name__)

class WeightPublisher(Publisher):
    """Publishes versioned weights to a set of servers. See the module docstring for the steps; what it shares
    with the adapters' publisher: :class:`bridge.publisher.lifecycle.Publisher`.

    ``publish(source, version)``, collective (every trainer rank calls it), returns a :class:`PublishResult` (the
    same figures on every rank), or raises the same error on every rank:

    - VersionError: ``version`` is older than the last published one, or equal with other weights;
    - SyncError / SyncTimeout / ConfigError: the sync failed; servers keep their previous version;
    - KeyboardInterrupt / SystemExit (only on the rank it came to, the others raise SyncError): Ctrl-C, SIGTERM or an
      interrupt raised in a step, after the same clean-up (:mod:`bridge.publisher.interrupts`).
    """

    config_class = PublisherConfig

    def __init__(self, config: PublisherConfig | None = None, **kwargs):
        super().__init__(config, kwargs)
        config = self.config
        self._fleet = None  # rank 0: where the servers are found, which answer, which are in rotation
        self._kind = transport_class(config.transport)
        self._encoding = encoding_class(config.encoding)(config, self._rank, self._agree.world)
        self._versions = Versions(self._encoding)  # the last version, and what tells a retry of it safe
        self._transport: Transport | None = None  # rank 0 only, built at the first publish
        self._sink: Sink | None = None  # what receives the buckets gathered to this rank (every rank), built with it
        self._gather_group = None  # the group the flat gathers run on, bounded by group_timeout
        self._guard = None  # rank 0: the fleet's guard between publishes (bridge.fleet.guard), from the first commit
        sessions = config.session_options  # real SGLang's labels are recorded where its writer lock lives
        self._labels = Labels(self.run_id, sessions.writer_lock if sessions is not None else None)

    # ---------------------------------------------------------------- public API

    @property
    def servers(self):
        """The :class:`bridge.client.ServerGroup` of the last publish's servers, the ones that answered
        (rank 0 only talks to them; None elsewhere and before the first publish)."""
        return self._fleet.group if self._fleet is not None else None

    def _publish(self, source: WeightSource | torch.nn.Module | CheckedSource, version: int,
                 refused: str | None = None) -> PublishResult:
        """One sync: the five steps, each agreed by every rank (see the module docstring). A sync that a server
        refused for its encoding before applying anything is published again at once, the same version with every
        tensor (:meth:`bridge.publisher.versions.Versions.encoding_refused`)."""
        t0 = time.perf_counter()
        source = check_source(source)
        plan, began = None, False
        try:
            plan = self._prepare(source, version, refused or self._versions.forced)
            began = True
            plan = self._begin(plan)
            with PeakMemory() as memory:
                transfer = self._send(plan)
            reports = self._settle(transfer)
            outcome = self._commit(plan, reports, max(memory.extra_bytes, memory.device_extra_bytes))
        except BridgeError as e:
            self._ended(plan, committed=False)
            failed = self._failed(version, e, began)
            SYNC.failed(self.config.transport, e.interrupt or failed)
            if isinstance(e, DeltaBaseMismatch) and e.interrupt is None and refused is None:
                return self._publish(source, version, self._versions.encoding_refused(failed))
            raise_agreed(e, failed)
        except BaseException as e:  # outside every step (a second Ctrl-C, a bug): leave, and clean up alone
            self._ended(plan, committed=False)
            SYNC.failed(self.config.transport, e)
            self._leave(e, began)
            raise
        self._ended(plan, committed=True)
        self._guard_fleet()
        result = self._result(plan, outcome, time.perf_counter() - t0)
        SYNC.committed(result)
        return result

    def _result(self, plan: Plan, outcome: dict, seconds: float) -> PublishResult:
        enc = plan.report()
        result = PublishResult(
            version=plan.version, transport=self.config.transport,
            bytes=enc.bytes if enc.bytes is not None else outcome.get("bytes", plan.nbytes),
            seconds=seconds, buckets=len(plan.buckets), servers=outcome["servers"],
            path=outcome.get("path"), retried=plan.retried or outcome.get("retried", False),
            peak_extra_bytes=outcome["peak"], phases=dict(outcome.get("phases") or {}), encoding=enc.encoding, anchor_reason=enc.anchor_reason,
            changed_fraction=enc.changed_fraction, base_bytes=enc.base_bytes,
        )
        logger.log(
            logging.INFO if self._rank == 0 else logging.DEBUG,
            "published version %d by %s (%s): %s in %d buckets in %.2f s, %.2f GB/s, peak extra memory %s%s",
            plan.version, self.config.transport, result.encoding, fmt_bytes(result.bytes), result.buckets,
            result.seconds, result.gbps, fmt_bytes(result.peak_extra_bytes),
            " (retry of identical weights)" if result.retried else "",
        )
        return result

    def _ended(self, plan: Plan | None, committed: bool) -> None:
        """Every rank: the sync committed or failed; the version record and the encoding learn it."""
        if committed:
            self._versions.committed(plan.version)
        else:
            self._versions.failed()
        self._encoding.end(plan, committed)

    def close(self) -> None:
        """Tear the weight-update group down on both sides and stop background work, within
        ``CLOSE_WAIT_S`` (a server that does not answer is left to a background thread)."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self._guard is not None:
            self._guard.stop(CLOSE_WAIT_S / 2)
            self._guard = None
        while pending_aborts:  # a clean-up that outlived its sync: let it resume the servers it can
            pending_aborts.pop().join(max(0.0, deadline - time.monotonic()))
        transport, sink, servers = self._transport, self._sink, self._fleet
        self._transport = self._sink = self._fleet = None
        self._labels.close()

        def release() -> None:
            for piece in (transport, sink, servers):
                if piece is not None:
                    try:
                        piece.close()
                    except Exception as e:  # closing is best effort; the sync's outcome is already known
                        logger.warning("closing the publisher: %s", e)

        worker = threading.Thread(target=release, name="wsync-close", daemon=True)
        worker.start()
        self._drop_gather_group()
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            logger.warning("closing the publisher: a server did not answer within %g s; left to a background thread",
                           CLOSE_WAIT_S)

    # ---------------------------------------------------------------- the steps

    def _step(self, name: str, on_rank0, bound: float, on_every_rank=None, collect=None) -> list:
        """Run one step (``on_every_rank`` here, then ``on_rank0`` on rank 0) and agree on the outcome;
        returns what ``collect()`` gave on each rank (None without it)."""

        def run():
            failpoint(name, self._rank)
            if on_every_rank is not None:
                on_every_rank()
            if self._rank == 0:
                on_rank0()
            return collect() if collect is not None else None

        return self._step_on_every_rank(name, run, bound, on_failure=self._give_back)

    def _give_back(self) -> None:
        """This rank's own step failed, so the sync cannot complete: on rank 0, give the servers back now
        (resumed, sessions discarded) instead of after the other ranks answered, which for a dead rank
        is the step's whole bound. The abort after the agreement then finds nothing left to do."""
        if self._rank == 0 and self._transport is not None and self._transport.gives_back_early:
            status = abort_within(self._transport, "rank 0's step failed", ABORT_WAIT_S)
            logger.debug("servers given back before the agreement: %s", status)

    def _prepare(self, source: CheckedSource, version: int, forced: str | None) -> Plan:
        """Step "prepare" (every rank): plan, the encoding's summaries, the gather group; decide retry vs new weights."""
        cfg = self.config
        versions = self._versions
        retry = versions.is_retry(version)
        mine: list = []
        self._check_every_rank_called(version)

        def prepare():
            failpoint("prepare", self._rank)
            source.require(self._kind.source_needs, f"the {cfg.transport} transport")
            specs = self._wire_specs(source)
            mine.append(specs)
            labels, servers = None, False
            if self._rank == 0:
                if cfg.metrics_port is not None:  # here, in a step: a port another process holds fails every rank
                    serve_metrics(cfg.metrics_port)
                self._open_servers()
                servers = self._transport.servers is not None  # checked once the encoding planned what travels
                labels = None if retry else self._labels.served(
                    self._fleet, self._kind, version, specs, self.config.new_run and self._versions.last is None)
            if self._sink is None:
                self._sink = self._kind.sink(cfg, self._transport, self._rank, self._agree.world)
            # A retry is safe only with the weights of the last version: each rank tells for its own shards, before
            # the encoding's prepare moves anything. A new version's fingerprint is taken for the next retry.
            differs = versions.differs(source, specs) if retry else None
            summary = self._encoding.prepare(source, specs)
            ours = specs if self._rank == 0 else None  # rank 0's are used
            if not retry:
                versions.fingerprint(source)
            return ours, differs, summary, labels, servers

        results = self._step_on_every_rank("prepare", prepare, cfg.group_timeout + cfg.http_timeout)
        specs = results[0][0]
        plan = Plan(version=version, buckets=plan_buckets(specs, cfg.bucket_bytes), source=source, forced=forced)
        plan = plan.planned(self._encoding.plan(plan, [r[2] for r in results]))
        if retry:
            why = [f"rank {r}: {d}" for r, (_, d, _, _, _) in enumerate(results) if d]
            if why:
                raise versions.refused(version, why)
            plan = replace(plan, retried=True)
        labels, servers = results[0][3], results[0][4]
        if servers or labels is not None:
            checked = self._check(plan, mine[0], labels)
            if checked is not None:
                plan = replace(plan, retried=plan.retried or checked.retried, served_digest=checked.served_digest,
                               record_labels=checked.record_labels)
        return self._with_gather_group(plan)

    def _check(self, plan: Plan, specs: list[ParamSpec], labels: dict | None) -> LabelCheck | None:
        """Step "check", once the encoding planned what travels (``plan.buckets``), before any server is paused:
        rank 0 checks that the servers serve it (:mod:`bridge.publisher.preflight`), and every rank adds its part of the
        digest the servers that already serve this version are compared with (:meth:`bridge.publisher.labels.Labels.check`)."""
        from bridge.publisher.labels import local_digest_part

        def check():
            if self._rank == 0 and self._transport.servers is not None:
                sent = [s for b in plan.buckets for s in b.specs]
                check_servers_serve(sent, self._transport.servers.clients, self.config.serving_dtype)
            return local_digest_part(plan.source, specs) if labels is not None else None

        cfg = self.config
        parts = self._step_on_every_rank("check", check, cfg.group_timeout + cfg.http_timeout)
        return self._labels.check(plan, parts, labels) if labels is not None else None

    def _begin(self, plan: Plan) -> Plan:
        """Step "begin" (rank 0): the transport opens the sync and the encoding decides; every rank's sink starts.
        The plan with the encoding's decision."""
        box: list = [None]

        def begin() -> None:
            box[0] = (self._transport.begin(plan), self._encoding.decide(plan, self._transport.servers))

        opened, decision = self._step("begin", lambda: begin(), self._begin_bound(), collect=lambda: box[0])[0]
        plan = replace(plan, decision=decision)
        self._sink.begin(opened, plan)
        return plan

    def _settle(self, transfer: Transfer) -> list:
        """Step "settle" (every rank): every sink waits for what it sent and reports (each rank's vote on the
        commit: failpoint "settle"); the fingerprint of this version is taken by then."""

        def settle():
            self._versions.fingerprinted()
            return self._sink.settle()

        return self._step("settle", lambda: None, self._bucket_bound(), on_every_rank=transfer.sent, collect=settle)

    def _commit(self, plan: Plan, reports: list, peak: int) -> dict:
        """Step "commit" (rank 0): the version goes live, given every rank's report; once it is, it is live."""
        version = plan.version

        def commit() -> dict | None:
            if self._rank != 0:
                return None
            failpoint("commit", 0)
            self._labels.forget_stale(plan)
            outcome = self._transport.commit(plan, reports)
            self._labels.record(plan, outcome.get("servers", {}))
            if self._fleet is not None:  # who took it: in rotation; who did not: out (or too few: raise)
                outcome["servers"] = self._fleet.committed(version, outcome.get("servers", {}))
            return {**outcome, "peak": peak}

        return self._step_on_every_rank("commit", commit, self._commit_bound(), on_failure=self._give_back)[0]

    def _check_every_rank_called(self, version: int) -> None:
        """Every rank is in publish(): a rank that does not call it is named within ``group_timeout``
        (:func:`bridge.publisher.bounded.publish_call_bound`), before anything else waits for it."""
        cfg = self.config

        def missing(ranks: list[int]) -> str:
            return (f"trainer rank(s) {ranks} did not call publish() within group_timeout={cfg.group_timeout:g} s "
                    f"of rank {self._rank} (version {version}): publish() is collective, every trainer rank must "
                    "call it with the same version; raise group_timeout if a rank only gets there later")

        self._agree.exchange("publish() call", version, timeout=publish_call_bound(cfg), missing=missing)

    def _open_servers(self) -> None:
        """Rank 0: the servers of this sync, found and probed again (:class:`bridge.fleet.Fleet`), and the
        transport over them."""
        cfg = self.config
        if self._fleet is None and (cfg.servers or cfg.server_registry):
            from bridge.fleet import Fleet

            self._fleet = Fleet(cfg, self.run_id, new_run=cfg.new_run)
        snapshot = self._transport.newest_snapshot if self._transport is not None else None
        servers = self._fleet.prepare(snapshot) if self._fleet is not None else None
        if self._transport is None:
            self._transport = self._kind(cfg, servers)
        else:
            self._transport.use_servers(servers)

    def _guard_fleet(self) -> None:
        """Rank 0, after the first commit: the fleet's guard between publishes (:mod:`bridge.fleet.guard`), where
        the fleet has a rotation to keep a server behind its version out of."""
        fleet = self._fleet
        if self._guard is None and fleet is not None and fleet.has_rotation and self.config.guard_every > 0:
            from bridge.fleet.guard import FleetGuard

            transport = self._transport
            self._guard = FleetGuard(fleet, self.config.guard_every, self._busy,
                                     transport.newest_snapshot if transport is not None else None)

    def _with_gather_group(self, plan: Plan) -> Plan:
        if self._agree.world > 1 and self._gather_group is None:
            self._step("gather group", lambda: None, self.config.group_timeout, on_every_rank=self._make_gather_group)
        return plan

    def _send(self, plan: Plan) -> Transfer:
        """Steps "bucket k" (every rank): the encoding's buckets, each gathered to one rank and handed to its sink
        (rank 0's by default, which waits for bucket k-1 to arrive, then sends k)."""
        transfer = self._encoding.buckets(plan)
        last = len(transfer.buckets) - 1
        bar = progress_bar(self.config.progress and self._rank == 0, transfer.nbytes, f"sync v{plan.version}")
        try:
            for k, out in enumerate(transfer.buckets):
                version = plan.version if k == last else None
                self._step_on_every_rank(out.step, functools.partial(self._send_bucket, k, out, version), self._bucket_bound(),
                             on_failure=self._give_back)
                if self._rank == 0:
                    bar.update(out.bucket.nbytes)
        finally:
            bar.close()
        return transfer

    def _send_bucket(self, k: int, out: Outgoing, version: int | None) -> None:
        """Every rank, bucket ``k``: its bytes into the buffer of the rank it goes to, whose sink sends it."""
        dst = self._sink.owner(k) if out.to_owner else 0
        sink = self._sink if self._rank == dst else None
        try:
            try:
                failpoint(out.step.replace(" ", ":"), self._rank)
                buf = sink.buffer(k, out.bucket) if sink is not None else None
            except BaseException:
                # Still take part in the bucket's gathers (receiving nothing), so the other ranks are
                # not left waiting in them for group_timeout; the agreement then fails the step at once.
                out.fill(None, dst, self._gather_group)
                raise
            out.fill(buf, dst, self._gather_group)
            if sink is not None:
                sink.send(k, out.bucket, buf, version)
        except BaseException as e:
            # Failed inside the step: leave the group now. Under gloo the ranks waiting in a gather or a
            # receive with us get "connection closed" at once instead of waiting group_timeout, and do
            # the same in turn; the agreement then names this rank's error, which came first.
            note_failure_time(e)
            self._drop_gather_group()
            raise

    def _failed(self, version: int, error: BridgeError, began: bool) -> BridgeError:
        """After an agreed failure: rank 0 aborts the transport; the error every rank raises."""
        status = ""
        broken = error.agreement_broken
        if began and self._sink is not None:
            self._abort_sinks()
            if self._sink.stops_before_abort and not broken:
                # Every rank's sink stopped and removed its files; only then does rank 0 remove what
                # they were in (a late file would otherwise be left behind there).
                try:
                    self._agree.exchange("sinks stopped", None, timeout=ABORT_WAIT_S + SLACK_S)
                except BridgeError:
                    pass
        if self._rank == 0 and began and self._transport is not None:
            status = abort_within(self._transport, str(error), ABORT_WAIT_S)
            if self._fleet is not None:  # torn servers: out of rotation until a publish repairs them
                status = "; ".join(filter(None, [status, self._fleet.failed(self._transport.held())]))
        if began:
            # A gather may have been left half-done on some rank: the next publish builds a new group.
            self._drop_gather_group()
        if not broken:
            try:  # every rank reports what the servers serve now, as rank 0 saw it
                status = self._agree.exchange("abort", status, timeout=self.config.http_timeout * 2 + SLACK_S)[0]
            except BridgeError:
                pass
        text = f"{self.config.transport} sync of version {version} failed: {error}" + (f"; {status}" if status else "")
        return type(error)(text)

    def _leave(self, error: BaseException, began: bool) -> None:
        """``error`` escaped the steps on this rank: the other ranks are told (they fail at their next
        exchange), a gather they wait in is left, and rank 0 aborts the sync, each within its bound."""
        logger.warning("rank %d leaves the sync: %s: %s", self._rank, type(error).__name__, describe(error))
        note_failure_time(error)
        self._drop_gather_group()
        self._agree.leave(error)
        if began and self._sink is not None:
            self._abort_sinks()
        if self._rank == 0 and began and self._transport is not None:
            status = abort_within(self._transport, f"{type(error).__name__} on rank 0", ABORT_WAIT_S)
            if self._fleet is not None:
                self._fleet.failed(self._transport.held())
            if status:
                logger.warning("%s", status)

    # ---------------------------------------------------------------- helpers

    def _abort_sinks(self) -> None:
        self._sink.abort(ABORT_WAIT_S)

    def _make_gather_group(self) -> None:
        self._gather_group = dist.new_group(backend=self.config.backend or default_backend(),
                                            timeout=timedelta(seconds=self.config.group_timeout))

    def _drop_gather_group(self) -> None:
        group, self._gather_group = self._gather_group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # a group broken by a failed gather may not destroy cleanly
                logger.debug("destroying the gather group failed: %s", e)

    def _wire_specs(self, source: CheckedSource) -> list[ParamSpec]:
        dtype = dtype_from_str(self.config.serving_dtype)
        # Only floating tensors are cast: integer buffers keep their dtype.
        return [s.with_dtype(dtype) if s.dtype.is_floating_point else s for s in source.param_specs()]

    def _begin_bound(self) -> float:
        cfg = self.config
        return cfg.group_timeout + 3 * cfg.http_timeout  # group (+ its HTTP answers), pause, session

    def _bucket_bound(self) -> float:
        return bucket_bound(self.config)

    def _commit_bound(self) -> float:
        return self._kind.commit_seconds(self.config)
