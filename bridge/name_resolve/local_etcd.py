"""A real ``etcd`` server on free loopback ports, for tests, benchmarks and trying the etcd backend.

It runs Debian's ``etcd`` binary (package ``etcd-server``) with a private data directory. ``stop()``
keeps the data so ``start()`` (or ``restart()``) brings the same cluster back, as an etcd restart in
production would; ``close()`` stops it and deletes the data.

Example:
    >>> etcd = LocalEtcd.start_if_available(tempfile.mkdtemp())   # doctest: +SKIP
    >>> etcd.url if etcd else "no etcd binary"                    # doctest: +SKIP
    'etcd://127.0.0.1:40123'
    >>> etcd.close()                                              # doctest: +SKIP
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

__all__ = ["INSTALL_HINT", "LocalEtcd"]

INSTALL_HINT = "etcd binary not found; install it with `apt-get install etcd-server` (scripts/test.sh does)"


class LocalEtcd:
    """An ``etcd`` process serving ``url`` (``etcd://127.0.0.1:PORT``) between :meth:`start` and :meth:`stop`.

    ``host`` is the address it listens on (loopback by default); ``wrap`` is a command prefix it is started
    under (``["ip", "netns", "exec", NS]`` runs it on another host made of a network namespace)."""

    def __init__(self, binary: str, workdir: str, name: str = "wsync", host: str = "127.0.0.1",
                 wrap: tuple[str, ...] = ()) -> None:
        self.binary, self.name, self.host, self.wrap = binary, name, host, tuple(wrap)
        self.data_dir = tempfile.mkdtemp(prefix="etcd-", dir=workdir)
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self.client_port, self.peer_port = find_free_port(), find_free_port()
        self.url = f"etcd://{host}:{self.client_port}"
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
        """Start etcd and wait until its ``/health`` says true.

        Raises:
            ConfigError: etcd exited at start-up or was not healthy within ``timeout`` (see ``log_path``).
        """
        assert self.proc is None, "etcd is already running"
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self.peer_port}"
        cmd = [
            *self.wrap, self.binary, "--name", self.name, "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            # A faster election makes start-up and restarts quicker; the minimum lease TTL becomes 1 s.
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise ConfigError(f"etcd exited with code {code} at start-up; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise ConfigError(f"etcd was not healthy within {timeout:g} s; see {self.log_path}")

    def stop(self) -> None:
        """Stop the process; the data directory stays for a later :meth:`start`."""
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

    def close(self) -> None:
        """Stop and delete the data directory."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
