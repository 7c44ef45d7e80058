"""Reading a checkpoint directory for ``/update_weights_from_disk``, refusing what must not be loaded.

SGLang loads any readable directory; this server loads only directories under ``--disk-root`` (symlinks
resolved), whose manifest and index name plain files inside them, and only regular files
(:func:`read_checkpoint`); what it reads is then checked against every served parameter
(:func:`checkpoint_to_stage`) before :class:`~inference_adapter.weight_updates.WeightUpdates` swaps it in.
"""

from __future__ import annotations

import json
import os

import torch

from bridge.codecs.fp8 import FP8_DTYPE, SCALE_SUFFIX
from bridge.errors import SnapshotError
from bridge.protocol import QUANTIZATION_MISMATCH, SNAPSHOT_INVALID
from bridge.tensors import dtype_to_str
from inference_adapter.weights import ServedWeights

__all__ = ["CheckpointRefused", "checkpoint_to_stage", "missing_problem", "read_checkpoint"]

_MAX_JSON_BYTES = 64 << 20  # a manifest or index larger than this is not a checkpoint's


class CheckpointRefused(Exception):
    """A checkpoint the server will not (or cannot) read: ``why``, and a ``reason`` for ``wsync_reason``."""

    def __init__(self, why: str, reason: str | None = None):
        super().__init__(why)
        self.why = why
        self.reason = reason


def read_checkpoint(path: str, roots: list[str], manifest_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``; CheckpointRefused for what :func:`_checked_dir` refuses,
    and for a snapshot that fails its manifest (reason :data:`~bridge.protocol.SNAPSHOT_INVALID`)."""
    from bridge.snapshot import read_snapshot

    real = _checked_dir(path, roots)
    try:
        return read_snapshot(real, verify=True, expected_manifest_sha256=manifest_sha256)
    except SnapshotError as e:
        raise CheckpointRefused(str(e), reason=SNAPSHOT_INVALID) from e
    except Exception as e:  # safetensors/JSON/OS errors of a corrupt directory
        raise CheckpointRefused(f"cannot read {path}: {type(e).__name__}: {e}") from e


def checkpoint_to_stage(tensors: dict[str, torch.Tensor],
                        weights: ServedWeights) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``(staged, problems)``: the checkpoint's tensors cast to the served dtypes, and why they must not be
    served (a name the model lacks, another shape, a served parameter missing). Aliases are skipped."""
    problems, staged = [], {}
    for n, t in tensors.items():
        target = weights.target(n)
        fp8 = FP8_DTYPE in (t.dtype, getattr(target, "dtype", None))
        if target is None and n.endswith(SCALE_SUFFIX) and weights.target(n.removesuffix(SCALE_SUFFIX)) is not None:
            problems.append(f"{QUANTIZATION_MISMATCH}: checkpoint tensor {n!r} is an FP8 block scale, but this server "
                            "serves its weight unquantized (it was not started with --quantization fp8)")
        elif target is None:
            problems.append(f"checkpoint tensor {n!r} is not a parameter of the served model")
        elif fp8 and t.dtype != target.dtype:
            problems.append(f"{QUANTIZATION_MISMATCH}: checkpoint tensor {n!r} is {dtype_to_str(t.dtype)}, served as "
                            f"{dtype_to_str(target.dtype)}: an FP8 checkpoint needs a server started with --quantization "
                            "fp8, and such a server an FP8 checkpoint (a publisher's encoding='fp8')")
        elif tuple(t.shape) != tuple(target.shape):
            problems.append(f"checkpoint tensor {n!r} has shape {list(t.shape)}, the served one {list(target.shape)}")
        elif t.is_floating_point() != target.is_floating_point():
            problems.append(f"checkpoint tensor {n!r} is {dtype_to_str(t.dtype)}, the served one "
                            f"{dtype_to_str(target.dtype)}")
        elif n not in weights.aliases:
            staged[n] = t.to(target.dtype)  # SGLang's loader casts into the parameter's dtype, so do we
    return staged, problems


def missing_problem(tensors: dict[str, torch.Tensor], staged: dict[str, torch.Tensor],
                    weights: ServedWeights) -> str | None:
    """Why a checkpoint is incomplete (it lacks served parameters), or None."""
    missing = [n for n in weights.params if n not in staged and n not in tensors]
    if not missing:
        return None
    return f"the checkpoint lacks {len(missing)} of the {len(weights.params)} served parameters, e.g. {missing[:3]}"


def _checked_dir(path: str, roots: list[str]) -> str:
    """``path`` resolved, or CheckpointRefused for what must not be loaded.

    Refused: a directory outside ``roots`` once symlinks are resolved; and any file the loader would open
    (every file the manifest or the index names, and every ``.json`` and ``.safetensors`` file) that is not
    a regular file directly inside the directory once symlinks are resolved
    (:func:`bridge.snapshot.manifest.open_entry`: opened without blocking, so a FIFO never freezes the
    server) or, for the manifest and the index, is implausibly large. A refusal says nothing of where a
    symlink leads or of the file there.
    """
    from bridge.snapshot import INDEX_NAME, MANIFEST_NAME
    from bridge.snapshot.manifest import under_roots

    try:
        real = os.path.realpath(path)
        is_dir = os.path.isdir(real)
    except (ValueError, OSError) as e:  # an embedded NUL byte, a name too long
        raise CheckpointRefused(f"model_path {path!r} is not a usable path ({e})") from None
    if not is_dir:
        raise CheckpointRefused(f"{path} does not exist or is not a directory")
    if not under_roots(real, roots):
        raise CheckpointRefused(f"{path} (resolved: {real}) is outside the directories this server loads from "
                                f"({', '.join(roots)}); start the server with --disk-root naming the snapshot root")
    names = {n for n in os.listdir(real) if n.endswith((".safetensors", ".json"))}
    for meta_name, key in ((MANIFEST_NAME, "files"), (INDEX_NAME, "weight_map")):
        if meta_name in names:
            entries = _json_entries(real, meta_name, key)
            for e in entries:  # checked as they are listed, before any of them is opened for its bytes
                _check_regular_file(real, e)
            names |= set(entries)
    for name in sorted(names):
        _check_regular_file(real, name)
    return real


def _json_entries(directory: str, name: str, key: str) -> list:
    """The keys (``files``) or values (``weight_map``) of a small JSON file of the checkpoint."""
    fd = _check_regular_file(directory, name, keep_open=True)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > _MAX_JSON_BYTES:
            raise CheckpointRefused(f"{name} has {size} bytes, more than a checkpoint's {name} can need")
        try:
            data = json.loads(f.read(_MAX_JSON_BYTES))
            table = data[key]
            return list(table) if key == "files" else list(table.values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointRefused(f"{name} is not a valid {name} ({type(e).__name__}: {e})") from None


def _check_regular_file(directory: str, name, keep_open: bool = False) -> int | None:
    """Refused unless ``name`` is a regular file inside ``directory`` (a missing one is the reader's to
    report, with the manifest's view of it); with ``keep_open`` its open file descriptor."""
    from bridge.snapshot.manifest import open_entry

    try:
        fd = open_entry(directory, name)
    except FileNotFoundError:
        if keep_open:
            raise CheckpointRefused(f"{name} disappeared while the checkpoint was read") from None
        return None
    except SnapshotError as e:
        raise CheckpointRefused(str(e).removeprefix(f"snapshot {directory}: ")) from None
    if keep_open:
        return fd
    os.close(fd)
    return None
