"""Start an inference server as a subprocess: real SGLang on a CUDA host, the reference server elsewhere.

Example:
    >>> with launch_server(preset="tiny") as s:                          # doctest: +SKIP
    ...     s.client.generate(text="hello", sampling_params={"temperature": 0, "max_new_tokens": 4})["text"]
"""

from __future__ import annotations

import importlib.util
import os
import signal
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

__all__ = ["LaunchedServer", "launch_server", "sglang_available"]

logger = get_logger(__name__)
CHECKOUT = str(Path(__file__).resolve().parent.parent)  # the checkout, so the child imports this code


def sglang_available() -> bool:
    """True when ``sglang`` is importable and CUDA is available (what real SGLang needs)."""
    if importlib.util.find_spec("sglang") is None:
        return False
    import torch

    return torch.cuda.is_available()


class LaunchedServer:
    """A running server process: ``url``, ``client``, ``process``, ``log_path``, ``kind`` (``"sglang"`` or ``"reference"``)."""

    def __init__(self, process: subprocess.Popen, url: str, client: ServerClient, log_path: str, kind: str, log_file):
        self.process, self.url, self.client, self.log_path, self.kind = process, url, client, log_path, kind
        self._log_file = log_file

    def __repr__(self) -> str:
        return f"LaunchedServer({self.kind} {self.url}, pid {self.process.pid})"

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it if it is still there after ``timeout`` seconds."""
        if self.process.poll() is None:
            _signal_group(self.process, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.process, signal.SIGKILL)
                self.process.wait(timeout=timeout)
        self.client.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the server runs in its own session; SGLang has child processes
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


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
        model: HF model directory. ``preset``: a :mod:`bridge.presets` name, used when ``model`` is None
            (for SGLang, the preset is first written to a temporary directory).
        port: default: a free port. ``host``: address to listen on and to reach the server at.
        dtype: serving dtype. ``extra_args``: more command-line flags for the server.
        use_sglang: True forces real SGLang, False the reference server, None picks SGLang when it is
            importable and CUDA is available.
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
    port = port or find_free_port(host)
    cmd = server_command(sglang, model, preset, host, port, dtype, disk_roots) + [str(a) for a in extra_args]
    kind = "sglang" if sglang else "reference"
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"wsync-{kind}-{port}-", suffix=".log")
        os.close(fd)
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join([CHECKOUT, *filter(None, [child_env.get("PYTHONPATH")])])
    child_env.update(env or {})
    log_file = open(log_path, "ab")
    logger.info("starting %s server on %s:%d (log %s)", kind, host, port, log_path)
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                            cwd=CHECKOUT if not sglang else None)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    server = LaunchedServer(proc, url, ServerClient(url, api_key=api_key, timeout=60.0), log_path, kind, log_file)
    wait_until_ready(server, ready_timeout)
    logger.info("%s server ready at %s", kind, url)
    return server


def server_command(sglang: bool, model: str | None, preset: str | None, host: str, port: int, dtype: str,
             disk_roots: Sequence[str]) -> list[str]:
    """The command line that starts real SGLang (a preset is first written to a temporary directory) or
    the reference server."""
    if sglang:
        if model is None:
            from bridge.presets import make_model_dir

            model = make_model_dir(tempfile.mkdtemp(prefix=f"wsync-{preset}-"), preset)
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port),
                "--dtype", dtype]
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
