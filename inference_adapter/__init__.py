"""The serving side: the reference server, the launcher, and the disk watcher.

The reference server (``wsync serve``, ``python -m inference_adapter.server``) speaks SGLang's
weight-update protocol around a transformers model on CPU, swapping each update atomically;
:func:`launch_server` starts it, or real SGLang on a CUDA host, as a subprocess; :class:`DiskWatcher`
loads each version announced in name resolution into every server. The HTTP client
(``ServerClient``/``ServerGroup``) lives in :mod:`bridge.client`, shared with the publisher, and is
re-exported here.

Each name is imported when first used, so a process that needs only the watcher (``wsync watch``) does not
import torch for the launcher.
"""

import importlib

_HOMES = {"ServerClient": "bridge.client", "ServerGroup": "bridge.client", "LaunchedServer": "inference_adapter.launcher",
          "launch_server": "inference_adapter.launcher", "sglang_available": "inference_adapter.launcher",
          "DiskWatcher": "inference_adapter.watcher"}

__all__ = ["DiskWatcher", "LaunchedServer", "ServerClient", "ServerGroup", "launch_server", "sglang_available"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'inference_adapter' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
