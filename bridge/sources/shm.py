"""A gather through shared memory, for trainer ranks on one host: each rank writes its own rows of every parameter
straight into rank ``dst``'s buffer, which lies in shared memory (torch's ``file_system`` strategy); a barrier
then says the buffer is whole. Nothing travels through a socket but the buffer's name: no send buffer, no
receive buffer, no unpacking on ``dst``.

Used for a LoRA adapter's gather (:meth:`trainer.engine.FSDPEngine.gather_adapter`): tens of MB in a few hundred
small parameters, where the flat gather (:func:`bridge.sources.gather_bucket_into`) spends more time packing and
unpacking than moving bytes. :class:`SharedGather` finds out once, collectively, whether every rank can map a
buffer rank ``dst`` made (the same host and the same ``/dev/shm``); where one cannot, every rank keeps to the
flat gather.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bridge.buckets import Bucket
from bridge.failpoints import failpoint
from bridge.sources import row_sharded, shard_nbytes
from bridge.tensors import ParamSpec

__all__ = ["KEPT", "SharedGather", "keep_newest", "shared_buffer"]

KEPT = 3
"""Buffers a rank keeps (mapped, by name) with their views: rank ``dst`` gathers into the same few again and again
(an adapter publisher's served one and its spare); an older one is let go."""


def keep_newest(cache: dict, key, make, valid=lambda value: True):
    """``cache[key]`` (``make()`` when missing or not ``valid``), made the newest entry; only the newest :data:`KEPT`
    entries stay in ``cache`` (an insertion-ordered dict)."""
    value = cache.pop(key, None)
    if value is None or not valid(value):
        value = make()
    cache[key] = value
    while len(cache) > KEPT:
        cache.pop(next(iter(cache)))
    return value


def shared_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 in shared memory (torch's ``file_system`` strategy: a file another process on this host
    maps by its name, as a server does with a same-host tensor payload)."""
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


class SharedGather:
    """A collective gather into a shared-memory buffer of rank ``dst`` (see the module docstring). Every rank
    builds one and calls :meth:`usable`, then :meth:`gather`, at the same points."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self._usable: bool | None = None
        self._kept: dict[bytes, tuple] = {}  # buffer name -> (its mapping here, {id(bucket): views}), newest last

    def usable(self, dst: int = 0) -> bool:
        """Collective, once (the answer is kept): True when every rank could map a buffer rank ``dst`` made and
        read what it wrote there (a CPU gloo group of ranks on one host)."""
        if self._usable is None:
            self._usable = self._probe(dst)
        return self._usable

    def _probe(self, dst: int) -> bool:
        if not dist.is_initialized() or dist.get_world_size(self.group) < 2 or dist.get_backend(self.group) != "gloo":
            return False
        rank = dist.get_rank(self.group)
        nonce = os.urandom(16)
        probe = shared_buffer(len(nonce)) if rank == dst else None
        if probe is not None:
            probe.copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
        box = [(_handle(probe), nonce) if probe is not None else None]
        dist.broadcast_object_list(box, src=_global(dst, self.group), group=self.group)
        handle, want = box[0]
        try:
            ok = rank == dst or bytes(_mapped(handle).numpy()) == want
        except (RuntimeError, OSError):  # another host, or another /dev/shm (a container of its own)
            ok = False
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    @torch.no_grad()
    def gather(self, items: Sequence[tuple[ParamSpec, torch.Tensor]], bucket: Bucket, out: torch.Tensor | None,
               dst: int = 0) -> None:
        """Collective: fill rank ``dst``'s ``out`` (a :func:`shared_buffer` of ``bucket.nbytes``) with the full
        parameters, each cast to its spec's dtype. ``items``: (spec, parameter) in ``bucket.specs`` order, the same
        on every rank; a DTensor sharded on dim 0 is written by every rank (its ``torch.chunk`` rows), anything
        else by rank ``dst`` alone (a DTensor of another placement gathered first, as the flat gather does)."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        box = [_handle(out) if rank == dst else None]
        dist.broadcast_object_list(box, src=_global(dst, self.group), group=self.group)
        for (_, p), (rows, dest) in zip(items, self._views(box[0], out, items, bucket, rank, world, dst)):
            if rows:
                if dest is not None:
                    dest.copy_(p.to_local())
                continue
            full = p.full_tensor() if isinstance(p, DTensor) else p  # (a collective for a DTensor)
            if dest is not None:
                dest.copy_(full)
        failpoint("gather", rank)  # (fault tests: the other ranks are already waiting in the barrier)
        dist.barrier(group=self.group)

    def _views(self, handle, out: torch.Tensor | None, items, bucket: Bucket, rank: int, world: int, dst: int) -> list:
        """Where this rank writes each item in the buffer ``handle`` names (``out`` on ``dst``, mapped elsewhere):
        ``(True, a view of its rows)`` for a row-sharded DTensor (its ``torch.chunk`` rows; None when it has none),
        ``(False, a view of the whole tensor)`` for anything else on ``dst``, ``(False, None)`` elsewhere. Kept
        (:data:`KEPT` buffers) with the buffer: the same few come back at every publish."""
        buf, by_bucket = keep_newest(self._kept, handle[1], lambda: (out if rank == dst else _mapped(handle), {}))
        got = by_bucket.get(id(bucket))
        if got is not None and got[0] is bucket:
            return got[1]
        views: list = []
        for (spec, p), offset in zip(items, bucket.offsets):
            rows = row_sharded(p, world)
            if rows:
                shape = p.to_local().shape
                start = offset + rank * shard_nbytes(spec, world)
            elif rank == dst:
                shape, start = spec.shape, offset
            else:
                views.append((False, None))
                continue
            n = math.prod(shape) * spec.dtype.itemsize
            views.append((rows, buf[start : start + n].view(spec.dtype).view(shape) if n else None))
        by_bucket[id(bucket)] = (bucket, views)
        return views

    def close(self) -> None:
        self._kept.clear()


def _handle(buf: torch.Tensor | None):
    """``(manager, name, nbytes)`` of a :func:`shared_buffer` (what a process needs to map it)."""
    if buf is None:
        return None
    storage = buf.untyped_storage()
    manager, name, nbytes = storage._share_filename_cpu_()
    if buf.storage_offset() or buf.numel() != nbytes:
        raise ValueError("the gather's buffer must be a whole shared_buffer()")
    return manager, name, nbytes


def _mapped(handle) -> torch.Tensor:
    manager, name, nbytes = handle
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,))


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
