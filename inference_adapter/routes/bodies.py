"""The request bodies the reference server parses: SGLang's request models, plus the project's own fields.

Each route parses its body once, into one of these models (:func:`inference_adapter.routes.common.parse`).
They extend :mod:`bridge.protocol`'s mirrors of SGLang's structs in two ways:

* the emulated SGLang version's dialect, applied before validation (the parse's context carries the
  server's :class:`~bridge.protocol.ProtocolFeatures`): a field that version's struct lacks is dropped, as
  SGLang's parsing drops it, and SGLang <= 0.4.8's one-tensor form of a broadcast becomes the lists;
* the project's fields, declared here and checked, with their own wording, once SGLang's fields are valid:
  ``wsync_run_id``/``wsync_new_run``/``wsync_writer`` (:class:`~inference_adapter.checks.RunClaim`) on every
  weight-changing request, ``wsync_manifest_sha256`` on disk updates. Real SGLang ignores them. The project's
  own ``/wsync/writer_lease`` takes :class:`LeaseBody`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationInfo, model_validator

from bridge.protocol import (
    BeginWeightUpdateReq,
    ContinueGenerationReq,
    LoadLoRAAdapterFromTensorsReq,
    LoadLoRAAdapterReq,
    PauseGenerationReq,
    ProtocolFeatures,
    UnloadLoRAAdapterReq,
    UpdateWeightFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightVersionReq,
)
from inference_adapter.checks import RunClaim, version_problem
from inference_adapter.errors import RequestError

__all__ = ["BeginBody", "DiskBody", "DistributedBody", "LeaseBody", "LoraDistributedBody", "LoraPathBody", "LoraTensorsBody",
           "LoraUnloadBody",
           "PauseBody",
           "TensorBody", "VersionBody", "WriterBody"]


def _features(info: ValidationInfo) -> ProtocolFeatures | None:
    return (info.context or {}).get("features")


def _without(data: dict, fields: list[str]) -> dict:
    return {k: v for k, v in data.items() if k not in fields} if any(k in data for k in fields) else data


class _VersionedFields(BaseModel):
    """Drops what the emulated version's struct lacks: ``load_format`` (flattened buckets) before 0.5.6,
    ``weight_version`` before 0.5.1."""

    @model_validator(mode="before")
    @classmethod
    def _drop_fields_the_version_lacks(cls, data: Any, info: ValidationInfo) -> Any:
        f = _features(info)
        if f is None or not isinstance(data, dict):
            return data
        lacks = ([] if f.flattened_bucket else ["load_format"]) + ([] if f.weight_version else ["weight_version"])
        return _without(data, lacks)


class _RunFields(BaseModel):
    """The project's ``wsync_run_id`` (str) and ``wsync_new_run`` (bool), as :attr:`run`.

    Declared loosely and checked after SGLang's fields, so that a bad SGLang field is reported first and a
    bad run field in the words of :meth:`RunClaim.from_fields <inference_adapter.checks.RunClaim.from_fields>`.
    """

    wsync_run_id: Any = None
    wsync_new_run: Any = False
    wsync_writer: Any = None
    _run: RunClaim = PrivateAttr(default_factory=RunClaim)

    @model_validator(mode="after")
    def _check_run(self) -> _RunFields:
        self._run = RunClaim.from_fields(self.wsync_run_id, self.wsync_new_run, self.wsync_writer)
        return self

    @property
    def run(self) -> RunClaim:
        return self._run


class DistributedBody(UpdateWeightsFromDistributedReq, _RunFields, _VersionedFields):
    """``/update_weights_from_distributed``; ``wsync_delta``: the buffer is a delta bucket and this its table
    (checked by :mod:`inference_adapter.delta`)."""

    wsync_delta: Any = None

    @model_validator(mode="before")
    @classmethod
    def _single_to_batched(cls, data: Any, info: ValidationInfo) -> Any:
        # SGLang <= 0.4.8 took one tensor per request.
        f = _features(info)
        if f is not None and not f.batched_distributed and isinstance(data, dict) and "name" in data:
            return {**data, "names": [data.get("name")], "dtypes": [data.get("dtype")], "shapes": [data.get("shape")]}
        return data


class TensorBody(UpdateWeightsFromTensorReq, _RunFields, _VersionedFields):
    """``/update_weights_from_tensor``."""


class DiskBody(UpdateWeightFromDiskReq, _RunFields, _VersionedFields):
    """``/update_weights_from_disk``, with the announced manifest digest (checked after the run fields)."""

    wsync_manifest_sha256: Any = None

    @model_validator(mode="after")
    def _check_manifest_sha256(self) -> DiskBody:
        sha = self.wsync_manifest_sha256
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise RequestError(f"wsync_manifest_sha256 must be the announced manifest's sha256 (64 lowercase hex "
                               f"digits), got {sha!r}")
        return self


class BeginBody(BeginWeightUpdateReq, _RunFields):
    """``/begin_weight_update``: the session claims its run here, for every bucket it stages."""


class VersionBody(UpdateWeightVersionReq, _RunFields):
    """``/update_weight_version``."""


class WriterBody(_RunFields):
    """``/end_weight_update`` and ``/wsync/abort_weight_update``: who asks (SGLang sends no body here)."""

    model_config = ConfigDict(extra="ignore")


class LeaseBody(BaseModel):
    """``/wsync/writer_lease``: take (or renew) the server for ``lease_s`` seconds, or ``release`` it;
    ``starts_sync``: the take opens a sync (a session this writer left open before is discarded);
    ``renew_only``: renew this writer's lease, never take one."""

    model_config = ConfigDict(extra="ignore")
    wsync_writer: Any = None
    wsync_run_id: Any = None
    lease_s: Any = 10.0
    release: Any = False
    starts_sync: Any = False
    renew_only: Any = False
    _run: RunClaim = PrivateAttr(default_factory=RunClaim)

    @model_validator(mode="after")
    def _check(self) -> LeaseBody:
        if self.wsync_writer is None:
            raise RequestError("wsync_writer is required: the writer (publisher) that takes or releases the lease")
        self._run = RunClaim.from_fields(self.wsync_run_id, False, self.wsync_writer)
        for name in ("release", "starts_sync", "renew_only"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_seconds("lease_s", self.lease_s)
        return self

    @property
    def run(self) -> RunClaim:
        return self._run


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
        raise RequestError(f"{name} must be a number of seconds, got {value!r}")


class ContinueBody(ContinueGenerationReq):
    """``/continue_generation``; ``wsync_release_lease``: also release ``wsync_writer``'s writer lease once
    resumed (the publisher's last step of a sync in one request instead of two)."""

    wsync_writer: Any = None
    wsync_release_lease: Any = False

    @model_validator(mode="after")
    def _check_release(self) -> ContinueBody:
        if not isinstance(self.wsync_release_lease, bool):
            raise RequestError(f"wsync_release_lease must be true or false, got {self.wsync_release_lease!r}")
        if self.wsync_release_lease and not (isinstance(self.wsync_writer, str) and self.wsync_writer):
            raise RequestError("wsync_release_lease needs wsync_writer: the writer whose lease to release")
        return self


class PauseBody(PauseGenerationReq, _RunFields):
    """``/pause_generation``: before 0.5.6 SGLang's route reads no mode; a mode (even a bad one) is ignored
    and it pauses, aborting.

    The project's fields make it a publisher's whole first step of a sync on its one server, in one request
    instead of three: ``wsync_lease_s`` takes ``wsync_writer``'s writer lease for that many seconds first (as
    ``/wsync/writer_lease`` with ``starts_sync``; refused with nothing paused while another writer holds it);
    ``wsync_begin_session`` then opens the update session once paused (as ``/begin_weight_update``; refused
    with the pause lifted again)."""

    wsync_lease_s: Any = None
    wsync_begin_session: Any = False

    @model_validator(mode="after")
    def _check_lease(self) -> PauseBody:
        if not isinstance(self.wsync_begin_session, bool):
            raise RequestError(f"wsync_begin_session must be true or false, got {self.wsync_begin_session!r}")
        if self.wsync_lease_s is not None:
            if self.wsync_writer is None:
                raise RequestError("wsync_lease_s needs wsync_writer: the writer (publisher) that takes the lease")
            _check_seconds("wsync_lease_s", self.wsync_lease_s)
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_mode_before_0_5_6(cls, data: Any, info: ValidationInfo) -> Any:
        f = _features(info)
        return _without(data, ["mode"]) if f is not None and not f.pause_mode and isinstance(data, dict) else data


class _LoraFields(BaseModel):
    """The project's fields on an adapter load: ``wsync_lora_version`` (the adapter's version label, reported by
    every generation that runs with it) and ``wsync_replace`` (replace an adapter of that name atomically instead
    of SGLang's "already loaded" refusal). Real SGLang ignores both."""

    wsync_lora_version: Any = None
    wsync_replace: Any = False

    @model_validator(mode="after")
    def _check_lora_fields(self):
        v = self.wsync_lora_version
        if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
            raise RequestError(f"wsync_lora_version must be a version label (a string or an integer), got {v!r}")
        if v is not None:
            self.wsync_lora_version = str(v)
        problem = version_problem(self.wsync_lora_version, "wsync_lora_version") or version_problem(
            getattr(self, "lora_name", None), "lora_name", example="the adapter's name")
        if problem:
            raise RequestError(problem)
        if not isinstance(self.wsync_replace, bool):
            raise RequestError(f"wsync_replace must be true or false, got {self.wsync_replace!r}")
        return self


class LoraPathBody(LoadLoRAAdapterReq, _LoraFields, _RunFields):
    """``/load_lora_adapter``: a PEFT adapter directory, by name."""


class LoraTensorsBody(LoadLoRAAdapterFromTensorsReq, _LoraFields, _RunFields):
    """``/load_lora_adapter_from_tensors`` in the emulated version's shape: 0.5.20+ ``serialized_named_tensors``
    (one entry per TP rank, ``load_format``, ``expected_checksums``), 0.5.8 one string ``serialized_tensors``;
    the other shape's fields are dropped before validation, as that version's struct has no such field."""

    @model_validator(mode="before")
    @classmethod
    def _version_shape(cls, data: Any, info: ValidationInfo) -> Any:
        f = _features(info)
        if f is None or not isinstance(data, dict):
            return data
        if f.lora_tensors_per_rank:
            return _without(data, ["serialized_tensors"])
        return _without(data, ["serialized_named_tensors", "load_format", "expected_checksums"])

    @model_validator(mode="after")
    def _one_shape(self):
        if self.serialized_named_tensors is None and self.serialized_tensors is None:
            raise RequestError("/load_lora_adapter_from_tensors needs serialized_named_tensors (one entry per TP rank; "
                               "serialized_tensors, one string, on SGLang 0.5.8-0.5.19)")
        return self


class LoraDistributedBody(_LoraFields, _RunFields):
    """The project's ``/wsync/load_lora_adapter_from_distributed``: the adapter's PEFT config and its tensors as one
    flat buffer broadcast on ``group_name`` (``names``/``dtypes``/``shapes`` as ``/update_weights_from_distributed``
    announces a flattened bucket), ``expected_checksums`` as ``/load_lora_adapter_from_tensors`` checks them."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    config_dict: dict[str, Any]
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    pinned: bool = False
    expected_checksums: dict[str, str] | None = None


class LoraUnloadBody(UnloadLoRAAdapterReq, _RunFields):
    """``/unload_lora_adapter``, with the writer (one writer at a time)."""
