"""The serving side: an HTTP client for SGLang's weight-update API, a launcher, and the reference server.

``ServerClient``/``ServerGroup`` live in :mod:`bridge.client` (the publisher uses them) and are re-exported
here. The reference server is ``python -m inference_adapter.server``; :func:`launch_server` starts it, or
real SGLang on a CUDA host, as a subprocess; :class:`DiskWatcher` loads each version announced in name resolution.
"""

from bridge.client import ServerClient, ServerGroup
from inference_adapter.launcher import LaunchedServer, launch_server, sglang_available
from inference_adapter.watcher import DiskWatcher

__all__ = ["DiskWatcher", "LaunchedServer", "ServerClient", "ServerGroup", "launch_server", "sglang_available"]
