"""Peak host memory of this process during a block of work, read from the kernel.

Linux keeps the resident-set high-water mark (``VmHWM`` in ``/proc/self/status``); writing ``5`` to
``/proc/self/clear_refs`` resets it to the current RSS. So ``peak - start`` is the most extra memory
the block held at any moment, whatever allocated it (torch, gloo, Python). On CUDA the device's
``max_memory_allocated`` is used as well, and so are pinned host buffers: torch's caching host allocator
keeps them from one sync to the next, so the RSS no longer grows when a sync takes them again; the peak
of its checked-out bytes is added (less what it newly allocated in the block, which the RSS already
counts). Elsewhere (no /proc) the figure is 0.
"""

from __future__ import annotations

import torch

__all__ = ["PeakMemory"]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.extra_bytes`` (host) and ``m.device_extra_bytes``."""

    def __init__(self) -> None:
        self.extra_bytes = 0
        self.device_extra_bytes = 0
        self._start = 0
        self._dev_start = 0
        self._pinned_start: dict | None = None

    def __enter__(self) -> PeakMemory:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self._start = (_status_kib("VmRSS") or 0) * 1024
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._dev_start = torch.cuda.memory_allocated()
            self._pinned_start = _pinned_stats(reset=True)
        return self

    def sample(self) -> int:
        """Extra bytes at the high-water mark so far."""
        hwm = _status_kib("VmHWM")
        return max(0, hwm * 1024 - self._start) if hwm is not None else 0

    def __exit__(self, *exc) -> None:
        self.extra_bytes = self.sample() + self._pinned_reused()
        if torch.cuda.is_available():
            self.device_extra_bytes = max(0, torch.cuda.max_memory_allocated() - self._dev_start)

    def _pinned_reused(self) -> int:
        """Pinned host bytes the block checked out of blocks allocated before it (not in the RSS figure)."""
        end = _pinned_stats(reset=False) if self._pinned_start is not None else None
        if end is None:
            return 0
        start = self._pinned_start
        grown = max(0, end["allocated_bytes.current"] - start["allocated_bytes.current"])
        return max(0, end["active_bytes.peak"] - start["active_bytes.current"] - grown)


def _pinned_stats(reset: bool) -> dict | None:
    """The caching host allocator's statistics, None where this process uses no CUDA (or torch cannot say)."""
    if not (torch.cuda.is_initialized() and hasattr(torch.cuda, "host_memory_stats")):
        return None
    try:
        if reset and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
        stats = torch.cuda.host_memory_stats()
        return {k: int(stats.get(k, 0)) for k in ("allocated_bytes.current", "active_bytes.current", "active_bytes.peak")}
    except (RuntimeError, AttributeError):
        return None
