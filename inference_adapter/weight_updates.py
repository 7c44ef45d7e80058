"""Weight updates: the begin/end session, staging, validation, and the distributed/shm/disk receive paths.

An update first *stages* (receive or read, then validate), and only a complete, valid update is
swapped in (:meth:`ModelState._swap <inference_adapter.model_state.ModelState._swap>`); anything that
fails leaves the previous weights and version serving.

How an update travels:

* Broadcast (``update_distributed``): the metadata is checked first. If it cannot describe what is on
  the wire (unparseable dtype, ragged lists, unsupported ``load_format``) the server cannot receive
  it; it answers 400 and destroys the group, because the trainer's bytes are already in flight and
  would be read by the next receive. If it is well-formed but wrong for this model (unknown name,
  wrong shape, dtype other than the served dtype, unaligned bucket, or no open session on a 0.5.21+
  protocol), the server still receives the broadcast as announced -- so the trainer does not hang and
  the group stays usable -- then discards it and answers 400. With a session (0.5.21+) buckets are
  staged until ``end_weight_update``, which swaps them together with the ``weight_version`` given on
  any bucket; any failure aborts the whole session. (Receiving and the byte-size check on gloo:
  :mod:`inference_adapter.wire`.)
* Co-located (``update_tensor``, ``/update_weights_from_tensor``): real SGLang takes pickled CUDA IPC
  handles; CPU tensors cannot cross HTTP, and this server never unpickles anything. It accepts only the
  project extension ``load_format="wsync_shm"``: the entry names a file under /dev/shm (or the temp dir)
  holding one flattened bucket, which is checked like a distributed bucket, copied out and staged in
  the session. Bad input answers 400, aborts the session and changes nothing.
* Disk (``update_disk``): the checkpoint is read and checked completely (every served parameter,
  shapes; dtypes are cast as SGLang casts them) before the swap.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import ConfigError, SnapshotError
from bridge.protocol import SESSION_REQUIRED_MESSAGE, SHM_LOAD_FORMAT
from bridge.tensors import ParamSpec, dtype_to_str
from inference_adapter.errors import RequestError
from inference_adapter.wire import (
    _read_shm,
    _receive_nccl,
    _recv_bytes,
    _shm_descriptor,
    _SizeMismatch,
    _wire_specs,
    _WireError,
)

__all__ = ["WeightUpdateMixin"]


@dataclass
class _Session:
    """An open begin/end_weight_update session (0.5.21+ protocol)."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    groups: set[str] = field(default_factory=set)
    requests: int = 0


def _join(problems: list[str], limit: int = 4) -> str:
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


class WeightUpdateMixin:
    """:class:`~inference_adapter.model_state.ModelState`'s weight-update methods.

    Uses the host's ``_params``/``_aliases``, ``features``, ``_update_lock`` (held by every method
    here, one weight operation at a time), its groups (:class:`~inference_adapter.groups.GroupsMixin`)
    and ``_swap``; owns the open session, set up by :meth:`_init_sessions`.
    """

    def _init_sessions(self) -> None:
        self._session: _Session | None = None
        self._last_session_error: str | None = None

    def begin_session(self) -> str:
        with self._update_lock:
            if self._session is not None:
                raise RequestError("A weight update session is already open; call end_weight_update() first.")
            self._session, self._last_session_error = _Session(), None
        self.log.info("weight update session opened")
        return "Weight update session started."

    def end_session(self) -> str:
        with self._update_lock:
            s = self._session
            if s is None:
                why = f" The last session was aborted: {self._last_session_error}" if self._last_session_error else ""
                raise RequestError(f"No weight update session is open; call begin_weight_update() first.{why}")
            self._session = None
            self._swap(s.staged, s.version)
        msg = f"Weight update session ended: {len(s.staged)} tensors from {s.requests} requests applied atomically."
        if s.version is not None:
            msg += f" Weight version updated to {s.version}."
        return msg

    def _abort_session(self, why: str) -> None:
        if self._session is not None:
            n = len(self._session.staged)
            self._session, self._last_session_error = None, why
            self.log.warning("weight update session aborted, %d staged tensors discarded: %s", n, why)

    # ------------------------------------------------------------------ updates

    def update_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                           load_format: str | None, weight_version: str | None, abort_all_requests: bool) -> str:
        """Receive one broadcast request (see the module docstring); returns SGLang's success message."""
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_distributed(abort_all_requests=True).")
        t0 = time.perf_counter()
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."
            pg = self._groups.get(group_name)
            if pg is None:
                why = f" (the server destroyed it because {self._dead_groups[group_name]})" if group_name in self._dead_groups else ""
                self._abort_session(f"group {group_name} does not exist")
                raise RequestError(
                    f"Group {group_name} not in {sorted(self._groups)}{why}. Please call init_weights_update_group first."
                )
            flattened = load_format == "flattened_bucket"
            try:
                if load_format not in (None, "flattened_bucket"):
                    raise _WireError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
                if flattened and not self.features.flattened_bucket:
                    raise _WireError(
                        f"load_format 'flattened_bucket' needs SGLang >= 0.5.10; this server speaks {self.features.version}"
                    )
                specs = _wire_specs(names, dtypes, shapes)
            except _WireError as e:
                self._drop_group(group_name, "it was sent a request it could not receive")
                self._abort_session(str(e))
                raise RequestError(
                    f"Failed to update parameter online: {e}. The trainer's broadcast was not received, so group "
                    f"{group_name} was destroyed; call init_weights_update_group again.{keep}"
                ) from None
            problems = []
            if self.features.needs_session and self._session is None:
                problems.append(SESSION_REQUIRED_MESSAGE + "; call begin_weight_update() first")
            problems += self._check_specs(specs, flattened)
            nbytes = sum(s.nbytes for s in specs)
            if problems and nbytes > max(2 * self._param_bytes, 64 << 20):
                self._drop_group(group_name, "it was sent an invalid request too large to receive and discard")
                self._abort_session(problems[0])
                raise RequestError(f"Failed to update parameter online: {_join(problems)}. The {nbytes}-byte broadcast "
                                   f"was not received; group {group_name} was destroyed.{keep}")
            self._receiving = group_name
            try:
                received = self._receive(pg, specs, flattened, tag=f"{group_name}|{names}|{dtypes}|{shapes}",
                                         nccl=group_name in self._nccl_groups)
            except _SizeMismatch as e:
                problems.append(str(e))
                received = []
            except Exception as e:  # noqa: BLE001 - any receive failure leaves the group unusable
                self._drop_group(group_name, f"a broadcast on it failed ({e})")
                self._abort_session(f"broadcast failed: {e}")
                if self._paused:
                    # The trainer that paused generation died or stalled; it may never send
                    # /continue_generation. The old weights are intact, so serve them again.
                    self.log.warning("broadcast failed while paused: continuing generation on the previous weights")
                    self.resume()
                raise RequestError(
                    f"Failed to update parameter online: the broadcast on group {group_name} failed ({e}); the trainer "
                    f"may have died or timed out (group timeout {self.group_timeout:g} s). The group was destroyed; "
                    f"call init_weights_update_group again.{keep}"
                ) from e
            finally:
                self._receiving = None
            if problems:
                sess = " The update session was aborted; nothing it staged was applied." if self._session else ""
                self._abort_session(problems[0])
                raise RequestError(f"Failed to update parameter online: {_join(problems)}.{sess}{keep} "
                                   "(The broadcast was received and discarded; the group is still usable.)")
            return self._stage(received, weight_version, nbytes, t0, group_name)

    def _stage(self, received: list[tuple[str, torch.Tensor]], weight_version: str | None, nbytes: int, t0: float,
               group_name: str | None) -> str:
        """Caller holds _update_lock: stage a validated request in the session, or swap it in without one."""
        staged = {n: t for n, t in received if n not in self._aliases}
        dt = time.perf_counter() - t0
        if self._session is not None:
            s = self._session
            s.staged.update(staged)
            if group_name is not None:
                s.groups.add(group_name)
            s.requests += 1
            if weight_version is not None:
                s.version = str(weight_version)
            self.log.info("staged %d tensors (%d bytes) in %.3f s, %.2f GB/s", len(staged), nbytes, dt,
                          nbytes / max(dt, 1e-9) / 1e9)
            msg = "Succeeded to update parameter online (staged; applied at end_weight_update())."
            if weight_version is not None:
                msg += f" Weight version {weight_version} is applied with the weights at end_weight_update()."
            return msg
        self._swap(staged, weight_version if self.features.weight_version else None)
        msg = "Succeeded to update parameter online."
        if weight_version is not None and self.features.weight_version:
            msg += f" Weight version updated to {weight_version}."
        return msg

    def update_tensor(self, *, serialized_named_tensors: list[str], load_format: str | None,
                      weight_version: str | None, abort_all_requests: bool) -> str:
        """``/update_weights_from_tensor``: only the project's ``load_format="wsync_shm"`` on this CPU server.

        Each entry (one per TP rank; this server has one) is base64 of the JSON object ``{"path", "nbytes",
        "names", "dtypes", "shapes"}``: a file under /dev/shm (or the temp dir) holding one flattened bucket.
        Nothing is unpickled. The file is mapped read-only and copied out (the trainer unlinks it once we
        answer), validated like a distributed bucket, and staged in the session (swapped at
        end_weight_update). Any bad input answers 400, aborts the session, and changes nothing.
        """
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_tensor(abort_all_requests=True).")
        t0 = time.perf_counter()
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."

            def refuse(why: str) -> RequestError:
                sess = " The update session was aborted; nothing it staged was applied." if self._session else ""
                self._abort_session(why)
                return RequestError(f"Failed to update weights from tensor: {why}.{sess}{keep}")

            if load_format != SHM_LOAD_FORMAT:
                raise refuse(
                    f"load_format {load_format!r} is not supported by the reference server: CPU tensors cannot cross "
                    f"HTTP; use load_format={SHM_LOAD_FORMAT!r} with the reference server, or CUDA tensors with real SGLang"
                )
            if self.features.needs_session and self._session is None:
                raise refuse(SESSION_REQUIRED_MESSAGE.replace("update_weights_from_distributed", "update_weights_from_tensor")
                             + "; call begin_weight_update() first")
            try:
                if len(serialized_named_tensors) != 1:
                    raise _WireError(f"serialized_named_tensors has {len(serialized_named_tensors)} entries; this server "
                                     "has 1 TP rank, so send exactly 1")
                desc = _shm_descriptor(serialized_named_tensors[0])
                specs = _wire_specs(desc["names"], desc["dtypes"], desc["shapes"])
            except _WireError as e:
                raise refuse(str(e)) from None
            problems = self._check_specs(specs, flattened=True)
            nbytes = sum(sp.nbytes for sp in specs)
            if desc["nbytes"] != nbytes:
                problems.append(f"nbytes is {desc['nbytes']} but names/dtypes/shapes describe {nbytes} bytes")
            if problems:
                raise refuse(_join(problems))
            try:
                buf = _read_shm(desc["path"], nbytes)
            except _WireError as e:
                raise refuse(str(e)) from None
            return self._stage(unflatten_bucket(buf, specs), weight_version, nbytes, t0, None)

    def abort_session(self) -> str:
        """Project extension (``/wsync/abort_weight_update``): discard the open session, apply nothing."""
        with self._update_lock:
            if self._session is None:
                raise RequestError("No weight update session is open; nothing to abort.")
            self._abort_session("the trainer aborted it (/wsync/abort_weight_update)")
        return f"Weight update session aborted; nothing was applied; still serving weight version {self._version}."

    def _check_specs(self, specs: list[ParamSpec], flattened: bool) -> list[str]:
        problems, seen = [], set()
        for s in specs:
            target = self._params.get(self._aliases.get(s.name, s.name))
            if s.name in seen:
                problems.append(f"tensor {s.name!r} appears twice in one request")
            seen.add(s.name)
            if target is None:
                problems.append(
                    f"tensor {s.name!r} is not a parameter of the served model ({type(self.model).__name__}; names are "
                    f"HF checkpoint names such as {next(iter(self._params))!r})"
                )
                continue
            if tuple(target.shape) != s.shape:
                problems.append(f"tensor {s.name!r} has shape {list(s.shape)} but the served parameter has shape "
                                f"{list(target.shape)}; send the full (unsharded) tensor")
            if target.dtype != s.dtype:
                problems.append(f"tensor {s.name!r} is sent as {dtype_to_str(s.dtype)} but served as "
                                f"{dtype_to_str(target.dtype)}; cast to {dtype_to_str(target.dtype)} before sending")
        if flattened:
            try:
                Bucket(list(specs))
            except ConfigError as e:
                problems.append(f"Unaligned received tensor: {e}")
        return problems

    def _receive(self, pg, specs: list[ParamSpec], flattened: bool, tag: str, nccl: bool) -> list[tuple[str, torch.Tensor]]:
        if nccl:
            try:
                return _receive_nccl(pg, specs, flattened)
            except ConfigError:  # unaligned bucket, already reported by _check_specs
                return []
        # The pattern is the same on every server of the group: gloo relays a receiver's whole buffer,
        # slack included, to the next receiver of a broadcast tree.
        seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
        if flattened:
            nbytes = sum(s.nbytes for s in specs)
            buf = _recv_bytes(pg, nbytes, seed, "the flattened bucket")
            try:
                return unflatten_bucket(buf, specs)
            except ConfigError:  # unaligned: the problem was reported by _check_specs; hand back nothing
                return []
        out = []
        for i, s in enumerate(specs):
            buf = _recv_bytes(pg, s.nbytes, seed + i, f"tensor {s.name!r}")
            out.append((s.name, buf.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)))
        return out

    def update_disk(self, *, model_path: str, weight_version: str | None, abort_all_requests: bool) -> str:
        """Load a whole HF checkpoint directory, validate it, then swap; SGLang's success message."""
        if abort_all_requests:
            self.abort_all("Abort by update_weights_from_disk(abort_all_requests=True).")
        with self._update_lock:
            keep = f" Nothing was applied; still serving weight version {self._version}."
            t0 = time.perf_counter()
            tensors = _read_checkpoint(model_path, keep)
            problems, staged = [], {}
            for n, t in tensors.items():
                target = self._params.get(self._aliases.get(n, n))
                if target is None:
                    problems.append(f"checkpoint tensor {n!r} is not a parameter of the served model")
                elif tuple(t.shape) != tuple(target.shape):
                    problems.append(f"checkpoint tensor {n!r} has shape {list(t.shape)}, the served one {list(target.shape)}")
                elif t.is_floating_point() != target.is_floating_point():
                    problems.append(f"checkpoint tensor {n!r} is {dtype_to_str(t.dtype)}, the served one {dtype_to_str(target.dtype)}")
                elif n not in self._aliases:
                    staged[n] = t.to(target.dtype)  # SGLang's loader casts into the parameter's dtype, so do we
            missing = [n for n in self._params if n not in staged and n not in tensors]
            if missing:
                problems.append(f"the checkpoint lacks {len(missing)} of the {len(self._params)} served parameters, "
                                f"e.g. {missing[:3]}")
            if problems:
                raise RequestError(f"Failed to update weights: {model_path}: {_join(problems)}.{keep}")
            self._swap(staged, weight_version if self.features.weight_version else None, model_path=model_path)
            self.log.info("loaded %s from disk in %.2f s", model_path, time.perf_counter() - t0)
        return "Succeeded to update model weights."


def _read_checkpoint(path: str, keep: str) -> dict[str, torch.Tensor]:
    from bridge.snapshot import read_snapshot

    if not os.path.isdir(path):
        raise RequestError(f"Failed to get weights iterator: {path} does not exist or is not a directory.{keep}")
    try:
        return read_snapshot(path, verify=True)
    except SnapshotError as e:
        raise RequestError(f"Failed to get weights iterator: {e}.{keep}") from e
    except Exception as e:  # noqa: BLE001 - safetensors/JSON/OS errors of a corrupt directory
        raise RequestError(f"Failed to get weights iterator: cannot read {path}: {type(e).__name__}: {e}.{keep}") from e
