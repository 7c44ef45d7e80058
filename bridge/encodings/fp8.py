"""The ``fp8`` encoding: every tensor, every sync, with the projections as block FP8 (:mod:`bridge.fp8`).

What travels: :func:`bridge.fp8.fp8_wire_specs` of the serving-dtype specs (each quantized weight as
``float8_e4m3fn`` and its fp32 ``<name>_scale_inv``, the rest as is), in the publisher's own bucket loop, so
it works on every transport that sends full buckets (broadcast, colocated, disk). Each bucket is quantized
on the trainer ranks that hold its rows as it is gathered (:func:`bridge.fp8.gather_fp8_bucket`), while the
previous bucket travels. A disk snapshot's ``config.json`` carries the ``quantization_config`` SGLang and
transformers load a block-FP8 checkpoint by. The servers must serve FP8 (``wsync serve --quantization fp8``,
or SGLang started on an FP8 checkpoint); a server that serves bf16 refuses the sync before anything moves.
"""

from __future__ import annotations

from bridge.encodings.base import Encoding
from bridge.encodings.registry import register_encoding
from bridge.errors import ConfigError
from bridge.fp8 import Fp8Rule, fp8_wire_specs, gather_fp8_bucket, quantization_config

__all__ = ["Fp8Encoding"]


@register_encoding
class Fp8Encoding(Encoding):
    name = "fp8"

    def __init__(self, config, rank: int, world: int):
        super().__init__(config, rank, world)
        self.rule = Fp8Rule(tuple(getattr(config, "fp8_skip", ()) or ()))
        self._served: dict = {}

    @classmethod
    def check_config(cls, config, transport_cls) -> None:
        if "full" not in transport_cls.encodings:
            raise ConfigError(f"the {transport_cls.name} transport cannot send the fp8 encoding (it sends "
                              f"{', '.join(transport_cls.encodings)}); use broadcast, colocated or disk")
        Fp8Rule(tuple(getattr(config, "fp8_skip", ()) or ()))  # a bad pattern: a ConfigError now

    def wire_specs(self, specs: list) -> list:
        self._served = {s.name: s for s in specs}
        return fp8_wire_specs(specs, self.rule)

    def prepare(self, source, specs):
        source.require(("local_shards",), "the fp8 encoding (it quantizes each rank's own rows)")
        return None

    def plan(self, plan, summaries: list) -> None:
        plan.config_fields = {"quantization_config": quantization_config(list(self._served.values()), self.rule)}

    def gather(self, source, bucket, buf, group, dst: int) -> None:
        gather_fp8_bucket(source, bucket, buf, self._served, group, dst)

    def result(self, plan) -> dict:
        return {"encoding": "fp8"}
