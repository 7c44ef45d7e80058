"""Run a function on N ranks of a real torch.distributed (gloo) job, as torchrun would.

Each rank is a process with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set; the function
runs with the default process group already initialised and its return value (picklable) comes back.
An exception on any rank fails the call with that rank's traceback; a hang fails after ``timeout``.

Ranks are forked from a forkserver that imported torch, transformers and the project once per test
session (:data:`PRELOAD`): a rank starts in under a second instead of re-importing them for about 5 s.
What a launch would give a rank is given to each one: the test process's environment as it is at the
call (a failpoint set just before, say), and Python's own SIGINT handler (the forkserver ignores SIGINT,
its children get the handler back).

    results = run_ranks(_my_test_body, world_size=2, args=(tmp_path,))
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from bridge.process_group import find_free_port

PRELOAD = ["tests.preload", "safetensors.torch", "bridge.publisher.core",
           "bridge.transports.broadcast", "bridge.transports.colocated", "bridge.transports.disk",
           "bridge.encodings.delta", "trainer.engine", "inference_adapter.server", "inference_adapter.model_state",
           "fastapi", "uvicorn", "tests.sync_bodies", "tests.engine_bodies"]
"""Imported once by the forkserver, before any process is forked from it (the ranks here, the reference
servers of tests/fixtures_server.py). Only imports: nothing here may start a thread or touch a device at
import, or the forked processes would inherit a broken copy."""

_ctx = None


def forked_context():
    """The multiprocessing context whose processes fork from the test session's preloaded forkserver."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _entry(fn, rank, world_size, port, args, kwargs, q, init_pg, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(*args, **kwargs)
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die with the rank.
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    init_pg: bool = True,
    may_die: tuple[int, ...] = (),
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

    Ranks in ``may_die`` are allowed to exit without a result (a test that kills them): their result
    is None, and the other ranks are waited for.
    """
    ctx = forked_context()
    q = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, kwargs or {}, q, init_pg, dict(os.environ)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                rank, ok, out = q.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                for r in [r for r in dead if r in may_die]:
                    results[r] = None
                dead = [r for r in dead if r not in may_die]
                if dead:
                    raise AssertionError(f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within {timeout} s") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{out}")
            results[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
