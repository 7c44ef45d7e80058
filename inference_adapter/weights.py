"""The served weights: the tensors by checkpoint name, their version, and the one place they change.

Weights change only inside :meth:`ServedWeights.swap`, under the writer side of a reader/writer lock;
every generation holds the reader side while it computes, and records ``(epoch, version)`` when it
starts. So each step of a generation sees the old weights or the new ones, never a mix; a version change
is told to the generations in flight (``on_version_change``), which SGLang 0.5.20+ dialects report as spans
(:mod:`inference_adapter.generation`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from inference_adapter.errors import RequestError

__all__ = ["RWLock", "ServedWeights"]


class RWLock:
    """Reader/writer lock that prefers writers, so a stream of generations cannot starve an update."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cv:
            while self._writer or self._writers_waiting:
                self._cv.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cv:
            self._readers -= 1
            if not self._readers:
                self._cv.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cv:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cv.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


class ServedWeights:
    """The model's tensors as served, with their ``version``, ``epoch`` (one more per swap) and ``rw`` lock.

    ``params``: served tensors by HF checkpoint name (parameters, and buffers the state dict holds);
    ``aliases``: state-dict names of the same storage (the tied ``lm_head.weight``), accepted in updates
    and skipped, as SGLang does. ``model_path``: where the weights came from (a disk update changes it).
    """

    def __init__(self, model: torch.nn.Module, version: str, model_path: str):
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        sd = model.state_dict()
        for n, b in model.named_buffers():
            if n in sd:
                self.params[n] = b
        by_ptr = {t.data_ptr(): n for n, t in self.params.items()}
        self.aliases = {n: by_ptr[t.data_ptr()] for n, t in sd.items() if n not in self.params and t.data_ptr() in by_ptr}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.params.values())
        self.model_type = type(model).__name__
        self.version = version
        self.model_path = model_path
        self.epoch = 0
        self.rw = RWLock()
        self.on_version_change: list = []
        """Called as ``f(old, new)`` under the writer lock whenever the version label changes (by a swap or a
        relabel), while no generation computes: the generations in flight record how many tokens they had."""

    def target(self, name: str) -> torch.Tensor | None:
        """The served tensor a name (or alias) updates, or None if the model has no such tensor."""
        return self.params.get(self.aliases.get(name, name))

    def swap(self, staged: dict[str, torch.Tensor], version: str | None, model_path: str | None = None) -> None:
        """The only place weights change: all tensors and the version, under the writer lock.

        A delta's :class:`~inference_adapter.delta.Patch` is applied in place (refused, before anything
        changes, when the tensor changed since the delta's base was checked). What an update received
        (broadcast buckets, shared-memory copies: memory of this process that nothing else writes) is served
        as it is, not copied again: the copy was most of the time ``end_weight_update`` took. A bucket's memory is then freed once every tensor in it
        has been replaced, so a delta that replaces part of a full sync's tensors keeps that sync's buckets
        (at most one model's worth). What a disk load read (``model_path``, possibly a mapped file) is copied.
        """
        stale = [n for n, t in staged.items() if hasattr(t, "apply_to") and t.stale(self.params[n])]
        if stale:
            raise RequestError(f"Weight update aborted, nothing applied: the served tensors {stale[:3]} changed after "
                               "the delta's base was checked (an update outside the session); send the full weights")
        with self.rw.write(), torch.no_grad():
            for n, t in staged.items():
                p = self.params[n]
                if hasattr(t, "apply_to"):  # a delta's records (inference_adapter.delta.Patch): in place
                    t.apply_to(p)
                elif model_path is None and t.is_contiguous() and (t.dtype, t.shape, t.device) == (p.dtype, p.shape, p.device):
                    p.data = t
                else:
                    p.copy_(t)
            if version is not None:
                self._relabel(str(version))
            if model_path is not None:
                self.model_path = model_path
            self.epoch += 1

    def set_version(self, version: str) -> None:
        """Relabel the served weights (``/update_weight_version``), under the writer lock."""
        with self.rw.write():
            self._relabel(str(version))

    def _relabel(self, version: str) -> None:
        """Caller holds the writer lock."""
        old, self.version = self.version, version
        if version != old:
            for f in self.on_version_change:
                f(old, version)

