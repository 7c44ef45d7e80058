"""Peak host memory of this process during a block of work, read from the kernel.

Linux keeps the resident-set high-water mark (``VmHWM`` in ``/proc/self/status``); writing ``5`` to
``/proc/self/clear_refs`` resets it to the current RSS. So ``peak - start`` is the most extra memory
the block held at any moment, whatever allocated it (torch, gloo, Python). On CUDA the device's
``max_memory_allocated`` is used as well. Elsewhere (no /proc) the figure is 0.
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
        return self

    def sample(self) -> int:
        """Extra bytes at the high-water mark so far."""
        hwm = _status_kib("VmHWM")
        return max(0, hwm * 1024 - self._start) if hwm is not None else 0

    def __exit__(self, *exc) -> None:
        self.extra_bytes = self.sample()
        if torch.cuda.is_available():
            self.device_extra_bytes = max(0, torch.cuda.max_memory_allocated() - self._dev_start)

