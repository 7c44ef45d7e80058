"""The CPU work per tensor in one pass: the delta's diff, its gap records (written by the trainer, read and applied by
the servers) and the block FP8 quantization, in a small C library
(``kernels.c`` beside this file) built once per machine with the C compiler it has and loaded with :mod:`ctypes`.

The plain way to diff a piece (cast it to the serving dtype, compare it with the base, take the positions, then the
values there) reads and writes each element in four passes; :func:`diff` reads the piece and the base once and writes
only what differs. Quantizing a block row in torch takes six passes (cast, absmax, scale, cast back, multiply, cast to
e4m3); :func:`quantize_blocks` takes two, the second from cache. The results are the same bits: the casts are torch's
(bf16: its vectorized one, round to nearest even, NaN as 0xFFFF; e4m3fn: round to nearest even, saturated), and the
tests compare both ways on every kind of float.

Built at the first :func:`available` (a delta or FP8 encoding calls it when it is made, before any publish, and the
reference server at its start, for the gap records it applies), in a
fraction of a second, into ``$WSYNC_KERNEL_CACHE`` (default ``~/.cache/wsync/kernels``) under a name that hashes the
source, the compiler and its flags, so a process that finds it there only loads it. The compiler is ``$CC``, else
``cc``, else ``gcc``. Without one, or with ``WSYNC_KERNELS=0``, the same work runs in torch; one log line says so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bridge.codecs.diff import INTS
from bridge.log import get_logger

__all__ = ["available", "diff", "gaps_apply", "gaps_count", "gaps_escapes", "gaps_write", "quantize_blocks", "room"]

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
"""Every build's flags; :func:`_flags` adds AVX2 where the CPU has it (its loops then take 8 floats at a time)."""
_THREAD_MIN = 1 << 21
"""Elements below which a piece is diffed by one thread (a thread's start costs more than it saves)."""


def room(n: int) -> int:
    """Entries :func:`diff` needs for a piece of ``n`` elements: up to a quarter of them changed (more is rare between
    two syncs, and such a piece is diffed the plain way)."""
    return n // 4 + 1


def _threads(n: int) -> int:
    return max(1, min(torch.get_num_threads(), n // _THREAD_MIN))


def _cache_dir() -> Path:
    root = os.environ.get("WSYNC_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wsync" / "kernels"


def _flags() -> tuple[str, ...]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return FLAGS
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        return FLAGS
    return (*FLAGS, "-mavx2") if re.search(r"^flags\s*:.*\bavx2\b", cpu, re.M) else FLAGS


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("WSYNC_KERNELS", "1") == "0":
        logger.info("WSYNC_KERNELS=0: the delta diff and the FP8 quantization run in torch")
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler ($CC, cc or gcc): the delta diff and the FP8 quantization run in torch, "
                       "several passes per tensor; install gcc for the one-pass kernels")
        return None
    source = SOURCE.read_bytes()
    flags = _flags()  # (in the name: a machine whose CPU lacks AVX2 builds its own, even in a shared cache)
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(), platform.machine().encode(),
                                     _version(cc)])).hexdigest()[:16]
    path = _cache_dir() / f"wsync_kernels-{key}.so"
    try:
        if not path.exists():
            _build(cc, flags, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning(f"the one-pass kernels did not build ({e}): the delta diff and the FP8 quantization run in torch")
        return None
    for name in ("wsync_diff_f32_bf16", *(f"wsync_diff_same_{w}" for w in (1, 2, 4, 8))):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.wsync_gaps_count.restype = ctypes.c_int64
    lib.wsync_gaps_count.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.wsync_gaps_apply.restype = None
    lib.wsync_gaps_apply.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p]
    lib.wsync_gaps_escapes.restype = None
    lib.wsync_gaps_escapes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.wsync_gaps_write.restype = ctypes.c_int64
    lib.wsync_gaps_write.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.wsync_quantize_blocks.restype = None
    lib.wsync_quantize_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _version(cc: str) -> bytes:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _build(cc: str, flags: tuple[str, ...], path: Path) -> None:
    """Compile into a temporary file beside ``path``, then rename it into place: ranks that build at once each get a
    whole library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise OSError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-300:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info(f"built the one-pass kernels (delta diff, FP8 quantization) in {time.perf_counter() - t0:.2f} s: {path}")


def available() -> bool:
    """Whether :func:`diff` runs the C kernel (building it now if this machine has none yet)."""
    return _library() is not None


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="wsync-diff")


def _each_part(fn, parts: int) -> list:
    """``fn(i)`` for each part ``i``: here for one, else on the pool's threads (ctypes lets go of the GIL)."""
    return [fn(0)] if parts == 1 else list(_pool().map(fn, range(parts)))


def _cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is one the kernels can read or write: contiguous, on the CPU."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _kernel(new: torch.Tensor, base: torch.Tensor):
    lib = _library()
    if lib is None or not _cpu(new, base):
        return None
    if new.dtype == base.dtype:
        return getattr(lib, f"wsync_diff_same_{base.element_size()}", None)
    if new.dtype == torch.float32 and base.dtype == torch.bfloat16:
        return lib.wsync_diff_f32_bf16
    return None


def diff(new: torch.Tensor, base: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, old: torch.Tensor,
         write: bool = False):
    """(int64 positions, values, old values) of the elements where ``new`` cast to ``base``'s dtype differs from
    ``base`` bit for bit: positions increasing, ``new``'s values and ``base``'s there, views into the scratch
    ``positions`` (int64), ``values`` and ``old`` (``base``'s dtype), each of :func:`room` entries at least; with
    ``write``, ``base`` takes the new values there in the same pass. None, ``base`` as it was, where the kernel does
    not apply (not built, not on the CPU, not contiguous, a cast other than float32 to bfloat16, or more than a quarter
    of the piece changed): diff it the plain way."""
    fn = _kernel(new, base)
    n = new.numel()
    if fn is None or base.numel() != n or min(positions.numel(), values.numel(), old.numel()) < room(n):
        return None
    parts = _threads(n)
    bounds = [n * i // parts for i in range(parts + 1)]
    cap = (positions.numel() // parts) if parts > 1 else positions.numel()
    width = base.element_size()

    def diff_part(i: int) -> int:
        lo, hi = bounds[i], bounds[i + 1]
        return fn(new.data_ptr() + lo * new.element_size(), base.data_ptr() + lo * width, hi - lo, lo,
                  positions.data_ptr() + i * cap * 8, values.data_ptr() + i * cap * width,
                  old.data_ptr() + i * cap * width, cap, int(write))

    counts = _each_part(diff_part, parts)
    if min(counts) < 0:
        if write:  # (a part that gave up put its own back; the others wrote theirs)
            bits = base.view(INTS[width])
            for i, c in enumerate(counts):
                if c > 0:
                    bits.index_copy_(0, positions[i * cap: i * cap + c], old[i * cap: i * cap + c].view(bits.dtype))
        return None
    if parts == 1:
        return positions[: counts[0]], values[: counts[0]], old[: counts[0]]
    return tuple(torch.cat([t[i * cap : i * cap + c] for i, c in enumerate(counts)]) for t in (positions, values, old))


_SERVED = {torch.float32: 0, torch.bfloat16: 1}


def quantize_blocks(rows: torch.Tensor, served: torch.dtype, out: torch.Tensor, grid: torch.Tensor, take: bool,
                    floor: float) -> bool:
    """Block-aligned float32 ``rows`` (``[n, k]``, multiples of 128) served as ``served`` (bfloat16 or float32),
    quantized to e4m3fn into ``out`` with one scale per 128x128 block in ``grid`` (``[n / 128, k / 128]`` float32):
    taken here (``take``: ``max(absmax, floor) / 448``) or given. The bytes and scales of
    :func:`bridge.codecs.fp8.block_amax`, :func:`~bridge.codecs.fp8.block_scales` and
    :func:`~bridge.codecs.fp8.quantize_rows`, in two passes per block row instead of six. False, having done nothing,
    where it does not apply (no kernel, not float32 on the CPU, not contiguous, another served dtype)."""
    lib = _library()
    n, k = rows.shape if rows.dim() == 2 else (0, 0)
    if lib is None or rows.dtype != torch.float32 or served not in _SERVED or not n or n % 128 or k % 128 \
            or not _cpu(rows, out, grid) \
            or out.shape != rows.shape or out.element_size() != 1 or grid.dtype != torch.float32 \
            or tuple(grid.shape) != (n // 128, k // 128):
        return False
    blocks = n // 128
    parts = max(1, min(_threads(rows.numel()), blocks))
    bounds = [blocks * i // parts for i in range(parts + 1)]

    def quantize_part(i: int) -> None:
        b0, b1 = bounds[i], bounds[i + 1]
        lib.wsync_quantize_blocks(rows.data_ptr() + b0 * 128 * k * 4, (b1 - b0) * 128, k, _SERVED[served], int(take),
                                  floor, grid.data_ptr() + b0 * (k // 128) * 4, out.data_ptr() + b0 * 128 * k)

    _each_part(quantize_part, parts)
    return True


# ------------------------------------------------------------------ the delta's gap records


def gaps_count(gaps: torch.Tensor, length: int) -> tuple[int, int] | None:
    """(how many positions a gap record's ``gaps`` mark, the last of them or -1 for none), reading from position -1;
    the count is -1 when a position reaches ``length``. ``gaps``: the record's uint8, uint16 or uint32 gaps. None
    without the kernel (or off the CPU): decode them the plain way."""
    lib = _library()
    if lib is None or not _cpu(gaps):
        return None
    last = ctypes.c_int64(-1)
    count = lib.wsync_gaps_count(gaps.data_ptr(), gaps.element_size(), gaps.numel(), length, ctypes.byref(last))
    return count, last.value


def gaps_apply(gaps: torch.Tensor, values: torch.Tensor, target: torch.Tensor) -> bool:
    """Assign ``values`` (in position order) at the positions ``gaps`` mark in ``target`` (the record's piece, flat,
    of the values' item size), in one pass with no positions made; the gaps were checked by :func:`gaps_count`. False,
    having done nothing, without the kernel."""
    lib = _library()
    if lib is None or not _cpu(gaps, values, target) or values.element_size() != target.element_size():
        return False
    lib.wsync_gaps_apply(gaps.data_ptr(), gaps.element_size(), gaps.numel(), values.data_ptr(), values.element_size(),
                         target.data_ptr())
    return True


def gaps_escapes(positions: torch.Tensor) -> tuple[int, int, int] | None:
    """The escapes gaps of 1, 2 and 4 bytes would need between the increasing int64 ``positions`` (read from -1), in
    one pass; None without the kernel."""
    lib = _library()
    if lib is None or positions.dtype != torch.int64 or not _cpu(positions):
        return None
    esc = (ctypes.c_int64 * 3)()
    lib.wsync_gaps_escapes(positions.data_ptr(), positions.numel(), esc)
    return esc[0], esc[1], esc[2]


def gaps_write(positions: torch.Tensor, out: torch.Tensor) -> int | None:
    """The gaps of the increasing int64 ``positions`` (escapes included) written into ``out`` (uint8, uint16 or
    uint32, room for them all: :func:`gaps_escapes` counts the escapes); how many. None without the kernel."""
    lib = _library()
    if lib is None or positions.dtype != torch.int64 or not _cpu(positions, out):
        return None
    return lib.wsync_gaps_write(positions.data_ptr(), positions.numel(), out.element_size(), out.data_ptr())
