"""One trainer rank of the multi-host tests (:mod:`tests.test_multihost`), started by torchrun on a host
made of a network namespace: train, publish, and write what happened to ``<out>/rank<R>.json``.

    torchrun ... -m tests.multihost_rank --out DIR --transport broadcast --server URL [--server URL]
        [--versions N] [--fail-version V] [--name-resolve URL --snapshot-root DIR] [--group-timeout S]
        [--http-timeout S]

Each version is one training step then one publish. Rank 0 compares what every server serves with the
trainer's own weights after each successful publish (:func:`tests.sync_bodies.check_served`). A publish
that raises is recorded (the error's class and text, and ``time.time()`` when it was raised, so the test
can time it against the fault it caused) and ends the run; ``--fail-version`` is the version at which the
test expects that (the failpoints come in ``WSYNC_FAILPOINTS``). Before a failing publish rank 0 records
the trainer's own checksums of the last published version and of the new weights, for the test to tell
the server's state apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--transport", default="broadcast")
    p.add_argument("--server", action="append", default=[])
    p.add_argument("--versions", type=int, default=1)
    p.add_argument("--fail-version", type=int)
    p.add_argument("--name-resolve")
    p.add_argument("--snapshot-root")
    p.add_argument("--trial", default="multihost")
    p.add_argument("--group-timeout", type=float, default=30.0)
    p.add_argument("--http-timeout", type=float, default=20.0)
    p.add_argument("--bucket-mb", type=float, default=0.1)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError
    from tests.sync_bodies import check_served, engine, own_checksums, train_step

    eng = engine()
    options = {}
    if args.transport == "disk":
        options = dict(name_resolve=args.name_resolve, snapshot_root=args.snapshot_root, wait_loaded_timeout=60.0)
    pub = WeightPublisher(PublisherConfig(
        transport=args.transport, servers=args.server, trial=args.trial, bucket_mb=args.bucket_mb, progress=False,
        group_timeout=args.group_timeout, http_timeout=args.http_timeout, **options))
    report: dict = {"rank": eng.rank, "host": os.uname().nodename, "published": [], "served": {}, "error": None}
    try:
        for v in range(1, args.versions + 1):
            train_step(eng, v)
            if v == args.fail_version:
                report["own_before"] = report.pop("own_last", None)
                report["own_after"] = own_checksums(eng)
                if eng.rank == 0:  # the test waits for this to cause its fault
                    open(os.path.join(args.out, f"publishing-v{v}"), "w").close()
            try:
                res = pub.publish(eng, version=v)
            except BridgeError as e:
                report["error"] = {"type": type(e).__name__, "message": str(e), "at": time.time()}
                break
            report["published"].append(v)
            report["served"][str(v)] = check_served(eng, args.server, v)  # collective
            if args.transport == "disk":
                report["path"] = res.path
            report["own_last"] = own_checksums(eng)
    finally:
        pub.close()
        eng.destroy()
        with open(os.path.join(args.out, f"rank{report['rank']}.json"), "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
