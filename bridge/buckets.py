"""Bucket planning and SGLang's flattened-bucket byte layout.

A bucket is a list of whole tensors whose bytes are concatenated, in ``names`` order, with no padding,
into one 1-D ``uint8`` buffer (``load_format="flattened_bucket"``). SGLang >= 0.5.23 rejects a tensor
whose byte offset is not a multiple of its dtype's itemsize, so inside a bucket tensors are ordered by
itemsize, largest first (itemsizes are powers of two, so every offset stays aligned). Buckets are
filled greedily in the trainer's parameter order; a tensor is never split, and a tensor larger than
the budget gets a bucket of its own.

Example:
    >>> import torch
    >>> from bridge.tensors import ParamSpec
    >>> specs = [ParamSpec("a", (2,), torch.bfloat16), ParamSpec("b", (1,), torch.float32)]
    >>> [b.names for b in plan_buckets(specs, bucket_bytes=1 << 20)]
    [['b', 'a']]
    >>> layout = plan_buckets(specs, bucket_bytes=1 << 20)[0]
    >>> layout.offsets, layout.nbytes
    ([0, 4], 8)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from bridge.errors import ConfigError
from bridge.tensors import ParamSpec

__all__ = ["Bucket", "flatten_tensors", "plan_buckets", "unflatten_bucket"]


@dataclass(slots=True)
class Bucket:
    """The wire layout of one bucket: tensors in ``names`` order at byte ``offsets``."""

    specs: list[ParamSpec]
    extra: dict | None = None
    """Further fields of the bucket's request (the delta encoding's table, ``wsync_delta``)."""
    offsets: list[int] = field(init=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        offset = 0
        self.offsets = []
        for spec in self.specs:
            if offset % spec.dtype.itemsize:
                raise ConfigError(
                    f"tensor {spec.name!r} would start at byte {offset}, not a multiple of its itemsize "
                    f"{spec.dtype.itemsize}; order a bucket by itemsize (plan_buckets does)"
                )
            self.offsets.append(offset)
            offset += spec.nbytes
        self.nbytes = offset

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def index(self) -> dict[str, tuple[int, ParamSpec]]:
        """name -> (byte offset, spec), for packing tensors as they arrive in any order."""
        return {s.name: (o, s) for s, o in zip(self.specs, self.offsets)}

    def request_fields(self) -> dict:
        """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
        return {
            "names": self.names,
            "dtypes": [str(s.dtype).removeprefix("torch.") for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
            **(self.extra or {}),
        }


def _ordered(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    # Stable sort: within one itemsize the trainer's order is kept.
    return sorted(specs, key=lambda s: -s.dtype.itemsize)


def plan_buckets(specs: Iterable[ParamSpec], bucket_bytes: int, first_bytes: int | None = None) -> list[Bucket]:
    """Group specs, in the given order, into buckets of at most ``bucket_bytes`` bytes.

    ``first_bytes``: a ramp, bucket ``k`` holds at most ``min(bucket_bytes, first_bytes * 2**k)`` bytes, so the
    first bucket, whose fill nothing hides, is filled sooner and each one after is filled while the one before
    travels (a tensor larger than its bucket's limit still goes alone).

    Raises:
        ConfigError: ``bucket_bytes`` (or ``first_bytes``) is not positive, or a name repeats.
    """
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be positive, got {bucket_bytes} bytes")
    if first_bytes is not None and first_bytes <= 0:
        raise ConfigError(f"first bucket size must be positive, got {first_bytes} bytes")
    limit = bucket_bytes if first_bytes is None else min(bucket_bytes, first_bytes)
    buckets: list[Bucket] = []
    current: list[ParamSpec] = []
    size = 0
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"parameter {spec.name!r} appears twice in one weight update")
        seen.add(spec.name)
        if current and size + spec.nbytes > limit:
            buckets.append(Bucket(_ordered(current)))
            current, size, limit = [], 0, min(bucket_bytes, 2 * limit)
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(Bucket(_ordered(current)))
    return buckets


def flatten_tensors(bucket: Bucket, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``tensors`` (cast to each spec's dtype) into one uint8 buffer in the bucket's layout."""
    if out is None:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for spec, offset in zip(bucket.specs, bucket.offsets):
        pack_one(out, offset, spec, tensors[spec.name])
    return out


def pack_one(out: torch.Tensor, offset: int, spec: ParamSpec, tensor: torch.Tensor) -> None:
    """Copy one tensor, cast to ``spec.dtype``, into ``out[offset : offset + spec.nbytes]``."""
    if tuple(tensor.shape) != spec.shape:
        raise ConfigError(f"tensor {spec.name!r} has shape {tuple(tensor.shape)}, planned {spec.shape}")
    dst = out[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)
    dst.copy_(tensor)


def unflatten_bucket(buffer: torch.Tensor, specs: Sequence[ParamSpec]) -> list[tuple[str, torch.Tensor]]:
    """Split a received uint8 buffer back into named tensors (views, no copy).

    Raises:
        ConfigError: the buffer size differs from the sum of the specs' bytes, or an offset is unaligned.
    """
    bucket = Bucket(list(specs))
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != bucket.nbytes:
        raise ConfigError(
            f"flattened bucket must be a 1-D uint8 tensor of {bucket.nbytes} bytes, "
            f"got {buffer.dtype} with shape {tuple(buffer.shape)}"
        )
    return [
        (s.name, buffer[o : o + s.nbytes].view(s.dtype).view(s.shape))
        for s, o in zip(bucket.specs, bucket.offsets)
    ]
