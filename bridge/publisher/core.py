"""Versioned weight publishing: one sync of a trainer's weights into every server.

A :class:`WeightPublisher` is created once by the training script (on every rank) and
``publish(source, version)`` is called collectively by every trainer rank after each step. It drives
one sync through the same steps whatever the transport (:mod:`bridge.transports`, registered by name);
after each step every rank learns every rank's outcome (:mod:`bridge.publisher.agreement`):

``_publish`` is these five steps, each one call:

1. **prepare** (every rank): the wire specs and bucket plan, and the encoding's summary (``Encoding.prepare``,
   then ``plan`` with every rank's, which may plan the buckets again from what it sends); then, in a step
   "check", rank 0 asks the servers whether they serve what the plan sends (:mod:`bridge.publisher.preflight`). On a
   retry of the last version each rank tells whether its shards still hold the weights it published then
   (:mod:`bridge.publisher.versions`: a digest of them, or the encoding's ``differs`` for one that keeps them, the
   delta's base); with every rank's answer, every rank decides the same thing: an older version, or the
   last version with other weights, is a :class:`VersionError` before any byte moves; the last version with
   the same weights is a safe retry.
2. **begin** (rank 0): the transport opens the sync (process group, pause, update sessions, snapshot) and
   the encoding decides (``Encoding.decide``: a delta or an anchor, say), which every rank learns.
3. **bucket k** (every rank): the encoding's buckets (``Encoding.buckets``), one agreed step each, in one
   loop: every rank fills the bucket's bytes into one rank's buffer (for ``full``, a few flat gathers on a
   group whose timeout is ``group_timeout``), and that rank's sink sends it (:mod:`bridge.transports.sink`,
   chosen by ``Transport.sink``). By default it is rank 0, whose sink is its transport: it waits for bucket
   k-1 to arrive, then sends bucket k (so the gather of k overlaps the transfer of k-1, and rank 0 holds
   about two buckets at most); the last bucket carries the version. A transport may give every rank a sink
   of its own instead (a writer of its own shards, say).
4. **settle** (every rank): every sink waits until what it sent arrived and reports, and every rank says
   whether it may commit.
5. **commit** (rank 0): the version goes live, given every rank's report.

Ctrl-C and SIGTERM are held until the step in progress ends, then fail the sync the same way before
they take effect (:mod:`bridge.publisher.interrupts`). Any exception on any rank, of any type, in any step, makes
every rank raise the same error (the first
failure's class when it is one of the project's, else :class:`SyncError` naming the rank, the step and
the cause) within the step's bound; every sink aborts, the encoding undoes its prepare (``Encoding.end``),
and rank 0 calls the transport's ``abort``: every server keeps
serving its previous version, unpaused, with no open session; a snapshot that was not complete is
removed, never announced. A trainer that catches the error can publish again.

Version semantics: versions are integers, strictly increasing per publisher (and, for a transport that
announces them, per (experiment, trial) in name resolution). A version whose publish failed was never
completed, so retrying it is allowed.

Example (one process, a reference server started with ``wsync serve --preset tiny``):

    >>> from bridge import WeightPublisher, PublisherConfig          # doctest: +SKIP
    >>> pub = WeightPublisher(PublisherConfig(servers=["http://127.0.0.1:30000"]))  # doctest: +SKIP
    >>> result = pub.publish(model, version=1)                       # doctest: +SKIP
    >>> result.version, result.servers                               # doctest: +SKIP
    (1, {'http://127.0.0.1:30000': 'ok'})
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bridge.buckets import plan_buckets
from bridge.config import PublisherConfig
from bridge.encodings import encoding_class
from bridge.encodings.base import Outgoing, Transfer
from bridge.errors import BridgeError, ConfigError, SyncTimeout, VersionError
from bridge.failpoints import failpoint
from bridge.log import fmt_bytes, get_logger, progress_bar
from bridge.metrics import SYNC, serve_metrics
from bridge.process_group import default_backend
from bridge.publisher.agreement import Agreement, describe, note_failure_time
from bridge.publisher.bounded import call_within
from bridge.publisher.interrupts import held
from bridge.publisher.memory import PeakMemory
from bridge.publisher.preflight import check_servers_serve
from bridge.publisher.result import PublishResult
from bridge.publisher.versions import Versions
from bridge.sources import CheckedSource, WeightSource, check_source
from bridge.tensors import ParamSpec, dtype_from_str
from bridge.transports import Plan, Sink, Transport, transport_class

__all__ = ["PublishResult", "PublisherConfig", "WeightPublisher", "bucket_bound", "dead_rank_bound", "publish_call_bound"]

logger = get_logger(__name__)

ABORT_WAIT_S = 5.0
"""The most a failed sync waits for its clean-up (resume, discard sessions) before raising."""

CLOSE_WAIT_S = 5.0
"""The most ``close()`` takes."""

SLACK_S = 10.0
"""Added to a step's own bound before the other ranks give up waiting for a rank (it died or hangs)."""


class WeightPublisher:
    """Publishes versioned weights to a set of servers. See the module docstring for the steps."""

    def __init__(self, config: PublisherConfig | None = None, **kwargs):
        if config is None:
            config = PublisherConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either a PublisherConfig or keyword arguments, not both")
        self.config = config
        self._agree = Agreement.of_default_group()
        self._rank = self._agree.rank
        self._fleet = None  # rank 0: where the servers are found, which answer, which are in rotation
        self._kind = transport_class(config.transport)
        self._encoding = encoding_class(config.encoding)(config, self._rank, self._agree.world)
        self._versions = Versions(self._encoding)  # the last version, and what tells a retry of it safe
        self._transport: Transport | None = None  # rank 0 only, built at the first publish
        self._sink: Sink | None = None  # what receives the buckets gathered to this rank (every rank), built with it
        self._others: list[Sink] = []  # rank 0: other sinks this sync's buckets went to (a delta for real SGLang)
        self._gather_group = None  # the group the flat gathers run on, bounded by group_timeout
        self._labels = None  # rank 0: the records of what real SGLang servers serve (bridge.publisher.labels)

    # ---------------------------------------------------------------- public API

    @property
    def servers(self):
        """The :class:`bridge.client.ServerGroup` of the last publish's servers, the ones that answered
        (rank 0 only talks to them; None elsewhere and before the first publish)."""
        return self._fleet.group if self._fleet is not None else None

    @property
    def run_id(self) -> str:
        """The run this publisher's versions belong to, as servers and watchers see it: ``experiment/trial``."""
        return f"{self.config.experiment}/{self.config.trial}"

    def publish(self, source: WeightSource | torch.nn.Module, version: int) -> PublishResult:
        """Publish ``source``'s weights as ``version``. Collective: every trainer rank calls it.

        Returns:
            A :class:`PublishResult` (the same figures on every rank).
        Raises (the same error on every rank):
            VersionError: ``version`` is older than the last published one, or equal with other weights.
            SyncError / SyncTimeout / ConfigError: the sync failed; servers keep their previous version.
            KeyboardInterrupt / SystemExit (only on the rank it came to, the others raise SyncError): Ctrl-C,
                SIGTERM or an interrupt raised in a step, after the same clean-up (:mod:`bridge.publisher.interrupts`).
        """
        self._versions.check(version)
        checked = check_source(source)
        with held(self._rank):  # Ctrl-C / SIGTERM: finish the step, clean up on every rank, then take effect
            return self._versions.run(lambda forced: self._publish(checked, version, forced))

    @property
    def last_version(self) -> int | None:
        """The last version this publisher published (None before the first)."""
        return self._versions.last

    def _publish(self, source: CheckedSource, version: int, forced: str | None) -> PublishResult:
        """One sync: the five steps, each agreed by every rank (see the module docstring)."""
        t0 = time.perf_counter()
        plan, began = None, False
        try:
            plan = self._prepare(source, version, forced)
            began = True
            self._begin(plan)
            with PeakMemory() as memory:
                transfer = self._send(plan)
            reports = self._settle(transfer)
            outcome = self._commit(plan, reports, max(memory.extra_bytes, memory.device_extra_bytes))
        except BridgeError as e:
            self._ended(plan, committed=False)
            failed = self._failed(version, e, began)
            SYNC.failed(self.config.transport, e.interrupt or failed)
            if e.interrupt is not None:  # raised in a step on this rank: it ends the program, after the clean-up
                raise e.interrupt from failed
            raise failed from None
        except BaseException as e:  # outside every step (a second Ctrl-C, a bug): leave, and clean up alone
            self._ended(plan, committed=False)
            SYNC.failed(self.config.transport, e)
            self._leave(e, began)
            raise
        self._ended(plan, committed=True)
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
            peak_extra_bytes=outcome["peak"], phases=plan.phases, encoding=enc.encoding, anchor_reason=enc.anchor_reason,
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
        while _pending_aborts:  # a clean-up that outlived its sync: let it resume the servers it can
            _pending_aborts.pop().join(max(0.0, deadline - time.monotonic()))
        transport, sink, servers = self._transport, self._sink, self._fleet
        self._transport = self._sink = self._fleet = None
        labels, self._labels = self._labels, None
        if labels is not None:
            labels.close()

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

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

        return self._agreed(name, run, bound + SLACK_S)

    def _agreed(self, name: str, fn, timeout: float) -> list:
        """One step of the sync through the agreement; rank 0 gives the servers back as soon as its own
        part fails (:meth:`_give_back`)."""
        return self._agree.step(name, fn, timeout=timeout, on_failure=self._give_back)

    def _give_back(self) -> None:
        """This rank's own step failed, so the sync cannot complete: on rank 0, give the servers back now
        (resumed, sessions discarded) instead of after the other ranks answered, which for a dead rank
        is the step's whole bound. The abort after the agreement then finds nothing left to do."""
        if self._rank == 0 and self._transport is not None and self._transport.gives_back_early:
            status = _abort_within(self._transport, "rank 0's step failed", ABORT_WAIT_S)
            logger.debug("servers given back before the agreement: %s", status)

    def _prepare(self, source: CheckedSource, version: int, forced: str | None) -> Plan:
        """Step "prepare" (every rank): plan, the encoding's summaries, the gather group; decide retry vs new weights."""
        cfg = self.config
        versions = self._versions
        retry = versions.is_retry(version)
        mine: list = []
        self._meet(version)

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
                labels = None if retry else self._served_labels(version, specs)
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

        results = self._agree.step("prepare", prepare, timeout=cfg.group_timeout + cfg.http_timeout + SLACK_S)
        specs = results[0][0]
        plan = Plan(version=version, buckets=plan_buckets(specs, cfg.bucket_bytes), source=source, forced=forced)
        self._encoding.plan(plan, [r[2] for r in results])
        if retry:
            why = [f"rank {r}: {d}" for r, (_, d, _, _, _) in enumerate(results) if d]
            if why:
                raise versions.refused(version, why)
            plan.retried = True
        labels, servers = results[0][3], results[0][4]
        if servers or labels is not None:
            self._check(plan, mine[0], labels)
        return self._with_gather_group(plan)

    def _check(self, plan: Plan, specs: list[ParamSpec], labels: dict | None) -> None:
        """Step "check", once the encoding planned what travels (``plan.buckets``), before any server is paused:
        rank 0 checks that the servers serve it (:mod:`bridge.publisher.preflight`), and every rank adds its part of the
        digest the servers that already serve this version are compared with (:meth:`_check_labels`)."""
        from bridge.publisher.labels import local_digest_part

        def check():
            if self._rank == 0 and self._transport.servers is not None:
                sent = [s for b in plan.buckets for s in b.specs]
                check_servers_serve(sent, self._transport.servers.clients, self.config.serving_dtype)
            return local_digest_part(plan.source, specs) if labels is not None else None

        cfg = self.config
        parts = self._agree.step("check", check, timeout=cfg.group_timeout + cfg.http_timeout + SLACK_S)
        if labels is not None:
            self._check_labels(plan, parts, labels)

    def _begin(self, plan: Plan) -> None:
        """Step "begin" (rank 0): the transport opens the sync and the encoding decides; every rank's sink starts."""
        box: list = [None]

        def begin() -> None:
            box[0] = (self._transport.begin(plan), self._encoding.decide(plan, self._transport.servers))

        opened, plan.decision = self._step("begin", lambda: begin(), self._begin_bound(), collect=lambda: box[0])[0]
        self._sink.begin(opened, plan)

    def _settle(self, transfer: Transfer) -> list:
        """Step "settle" (every rank): every sink waits for what it sent and reports (each rank's vote on the
        commit: failpoint "settle"); the fingerprint of this version is taken by then."""

        def settle():
            for sink in self._others:
                sink.settle()
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
            self._forget_stale_labels(plan)
            outcome = self._transport.commit(plan, reports)
            self._record_labels(plan, outcome.get("servers", {}))
            if self._fleet is not None:  # who took it: in rotation; who did not: out (or too few: raise)
                outcome["servers"] = self._fleet.committed(version, outcome.get("servers", {}))
            return {**outcome, "peak": peak}

        return self._agreed("commit", commit, self._commit_bound() + SLACK_S)[0]

    def _served_labels(self, version: int, specs: list[ParamSpec]) -> dict | None:
        """Rank 0, in the prepare step: the servers that already serve ``version``, which this publisher did not
        publish, with the digest of what they serve (or why it cannot be known), and the real SGLang servers
        whose label this sync records at commit (:mod:`bridge.publisher.labels`); None when neither."""
        fleet = self._fleet
        if fleet is None or fleet.group is None:
            return None
        label, sets = str(version), self._kind.sets_labels
        new_run = self.config.new_run and self._versions.last is None  # a new run starts over: nothing to compare
        check: dict[str, tuple[str | None, str | None]] = {}
        record: list[str] = []
        for c in fleet.group.clients:
            real = not c.is_reference_server
            if real and sets:
                record.append(c.url)
            if new_run or fleet.served.get(c.url) != label:
                continue
            if not real:  # it digests what it serves, on request
                got = c.weights_digest([s.name for s in specs])
                if str(got.get("weight_version")) == label and got.get("run_id") in (None, self.run_id):
                    check[c.url] = (got.get("digest"), None)
            elif sets:  # real SGLang keeps nothing: the record written when it was labelled
                records = self._label_records()
                rec = records.read(c.url)
                if rec is None or str(rec.get("version")) != label:
                    check[c.url] = (None, f"no digest of its weights is recorded in {records.url}; its label was set "
                                          "by a trainer whose record lives elsewhere, or outside wsync")
                elif rec.get("run_id") in (None, self.run_id):
                    check[c.url] = (rec.get("digest"), None if rec.get("digest") else
                                    "the trainer that labelled it could not take the digest of its weights")
        return {"check": check, "record": record} if check or record else None

    def _check_labels(self, plan: Plan, parts: list, labels: dict) -> None:
        """Every rank, in the check step: the digest of these weights as servers serve them (``parts``: each rank's
        of its own rows), compared with what the servers that already serve this version serve. Other weights, or
        weights that cannot be compared, are a VersionError on every rank before anything moves; the same
        weights are a safe retry (:mod:`bridge.publisher.labels`)."""
        from bridge.publisher.labels import refusal

        digest = None if any(p is None for p in parts) else f"{sum(parts) % (1 << 64):016x}"
        problems = []
        for url, (served, why) in labels["check"].items():
            if why is None and digest is None:
                why = "the weight source has no local_shards(), so the digest of its weights cannot be taken"
            if why is not None or served != digest:
                problems.append(refusal(url, plan.version, why))
        if problems:
            raise VersionError("; ".join(problems))
        plan.retried = plan.retried or bool(labels["check"])
        plan.served_digest, plan.record_labels = digest, list(labels["record"])

    def _label_records(self):
        """Rank 0: where the labels of real SGLang servers are recorded (:class:`bridge.publisher.labels.LabelRecords`)."""
        if self._labels is None:
            from bridge.publisher.labels import LabelRecords

            sessions = self.config.session_options  # the lock of a transport that updates servers in sessions
            self._labels = LabelRecords(sessions.writer_lock if sessions is not None else None)
        return self._labels

    def _forget_stale_labels(self, plan: Plan) -> None:
        """Rank 0, before the commit: a record of this version with other weights (a new run publishes it again) is
        removed first, so that a record that cannot be written after the commit never vouches for the weights the
        commit replaced. A failure here fails the sync before anything is labelled."""
        for url in plan.record_labels:
            rec = self._label_records().read(url)
            if rec is not None and str(rec.get("version")) == str(plan.version) and rec.get("digest") != plan.served_digest:
                self._label_records().forget(url)

    def _record_labels(self, plan: Plan, servers: dict[str, str]) -> None:
        """Rank 0, after the commit: record the label of each real SGLang server that took the version. A record
        that cannot be written is logged: that label then cannot be compared, and is refused as such."""
        for url in plan.record_labels:
            if servers.get(url) != "ok":
                continue
            try:
                self._label_records().write(url, str(plan.version), plan.served_digest, self.run_id)
            except BridgeError as e:
                logger.warning("could not record the digest of version %d served by %s: %s", plan.version, url, e)

    def _meet(self, version: int) -> None:
        """Every rank is in publish(): a rank that does not call it is named within ``group_timeout``
        (:func:`publish_call_bound`), before anything else waits for it."""
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

            self._fleet = Fleet(cfg, self.run_id)
        snapshot = self._transport.newest_snapshot if self._transport is not None else None
        servers = self._fleet.prepare(snapshot) if self._fleet is not None else None
        if self._transport is None:
            self._transport = self._kind(cfg, servers)
        else:
            self._transport.use_servers(servers)

    def _with_gather_group(self, plan: Plan) -> Plan:
        if self._agree.world > 1 and self._gather_group is None:
            self._step("gather group", lambda: None, self.config.group_timeout, on_every_rank=self._make_gather_group)
        return plan

    def _send(self, plan: Plan) -> Transfer:
        """Steps "bucket k" (every rank): the encoding's buckets, each gathered to one rank and handed to its sink
        (rank 0's by default, which waits for bucket k-1 to arrive, then sends k)."""
        self._others = []
        transfer = self._encoding.buckets(plan)
        last = len(transfer.buckets) - 1
        bar = progress_bar(self.config.progress and self._rank == 0, transfer.nbytes, f"sync v{plan.version}")
        try:
            for k, out in enumerate(transfer.buckets):
                version = plan.version if k == last else None
                self._agreed(out.step, lambda k=k, o=out, v=version: self._one(k, o, v), self._bucket_bound() + SLACK_S)
                if self._rank == 0:
                    bar.update(out.bucket.nbytes)
        finally:
            bar.close()
        return transfer

    def _one(self, k: int, out: Outgoing, version: int | None) -> None:
        """Every rank, bucket ``k``: its bytes into the buffer of the rank it goes to, whose sink sends it."""
        dst = self._sink.owner(k) if out.to_owner else 0
        sink = (out.sink or self._sink) if self._rank == dst else None
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
                if sink is not self._sink and sink not in self._others:
                    self._others.append(sink)
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
            status = _abort_within(self._transport, str(error), ABORT_WAIT_S)
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
            status = _abort_within(self._transport, f"{type(error).__name__} on rank 0", ABORT_WAIT_S)
            if self._fleet is not None:
                self._fleet.failed(self._transport.held())
            if status:
                logger.warning("%s", status)

    # ---------------------------------------------------------------- helpers

    def _abort_sinks(self) -> None:
        for sink in [*self._others, self._sink]:
            sink.abort(ABORT_WAIT_S)

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


def bucket_bound(config: PublisherConfig) -> float:
    """The most one bucket step takes: its gather, then the previous bucket's arrival."""
    return 2 * config.group_timeout + config.http_timeout


def publish_call_bound(config: PublisherConfig) -> float:
    """Seconds a rank in publish() waits for the other ranks to call it too, before it fails naming the
    absent ranks: ``group_timeout``."""
    return config.group_timeout


def dead_rank_bound(config: PublisherConfig) -> float:
    """The most the other ranks take to raise when a trainer rank dies in the middle of a transfer: the
    bucket step's bound, the agreement's slack and the clean-up's wait; 2 x group_timeout + http_timeout
    + 15 s (docs/guarantees.md, "Bounded time"). The servers are given back at once when rank 0's own step fails
    (a gather with the dead rank does), without waiting that long."""
    return bucket_bound(config) + SLACK_S + ABORT_WAIT_S


def _abort_within(transport: Transport, reason: str, seconds: float) -> str:
    """Run ``transport.abort`` for at most ``seconds``; a server that does not answer (stopped, say)
    must not delay the error. Whatever is left goes on in the background (it is idempotent cleanup)."""

    def run() -> str:
        try:
            return transport.abort(reason)
        except Exception as e:  # best effort by contract; never hide the cause behind it
            logger.warning("aborting the sync failed: %s", e)
            return ""

    try:
        return call_within(run, seconds, "aborting the sync", background=_pending_aborts, thread_name="wsync-abort")
    except SyncTimeout:  # (run itself never raises)
        return f"cleanup goes on in the background: a server did not answer within {seconds:g} s"


_pending_aborts: list[threading.Thread] = []
"""Clean-ups still running after their failed sync raised; ``close()`` gives them time to finish."""
