"""Real SGLang's co-located payload on a host without CUDA: each bucket's tensors as views of a shared-memory
file, pickled by its name.

SGLang's ``/update_weights_from_tensor`` takes ``serialized_named_tensors``, one base64 pickle per TP rank of a
list of ``(name, tensor)`` pairs (``load_format`` unset), and unpickles it in each scheduler with its restricted
unpickler, which admits torch's own rebuild functions. torch's ``rebuild_storage_filename`` maps a segment of
``/dev/shm`` by name (the ``file_system`` sharing strategy): the server loads from the same pages the trainer
gathered the bucket into, so nothing is copied on the way. (torch's default ``file_descriptor`` strategy would
pass a descriptor over a connection SGLang's scheduler cannot authenticate, and it dies of it.)

The segments are this module's own files, not torch's: ``/dev/shm/wsync-<pid>-<uuid>-s<i>``, in the layout of
torch's refcounted shared memory (a 64-byte header holding a reference count, then the data). Their count is
set so high that no receiver ever removes them; this process does, on ``close``, and a trainer killed
mid-sync leaves them to the next colocated transport on this host, which removes the files of trainers that
are gone (:func:`bridge.transports.shm.sweep_stale_files`). So a request still queued in a server when
its trainer died finds its segment there (an unpickling error would kill SGLang's scheduler), and no
``torch_shm_manager`` process of the trainer outlives it. The pickle names no manager: the server registers
each segment with its own.

:class:`SharedBuckets` gathers bucket ``k`` into segment ``k % 2``: the publisher has at most one bucket in
flight, so a segment is written again only after every server answered the bucket it held. After a failed
sync whose last bucket was not answered, both segments are set aside (never written again) and new ones are
made.
"""

from __future__ import annotations

import base64
import io
import mmap
import os
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.transports.shm import new_file, remove

__all__ = ["HEADER", "SharedBuckets"]

logger = get_logger(__name__)

HEADER = 64
"""Bytes before the data in torch's refcounted shared memory (``RefcountedMapAllocator``: the count, aligned)."""
_NEVER_ZERO = 1 << 30  # each receive lowers the count by one at most: no receiver ever reaches zero and removes it


class _Segment:
    def __init__(self, directory: str, nbytes: int, i: int) -> None:
        self.path = new_file(HEADER + nbytes, f"s{i}", directory)
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, HEADER + nbytes)
        finally:
            os.close(fd)
        torch.frombuffer(self.map, dtype=torch.int32, count=1)[0] = _NEVER_ZERO
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=HEADER)

    @property
    def handle(self) -> bytes:
        return b"/" + os.path.basename(self.path).encode()

    def remove(self) -> None:
        remove(self.path)


class SharedBuckets:
    """Two bucket buffers in shared-memory files, reused from bucket to bucket and sync to sync (see the module
    docstring). ``directory``: where they are made (``/dev/shm``, where SGLang's ``shm_open`` looks)."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self._segments: list[_Segment | None] = [None, None]
        self._by_pointer: dict[int, _Segment] = {}  # data pointer -> segment: what the pickler names
        self._set_aside: list[_Segment] = []

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of segment ``k % 2`` (a larger segment replaces a smaller one)."""
        i = k % 2
        seg = self._segments[i]
        if seg is None or seg.nbytes < nbytes:
            if seg is not None:
                self._forget(seg)
                seg.remove()
            seg = _Segment(self.directory, max(nbytes, 1), i)
            self._segments[i] = seg
            self._by_pointer[seg.data.data_ptr()] = seg
        return seg.data[:nbytes]

    def serialize(self, bucket: Bucket, buf: torch.Tensor, tp_size: int) -> list[str]:
        """SGLang's ``serialized_named_tensors`` for ``bucket`` gathered into ``buf`` (a :meth:`buffer`): ``tp_size``
        entries, one per TP rank."""
        if tp_size < 1:
            raise ConfigError(f"tp_size must be at least 1, got {tp_size}")
        return [self.pickled(unflatten_bucket(buf, bucket.specs))] * tp_size

    def pickled(self, obj) -> str:
        """``base64(pickle(obj))`` as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` writes it,
        each tensor of ``obj`` (views of this object's buffers only) by the name of its segment."""
        out = io.BytesIO()
        pickler = ForkingPickler(out)
        pickler.dispatch_table[torch.UntypedStorage] = self._reduce_storage
        pickler.dump(obj)
        return base64.b64encode(out.getvalue()).decode()

    def share(self, tensors: dict[str, torch.Tensor]) -> str:
        """``tensors`` copied into segment 0 (one bucket), pickled as a dict of views by :meth:`pickled`: an adapter's
        entry of ``/load_lora_adapter_from_tensors``. Keep this object until the server answered, then ``close`` it."""
        from bridge.buckets import flatten_tensors, plan_buckets
        from bridge.tensors import ParamSpec

        specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
        [bucket] = plan_buckets(specs, max(sum(s.nbytes for s in specs), 1))
        buf = self.buffer(0, bucket.nbytes)
        flatten_tensors(bucket, tensors, out=buf)
        views = dict(unflatten_bucket(buf, bucket.specs))
        return self.pickled({n: views[n] for n in tensors})

    def set_aside(self) -> None:
        """A server may still read the segments (a request it has not answered): never write them again; they are
        removed on ``close``."""
        for seg in self._segments:
            if seg is not None:
                self._forget(seg)
                self._set_aside.append(seg)
        self._segments = [None, None]

    def close(self) -> None:
        for seg in [*self._segments, *self._set_aside]:
            if seg is not None:
                seg.remove()
        self._segments, self._set_aside, self._by_pointer = [None, None], [], {}

    def _forget(self, seg: _Segment) -> None:
        self._by_pointer.pop(seg.data.data_ptr(), None)

    def _reduce_storage(self, storage: torch.UntypedStorage):
        """A bucket view's storage as torch's ``file_system`` reduction writes it: rebuilt by mapping the segment
        by name (no manager named: the receiver registers it with its own)."""
        seg = self._by_pointer.get(storage.data_ptr())
        if seg is None or storage.nbytes() != seg.nbytes:
            raise ConfigError("only a bucket buffer of SharedBuckets can be sent by name")
        return reductions.rebuild_storage_filename, (torch.UntypedStorage, b"", seg.handle, seg.nbytes)
