"""Block-wise FP8 weights: which tensors are quantized, how, and how they come back.

The format is SGLang's and DeepSeek's block FP8 (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
what SGLang's ``Fp8LinearMethod`` registers for a block-FP8 checkpoint):

* a quantized weight ``<name>`` (``[N, K]``) travels and is served as ``torch.float8_e4m3fn`` with an fp32
  ``<name>_scale_inv`` of shape ``[ceil(N/128), ceil(K/128)]``: one scale per 128x128 block, the last row
  and column of blocks partial when N or K is not a multiple of 128;
* ``scale = max(absmax(block), 1e-4) / 448`` (448: the largest e4m3fn value; 1e-4: SGLang's floor for an
  all-zero block, ``per_block_cast_to_fp8``), the multiplier that dequantizes: ``w ~= q * scale``;
* ``q = clamp(w_fp32 * (1 / scale), -448, 448)`` cast to e4m3fn (round to nearest even), as SGLang's
  ``per_block_cast_to_fp8`` multiplies by the reciprocal.

The rule (:class:`Fp8Rule`): the 2-D ``.weight`` of attention and MLP projections and of experts are
quantized (``q/k/v/o_proj``, ``qkv_proj``, ``gate/up/down_proj``, ``gate_up_proj``, ``w1/w2/w3``, ``fc1/fc2``,
``dense``...); embeddings, ``lm_head``, norms, biases and MoE router gates (``mlp.gate``,
``shared_expert_gate``) stay in the serving dtype. ``skip`` adds regular expressions of module names to
leave unquantized (``PublisherConfig.fp8_skip``, ``wsync serve --fp8-skip``); the snapshot's
``quantization_config.modules_to_not_convert`` lists every linear module left unquantized.

Quantization runs on the trainer ranks that hold the rows (:func:`bridge.sources.fp8.gather_fp8_bucket`): per bucket, when every
rank's rows of each quantized weight are whole 128-row blocks (FSDP2 row chunks of a multiple of 128 rows, as
on ``medium`` with 2 ranks, and on ``small`` but for its 128-row k/v projections; any weight on one rank),
each rank quantizes its rows in one pass, taking each block's absmax as it goes, and its rows of the scales
travel with its FP8 bytes; otherwise each rank takes the absmax of its own rows per block and one
``all_reduce(MAX)`` of those (1/16384 of the elements) gives every rank the scales first. The FP8 bytes (half the
bf16 bytes) are gathered to the rank that sends the bucket. Never the whole model on one rank. Block-aligned float32
rows on the CPU are quantized by the C kernel (:func:`bridge.codecs.kernels.quantize_blocks`, the same bytes).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bridge.buckets import Bucket, plan_buckets
from bridge.codecs import kernels
from bridge.errors import ConfigError
from bridge.tensors import ParamSpec, kept_buffer

__all__ = [
    "BLOCK", "FIRST_BUCKET_DIVISOR", "FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "Fp8Rule", "block_amax", "block_scales",
    "dequantize", "fp32_block_rows", "fp8_wire_specs", "plan_fp8_buckets", "quantization_config", "quantize", "quantize_rows", "scale_shape", "scratch_buffer",
    "whole_blocks",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-4
SCALE_SUFFIX = "_scale_inv"

_PROJECTIONS = r"(q|k|v|o|qkv|query_key_value|gate|up|down|gate_up|in|out|c)_proj|w[123]|fc[12]|dense|dense_h_to_4h|dense_4h_to_h|query|key|value|c_attn|c_fc"
DEFAULT_QUANTIZED = rf"(^|\.)(self_attn|attn|attention|mlp|experts\.\d+|shared_experts?|feed_forward)\.({_PROJECTIONS})\.weight$"
"""Names quantized by default (before ``skip``): a projection's weight inside an attention, MLP or expert module."""
ALWAYS_KEPT = r"(embed|lm_head|norm|\.bias$|(^|\.)gate\.weight$|shared_expert_gate)"
"""Names never quantized, whatever else matches: embeddings, the head, norms, biases, router gates."""


@dataclass(frozen=True)
class Fp8Rule:
    """Which tensors are quantized (see the module docstring); ``skip``: module-name regexes kept unquantized."""

    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for pattern in self.skip:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"fp8 skip pattern {pattern!r} is not a regular expression ({e}); give module-name "
                                  "patterns such as 'layers\\.0\\.' or 'mlp\\.down_proj'") from None

    def quantized(self, name: str, shape: Sequence[int]) -> bool:
        if len(shape) != 2 or not re.search(DEFAULT_QUANTIZED, name) or re.search(ALWAYS_KEPT, name):
            return False
        module = name.removesuffix(".weight")
        return not any(re.search(p, module) for p in self.skip)


def scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The ``_scale_inv`` shape of a quantized ``[N, K]`` weight: ``(ceil(N/128), ceil(K/128))``."""
    n, k = shape
    return -(-n // BLOCK), -(-k // BLOCK)


def fp8_wire_specs(specs: Sequence[ParamSpec], rule: Fp8Rule) -> list[ParamSpec]:
    """What travels for ``specs`` (serving-dtype specs): each quantized weight as FP8, its scales right after."""
    out = []
    for s in specs:
        if s.dtype.is_floating_point and rule.quantized(s.name, s.shape):
            out += [ParamSpec(s.name, s.shape, FP8_DTYPE), ParamSpec(s.name + SCALE_SUFFIX, scale_shape(s.shape), torch.float32)]
        else:
            out.append(s)
    return out


FIRST_BUCKET_DIVISOR = 8
"""The first FP8 bucket holds at most 1/8 of a bucket, the next 1/4, 1/2, then whole buckets: nothing hides the first
bucket's fill (its quantization: twice the elements per byte of a bf16 bucket), and each later one is filled while
the one before travels."""


def plan_fp8_buckets(specs: Sequence[ParamSpec], rule: Fp8Rule, bucket_bytes: int) -> list[Bucket]:
    """The FP8 wire tensors of ``specs`` (serving-dtype specs) in buckets of at most ``bucket_bytes``, the first
    ones ramping up from ``bucket_bytes / FIRST_BUCKET_DIVISOR`` (see :data:`FIRST_BUCKET_DIVISOR`)."""
    return plan_buckets(fp8_wire_specs(specs, rule), bucket_bytes, first_bytes=max(1, bucket_bytes // FIRST_BUCKET_DIVISOR))


def quantization_config(specs: Sequence[ParamSpec], rule: Fp8Rule) -> dict:
    """The HF ``quantization_config`` of an FP8 snapshot of ``specs`` (serving-dtype specs): SGLang and transformers
    load it as a block-FP8 checkpoint; ``modules_to_not_convert`` names every 2-D weight's module left as is, and
    ``lm_head`` (a tied head is not in the snapshot)."""
    kept = [s.name.removesuffix(".weight") for s in specs
            if len(s.shape) == 2 and s.name.endswith(".weight") and not rule.quantized(s.name, s.shape)]
    if "lm_head" not in kept:  # a tied head is not sent, but a loader builds it: it stays unquantized
        kept.append("lm_head")
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": kept}


# ---------------------------------------------------------------- the arithmetic


_scratch = threading.local()


def scratch_buffer(key: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of a buffer this thread keeps across calls (:func:`bridge.tensors.kept_buffer`), for the
    quantization's block buffers and the gather's pieces: a fresh one per weight and per piece costs a fresh mapping."""
    return kept_buffer(_scratch.__dict__.setdefault("bufs", {}), (key, dtype, device), n, dtype, device)


def block_amax(rows: torch.Tensor, row0: int, n_blocks: int, served: torch.dtype | None = None) -> torch.Tensor:
    """Absmax per 128x128 block of the full tensor's grid, over ``rows`` (its rows ``row0 ..``) cast to ``served``
    (default: their dtype); 0 elsewhere."""
    served = served or rows.dtype
    k = rows.shape[1]
    kb = -(-k // BLOCK)
    grid = torch.zeros(n_blocks, kb, dtype=torch.float32, device=rows.device)
    n = rows.shape[0]
    if n == 0:
        return grid
    b0, b1 = row0 // BLOCK, -(-(row0 + n) // BLOCK)
    if whole_blocks(rows, row0):
        # No copy: max(amax, -amin) of each block, in the rows' own dtype, then cast: rounding to ``served`` is
        # monotonic and symmetric, so the absmax of the cast values is the cast of the absmax.
        v = rows.view(n, kb, BLOCK)  # (amax and amin over contiguous runs of 128: faster than aminmax)
        grid[b0:b1] = torch.maximum(v.amax(-1), v.amin(-1).neg()).view(n // BLOCK, BLOCK, kb).amax(1).to(served).float()
        return grid
    rows = rows.to(served)
    padded = torch.zeros((b1 - b0) * BLOCK, kb * BLOCK, dtype=torch.float32, device=rows.device)
    padded[row0 - b0 * BLOCK: row0 - b0 * BLOCK + n, :k] = rows.abs()
    grid[b0:b1] = padded.view(b1 - b0, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    return grid


def whole_blocks(rows: torch.Tensor, row0: int) -> bool:
    """The rows start and end on block boundaries and the columns fill whole blocks (a view does)."""
    return row0 % BLOCK == 0 and rows.shape[0] % BLOCK == 0 and rows.shape[1] % BLOCK == 0 and rows.is_contiguous()


def fp32_block_rows(rows: torch.Tensor, served: torch.dtype):
    """Each block row of block-aligned ``rows`` (``[n, k]``), cast to ``served`` and copied into one fp32 buffer
    this thread reuses, viewed ``[BLOCK, k // BLOCK, BLOCK]``: ``(b, buffer)``, the buffer valid until the next."""
    n, k = rows.shape
    kb = k // BLOCK
    tmp = scratch_buffer("tmp", BLOCK * k, torch.float32, rows.device).view(BLOCK, kb, BLOCK)
    cast = None if rows.dtype == served else scratch_buffer("cast", BLOCK * k, served, rows.device).view(BLOCK, kb, BLOCK)
    for b in range(n // BLOCK):
        block = rows[b * BLOCK: (b + 1) * BLOCK].view(BLOCK, kb, BLOCK)
        if cast is not None:
            block = cast.copy_(block)
        yield b, tmp.copy_(block)


def block_scales(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=AMAX_FLOOR) / FP8_MAX


def quantize_rows(rows: torch.Tensor, row0: int, scale: torch.Tensor, out: torch.Tensor | None = None,
                   served: torch.dtype | None = None) -> torch.Tensor:
    """``rows`` (rows ``row0 ..`` of a weight) cast to ``served`` (default: their dtype), as e4m3fn with the full
    weight's block ``scale`` (into ``out``)."""
    served = served or rows.dtype
    n, k = rows.shape
    if whole_blocks(rows, row0):
        # One block row at a time through a small fp32 buffer, the block's reciprocal broadcast over a view. No
        # clamp: |w| <= absmax and 1/scale rounds to within 2**-23 of 448/absmax, so |w/scale| < 448.001, which
        # rounds to 448 (the same bytes as clamping first).
        b0, kb = row0 // BLOCK, k // BLOCK
        out = torch.empty(n, k, dtype=FP8_DTYPE, device=rows.device) if out is None else out
        if kernels.quantize_blocks(rows, served, out, scale[b0: b0 + n // BLOCK].contiguous(), False, AMAX_FLOOR):
            return out  # (the C kernel, the same bytes in two passes per block row)
        inv = 1.0 / scale[b0: b0 + n // BLOCK]
        # The product in fp32 of fp32 operands: torch.mul of a bf16 and an fp32 tensor into fp32 computes the same
        # values but takes a slower path on CPU than a copy into fp32 followed by an fp32 multiply.
        for b, tmp in fp32_block_rows(rows, served):
            tmp.mul_(inv[b].view(1, kb, 1))
            out[b * BLOCK: (b + 1) * BLOCK].copy_(tmp.view(BLOCK, k))
        return out
    rows = rows.to(served)
    idx = torch.arange(row0, row0 + n, device=rows.device) // BLOCK
    per = scale[idx].repeat_interleave(BLOCK, dim=1)[:, :k]
    q = (rows.float() * (1.0 / per)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q if out is None else out.copy_(q)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of a whole 2-D weight (the same bytes as :func:`bridge.sources.fp8.gather_fp8_bucket` makes from shards)."""
    if w.dim() != 2:
        raise ConfigError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    scale = block_scales(block_amax(w, 0, -(-w.shape[0] // BLOCK)))
    return quantize_rows(w, 0, scale), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``q * scale`` per block, in ``dtype`` (SGLang's ``block_quant_dequant``)."""
    n, k = q.shape
    per = scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return (q.to(torch.float32) * per).to(dtype)
