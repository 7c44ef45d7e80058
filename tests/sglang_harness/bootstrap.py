"""Put one SGLang version's own code on ``sys.path`` of this process (run before importing ``sglang``).

``setup(dir)`` prepends ``dir`` (a ``pip install --no-deps --target`` of one SGLang wheel, see
``scripts/install_sglang.sh``) and the stand-ins, then patches the few module-level expectations an older
SGLang has of newer/older torch and triton (each named below). Nothing here changes SGLang's code.
"""

from __future__ import annotations

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The torchvision stand-in of real SGLang on CPU (every version; its strict sgl_kernel is shadowed by STUBS_KERNEL
# on the releases that need the inert one).
STUBS = os.path.join(ROOT, "inference_adapter", "sglang_cpu")
STUBS_KERNEL = os.path.join(HERE, "stubs_kernel")  # sgl_kernel / vllm stand-ins (versions that import them)


def release_of(sglang_dir: str) -> tuple[int, int, int]:
    m = re.search(r"sglang-(\d+)\.(\d+)\.(\d+)", os.path.basename(os.path.normpath(sglang_dir)))
    if not m:
        raise ValueError(f"cannot tell the SGLang version of {sglang_dir!r} (expected .../sglang-X.Y.Z)")
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


def setup(sglang_dir: str, cuda: bool = False) -> tuple[int, int, int]:
    """Make ``import sglang`` load the copy in ``sglang_dir``; returns its release tuple.

    ``cuda``: this process keeps the host's GPUs (the CUDA IPC check of ``ipc_payload cuda``), so SGLang's
    import-time probes see CUDA and its CUDA-only imports need the kernel stand-ins on every release."""
    rel = release_of(sglang_dir)
    paths = [sglang_dir] + ([STUBS_KERNEL] if rel < (0, 5, 23) or cuda else []) + [STUBS]
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    if not cuda:  # the harness runs on CPU: SGLang must not look for a GPU
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if rel < (0, 5, 0):
        _shim_old_sglang()
    if rel < (0, 5, 2):
        _shim_amx_probe()
    return rel


def _shim_old_sglang() -> None:
    """SGLang 0.4.x imports names that today's triton no longer has."""
    import triton.runtime.cache as cache

    # triton >= 3.4 dropped these helpers; 0.4.x imports them (only used for triton's cache paths).
    for name, sub in (("default_cache_dir", "cache"), ("default_dump_dir", "dump"), ("default_override_dir", "override")):
        if not hasattr(cache, name):
            setattr(cache, name, lambda s=sub: os.path.join(os.path.expanduser("~"), ".triton", s))


def _shim_amx_probe() -> None:
    """torch 2.13 renamed its AMX probe; SGLang 0.4.x-0.5.1 call it at import unguarded (0.5.2 wraps it in a
    try). No AMX: SGLang takes its plain CPU path."""
    import torch

    if not hasattr(torch._C._cpu, "_is_amx_tile_supported"):
        torch._C._cpu._is_amx_tile_supported = lambda: False
