"""``wsync register``: keep a server's entry in a registry alive while the server answers.

The sidecar for a server that cannot register itself (real SGLang): next to ``python -m
sglang.launch_server --port 30000``, ``wsync register --server http://10.0.0.5:30000 --registry
etcd://10.0.0.1:2379 --experiment E --trial T`` keeps ``wsync/E/T/servers/10.0.0.5:30000`` under a lease
while the server answers ``/health`` (any answer: SGLang's 503 while paused counts), deletes it when the
server stops answering (and puts it back when it answers again), and deletes it on Ctrl-C or SIGTERM. A
publisher with ``--server-registry etcd://10.0.0.1:2379`` finds the server at its next publish. The
reference server does the same by itself with ``wsync serve --register URL``.
"""

from __future__ import annotations

import argparse
import signal
import threading

from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, metavar="URL", help="the server to register, as publishers reach it")
    p.add_argument("--registry", required=True, metavar="URL",
                   help="where: etcd://host:port, or file:///dir on one host (a router is not a registry: see "
                        "docs/fleet.md)")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="the experiment whose publisher the server serves")
    p.add_argument("--trial", default=DEFAULT_TRIAL, help="the trial whose publisher the server serves")
    p.add_argument("--ttl", type=float, default=10.0, help="seconds the entry outlives this sidecar (at most 30)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two /health checks")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO; env WSYNC_LOG_LEVEL)")


def run(args: argparse.Namespace) -> int:
    from bridge.errors import ConfigError
    from bridge.fleet import Registration

    if not args.interval > 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}")
    registration = Registration(args.registry, args.server, args.experiment, args.trial, ttl=args.ttl)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"wsync register: keeping {registration.key} in {args.registry} while {registration.url} answers /health "
          "(Ctrl-C to stop)", flush=True)
    registration.follow(stop, interval=args.interval)
    print(f"wsync register: removed {registration.key}", flush=True)
    return 0
