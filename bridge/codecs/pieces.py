"""The digest that names a delta's base: CRC32 of each piece's bytes, the pieces cut as the trainer's ranks hold them
(:func:`pieces_of`: FSDP2 row chunks of ``world`` ranks, or the whole tensor), combined over the sorted names
(:func:`combine_digest`). A server that holds whole tensors cuts them the same way."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

__all__ = ["combine_digest", "piece_crc", "pieces_of"]


def pieces_of(shape: Sequence[int], world: int, whole: bool) -> list[tuple[int, int]]:
    """The (start, length) pieces of a tensor's flat view as ``world`` FSDP2 ranks hold its rows (the chunks
    of ``torch.chunk``: ``ceil(rows / world)`` rows each, the last ones shorter or empty), or the whole
    tensor; empty pieces left out."""
    numel = math.prod(shape)
    if whole or world == 1 or len(shape) == 0 or not numel:
        return [(0, numel)] if numel else []
    rows, row = shape[0], numel // shape[0]
    c = -(-rows // world)
    return [(r * c * row, (min(rows, (r + 1) * c) - r * c) * row) for r in range(world) if r * c < rows]


def piece_crc(flat: torch.Tensor, start: int, length: int) -> int:
    """CRC32 of a piece's bytes (the tensor's flat view on the CPU)."""
    if not length:
        return 0
    piece = flat[start : start + length]
    if piece.device.type != "cpu":
        piece = piece.cpu()
    return zlib.crc32(piece.contiguous().view(torch.uint8).numpy())


def combine_digest(entries: Sequence[tuple[str, int, int, int]]) -> int:
    """One digest of a base from its pieces' (name, start, length, crc), in any order."""
    text = ";".join(f"{n}:{s}:{ln}:{c}" for n, s, ln, c in sorted(entries))
    return zlib.crc32(text.encode())
