"""``wsync watch``: load every version announced in name resolution into a set of servers.

The command line around ``inference_adapter.DiskWatcher``: it follows announcements until Ctrl-C or
SIGTERM, and ends with one line and a non-zero status when the watcher stops by itself (etcd
unreachable, for instance) or when ``--once`` loads nothing. With ``--server-registry`` the servers are the
ones the registry lists, re-read every ``--heal-every`` seconds; every round, a server that serves another
version than the loaded one (it joined, or restarted on its base weights) is brought to it from its snapshot, and,
with ``--writer-lock``, a server a trainer that died mid-sync left paused is given back (:mod:`bridge.fleet.abandoned`).
"""

from __future__ import annotations

import argparse
import signal
import threading

from bridge.errors import BridgeError, ConfigError
from bridge.log import get_logger
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL, DEFAULT_URL

log = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name-resolve", default=DEFAULT_URL, metavar="URL",
                   help="etcd://host:port, file:///dir or memory://name")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT,
                   help="experiment name the trainer publishes under (as wsync train)")
    p.add_argument("--trial", default=DEFAULT_TRIAL, help="trial name the trainer publishes under (as wsync train)")
    p.add_argument("--server", action="append", default=[], metavar="URL", dest="servers",
                   help="a server to load every version into (repeat for several)")
    p.add_argument("--server-registry", action="append", default=[], metavar="URL", dest="registries",
                   help="load into the servers this registry lists (etcd://host:port or file:///dir, where `wsync "
                        "register` and `wsync serve --register` keep them, under --experiment/--trial), re-read every "
                        "--heal-every seconds (repeat for several; beside --server)")
    p.add_argument("--heal-every", type=float, default=2.0, metavar="S",
                   help="every S seconds, bring each server that serves another version than the loaded one (one "
                        "that joined, or restarted on its base weights) to it from its snapshot; 0: never")
    p.add_argument("--writer-lock", default=None, metavar="URL",
                   help="the trainers' --writer-lock (etcd://host:port or file:///dir): every --heal-every seconds, "
                        "a real SGLang server a trainer that died mid-sync left paused is resumed (from the loaded "
                        "snapshot where that sync may have torn it); default: not looked for")
    p.add_argument("--root", default="wsync", help="key root in name resolution")
    p.add_argument("--api-key", default=None, help="the servers' API key, if they need one")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one server may take to load a version")
    p.add_argument("--abort-all-requests", action="store_true",
                   help="abort in-flight generation requests before each load")
    p.add_argument("--once", action="store_true", help="load the newest announced version, then exit")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (loaded version, lag in versions and seconds, load seconds, "
                        "failures; bridge.metrics) at http://HOST:PORT/metrics (default: off)")


def run(args: argparse.Namespace) -> int:
    from bridge.client import ServerGroup
    from bridge.fleet.discovery import open_sources
    from bridge.metrics import serve_metrics
    from inference_adapter.watcher import DiskWatcher

    if not args.servers and not args.registries:
        raise ConfigError("name the servers to load into: --server URL (repeat) or --server-registry URL")
    if args.heal_every < 0:
        raise ConfigError(f"--heal-every must be 0 (never) or a positive number of seconds, got {args.heal_every}")
    if args.metrics_port is not None:
        serve_metrics(args.metrics_port)
    sources = open_sources(args.servers, args.registries, args.experiment, args.trial)
    group = ServerGroup(_urls(sources), api_key=args.api_key, timeout=args.timeout, allow_empty=True)
    watcher = DiskWatcher(args.name_resolve, args.experiment, args.trial, group, root=args.root,
                          abort_all_requests=args.abort_all_requests, request_timeout=args.timeout,
                          writer_lock=args.writer_lock)
    try:
        if args.once:
            return _once(watcher, args)
        return _follow(watcher, sources, args.heal_every)
    finally:
        watcher.stop()
        for source in sources:
            source.close()


def _urls(sources) -> list[str]:
    return list(dict.fromkeys(u for source in sources for u in source.urls()))


def _once(watcher, args: argparse.Namespace) -> int:
    """Load the newest announced version; one line says what was loaded, or why nothing was."""
    from bridge import VersionSubscriber

    version = watcher.catch_up()
    if version is not None:
        print(f"wsync watch: loaded version {version} into {', '.join(watcher.status())}")
        return 0
    where = f"{args.experiment}/{args.trial} in {args.name_resolve}"
    latest = VersionSubscriber(watcher.nr, args.experiment, args.trial, root=args.root).latest()
    if latest is None:
        raise BridgeError(f"no version announced yet for {where}; publish one with "
                          f"`wsync train --publish disk` (same --experiment, --trial and --name-resolve)")
    raise BridgeError(f"version {latest.version} is announced for {where}, but no server loaded it (the reason is "
                      f"logged above); fix that and rerun")


def _follow(watcher, sources, heal_every: float) -> int:
    """Follow announcements until a signal, and the fleet every ``heal_every`` seconds; a watcher that dies on its
    own is an error, not an exit 0."""
    died: list[BaseException] = []
    stop = threading.Event()

    def follow() -> None:
        try:
            watcher.run_forever()
        except BaseException as e:  # reported by the command, below
            died.append(e)
        finally:
            stop.set()

    def heal() -> None:
        while not stop.wait(heal_every):
            try:
                watcher.follow(_urls(sources))
                watcher.heal()
            except BridgeError as e:  # a registry that does not answer now: the next round asks again
                log.warning("could not follow the fleet this round: %s", e)

    def on_signal(signum, frame):
        stop.set()
        threading.Thread(target=watcher.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    thread = threading.Thread(target=follow, name="wsync-watch", daemon=True)
    thread.start()
    if heal_every > 0:
        threading.Thread(target=heal, name="wsync-watch-heal", daemon=True).start()
    thread.join()  # signal handlers still run while the main thread waits here
    if died:
        raise BridgeError(f"the watcher stopped: {died[0]}") from died[0]
    return 0
