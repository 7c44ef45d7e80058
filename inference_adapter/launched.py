"""A server process this package started: its URL, client, log, and how it is stopped (by its process group)."""

from __future__ import annotations

import os
import signal
import subprocess

from bridge.client import ServerClient

__all__ = ["LaunchedServer"]


class LaunchedServer:
    """A running server process: ``url``, ``client``, ``process``, ``log_path``, ``kind`` (``"sglang"`` or ``"reference"``)."""

    def __init__(self, process: subprocess.Popen, url: str, client: ServerClient, log_path: str, kind: str, log_file,
                 stop_signal: int = signal.SIGTERM):
        self.process, self.url, self.client, self.log_path, self.kind = process, url, client, log_path, kind
        self._log_file = log_file
        self.stop_signal = stop_signal
        """What :meth:`stop` sends first (real SGLang: SIGINT, as Ctrl-C; its SIGTERM handler waits 5 s more)."""

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
        """Signal the server's process group (:attr:`stop_signal`), SIGKILL it if it is still there after ``timeout``
        seconds."""
        if self.process.poll() is None:
            _signal_group(self.process, self.stop_signal)
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
