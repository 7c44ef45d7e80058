"""SGLang's own code as the receiving side of the ``sglang_code`` test tier, on CPU.

``scripts/install_sglang.sh`` unpacks each SGLang release under ``$WSYNC_SGLANG_CACHE`` (default
``~/.cache/wsync/sglang``) as ``sglang-<version>/``; :func:`launch` starts :mod:`tests.sglang_harness.serve`
for one of them in a subprocess of its own (one SGLang per process) and yields its URL. What in that server
is SGLang's code and what is stubbed is listed in :mod:`tests.sglang_harness.serve`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("WSYNC_SGLANG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "wsync", "sglang")
# One release per dialect the client claims, for the publishing tests (tests/test_sglang_code.py): the newest,
# the first with /server_info, load_format and pause modes (0.5.6), and the oldest claimed (0.4.9).
VERSIONS = ("0.5.23", "0.5.6", "0.4.9")
# The releases on either side of each version gate of bridge/protocol.py that VERSIONS does not already pin
# (tests/test_sglang_versions.py; scripts/install_sglang.sh says which gate each pins).
GATE_VERSIONS = ("0.4.10.post2", "0.5.1", "0.5.2", "0.5.3", "0.5.5", "0.5.7", "0.5.8", "0.5.20", "0.5.21", "0.5.22")
# Everything scripts/install_sglang.sh installs, oldest first.
ALL_VERSIONS = ("0.4.9", "0.4.10.post2", "0.5.1", "0.5.2", "0.5.3", "0.5.5", "0.5.6", "0.5.7", "0.5.8", "0.5.20",
                "0.5.21", "0.5.22", "0.5.23")
assert set(ALL_VERSIONS) == set(VERSIONS) | set(GATE_VERSIONS)


def sglang_dir(version: str) -> str:
    return os.path.join(CACHE, f"sglang-{version}")


def installed(version: str) -> bool:
    return os.path.exists(os.path.join(sglang_dir(version), ".complete"))


@contextlib.contextmanager
def launch(version: str, model_dir: str, *, api_key: str | None = None, admin_api_key: str | None = None,
           weight_version: str = "default", timeout: float = 240.0,
           custom_weight_loader: str | None = None, env: dict | None = None,
           extra_args: list[str] | None = None) -> Iterator[Launched]:
    """Start a harness server of SGLang ``version`` serving ``model_dir``; stop it on exit. ``env``: more environment
    of its process; ``extra_args``: more flags of :mod:`tests.sglang_harness.serve` (``--enable-lora`` ...)."""
    args = ["--sglang-dir", sglang_dir(version), "--model", model_dir, "--weight-version", weight_version]
    if api_key:
        args += ["--api-key", api_key]
    if admin_api_key:
        args += ["--admin-api-key", admin_api_key]
    if custom_weight_loader:
        args += ["--custom-weight-loader", custom_weight_loader]
    args += list(extra_args or [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    # A free port is found, closed, then bound by the server: another process (the other xdist worker's servers,
    # ranks, routers, any connection's ephemeral port) may take it in between; then it is chosen again.
    for attempt in range(3):
        try:
            server = _start(version, args, env, timeout)
            break
        except _PortTaken:
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()


class _PortTaken(RuntimeError):
    pass


def _start(version: str, args: list[str], env: dict, timeout: float) -> Launched:
    """One harness process on a free port, once it says it is ready (:class:`_PortTaken` when another process took
    the port first; RuntimeError when it does not start)."""
    from bridge.process_group import find_free_port

    port = find_free_port()
    cmd = [sys.executable, "-m", "tests.sglang_harness.serve", "--port", str(port), *args]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"sglang-{version}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    ready = threading.Event()

    def pump():
        for line in proc.stdout:  # type: ignore[union-attr]
            log.write(line)
            log.flush()
            if line.startswith("HARNESS READY"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    server = Launched(version, f"http://127.0.0.1:{port}", proc, log.name, log)
    deadline = time.monotonic() + timeout
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = server.log_tail()
            taken = "address already in use" in tail
            raise (_PortTaken if taken else RuntimeError)(
                f"SGLang {version} harness did not start (exit {proc.poll()}):\n{tail}")
    return server


class Launched:
    def __init__(self, version, url, proc, log_path, log=None):
        self.version, self.url, self.proc, self.log_path, self._log = version, url, proc, log_path, log

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 10 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def checksums(self) -> dict:
        """``{"weight_version", "checksums": {name: sha256}}`` of every tensor the SGLang-side model serves."""
        import requests

        return requests.get(self.url + "/wsync_harness/weights", timeout=30).json()

    def lora(self) -> dict:
        """SGLang's LoRA state (``--enable-lora``, :mod:`tests.sglang_harness.lora_serve`): ``registry`` (name -> id),
        ``counters`` (id -> generations holding it), ``pending_unloads``, and ``loaded`` (name -> id, path, rank, the
        sha256 of every tensor SGLang's ``LoRAAdapter`` was handed)."""
        import requests

        return requests.get(self.url + "/wsync_harness/lora", timeout=30).json()
