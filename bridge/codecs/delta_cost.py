"""Whether a delta is worth sending: the anchor decision of the delta encoding from what syncs cost.

Each trainer rank measures its own publishes, from the start of the prepare step to the commit:

* a full sync (an anchor): its seconds per full byte (a diff it took before it was decided excluded):
  the rate the link and the transport achieve end to end, whatever they are (loopback, a 200 Mbit/s
  link, NCCL), fixed work included;
* a delta: its diff (the prepare step after the anchor check): the compare's seconds per element of the
  rank's shard and the encoding's per changed element; and the rest of its seconds against its bytes.

A delta of ``delta_bytes`` is expected to take ``diff + fixed + delta_bytes * per_byte`` and the full
sync ``full_bytes * s_per_byte``: a delta goes when that is shorter by a margin (:data:`MARGIN`), since the costs
are the last syncs' and a load that rises between two syncs slows a delta's CPU work, not the full sync's bytes. ``diff`` is ``compare * elements +
encode * changed``. ``fixed`` and ``per_byte`` are a least-squares line through the last deltas' (bytes,
seconds after the diff), which AdamW's first steps spread widely (its per-byte cost includes the servers'
scattered writes, which a link rate does not see); until two deltas of different sizes are measured,
``fixed`` is 0 and ``per_byte`` the full sync's (the last deltas' own seconds per byte would count their
fixed work per byte, and on a small model call every delta slower than the full sync). So the first delta
much larger than the ones before is priced at the link's rate; once it is measured, the line prices it. So on a slow link nearly any delta under
``delta_max_fraction`` (the upper bound) goes, and on a fast one (NCCL between GPUs, loopback) only one
whose saved bytes outweigh its diff and writes. Before diffing (each rank, from a sample that estimates
the changed elements) the diff counts; once diffed, it is spent and only the rest counts. Each figure is
from the last :data:`KEEP` syncs of its kind. With no full sync measured yet nothing is decided here
(there is always one: the first sync is an anchor). Every committed delta is also checked against what the full sync
would have taken then: one that took longer is counted (:attr:`SyncCosts.slower` of :attr:`SyncCosts.deltas`) and
logged, and its costs price the next syncs.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["KEEP", "MARGIN", "SyncCosts"]

KEEP = 5
MARGIN = 1.1
"""A delta goes only when expected to take at most ``1 / MARGIN`` of the full sync's time (about nine tenths)."""


class SyncCosts:
    """The costs one rank measured over its last syncs."""

    def __init__(self):
        self._full: deque = deque(maxlen=KEEP)  # seconds per byte of anchors
        self._compare: deque = deque(maxlen=KEEP)  # a delta's compare: seconds per element
        self._encode: deque = deque(maxlen=KEEP)  # a delta's encoding: seconds per changed element
        self._sent: deque = deque(maxlen=KEEP)  # a delta's (bytes, seconds after its diff)
        self.full_bytes = 0
        """The full sync's bytes, as the last sync planned them."""
        self.deltas = 0
        """Committed deltas measured against a full sync."""
        self.slower = 0
        """Of those, the ones that took longer than the full sync would have then."""

    def record(self, mode: str, nbytes: int, seconds: float, diff: tuple[float, float, int, int]) -> float | None:
        """One committed sync: ``mode`` ``anchor`` (``nbytes``: the full bytes) or ``delta``; ``diff``: the
        seconds of its diff and of the encoding in it, the elements compared and changed (a diff before an
        anchor was decided is not the full sync's cost). A delta that took longer than the full sync would have
        (``full_bytes`` at the last full syncs' rate): that full sync's seconds, and it is counted; else None."""
        diff_s, encode_s, numel, changed = diff
        if mode == "anchor" and nbytes > 0 and seconds > diff_s:
            self._full.append((seconds - diff_s) / nbytes)
        elif mode == "delta" and numel:
            full_s = statistics.median(self._full) * self.full_bytes if self._full and self.full_bytes else None
            self._compare.append(max(0.0, diff_s - encode_s) / numel)
            self._encode.append(encode_s / max(1, changed))
            self._sent.append((nbytes, max(0.0, seconds - diff_s)))
            if full_s is not None:
                self.deltas += 1
                if seconds > full_s:
                    self.slower += 1
                    return full_s
        return None

    def state(self) -> dict:
        """The medians, as plain numbers (rank 0's travel in its summary, so that every rank decides alike)."""
        def med(d) -> float | None:
            return statistics.median(d) if d else None

        fixed, per_byte = _line(list(self._sent))
        return {"s_per_byte": med(self._full), "compare": med(self._compare) or 0.0, "encode": med(self._encode) or 0.0,
                "fixed": fixed, "per_byte": per_byte}

    @staticmethod
    def verdict(state: dict, delta_bytes: float, full_bytes: int, diff: tuple[int, int] | None = None) -> str | None:
        """Why a delta of ``delta_bytes`` (estimated or exact) would cost more than the full sync of
        ``full_bytes``, or None (send it, or nothing measured yet). ``diff``: (elements, changed elements) of
        the diff still to run; None when it is spent."""
        per_byte = state.get("s_per_byte")
        if not per_byte:
            return None
        diff_s = 0.0 if diff is None else state["compare"] * diff[0] + state["encode"] * diff[1]
        sent = state.get("per_byte")
        delta_s = diff_s + (delta_bytes * per_byte if sent is None else state["fixed"] + delta_bytes * sent)
        full_s = full_bytes * per_byte
        if delta_s * MARGIN <= full_s:
            return None
        return (f"the delta would take about {delta_s:.3f} s ({delta_bytes / max(1, full_bytes):.1%} of the bytes"
                + ("" if diff is None else f" and its diff, {diff_s:.3f} s") + f"), the full sync {full_s:.3f} s, at "
                f"{8 / per_byte / 1e6:.0f} Mbit/s, what the last full syncs achieved; a delta goes under "
                f"{full_s / MARGIN:.3f} s (delta_cost)")


def _line(points: list[tuple[int, float]]) -> tuple[float, float | None]:
    """(fixed seconds, seconds per byte) of the least-squares line through (bytes, seconds), both >= 0; (0, None)
    until two points differ in bytes by half or more."""
    xs = [x for x, _ in points]
    if len(points) < 2 or max(xs) < 1.5 * max(1, min(xs)):
        return 0.0, None
    mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    if slope >= 0 and my - slope * mx >= 0:
        return my - slope * mx, slope
    if slope < 0:  # bigger deltas took no longer: their bytes cost nothing measurable beside the fixed work
        return my, 0.0
    return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)  # through the origin
