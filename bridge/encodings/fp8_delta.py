"""The ``fp8_delta`` encoding: the delta (:mod:`bridge.encodings.delta`) over what FP8 servers serve.

The base is the FP8 bytes and the fp32 block scales the servers serve (``wsync serve --quantization fp8``, the
``fp8`` encoding's format, :mod:`bridge.codecs.fp8`): each rank quantizes its own rows as the ``fp8`` encoding does (the
same :class:`~bridge.codecs.fp8.Fp8Rule`, the same functions, so the same bytes), diffs its FP8 bytes and its rows of the
scales against its base, and sends what changed; an anchor is the FP8 full sync (:func:`bridge.encodings.fp8.
fp8_buckets`). A quantized weight is two base pieces on each rank, in the layout the delta's digest and the
servers cut (:func:`bridge.codecs.pieces.pieces_of`), so the base digest covers the scales too:

* when the rank's rows are whole 128-row blocks (:func:`bridge.sources.fp8.own_blocks`), its FP8 rows and its own rows
  of the scales, taken in the same pass;
* otherwise (the k/v projections of ``small`` on 2 ranks: 64 rows each) the scales are agreed across the ranks:
  each rank quantizes its rows with the scales of the base, sends its block absmax in its summary, and every rank
  takes the agreed scales from every rank's in ``plan`` (the max, as the ``fp8`` encoding's ``all_reduce``). If
  they moved, the bytes were diffed against the wrong scales and the sync is an anchor, which writes the agreed
  scales into the base at commit. At lr 1e-6 a block's absmax rarely moves.

Real SGLang gets anchors, with the reason logged: its delta loader (:mod:`bridge.serving.sglang_delta_loader`) applies
serving-dtype records to SGLang's own (stacked) parameters, not FP8 bytes and scales.

Why an encoding and not a delta option: what travels differs (FP8 and scales, and a snapshot's
``quantization_config``), the servers must serve FP8, and the fp8 options (``fp8_skip``) belong with it; the
delta's machinery is reused through four hooks (``_pieces``, ``_cast``, ``_estimate``, ``_anchor_buckets``) and
the summary's ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bridge.codecs.fp8 import (
    BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8Rule,
    block_amax,
    block_scales,
    quantize_rows,
    scale_shape,
)
from bridge.codecs.pieces import pieces_of
from bridge.encodings.delta import DeltaEncoding, DeltaOptions
from bridge.encodings.fp8 import Fp8Options, fp8_buckets, plan_fp8_wire
from bridge.encodings.registry import register_encoding
from bridge.errors import ConfigError
from bridge.publisher.plan import Planned
from bridge.sources import LocalShard
from bridge.sources.fp8 import OwnScales, own_blocks
from bridge.tensors import ParamSpec

__all__ = ["Fp8DeltaEncoding", "Fp8DeltaOptions"]

REAL_SGLANG = ("real SGLang's delta loader applies serving-dtype records to its own parameters, not FP8 bytes and "
               "block scales, so fp8_delta sends it FP8 full syncs (deltas go to reference servers)")


@dataclass(kw_only=True)
class Fp8DeltaOptions(DeltaOptions, Fp8Options):
    """The delta's options (when a sync is an anchor) and the fp8 encoding's (which projections stay unquantized)."""

    def __post_init__(self) -> None:
        DeltaOptions.__post_init__(self)
        Fp8Options.__post_init__(self)


@dataclass
class _Quantized:
    """One quantized weight as this rank holds it during a sync."""

    served: ParamSpec
    """Its serving-dtype spec (what is quantized is what a full sync would serve)."""
    rows: torch.Tensor | None
    """This rank's rows (``[n, K]``, the trainer's dtype); None: it holds none."""
    row0: int
    own: OwnScales | None
    """Its rows are whole blocks: the scales of its rows are its own (taken as it quantizes); None: agreed."""
    scale_at: int
    """The flat start of this rank's piece of the scale grid."""


def _placeholder(n: int) -> torch.Tensor:
    """``n`` elements, no memory: the ``local`` of a scale piece, whose values :meth:`Fp8DeltaEncoding._cast` makes."""
    return torch.zeros(1, dtype=torch.float32).expand(n)


@register_encoding
class Fp8DeltaEncoding(DeltaEncoding):
    """The delta encoding over FP8 bytes and block scales (see the module docstring)."""

    name = "fp8_delta"
    Options = Fp8DeltaOptions

    def __init__(self, config, rank: int, world: int):
        super().__init__(config, rank, world)
        self.rule = Fp8Rule(config.encoding_options.fp8_skip)
        self._q: dict[str, _Quantized] = {}
        self._amax: dict[str, torch.Tensor] = {}  # this sync: block absmax of this rank's rows of agreed-scale weights
        self._grids: dict[str, torch.Tensor] = {}  # the agreed scales of those weights, as last committed
        self._agreed_scales: dict[str, torch.Tensor] = {}  # ... and as this sync's plan agreed them
        self._using: dict[str, torch.Tensor] = {}  # the scales this rank quantizes them with now
        self._served: dict[str, ParamSpec] = {}

    @classmethod
    def check_config(cls, config, transport_cls) -> None:
        if "delta" not in transport_cls.encodings:
            raise ConfigError(f"the {transport_cls.name} transport cannot send the {cls.name} encoding; it sends "
                              f"{', '.join(transport_cls.encodings)} (encoding='fp8_delta' needs broadcast or colocated, "
                              "as encoding='delta'; encoding='fp8' goes over any transport)")

    # ------------------------------------------------------------------ the base pieces: FP8 rows and scale rows

    def _pieces(self, source, specs: list[ParamSpec]) -> list:
        self._q, self._amax, out = {}, {}, []
        for sh in source.local_shards(specs):
            spec = sh.spec
            if not (spec.dtype.is_floating_point and self.rule.quantized(spec.name, spec.shape)):
                out.append(sh)
                continue
            k = spec.shape[1]
            rows = None if sh.local is None or not sh.local.numel() else sh.local.view(-1, k)
            row0 = sh.start // k
            sspec = ParamSpec(spec.name + SCALE_SUFFIX, scale_shape(spec.shape), torch.float32)
            if own_blocks(spec.shape, self.world, sh.whole):
                own = None if rows is None else OwnScales(sh, spec)
                at = (row0 // BLOCK) * sspec.shape[1]
                length = 0 if rows is None else -(-rows.shape[0] // BLOCK) * sspec.shape[1]
            else:
                own, pieces = None, pieces_of(sspec.shape, self.world, False)
                at, length = pieces[self.rank] if self.rank < len(pieces) else (0, 0)
                if rows is not None:
                    self._amax[spec.name] = block_amax(rows, row0, sspec.shape[0], spec.dtype)
            self._q[spec.name] = _Quantized(spec, rows, row0, own, at)
            out.append(LocalShard(ParamSpec(spec.name, spec.shape, FP8_DTYPE), rows, sh.start, sh.whole))
            out.append(LocalShard(sspec, _placeholder(length) if length else None, at, sh.whole))
        return out

    def _cast(self, spec: ParamSpec, local: torch.Tensor) -> torch.Tensor:
        """A piece's base values: a quantized weight's rows as e4m3fn (as :func:`bridge.sources.fp8.gather_fp8_bucket`
        makes them), its scale piece, or the serving-dtype cast."""
        q = self._q.get(spec.name)
        if q is not None and spec.dtype == FP8_DTYPE:
            out = self._scratch("new", local.numel(), FP8_DTYPE, local.device)
            rows_out = out.view(q.rows.shape)
            if q.own is not None:
                q.own.quantize(rows_out)
            else:
                quantize_rows(q.rows, q.row0, self._grid(q).to(q.rows.device), out=rows_out, served=q.served.dtype)
            return out
        q = self._q.get(spec.name.removesuffix(SCALE_SUFFIX)) if spec.name.endswith(SCALE_SUFFIX) else None
        if q is not None:
            if q.own is not None:
                return q.own.blocks().reshape(-1).contiguous()
            return self._grid(q).reshape(-1)[q.scale_at: q.scale_at + local.numel()].contiguous()
        return super()._cast(spec, local)

    def _plain_cast(self, spec: ParamSpec) -> bool:
        """A quantized weight's FP8 rows and its scales are quantized, not cast: the kernel diffs their bytes once
        :meth:`_cast` made them."""
        return spec.name.removesuffix(SCALE_SUFFIX) not in self._q

    def _grid(self, q: _Quantized) -> torch.Tensor:
        """The scales an agreed-scale weight is quantized with now (the base's while diffing, this sync's agreed ones
        once planned; with none yet, this rank's own, which the anchor's commit replaces)."""
        g = self._using.get(q.served.name)
        if g is None:
            g = block_scales(self._amax.get(q.served.name, torch.zeros(scale_shape(q.served.shape))))
        return g

    def _estimate(self, owned: list, numel: int):
        """No sample before the diff: FP8 bytes change far more rarely than bf16 ones (0.4 % against 4 % at lr 1e-6),
        so a sample of bf16 elements says little, and quantizing one costs what the diff does."""
        return None

    @torch.no_grad()
    def _copy_into_base(self, owned: list) -> None:
        for sh in owned:
            self.base[sh.spec.name].base.copy_(self._cast(sh.spec, sh.local))

    # ------------------------------------------------------------------ the sync's steps

    def differs(self, source, specs: list[ParamSpec]) -> str | None:
        self._using = self._grids
        return super().differs(source, specs)

    def prepare(self, source, specs: list[ParamSpec]):
        self._using = self._grids
        summary = super().prepare(source, specs)
        summary.extra["amax"] = self._amax
        return summary

    def plan(self, plan, summaries: list) -> Planned:
        """The FP8 wire tensors (the anchor's buckets and the delta's table), the snapshot's quantization_config, the
        delta's buckets and decision; the agreed scales, and an anchor when they moved."""
        self._served, wire = plan_fp8_wire(plan, self.rule, self.config.bucket_bytes)
        delta = super().plan(plan.planned(wire), summaries)  # the delta of what travels, the FP8 tensors
        enc = delta.encoded
        amax: dict[str, torch.Tensor] = {}
        for s in summaries:
            for name, g in s.extra.get("amax", {}).items():
                amax[name] = g if name not in amax else torch.maximum(amax[name], g)
        self._agreed_scales = self._using = {n: block_scales(g) for n, g in amax.items()}
        moved = [n for n, g in self._agreed_scales.items() if n not in self._grids or not torch.equal(g, self._grids[n])]
        if enc.reason is None and moved:
            enc.reason = (f"the block scales of {len(moved)} weight(s) whose rows are not whole 128-row blocks "
                          f"on each rank changed ({moved[0]}), and their FP8 bytes were diffed against the old")
        return replace(wire, encoded=enc)

    def decide(self, plan, servers):
        d = super().decide(plan, servers)
        if d.reason is None and not all(c.can.fp8_delta for c in servers.clients):
            d.reason, d.via = REAL_SGLANG, None
        return d

    def _anchor_buckets(self, plan) -> list:
        return fp8_buckets(plan, self._served)

    @torch.no_grad()
    def _committed(self, plan) -> None:
        """An anchor writes the agreed scales, and the rows quantized with them, into the base of the agreed-scale
        weights (the diff used the old scales); a delta was sent only when they had not moved."""
        if self._refresh is not None:
            self._refresh.result()
        if plan.encoded.mode == "anchor":
            self._using = self._agreed_scales
            for name, q in self._q.items():
                fspec, sname = ParamSpec(name, q.served.shape, FP8_DTYPE), name + SCALE_SUFFIX
                if q.own is not None:
                    continue
                if q.rows is not None and name in self.base:
                    self.base[name].base.copy_(self._cast(fspec, q.rows))
                if sname in self.base:
                    held = self.base[sname].base
                    held.copy_(self._cast(ParamSpec(sname, scale_shape(q.served.shape), torch.float32), held))
        self._grids = dict(self._agreed_scales)
        super()._committed(plan)
