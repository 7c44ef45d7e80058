"""The byte format of a delta: what changed in a tensor since the base a server serves, and how to apply it.

This module needs only torch and the standard library (and ``zstandard`` for ``ZSTD`` records): trainer ranks encode with it, the reference
server applies with it, and the loader real SGLang imports (:mod:`bridge.serving.sglang_delta_loader`) decodes with
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
``GAPS8`` (5)      one int64 ``entries``, then ``entries`` uint8 *gaps*, then ``count`` values in position
``GAPS16`` (6)     order; uint16 gaps; uint32 gaps. Reading the gaps from a position ``p = -1``: a gap
``GAPS32`` (7)     ``g > 0`` moves ``p`` by ``g`` and marks ``p`` changed, a gap 0 (the escape) moves it by
                   the type's largest value ``M`` (255, 65535, 2**32 - 1) and marks nothing, so a distance
                   ``d`` between changes is ``(d - 1) // M`` zeros and then ``d - M * ((d - 1) // M)``
kind | ``ZSTD``     (16 | any of the above but ``DENSE``): two int64, ``raw`` and ``stored``, then ``stored``
                   bytes of one zstd frame whose content is the base kind's sections (``raw`` bytes) with its
                   values section written as byte planes (byte 0 of every value, then byte 1, ...)
=================  ======================================================================================

A header whose ``kind`` is 0 ends the buffer (what follows is padding). The encoder picks, per record,
the smallest (:func:`choose`, exact when given the positions), then compresses it with zstd level 1 where
that saves at least :data:`ZSTD_MIN_GAIN` of it (:func:`encode_sparse`); values are the new bytes, never a
difference, so applying a record is a plain assignment and the result is bit-exact. zstd (the
``zstandard`` package) is needed only to write or read a ``ZSTD`` record.

The base is named by a digest (:mod:`bridge.codecs.pieces`); what differs is found with :mod:`bridge.codecs.diff`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from bridge.codecs import kernels
from bridge.codecs.diff import INTS, as_ints, flatnonzero, numpy_or_none, pack_bits, unpack_bits

__all__ = [
    "BITMASK", "DELTA_FIELD", "DELTA_TENSOR", "DENSE", "GAPS8", "GAPS16", "GAPS32", "GAP_KINDS", "HEADER_BYTES", "KIND_NAMES", "SPARSE32",
    "SPARSE64", "ZSTD", "ZSTD_MIN_GAIN", "DeltaFormatError", "Record", "apply_record", "changed_positions", "choose",
    "encode_sparse", "iter_records", "record_nbytes", "write_record",
]

DELTA_TENSOR = "wsync.delta"
"""The name a delta bucket travels under: one uint8 tensor (the records), beside its table."""

DELTA_FIELD = "wsync_delta"
"""The request field of a delta bucket that carries its table (a bucket's ``extra``): what marks a bucket as a delta."""

SPARSE32, SPARSE64, BITMASK, DENSE = 1, 2, 3, 4
GAPS8, GAPS16, GAPS32 = 5, 6, 7
ZSTD = 16
"""A flag on a record's kind: its sections are one zstd frame (see the module docstring)."""
GAP_KINDS = {GAPS8: torch.uint8, GAPS16: torch.uint16, GAPS32: torch.uint32}
_GAP_MAX = {GAPS8: 2**8 - 1, GAPS16: 2**16 - 1, GAPS32: 2**32 - 1}
KIND_NAMES = {SPARSE32: "indices+values", SPARSE64: "indices+values", BITMASK: "bitmask+values", DENSE: "dense",
              GAPS8: "gaps+values", GAPS16: "gaps+values", GAPS32: "gaps+values"}
HEADER_BYTES = 48
ZSTD_LEVEL = 1
ZSTD_MIN_GAIN = 0.03
"""A record is compressed only when zstd saves at least this fraction of its bytes (else decoding it would
cost time for next to nothing)."""


class DeltaFormatError(ValueError):
    """A delta buffer or its tensor table is malformed; the message names the record and what is wrong."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def record_nbytes(kind: int, length: int, count: int, itemsize: int, entries: int | None = None,
                  stored: int = 0) -> int:
    """Bytes of one record (header and padded sections); ``entries``: a gap kind's gaps (``count`` when
    None: no escape), ``stored``: a ``ZSTD`` record's compressed bytes."""
    values = _pad8(count * itemsize)
    if kind & ZSTD and kind & ~ZSTD not in (SPARSE32, SPARSE64, BITMASK, *GAP_KINDS):
        raise DeltaFormatError(f"unknown record kind {kind}")
    if kind & ZSTD:
        return HEADER_BYTES + 16 + _pad8(stored)
    if kind in GAP_KINDS:
        width = GAP_KINDS[kind].itemsize
        return HEADER_BYTES + 8 + _pad8((count if entries is None else entries) * width) + values
    if kind == SPARSE32:
        return HEADER_BYTES + _pad8(4 * count) + values
    if kind == SPARSE64:
        return HEADER_BYTES + 8 * count + values
    if kind == BITMASK:
        return HEADER_BYTES + _pad8((length + 7) // 8) + values
    if kind == DENSE:
        return HEADER_BYTES + _pad8(length * itemsize)
    raise DeltaFormatError(f"unknown record kind {kind}")


def _distances(positions: torch.Tensor):
    """int64 distances between consecutive changed positions (numpy), the first from -1 (so all are >= 1)."""
    import numpy

    return numpy.diff(positions.detach().cpu().numpy().astype(numpy.int64, copy=False), prepend=-1)


def _escapes(length: int, count: int, distances) -> dict[int, int]:
    """Escape gaps each gap kind needs: counted from the distances, or expected for ``count`` changes spread at
    random over ``length`` elements (a distance over ``j * M`` has probability ``(1 - p) ** (j * M)``)."""
    if distances is not None:
        top = int(distances.max()) if len(distances) else 0
        return {k: 0 if top <= m else int(((distances[distances > m] - 1) // m).sum()) for k, m in _GAP_MAX.items()}
    p = count / max(1, length)
    out = {}
    for k, m in _GAP_MAX.items():
        q = (1 - p) ** m if p < 1 else 0.0
        out[k] = round(count * q / (1 - q)) if q < 1 else length
    return out


def _smallest(length: int, count: int, itemsize: int, escapes: dict[int, int]) -> tuple[int, int]:
    sparse = SPARSE32 if length < 2**31 else SPARSE64
    sizes = [(k, record_nbytes(k, length, count, itemsize)) for k in (sparse, BITMASK, DENSE)]
    sizes += [(k, record_nbytes(k, length, count, itemsize, count + escapes[k])) for k in GAP_KINDS]
    return min(sizes, key=lambda kb: kb[1])


def choose(length: int, count: int, itemsize: int, positions: torch.Tensor | None = None) -> tuple[int, int]:
    """The smallest encoding of ``count`` changed elements among ``length``: (kind, record bytes), before zstd.

    Given the changed ``positions`` (increasing, relative to the piece) the gap kinds' sizes are exact; without
    them they are what changes spread at random would take (an estimate, from a count alone)."""
    return _smallest(length, count, itemsize,
                     _escapes(length, count, None if positions is None else _distances(positions)))


def _gap_entries(kind: int, distances) -> torch.Tensor:
    """A gap kind's gaps (escapes included) of the distances between changes, vectorized (numpy)."""
    import numpy

    m, dtype = _GAP_MAX[kind], GAP_KINDS[kind]
    np_dtype = {torch.uint8: numpy.uint8, torch.uint16: numpy.uint16, torch.uint32: numpy.uint32}[dtype]
    if not len(distances) or int(distances.max()) <= m:
        return torch.from_numpy(distances.astype(np_dtype))
    esc = (distances - 1) // m
    at = numpy.cumsum(esc + 1) - 1  # where each change's own gap goes; the escapes before it stay 0
    entries = numpy.zeros(int(at[-1]) + 1, dtype=np_dtype)
    entries[at] = distances - m * esc
    return torch.from_numpy(entries)


def _gap_positions(kind: int, entries: torch.Tensor) -> torch.Tensor:
    """The int64 positions that gaps mark (the inverse of :func:`_gap_entries`), with numpy where it is."""
    np = numpy_or_none(entries.device.type == "cpu")
    if np is not None:
        e = entries.numpy().astype(np.int64)
        if e.size and not e.min():
            return torch.from_numpy((np.cumsum(np.where(e == 0, _GAP_MAX[kind], e)) - 1)[e != 0])
        return torch.from_numpy(np.cumsum(e) - 1)
    e = entries.to(torch.int64)
    step = torch.where(e == 0, _GAP_MAX[kind], e)
    return (torch.cumsum(step, 0) - 1)[e != 0]


def _planes(values: torch.Tensor, count: int, itemsize: int, inverse: bool = False) -> torch.Tensor:
    """``count`` values of ``itemsize`` bytes (a CPU uint8 tensor) as byte planes (byte 0 of each, then byte
    1...), or back."""
    if itemsize == 1 or not count:
        return values
    shape = (itemsize, count) if inverse else (count, itemsize)
    np = numpy_or_none()
    if np is not None:
        return torch.from_numpy(np.ascontiguousarray(values.numpy().reshape(shape).T).reshape(-1))
    return values.view(shape).t().contiguous().view(-1)


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise DeltaFormatError("a ZSTD delta record needs the zstandard package: pip install zstandard") from None
    return zstandard


def encode_sparse(length: int, positions: torch.Tensor, values: torch.Tensor,
                  zstd: bool = True) -> tuple[int, torch.Tensor | None]:
    """(kind, body) of a changed piece: the smallest kind of :func:`choose` given its ``positions`` (int,
    increasing, relative to the piece) and new ``values`` there, compressed when zstd saves at least
    :data:`ZSTD_MIN_GAIN` (``zstd``); ``body`` is the record's bytes after its header, on the CPU, for
    :func:`write_record`. For ``DENSE``, (``DENSE``, None): the record is the piece itself. The trainer's
    side: it needs numpy (each section is built in one vectorized pass, the body in one copy)."""
    import numpy as np

    count, itemsize = positions.numel(), values.element_size()
    counted = kernels.gaps_escapes(positions)  # one pass in C; else from numpy's distances
    distances = _distances(positions) if counted is None else None
    escapes = _escapes(length, count, distances) if counted is None else dict(zip(GAP_KINDS, counted))
    kind, nbytes = _smallest(length, count, itemsize, escapes)
    if kind == DENSE:
        return DENSE, None
    if kind == BITMASK:
        mask = torch.zeros(length, dtype=torch.bool, device=positions.device)
        mask[positions.to(torch.int64)] = True
        head = [pack_bits(mask).cpu().numpy()]
    elif kind in GAP_KINDS:
        if counted is None:
            gaps = _gap_entries(kind, distances)
        else:
            gaps = torch.empty(count + escapes[kind], dtype=GAP_KINDS[kind])
            kernels.gaps_write(positions, gaps)
        head = [np.array([gaps.numel()], dtype=np.int64).view(np.uint8), gaps.view(torch.uint8).numpy()]
    else:
        head = [positions.detach().cpu().numpy().astype(np.int32 if kind == SPARSE32 else np.int64).view(np.uint8)]
    n_head = sum(h.size for h in head)
    vals = values.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy()
    pads = [np.zeros(_pad8(n_head) - n_head, np.uint8), np.zeros(_pad8(vals.size) - vals.size, np.uint8)]
    if zstd and count:
        planes = _planes(torch.from_numpy(vals), count, itemsize).numpy()
        z = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=nbytes - HEADER_BYTES)
        frame = b"".join([z.compress(part) for part in (*head, pads[0], planes, pads[1])] + [z.flush()])
        if 16 + _pad8(len(frame)) <= (1 - ZSTD_MIN_GAIN) * (nbytes - HEADER_BYTES):
            ext = np.array([nbytes - HEADER_BYTES, len(frame)], dtype=np.int64).view(np.uint8)
            tail = np.zeros(_pad8(len(frame)) - len(frame), np.uint8)
            return kind | ZSTD, torch.from_numpy(np.concatenate([ext, np.frombuffer(frame, np.uint8), tail]))
    return kind, torch.from_numpy(np.concatenate([*head, pads[0], vals, pads[1]]))


def _inflate(frame: torch.Tensor, raw: int, kind: int, count: int, itemsize: int, where: str) -> torch.Tensor:
    """A ``ZSTD`` record's sections as the base kind wrote them (values back from byte planes)."""
    try:
        body = _zstd().ZstdDecompressor().decompress(frame.numpy().tobytes(), max_output_size=raw)
    except DeltaFormatError:
        raise
    except Exception as e:  # zstandard.ZstdError: a corrupt frame
        raise DeltaFormatError(f"{where}: its zstd frame does not decompress: {e}") from None
    if len(body) != raw:
        raise DeltaFormatError(f"{where}: its zstd frame holds {len(body)} bytes, the record says {raw}")
    out = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    vals = _pad8(count * itemsize)
    if raw < vals:
        raise DeltaFormatError(f"{where}: {raw} bytes cannot hold {count} values")
    at = raw - vals
    out[at : at + count * itemsize] = _planes(out[at : at + count * itemsize], count, itemsize, inverse=True)
    return out


def changed_positions(new: torch.Tensor, old: torch.Tensor, kind: int, mask: torch.Tensor | None = None):
    """What to keep of a changed piece for its record: int positions (sparse kinds), packed bits, or gaps."""
    if mask is None:
        mask = as_ints(new) != as_ints(old)
    if kind in GAP_KINDS:
        return _gap_entries(kind, _distances(flatnonzero(mask)))
    if kind in (SPARSE32, SPARSE64):
        return flatnonzero(mask).to(torch.int32 if kind == SPARSE32 else torch.int64)
    return pack_bits(mask)


def write_record(out: torch.Tensor, tensor: int, kind: int, start: int, piece: torch.Tensor,
                 positions: torch.Tensor | None, count: int, values: torch.Tensor | None = None,
                 body: torch.Tensor | None = None) -> int:
    """Write one record into the uint8 tensor ``out`` (8-byte aligned, long enough); its byte size.

    ``piece`` is the tensor's new values over ``[start, start + length)`` (flat), ``positions`` what
    :func:`changed_positions` gave for ``kind`` (None for ``DENSE``); ``values``, when given, the new values
    at the changed positions (else taken from ``piece``). ``body``, when given, is what :func:`encode_sparse`
    made for ``kind`` (then ``positions`` and ``values`` are not used)."""
    length, itemsize = piece.numel(), piece.element_size()
    header = torch.tensor([tensor, kind, start, length, count, itemsize], dtype=torch.int64)
    out[:HEADER_BYTES].view(torch.int64).copy_(header)
    at = HEADER_BYTES
    if body is not None:
        out[at : at + body.numel()].copy_(body)
        return at + body.numel()
    entries = positions.numel() if kind in GAP_KINDS else None
    nbytes = record_nbytes(kind, length, count, itemsize, entries)
    if kind == DENSE:
        out[at : at + length * itemsize].view(piece.dtype).copy_(piece)
        return nbytes
    if kind == BITMASK:
        n = positions.numel()
        out[at : at + n].copy_(positions)
        if values is None:
            values = piece[unpack_bits(positions.cpu(), length).to(piece.device)]
        at += _pad8(n)
    elif kind in GAP_KINDS:
        out[at : at + 8].view(torch.int64).fill_(entries)
        width = positions.element_size()
        out[at + 8 : at + 8 + entries * width].copy_(positions.view(torch.uint8))
        if values is None:
            values = piece.index_select(0, _gap_positions(kind, positions.cpu()).to(piece.device))
        at += 8 + _pad8(entries * width)
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
    """The kind whose sections these are (a gap kind's gaps decoded to positions, ``ZSTD`` undone)."""
    start: int
    length: int
    count: int
    positions: torch.Tensor | None
    """int32/int64 positions (sparse kinds; a gap kind decoded without the C kernel), the gaps themselves (a gap kind
    whose gaps the kernel checked: uint8, uint16 or uint32, applied by it in one pass), packed bits (``BITMASK``),
    None (``DENSE``)."""
    values: torch.Tensor
    """The new values (``count`` of them, or ``length`` for ``DENSE``), as raw bytes until typed by
    :func:`iter_records`."""

    def flat_positions(self) -> torch.Tensor | None:
        """int64 positions in the whole tensor's flat view (None for ``DENSE``: every one of the piece)."""
        if self.kind == DENSE:
            return None
        if self.kind == BITMASK:
            local = unpack_bits(self.positions, self.length).nonzero().squeeze(1)
        elif _raw_gaps(self):
            local = _gap_positions(self.kind, self.positions)
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
        body, size = _body(buf, at, kind, length, count, itemsize, where)
        at += size
        positions, values = _sections(body, kind & ~ZSTD, length, count, itemsize, where)
        yield Record(tensor, kind & ~ZSTD, start, length, count, positions, values.view(dtype))
        i += 1


def _body(buf: torch.Tensor, at: int, kind: int, length: int, count: int, itemsize: int, where: str):
    """(the record's sections as its base kind wrote them, the record's bytes)."""
    n = buf.numel()
    entries, stored, raw = None, 0, 0
    if kind & ZSTD or kind in GAP_KINDS:
        ext = (16 if kind & ZSTD else 8)
        if at + HEADER_BYTES + ext > n:
            raise DeltaFormatError(f"{where} runs past the buffer")
        fields = buf[at + HEADER_BYTES : at + HEADER_BYTES + ext].view(torch.int64).tolist()
        if kind & ZSTD:
            raw, stored = fields
            if not (0 <= stored and 0 <= raw <= 8 + 8 * length + _pad8(count * itemsize)):
                raise DeltaFormatError(f"{where}: a zstd frame of {stored} bytes for {raw} is out of range")
        else:
            entries = fields[0]
            if not count <= entries <= count + length:
                raise DeltaFormatError(f"{where}: {entries} gaps cannot mark {count} changes in {length} elements")
    size = record_nbytes(kind, length, count, itemsize, entries, stored)
    if at + size > n:
        raise DeltaFormatError(f"{where} needs {size} bytes, {n - at} are left")
    if kind & ZSTD:
        start = at + HEADER_BYTES + 16
        return _inflate(buf[start : start + stored], raw, kind & ~ZSTD, count, itemsize, where), size
    return buf[at + HEADER_BYTES : at + size], size


def _sections(body: torch.Tensor, kind: int, length: int, count: int, itemsize: int, where: str):
    if kind == DENSE:
        return None, body[: length * itemsize]
    if kind == BITMASK:
        nb = (length + 7) // 8
        if body.numel() < _pad8(nb) + count * itemsize:
            raise DeltaFormatError(f"{where}: its sections hold {body.numel()} bytes, too few")
        positions, values = body[:nb], body[_pad8(nb) : _pad8(nb) + count * itemsize]
        if int(unpack_bits(positions, length).sum()) != count:
            raise DeltaFormatError(f"{where}: the bitmask sets another number of elements than its count {count}")
        return positions, values
    if kind in GAP_KINDS:
        entries = int(body[:8].view(torch.int64)[0]) if body.numel() >= 8 else -1
        width = GAP_KINDS[kind].itemsize
        at = 8 + _pad8(max(0, entries) * width)
        if entries < count or body.numel() < at + count * itemsize:
            raise DeltaFormatError(f"{where}: its gaps and values do not fit its {body.numel()} bytes")
        gaps = body[8 : 8 + entries * width].view(GAP_KINDS[kind])
        counted = kernels.gaps_count(gaps, length)  # one pass in C, the gaps kept; else the positions decoded
        if counted is None:
            positions = _gap_positions(kind, gaps)
            counted = positions.numel(), int(positions[-1]) if positions.numel() else -1
        else:
            positions = gaps
        if counted[0] != count or counted[1] >= length:
            marked = "positions past the piece" if counted[0] < 0 else f"{counted[0]} positions up to {counted[1]}"
            raise DeltaFormatError(f"{where}: its gaps mark {marked}; it changes {count} of {length}")
        return positions, body[at : at + count * itemsize]
    width = 4 if kind == SPARSE32 else 8
    if body.numel() < _pad8(count * width) + count * itemsize:
        raise DeltaFormatError(f"{where}: its sections hold {body.numel()} bytes, too few")
    positions = body[: count * width].view(torch.int32 if width == 4 else torch.int64)
    if count and (int(positions[0]) < 0 or int(positions[-1]) >= length
                  or (count > 1 and not bool((positions[1:] > positions[:-1]).all()))):
        raise DeltaFormatError(f"{where}: positions must increase within [0, {length})")
    return positions, body[_pad8(count * width) : _pad8(count * width) + count * itemsize]


def apply_record(flat: torch.Tensor, rec: Record) -> None:
    """Assign a record's new values into ``flat`` (the whole tensor's flat view, of the record's dtype). As integers
    of the same width: the bytes are what is assigned, and FP8 has no index_copy_ or masked_scatter_ on the CPU."""
    ints = INTS[flat.element_size()]
    piece = flat.view(ints)[rec.start : rec.start + rec.length]
    values = rec.values.to(flat.device).view(ints)
    if rec.kind == DENSE:
        piece.copy_(values)
    elif rec.kind == BITMASK:
        piece.masked_scatter_(unpack_bits(rec.positions, rec.length).to(flat.device), values)
    elif _raw_gaps(rec):
        if not kernels.gaps_apply(rec.positions, values, piece):  # (a piece off the CPU)
            piece.index_copy_(0, _gap_positions(rec.kind, rec.positions).to(flat.device), values)
    else:  # (index_copy_: faster than assigning through an index)
        piece.index_copy_(0, rec.positions.to(flat.device, torch.int64), values)


def _raw_gaps(rec: Record) -> bool:
    """A gap record whose positions are still its gaps (the C kernel checked them; it applies them too)."""
    return rec.kind in GAP_KINDS and rec.positions is not None and rec.positions.dtype in _GAP_DTYPES


_GAP_DTYPES = tuple(GAP_KINDS.values())
