"""Wire-level receiving: what an update request announces, and reading its bytes off a group or /dev/shm.

These helpers know nothing of the served model; :mod:`inference_adapter.weight_updates` checks the
announced specs against it and stages what arrives.

Byte-size check (gloo groups; NCCL groups, possible on a CUDA host, receive exactly as SGLang does,
without it): gloo does not tell a receiver how many bytes arrived, and aborts the process when
more arrive than were posted. Each receive therefore posts a buffer with slack beyond the announced
size and pre-fills the bytes around the announced end with a pattern derived from the request; a
changed pattern beyond the end means more bytes came; the last 16 announced bytes still holding the
pattern mean at least 16 fewer came (a smaller shortfall, or a receive under 8 bytes, goes unnoticed).
A sender that sends more than twice the announced size plus 4 KiB still overruns the slack, and gloo
aborts the server.

Shared memory (``load_format="wsync_shm"``): each entry is base64 of a JSON object (never a pickle)
naming a regular file under /dev/shm (or the temp dir) that holds one flattened bucket.

Everything here is private to the package: only :mod:`inference_adapter.weight_updates` uses it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bridge.buckets import unflatten_bucket
from bridge.tensors import ParamSpec

_PROBE = 16  # bytes of pattern on each side of a receive's announced end
_MIN_UNDER_CHECK = 8  # below this many bytes the "fewer bytes arrived" check is skipped (false alarms)


class _WireError(Exception):
    """The request cannot describe what is on the wire, so its bytes cannot be received."""


class _SizeMismatch(Exception):
    """A gloo receive got more or fewer bytes than announced; the group itself is still usable."""


def _shm_descriptor(entry) -> dict:
    """Decode one ``wsync_shm`` entry: base64 of a JSON object (never a pickle); _WireError if malformed."""
    import base64
    import binascii
    import json

    if not isinstance(entry, str):
        raise _WireError("the serialized entry must be a base64 string")
    try:
        desc = json.loads(base64.b64decode(entry, validate=True))
    except (binascii.Error, ValueError) as e:
        raise _WireError(f"the serialized entry is not base64 of a JSON object ({e})") from None
    if not isinstance(desc, dict):
        raise _WireError(f"the serialized entry must decode to a JSON object, got {type(desc).__name__}")
    missing = [k for k in ("path", "nbytes", "names", "dtypes", "shapes") if k not in desc]
    if missing:
        raise _WireError(f"the serialized entry lacks {missing}; it needs path, nbytes, names, dtypes, shapes")
    if not isinstance(desc["path"], str) or not desc["path"]:
        raise _WireError(f"'path' must be a non-empty string, got {desc['path']!r}")
    if isinstance(desc["nbytes"], bool) or not isinstance(desc["nbytes"], int) or desc["nbytes"] < 0:
        raise _WireError(f"'nbytes' must be a non-negative integer, got {desc['nbytes']!r}")
    for key in ("names", "dtypes"):
        if not isinstance(desc[key], list) or not all(isinstance(x, str) for x in desc[key]):
            raise _WireError(f"{key!r} must be a list of strings")
    if not isinstance(desc["shapes"], list) or not all(
        isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in desc["shapes"]
    ):
        raise _WireError("'shapes' must be a list of lists of integers")
    return desc


def _shm_roots() -> list[str]:
    import tempfile

    return [os.path.realpath(d) for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def _read_shm(path: str, nbytes: int) -> torch.Tensor:
    """Copy a shared-memory bucket file into a new tensor; _WireError if the file is not acceptable."""
    import mmap
    import stat

    import numpy as np

    real = os.path.realpath(path)
    roots = _shm_roots()
    if not any(real.startswith(r.rstrip("/") + "/") for r in roots):
        raise _WireError(f"path {path!r} is not under {' or '.join(roots)}; shared-memory buckets must live there")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise _WireError(f"cannot open {path!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _WireError(f"{path!r} is not a regular file")
        if st.st_size != nbytes:
            raise _WireError(f"{path!r} holds {st.st_size} bytes, but nbytes and names/dtypes/shapes say {nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as mm:
                view = np.frombuffer(mm, dtype=np.uint8)
                out.numpy()[:] = view
                del view
        return out
    finally:
        os.close(fd)


def _wire_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[ParamSpec]:
    """What the trainer says it broadcasts; _WireError when that cannot be known."""
    if not len(names) == len(dtypes) == len(shapes):
        raise _WireError(f"names, dtypes and shapes have different lengths ({len(names)}, {len(dtypes)}, {len(shapes)})")
    specs = []
    for n, d, s in zip(names, dtypes, shapes):
        dt = getattr(torch, d, None) if isinstance(d, str) and not d.startswith("_") else None
        if not isinstance(dt, torch.dtype):
            raise _WireError(
                f"tensor {n!r} has dtype {d!r}, which is not a torch dtype name; send the bare name such as "
                "'bfloat16' (SGLang resolves dtypes with getattr(torch, name))"
            )
        if any(x < 0 for x in s):
            raise _WireError(f"tensor {n!r} has a negative dimension in shape {s}")
        specs.append(ParamSpec(n, tuple(s), dt))
    return specs


def _receive_nccl(pg, specs: list[ParamSpec], flattened: bool) -> list[tuple[str, torch.Tensor]]:
    """NCCL receives exactly as SGLang does (NCCL needs equal counts and dtypes on every rank, so no slack
    and no byte-size check), on the current CUDA device, then copies to the CPU model."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if flattened:
        buf = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=0, group=pg)
        return unflatten_bucket(buf.cpu(), specs)
    out = []
    for s in specs:
        t = torch.empty(s.shape, dtype=s.dtype, device=dev)
        dist.broadcast(t, src=0, group=pg)
        out.append((s.name, t.cpu()))
    return out


def _recv_bytes(pg, nbytes: int, seed: int, what: str) -> torch.Tensor:
    """Receive one broadcast of ``nbytes`` bytes into a slack buffer; _SizeMismatch if the size differs."""
    slack = max(nbytes, 4096)
    buf = torch.empty(nbytes + slack, dtype=torch.uint8)
    lo = max(0, nbytes - _PROBE)
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    pattern = torch.randint(0, 256, (nbytes + _PROBE - lo,), dtype=torch.uint8, generator=g)
    buf[lo : nbytes + _PROBE] = pattern
    dist.broadcast(buf, src=0, group=pg)
    if not torch.equal(buf[nbytes : nbytes + _PROBE], pattern[nbytes - lo :]):
        raise _SizeMismatch(f"{what}: the trainer broadcast more than the {nbytes} bytes its names/dtypes/shapes announce")
    if nbytes >= _MIN_UNDER_CHECK and torch.equal(buf[lo:nbytes], pattern[: nbytes - lo]):
        raise _SizeMismatch(f"{what}: the trainer broadcast fewer than the {nbytes} bytes its names/dtypes/shapes announce")
    return buf[:nbytes]
