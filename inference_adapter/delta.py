"""Deltas on the reference server: check the base a delta names, then turn its records into whole tensors.

A delta bucket arrives like any bucket (broadcast on the group, or a shared-memory file) as one uint8 tensor
named :data:`~bridge.codecs.delta.DELTA_TENSOR`, with its table in the request (``wsync_delta``: the base
version and digest, the layout of the trainer's pieces, and the names, dtypes and shapes of its tensors;
:mod:`bridge.encodings.delta_send`). The table's tensors are checked like any announced tensors; then, before
anything is staged, the base: the served version label must be the table's ``base_version`` and the
digest of the served bytes of the table's tensors, cut into the trainer's pieces, its ``base_digest``.
Otherwise the request is refused with ``wsync_reason`` :data:`~bridge.protocol.DELTA_BASE_MISMATCH` and
nothing changes. Each touched tensor is staged as a :class:`Patch` (its records), which the swap applies
in place, so the update goes through the session like any other (swapped atomically at
``end_weight_update``) without a copy of every touched tensor.

The CRC of each served piece is cached until the weights change (one pass over the touched tensors per
version).
"""

from __future__ import annotations

import math
import threading

import torch

from bridge.codecs import kernels
from bridge.codecs.delta import DELTA_TENSOR, DeltaFormatError, apply_record, iter_records
from bridge.codecs.pieces import combine_digest, piece_crc, pieces_of
from bridge.protocol import DELTA_BASE_MISMATCH
from bridge.tensors import ParamSpec
from inference_adapter.wire import WireError, wire_specs

__all__ = ["DeltaRefused", "Deltas", "Patch", "delta_specs", "table_specs"]

_KEYS = ("base_version", "base_digest", "world", "whole", "names", "dtypes", "shapes")


class DeltaRefused(Exception):
    """The delta's base is not what this server serves; ``reason`` is the answer's ``wsync_reason``."""

    reason = DELTA_BASE_MISMATCH


def table_specs(table) -> list[ParamSpec]:
    """The tensors a delta's table names; WireError when the table is malformed."""
    if not isinstance(table, dict) or any(k not in table for k in _KEYS):
        raise WireError(f"wsync_delta must be an object with {', '.join(_KEYS)}")
    if not isinstance(table["base_version"], str) or not isinstance(table["whole"], list):
        raise WireError("wsync_delta: base_version must be a string and whole a list of names")
    digest, world = table["base_digest"], table["world"]
    if digest is not None and (isinstance(digest, bool) or not isinstance(digest, int)):
        raise WireError(f"wsync_delta: base_digest must be an integer or null, got {digest!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise WireError(f"wsync_delta: world must be a positive integer, got {world!r}")
    for key in ("names", "dtypes", "whole"):
        if not isinstance(table[key], list) or not all(isinstance(x, str) for x in table[key]):
            raise WireError(f"wsync_delta: {key} must be a list of strings")
    shapes = table["shapes"]
    if not isinstance(shapes, list) or not all(
        isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in shapes
    ):
        raise WireError("wsync_delta: shapes must be a list of lists of integers")
    return wire_specs(table["names"], table["dtypes"], shapes)


def delta_specs(table, specs: list[ParamSpec]) -> tuple[list[ParamSpec] | None, list[str]]:
    """For a request with ``wsync_delta``: the tensors its table names (None if it cannot be read), and why
    what travels (``specs``) is not one delta bucket (a single 1-D uint8 tensor named DELTA_TENSOR)."""
    problems = []
    if len(specs) != 1 or specs[0].name != DELTA_TENSOR or specs[0].dtype != torch.uint8 or len(specs[0].shape) != 1:
        problems.append(f"a request with wsync_delta carries exactly one 1-D uint8 tensor named {DELTA_TENSOR!r}")
    try:
        return table_specs(table), problems
    except WireError as e:
        return None, [*problems, str(e)]


class Patch:
    """A delta's records for one served tensor: staged instead of a whole new copy of it, and applied in place
    when the update is swapped in (:meth:`ServedWeights.swap <inference_adapter.weights.ServedWeights.swap>`),
    under the writer lock. It is *stale* when the served tensor changed after the base was checked (a disk
    load in the middle of a session): the swap then applies nothing."""

    def __init__(self, target: torch.Tensor):
        self.records: list = []
        self._stamp = (target.data_ptr(), target._version)

    def stale(self, target: torch.Tensor) -> bool:
        return (target.data_ptr(), target._version) != self._stamp

    def apply_to(self, target: torch.Tensor) -> None:
        flat = target.detach().view(-1)
        for rec in self.records:
            apply_record(flat, rec)


class Deltas:
    """The delta path of one server's :class:`~inference_adapter.weights.ServedWeights` (callers hold the
    update lock)."""

    def __init__(self, weights):
        self.weights = weights
        # The C kernels that check and apply gap records in one pass, loaded (or built, once per machine) before the
        # first delta rather than inside it; without them the records are decoded in numpy.
        threading.Thread(target=kernels.available, name="wsync-kernels", daemon=True).start()
        self._crcs: dict[tuple, list] = {}
        self._epoch = -1
        self._layout: tuple[int, set] | None = None  # (world, whole names) of the last delta
        self._ahead: threading.Thread | None = None  # CRCs of the served pieces, taken after a swap

    def staged(self, table: dict, buf: torch.Tensor, specs: list[ParamSpec]) -> tuple[list, dict]:
        """The whole new tensors of a delta bucket whose table (already checked by the caller against the
        served model) is ``specs``, and its new values (what to check for NaN/Inf: the rest is served).

        Raises:
            DeltaRefused: the served version or bytes are not the delta's base.
            WireError: the records do not fit the table.
        """
        self._check_base(table, specs)
        touched: dict[int, Patch] = {}
        values: dict[str, torch.Tensor] = {}
        try:
            for rec in iter_records(buf, [s.dtype for s in specs], [math.prod(s.shape) for s in specs]):
                if rec.tensor not in touched:
                    touched[rec.tensor] = Patch(self.weights.target(specs[rec.tensor].name))
                touched[rec.tensor].records.append(rec)
                values[f"{specs[rec.tensor].name} (delta record {len(values)})"] = rec.values
        except DeltaFormatError as e:
            raise WireError(f"the delta bucket is malformed: {e}") from None
        return [(specs[i].name, patch) for i, patch in touched.items()], values

    def after_swap(self) -> None:
        """The served weights changed: take the CRCs of their pieces now, on a thread, as the last delta cut them,
        so that the next delta does not wait for them (``zlib.crc32`` releases the GIL)."""
        if self._layout is None:
            return
        world, whole = self._layout
        epoch, params = self.weights.epoch, dict(self.weights.params)

        def run() -> None:
            out = {}
            for name, t in params.items():
                if self.weights.epoch != epoch:
                    return  # swapped again meanwhile: these would be of neither version
                key = (name, world, name in whole)
                flat = t.detach().reshape(-1)
                out[key] = [(name, s, n, piece_crc(flat, s, n)) for s, n in pieces_of(tuple(t.shape), world, key[2])]
            if self.weights.epoch == epoch:
                self._crcs, self._epoch = out, epoch

        self._ahead = threading.Thread(target=run, name="wsync-delta-crc", daemon=True)
        self._ahead.start()

    def _check_base(self, table: dict, specs: list[ParamSpec]) -> None:
        served = self.weights.version
        if table["base_version"] != str(served):
            raise DeltaRefused(f"the delta is against version {table['base_version']}, but this server serves "
                               f"version {served}")
        if table["base_digest"] is None:
            return
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        entries = []
        whole = set(table["whole"])
        if self._layout is None or self._layout[0] != table["world"]:
            self._layout = (table["world"], set())
        self._layout[1].update(whole)
        for s in specs:
            entries += self._piece_crcs(s, table["world"], s.name in whole)
        if combine_digest(entries) != table["base_digest"]:
            raise DeltaRefused(f"the served bytes of version {served} are not the delta's base (digest "
                               f"{combine_digest(entries)}, the delta names {table['base_digest']})")

    def _piece_crcs(self, spec: ParamSpec, world: int, whole: bool) -> list:
        if self._epoch != self.weights.epoch:
            self._crcs, self._epoch = {}, self.weights.epoch
        key = (spec.name, world, whole)
        if key not in self._crcs:
            flat = self.weights.target(spec.name).detach().reshape(-1)
            self._crcs[key] = [(spec.name, s, n, piece_crc(flat, s, n)) for s, n in pieces_of(spec.shape, world, whole)]
        return self._crcs[key]
