"""``wsync status``: one table of the fleet, and an exit status that says whether it is healthy.

``wsync status --server-registry etcd://10.0.0.1:2379 --experiment E --trial T`` lists every server the registry
(or a router: ``router+http://host:port``, or ``--server URL`` for a fixed list) knows, with the version it serves,
whether it answers, is paused or out of rotation (and why: ``torn: ...`` for one a failed sync left paused), and how
many versions it is behind the newest (announced on disk with ``--name-resolve``, else served by any of them). It
exits 0 when every server is on the newest version and in rotation, 1 when one is not, so it fits a readiness probe;
``--json`` prints the same for scripts, ``--watch S`` refreshes it every S seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", default=[], metavar="URL", dest="servers",
                   help="a server to show (repeat for several)")
    p.add_argument("--server-registry", action="append", default=[], metavar="URL", dest="registries",
                   help="where the servers are found, as a publisher finds them: etcd://host:port, file:///dir, or "
                        "router+http://host:port (repeat for several)")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="the experiment whose servers to show")
    p.add_argument("--trial", default=DEFAULT_TRIAL, help="the trial whose servers to show")
    p.add_argument("--name-resolve", metavar="URL",
                   help="where disk versions are announced (etcd://host:port, file:///dir): their newest is the "
                        "fleet's newest (default: the newest any server serves)")
    p.add_argument("--writer-lock", default=None, metavar="URL",
                   help="the trainers' --writer-lock: a paused server a trainer that died mid-sync left is named so")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each server has to answer")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--watch", type=float, metavar="S", help="refresh every S seconds until Ctrl-C")


def run(args: argparse.Namespace) -> int:
    from bridge.errors import ConfigError
    from bridge.fleet.status import fleet_status

    if not args.servers and not args.registries:
        raise ConfigError("no servers to show: give --server URL or --server-registry URL")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.watch is not None and not args.watch > 0:
        raise ConfigError(f"--watch must be a positive number of seconds, got {args.watch}")
    while True:
        status = fleet_status(args.servers, args.registries, experiment=args.experiment, trial=args.trial,
                              name_resolve=args.name_resolve, timeout=args.timeout, writer_lock=args.writer_lock)
        print(status.to_json() if args.json else status.table(), flush=True)
        if args.watch is None:
            return 0 if status.healthy else 1
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0 if status.healthy else 1
        if not args.json:
            print(file=sys.stdout)
