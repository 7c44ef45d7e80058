"""Whether a delta is worth sending: the anchor decision of the delta encoding from what syncs cost.

Each trainer rank measures its own publishes (from the start of the prepare step to the commit):

* a full sync (an anchor): its seconds for the full bytes, which is the rate the link and the transport
  achieve end to end, whatever they are (loopback, a 200 Mbit/s link, NCCL);
* a delta: its diff (the prepare step: cast, compare, encode), and the rest of its seconds per delta byte
  (the transfer, the servers' apply, and the fixed work of a sync, which a small delta pays per byte more
  dearly: the estimate errs towards the full sync).

Before diffing, a delta of an estimated fraction ``f`` of the full bytes is expected to take
``diff + f * full_bytes * per_byte`` seconds, ``per_byte`` being what the last deltas paid per byte (at
least the full sync's seconds per byte), against the last full syncs' seconds; once diffed, its diff is
spent and only the bytes count. Each figure is the median of the last :data:`KEEP` syncs of its kind. With
no full sync measured yet (there is always one: the first sync is an anchor), nothing is decided here.
``delta_max_fraction`` stays the upper bound above which a delta is never sent.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["KEEP", "SyncCosts"]

KEEP = 3


class SyncCosts:
    """The costs one rank measured over its last syncs."""

    def __init__(self):
        self._full: deque = deque(maxlen=KEEP)  # (seconds, full bytes) of anchors
        self._per_byte: deque = deque(maxlen=KEEP)  # seconds per delta byte beyond the diff
        self._diff: deque = deque(maxlen=KEEP)  # seconds of a delta's diff
        self.full_bytes = 0
        """The full sync's bytes, as the last sync planned them."""

    def record(self, mode: str, nbytes: int, seconds: float, diff_seconds: float) -> None:
        """One committed sync: ``mode`` ``anchor`` (``nbytes``: the full bytes; a diff it took, decided after
        it, is not the full sync's cost) or ``delta`` (its bytes)."""
        if seconds <= 0 or nbytes <= 0:
            return
        if mode == "anchor":
            self._full.append((max(seconds - diff_seconds, 1e-9), nbytes))
        else:
            self._diff.append(diff_seconds)
            self._per_byte.append(max(0.0, seconds - diff_seconds) / nbytes)

    def state(self) -> dict:
        """The medians, as plain numbers (rank 0's travel in its summary, so that every rank decides alike)."""
        full = statistics.median(s / b for s, b in self._full) if self._full else None
        return {"full_s_per_byte": full,
                "per_byte": statistics.median(self._per_byte) if self._per_byte else None,
                "diff_s": statistics.median(self._diff) if self._diff else 0.0}

    @staticmethod
    def verdict(state: dict, delta_bytes: float, full_bytes: int, diff_spent: bool) -> str | None:
        """Why a delta of ``delta_bytes`` (estimated or exact) would cost more than the full sync of
        ``full_bytes``, or None (send it, or nothing measured yet). ``diff_spent``: the diff is done."""
        full_pb = state.get("full_s_per_byte")
        if not full_pb:
            return None
        per_byte = max(full_pb, state.get("per_byte") or 0.0)
        diff = 0.0 if diff_spent else state.get("diff_s") or 0.0
        delta_s, full_s = diff + delta_bytes * per_byte, full_bytes * full_pb
        if delta_s < full_s:
            return None
        return (f"the delta would take about {delta_s:.3f} s ({delta_bytes / max(1, full_bytes):.1%} of the bytes"
                + ("" if diff_spent else f", its diff {diff:.3f} s") + f"), the full sync {full_s:.3f} s, "
                "at what the last syncs cost (delta_cost)")
