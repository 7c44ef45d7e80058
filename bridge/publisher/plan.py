"""What one sync moves, known on every rank before the first byte moves: :class:`Plan`, with what the encoding
planned (:class:`Planned`, :class:`Encoded`), and what the encoding reports of it (:class:`EncodingReport`).

A plan is written by the publisher alone, and never changed once made: each step that learns something returns it
as a typed result (the encoding's :class:`Planned`, the label check's
:class:`~bridge.publisher.labels.LabelCheck`, the encoding's decision at begin, the transport's commit outcome), and
the publisher makes the next plan from it (``dataclasses.replace``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from bridge.buckets import Bucket

__all__ = ["Encoded", "EncodingReport", "Plan", "Planned"]


class Encoded:
    """What an encoding (:mod:`bridge.encodings`) planned for one sync, the same on every rank: each encoding's
    own dataclass derives from it (the delta's :class:`bridge.encodings.delta.DeltaPlan`)."""

    def report(self) -> EncodingReport:
        """What :class:`bridge.publisher.result.PublishResult` reports of the encoding of this sync."""
        return EncodingReport()


@dataclass
class EncodingReport:
    """What :class:`bridge.publisher.result.PublishResult` reports of the encoding of one sync."""

    encoding: str = "full"
    """What was sent: full, delta, or anchor (a full sync of the delta encoding)."""
    anchor_reason: str | None = None
    changed_fraction: float | None = None
    base_bytes: int = 0
    bytes: int | None = None
    """The bytes on the wire when the encoding formed them (a delta); None: the transport's or the plan's count."""


@dataclass(frozen=True)
class Planned:
    """What an encoding's ``plan`` returns, the same on every rank (:mod:`bridge.encodings.base`)."""

    encoded: Encoded | None = None
    """What it planned for this sync (None for ``full``)."""
    buckets: list[Bucket] | None = None
    """What travels, when it is not the serving-dtype tensors (a quantized encoding's other dtypes and added
    scales); None: the plan's buckets."""
    config_fields: dict[str, Any] = field(default_factory=dict)
    """Fields it adds to the model's ``config.json`` where a transport writes one (:attr:`Plan.config_fields`)."""


@dataclass(frozen=True)
class Plan:
    """What one sync moves: known on every rank before the first byte moves. Made by the publisher, never changed
    (see the module docstring)."""

    version: int
    buckets: list[Bucket]
    """What travels, bucket by bucket: planned from the source's tensors in the serving dtype; an encoding whose
    tensors travel otherwise (a quantized one: other dtypes, added scales) plans them again from what it sends, in
    its ``plan``. The servers are checked against them before anything moves (:mod:`bridge.publisher.preflight`)."""
    source: Any = None
    """The :class:`bridge.sources.WeightSource` being published."""
    retried: bool = False
    """True when this republishes the last version with identical weights (a safe retry)."""
    forced: str | None = None
    """Why this sync must send every tensor, decided by the publisher (a server refused the delta of this
    version: :mod:`bridge.publisher.versions`); None otherwise."""
    encoded: Encoded | None = None
    """What the encoding planned for this sync; None for ``full``."""
    decision: Any = None
    """Rank 0's decision at begin (``Encoding.decide``, a dataclass of the encoding's), on every rank."""
    config_fields: dict[str, Any] = field(default_factory=dict)
    """Fields the encoding adds to the model's ``config.json`` where a transport writes one (a disk snapshot: a
    quantized encoding's ``quantization_config``, by which SGLang and transformers load it); :attr:`model_config`."""
    served_digest: str | None = None
    """The digest of these weights as servers serve them (:mod:`bridge.publisher.labels`), when this sync took one."""
    record_labels: list[str] = field(default_factory=list)
    """Real SGLang servers whose label this sync records at commit, with ``served_digest`` (:mod:`bridge.publisher.labels`)."""

    def report(self) -> EncodingReport:
        """What :class:`bridge.publisher.result.PublishResult` reports of the encoding of this sync."""
        return self.encoded.report() if self.encoded is not None else EncodingReport()

    def planned(self, planned: Planned | None) -> Plan:
        """This plan with what the encoding planned."""
        if planned is None:
            return self
        return replace(self, encoded=planned.encoded, buckets=planned.buckets if planned.buckets is not None else
                       self.buckets, config_fields=dict(planned.config_fields))

    @property
    def model_config(self) -> Any:
        """The source's model config with :attr:`config_fields` over it (a dict then), what a snapshot carries;
        None without one."""
        config = getattr(self.source, "model_config", None)
        if not self.config_fields or config is None:
            return config
        return {**(config.to_dict() if hasattr(config, "to_dict") else dict(config)), **self.config_fields}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)
