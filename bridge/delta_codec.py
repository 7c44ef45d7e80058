"""The byte format of a delta: what changed in a tensor since the base a server serves, and how to apply it.

This module needs only torch and the standard library: trainer ranks encode with it, the reference
server applies with it, and the loader real SGLang imports (:mod:`bridge.sglang_delta_loader`) decodes with
it inside SGLang's scheduler process.

A delta bucket is one ``uint8`` buffer: a sequence of *records*, then zero padding. A record is what one
trainer rank changed in one tensor: the elements ``[start, start + length)`` of the tensor's flat
(row-major) view, which that rank holds (its FSDP2 rows, or the whole tensor). Each record starts with a
header of six little-endian int64 (:data:`HEADER_BYTES`)::

    [tensor, kind, start, length, count, itemsize]

``tensor`` indexes the bucket's tensor table (sent beside the buffer: names, dtypes, shapes), ``count`` is
how many of the ``length`` elements changed, ``itemsize`` the bytes per element. Then the sections, each
padded to 8 bytes, which keeps every section aligned for a zero-copy view:

=================  ======================================================================================
kind               sections
=================  ======================================================================================
``SPARSE32`` (1)   ``count`` int32 positions (relative to ``start``, increasing), ``count`` values
``SPARSE64`` (2)   the same with int64 positions (a piece of 2**31 elements or more)
``BITMASK`` (3)    ``ceil(length / 8)`` bytes, bit ``i % 8`` of byte ``i // 8`` set where element ``i``
                   changed (little-endian bit order), then ``count`` values in position order
``DENSE`` (4)      ``length`` values: the whole piece
=================  ======================================================================================

A header whose ``kind`` is 0 ends the buffer (what follows is padding). The encoder picks, per record,
the smallest of the three (:func:`choose`); values are the new bytes, never a difference, so applying a
record is a plain assignment and the result is bit-exact.

The base is named by a digest (:func:`combine_digest`): CRC32 of each piece's bytes, the pieces cut as
the trainer's ranks hold them (:func:`pieces_of`: FSDP2 row chunks of ``world`` ranks, or the whole
tensor), combined over the sorted names. A server that holds whole tensors cuts them the same way.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "BITMASK", "DELTA_TENSOR", "DENSE", "HEADER_BYTES", "KIND_NAMES", "SPARSE32", "SPARSE64", "DeltaFormatError", "Record",
    "INTS", "apply_record", "changed_positions", "choose", "combine_digest", "differing_lanes", "flatnonzero",
    "iter_records", "pack_bits", "pieces_of", "piece_crc", "record_nbytes", "unpack_bits", "write_record",
]

DELTA_TENSOR = "wsync.delta"
"""The name a delta bucket travels under: one uint8 tensor (the records), beside its table."""

SPARSE32, SPARSE64, BITMASK, DENSE = 1, 2, 3, 4
KIND_NAMES = {SPARSE32: "indices+values", SPARSE64: "indices+values", BITMASK: "bitmask+values", DENSE: "dense"}
HEADER_BYTES = 48
_SHIFTS = torch.arange(8, dtype=torch.uint8)


class DeltaFormatError(ValueError):
    """A delta buffer or its tensor table is malformed; the message names the record and what is wrong."""


def _numpy(wanted: bool = True):
    """numpy, for tensors on the CPU (``wanted``), or None: not wanted, or missing (the loader needs only torch)."""
    if not wanted:
        return None
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def record_nbytes(kind: int, length: int, count: int, itemsize: int) -> int:
    """Bytes of one record (header and padded sections)."""
    values = _pad8(count * itemsize)
    if kind == SPARSE32:
        return HEADER_BYTES + _pad8(4 * count) + values
    if kind == SPARSE64:
        return HEADER_BYTES + 8 * count + values
    if kind == BITMASK:
        return HEADER_BYTES + _pad8((length + 7) // 8) + values
    if kind == DENSE:
        return HEADER_BYTES + _pad8(length * itemsize)
    raise DeltaFormatError(f"unknown record kind {kind}")


def choose(length: int, count: int, itemsize: int) -> tuple[int, int]:
    """The smallest encoding of ``count`` changed elements among ``length``: (kind, record bytes)."""
    sparse = SPARSE32 if length < 2**31 else SPARSE64
    return min(((k, record_nbytes(k, length, count, itemsize)) for k in (sparse, BITMASK, DENSE)),
               key=lambda kb: kb[1])


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as ``ceil(n / 8)`` bytes, little-endian bit order (numpy's ``packbits`` on CPU)."""
    mask = mask.reshape(-1)
    np = _numpy(mask.device.type == "cpu")
    if np is not None:
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros(_pad8(n) if n % 8 else n, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The bool vector of ``n`` elements that :func:`pack_bits` packed."""
    np = _numpy(packed.device.type == "cpu")
    if np is not None:
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1)[:n].bool()


INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: views that compare bytes exactly (NaN, -0.0)."""


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """A same-size integer view of ``t``, so that comparing bytes is exact (NaN, -0.0)."""
    return t.view(INTS[t.element_size()])


def flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 positions of the true elements of a flat bool tensor, increasing (numpy's one pass on CPU)."""
    np = _numpy(mask.device.type == "cpu")
    if np is not None:
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().squeeze(1)


def differing_lanes(new_words: torch.Tensor, base_words: torch.Tensor, words: torch.Tensor,
                    itemsize: int) -> torch.Tensor:
    """int64 positions of the elements (``itemsize`` bytes each) that differ inside the given differing words.

    ``new_words``/``base_words`` are two flat tensors seen as 8-byte words, ``words`` the increasing int64
    indices of the words that differ. Each differing word holds ``8 // itemsize`` elements; the positions come
    out increasing. On the CPU numpy does it in a few passes over the differing words alone (torch's gathers and
    boolean indexing took three times as long)."""
    per = 8 // itemsize
    shift = per.bit_length() - 1
    np = _numpy(words.device.type == "cpu")
    if np is not None:
        w = words.numpy()
        flips = np.take(new_words.numpy(), w) ^ np.take(base_words.numpy(), w)
        lanes = np.flatnonzero(flips.view(f"i{itemsize}") != 0)
        return torch.from_numpy(w[lanes >> shift] * per + (lanes & (per - 1)))
    flips = torch.take(new_words, words) ^ torch.take(base_words, words)
    lanes = flatnonzero(flips.view(INTS[itemsize]) != 0)
    return torch.take(words, lanes >> shift) * per + (lanes & (per - 1))


def changed_positions(new: torch.Tensor, old: torch.Tensor, kind: int, mask: torch.Tensor | None = None):
    """What to keep of a changed piece for its record: int positions (sparse kinds) or packed bits."""
    if mask is None:
        mask = _as_ints(new) != _as_ints(old)
    if kind in (SPARSE32, SPARSE64):
        return flatnonzero(mask).to(torch.int32 if kind == SPARSE32 else torch.int64)
    return pack_bits(mask)


def write_record(out: torch.Tensor, tensor: int, kind: int, start: int, piece: torch.Tensor,
                 positions: torch.Tensor | None, count: int, values: torch.Tensor | None = None) -> int:
    """Write one record into the uint8 tensor ``out`` (8-byte aligned, long enough); its byte size.

    ``piece`` is the tensor's new values over ``[start, start + length)`` (flat), ``positions`` what
    :func:`changed_positions` gave for ``kind`` (None for ``DENSE``); ``values``, when given, the new values
    at the changed positions (else taken from ``piece``)."""
    length, itemsize = piece.numel(), piece.element_size()
    nbytes = record_nbytes(kind, length, count, itemsize)
    header = torch.tensor([tensor, kind, start, length, count, itemsize], dtype=torch.int64)
    out[:HEADER_BYTES].view(torch.int64).copy_(header)
    at = HEADER_BYTES
    if kind == DENSE:
        out[at : at + length * itemsize].view(piece.dtype).copy_(piece)
        return nbytes
    if kind == BITMASK:
        n = positions.numel()
        out[at : at + n].copy_(positions)
        if values is None:
            values = piece[unpack_bits(positions.cpu(), length).to(piece.device)]
        at += _pad8(n)
    else:
        width = positions.element_size()
        out[at : at + count * width].view(positions.dtype).copy_(positions)
        if values is None:
            values = piece.index_select(0, positions.to(piece.device))
        at += _pad8(count * width)
    out[at : at + count * itemsize].view(piece.dtype).copy_(values)
    return nbytes


@dataclass(frozen=True)
class Record:
    """One decoded record: views into the buffer, no copy."""

    tensor: int
    kind: int
    start: int
    length: int
    count: int
    positions: torch.Tensor | None
    """int32/int64 positions (sparse kinds), packed bits (``BITMASK``), None (``DENSE``)."""
    values: torch.Tensor
    """The new values (``count`` of them, or ``length`` for ``DENSE``), as raw bytes until typed by
    :func:`iter_records`."""

    def flat_positions(self) -> torch.Tensor | None:
        """int64 positions in the whole tensor's flat view (None for ``DENSE``: every one of the piece)."""
        if self.kind == DENSE:
            return None
        if self.kind == BITMASK:
            local = unpack_bits(self.positions, self.length).nonzero().squeeze(1)
        else:
            local = self.positions.to(torch.int64)
        return local + self.start


def iter_records(buf: torch.Tensor, dtypes: Sequence[torch.dtype], numels: Sequence[int]) -> Iterator[Record]:
    """The records of a delta buffer, each checked against the tensor table (``dtypes``, ``numels``).

    Raises:
        DeltaFormatError: a record runs past the buffer, names no tensor of the table, leaves its tensor,
            has another itemsize than its tensor's dtype, or positions out of order or range.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise DeltaFormatError(f"a delta must be a 1-D uint8 buffer, got {buf.dtype} of shape {tuple(buf.shape)}")
    at, n, i = 0, buf.numel(), 0
    while at + HEADER_BYTES <= n:
        tensor, kind, start, length, count, itemsize = buf[at : at + HEADER_BYTES].view(torch.int64).tolist()
        if kind == 0:
            return
        where = f"record {i} (byte {at})"
        if not 0 <= tensor < len(dtypes):
            raise DeltaFormatError(f"{where} names tensor {tensor}; the table has {len(dtypes)}")
        dtype, numel = dtypes[tensor], numels[tensor]
        if itemsize != dtype.itemsize:
            raise DeltaFormatError(f"{where}: itemsize {itemsize}, but tensor {tensor} is {dtype}")
        if not (0 <= start and 0 <= length and start + length <= numel and 0 <= count <= length):
            raise DeltaFormatError(f"{where}: elements [{start}, {start + length}) with {count} changed do not fit "
                                   f"tensor {tensor} of {numel} elements")
        size = record_nbytes(kind, length, count, itemsize)
        if at + size > n:
            raise DeltaFormatError(f"{where} needs {size} bytes, {n - at} are left")
        body, at = buf[at + HEADER_BYTES : at + size], at + size
        positions, values = _sections(body, kind, length, count, itemsize, where)
        yield Record(tensor, kind, start, length, count, positions, values.view(dtype))
        i += 1


def _sections(body: torch.Tensor, kind: int, length: int, count: int, itemsize: int, where: str):
    if kind == DENSE:
        return None, body[: length * itemsize]
    if kind == BITMASK:
        nb = (length + 7) // 8
        positions, values = body[:nb], body[_pad8(nb) : _pad8(nb) + count * itemsize]
        if int(unpack_bits(positions, length).sum()) != count:
            raise DeltaFormatError(f"{where}: the bitmask sets another number of elements than its count {count}")
        return positions, values
    width = 4 if kind == SPARSE32 else 8
    positions = body[: count * width].view(torch.int32 if width == 4 else torch.int64)
    if count and (int(positions[0]) < 0 or int(positions[-1]) >= length
                  or (count > 1 and not bool((positions[1:] > positions[:-1]).all()))):
        raise DeltaFormatError(f"{where}: positions must increase within [0, {length})")
    return positions, body[_pad8(count * width) : _pad8(count * width) + count * itemsize]


def apply_record(flat: torch.Tensor, rec: Record) -> None:
    """Assign a record's new values into ``flat`` (the whole tensor's flat view, of the record's dtype)."""
    piece = flat[rec.start : rec.start + rec.length]
    values = rec.values.to(flat.device)
    if rec.kind == DENSE:
        piece.copy_(values)
    elif rec.kind == BITMASK:
        piece.masked_scatter_(unpack_bits(rec.positions, rec.length).to(flat.device), values)
    else:  # (index_copy_: a third less time than assigning through an index, on 1 % of a tensor)
        piece.index_copy_(0, rec.positions.to(flat.device, torch.int64), values)


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
