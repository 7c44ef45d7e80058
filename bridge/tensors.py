"""Parameter metadata that crosses process boundaries: names, shapes and dtypes as plain JSON values."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bridge.errors import ConfigError
from bridge.protocol import wire_dtype

__all__ = ["ParamSpec", "dtype_from_str", "dtype_to_str", "host_buffer", "kept_buffer"]

# The dtypes a weight update may carry. SGLang resolves each with getattr(torch, name), so the wire form
# is the bare attribute name ("bfloat16"), never "torch.bfloat16".
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (SGLang's wire form, :func:`bridge.protocol.wire_dtype`)."""
    return wire_dtype(dtype)


def dtype_from_str(name: str | torch.dtype) -> torch.dtype:
    """Parse a dtype name as SGLang does, accepting common aliases (``bf16``) and a ``torch.`` prefix.

    Raises:
        ConfigError: the name is not a supported dtype.
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    key = _ALIASES.get(key, key)
    try:
        return _DTYPES[key]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One tensor of a weight update: HF name, full (unsharded) shape and dtype on the wire."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_dtype(self, dtype: torch.dtype) -> ParamSpec:
        return ParamSpec(self.name, self.shape, dtype)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_to_str(self.dtype)}

    @classmethod
    def from_json(cls, d: dict) -> ParamSpec:
        return cls(str(d["name"]), tuple(int(x) for x in d["shape"]), dtype_from_str(d["dtype"]))


def host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` in host memory for a bucket, pinned when this process uses CUDA.

    A CUDA trainer's gather copies every tensor of the bucket from the GPU into it: into pageable memory
    each copy goes through the driver's staging buffer, several times slower; into pinned
    memory it is one DMA. Pinned blocks come from torch's caching host allocator, so the buckets of later
    syncs reuse them. A process that never touched CUDA gets plain memory (no CUDA context is created)."""
    pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def kept_buffer(store: dict, key, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of a buffer kept in ``store`` under ``key`` from one call to the next (replaced when too small or
    of another dtype or device): fresh memory costs a page fault per page at its first touch, more than the copies
    into it (the FP8 quantization's blocks, the gathers' send and receive buffers)."""
    buf = store.get(key)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
        buf = store[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]
