"""Wire-level receiving: what an update request announces, and reading its bytes off a group or /dev/shm.

These helpers know nothing of the served model; :mod:`inference_adapter.weight_updates` checks the
announced specs against it and stages what arrives.

Byte-size check (gloo groups; NCCL groups, possible on a CUDA host, receive exactly as SGLang does,
without it): gloo does not tell a receiver how many bytes arrived, and aborts the process when
more arrive than were posted. Each receive therefore posts a buffer with slack beyond the announced
size and pre-fills the bytes around the announced end with a pattern derived from the request; a
changed pattern beyond the end means more bytes came; the last 16 announced bytes still holding the
pattern mean at least 16 fewer came (a smaller shortfall, or a receive under 8 bytes, goes unnoticed).
The slack is a reserve as large as the host's physical memory, mapped without backing (pages exist only
once written), so a sender that overruns it would have exhausted the host's memory anyway; below that,
a wrong trainer gets a 400 instead of aborting the server. Each receive is bounded in time
(:func:`receive_bound`); a receive that times out leaves the group unusable.

Shared memory (``load_format="wsync_shm"``): each entry is base64 of a JSON object (never a pickle)
naming a regular file under /dev/shm (or the temp dir) that holds one flattened bucket.

Used by :mod:`inference_adapter.weight_updates` (every update) and :mod:`inference_adapter.bench_routes`
(the raw floor); the slack buffer and the shm roots stay private.
"""

from __future__ import annotations

import datetime
import hashlib
import mmap
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from bridge.buckets import unflatten_bucket
from bridge.errors import ConfigError
from bridge.tensors import ParamSpec

__all__ = ["ReceiveTimeout", "SizeMismatch", "WireError", "read_shm", "receive_bound", "receive_tensors", "recv_bytes",
           "shm_descriptor", "wire_specs"]

_PROBE = 16  # bytes of pattern on each side of a receive's announced end
_MIN_UNDER_CHECK = 8  # below this many bytes the "fewer bytes arrived" check is skipped (false alarms)
_MIN_RATE = 50e6  # bytes/s: the slowest transfer the receive bound allows for, beyond --receive-timeout
_RELAY_SLACK = 64 << 10  # the slack of a receive in a group of more than two servers (see _slack_buffer)
# Linux's MAP_NORESERVE (Python's mmap module names it only from 3.12 on): no swap/commit accounting.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class WireError(Exception):
    """The request cannot describe what is on the wire, so its bytes cannot be received."""


class SizeMismatch(Exception):
    """A gloo receive got more or fewer bytes than announced; the group itself is still usable."""


class ReceiveTimeout(Exception):
    """The announced bytes did not all arrive within the receive bound; the group is unusable."""


def receive_bound(nbytes: int, receive_timeout: float, group_timeout: float) -> float:
    """Seconds one receive of ``nbytes`` may take: ``receive_timeout`` plus the size at 50 MB/s, at most
    ``group_timeout``. Bytes that never come then block other weight operations only this long."""
    return min(group_timeout, receive_timeout + nbytes / _MIN_RATE)


def shm_descriptor(entry) -> dict:
    """Decode one ``wsync_shm`` entry: base64 of a JSON object (never a pickle); WireError if malformed."""
    import base64
    import binascii
    import json

    if not isinstance(entry, str):
        raise WireError("the serialized entry must be a base64 string")
    try:
        desc = json.loads(base64.b64decode(entry, validate=True))
    except (binascii.Error, ValueError) as e:
        raise WireError(f"the serialized entry is not base64 of a JSON object ({e})") from None
    if not isinstance(desc, dict):
        raise WireError(f"the serialized entry must decode to a JSON object, got {type(desc).__name__}")
    missing = [k for k in ("path", "nbytes", "names", "dtypes", "shapes") if k not in desc]
    if missing:
        raise WireError(f"the serialized entry lacks {missing}; it needs path, nbytes, names, dtypes, shapes")
    if not isinstance(desc["path"], str) or not desc["path"]:
        raise WireError(f"'path' must be a non-empty string, got {desc['path']!r}")
    if isinstance(desc["nbytes"], bool) or not isinstance(desc["nbytes"], int) or desc["nbytes"] < 0:
        raise WireError(f"'nbytes' must be a non-negative integer, got {desc['nbytes']!r}")
    for key in ("names", "dtypes"):
        if not isinstance(desc[key], list) or not all(isinstance(x, str) for x in desc[key]):
            raise WireError(f"{key!r} must be a list of strings")
    if not isinstance(desc["shapes"], list) or not all(
        isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in desc["shapes"]
    ):
        raise WireError("'shapes' must be a list of lists of integers")
    return desc


def _shm_roots() -> list[str]:
    import tempfile

    return [os.path.realpath(d) for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def read_shm(path: str, nbytes: int) -> torch.Tensor:
    """Copy a shared-memory bucket file into a new tensor; WireError if the file is not acceptable."""
    import stat

    import numpy as np

    real = os.path.realpath(path)
    roots = _shm_roots()
    if not any(real.startswith(r.rstrip("/") + "/") for r in roots):
        raise WireError(f"path {path!r} is not under {' or '.join(roots)}; shared-memory buckets must live there")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below as not a regular file).
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise WireError(f"cannot open {path!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WireError(f"{path!r} is not a regular file")
        if st.st_size != nbytes:
            raise WireError(f"{path!r} holds {st.st_size} bytes, but nbytes and names/dtypes/shapes say {nbytes}")
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as mm:
                view = np.frombuffer(mm, dtype=np.uint8)
                out.numpy()[:] = view
                del view
        return out
    finally:
        os.close(fd)


def wire_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[ParamSpec]:
    """What the trainer says it broadcasts; WireError when that cannot be known."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WireError(f"names, dtypes and shapes have different lengths ({len(names)}, {len(dtypes)}, {len(shapes)})")
    specs = []
    for n, d, s in zip(names, dtypes, shapes):
        dt = getattr(torch, d, None) if isinstance(d, str) and not d.startswith("_") else None
        if not isinstance(dt, torch.dtype):
            raise WireError(
                f"tensor {n!r} has dtype {d!r}, which is not a torch dtype name; send the bare name such as "
                "'bfloat16' (SGLang resolves dtypes with getattr(torch, name))"
            )
        if any(x < 0 for x in s):
            raise WireError(f"tensor {n!r} has a negative dimension in shape {s}")
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


def receive_tensors(pg, specs: list[ParamSpec], flattened: bool, *, tag: str, nccl: bool,
                    bound: Callable[[int], float]) -> list[tuple[str, torch.Tensor]]:
    """The announced tensors off group ``pg``: on NCCL as SGLang receives, on gloo with the byte-size check
    (:func:`recv_bytes`, each receive bounded by ``bound(nbytes)`` seconds). An unaligned bucket, which the
    caller has already reported, yields nothing. ``tag`` (the same on every server of the group) seeds
    the pattern: gloo relays a receiver's whole buffer, slack included, to the next receiver of a tree."""
    try:
        if nccl:
            return _receive_nccl(pg, specs, flattened)
        seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
        if flattened:
            nbytes = sum(s.nbytes for s in specs)
            return unflatten_bucket(recv_bytes(pg, nbytes, seed, "the flattened bucket", bound(nbytes)), specs)
        out = []
        for i, s in enumerate(specs):
            buf = recv_bytes(pg, s.nbytes, seed + i, f"tensor {s.name!r}", bound(s.nbytes))
            out.append((s.name, buf.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)))
        return out
    except ConfigError:  # unaligned bucket
        return []


def recv_bytes(pg, nbytes: int, seed: int, what: str, timeout: float, keep: bool = True) -> torch.Tensor | None:
    """Receive one broadcast of ``nbytes`` bytes into a slack buffer; SizeMismatch if the size differs,
    ReceiveTimeout if it has not all arrived after ``timeout`` seconds. ``keep=False`` drops the bytes
    (the bench's raw floor). Callers hold the server's update lock.

    A kept receive of at least :data:`_OWN_MAPPING_BYTES` lands in a slack mapping of its own, and the
    returned tensor is a view of it: the bytes are staged where they arrived, with no copy (fresh pages
    cost less than the reused buffer plus the copy out of it). Smaller ones reuse one shared buffer and are copied out, so a model of
    many small tensors does not hold a mapping per tensor.
    """
    own = keep and nbytes >= _OWN_MAPPING_BYTES
    buf = _slack_buffer(nbytes, own=own, relayed=pg.size() > 3)
    lo = max(0, nbytes - _PROBE)
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    pattern = torch.randint(0, 256, (nbytes + _PROBE - lo,), dtype=torch.uint8, generator=g)
    buf[lo : nbytes + _PROBE] = pattern
    # gloo itself gives up at the bound too, not at the group's timeout: a receive left waiting in gloo makes
    # whichever thread lets go of the dropped group last (the garbage collector's, in a generation) wait for it.
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, datetime.timedelta(seconds=timeout)
    work = pg.broadcast([buf], opts)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        _drop_reserve()  # gloo may still write into it until its own bound
        if "timed out" not in str(e).lower():
            raise
        raise ReceiveTimeout(f"{what}: the {nbytes} announced bytes did not arrive within {timeout:g} s (the receive "
                              "bound: --receive-timeout plus the size at 50 MB/s)") from None
    if not torch.equal(buf[nbytes : nbytes + _PROBE], pattern[nbytes - lo :]):
        _drop_reserve()  # give back the memory the extra bytes took
        raise SizeMismatch(f"{what}: the trainer broadcast more than the {nbytes} bytes its names/dtypes/shapes announce")
    if nbytes >= _MIN_UNDER_CHECK and torch.equal(buf[lo:nbytes], pattern[: nbytes - lo]):
        raise SizeMismatch(f"{what}: the trainer broadcast fewer than the {nbytes} bytes its names/dtypes/shapes announce")
    if not keep:
        return None
    return buf[:nbytes] if own else buf[:nbytes].clone()  # a shared buffer is reused by the next receive


_reserve: torch.Tensor | None = None  # see _slack_buffer; receives run one at a time, under the update lock
_OWN_MAPPING_BYTES = 1 << 20


def _slack_buffer(nbytes: int, own: bool = False, relayed: bool = False) -> torch.Tensor:
    """``nbytes`` plus a reserve as large as physical memory, in one lazily backed mapping (only written
    pages cost memory) that every receive reuses, so its pages are faulted in once; ``own=True``: a new
    mapping of that size for this receive only (it lives as long as the tensors viewing it).

    gloo aborts the process when more bytes arrive than were posted; the reserve makes that need more
    bytes than the host could hold. Where the kernel refuses such a mapping (strict overcommit), the
    reserve is ``nbytes`` (at least 4 KiB) of ordinary memory.

    ``relayed``: in a group of more than two servers gloo's broadcast is a tree, and a server passes its
    whole posted buffer on to the next one, reserve included: a reserve of physical memory would then be
    written, page by page, into the next server's memory. Such a receive gets :data:`_RELAY_SLACK` of
    ordinary memory instead (a trainer that broadcasts more than that beyond its announcement aborts it).
    """
    global _reserve
    if relayed:
        return torch.empty(nbytes + _RELAY_SLACK, dtype=torch.uint8)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def mapping(size: int) -> torch.Tensor | None:
        try:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            return torch.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=torch.uint8)
        except (OSError, ValueError):
            return None

    if nbytes <= physical:
        if own:
            buf = mapping(nbytes + physical)
        else:
            _reserve = _reserve if _reserve is not None else mapping(2 * physical)
            buf = _reserve[: nbytes + physical] if _reserve is not None else None
        if buf is not None:
            return buf
    return torch.empty(nbytes + max(nbytes, 4096), dtype=torch.uint8)


def _drop_reserve() -> None:
    """Forget the shared mapping (unmapped once nothing uses it); the next receive maps a fresh one."""
    global _reserve
    _reserve = None
