"""A throw-away etcd for one benchmark run: free loopback ports, a temporary data directory, stopped at the end.

Example:
    >>> etcd = LocalEtcd.start_if_available(tempfile.mkdtemp())   # doctest: +SKIP
    >>> etcd.url if etcd else "no etcd binary"                    # doctest: +SKIP
    'etcd://127.0.0.1:40123'
    >>> etcd.stop()                                               # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

from bridge.errors import ConfigError
from bridge.process_group import find_free_port

__all__ = ["LocalEtcd"]


class LocalEtcd:
    """An ``etcd`` process serving ``url`` (``etcd://127.0.0.1:PORT``) until :meth:`stop`."""

    def __init__(self, binary: str, workdir: str) -> None:
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="etcd-", dir=workdir)
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self.client_port, self.peer_port = find_free_port(), find_free_port()
        self.url = f"etcd://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start_if_available(cls, workdir: str, timeout: float = 30.0) -> LocalEtcd | None:
        """Start one when an ``etcd`` binary is on PATH; None (nothing started) otherwise."""
        binary = shutil.which("etcd")
        if binary is None:
            return None
        etcd = cls(binary, workdir)
        etcd.start(timeout)
        return etcd

    def start(self, timeout: float = 30.0) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary, "--name", "bench", "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bench={peer}",
            # A faster election makes start-up quicker; nothing here needs etcd's default timings.
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"etcd exited with code {self.proc.returncode} at start-up; see {self.log_path} "
                                  "(or run the benchmark with --no-etcd)")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise ConfigError(f"etcd was not healthy within {timeout:g} s; see {self.log_path} (or use --no-etcd)")

    def stop(self) -> None:
        """Stop the process and delete its data directory."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
