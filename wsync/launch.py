"""Start the trainer's ranks: re-run the current ``wsync`` command under torchrun when needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["ARGV_ENV", "under_torchrun", "torchrun"]

ARGV_ENV = "WSYNC_RANK_ARGV"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun(nproc: int, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start ``python -m wsync.cli ARGV`` on ``nproc`` local ranks with torchrun (standalone rendezvous)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "wsync.cli"]
    # The ranks' arguments travel in the environment: torchrun would take flags such as --nproc for its own.
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}),
                ARGV_ENV: json.dumps(list(argv))}
    # Start in a new session so Ctrl-C handling and cleanup can signal the whole rank tree.
    return subprocess.Popen(cmd, env=full_env, start_new_session=True)
