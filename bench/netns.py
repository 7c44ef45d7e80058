"""Shaped links for ``wsync bench --link RATE``: the trainer and the servers on two hosts of their own.

The hosts are two network namespaces this module makes, joined by one veth pair whose two legs are
shaped alike (``tc qdisc ... tbf``, and ``netem delay`` under it with ``--link-delay``), so bytes cost
what a real link makes them cost, in both directions::

    trainer host  wsb<pid>t  10.201.<n>.1/24  ==== veth, tbf RATE each way ====  10.201.<n>.2/24  wsb<pid>s  servers

Nothing else is touched: no address outside these two namespaces, no route or link in the host's own
namespace. :class:`Link` makes them (``up``), measures the link once with a plain TCP transfer
(:meth:`Link.measure`) and removes them (``down``, also on error and Ctrl-C: :func:`run_linked`).

Who runs where (:func:`run_linked`, from ``wsync bench``): this process (in the host's namespace) builds the
link, measures it, then runs the whole bench driver again inside the trainer namespace (``ip netns exec``,
``--_link-spec``): etcd, the watchers and the torchrun trainer there on its loopback, the servers started
by :func:`launch_server_in` in the server namespace on its own address. Broadcast crosses the link;
disk is written and read on the filesystem both hosts share (it does not cross the link: a network
filesystem would put its bytes on the wire too).

Needs root and iproute2 (``ip``, ``tc``): :func:`require` names what is missing in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from bridge.errors import ConfigError

__all__ = ["Link", "LinkSpec", "launch_server_in", "parse_rate", "remove_namespaces", "require", "run_command",
           "run_in_namespace", "run_linked"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_PORTS = (30000, 30001, 30002, 30003, 30004)
"""Ports of the servers in the server namespace (it is new: nothing else listens there)."""
PROBE_PORT = 30999
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate (``200mbit``, ``1gbit``, ``500kbit``).

    Raises:
        ConfigError: not a rate tc reads as bits per second.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)\s*", rate.lower())
    if not m or not float(m.group(1)) > 0:
        raise ConfigError(f"--link {rate!r}: give a rate as tc writes it, e.g. 200mbit or 1gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_delay(delay: str | None) -> float:
    """Seconds of a netem delay (``1ms``, ``500us``, ``0.2s``); 0 for None."""
    if not delay:
        return 0.0
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*", delay.lower())
    if not m:
        raise ConfigError(f"--link-delay {delay!r}: give a delay as tc writes it, e.g. 1ms or 500us")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def require() -> None:
    """Raise ConfigError naming what a shaped link needs and this host lacks (root, ``ip``, ``tc``)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        raise ConfigError("--link needs root (it makes network namespaces and shapes a veth pair with tc); run as root"
                          + (f", with iproute2 installed ({', '.join(missing)} not on PATH)" if missing else ""))
    if missing:
        raise ConfigError(f"--link needs iproute2: {' and '.join(missing)} not on PATH (apt-get install iproute2)")


def run_command(*cmd: str) -> None:
    """Run ``cmd`` (ip, tc); ConfigError with its output when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")


@dataclass
class LinkSpec:
    """What the driver inside the trainer namespace needs to know of the link (JSON through ``--_link-spec``)."""

    rate: str
    delay: str | None
    trainer_ns: str
    server_ns: str
    trainer_addr: str
    server_addr: str
    measured: dict


class Link:
    """Two namespaces (trainer ``t``, servers ``s``) and the shaped veth pair between them."""

    def __init__(self, rate: str, delay: str | None = None) -> None:
        self.rate, self.delay = rate, delay
        self.bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        pid = os.getpid()
        n = pid % 250 + 1
        self.ns = {"t": f"wsync-bench-{pid}-t", "s": f"wsync-bench-{pid}-s"}
        self.dev = {"t": f"wsb{pid}t", "s": f"wsb{pid}s"}
        self.addr = {"t": f"10.201.{n}.1", "s": f"10.201.{n}.2"}
        self.made: list[str] = []

    def on(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def up(self) -> None:
        """Make both namespaces, the veth pair, the addresses, and shape each leg's egress."""
        for side in "ts":
            run_command("ip", "netns", "add", self.ns[side])
            self.made.append(self.ns[side])
        t, s = self.ns["t"], self.ns["s"]
        run_command("ip", "-n", t, "link", "add", self.dev["t"], "type", "veth", "peer", "name", self.dev["s"], "netns",
                    s)
        for side in "ts":
            ns, dev = self.ns[side], self.dev[side]
            run_command("ip", "-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev)
            run_command("ip", "-n", ns, "link", "set", dev, "up")
            run_command("ip", "-n", ns, "link", "set", "lo", "up")
            for cmd in self.qdisc_commands(dev):
                try:
                    run_command("ip", "netns", "exec", ns, *cmd)
                except ConfigError as e:
                    if "netem" in cmd and "unknown" in str(e):
                        raise ConfigError(f"--link-delay {self.delay}: this kernel has no netem qdisc (sch_netem); "
                                          "leave --link-delay out") from e
                    raise

    def qdisc_commands(self, dev: str) -> list[list[str]]:
        """tc commands shaping ``dev``'s egress: tbf at the rate (a burst of 10 ms of traffic, at least 32 kB),
        and netem's delay under it when one is asked."""
        burst = max(32 * 1024, int(self.bps / 8 / 100))
        cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", self.rate, "burst",
                 str(burst), "latency", "50ms"]]
        if self.delay_s:
            cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                         self.delay])
        return cmds

    def down(self) -> None:
        """Remove what :meth:`up` made (the veth pair goes with its namespaces). Never raises."""
        remove_namespaces(self.made)
        self.made = []

    def measure(self, mb: float = 32.0, timeout: float = 120.0) -> dict:
        """One plain TCP stream of ``mb`` MB from the trainer namespace to the server namespace: ``{"bytes",
        "seconds", "mbit_s"}``, timed by the sender from its first byte to the receiver's answer that every
        byte arrived."""
        nbytes = int(mb * 1e6)
        env = {**os.environ, "PYTHONPATH": _ROOT}
        recv = subprocess.Popen([*self.on("s"), sys.executable, "-m", "bench.netns", "_recv", self.addr["s"],
                                 str(PROBE_PORT), str(nbytes)], cwd=_ROOT, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout is not None
            recv.stdout.readline()  # "listening"
            send = subprocess.run([*self.on("t"), sys.executable, "-m", "bench.netns", "_send", self.addr["s"],
                                   str(PROBE_PORT), str(nbytes)], cwd=_ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            if send.returncode != 0:
                raise ConfigError(f"the link probe failed: {send.stderr.strip()[-500:]}")
            seconds = float(send.stdout.strip())
        finally:
            recv.kill()
            recv.wait()
        return {"bytes": nbytes, "seconds": seconds, "mbit_s": nbytes * 8 / seconds / 1e6}


def remove_namespaces(names: list[str]) -> None:
    """Delete the namespaces ``names`` (the links in them go too), first stopping any process still inside them
    (only the bench's own: nothing else runs in namespaces it made). Never raises."""
    for ns in names:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in reversed(names):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_in_namespace(ns: str, args: list[str]) -> int:
    """``python ARGS`` from the checkout inside namespace ``ns`` (the checkout importable there); its exit code. Ended
    (SIGTERM, SIGKILL after 60 s) when this returns by an exception: Ctrl-C, or SIGTERM raised as one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    inner = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], cwd=_ROOT, env=env)
    try:
        return inner.wait()
    finally:
        if inner.poll() is None:
            inner.terminate()
            try:
                inner.wait(60)
            except subprocess.TimeoutExpired:
                inner.kill()
                inner.wait()


def _recv(host: str, port: int, nbytes: int) -> None:
    import socket

    with socket.create_server((host, port)) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
            conn.sendall(b"1" if got == nbytes else b"0")


def _send(host: str, port: int, nbytes: int) -> None:
    import socket

    data = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=60) as s:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            s.sendall(data[: min(left, len(data))])
            left -= min(left, len(data))
        ok = s.recv(1)
        seconds = time.perf_counter() - t0
    if ok != b"1":
        raise SystemExit("the receiver did not get every byte")
    print(f"{seconds:.6f}", flush=True)


# ------------------------------------------------------------------------------------------ the servers' side


def launch_server_in(link: LinkSpec, port: int, **kw):
    """:func:`inference_adapter.launcher.launch_server` for the reference server, run in the server namespace and
    listening on its address. Same keywords (``model``, ``log_path``, ``dtype``, ``extra_args``, ``env``,
    ``ready_timeout``, ``disk_roots``)."""
    from bridge.client import ServerClient
    from inference_adapter.launcher import CHECKOUT as ADAPTER_ROOT
    from inference_adapter.launcher import LaunchedServer, server_command, wait_until_ready

    host = link.server_addr
    cmd = server_command(kw["model"], None, host, port, kw.get("dtype", "bfloat16"), kw.get("disk_roots", ()))
    cmd = ["ip", "netns", "exec", link.server_ns, *cmd, *[str(a) for a in kw.get("extra_args", ())]]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ADAPTER_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env.update(kw.get("env") or {})
    log_file = open(kw["log_path"], "ab")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=ADAPTER_ROOT)
    url = f"http://{host}:{port}"
    server = LaunchedServer(proc, url, ServerClient(url, timeout=60.0), kw["log_path"], "reference", log_file)
    wait_until_ready(server, kw.get("ready_timeout", 300))
    return server


# ------------------------------------------------------------------------------------------ the outer driver


def run_linked(cfg, *, json_path: str | None, plot_path: str | None, probe_mb: float = 32.0) -> int:
    """Build the link, measure it, run the bench driver inside the trainer namespace, remove the link.

    Returns the inner driver's exit code. The link is removed on every way out: the end, an error, Ctrl-C
    (which reaches the inner driver too, in the same process group) and SIGTERM.
    """
    from dataclasses import asdict, replace

    require()
    # The driver inside runs from the checkout: relative paths are made absolute here, where they were meant.
    cfg = replace(cfg, workdir=os.path.abspath(cfg.workdir), models=[os.path.abspath(m) for m in cfg.models])
    link = Link(cfg.link, cfg.link_delay)
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        link.up()
        measured = link.measure(probe_mb)
        print(f"wsync bench: link {cfg.link}{f' + {cfg.link_delay} delay' if cfg.link_delay else ''} between "
              f"{link.addr['t']} (trainer) and {link.addr['s']} (servers): measured {measured['mbit_s']:.1f} Mbit/s "
              f"({measured['bytes'] / 1e6:.0f} MB of TCP in {measured['seconds']:.2f} s)", file=sys.stderr, flush=True)
        spec = {"config": asdict(cfg), "json": json_path, "plot": plot_path,
                "link": asdict(LinkSpec(rate=cfg.link, delay=cfg.link_delay, trainer_ns=link.ns["t"],
                                        server_ns=link.ns["s"], trainer_addr=link.addr["t"],
                                        server_addr=link.addr["s"], measured=measured))}
        return run_in_namespace(link.ns["t"], ["-m", "wsync", "bench", "--_link-spec", json.dumps(spec)])
    finally:
        link.down()
        signal.signal(signal.SIGTERM, old)


def _raise_interrupt(*_):
    raise KeyboardInterrupt()


if __name__ == "__main__":  # the link probe's two ends, run by Link.measure in each namespace
    what, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    {"_recv": _recv, "_send": _send}[what](host, port, nbytes)
