"""SGLang's real routers for the tests, as processes on free loopback ports: ``sglang-router`` (0.3.2) and its
successor gateway ``smg`` (1.13.0), both from PyPI (``scripts/test.sh`` installs them; a test that needs one
skips with the install line where it is missing).

``router_factory(kind, workers)`` starts one (``kind`` ``"sglang-router"`` or ``"smg"``) in front of
``workers`` and returns a :class:`RunningRouter` once it lists them all; every router is stopped when the
module ends. Each gets its own Prometheus port (both default to 29000, and a second router on a machine
would die on it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import requests

from bridge.process_group import find_free_port

__all__ = ["RunningRouter"]

INSTALL = "pip install 'sglang-router==0.3.2' 'smg==1.13.0'"


class RunningRouter:
    def __init__(self, kind: str, process: subprocess.Popen, url: str, log_path: str):
        self.kind, self.process, self.url, self.log_path = kind, process, url, log_path

    def workers(self) -> list[str]:
        """The worker URLs the router lists now."""
        return sorted(w["url"].rstrip("/") for w in requests.get(self.url + "/workers", timeout=5).json()["workers"])

    def generate(self, timeout: float = 30.0) -> dict:
        body = {"input_ids": [1, 4, 5], "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def _command(kind: str, port: int, metrics: int, workers: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics), "--log-level", "warn",
              "--worker-urls", *workers]
    if kind == "sglang-router":
        if importlib.util.find_spec("sglang_router") is None:
            pytest.skip(f"sglang-router is not installed: {INSTALL}")
        return [sys.executable, "-m", "sglang_router.launch_router", *common]
    exe = shutil.which("smg")
    if exe is None:
        pytest.skip(f"smg is not installed: {INSTALL}")
    return [exe, "launch", *common]


def start_router(kind: str, workers: list[str], timeout: float = 60.0) -> RunningRouter:
    port = find_free_port()
    metrics = find_free_port(avoid=(port,))
    fd, log_path = tempfile.mkstemp(prefix=f"wsync-{kind}-{port}-", suffix=".log")
    os.close(fd)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(_command(kind, port, metrics, workers), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    router = RunningRouter(kind, proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    want = sorted(w.rstrip("/") for w in workers)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited with {proc.returncode}:\n{router.log_tail()}")
        try:
            if router.workers() == want:
                return router
        except (requests.RequestException, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(f"{kind} did not list {want} within {timeout:g} s:\n{router.log_tail()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def router_factory():
    started: list[RunningRouter] = []

    def start(kind: str, workers: list[str]) -> RunningRouter:
        r = start_router(kind, workers)
        started.append(r)
        return r

    try:
        yield start
    finally:
        for r in started:
            r.stop()
