"""What differs between two tensors, byte for byte: the primitives a delta is built from (bit vectors, the positions
of true elements, the elements that differ inside differing 8-byte words). Only torch and the standard library, numpy
where it is installed (one pass on the CPU): the loader real SGLang imports uses them too."""

from __future__ import annotations

import torch

__all__ = ["INTS", "as_ints", "differing_lanes", "flatnonzero", "numpy_or_none", "pack_bits", "unpack_bits"]

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def numpy_or_none(wanted: bool = True):
    """numpy, for tensors on the CPU (``wanted``), or None: not wanted, or missing (the loader needs only torch)."""
    if not wanted:
        return None
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as ``ceil(n / 8)`` bytes, little-endian bit order (numpy's ``packbits`` on CPU)."""
    mask = mask.reshape(-1)
    np = numpy_or_none(mask.device.type == "cpu")
    if np is not None:
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros((n + 7) & ~7, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The bool vector of ``n`` elements that :func:`pack_bits` packed."""
    np = numpy_or_none(packed.device.type == "cpu")
    if np is not None:
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(-1)[:n].bool()


INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: views that compare bytes exactly (NaN, -0.0)."""


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """A same-size integer view of ``t``, so that comparing bytes is exact (NaN, -0.0)."""
    return t.view(INTS[t.element_size()])


def flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """int64 positions of the true elements of a flat bool tensor, increasing (numpy's one pass on CPU)."""
    np = numpy_or_none(mask.device.type == "cpu")
    if np is not None:
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().squeeze(1)


def differing_lanes(new_words: torch.Tensor, base_words: torch.Tensor, words: torch.Tensor,
                    itemsize: int) -> torch.Tensor:
    """int64 positions of the elements (``itemsize`` bytes each) that differ inside the given differing words.

    ``new_words``/``base_words`` are two flat tensors seen as 8-byte words, ``words`` the increasing int64
    indices of the words that differ. Each differing word holds ``8 // itemsize`` elements; the positions come
    out increasing. On the CPU numpy does it in a few passes over the differing words alone (torch's gathers and
    boolean indexing go over them more often)."""
    per = 8 // itemsize
    shift = per.bit_length() - 1
    np = numpy_or_none(words.device.type == "cpu")
    if np is not None:
        w = words.numpy()
        flips = np.take(new_words.numpy(), w) ^ np.take(base_words.numpy(), w)
        lanes = np.flatnonzero(flips.view(f"i{itemsize}") != 0)
        return torch.from_numpy(w[lanes >> shift] * per + (lanes & (per - 1)))
    flips = torch.take(new_words, words) ^ torch.take(base_words, words)
    lanes = flatnonzero(flips.view(INTS[itemsize]) != 0)
    return torch.take(words, lanes >> shift) * per + (lanes & (per - 1))
