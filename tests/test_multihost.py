"""Trainer and servers on different hosts: hosts A, B and C are network namespaces on one Linux bridge,
with addresses only inside them (``10.231.<n>.1`` A, ``.2`` B, ``.3`` C; this process watches from
``.254`` on the bridge). Everything is removed at the end, also on failure. Needs root (``ip netns``);
skips with one line where namespaces cannot be made.

What runs across hosts:
- a 2-rank trainer on A publishing by broadcast to servers on B and C in one group, bit-equal afterwards,
  and with no flag (the bug this tier reproduced: rank 0 told the servers to meet it at its host name's
  address, 127.0.0.1 here, and gloo bound its connections to that address too); colocated and a loopback
  ``--master-address`` refused at once, naming why;
- a LoRA adapter alone by broadcast from a 2-rank trainer on A into the server on C (no shared disk);
- disk with etcd on A, the server and ``wsync watch`` on B, snapshots on the shared directory;
- a 2-node trainer (rank 0 on A, rank 1 on C, torchrun's multi-node rendezvous) publishing by broadcast
  and by disk (every rank writes its share) to the server on B;
- the link to one server cut mid-broadcast: every trainer rank raises within the configured bounds and
  the other server keeps its version, unpaused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 30555  # every host is new: nothing else listens there
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Net:
    """Hosts A, B, C (network namespaces), each with one veth leg on a bridge that this process is on too."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.n = 100 + pid % 150
        self.bridge = f"wsmh{pid}br"
        self.ns = {h: f"wsync-mh-{pid}-{h}" for h in "ABC"}
        self.dev = {h: f"wsmh{pid}{h}" for h in "ABC"}  # each host's own leg (the peer on the bridge ends in "p")
        self.addr = {h: f"10.231.{self.n}.{i}" for i, h in enumerate("ABC", start=1)}

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.231.{self.n}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in "ABC":
            ns, dev = self.ns[h], self.dev[h]
            _ip("netns", "add", ns)
            _ip("link", "add", dev, "type", "veth", "peer", "name", dev + "p")
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", dev + "p", "master", self.bridge)
            _ip("link", "set", dev + "p", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def on(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host]]

    def url(self, host: str) -> str:
        return f"http://{self.addr[host]}:{PORT}"

    def cut(self, host: str, up: bool = False) -> None:
        """Take the host's link down (or up again), on its side."""
        _ip("-n", self.ns[host], "link", "set", self.dev[host], "up" if up else "down")


@pytest.fixture(scope="module")
def net():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("multi-host tests need root and iproute2 (`ip netns`) to build network namespaces")
    n = Net()
    try:
        n.up()
    except subprocess.CalledProcessError as e:
        n.down()
        pytest.skip(f"cannot make network namespaces and a bridge here: {(e.stderr or '').strip()}")
    try:
        yield n
    finally:
        n.down()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in left for ns in n.ns.values()), f"namespaces left behind: {left}"
        assert subprocess.run(["ip", "link", "show", n.bridge], capture_output=True).returncode != 0, "bridge left"


@contextmanager
def _serve(net: Net, host: str, log, *extra: str):
    from bridge.client import ServerClient

    proc = subprocess.Popen([*net.on(host), sys.executable, "-m", "wsync", "serve", "--preset", "tiny", "--host",
                             net.addr[host], "--port", str(PORT), *extra], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, env=ENV)
    url = net.url(host)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                ServerClient(url, timeout=2).model_info()
                break
            except Exception as e:  # not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the server on {host} did not start: {e}") from e
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    """The directory every host sees at the same path (the hosts share this machine's filesystem)."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def servers(net, shared_dir, tmp_path_factory):
    """Reference servers on B and C, listening only on their own addresses; B may load from ``shared_dir``, C serves
    LoRA adapters."""
    logs = tmp_path_factory.mktemp("server-logs")
    with open(logs / "B.log", "w") as lb, open(logs / "C.log", "w") as lc:
        with _serve(net, "B", lb, "--disk-root", str(shared_dir)) as b, _serve(net, "C", lc, "--enable-lora") as c:
            yield {"B": b, "C": c}


def _torchrun(net: Net, host: str, out, *args: str, nnodes: int = 1, node_rank: int = 0, nproc: int = 2,
              env: dict | None = None) -> subprocess.Popen:
    """``torchrun -m tests.multihost_rank`` on ``host``: ``nproc`` ranks there, of ``nnodes`` hosts (A is node 0
    and hosts the rendezvous)."""
    rdzv = ["--standalone"] if nnodes == 1 else ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                                                  "--master-addr", net.addr["A"], "--master-port", "29517"]
    cmd = [*net.on(host), sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(nproc),
           "-m", "tests.multihost_rank", "--out", str(out), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], out, ranks: int, timeout: float = 240) -> list[dict]:
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired as e:
            for q in procs:
                q.kill()
            raise AssertionError(f"a trainer did not finish within {timeout:g} s:\n{p.communicate()[0][-4000:]}") from e
    reports = []
    for r in range(ranks):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no report; trainer output:\n" + "\n".join(x[-3000:] for x in logs)
        reports.append(json.loads(path.read_text()))
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    return reports


def _served_ok(report: dict, urls: list[str], version: int) -> None:
    seen = report["served"][str(version)]
    for url in urls:
        s = seen[url]
        assert s["tensors_equal"] and s["answer_equal"], f"{url} v{version}: {s}"
        assert s["version"] == s["generate_version"] == str(version), f"{url}: {s}"


def test_broadcast_from_a_to_servers_on_b_and_c_is_bit_equal(net, servers, tmp_path):
    urls = [servers["B"], servers["C"]]
    out = tmp_path
    args = ["--transport", "broadcast", "--versions", "2", "--trial", "bcast"]
    reports = _finish([_torchrun(net, "A", out, *args, *[a for u in urls for a in ("--server", u)])], out, 2)
    assert all(r["error"] is None and r["published"] == [1, 2] for r in reports), reports
    for v in (1, 2):
        _served_ok(reports[0], urls, v)


def test_the_cli_needs_no_flag_and_a_loopback_master_address_fails_at_once(net, servers):
    from bridge.client import ServerClient

    def train(*args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([*net.on("A"), sys.executable, "-m", "wsync", "train", "--steps", "1", "--nproc", "2",
                               "--publish", "broadcast", "--server", servers["C"], "--trial", "cli", *args],
                              capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=timeout)

    out = train(timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "published v" in out.stdout
    version = ServerClient(servers["C"]).model_info()["weight_version"]
    t = time.monotonic()
    out = train("--master-address", "127.0.0.1", timeout=120)
    assert out.returncode != 0 and time.monotonic() - t < 60
    last = out.stderr.strip().splitlines()[-1]
    assert "master_address" in last and "--master-address" in last and "loopback" in last, last
    assert ServerClient(servers["C"]).model_info()["weight_version"] == version


def test_colocated_to_servers_on_other_hosts_is_refused_at_once_naming_why(net, servers):
    t = time.monotonic()
    out = subprocess.run([*net.on("A"), sys.executable, "-m", "wsync", "train", "--steps", "1", "--nproc", "1",
                          "--publish", "colocated", "--server", servers["B"], "--server", servers["C"]],
                         capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert out.returncode != 0 and time.monotonic() - t < 60
    last = out.stderr.strip().splitlines()[-1]
    assert "colocated" in last and servers["B"] in last and "broadcast" in last, last


def test_an_adapter_by_broadcast_from_a_to_c_needs_no_shared_disk(net, servers):
    """``wsync train --publish-adapter NAME --publish broadcast`` on A: the adapter alone, over a weight-update group,
    into the reference server on C, which serves it by name with the version of the last step."""
    from bridge.client import ServerClient

    out = subprocess.run([*net.on("A"), sys.executable, "-m", "wsync", "train", "--steps", "2", "--nproc", "2",
                          "--lora-rank", "4", "--publish-adapter", "mh-policy", "--publish", "broadcast",
                          "--server", servers["C"], "--trial", "mh-lora"],
                         capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    c = ServerClient(servers["C"])
    served = c.adapter_checksums("mh-policy")
    assert served["wsync_lora_version"] == "2" and served["checksums"], served
    answer = c.generate(input_ids=[5, 72, 101], sampling_params={"temperature": 0, "max_new_tokens": 4},
                        lora_path="mh-policy")
    assert answer["meta_info"]["wsync_lora_version"] == "2", answer["meta_info"]


def test_the_address_announced_is_the_one_that_routes_to_the_servers(net):
    code = ("from bridge.transports.broadcast import master_address_for as m; import sys; "
            f"print(m(['http://{net.addr['B']}:1'], None), m(['http://127.0.0.1:1'], None))")
    out = subprocess.run([*net.on("A"), sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV)
    assert out.stdout.split() == [net.addr["A"], "127.0.0.1"], out.stdout + out.stderr


@pytest.fixture(scope="module")
def etcd_on_a(net, tmp_path_factory):
    from bridge.name_resolve.local_etcd import LocalEtcd

    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; scripts/test.sh does)")
    etcd = LocalEtcd(binary, str(tmp_path_factory.mktemp("etcd")), host=net.addr["A"], wrap=tuple(net.on("A")))
    etcd.start()
    try:
        yield etcd.url
    finally:
        etcd.close()


@contextmanager
def _watch(net: Net, host: str, etcd_url: str, url: str, trial: str, log):
    proc = subprocess.Popen([*net.on(host), sys.executable, "-m", "wsync", "watch", "--name-resolve", etcd_url,
                             "--experiment", "default", "--trial", trial, "--server", url],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def test_disk_with_etcd_on_a_and_the_server_and_watcher_on_b(net, servers, etcd_on_a, shared_dir, tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    with open(tmp_path / "watch.log", "w") as log, _watch(net, "B", etcd_on_a, servers["B"], "disk1", log):
        reports = _finish([_torchrun(net, "A", out, "--transport", "disk", "--server", servers["B"], "--versions", "2",
                                     "--trial", "disk1", "--name-resolve", etcd_on_a, "--snapshot-root",
                                     str(shared_dir / "disk1"))], out, 2)
    assert all(r["error"] is None and r["published"] == [1, 2] for r in reports), reports
    _served_ok(reports[0], [servers["B"]], 2)
    assert reports[0]["path"].startswith(str(shared_dir / "disk1"))


def _gloo_env(net: Net, host: str) -> dict:
    """A multi-node CPU trainer's own process group needs GLOO_SOCKET_IFNAME (torch's setting): gloo binds to
    the host name's address otherwise, which is 127.0.0.1 here."""
    return {"GLOO_SOCKET_IFNAME": net.dev[host]}


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_a_two_node_trainer_on_a_and_c_publishes_to_b(net, servers, etcd_on_a, shared_dir, tmp_path, transport):
    out = tmp_path
    trial = f"twonode-{transport}"
    args = ["--transport", transport, "--server", servers["B"], "--versions", "2", "--trial", trial]
    if transport == "disk":
        args += ["--name-resolve", etcd_on_a, "--snapshot-root", str(shared_dir / trial)]
    with open(tmp_path / "watch.log", "w") as log, _watch(net, "B", etcd_on_a, servers["B"], trial, log):
        procs = [_torchrun(net, h, out, *args, nnodes=2, node_rank=i, nproc=1, env=_gloo_env(net, h))
                 for i, h in enumerate("AC")]
        reports = _finish(procs, out, 2)
    assert [r["error"] for r in reports] == [None, None], reports
    assert all(r["published"] == [1, 2] for r in reports), reports
    _served_ok(reports[0], [servers["B"]], 2)


def test_a_link_cut_mid_broadcast_fails_every_rank_in_bounds_and_the_other_server_keeps_its_version(
        net, servers, tmp_path):
    from bridge.client import ServerClient
    from bridge.config import PublisherConfig
    from bridge.publisher.bounded import dead_rank_bound
    from tests.sync_bodies import assert_resumed, holds, serving_now

    urls = [servers["B"], servers["C"]]
    group_timeout, http_timeout = 5.0, 5.0
    bound = dead_rank_bound(PublisherConfig(servers=urls, group_timeout=group_timeout, http_timeout=http_timeout))
    out = tmp_path
    # Version 2 stops at bucket 3 on rank 0 for 3 s: the link to C goes down before that pause ends.
    proc = _torchrun(net, "A", out, "--transport", "broadcast", "--versions", "2", "--fail-version", "2",
                     "--trial", "cut", "--group-timeout", str(group_timeout), "--http-timeout", str(http_timeout),
                     *[a for u in urls for a in ("--server", u)], env={"WSYNC_FAILPOINTS": "bucket:3@0=sleep:3"})
    try:
        deadline = time.monotonic() + 180
        c = ServerClient(servers["C"], timeout=5)
        # C paused: version 2's sync is under way there, and the pause in bucket 3 keeps it so until after the cut
        # (polled: a fixed 1.5 s after the trainer said it was publishing assumed the buckets before it were fast).
        while not ((out / "publishing-v2").exists() and c.server_info()["internal_states"][0]["paused"]):
            assert proc.poll() is None and time.monotonic() < deadline, "version 2 never started on C"
            time.sleep(0.05)
        net.cut("C")
        cut_at = time.time()
        reports = _finish([proc], out, 2, timeout=bound + 60)
    finally:
        net.cut("C", up=True)
    for r in reports:
        assert r["published"] == [1] and r["error"] is not None, r
        assert r["error"]["at"] - cut_at < bound, (r["error"], bound)
    now = serving_now(servers["B"])
    assert_resumed(now, "B, beside the cut link")
    assert now["version"] == now["generate_version"] == "1", now
    assert now["paused"] is False and now["session_open"] is False, now
    assert holds(now["checksums"], reports[0]["own_before"]) and not holds(now["checksums"], reports[0]["own_after"])


def test_the_interface_gloo_binds_to_is_the_one_holding_the_routed_address():
    from bridge.process_group import interface_of, route_source

    assert route_source("127.0.0.1") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface here holds it
