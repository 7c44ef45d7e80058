"""Real SGLang servers for the real tier: SGLang 0.5.23's whole server on CPU, started by the project's own launcher
(:mod:`inference_adapter.real_sglang`), exactly as ``wsync sglang`` starts it.

``real_sglang`` (module scope) starts servers, several at once with ``real_sglang.start([...])`` (about 20 s each
on idle cores, 30-50 s beside the rest of the suite), and stops them when the module ends. Each holds about 2 GB,
so at most :data:`SLOTS` are alive at once on the machine, across pytest-xdist workers: a server takes a slot (a
file lock) before it starts and gives it back when it is stopped or killed. A server that dies is reported with the
end of its log.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import os
import signal
import tempfile
import time

import pytest

from inference_adapter.launched import LaunchedServer
from inference_adapter.real_sglang import find_sglang, launch_sglang

__all__ = ["SLOTS", "RealServers"]

SLOTS = 3
SLOT_DIR = os.path.join(tempfile.gettempdir(), "wsync-real-sglang-slots")
START_S = 300.0  # to generate, beside the rest of the suite on 2 cores (about 20 s on idle ones)


class _Slot:
    """One of the machine's :data:`SLOTS` for a real server: an exclusive lock on a file, held while it lives."""

    def __init__(self, wait_s: float = 900.0) -> None:
        os.makedirs(SLOT_DIR, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while True:
            for i in range(SLOTS):
                fd = os.open(os.path.join(SLOT_DIR, f"{i}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self.fd = fd
                    return
                except BlockingIOError:
                    os.close(fd)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no free slot for a real SGLang server within {wait_s:g} s ({SLOTS} alive)")
            time.sleep(0.5)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class RealServers:
    """Real SGLang servers of one test module (see the module docstring)."""

    def __init__(self) -> None:
        self.started: list[LaunchedServer] = []
        self._slots: dict[int, _Slot] = {}

    def __call__(self, **kw) -> LaunchedServer:
        return self.start([kw])[0]

    def start(self, specs: list[dict]) -> list[LaunchedServer]:
        """Start a server per spec (:func:`launch_sglang` keywords) concurrently; each is ready to generate."""
        if find_sglang() is None:
            pytest.fail("real SGLang is not installed: bash scripts/install_sglang.sh")
        with cf.ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(self._one, spec) for spec in specs]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def kill(self, server: LaunchedServer) -> None:
        """SIGKILL the server's whole process group (its scheduler and detokenizer too) and give back its slot."""
        try:
            os.killpg(server.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.process.wait(30)
        self._release(server)

    def died(self) -> str | None:
        """For each server that exited without being stopped or killed here: its URL, exit status and the end of its
        log; None when every one is alive."""
        dead = [s for s in self.started if id(s) in self._slots and not s.alive()]
        return "\n".join(f"real SGLang at {s.url} died (exit {s.process.returncode}); the end of its log "
                         f"({s.log_path}):\n{s.log_tail(25)}" for s in dead) or None

    def stop_all(self) -> None:
        if self.started:
            with cf.ThreadPoolExecutor(len(self.started)) as pool:
                list(pool.map(self._stop, list(self.started)))

    def _one(self, spec: dict) -> LaunchedServer:
        slot = _Slot()
        try:
            server = launch_sglang(ready_timeout=START_S, **spec)
        except BaseException:
            slot.release()
            raise
        self._slots[id(server)] = slot
        self.started.append(server)
        return server

    def _stop(self, server: LaunchedServer) -> None:
        server.stop(timeout=15.0)
        self._release(server)

    def _release(self, server: LaunchedServer) -> None:
        slot = self._slots.pop(id(server), None)
        if slot is not None:
            slot.release()


@pytest.fixture(scope="module")
def real_sglang():
    """Start real SGLang servers (:class:`RealServers`); all are stopped when the module ends."""
    servers = RealServers()
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture
def real_sglang_alive(real_sglang):
    """After the test, a real server that died is an error that shows the end of its log (not a bare timeout)."""
    yield
    died = real_sglang.died()
    if died:
        pytest.fail(died, pytrace=False)


def served_tensor(server: LaunchedServer, name: str, rows: int):
    """The served tensor ``name`` (HF name) read back through SGLang's ``/get_weights_by_name`` (Llama and its kin
    answer it for every tensor, q/k/v and gate/up included, by their slices of the stacked tensors), as float32."""
    import torch

    return torch.tensor(server.client.get_weights_by_name(name, truncate_size=rows), dtype=torch.float32)
