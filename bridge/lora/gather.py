"""An adapter gathered onto rank 0 (one flat gather of the source's ``gather_adapter``), its checksums computed in
the background, and the thread rank 0's disk work runs on beside a publish."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from bridge.digest import tensor_checksum

__all__ = ["CHECKSUM_THREADS", "DISK_WORK", "Checksums", "gather_adapter_tensors"]

DISK_WORK = ThreadPoolExecutor(1, thread_name_prefix="wsync-adapter-disk")
"""Rank 0's disk work beside a publish: a directory's fsyncs (:meth:`AdapterPublisher._write`), the removal of old
ones after a commit (one thread: a publish waits for the removal before it writes)."""
CHECKSUM_THREADS = 2
_CHECKSUM_POOL = ThreadPoolExecutor(CHECKSUM_THREADS, thread_name_prefix="wsync-adapter-checksums")


class Checksums:
    """sha256 of every tensor, computed on :data:`CHECKSUM_THREADS` threads in the background (hashlib leaves the
    GIL), about the same bytes on each; :meth:`result` waits for them (a Future's interface)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        parts: list[list[str]] = [[]]
        cut, acc = sum(t.nbytes for t in tensors.values()) / CHECKSUM_THREADS, 0
        for n, t in tensors.items():
            if acc >= cut * len(parts) and len(parts) < CHECKSUM_THREADS:
                parts.append([])
            parts[-1].append(n)
            acc += t.nbytes
        self._futures = [_CHECKSUM_POOL.submit(lambda part=part: {n: tensor_checksum(tensors[n]) for n in part})
                         for part in parts]

    def result(self) -> dict[str, str]:
        return {n: c for f in self._futures for n, c in f.result().items()}


def gather_adapter_tensors(source, dtype, shared: bool, reuse: torch.Tensor | None = None) -> dict | None:
    """The collective gather: ``{"tensors": on the CPU, "config": the PEFT config, "checksums", "buffer": the buffer
    the tensors are views of}`` on rank 0, None elsewhere. ``shared`` (by tensors): gathered into shared memory, which
    the servers map (``gather_adapter(shared=True)``); ``reuse``: a spare buffer of an earlier gather to fill again."""
    kwargs = {"shared": True} if shared else {}
    if reuse is not None:
        kwargs["reuse"] = reuse
    tensors = source.gather_adapter(dtype, **kwargs)
    if tensors is None:
        return None
    # Views of the gathered buffer, which they keep alive: copied only when the gather ran on a GPU.
    if any(t.device.type != "cpu" for t in tensors.values()):
        tensors = {n: t.detach().to("cpu") for n, t in tensors.items()}
    buffer = None
    if tensors:
        storage = next(iter(tensors.values())).untyped_storage()
        if all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors.values()):
            buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    # The checksums run on two threads beside the exchange, the write and the body.
    return {"tensors": tensors, "config": source.adapter_config(), "checksums": Checksums(tensors), "buffer": buffer}
