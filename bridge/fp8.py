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

Quantization runs on the trainer ranks that hold the rows (:func:`gather_fp8_bucket`): per bucket, when every
rank's rows of each quantized weight are whole 128-row blocks (FSDP2 row chunks of a multiple of 128 rows, as
on ``medium`` with 2 ranks, and on ``small`` but for its 128-row k/v projections; any weight on one rank),
each rank quantizes its rows in one pass, taking each block's absmax as it goes, and its rows of the scales
travel with its FP8 bytes; otherwise each rank takes the absmax of its own rows per block and one
``all_reduce(MAX)`` of those (1/16384 of the elements) gives every rank the scales first. The FP8 bytes (half the bf16 bytes) are gathered to the rank that sends the bucket. Never the whole
model on one rank.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bridge.buckets import Bucket, plan_buckets
from bridge.errors import ConfigError
from bridge.tensors import ParamSpec, kept_buffer

__all__ = [
    "BLOCK", "FIRST_BUCKET_DIVISOR", "FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "Fp8Linear", "Fp8Rule", "OwnScales",
    "block_amax", "block_scales", "dequantize", "fp8_wire_specs", "gather_fp8_bucket", "own_blocks", "plan_fp8_buckets",
    "quantization_config", "quantize", "quantize_module", "quantize_rows", "scale_shape",
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


def _reused(key: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of a buffer this thread keeps across calls (:func:`bridge.tensors.kept_buffer`): the
    quantization's block buffers and the gather's pieces took a fresh mapping each, per weight and per piece."""
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
    if _aligned(rows, row0):
        # No copy: max(amax, -amin) of each block, in the rows' own dtype, then cast: rounding to ``served`` is
        # monotonic and symmetric, so the absmax of the cast values is the cast of the absmax.
        v = rows.view(n, kb, BLOCK)  # (amax and amin over contiguous runs of 128: 3x faster here than aminmax)
        grid[b0:b1] = torch.maximum(v.amax(-1), v.amin(-1).neg()).view(n // BLOCK, BLOCK, kb).amax(1).to(served).float()
        return grid
    rows = rows.to(served)
    padded = torch.zeros((b1 - b0) * BLOCK, kb * BLOCK, dtype=torch.float32, device=rows.device)
    padded[row0 - b0 * BLOCK: row0 - b0 * BLOCK + n, :k] = rows.abs()
    grid[b0:b1] = padded.view(b1 - b0, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    return grid


def _aligned(rows: torch.Tensor, row0: int) -> bool:
    """The rows start and end on block boundaries and the columns fill whole blocks (a view does)."""
    return row0 % BLOCK == 0 and rows.shape[0] % BLOCK == 0 and rows.shape[1] % BLOCK == 0 and rows.is_contiguous()


def block_scales(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=AMAX_FLOOR) / FP8_MAX


def quantize_rows(rows: torch.Tensor, row0: int, scale: torch.Tensor, out: torch.Tensor | None = None,
                   served: torch.dtype | None = None) -> torch.Tensor:
    """``rows`` (rows ``row0 ..`` of a weight) cast to ``served`` (default: their dtype), as e4m3fn with the full
    weight's block ``scale`` (into ``out``)."""
    served = served or rows.dtype
    n, k = rows.shape
    if _aligned(rows, row0):
        # One block row at a time through a small fp32 buffer, the block's reciprocal broadcast over a view. No
        # clamp: |w| <= absmax and 1/scale rounds to within 2**-23 of 448/absmax, so |w/scale| < 448.001, which
        # rounds to 448 (the same bytes as clamping first).
        b0, kb = row0 // BLOCK, k // BLOCK
        inv = 1.0 / scale[b0: b0 + n // BLOCK]
        out = torch.empty(n, k, dtype=FP8_DTYPE, device=rows.device) if out is None else out
        tmp = _reused("tmp", BLOCK * k, torch.float32, rows.device).view(BLOCK, kb, BLOCK)
        cast = None if rows.dtype == served else _reused("cast", BLOCK * k, served, rows.device).view(BLOCK, kb, BLOCK)
        # The product in fp32 of fp32 operands: torch.mul of a bf16 and an fp32 tensor into fp32 computes the same
        # values but takes a path 2x slower on CPU than a copy into fp32 followed by an fp32 multiply.
        for b in range(n // BLOCK):
            block = rows[b * BLOCK: (b + 1) * BLOCK].view(BLOCK, kb, BLOCK)
            if cast is not None:
                block = cast.copy_(block)
            tmp.copy_(block).mul_(inv[b].view(1, kb, 1))
            out[b * BLOCK: (b + 1) * BLOCK].copy_(tmp.view(BLOCK, k))
        return out
    rows = rows.to(served)
    idx = torch.arange(row0, row0 + n, device=rows.device) // BLOCK
    per = scale[idx].repeat_interleave(BLOCK, dim=1)[:, :k]
    q = (rows.float() * (1.0 / per)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q if out is None else out.copy_(q)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of a whole 2-D weight (the same bytes as :func:`gather_fp8_bucket` makes from shards)."""
    if w.dim() != 2:
        raise ConfigError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    scale = block_scales(block_amax(w, 0, -(-w.shape[0] // BLOCK)))
    return quantize_rows(w, 0, scale), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``q * scale`` per block, in ``dtype`` (SGLang's ``block_quant_dequant``)."""
    n, k = q.shape
    per = scale_inv.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return (q.to(torch.float32) * per).to(dtype)


# ---------------------------------------------------------------- served FP8 (the reference server)


class Fp8Linear(torch.nn.Module):
    """A linear layer served as block FP8: ``weight`` (e4m3fn) and ``weight_scale_inv`` (fp32), computing with
    their block dequantization in the activations' dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        q, scale = quantize(linear.weight.detach())
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, dequantize(self.weight, self.weight_scale_inv, x.dtype), self.bias)


def quantize_module(model: torch.nn.Module, rule: Fp8Rule) -> list[str]:
    """Replace every linear layer whose weight the rule quantizes by an :class:`Fp8Linear`; their names."""
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and rule.quantized(f"{name}.weight", tuple(mod.weight.shape)):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, Fp8Linear(mod))
            done.append(name)
    return done


# ---------------------------------------------------------------- on the trainer ranks


def gather_fp8_bucket(source, bucket, out: torch.Tensor | None, by_name: dict[str, ParamSpec], group=None,
                      dst: int = 0, piece_bytes: int | None = None) -> None:
    """Collective: fill rank ``dst``'s ``out`` (the FP8 wire bucket) from every rank's own rows, cast to the serving
    dtype first (what is quantized is what a full sync would serve).

    ``by_name``: the source's spec of every tensor (serving dtype). Each rank takes its rows of the bucket's
    tensors (``source.local_shards``). When each rank's rows of every quantized one are whole 128-row blocks
    (:func:`own_blocks`), its scales are its own: it quantizes its rows in one pass and sends its rows of the
    scales with them. Otherwise it takes the block absmax of its rows, one ``all_reduce(MAX)`` gives every rank
    the scales, it quantizes its rows, and ``dst`` writes the scales it already holds. The FP8 (or
    serving-dtype) bytes are gathered to ``dst`` in flat pieces.
    """
    from bridge.sources import piece_bytes_for

    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_available() and dist.is_initialized() else (1, 0)
    scale_names = {s.name.removesuffix(SCALE_SUFFIX) for s in bucket.specs if s.name.endswith(SCALE_SUFFIX)
                   and s.name.removesuffix(SCALE_SUFFIX) in by_name}
    wire = {s.name: s for s in bucket.specs}
    moved = [s.name for s in bucket.specs if s.name in by_name]
    needed = list(dict.fromkeys(moved + sorted(scale_names)))
    shards = {sh.spec.name: sh for sh in source.local_shards([by_name[n] for n in needed])}
    quant = [n for n in needed if n in scale_names or (n in wire and wire[n].dtype == FP8_DTYPE)]
    offsets = dict(zip(bucket.names, bucket.offsets))
    if all(own_blocks(by_name[n].shape, world, shards[n].whole) for n in quant):
        # Each rank's rows cover whole 128-row blocks: its scales are its own, no all_reduce; each rank quantizes
        # its rows in one pass (the block absmax taken as it goes) and its rows of the scales travel with them.
        own = {n: OwnScales(shards[n], by_name[n]) for n in quant}
        parts = [_Part(wire[n], shards[n], world, rank, own.get(n), by_name[n].dtype) for n in moved]
        parts += [_ScalePart(wire[n + SCALE_SUFFIX], shards[n], world, rank, own[n]) for n in quant if n in scale_names]
    else:
        scales = _agreed_scales(quant, shards, by_name, world, group)
        if rank == dst and out is not None:
            for n in scale_names:
                at = offsets[n + SCALE_SUFFIX]
                out[at: at + scales[n].numel() * 4].view(torch.float32).copy_(scales[n].reshape(-1))
        parts = [_Part(wire[n], shards[n], world, rank, scales.get(n), by_name[n].dtype) for n in moved]
    # Pieces of a quarter of a bucket over all ranks (the full sync's are an eighth: bridge.sources.piece_bytes_for):
    # half as many gathers, each one step of the ranks in lock, with the quantization of each piece between them;
    # rank dst holds two buckets and 3/8 of one at most (2 ranks), under 2.5x.
    limit = piece_bytes if piece_bytes is not None else piece_bytes_for(2 * bucket.nbytes, world)
    piece: list[_Part] = []
    for p in parts:
        if piece and sum(q.slot for q in piece) + p.slot > limit:
            _gather_parts(piece, offsets, out, world, rank, group, dst)
            piece = []
        piece.append(p)
    if piece:
        _gather_parts(piece, offsets, out, world, rank, group, dst)


def own_blocks(shape, world: int, whole: bool) -> bool:
    """Every rank's rows of a ``shape`` weight (row chunks of ``ceil(N/world)``, or all on rank 0) are whole
    128-row blocks (the last rank's ending with the tensor)."""
    return whole or world == 1 or -(-shape[0] // world) % BLOCK == 0


class OwnScales:
    """This rank's block scales of one weight whose rows are whole blocks (:func:`own_blocks`): taken by the
    quantization as it goes (:meth:`quantize`), or by one absmax pass when the scales are written first."""

    def __init__(self, shard, spec: ParamSpec):
        self.shard, self.spec, self.grid = shard, spec, None
        self.rows = None if shard.local is None else shard.local.view(-1, spec.shape[1])
        self.row0 = shard.start // spec.shape[1]

    def blocks(self) -> torch.Tensor:
        """This rank's rows of the scale grid (``[own block rows, ceil(K/128)]``, fp32)."""
        if self.grid is None:
            nb = -(-self.spec.shape[0] // BLOCK)
            grid = block_scales(block_amax(self.rows, self.row0, nb, self.spec.dtype))
            self.grid = grid[self.row0 // BLOCK: -(-(self.row0 + self.rows.shape[0]) // BLOCK)]
        return self.grid

    def quantize(self, out: torch.Tensor) -> None:
        """This rank's rows as e4m3fn into ``out`` (``[rows, K]``), in one pass when the scales are not known yet."""
        if self.grid is None and _aligned(self.rows, self.row0):
            self.grid = _quantize_own_blocks(self.rows, out, self.spec.dtype)
            return
        grid = torch.zeros(-(-self.spec.shape[0] // BLOCK), -(-self.spec.shape[1] // BLOCK), dtype=torch.float32)
        b0 = self.row0 // BLOCK
        grid[b0: b0 + self.blocks().shape[0]] = self.blocks()
        quantize_rows(self.rows, self.row0, grid.to(self.rows.device), out=out, served=self.spec.dtype)


def _quantize_own_blocks(rows: torch.Tensor, out: torch.Tensor, served: torch.dtype) -> torch.Tensor:
    """Block-aligned ``rows`` cast to ``served`` as e4m3fn into ``out``, each block row's absmax taken from the
    same fp32 buffer that is then scaled (the values and bytes of :func:`block_amax` then :func:`quantize_rows`:
    the absmax of the cast values, no clamp needed); the scales of these rows' blocks."""
    n, k = rows.shape
    kb = k // BLOCK
    grid = torch.empty(n // BLOCK, kb, dtype=torch.float32, device=rows.device)
    tmp = _reused("tmp", BLOCK * k, torch.float32, rows.device).view(BLOCK, kb, BLOCK)
    cast = None if rows.dtype == served else _reused("cast", BLOCK * k, served, rows.device).view(BLOCK, kb, BLOCK)
    for b in range(n // BLOCK):
        block = rows[b * BLOCK: (b + 1) * BLOCK].view(BLOCK, kb, BLOCK)
        if cast is not None:
            block = cast.copy_(block)
        tmp.copy_(block)
        flat = tmp.view(BLOCK * kb, BLOCK)
        amax = torch.maximum(flat.amax(-1), flat.amin(-1).neg()).view(BLOCK, kb).amax(0)
        grid[b] = block_scales(amax)
        tmp.mul_((1.0 / grid[b]).view(1, kb, 1))
        out[b * BLOCK: (b + 1) * BLOCK].copy_(tmp.view(BLOCK, k))
    return grid


def _agreed_scales(names, shards, by_name, world, group) -> dict[str, torch.Tensor]:
    grids = []
    for n in names:
        sh, shape = shards[n], by_name[n].shape
        nb = -(-shape[0] // BLOCK)
        if sh.local is None:
            grids.append(torch.zeros(nb, -(-shape[1] // BLOCK), dtype=torch.float32))
        else:
            grids.append(block_amax(sh.local.view(-1, shape[1]), sh.start // shape[1], nb, by_name[n].dtype))
    if not grids:
        return {}
    flat = torch.cat([g.reshape(-1).cpu() for g in grids])  # (1/16384 of the elements; some may be on a GPU)
    if world > 1:
        if dist.get_backend(group) == "nccl":
            flat = flat.cuda()
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    flat = block_scales(flat.cpu())
    out, at = {}, 0
    for n, g in zip(names, grids):
        out[n] = flat[at: at + g.numel()].view(g.shape)
        at += g.numel()
    return out


class _Part:
    """One tensor of a piece: this rank's bytes of it (quantized or cast) and where every rank's rows go."""

    def __init__(self, spec: ParamSpec, shard, world: int, rank: int, scale: torch.Tensor | None, served: torch.dtype):
        self.spec = spec
        numel, cols = spec.numel, (spec.numel // spec.shape[0] if spec.shape and spec.shape[0] else spec.numel)
        if shard.whole:
            self.spans = [(0, numel)] + [(0, 0)] * (world - 1)
        else:
            c = -(-spec.shape[0] // world)
            self.spans = [(r * c * cols, max(0, min(c, spec.shape[0] - r * c)) * cols) for r in range(world)]
        self.slot = -(-max(n for _, n in self.spans) * spec.dtype.itemsize // 8) * 8
        self.local = shard.local if shard.local is not None and self.spans[rank][1] else None
        self.row0, self.scale, self.served = shard.start // max(1, cols), scale, served

    def write(self, dst: torch.Tensor) -> None:
        """This rank's bytes of the tensor into ``dst`` (uint8, exactly their size), quantized or cast on the way."""
        out = dst.view(self.spec.dtype)
        if self.scale is None:
            out.copy_(self.local.reshape(-1))
            return
        rows = self.local.view(-1, self.spec.shape[1])  # quantized from what a full sync serves (served)
        if isinstance(self.scale, OwnScales):
            self.scale.quantize(out.view(rows.shape))
            return
        quantize_rows(rows, self.row0, self.scale.to(rows.device), out=out.view(rows.shape), served=self.served)


class _ScalePart(_Part):
    """The scales of a weight whose rows are whole blocks on every rank: each rank sends its rows of the grid."""

    def __init__(self, spec: ParamSpec, shard, world: int, rank: int, own: OwnScales):
        kb = spec.shape[1]
        if shard.whole:
            spans = [(0, spec.numel)] + [(0, 0)] * (world - 1)
        else:
            # Block rows per rank: a whole number (own_blocks), but with one rank the rows may end inside a block.
            rows = -(-own.spec.shape[0] // world)
            c = -(-rows // BLOCK)
            spans = [(r * c * kb, max(0, min(c, spec.shape[0] - r * c)) * kb) for r in range(world)]
        self.spec, self.spans, self.own, self.scale = spec, spans, own, None
        self.slot = -(-max(n for _, n in spans) * 4 // 8) * 8
        self.local = shard.local if shard.local is not None and spans[rank][1] else None

    def write(self, dst: torch.Tensor) -> None:
        dst.view(torch.float32).copy_(self.own.blocks().reshape(-1))


def _direct_views(parts: list[_Part], offsets, out, total: int, device) -> list[torch.Tensor] | None:
    """Where every rank's bytes of a one-tensor piece lie in ``out`` when each rank sends exactly ``total`` of them
    (then the gather receives straight into the bucket, one copy less); None otherwise."""
    if out is None or len(parts) != 1 or out.device != device:
        return None
    p = parts[0]
    size = p.spec.dtype.itemsize
    if any(n * size != total for _, n in p.spans):
        return None
    return [out[offsets[p.spec.name] + start * size: offsets[p.spec.name] + start * size + total] for start, _ in p.spans]


def _gather_parts(parts: list[_Part], offsets, out, world: int, rank: int, group, dst: int) -> None:
    total = sum(p.slot for p in parts)
    device = next((p.local.device for p in parts if p.local is not None), torch.device("cpu"))
    if world > 1 and dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    send = _reused("send", total, torch.uint8, device)  # (padding bytes are sent, never read)
    at, later = 0, []
    for p in parts:
        if isinstance(p, _ScalePart):  # after the weights: their one-pass quantization takes the scales first
            later.append((p, at))
        elif p.local is not None:
            p.write(send[at: at + p.local.numel() * p.spec.dtype.itemsize])
        at += p.slot
    for p, at in later:
        if p.local is not None:
            p.write(send[at: at + p.spans[rank][1] * 4])
    if world == 1:
        recv = [send]
    elif rank != dst:
        dist.gather(send, None, dst=dst, group=group)
        return
    else:
        direct = _direct_views(parts, offsets, out, total, device)
        recv = direct or list(_reused("recv", world * total, torch.uint8, device).split(total))
        dist.gather(send, recv, dst=dst, group=group)
        if direct:
            return
    if out is None:
        return
    at = 0
    for p in parts:
        size = p.spec.dtype.itemsize
        for r, (start, n) in enumerate(p.spans):
            if n:
                base = offsets[p.spec.name] + start * size
                out[base: base + n * size].copy_(recv[r][at: at + n * size])
        at += p.slot
