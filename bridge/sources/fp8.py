"""Block FP8 made on the trainer ranks that hold the rows: :func:`gather_fp8_bucket` fills the FP8 wire bucket on
the rank that sends it, never the whole model on one rank (the format: :mod:`bridge.codecs.fp8`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bridge.codecs import kernels
from bridge.codecs.fp8 import (
    AMAX_FLOOR,
    BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    block_amax,
    block_scales,
    fp32_block_rows,
    quantize_rows,
    scratch_buffer,
    whole_blocks,
)
from bridge.tensors import ParamSpec

__all__ = ["OwnScales", "gather_fp8_bucket", "own_blocks", "quantize_own_blocks"]


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
        if self.grid is None and whole_blocks(self.rows, self.row0):
            self.grid = quantize_own_blocks(self.rows, out, self.spec.dtype)
            return
        grid = torch.zeros(-(-self.spec.shape[0] // BLOCK), -(-self.spec.shape[1] // BLOCK), dtype=torch.float32)
        b0 = self.row0 // BLOCK
        grid[b0: b0 + self.blocks().shape[0]] = self.blocks()
        quantize_rows(self.rows, self.row0, grid.to(self.rows.device), out=out, served=self.spec.dtype)


def quantize_own_blocks(rows: torch.Tensor, out: torch.Tensor, served: torch.dtype) -> torch.Tensor:
    """Block-aligned ``rows`` cast to ``served`` as e4m3fn into ``out``, each block row's absmax taken from the
    same fp32 buffer that is then scaled (the values and bytes of :func:`block_amax` then :func:`quantize_rows`:
    the absmax of the cast values, no clamp needed); the scales of these rows' blocks."""
    n, k = rows.shape
    kb = k // BLOCK
    grid = torch.empty(n // BLOCK, kb, dtype=torch.float32, device=rows.device)
    if kernels.quantize_blocks(rows, served, out, grid, True, AMAX_FLOOR):
        return grid  # (the C kernel: the same bytes and scales in two passes per block row)
    for b, tmp in fp32_block_rows(rows, served):
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
    send = scratch_buffer("send", total, torch.uint8, device)  # (padding bytes are sent, never read)
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
        recv = direct or list(scratch_buffer("recv", world * total, torch.uint8, device).split(total))
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
