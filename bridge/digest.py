"""Checksums of tensors, as servers and trainers compare them: :func:`tensor_checksum` (sha256 of a tensor's bytes,
what the reference server's ``/wsync/weights_checksum`` reports) and :func:`served_digest_part` (one digest of many
tensors that FSDP2 ranks and a server compute alike whatever the sharding). Apart from :mod:`bridge.protocol` so
that the HTTP side (clients, sidecars, watchers) needs no torch.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

__all__ = ["DIGEST_BLOCK", "served_digest_part", "tensor_checksum"]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's raw bytes in its own dtype; equal checksums mean bit-equal tensors.

    The reference server's ``/wsync/weights_checksum`` route reports this for every served tensor, so a
    trainer can check a sync without pulling the weights back.
    """
    t = tensor.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()  # the bytes in place, not a copy


DIGEST_BLOCK = 4096
"""Elements per block of :func:`served_digest_part` (its coefficients are one per element of a block, times one
per block)."""

_DIGEST_CHUNK = DIGEST_BLOCK * 1024  # elements hashed at once (32 MiB of int64)
_MASK64 = (1 << 64) - 1
_ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_tables: dict[torch.device, torch.Tensor] = {}


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (numpy wraps uint64 arithmetic; its shifts are logical)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)  # odd: no coefficient kills a difference on its own


def _as_int64(x: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(x.view(np.int64)).to(device)


@torch.no_grad()
def served_digest_part(name: str, flat: torch.Tensor, start: int = 0) -> int:
    """This part's share of the digest of served weights: a tensor's elements ``flat`` (1-D, in the dtype it is
    served in) that start at flat element ``start`` of tensor ``name``. Linear in the elements' bit patterns
    modulo 2**64, with a pseudo-random odd coefficient for every (name, flat position): the parts of a tensor
    sum (mod 2**64) to the digest of the whole, so FSDP2 ranks, each holding some rows, and a server holding the
    whole tensor compute the same number whatever the sharding. Not cryptographic: it tells other weights from
    these (a difference goes unseen with a probability about 2**-64), not a forgery.
    """
    n = flat.numel()
    if n == 0:
        return 0
    x = flat.detach().contiguous().reshape(-1).view(_ints[flat.element_size()])
    device = x.device
    table = _tables.get(device)
    if table is None:
        table = _tables[device] = _as_int64(_mix64(np.arange(DIGEST_BLOCK, dtype=np.uint64)), device)
    seed = np.uint64(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
    total, g, end = 0, start, start + n
    while g < end:
        g1 = min(end, (g // _DIGEST_CHUNK + 1) * _DIGEST_CHUNK)
        first, off = g // DIGEST_BLOCK, g % DIGEST_BLOCK
        blocks = -(-(off + g1 - g) // DIGEST_BLOCK)
        buf = torch.zeros(blocks * DIGEST_BLOCK, dtype=torch.int64, device=device)
        buf[off:off + g1 - g] = x[g - start:g1 - start]
        per_block = (buf.view(blocks, DIGEST_BLOCK) * table).sum(1)  # int64 arithmetic wraps: mod 2**64
        coeffs = _as_int64(_mix64(np.arange(first, first + blocks, dtype=np.uint64) ^ seed), device)
        total = (total + int((per_block * coeffs).sum())) & _MASK64
        g = g1
    return total
