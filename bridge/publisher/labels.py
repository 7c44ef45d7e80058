"""A version label never names two sets of weights: what a publisher checks before it publishes the version a
server already serves, when it did not publish that version itself (a new trainer process of the same run).

The comparison is of one digest of the weights as servers serve them (:func:`bridge.digest.served_digest_part`:
linear in the served bytes, so each trainer rank adds its own rows and the sum does not depend on the sharding):

- the reference server computes it of the tensors it serves, on request (``/wsync/weights_checksum`` with
  ``digest``), and says which run its version came from;
- real SGLang keeps nothing of the kind, so the publisher records it at commit, per server, beside the run:
  ``wsync/served_label/<url>`` = ``{"version", "digest", "run_id"}`` in the name resolution of ``writer_lock``
  when one is set (etcd or a shared directory), else in the default directory under this host's temp folder
  (:data:`bridge.name_resolve.DEFAULT_URL`). A label with no record of its own (set outside wsync, or by a
  trainer whose record lives elsewhere) cannot be compared, and is refused as such.

A version of another run (``experiment/trial``) is another sequence: the check applies to the served version's
own run, or to an unknown one. ``new_run=True`` skips it (a new run starts over).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import quote

import torch

from bridge.digest import served_digest_part
from bridge.errors import BridgeError, NameEntryNotFound, VersionError
from bridge.log import get_logger

__all__ = ["LabelCheck", "Labels", "LabelRecords", "label_key", "local_digest_part", "refusal"]

logger = get_logger(__name__)


def label_key(url: str) -> str:
    """The name-resolution key of the record of the version real SGLang at ``url`` serves."""
    return f"wsync/served_label/{quote(url, safe='')}"


class LabelRecords:
    """The records of what real SGLang servers serve (see the module docstring); rank 0 only."""

    def __init__(self, url: str | None):
        from bridge.name_resolve import DEFAULT_URL, make_name_resolve

        self.url = url or DEFAULT_URL
        self._nr = make_name_resolve(self.url)

    def read(self, server: str) -> dict | None:
        try:
            rec = json.loads(self._nr.get(label_key(server)))
        except NameEntryNotFound:
            return None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    def write(self, server: str, version: str, digest: str, run_id: str) -> None:
        self._nr.add(label_key(server), json.dumps({"version": version, "digest": digest, "run_id": run_id}),
                     replace=True)

    def forget(self, server: str) -> None:
        try:
            self._nr.delete(label_key(server))
        except NameEntryNotFound:
            pass

    def close(self) -> None:
        self._nr.close()


@torch.no_grad()
def local_digest_part(source, specs: Sequence) -> int | None:
    """This rank's share of the served-weights digest of ``specs`` (wire specs: the serving dtype), from its own
    rows (``local_shards``), with no communication; None when the source has no ``local_shards``."""
    if source.local_shards is None:
        return None
    total = 0
    for sh in source.local_shards(specs):
        if sh.local is not None:
            total += served_digest_part(sh.spec.name, sh.local.to(sh.spec.dtype), sh.start)
    return total % (1 << 64)


def refusal(url: str, version: int, why: str | None) -> str:
    """The one line a refused publish says (``why`` None: the weights differ)."""
    fix = "publish a new version, or pass new_run=True to start a new run"
    if why is None:
        return f"server {url} already serves version {version} with other weights (published by another process); {fix}"
    return f"server {url} already serves version {version}, and its weights cannot be compared with these ({why}); {fix}"


@dataclass(frozen=True)
class LabelCheck:
    """What the check step learned of the servers that already serve this version (:meth:`Labels.check`)."""

    retried: bool = False
    """Servers serve these very weights under this version already: the sync is a safe retry."""
    served_digest: str | None = None
    """The digest of these weights as servers serve them, when it was taken."""
    record_labels: list[str] = field(default_factory=list)
    """Real SGLang servers whose label this sync records at commit, with ``served_digest``."""


class Labels:
    """One publisher's label checks (see the module docstring): rank 0 finds what to compare in the prepare step,
    every rank compares in the check step, rank 0 records real SGLang's labels around the commit."""

    def __init__(self, run_id: str, lock_url: str | None):
        """``lock_url``: the name resolution of a transport's writer lock, where the records live (None: the
        default directory)."""
        self.run_id, self._lock_url = run_id, lock_url
        self._kept: LabelRecords | None = None

    def close(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()

    def served(self, fleet, kind, version: int, specs: list, new_run: bool) -> dict | None:
        """Rank 0, in the prepare step: the servers that already serve ``version``, which this publisher did not
        publish, with the digest of what they serve (or why it cannot be known), and the real SGLang servers
        whose label this sync records at commit; None when neither."""
        if fleet is None or fleet.group is None:
            return None
        label, sets = str(version), kind.sets_labels
        check: dict[str, tuple[str | None, str | None]] = {}
        record: list[str] = []
        for c in fleet.group.clients:
            real = not c.can.digests_weights
            if real and sets:
                record.append(c.url)
            if new_run or fleet.served.get(c.url) != label:
                continue
            if not real:  # it digests what it serves, on request
                got = c.weights_digest([s.name for s in specs])
                if str(got.get("weight_version")) == label and got.get("run_id") in (None, self.run_id):
                    check[c.url] = (got.get("digest"), None)
            elif sets:  # real SGLang keeps nothing: the record written when it was labelled
                records = self._records()
                rec = records.read(c.url)
                if rec is None or str(rec.get("version")) != label:
                    check[c.url] = (None, f"no digest of its weights is recorded in {records.url}; its label was set "
                                          "by a trainer whose record lives elsewhere, or outside wsync")
                elif rec.get("run_id") in (None, self.run_id):
                    check[c.url] = (rec.get("digest"), None if rec.get("digest") else
                                    "the trainer that labelled it could not take the digest of its weights")
        return {"check": check, "record": record} if check or record else None

    def check(self, plan, parts: list, labels: dict) -> LabelCheck:
        """Every rank, in the check step: the digest of these weights as servers serve them (``parts``: each rank's
        of its own rows), compared with what the servers that already serve this version serve. Other weights, or
        weights that cannot be compared, are a VersionError on every rank before anything moves; the same
        weights are a safe retry."""
        digest = None if any(p is None for p in parts) else f"{sum(parts) % (1 << 64):016x}"
        problems = []
        for url, (served, why) in labels["check"].items():
            if why is None and digest is None:
                why = "the weight source has no local_shards(), so the digest of its weights cannot be taken"
            if why is not None or served != digest:
                problems.append(refusal(url, plan.version, why))
        if problems:
            raise VersionError("; ".join(problems))
        return LabelCheck(retried=bool(labels["check"]), served_digest=digest, record_labels=list(labels["record"]))

    def _records(self) -> LabelRecords:
        """Rank 0: where the labels of real SGLang servers are recorded (:class:`LabelRecords`)."""
        if self._kept is None:
            self._kept = LabelRecords(self._lock_url)
        return self._kept

    def forget_stale(self, plan) -> None:
        """Rank 0, before the commit: a record of this version with other weights (a new run publishes it again) is
        removed first, so that a record that cannot be written after the commit never vouches for the weights the
        commit replaced. A failure here fails the sync before anything is labelled."""
        for url in plan.record_labels:
            rec = self._records().read(url)
            if rec is not None and str(rec.get("version")) == str(plan.version) and rec.get("digest") != plan.served_digest:
                self._records().forget(url)

    def record(self, plan, servers: dict[str, str]) -> None:
        """Rank 0, after the commit: record the label of each real SGLang server that took the version. A record
        that cannot be written is logged: that label then cannot be compared, and is refused as such."""
        for url in plan.record_labels:
            if servers.get(url) != "ok":
                continue
            try:
                self._records().write(url, str(plan.version), plan.served_digest, self.run_id)
            except BridgeError as e:
                logger.warning("could not record the digest of version %d served by %s: %s", plan.version, url, e)
