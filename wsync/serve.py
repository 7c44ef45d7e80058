"""``wsync serve``: the reference server (SGLang's HTTP protocol, a transformers model on CPU)."""

from __future__ import annotations

import argparse
import socket

from bridge.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from inference_adapter.server import add_server_arguments

    add_server_arguments(p)


def run(args: argparse.Namespace) -> int:
    check_port_free(args.host, args.port)  # before the model loads, which takes a while
    try:
        import fastapi  # noqa: F401  (the server's web stack, an optional extra)
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the reference server needs its web stack ({e}); pip install 'wsync[server]'") from e
    from inference_adapter.server import run as serve

    return serve(args)


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
