"""``wsync watch``: load every version announced in name resolution into a set of servers.

The command line around ``inference_adapter.DiskWatcher``: it follows announcements until Ctrl-C or
SIGTERM, and ends with one line and a non-zero status when the watcher stops by itself (etcd
unreachable, for instance) or when ``--once`` loads nothing.
"""

from __future__ import annotations

import argparse
import signal
import threading

from bridge.errors import BridgeError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from inference_adapter.watcher import add_arguments as add

    add(p)


def run(args: argparse.Namespace) -> int:
    from bridge.client import ServerGroup
    from bridge.metrics import serve_metrics
    from inference_adapter.watcher import DiskWatcher

    if args.metrics_port is not None:
        serve_metrics(args.metrics_port)
    group = ServerGroup(args.servers, api_key=args.api_key, timeout=args.timeout)
    watcher = DiskWatcher(args.name_resolve, args.experiment, args.trial, group, root=args.root,
                          abort_all_requests=args.abort_all_requests, request_timeout=args.timeout)
    if args.once:
        try:
            return _once(watcher, args)
        finally:
            watcher.stop()
    return _follow(watcher)


def _once(watcher, args: argparse.Namespace) -> int:
    """Load the newest announced version; one line says what was loaded, or why nothing was."""
    from bridge import VersionSubscriber

    version = watcher.catch_up()
    if version is not None:
        print(f"wsync watch: loaded version {version} into {', '.join(args.servers)}")
        return 0
    where = f"{args.experiment}/{args.trial} in {args.name_resolve}"
    latest = VersionSubscriber(watcher.nr, args.experiment, args.trial, root=args.root).latest()
    if latest is None:
        raise BridgeError(f"no version announced yet for {where}; publish one with "
                          f"`wsync train --publish disk` (same --experiment, --trial and --name-resolve)")
    raise BridgeError(f"version {latest.version} is announced for {where}, but no server loaded it (the reason is "
                      f"logged above); fix that and rerun")


def _follow(watcher) -> int:
    """Follow announcements until a signal; a watcher that dies on its own is an error, not an exit 0."""
    died: list[BaseException] = []

    def follow() -> None:
        try:
            watcher.run_forever()
        except BaseException as e:  # reported by the command, below
            died.append(e)

    def on_signal(signum, frame):
        threading.Thread(target=watcher.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    thread = threading.Thread(target=follow, name="wsync-watch", daemon=True)
    thread.start()
    thread.join()  # signal handlers still run while the main thread waits here
    watcher.stop()
    if died:
        raise BridgeError(f"the watcher stopped: {died[0]}") from died[0]
    return 0
