"""Start a command's trainer ranks on this machine, and turn their failure into one line.

The ranks are plain processes with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...,
a static world on loopback), so the code inside them is exactly what runs under torchrun. They are
started directly rather than through the torchrun command so that a failure reads as the ranks' own
error, once: a rank that fails writes its one-line error into the job's error folder instead of
printing it, and the command that started the job raises the ranks' distinct errors, while torchrun
would print the error once per rank and then ~35 lines of its own ``ChildFailedError`` report.

Each rank runs ``python -m wsync`` with its arguments in ``WSYNC_RANK_ARGV`` (:data:`ARGV_ENV`), which
``wsync.cli.main`` reads: a new process, or, where the command line passes its ``main`` and no other thread runs
(:func:`can_fork`), a child forked from the command, which has already imported torch and transformers (the imports
are a rank's largest start-up cost on a small machine; ``WSYNC_SPAWN_RANKS=1`` spawns). The commands, the bench and
the tests all start ranks with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["ARGV_ENV", "SPAWN_ENV", "ForkedRank", "RankJob", "can_fork", "report_rank_error", "run_ranks", "start_ranks",
           "under_torchrun"]

ARGV_ENV = "WSYNC_RANK_ARGV"
ERROR_DIR_ENV = "WSYNC_RANK_ERROR_DIR"
SPAWN_ENV = "WSYNC_SPAWN_RANKS"
"""Set (to anything): every rank is a new ``python -m wsync`` process, never forked (:func:`can_fork`)."""


def under_torchrun() -> bool:
    """True in a rank process (started here, by torchrun, or by any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def report_rank_error(message: str) -> bool:
    """In a rank started by :func:`start_ranks`: hand ``message`` to the starting command; False elsewhere."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not under_torchrun():
        return False
    with open(os.path.join(folder, f"rank{os.environ['RANK']}"), "w") as f:
        f.write(message)
    return True


class RankJob:
    """The ranks of one job. ``pid`` is their process group's id (``os.killpg`` stops every rank)."""

    def __init__(self, procs: list[subprocess.Popen], error_dir: str) -> None:
        self.procs, self.error_dir = procs, error_dir
        self.pid = procs[0].pid
        self.returncode: int | None = None

    def wait(self, grace: float = 10.0) -> int:
        """Wait until every rank exited; when one fails, stop the others. Returns the first failure's code."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                break
            time.sleep(0.05)
        if failed:
            self._stop_others(grace)
        self.returncode = failed[0] if failed else 0
        return self.returncode

    def errors(self) -> list[str]:
        """The ranks' distinct error lines, rank 0's first; a rank that died without one is described."""
        out: list[str] = []
        for rank, p in enumerate(self.procs):
            path = os.path.join(self.error_dir, f"rank{rank}")
            if os.path.exists(path):
                with open(path) as f:
                    line = f.read().strip()
            elif p.returncode not in (None, 0) and p.returncode < 0 and p.returncode != -signal.SIGTERM:
                line = f"trainer rank {rank} was killed by signal {signal.Signals(-p.returncode).name}"
            else:
                continue
            if line and line not in out:
                out.append(line)
        return out

    def failure(self) -> str:
        """One message for a failed job: the ranks' distinct errors, or a pointer to their output."""
        return "\n".join(self.errors()) or (
            f"a trainer rank exited with code {self.returncode} without an error message (its output is above); "
            f"rerun with --debug for tracebacks")

    def terminate(self) -> None:
        """Stop every rank: one SIGTERM to the group (a rank in a sync finishes its step and leaves every
        server on its previous version first; a second SIGTERM would stop it at once), SIGKILL after 10 s."""
        self._stop_others(10.0)

    def close(self) -> None:
        """Delete the error folder (after :meth:`failure` was read)."""
        shutil.rmtree(self.error_dir, ignore_errors=True)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop_others(self, grace: float) -> None:
        # Ranks blocked in a collective wait for the failed one until their group timeout: stop them now.
        if any(p.poll() is None for p in self.procs):
            self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                p.wait()


class ForkedRank:
    """A rank forked from the command's process: what of :class:`subprocess.Popen` a :class:`RankJob` uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"trainer rank {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def can_fork() -> bool:
    """True where a rank may be forked from this process: POSIX, no thread but this one (a lock another thread holds
    would stay held in the child), and ``WSYNC_SPAWN_RANKS`` unset."""
    import threading

    return hasattr(os, "fork") and threading.active_count() == 1 and not os.environ.get(SPAWN_ENV)


def _fork(entry, env: dict, group: int) -> ForkedRank:
    """Run ``entry()`` (the command line's main, which reads its arguments from :data:`ARGV_ENV`) in a child forked
    from this process, with ``env`` as its whole environment, in process group ``group`` (0: its own), with the
    signal handlers a new Python process has. The child never returns here: it ends with :func:`os._exit`."""
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, group or pid)  # (the child does it too: whichever runs first)
        except OSError:
            pass
        return ForkedRank(pid)
    code = 1
    try:
        os.setpgid(0, group)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        code = entry()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def start_ranks(nproc: int, argv: list[str], env: dict | None = None, entry=None) -> RankJob:
    """Start ``python -m wsync ARGV`` as ``nproc`` local ranks of one static world (torchrun's environment).

    With ``entry`` (``wsync.cli.main``, passed by the command line) and :func:`can_fork`, each rank is forked from this
    process instead: it starts with the modules this process imported (torch, transformers: seconds of CPU a rank
    on 2 cores), and runs exactly what ``python -m wsync`` would.
    """
    from bridge.process_group import find_free_port

    error_dir = tempfile.mkdtemp(prefix="wsync-rank-errors-")
    base = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}),
            ARGV_ENV: json.dumps(list(argv)), ERROR_DIR_ENV: error_dir,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(nproc)}
    procs: list[subprocess.Popen | ForkedRank] = []
    fork = entry is not None and can_fork()
    try:
        for rank in range(nproc):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            # All ranks in one new process group (rank 0's): Ctrl-C at a terminal reaches only the
            # command, which stops the ranks; os.killpg(job.pid) reaches every rank.
            group = procs[0].pid if procs else 0
            if fork:
                procs.append(_fork(entry, rank_env, group))
            else:
                procs.append(subprocess.Popen([sys.executable, "-m", "wsync"], env=rank_env, process_group=group))
    except BaseException:
        job = RankJob(procs, error_dir)
        job.terminate()
        job.close()
        raise
    return RankJob(procs, error_dir)


def run_ranks(nproc: int, argv: list[str], env: dict | None = None, entry=None) -> None:
    """Run a rank job to its end; stop it on Ctrl-C.

    Raises:
        BridgeError: a rank failed; the message is the ranks' distinct one-line errors.
    """
    from bridge.errors import BridgeError

    job = start_ranks(nproc, argv, env, entry)
    try:
        if job.wait() != 0:
            raise BridgeError(job.failure())
    except KeyboardInterrupt:
        job.terminate()
        raise
    finally:
        job.close()
