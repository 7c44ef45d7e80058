"""The serving side: the reference server, the launcher, and the disk watcher.

The reference server (``wsync serve``, ``python -m inference_adapter.server``) speaks SGLang's
weight-update protocol around a transformers model on CPU, swapping each update atomically;
:func:`launch_server` starts it, or real SGLang on a CUDA host, as a subprocess; :class:`DiskWatcher`
loads each version announced in name resolution into every server. The HTTP client
(``ServerClient``/``ServerGroup``) lives in :mod:`bridge.client`, shared with the publisher, and is
re-exported here.
"""

from bridge.client import ServerClient, ServerGroup
from inference_adapter.launcher import LaunchedServer, launch_server, sglang_available
from inference_adapter.watcher import DiskWatcher

__all__ = ["DiskWatcher", "LaunchedServer", "ServerClient", "ServerGroup", "launch_server", "sglang_available"]
