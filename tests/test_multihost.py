"""Trainer and server on two hosts: network namespaces joined by a veth pair, with addresses only inside
them (``10.231.<n>.1`` for the trainer's host, ``10.231.<n>.2`` for the server's), removed at the end.

The bug this reproduces: the trainer told a server on another host to meet it at the address of its host
name (127.0.0.1 here), and the broadcast group never formed. Rank 0 now announces the address of the
interface that routes to the servers, and a loopback ``--master-address`` with a remote server is refused
at once, naming the setting. Needs root (``ip netns``); skips with one line where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """(trainer address, server namespace, server address): the trainer stays in this namespace."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("multi-host tests need root and iproute2 (`ip netns`) to build network namespaces")
    n = 100 + os.getpid() % 150
    ns, here, there = f"wsync-mh-{os.getpid()}", f"wsmh{os.getpid()}a", f"wsmh{os.getpid()}b"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr.strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"10.231.{n}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("addr", "add", f"10.231.{n}.2/24", "dev", there, ns=ns)
        _ip("link", "set", there, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        yield f"10.231.{n}.1", ns, f"10.231.{n}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def remote_server(hosts, tmp_path_factory):
    """A reference server in the server's namespace, listening only on its address there."""
    from bridge.client import ServerClient

    _, ns, address = hosts
    port = 30555  # the namespace is new: nothing else listens there
    log = tmp_path_factory.mktemp("remote") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "wsync", "serve", "--preset", "tiny",
                                 "--host", address, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://{address}:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                ServerClient(url, timeout=2).model_info()
                break
            except Exception as e:  # not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the remote server did not start: {e}\n{log.read_text()[-2000:]}") from e
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _train(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wsync", "train", "--steps", "1", "--nproc", "2", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_broadcast_to_a_server_on_another_host_needs_no_flag(remote_server):
    from bridge.client import ServerClient

    out = _train("--publish", "broadcast", "--server", remote_server, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "published v" in out.stdout
    assert ServerClient(remote_server).model_info()["weight_version"] == "1"


def test_a_loopback_master_address_for_a_remote_server_fails_at_once_naming_the_setting(remote_server):
    t = time.monotonic()
    out = _train("--publish", "broadcast", "--server", remote_server, "--master-address", "127.0.0.1", timeout=120)
    assert out.returncode != 0 and time.monotonic() - t < 60
    last = out.stderr.strip().splitlines()[-1]
    assert "master_address" in last and "--master-address" in last and "loopback" in last, last


def test_the_address_announced_is_the_one_that_routes_to_the_servers(hosts):
    from bridge.transports.broadcast import master_address_for

    here, _, there = hosts
    assert master_address_for([f"http://{there}:30000"], None) == here
    assert master_address_for(["http://127.0.0.1:30000"], None) == "127.0.0.1"
