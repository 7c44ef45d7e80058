"""The delta encoding: each sync sends what changed since the base the servers serve.

Every trainer rank keeps the serving-dtype bytes of its own shard as last committed, *the base*: 2 bytes
per parameter of its shard in bf16, on the parameters' device (``base_bytes``). At each publish, in the
prepare step, a rank casts its shard, compares it bit for bit with the base (one pass per tensor on the CPU, the
C kernel of :mod:`bridge.codecs.kernels`), and for each tensor it holds picks the smallest record (gaps, indices or bitmask + values, zstd where ``delta_zstd`` says; :mod:`bridge.codecs.delta`);
it writes the new bytes into the base at once (the kernel, in the diff's own pass) and keeps what it overwrote (an undo log: the changed
positions and old values of each tensor, or a copy of a tensor that changed almost entirely), so a failed
sync puts the base back exactly and a committed one only drops the log. The base therefore moves only when
a publish commits. During a sync a rank also holds its encoded records (no larger than the changed values and
their positions) and scratch reused from tensor to tensor: the kernel's positions, new and old values (room for a
quarter of its largest piece; 3 bytes per element of it in bf16), or, where the kernel does not apply, the cast piece and its
change mask.

Every rank learns every rank's encoded sizes, so all of them plan the same *delta buckets* (whole tensors,
up to ``bucket_mb`` of encoded bytes each) and decide alike whether this sync must be an *anchor*, a full
sync: there is no base yet; every ``delta_anchor_every`` versions; the delta is over ``delta_max_fraction``
of the full bytes or costs more than a full sync (:meth:`DeltaEncoding._costlier_than_full`). Rank 0, once the
servers are paused, also sends an anchor when a server is out of
rotation (:mod:`bridge.fleet`: restarted, newly joined, on another version, torn or held paused; the anchor
repairs it), when the servers are of two kinds (reference server and real SGLang), when real SGLang was not
started with the loader (``--custom-weight-loader``) or does not report the base version, and after a failed
sync into real SGLang (which loads buckets as they arrive, so it may hold part of it). The reason is logged
and reported (``PublishResult.encoding``, ``.anchor_reason``).

Each delta bucket names the base version and a digest of the base of its tensors (the CRC32 of each rank's
piece, :func:`bridge.codecs.pieces.combine_digest`); a server that does not serve exactly that base refuses
it before any weight changes (``wsync_reason: delta_base_mismatch``), and the publisher sends an anchor
instead, in the same ``publish()`` call. How the bytes move: :mod:`bridge.encodings.delta_send`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import torch

from bridge.codecs import kernels
from bridge.codecs.delta import DENSE, HEADER_BYTES, choose, encode_sparse, record_nbytes, write_record
from bridge.codecs.delta_cost import SyncCosts
from bridge.codecs.diff import INTS, differing_lanes, flatnonzero
from bridge.codecs.pieces import combine_digest, piece_crc
from bridge.encodings.base import Encoding, Transfer, gathered
from bridge.encodings.delta_plan import (
    ZSTD_AUTO_BELOW_BITS,
    BasePiece,
    Change,
    Decision,
    DeltaBucket,
    DeltaOptions,
    DeltaPlan,
    DeltaSummary,
)
from bridge.encodings.registry import register_encoding
from bridge.log import fmt_bytes, get_logger
from bridge.publisher.plan import Planned
from bridge.tensors import ParamSpec

__all__ = ["Decision", "DeltaBucket", "DeltaEncoding", "DeltaOptions", "DeltaPlan", "DeltaSummary"]

logger = get_logger(__name__)


_SAMPLE_BLOCK, _SAMPLE_EVERY = 512, 64


def _sample(flat: torch.Tensor) -> torch.Tensor:
    """A view of one block of :data:`_SAMPLE_BLOCK` elements in every :data:`_SAMPLE_EVERY` (the whole of a
    tensor shorter than that): contiguous runs, so the sample reads 1/64 of the memory, where one element in
    64 read every cache line of it."""
    span = _SAMPLE_BLOCK * _SAMPLE_EVERY
    m = flat.numel() // span
    return flat[: m * span].view(m, span)[:, :_SAMPLE_BLOCK] if m else flat


@register_encoding
class DeltaEncoding(Encoding):
    name = "delta"
    Options = DeltaOptions
    any_transport = False  # a delta bucket's table must reach the servers: broadcast and colocated pass it on
    fingerprints = False  # the base is what was published: differs compares with it

    def __init__(self, config, rank: int, world: int):
        super().__init__(config, rank, world)
        self.base: dict[str, BasePiece] = {}
        self.base_version: int | None = None
        self.since_anchor = 0
        self.changes: dict[str, Change] = {}
        self.probes: dict[str, list] = {}  # name -> [(flat position, base bits)]: for the SGLang loader's check
        self.anchor_next: str | None = None  # rank 0: the next sync is an anchor, for this reason
        self._crcs: cf.Future | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}  # scratch of _diff (the kernel's positions and values; or the
        # cast piece and its change mask)
        self._kernels = kernels.available()  # the one-pass diff, built here (once per machine) if it is not yet
        self._into_real_sglang = False  # rank 0: the sync in progress reached servers that load as bytes arrive
        self.zstd = True  # records may take the zstd stage (each sync's decision says whether the servers read it)
        self._zstd_now = False  # this sync's records take it (:meth:`_zstd_stage`)
        self._stale: list | None = None  # an anchor decided early: the shards the base takes once they are sent
        self._refresh: cf.Future | None = None  # ... and that copy, from the settle step until the commit
        self.costs, self._t0, self._timed = SyncCosts(), 0.0, [0.0, 0.0, 0, 0]  # what syncs cost: the anchor decision

    @property
    def base_bytes(self) -> int:
        """This rank's memory for its base: its shard in the serving dtype (2 bytes per parameter in bf16)."""
        return sum(h.base.numel() * h.base.element_size() for h in self.base.values())

    # ------------------------------------------------------------------ a retry: the base is what was published

    @torch.no_grad()
    def differs(self, source, specs: list[ParamSpec]) -> str | None:
        """The base holds this rank's bytes of the last version as servers hold them, so a retry is safe when
        each of its tensors, cast to the serving dtype, is its base bit for bit (weights that differ only below
        the serving dtype's precision serve the same model). No digest is taken during a sync."""
        source.require(("local_shards",), "the delta encoding")
        if self.base_version is None:
            return "a failed sync dropped this rank's delta base, so its weights cannot be compared with the last version's"
        for sh in self._pieces(source, specs):
            if sh.local is None:
                continue
            if self._fresh(sh):
                return f"{sh.spec.name} is not in this rank's delta base"
            new = self._cast(sh.spec, sh.local)
            ints = INTS[new.element_size()]
            if not torch.equal(new.view(ints), self.base[sh.spec.name].base.view(ints)):
                return f"other weights ({sh.spec.name} changed)"
        return None

    # ------------------------------------------------------------------ prepare: diff against the base

    @torch.no_grad()
    def prepare(self, source, specs: list[ParamSpec]) -> DeltaSummary:
        source.require(("local_shards",), "the delta encoding")
        self._t0, self._timed = time.perf_counter(), [0.0, 0.0, 0, 0]  # (diff s, encoding s, elements, changed)
        crcs = self._crcs.result() if self._crcs is not None and self.base_version is not None else []
        self.changes, self.probes, self._refresh, self._stale = {}, {}, None, None
        shards = self._pieces(source, specs)
        whole = [sh.spec.name for sh in shards if sh.whole]
        skip = self._anchor_ahead([sh for sh in shards if sh.local is not None])
        if skip is not None:  # an anchor for sure: no diff; the base becomes the weights once they are sent
            reason, changed, numel = skip
            self._stale = [sh for sh in shards if sh.local is not None]
            return DeltaSummary(skip=reason, whole=whole, changed=changed, numel=numel, crcs=crcs,
                                costs=self.costs.state())
        sizes, changed, numel, fresh, t_diff = {}, 0, 0, False, time.perf_counter()
        costs = self.costs.state()  # (this sync's records change them only at its end)
        self._zstd_now = self._zstd_stage(costs)
        for sh in shards:
            if sh.local is None:
                continue
            ch = self._diff(sh.spec, sh.local, sh.start)
            numel += sh.local.numel()
            if ch is None:
                continue
            self.changes[sh.spec.name] = ch
            sizes[sh.spec.name] = ch.nbytes
            changed += ch.count
            fresh |= ch.old is None
        self._timed[0], self._timed[2:] = time.perf_counter() - t_diff, [numel, changed]
        return DeltaSummary(skip=None, sizes=sizes, whole=whole, changed=changed, numel=numel, fresh=fresh, crcs=crcs,
                            probes=self.probes, costs=costs)

    def _zstd_stage(self, costs: dict) -> bool:
        """Whether this sync's records may take the zstd stage: every server reads it (the last decision said so) and
        ``delta_zstd`` is ``on``, or ``auto`` where the last full syncs this rank measured (``costs``) ran below
        :data:`~bridge.encodings.delta_plan.ZSTD_AUTO_BELOW_BITS` end to end. (Each record says whether it took the
        stage, so ranks that measured differently need not agree.)"""
        mode = self.config.encoding_options.delta_zstd
        if not self.zstd or mode == "off":
            return False
        per_byte = costs["s_per_byte"]
        return mode == "on" or (per_byte is not None and 8 / per_byte < ZSTD_AUTO_BELOW_BITS)

    def _anchor_ahead(self, owned: list) -> tuple[str, int, int] | None:
        """(why, estimated changed elements, elements) when this rank knows before diffing that the sync will be
        an anchor: every ``delta_anchor_every`` versions, or when a sample (:func:`_sample`) says the delta
        would be over ``delta_max_fraction`` of this rank's bytes. Then the sync costs a full one and little
        more: no diff, only the base refreshed at commit. None: diff (also when there is no base to sample)."""
        opts, numel = self.config.encoding_options, sum(sh.local.numel() for sh in owned)
        if self.base_version is None or any(self._fresh(sh) for sh in owned):
            return None
        if self.since_anchor + 1 >= opts.delta_anchor_every:
            return f"an anchor every {opts.delta_anchor_every} versions (delta_anchor_every)", 0, numel
        return self._estimate(owned, numel)

    def _estimate(self, owned: list, numel: int) -> tuple[str, int, int] | None:
        """The sample's part of :meth:`_anchor_ahead`: (why, changed, elements) when the sampled delta is too large or
        costs more than a full sync."""
        opts = self.config.encoding_options
        est = changed = full = 0
        for sh in owned:
            n, itemsize = sh.local.numel(), sh.spec.dtype.itemsize
            ints = INTS[itemsize]
            sample = _sample(sh.local.detach().reshape(-1)).to(sh.spec.dtype)
            hits = int(torch.count_nonzero(sample.view(ints) != _sample(self.base[sh.spec.name].base).view(ints)))
            count = min(n, round(hits * n / max(1, sample.numel())))
            est, changed, full = est + (choose(n, count, itemsize)[1] if count else 0), changed + count, full + n * itemsize
        if est > opts.delta_max_fraction * full:
            return (f"the delta would be about {est / max(1, full):.0%} of the full bytes (from a sample of 1 block "
                    f"in {_SAMPLE_EVERY}), over delta_max_fraction={opts.delta_max_fraction:g}"), changed, numel
        why = self._costlier_than_full(self.costs.state(), est / max(1, full), diff=(numel, changed))
        return None if why is None else (f"{why}; from a sample of 1 block in {_SAMPLE_EVERY}", changed, numel)

    def _costlier_than_full(self, costs: dict, fraction: float, diff=None, full_bytes: int = 0) -> str | None:
        """Why a delta of ``fraction`` of the full bytes would take longer than the full sync, at what the last
        syncs cost (:mod:`bridge.codecs.delta_cost`), or None; ``diff``: (elements, changed) still to diff, None once
        diffed. ``delta_max_fraction`` bounds it from above."""
        full = full_bytes or self.costs.full_bytes
        return SyncCosts.verdict(costs, fraction * full, full, diff) if full else None

    @torch.no_grad()
    def _copy_into_base(self, owned: list) -> None:
        for sh in owned:
            self.base[sh.spec.name].base.copy_(sh.local.detach().reshape(-1))

    def _pieces(self, source, specs: list[ParamSpec]) -> list:
        """This rank's base pieces (:class:`bridge.sources.LocalShard`: the spec of what is served, this rank's
        part, its flat start, whole or not), in order; :meth:`_cast` turns a piece's ``local`` into its flat
        base values. Here the shards themselves, the base their serving-dtype cast (the FP8 delta: each
        quantized weight's FP8 rows and its rows of the scales, :mod:`bridge.encodings.fp8_delta`)."""
        return source.local_shards(specs)

    def _fresh(self, sh) -> bool:
        held = self.base.get(sh.spec.name)
        return held is None or held.start != sh.start or held.base.numel() != sh.local.numel() or \
            held.base.dtype != sh.spec.dtype

    def _diff(self, spec: ParamSpec, local: torch.Tensor, start: int) -> Change | None:
        n = local.numel()
        held = self.base.get(spec.name)
        if held is None or held.start != start or held.base.numel() != n or held.base.dtype != spec.dtype:
            new = self._cast(spec, local)
            self.base[spec.name] = BasePiece(start, new.clone())
            return Change(DENSE, n, record_nbytes(DENSE, n, n, new.element_size()))
        positions, values, old = self._changes(spec, local, held.base, write=True)
        count = positions.numel()
        if not count:
            return None
        itemsize = held.base.element_size()
        bits = held.base.view(INTS[itemsize])
        moved = old is not None  # the kernel moved the base where it changed (the rest is equal), keeping the old values
        if old is None:
            old = held.base.index_select(0, positions)
        first, was = int(positions[0]), old.view(bits.dtype)
        self.probes[spec.name] = [(start, int(was[0]) if first == 0 else int(bits[0])), (start + first, int(was[0]))]
        t = time.perf_counter()
        kind, body = encode_sparse(n, positions, values, zstd=self._zstd_now)
        self._timed[1] += time.perf_counter() - t
        if not moved:
            bits.index_copy_(0, positions, values.view(bits.dtype))
        if kind == DENSE:  # (nearly) all changed: the undo is a copy of the old base, the record the base itself
            undo = held.base.clone()
            undo.view(bits.dtype).index_copy_(0, positions, was)
            return Change(kind, count, record_nbytes(DENSE, n, n, itemsize), old=undo)
        old = old.clone() if moved else old  # (the kernel's old values are scratch)
        # (kept for the undo: int32 is half the bytes; either way a copy, not a view of the scratch)
        positions = positions.to(torch.int32) if n < 2**31 else positions.clone()
        return Change(kind, count, HEADER_BYTES + body.numel(), positions, old, body)

    def _changes(self, spec: ParamSpec, local: torch.Tensor, base: torch.Tensor, write: bool = False):
        """(int64 positions, new values, old values or None) of the elements of ``local`` cast to the serving dtype
        that differ from ``base`` bit for bit, positions increasing: in one pass by the C kernel
        (:mod:`bridge.codecs.kernels`, the cast fused, the old values taken on the way, and with ``write`` the base
        moved to the new values there) where it applies, else cast, compared and gathered in torch (no old values:
        the caller takes them, and the base is as it was)."""
        if self._plain_cast(spec):
            found = self._kernel_diff(local.detach().reshape(-1), base, write)
            if found is not None:
                return found
        return self._diff_cast(self._cast(spec, local), base, write)

    def _plain_cast(self, spec: ParamSpec) -> bool:
        """Whether a piece's base values are its local values cast to the serving dtype (the kernel casts them itself)."""
        return True

    def _diff_cast(self, new: torch.Tensor, base: torch.Tensor, write: bool = False):
        """:meth:`_changes` of a piece already in the serving dtype."""
        found = self._kernel_diff(new, base, write)
        if found is not None:
            return found
        positions = self._changed(new, base, new.element_size())
        return positions, new.index_select(0, positions), None

    def _kernel_diff(self, new: torch.Tensor, base: torch.Tensor, write: bool):
        if not self._kernels:
            return None
        n = kernels.room(new.numel())
        return kernels.diff(new, base, self._scratch("positions", n, torch.int64, base.device),
                            self._scratch("values", n, base.dtype, base.device),
                            self._scratch("old", n, base.dtype, base.device), write)

    def _changed(self, new: torch.Tensor, base: torch.Tensor, itemsize: int) -> torch.Tensor:
        """The int64 positions where ``new`` and ``base`` (flat, same dtype) differ bit for bit, increasing.

        Compared 8 bytes at a time (4 bf16 elements to a word), then element by element only inside the words
        that differ: with about 1 % of the elements changed, the full-length passes (compare, count, positions)
        read and write a quarter of what an element-wise mask takes."""
        n = new.numel()
        per = 8 // itemsize if itemsize < 8 else 1
        if n % per or (new.storage_offset() | base.storage_offset()) % per:  # words do not cover it: element-wise
            per = 1
        ints = INTS[itemsize * per]
        wmask = self._scratch("mask", n // per, torch.bool, new.device)
        torch.ne(new.view(ints), base.view(ints), out=wmask)
        words = flatnonzero(wmask)
        if per == 1 or not words.numel():
            return words
        return differing_lanes(new.view(ints), base.view(ints), words, itemsize)

    def _cast(self, spec: ParamSpec, local: torch.Tensor) -> torch.Tensor:
        """``local`` flat in the serving dtype, in memory reused from tensor to tensor and sync to sync."""
        return self._scratch("new", local.numel(), spec.dtype, local.device).copy_(local.detach().reshape(-1))

    def _scratch(self, key: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``n`` elements of a buffer kept across tensors and syncs (as large as this rank's largest piece):
        a fresh tensor per piece spent more time faulting its pages in than casting or comparing."""
        buf = self._buffers.get((key, dtype, device))
        if buf is None or buf.numel() < n:
            buf = self._buffers[(key, dtype, device)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    # ------------------------------------------------------------------ plan: the same on every rank

    def plan(self, plan, summaries: list[DeltaSummary]) -> Planned:
        opts, world = self.config.encoding_options, len(summaries)
        changed, numel = sum(s.changed for s in summaries), sum(s.numel for s in summaries)
        whole = set(summaries[0].whole)
        crcs: dict[str, list] = {}
        for s in summaries:
            for name, start, length, crc in s.crcs:
                crcs.setdefault(name, []).append((name, start, length, crc))
        buckets = self._buckets([spec for b in plan.buckets for spec in b.specs], summaries, whole, crcs)
        total = sum(sum(b.sizes) for b in buckets)
        enc = DeltaPlan(buckets, total, plan.nbytes, changed, numel, self.base_version, world,
                        base_bytes=self.base_bytes)
        shapes = {s.name: list(s.shape) for b in plan.buckets for s in b.specs}
        for s in summaries:
            for name, items in s.probes.items():
                enc.probes.setdefault(name, {"shape": shapes[name], "items": []})["items"] += items
        if self.base_version is None or any(s.fresh for s in summaries):
            enc.reason = "no base yet" if self.base_version is None else "the trainer's tensors changed shape"
        elif any(s.skip for s in summaries):
            enc.reason = next(s.skip for s in summaries if s.skip)
        elif self.since_anchor + 1 >= opts.delta_anchor_every:
            enc.reason = f"an anchor every {opts.delta_anchor_every} versions (delta_anchor_every)"
        elif total > opts.delta_max_fraction * plan.nbytes:
            enc.reason = (f"the delta ({fmt_bytes(total)}) is {total / max(1, plan.nbytes):.0%} of the full "
                          f"{fmt_bytes(plan.nbytes)}, over delta_max_fraction={opts.delta_max_fraction:g}")
        else:  # rank 0's measurements, so that every rank decides alike
            enc.reason = self._costlier_than_full(summaries[0].costs, total / max(1, plan.nbytes), None, plan.nbytes)
        return Planned(enc)

    def _buckets(self, specs: list[ParamSpec], summaries: list[DeltaSummary], whole: set, crcs: dict) -> list[DeltaBucket]:
        budget, out, cur, size = self.config.bucket_bytes, [], [], 0

        def close() -> None:
            sizes = [sum(s.sizes.get(sp.name, 0) for sp in cur) for s in summaries]
            entries = [e for sp in cur for e in crcs.get(sp.name, [])]
            out.append(DeltaBucket(list(cur), sizes, [sp.name for sp in cur if sp.name in whole],
                                   combine_digest(entries) if entries else None))

        for spec in specs:
            n = sum(s.sizes.get(spec.name, 0) for s in summaries)
            if cur and size + n > budget:
                close()
                cur, size = [], 0
            cur.append(spec)
            size += n
        if cur:
            close()
        return out

    # ------------------------------------------------------------------ begin (rank 0) and the decision

    def decide(self, plan, servers) -> Decision:
        from bridge.encodings.delta_send import delta_route, zstd_unreadable

        enc = plan.encoded
        self._into_real_sglang = not all(c.can.staged for c in servers.clients)
        reason, via = enc.reason or plan.forced or self.anchor_next, None
        if reason is None:
            reason, via = delta_route(servers, self.base_version)
        unreadable = zstd_unreadable(servers.clients)
        if reason is None and self.zstd and unreadable:  # (this sync's records were encoded with the stage)
            reason, via = f"{unreadable}; the next deltas go without the zstd stage", None
        return Decision(reason, via, zstd=unreadable is None)

    # ------------------------------------------------------------------ the buckets: an anchor's or the delta's

    def buckets(self, plan) -> Transfer:
        from bridge.encodings.delta_send import delta_buckets

        enc = plan.encoded
        enc.reason, enc.via = plan.decision.reason, plan.decision.via
        if self.rank == 0:
            if enc.reason is not None:
                logger.info("version %d: an anchor (full sync): %s", plan.version, enc.reason)
            else:
                logger.info("version %d: a delta against version %s: %s in %d buckets (%.1f%% of the full %s), "
                            "%.2f%% of the elements changed", plan.version, enc.base_version, fmt_bytes(enc.nbytes),
                            len(enc.buckets), 100 * enc.nbytes / max(1, enc.full_bytes), fmt_bytes(enc.full_bytes),
                            100 * enc.changed / max(1, enc.numel))
        if enc.mode == "delta":
            return Transfer(delta_buckets(plan, self.rank, self._write_records))
        return Transfer(self._anchor_buckets(plan), sent=self._sent)

    def _anchor_buckets(self, plan) -> list:
        """An anchor's buckets: the full sync of what the servers serve (here every tensor in the serving dtype)."""
        return gathered(plan)

    def _write_records(self, specs: list, out: torch.Tensor) -> int:
        """This rank's records of the tensors ``specs`` (their changes against the base) into ``out``; the bytes
        written."""
        at = 0
        for i, spec in enumerate(specs):
            ch = self.changes.get(spec.name)
            if ch is None:
                continue
            held = self.base[spec.name]
            at += write_record(out[at:], i, ch.kind, held.start, held.base, None, ch.count, body=ch.body)
        return at

    def _sent(self) -> None:
        """An anchor decided before diffing: the base takes the weights now, on a thread, while the servers take
        the last bucket and the commit (the transfer's gathers are not slowed by it); ``end`` waits."""
        if self._stale is not None:  # (copy_ frees the GIL)
            self._refresh, self._stale = _in_background(self._copy_into_base, self._stale), None

    # ------------------------------------------------------------------ the end of a sync

    @torch.no_grad()
    def end(self, plan, committed: bool) -> None:
        if plan is not None and plan.decision is not None:  # whether the servers read zstd records, for the next syncs
            self.zstd = plan.decision.zstd
        if committed:
            self._committed(plan)
        else:
            self._failed()

    def _committed(self, plan) -> None:
        enc = plan.encoded
        if self._refresh is not None:  # an anchor decided before diffing: its base copy ran beside the settle step
            self._refresh.result()
        self.changes, self.anchor_next, self._into_real_sglang = {}, None, False
        self._refresh = None
        self.base_version = plan.version
        self.since_anchor = 0 if enc.mode == "anchor" else self.since_anchor + 1
        if not plan.retried:
            self.costs.full_bytes, seconds = enc.full_bytes, time.perf_counter() - self._t0
            full_s = self.costs.record(enc.mode, enc.full_bytes if enc.mode == "anchor" else enc.nbytes, seconds,
                                       tuple(self._timed))
            if full_s is not None and self.rank == 0:
                logger.warning(f"v{plan.version}: the delta took {seconds:.3f} s, longer than the {full_s:.3f} s of a "
                               f"full sync at the last full syncs' rate ({self.costs.slower} of {self.costs.deltas} "
                               "deltas so far); the next syncs are priced with it")
        pieces = [(name, h.start, h.base) for name, h in self.base.items()]
        self._crcs = _in_background(lambda: [(n, s, b.numel(), piece_crc(b, 0, b.numel())) for n, s, b in pieces])

    def _failed(self) -> None:
        self._stale = None
        if self._refresh is not None:  # the base was being overwritten with weights no server holds: drop it
            self._refresh.exception()
            self._refresh, self.base, self.base_version = None, {}, None
        for name, ch in self.changes.items():
            held = self.base.get(name)
            if held is None:
                continue
            if ch.old is None:  # new in this sync: there is no base of it
                del self.base[name]
                self.base_version = None
            elif ch.positions is None:
                held.base.copy_(ch.old)
            else:
                held.base[ch.positions.to(held.base.device, torch.int64)] = ch.old
        self.changes = {}
        if self._into_real_sglang:  # it loads buckets as they arrive: it may hold part of the failed sync
            self.anchor_next = self.anchor_next or "the last sync failed, and real SGLang may hold part of it"
        self._into_real_sglang = False


_base_thread: cf.ThreadPoolExecutor | None = None


def _in_background(fn, *args) -> cf.Future:
    """``fn(*args)`` on the delta's one thread for the life of the process (starting one per sync cost ms)."""
    global _base_thread
    if _base_thread is None:
        _base_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="wsync-base-crc")
    return _base_thread.submit(fn, *args)
