"""Ctrl-C, SIGTERM, KeyboardInterrupt and SystemExit in the middle of a sync, with real signals to real processes.

The promise: an interrupt on any rank, at any point of a sync, leaves every server on its previous
version, unpaused, with no open update session, and no temporary snapshot behind; every other rank
raises a ``SyncError`` naming the interrupted rank; the interrupt itself still ends the program
(``KeyboardInterrupt`` / ``SystemExit`` on the interrupted rank, or death by SIGTERM), after that
clean-up. Real SGLang resumes generation only when told to, so the same interrupts run against
SGLang's own code too (the ``sglang_code`` tier), where nothing resumes by itself.

Signals are real: a failpoint (``bucket:2@1=SIGINT``, :mod:`bridge.failpoints`) makes the rank send
itself the signal at a known point, and the command-line tests signal ``wsync train``'s processes from
outside, as a terminal or a scheduler does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests import sync_bodies as sb
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.slow

# (failpoint, rank interrupted, what that rank raises): raised in a step, and real signals.
INTERRUPTS = [
    ("bucket:2@0=KeyboardInterrupt", 0, "KeyboardInterrupt"),
    ("bucket:1@1=SystemExit", 1, "SystemExit"),
    ("bucket:2@1=SIGINT", 1, "KeyboardInterrupt"),  # a real SIGINT to rank 1 only
    ("bucket:1@0=SIGINT", 0, "KeyboardInterrupt"),  # ... and to rank 0 only
    ("bucket:2@0=SIGTERM", 0, "SystemExit"),  # a real SIGTERM; this trainer's handler turns it into SystemExit
]
BOUND_S = 5.0  # from the interrupt to every rank's raise; the interrupts come early in a sub-second sync


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)  # what many training scripts do with SIGTERM


def _observe(urls: list[str], nr_url: str, root: str, disk: bool) -> dict:
    """Rank 0, right after a publish: what each server serves and whether it is usable at once."""
    from tests.test_faults import _announced

    if disk:
        return dict(announced=_announced(nr_url), temporary=[n for n in os.listdir(root) if n.startswith(".tmp")])
    return {url: sb.serving_now(url) for url in urls}


def _interrupt_matrix(urls: list[str], nr_url: str, root: str, transports: list[tuple[str, int]]):
    """Every rank: per transport, publish v0, train, publish v0+1 under each interrupt, then for real."""
    from bridge.failpoints import ENV

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine = sb.engine()
    rank0 = engine.rank == 0
    runs = {}
    try:
        for transport, v0 in transports:
            disk = sb.announces(transport)
            pub = sb.matrix_publisher(transport, urls, nr_url, root)
            try:
                own_before, own_after = sb.publish_then_train(pub, engine, v0)  # the checks below can fail
                run = dict(before=_observe(urls, nr_url, root, disk) if rank0 else None, own_before=own_before,
                           own_after=own_after, outcomes=[])
                for point, _, _ in INTERRUPTS:
                    torch.distributed.barrier()  # rank 0 may still be observing a held server (sb.PROBE_S)
                    os.environ[ENV] = point
                    t = time.monotonic()
                    try:
                        pub.publish(engine, version=v0 + 1)
                        got = ("no error", "", "")
                    except BaseException as e:  # the test records whatever comes, interrupts included
                        cause = e.__cause__ or e.__context__
                        got = (type(e).__name__, str(e), str(cause) if cause is not None else "")
                    finally:
                        del os.environ[ENV]
                    seconds = time.monotonic() - t
                    run["outcomes"].append((got, seconds, _observe(urls, nr_url, root, disk) if rank0 else None))
                pub.publish(engine, version=v0 + 1)  # the trainer goes on
                run["final"] = _final(engine, urls, nr_url, disk, v0 + 1)
            finally:
                pub.close()
            runs[transport] = run
        return runs
    finally:
        engine.destroy()


def _final(engine, urls: list[str], nr_url: str, disk: bool, version: int):
    """After the interrupts, the trainer published ``version`` for real: what was announced, or served."""
    from tests.test_faults import _announced

    return _announced(nr_url) if disk else sb.check_served_any(engine, urls, version)


def _check_matrix(runs0: dict, runs1: dict, transports: list[tuple[str, int]], urls: list[str]):
    for transport, v0 in transports:
        r0, r1 = runs0[transport], runs1[transport]
        for (point, rank, raised), (got0, s0, after), (got1, s1, _) in zip(INTERRUPTS, r0["outcomes"], r1["outcomes"]):
            where = f"{transport}, {point}"
            mine, other = (got0, got1) if rank == 0 else (got1, got0)
            assert mine[0] == raised, f"{where}: the interrupted rank raised {mine}"
            assert other[0] == "SyncError" and f"rank {rank} was interrupted" in other[1], f"{where}: {other}"
            assert f"rank {rank} was interrupted" in mine[2], f"{where}: the interrupt's context: {mine[2]}"
            assert max(s0, s1) < BOUND_S, f"{where}: took {max(s0, s1):.1f} s"
            if sb.announces(transport):
                assert after == dict(announced=[v0], temporary=[]), f"{where}: {after}"
                continue
            for url in urls:  # resumed when publish() raised (sb.assert_resumed); SGLang's own code too: the sync
                # went as one request (atomic_mb), which it loads only once it received every bucket
                sb.assert_left_on(after[url], v0, r0["before"][url], r0["own_before"], r0["own_after"], where)
        if sb.announces(transport):
            assert r0["final"] == [v0, v0 + 1]
        else:
            for url in urls:
                check = r0["final"][url]
                assert check["tensors_equal"] and check["version"] == str(v0 + 1), (transport, check)


TRANSPORTS = sb.matrix_transports()  # the registry's: a new transport joins the matrix with no change here


def test_interrupts_mid_sync_leave_every_server_clean(server_factory, tiny_model_dir, tmp_path):
    """Against two reference servers: each interrupt, mid-broadcast, mid-colocated and mid-disk."""
    servers = server_factory.many([dict(model=tiny_model_dir), dict(model=tiny_model_dir)])
    urls = [s.url for s in servers]
    args = (urls, f"file://{tmp_path / 'nr'}", str(tmp_path / "snap"), TRANSPORTS)
    runs0, runs1 = run_ranks(_interrupt_matrix, 2, args=args, timeout=400)
    _check_matrix(runs0, runs1, TRANSPORTS, urls)


# ------------------------------------------------------------------ the command line, signalled from outside


def _train(argv: list[str], failpoints: str) -> subprocess.Popen:
    """``wsync train`` in a session of its own (so that its process group can be signalled as a terminal would)."""
    env = {**os.environ, "WSYNC_FAILPOINTS": failpoints, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "wsync", "train", "--steps", "1", "--bucket-mb", "0.05", *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(what: str, check, proc: subprocess.Popen, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"wsync train ended before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"no {what} within {within} s"
        time.sleep(0.05)


def _state(url: str, checksums: bool = True) -> dict:
    from bridge.client import ServerClient

    c = ServerClient(url, timeout=10)
    state = c.server_info()["internal_states"][0]
    return dict(state, checksums=c.weights_checksum()["checksums"]) if checksums else state


@pytest.mark.parametrize("signalled", ["ctrl-c", "sigterm-to-rank-1"])
def test_wsync_train_interrupted_mid_broadcast(server_factory, tiny_model_dir, signalled):
    """Ctrl-C at the terminal (SIGINT to the command's process group), or SIGTERM to one rank, whose
    default action ends it: the server is left on its version, unpaused, with no open session."""
    (srv,) = server_factory.many([dict(model=tiny_model_dir)])
    before = _state(srv.url)
    # Rank 0 pauses 3 s in bucket 1 (the server is paused by then); rank 1 signals itself in bucket 1.
    failpoints = "bucket:1@0=sleep:3" if signalled == "ctrl-c" else "bucket:1@1=SIGTERM"
    proc = _train(["--publish", "broadcast", "--server", srv.url, "--new-run"], failpoints)
    try:
        if signalled == "ctrl-c":
            _wait_for("paused server", lambda: _state(srv.url, checksums=False)["paused"], proc)
            os.killpg(proc.pid, signal.SIGINT)
        t = time.monotonic()
        _, err = proc.communicate(timeout=60)
        ended_s = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    now = _state(srv.url)
    last = err.strip().splitlines()[-1]
    if signalled == "ctrl-c":
        # The ranks finish the step (rank 0's 3 s pause), clean up, then end; the launcher waits 10 s for them.
        assert proc.returncode == 130 and last == "wsync train: interrupted", (proc.returncode, err[-2000:])
        assert ended_s < 10, f"the command took {ended_s:.1f} s to end after Ctrl-C"
    else:
        assert proc.returncode == 1 and "rank 1 was interrupted at bucket 1 (SIGTERM)" in last, (proc.returncode, err[-2000:])
    assert (now["weight_version"], now["paused"], now["update_session_open"]) == (before["weight_version"], False, False), now
    assert now["checksums"] == before["checksums"], "the served weights changed"
    assert now["weight_update_groups"] == [] and now["writer_lease"] is None, now


def test_wsync_train_ctrl_c_mid_disk_announces_nothing_and_leaves_no_temporary(tmp_path):
    nr, root = f"file://{tmp_path / 'nr'}", tmp_path / "snap"
    proc = _train(["--publish", "disk", "--name-resolve", nr, "--snapshot-root", str(root)], "bucket:1@0=sleep:3")
    try:
        _wait_for("temporary snapshot", lambda: root.is_dir() and any(n.startswith(".tmp") for n in os.listdir(root)), proc)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    from tests.test_faults import _announced

    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert _announced(nr) == [] and os.listdir(root) == [], (os.listdir(root), err[-3000:])


# ------------------------------------------------------------------ the hold itself, in this process


SIGNAL_S = 5.0  # a signal sent to this process is handled at its next bytecode; generous for a busy machine


def _wait(check) -> bool:
    """Poll ``check`` (the handler of a signal just sent has run) instead of sleeping a fixed time; False
    when it did not come true within SIGNAL_S."""
    deadline = time.monotonic() + SIGNAL_S
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _recorded() -> list[str]:
    """The signals the active hold recorded (``pending()`` names only the first)."""
    from bridge.publisher import interrupts

    return [signal.Signals(s).name for s in interrupts._active[-1].received] if interrupts._active else []


def test_a_held_signal_takes_effect_when_the_sync_ends_and_twice_at_once():
    """What the block reached is recorded, and checked outside it: an AssertionError raised inside ``held()``
    is replaced by the held KeyboardInterrupt on leaving it, which ``pytest.raises`` accepts (the checks
    inside passed against a ``held()`` that holds nothing, and one where a second SIGINT waits too)."""
    from bridge.publisher.interrupts import held, pending

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with held(rank=0):
            os.kill(os.getpid(), signal.SIGINT)
            reached.append(("SIGINT recorded", _wait(lambda: pending() is not None), pending()))
            os.kill(os.getpid(), signal.SIGTERM)  # another kind is held too (torchrun's answer to Ctrl-C)
            reached.append(("SIGTERM recorded", _wait(lambda: "SIGTERM" in _recorded()), pending()))
    # Not reached where the SIGINT raised at once; the first signal held is the one delivered.
    assert reached == [("SIGINT recorded", True, "SIGINT"), ("SIGTERM recorded", True, "SIGINT")], reached
    assert pending() is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler

    reached = []
    with pytest.raises(KeyboardInterrupt):  # the same signal twice: at once, inside the block
        with held(rank=0):
            os.kill(os.getpid(), signal.SIGINT)
            reached.append(("first SIGINT held", _wait(lambda: pending() is not None)))
            os.kill(os.getpid(), signal.SIGINT)
            _wait(lambda: False)  # only the second SIGINT's KeyboardInterrupt ends this wait early
            reached.append(f"the second SIGINT did not act within {SIGNAL_S} s")
    assert reached == [("first SIGINT held", True)], reached
    assert pending() is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_trainers_own_sigterm_handler_runs_after_the_sync():
    from bridge.publisher.interrupts import held

    seen = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with held(rank=0):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == []
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_outside_the_main_thread_nothing_is_installed():
    import threading

    from bridge.publisher.interrupts import held

    box = []

    def run():
        with held(rank=0):
            box.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert box == [signal.default_int_handler]
