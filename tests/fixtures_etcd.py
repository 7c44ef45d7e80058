"""A real etcd server for the tests (pytest plugin, listed in tests/conftest.py).

``etcd_server`` (session scope) starts the ``etcd`` binary on free loopback ports with a temporary data
directory and yields an ``EtcdServer`` with ``.url`` (``etcd://127.0.0.1:P``), ``.stop()``, ``.start()``
and ``.restart()`` (same ports, same data, so keys and leases survive). Tests that restart it must leave
it running. Without the binary the dependent tests are skipped with the install hint.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

INSTALL_HINT = "etcd binary not found; install it with `apt-get install etcd-server` (scripts/test.sh does)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    def __init__(self, binary: str, data_dir: str, log_path: str) -> None:
        self.binary, self.data_dir, self.log_path = binary, data_dir, log_path
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.url = f"etcd://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        assert self.proc is None, "etcd is already running"
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary, "--name", "t", "--data-dir", self.data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"t={peer}",
            # A faster election makes start-up and restarts quicker; the minimum lease TTL becomes 1 s.
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip(INSTALL_HINT)
    d = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(binary, os.path.join(d, "data"), os.path.join(d, "etcd.log"))
    server.start()
    yield server
    server.stop()
