"""What a delta sync plans and decides, as data every rank holds the same: each rank's summary, the decision (a delta
or an anchor), the buckets of records, and the encoding's options; and what one rank keeps of its base and of what it
changed in it (:mod:`bridge.encodings.delta` builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bridge.errors import ConfigError
from bridge.options import option
from bridge.publisher.plan import Encoded, EncodingReport
from bridge.tensors import ParamSpec

__all__ = ["ZSTD_AUTO_BELOW_BITS", "ZSTD_CHOICES", "BasePiece", "Change", "Decision", "DeltaBucket", "DeltaOptions", "DeltaPlan",
           "DeltaSummary"]


ZSTD_CHOICES = ("auto", "on", "off")
ZSTD_AUTO_BELOW_BITS = 250e6
"""``delta_zstd="auto"``: the zstd stage only where the last full syncs moved fewer bits per second than this, end to
end (docs/benchmark.md, "The zstd stage and the gap records": where it pays)."""


@dataclass
class DeltaSummary:
    """One rank's summary of its shards against its base, from the prepare step (every rank receives every rank's)."""

    skip: str | None = None
    """Why this rank knows, before diffing, that the sync is an anchor (then it did not diff); None: it diffed."""
    sizes: dict[str, int] = field(default_factory=dict)
    """name -> this rank's encoded bytes of that tensor (tensors that did not change are absent)."""
    whole: list[str] = field(default_factory=list)
    """The tensors this rank holds whole (not sharded)."""
    changed: int = 0
    """Elements of this rank's shards that changed (estimated when ``skip``)."""
    numel: int = 0
    """Elements of this rank's shards."""
    fresh: bool = False
    """A tensor is new to this rank's base (or changed shape): the sync must be an anchor."""
    crcs: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(name, start, length, CRC32) of each of this rank's base pieces, as last committed."""
    probes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """name -> [(flat position, base bits)]: base values the SGLang loader checks before it applies."""
    costs: dict = field(default_factory=dict)
    """What this rank measured syncs to cost (:class:`bridge.codecs.delta_cost.SyncCosts`); rank 0's decide for every rank."""
    extra: dict = field(default_factory=dict)
    """What a subclass adds for its ``plan`` (the FP8 delta: each rank's block absmax of rows whose scales are agreed)."""


@dataclass
class Decision:
    """Rank 0's decision at begin, once the servers are paused (every rank receives it)."""

    reason: str | None
    """Why this sync is an anchor (a full sync); None for a delta."""
    via: str | None
    """``native`` (reference servers) or ``loader`` (real SGLang with the loader), for a delta."""
    zstd: bool = True
    """Every server reads zstd records (:func:`bridge.encodings.delta_send.zstd_unreadable`): the next syncs'
    records may take the zstd stage; every rank takes it at the end of the sync."""


@dataclass
class DeltaBucket:
    """Whole tensors whose encoded bytes travel together; ``sizes[r]``: rank r's bytes of them."""

    specs: list[ParamSpec]
    sizes: list[int]
    whole: list[str]
    digest: int | None = None
    """Digest of the base of these tensors (every rank's pieces)."""

    @property
    def nbytes(self) -> int:
        return max(8, sum(self.sizes))  # never an empty broadcast


@dataclass
class DeltaPlan(Encoded):
    """What the delta encoding decided for one sync (the same on every rank)."""

    buckets: list[DeltaBucket]
    nbytes: int
    full_bytes: int
    changed: int
    numel: int
    base_version: int | None
    world: int
    reason: str | None = None
    """Why this sync is an anchor (a full sync); None for a delta."""
    via: str | None = None
    """``native`` (reference servers) or ``loader`` (real SGLang with the loader), for a delta."""
    probes: dict[str, dict] = field(default_factory=dict)
    """name -> {"shape", "items": [(flat position, base bits)]}: base values the SGLang loader checks (sent as
    the table's ``probes``, JSON, as is)."""

    base_bytes: int = 0
    """This rank's memory for its base (reported as ``PublishResult.base_bytes``)."""

    @property
    def mode(self) -> str:
        return "anchor" if self.reason is not None else "delta"

    def report(self) -> EncodingReport:
        return EncodingReport(self.mode, self.reason, self.changed / max(1, self.numel), self.base_bytes,
                              sum(b.nbytes for b in self.buckets) if self.mode == "delta" else None)


@dataclass
class Change:
    """One tensor this rank changed in its base during the current sync (the undo log and the record)."""

    kind: int
    count: int
    nbytes: int
    positions: torch.Tensor | None = None  # the changed positions (None: dense)
    old: torch.Tensor | None = None  # what was overwritten: at the positions, or all (dense); None: new tensor
    body: torch.Tensor | None = None  # the record after its header (delta_codec.encode_sparse; None: dense)


@dataclass
class BasePiece:
    """This rank's piece of a tensor's base: its first element's position in the tensor, and the values (flat, serving
    dtype)."""

    start: int
    base: torch.Tensor


@dataclass(kw_only=True)
class DeltaOptions:
    """The delta encoding's options: when a sync is a full one (an anchor) instead."""

    delta_anchor_every: int = option(50, "at least every this many versions, a full sync. At 2-10 % delta bytes "
                                         "an anchor every 50 versions adds about 2 % to the bytes moved on average",
                                     metavar="N")
    delta_max_fraction: float = option(0.5, "a delta larger than this fraction of the full bytes is always sent as a "
                                            "full sync; below it the measured costs decide (bridge.codecs.delta_cost: the "
                                            "delta's bytes at what the last syncs paid per byte, plus its diff, "
                                            "against the last full syncs' time). Each rank estimates it from a "
                                            "sample first, so a sync that will be full skips the diff", metavar="F")

    delta_zstd: str = option("auto", "the zstd stage of the delta's records: auto = only where the last full syncs "
                                     "ran below 250 Mbit/s end to end (on faster links its compression on the ranks "
                                     "and decompression on the servers cost more than the bytes it saves), on, off",
                             choices=ZSTD_CHOICES)

    def __post_init__(self) -> None:
        if self.delta_zstd not in ZSTD_CHOICES:
            raise ConfigError(f"delta_zstd must be one of {', '.join(ZSTD_CHOICES)}, got {self.delta_zstd!r}")
        if isinstance(self.delta_anchor_every, bool) or not isinstance(self.delta_anchor_every, int) \
                or self.delta_anchor_every < 1:
            raise ConfigError(f"delta_anchor_every must be an integer >= 1, got {self.delta_anchor_every!r}")
        if not 0 < self.delta_max_fraction <= 1:
            raise ConfigError(f"delta_max_fraction must be in (0, 1], got {self.delta_max_fraction!r}")
