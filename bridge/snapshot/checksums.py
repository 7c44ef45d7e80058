"""The snapshot's CRC-32 checksums, and how a file's CRC is built from its tensors' without a second pass.

The manifest records a CRC-32 (``zlib.crc32``) per file and per tensor. A large tensor's bytes are read
once: its own CRC is computed and then folded into its file's CRC arithmetically (:func:`crc32_combine`,
zlib's ``crc32_combine``, which Python's zlib does not expose). Writer and reader both use this module.
"""

from __future__ import annotations

import zlib

__all__ = ["COMBINE_MIN_BYTES", "crc32_combine", "crc_extend", "crc_hex"]

COMBINE_MIN_BYTES = 512 << 10
"""Below this many bytes a second pass of ``zlib.crc32`` is cheaper than combining (~150 us)."""

_CRC_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def crc_hex(crc: int) -> str:
    """A CRC as the manifest writes it: 8 lowercase hex digits."""
    return f"{crc & 0xFFFFFFFF:08x}"


def _gf2_multmodp(a: int, b: int) -> int:
    # a(x) * b(x) modulo the CRC polynomial, in the reflected bit order zlib uses.
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p for k = 0..31
for _ in range(31):
    _X2N.append(_gf2_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    p, n, k = 1 << 31, len2, 3  # x^(8 * len2) mod p
    while n:
        if n & 1:
            p = _gf2_multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _gf2_multmodp(p, crc1) ^ crc2


def crc_extend(crc: int, data_crc: int, data: memoryview) -> int:
    """The CRC of (bytes with CRC ``crc``) + ``data``, given ``data_crc = crc32(data)``."""
    if data.nbytes < COMBINE_MIN_BYTES:
        return zlib.crc32(data, crc)
    return crc32_combine(crc, data_crc, data.nbytes)
