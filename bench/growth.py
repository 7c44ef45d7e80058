"""``wsync bench --servers 1 2 4 8``: how one sync grows with the number of servers, by broadcast and by disk.

For each count N, N reference servers start, each (with ``--link RATE``) on a host of its own: a network namespace
joined to a switch (a bridge in a namespace of its own) by a veth pair shaped to RATE on both legs, as the trainer's
host is; server-to-server traffic (gloo's broadcast is a tree: servers relay to servers) crosses two shaped legs, as
through a real switch. Without ``--link`` everything runs on loopback. The trainer (one rank, in the trainer host)
publishes the preset ``--repeats`` times after a warm-up, by broadcast (one weight-update group, the trainer its
source) and by disk (a snapshot on the filesystem every host shares, loaded by every server through a watcher:
disk bytes do not cross the link). Each row: ``servers``, ``method``, ``seconds`` (median), ``bytes`` (one copy of
the model on the wire), and every timing.

The CPU is shared: on a 2-core machine N servers receiving at once also compete for the cores, which is part of
what a row shows; the per-hop figures ``docs/fleet.md`` derives come from the rows where the link, not the cores,
is the bound.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from bridge.errors import ConfigError

__all__ = ["GrowthConfig", "run_growth"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 30000


@dataclass
class GrowthConfig:
    counts: list[int]
    preset: str = "small"
    repeats: int = 3
    link: str | None = None
    link_delay: str | None = None
    workdir: str = ""
    timeout: float = 300.0
    methods: list[str] = field(default_factory=lambda: ["broadcast", "disk"])


class Star:
    """A switch namespace with a bridge, and hosts (namespaces) each on a veth pair to it shaped to ``rate`` both ways."""

    def __init__(self, rate: str, delay: str | None, hosts: int) -> None:
        from bench.netns import Link

        self.shaper = Link(rate, delay)  # its qdisc commands (tbf, netem)
        pid = os.getpid()
        self.switch = f"wsg-{pid}-sw"
        self.names = [f"wsg-{pid}-{i}" for i in range(hosts)]  # 0: the trainer
        n = pid % 250 + 1
        self.addrs = [f"10.202.{n}.{i + 1}" for i in range(hosts)]
        self.made: list[str] = []

    def up(self) -> None:
        from bench.netns import run_command

        run_command("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        run_command("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run_command("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            run_command("ip", "netns", "add", ns)
            self.made.append(ns)
            host_dev, sw_dev = f"h{i}", f"p{i}"
            run_command("ip", "-n", ns, "link", "add", host_dev, "type", "veth", "peer", "name", sw_dev, "netns",
                        self.switch)
            run_command("ip", "-n", self.switch, "link", "set", sw_dev, "master", "br0")
            run_command("ip", "-n", self.switch, "link", "set", sw_dev, "up")
            run_command("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", host_dev)
            run_command("ip", "-n", ns, "link", "set", host_dev, "up")
            run_command("ip", "-n", ns, "link", "set", "lo", "up")
            for on, dev in ((ns, host_dev), (self.switch, sw_dev)):
                for cmd in self.shaper.qdisc_commands(dev):
                    run_command("ip", "netns", "exec", on, *cmd)

    def down(self) -> None:
        from bench.netns import remove_namespaces

        remove_namespaces(self.made)
        self.made = []


def _start_servers(cfg: GrowthConfig, n: int, hosts: list[tuple[str | None, str]], model_dir: str, logs: str):
    """``n`` reference servers of ``model_dir``, the i-th in ``hosts[i]`` (namespace or None, address), at once."""
    from bridge.client import ServerClient
    from inference_adapter.launcher import CHECKOUT, LaunchedServer, server_command, wait_until_ready

    servers = []
    for i in range(n):
        ns, addr = hosts[i]
        port = PORT if ns else _free_port()
        cmd = server_command(model_dir, None, addr, port, "bfloat16", [cfg.workdir])
        cmd = (["ip", "netns", "exec", ns] if ns else []) + cmd
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([CHECKOUT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        log_path = os.path.join(logs, f"server-{n}-{i}.log")
        log = open(log_path, "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=CHECKOUT)
        url = f"http://{addr}:{port}"
        servers.append(LaunchedServer(proc, url, ServerClient(url, timeout=cfg.timeout), log_path, "reference", log))
    try:
        for s in servers:
            wait_until_ready(s, 300)
    except BaseException:
        _stop(servers)
        raise
    return servers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(servers) -> None:
    for s in servers:
        s.stop()


def _measure(cfg: GrowthConfig, method: str, urls: list[str], model, trainer_addr: str, version: int) -> list[float]:
    """Seconds of ``cfg.repeats`` publishes of ``model`` into ``urls`` by ``method`` after a warm-up."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.client import ServerGroup
    from inference_adapter.watcher import DiskWatcher

    common = dict(servers=urls, progress=False, group_timeout=cfg.timeout, http_timeout=cfg.timeout,
                  experiment="growth", trial=f"{method}-{len(urls)}-{os.getpid()}")
    watcher = None
    if method == "broadcast":
        pub = WeightPublisher(PublisherConfig(transport="broadcast", master_address=trainer_addr, **common))
    else:
        nr = f"file://{cfg.workdir}/nr"
        pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve=nr, snapshot_root=f"{cfg.workdir}/snap",
                                              wait_loaded_timeout=cfg.timeout, keep_snapshots=2, **common))
        watcher = DiskWatcher(nr, "growth", common["trial"], ServerGroup(urls, timeout=cfg.timeout))
        watcher.start()
    try:
        pub.publish(model, version=version)  # warm-up: group, connections, page cache
        out = []
        for i in range(cfg.repeats):
            res = pub.publish(model, version=version + 1 + i)
            out.append(res.seconds)
        return out
    finally:
        pub.close()
        if watcher is not None:
            watcher.stop()


def run_growth(cfg: GrowthConfig, json_path: str | None = None, plot_path: str | None = None,
               star: dict | None = None) -> int:
    """Every count, every method; rows printed as they come and written to ``json_path``. With ``star`` (inside the
    trainer's namespace of a ``--link`` run) the servers start in its hosts."""
    from bridge.local.presets import build_model, make_model_dir

    os.makedirs(cfg.workdir, exist_ok=True)
    model_dir = os.path.join(cfg.workdir, f"model-{cfg.preset}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_model_dir(model_dir, cfg.preset)
    model = build_model(cfg.preset)
    nbytes = sum(p.numel() * 2 for p in model.parameters())  # one bf16 copy
    logs = os.path.join(cfg.workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    if star:
        hosts = list(zip(star["names"][1:], star["addrs"][1:]))
        trainer_addr = star["addrs"][0]
    else:
        hosts, trainer_addr = [(None, "127.0.0.1")] * max(cfg.counts), "127.0.0.1"
    rows, version = [], 1
    print(f"{'servers':>7} {'method':>9} {'seconds':>8} {'x 1 server':>10}", flush=True)
    for n in cfg.counts:
        servers = _start_servers(cfg, n, hosts, model_dir, logs)
        try:
            for method in cfg.methods:
                times = _measure(cfg, method, [s.url for s in servers], model, trainer_addr, version)
                version += cfg.repeats + 1
                seconds = statistics.median(times)
                base = next((r["seconds"] for r in rows if r["method"] == method and r["servers"] == cfg.counts[0]),
                            seconds)
                row = dict(servers=n, method=method, seconds=seconds, bytes=nbytes, preset=cfg.preset, times=times,
                           link=cfg.link)
                rows.append(row)
                print(f"{n:>7} {method:>9} {seconds:>8.3f} {seconds / base:>10.2f}", flush=True)
        finally:
            _stop(servers)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": asdict(cfg), "rows": rows}, f, indent=1)
    if plot_path:
        _plot(rows, plot_path, cfg)
    return 0


def _plot(rows: list[dict], path: str, cfg: GrowthConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in cfg.methods:
        pts = [(r["servers"], r["seconds"]) for r in rows if r["method"] == method]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("servers")
    ax.set_ylabel("seconds per sync")
    ax.set_title(f"{cfg.preset}, {cfg.link or 'loopback'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run_linked_growth(cfg: GrowthConfig, json_path: str | None, plot_path: str | None) -> int:
    """Build the star of ``max(counts) + 1`` hosts, run :func:`run_growth` in the trainer's host, remove the star."""
    from bench.netns import require, run_in_namespace

    require()
    star = Star(cfg.link, cfg.link_delay, max(cfg.counts) + 1)
    try:
        star.up()
        spec = {"config": asdict(cfg), "json": json_path, "plot": plot_path,
                "star": {"names": star.names, "addrs": star.addrs}}
        return run_in_namespace(star.names[0], ["-m", "bench.growth", json.dumps(spec)])
    finally:
        star.down()


def check_counts(counts: list[int]) -> list[int]:
    if not counts or any(n < 1 for n in counts):
        raise ConfigError(f"--servers takes counts of servers of at least 1, e.g. --servers 1 2 4 8; got {counts}")
    return sorted(set(counts))


if __name__ == "__main__":  # the driver inside the trainer's host of a --link run
    spec = json.loads(sys.argv[1])
    sys.exit(run_growth(GrowthConfig(**spec["config"]), spec["json"], spec["plot"], spec["star"]))
