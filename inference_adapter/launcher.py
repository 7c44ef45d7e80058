"""Start an inference server as a subprocess: the reference server, or real SGLang (on a CUDA host by default;
on any host with ``use_sglang=True``, :mod:`inference_adapter.real_sglang`).

Example:
    >>> with launch_server(preset="tiny") as s:                          # doctest: +SKIP
    ...     s.client.generate(text="hello", sampling_params={"temperature": 0, "max_new_tokens": 4})["text"]
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bridge.client import ServerClient
from bridge.errors import ServerError, SyncTimeout
from bridge.log import get_logger
from bridge.process_group import find_free_port
from inference_adapter.launched import LaunchedServer

__all__ = ["LaunchedServer", "launch_server", "sglang_available"]

logger = get_logger(__name__)
CHECKOUT = str(Path(__file__).resolve().parent.parent)  # the checkout, so the child imports this code


def sglang_available() -> bool:
    """True when ``sglang`` is importable and CUDA is available (what real SGLang needs)."""
    if importlib.util.find_spec("sglang") is None:
        return False
    import torch

    return torch.cuda.is_available()


def launch_server(
    model: str | None = None,
    preset: str | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    dtype: str = "bfloat16",
    extra_args: Sequence[str] = (),
    use_sglang: bool | None = None,
    ready_timeout: float = 180.0,
    *,
    api_key: str | None = None,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
    disk_roots: Sequence[str] = (),
) -> LaunchedServer:
    """Start a server and wait until ``/model_info`` answers.

    Args:
        model: HF model directory. ``preset``: a :mod:`bridge.local.presets` name, used when ``model`` is None
            (for SGLang, the preset is first written to a temporary directory).
        port: default: a free port. ``host``: address to listen on and to reach the server at.
        dtype: serving dtype. ``extra_args``: more command-line flags for the server.
        use_sglang: True starts real SGLang (on a host without CUDA, on its CPU engine:
            :func:`inference_adapter.real_sglang.launch_sglang`), False the reference server, None picks SGLang
            when it is importable and CUDA is available.
        ready_timeout: seconds to wait for readiness.
        api_key: for the returned client (pass the server's flag in ``extra_args`` too).
        log_path: file for the server's stdout/stderr (default: a temporary file).
        env: extra environment variables for the server.
        disk_roots: directories the reference server may load snapshots from (``--disk-root``; default:
            wsync's default snapshot root and the model's directory). Real SGLang loads any directory.

    Raises:
        ServerError: the server exited or was not ready in time; the message ends with its log tail.
    """
    if model is None and preset is None:
        preset = "tiny"
    sglang = sglang_available() if use_sglang is None else use_sglang
    if sglang:
        from inference_adapter.real_sglang import launch_sglang

        return launch_sglang(model, preset, port=port, host=host, dtype=dtype, extra_args=extra_args,
                             ready_timeout=ready_timeout, api_key=api_key, log_path=log_path, env=env)
    port = port or find_free_port(host)
    cmd = server_command(model, preset, host, port, dtype, disk_roots) + [str(a) for a in extra_args]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"wsync-reference-{port}-", suffix=".log")
        os.close(fd)
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join([CHECKOUT, *filter(None, [child_env.get("PYTHONPATH")])])
    child_env.update(env or {})
    log_file = open(log_path, "ab")
    logger.info("starting the reference server on %s:%d (log %s)", host, port, log_path)
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                            cwd=CHECKOUT)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    server = LaunchedServer(proc, url, ServerClient(url, api_key=api_key, timeout=60.0), log_path, "reference", log_file)
    wait_until_ready(server, ready_timeout)
    logger.info("reference server ready at %s", url)
    return server


def server_command(model: str | None, preset: str | None, host: str, port: int, dtype: str,
                   disk_roots: Sequence[str]) -> list[str]:
    """The command line that starts the reference server (real SGLang's: :func:`inference_adapter.real_sglang.sglang_command`)."""
    cmd = [sys.executable, "-m", "inference_adapter.server", "--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--model", model] if model is not None else ["--preset", preset]
    for root in disk_roots:
        cmd += ["--disk-root", str(root)]
    return cmd


def wait_until_ready(server: LaunchedServer, ready_timeout: float) -> None:
    """Wait until the server's ``/model_info`` answers; stop it and raise ServerError (with its log tail)
    if it exits, wants an API key, or is not ready within ``ready_timeout`` seconds."""
    url, kind, proc = server.url, server.kind, server.process
    deadline = time.monotonic() + ready_timeout
    while True:
        if proc.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise ServerError(url, f"{kind} server exited with code {proc.returncode} before it was ready; "
                                   f"log {server.log_path}:\n{tail}")
        try:
            server.client.model_info()
            return
        except (SyncTimeout, ServerError) as e:
            if isinstance(e, ServerError) and e.status == 401:
                server.stop()
                raise ServerError(url, "the server wants an API key; pass api_key= to launch_server", 401) from e
            if time.monotonic() > deadline:
                tail = server.log_tail()
                server.stop()
                raise ServerError(url, f"{kind} server not ready within {ready_timeout:g} s; log {server.log_path}:\n"
                                       f"{tail}") from e
        time.sleep(0.2)
