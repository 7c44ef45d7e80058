"""The ``fp8`` encoding: every tensor, every sync, with the projections as block FP8 (:mod:`bridge.codecs.fp8`).

What travels: :func:`bridge.codecs.fp8.fp8_wire_specs` of the serving-dtype specs (each quantized weight as
``float8_e4m3fn`` and its fp32 ``<name>_scale_inv``, the rest as is), planned into buckets in ``plan`` (so the
servers are checked against them before anything moves), so it works on every transport that carries plain
named tensors. Each bucket is quantized on the trainer ranks that hold its rows as it is gathered
(:func:`bridge.sources.fp8.gather_fp8_bucket`), while the previous bucket travels; never the whole model on one rank.
A disk snapshot's ``config.json`` carries the ``quantization_config`` SGLang and transformers load a block-FP8
checkpoint by (``plan.config_fields``). The servers must serve FP8 (``wsync serve --quantization fp8``, or
SGLang started on an FP8 checkpoint); a server that serves bf16 refuses the sync before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bridge.codecs import kernels
from bridge.codecs.fp8 import Fp8Rule, plan_fp8_buckets, quantization_config
from bridge.encodings.base import Encoding, Outgoing, Transfer
from bridge.encodings.registry import register_encoding
from bridge.errors import ConfigError
from bridge.options import option
from bridge.publisher.plan import Encoded, EncodingReport, Planned
from bridge.sources.fp8 import gather_fp8_bucket
from bridge.tensors import ParamSpec

__all__ = ["Fp8Encoding", "Fp8Options", "Fp8Plan", "fp8_buckets"]


@dataclass
class Fp8Plan(Encoded):
    """What the fp8 encoding planned for one sync: the serving-dtype spec of every tensor, by name (what each rank
    casts its rows to before quantizing them)."""

    served: dict[str, ParamSpec]

    def report(self) -> EncodingReport:
        return EncodingReport(encoding="fp8")


@dataclass(kw_only=True)
class Fp8Options:
    """The fp8 encoding's options: which projections stay in the serving dtype."""

    fp8_skip: tuple = option((), "regular expressions of module names to leave in the serving dtype besides the "
                                 "rule of bridge.codecs.fp8 (layers\\.0\\., say); the servers must be started with the same "
                                 "--fp8-skip", many=True, metavar="REGEX")

    def __post_init__(self) -> None:
        if isinstance(self.fp8_skip, str):
            raise ConfigError(f"fp8_skip must be a list of regular expressions, got the string {self.fp8_skip!r}")
        self.fp8_skip = tuple(self.fp8_skip or ())
        Fp8Rule(self.fp8_skip)  # a bad pattern: a ConfigError now


@register_encoding
class Fp8Encoding(Encoding):
    """Every tensor, every sync, the projections as block FP8 (see the module docstring)."""

    name = "fp8"
    Options = Fp8Options

    def __init__(self, config, rank: int, world: int):
        super().__init__(config, rank, world)
        self.rule = Fp8Rule(config.encoding_options.fp8_skip)
        kernels.available()  # the one-pass quantization, built here (once per machine), not inside a publish

    def prepare(self, source, specs):
        source.require(("local_shards",), "the fp8 encoding (it quantizes each rank's own rows)")
        return None

    def plan(self, plan, summaries: list) -> Planned:
        """What travels: the FP8 tensors, in buckets of their own size (the first ones smaller:
        :func:`bridge.codecs.fp8.plan_fp8_buckets`); the snapshot's quantization_config."""
        served, wire = plan_fp8_wire(plan, self.rule, self.config.bucket_bytes)
        return replace(wire, encoded=Fp8Plan(served))

    def buckets(self, plan) -> Transfer:
        """Each bucket quantized on the ranks that hold its rows as it is gathered (every rank calls ``fill``)."""
        return Transfer(fp8_buckets(plan, plan.encoded.served))


def plan_fp8_wire(plan, rule: Fp8Rule, bucket_bytes: int) -> tuple[dict[str, ParamSpec], Planned]:
    """``plan``'s serving-dtype buckets planned again as what travels in FP8 (:func:`bridge.codecs.fp8.plan_fp8_buckets`),
    with the snapshot's ``quantization_config``; and the serving-dtype spec of every tensor, by name."""
    served = [s for b in plan.buckets for s in b.specs]
    wire = Planned(buckets=plan_fp8_buckets(served, rule, bucket_bytes),
                   config_fields={"quantization_config": quantization_config(served, rule)})
    return {s.name: s for s in served}, wire


def fp8_buckets(plan, served: dict[str, ParamSpec]) -> list[Outgoing]:
    """``plan``'s FP8 buckets (:func:`bridge.codecs.fp8.plan_fp8_buckets`), each quantized on the ranks that hold its rows as
    it is gathered (:func:`bridge.sources.fp8.gather_fp8_bucket`); ``served``: the serving-dtype spec of every tensor."""
    source = plan.source

    def fill(bucket):
        return lambda buf, dst, group: gather_fp8_bucket(source, bucket, buf, served, group, dst)

    return [Outgoing(f"bucket {k}", b, fill(b), to_owner=source.gathers_to_any_rank) for k, b in enumerate(plan.buckets)]
