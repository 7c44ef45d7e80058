"""``wsync serve``: the reference server (SGLang's HTTP protocol, a transformers model on CPU).

Its web stack (FastAPI, uvicorn) is the ``server`` extra; without it this module does not import, and
the command line says which extra to install.
"""

from __future__ import annotations

import argparse
import socket

from bridge.errors import ConfigError
from inference_adapter.server import add_server_arguments
from inference_adapter.server import run as serve


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p)


def run(args: argparse.Namespace) -> int:
    check_port_free(args.host, args.port)  # before the model loads, which takes a while
    return serve(args)


def require_server_stack() -> None:
    """For commands that start reference servers: fail now, naming the extra, rather than in a server."""
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401


def check_port_free(host: str, port: int) -> None:
    """Raises ConfigError naming the port and the fix when nothing could listen on ``host:port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({e.strerror}): another server (an earlier `wsync serve`?) holds "
                f"it; pass --port with a free port, or stop that process (`ss -ltnp 'sport = :{port}'` names it)"
            ) from e
