"""Fixtures that run the reference server as a real subprocess on a free loopback port.

``ref_server``: the tiny preset speaking SGLang 0.5.23, one per test module. ``server_factory``: starts
more servers (flags as ``extra_args``), several at once with ``server_factory.many``; everything is
stopped at module teardown. Servers accept versions older than the served one
(``--allow-version-rollback``), since publishers of successive tests restart at version 1; pass
``strict_versions=True`` for the production behaviour. They load snapshots from anywhere under the
temp folder (``--disk-root``), where pytest's folders are; ``default_disk_roots=True`` keeps the default. :class:`Trainer` plays trainer rank 0 of a weight-update group inside the
test process: it joins the group while the HTTP init runs in a thread, announces each update over HTTP
and broadcasts the tensors concurrently, as a real trainer does.

Tests that change weights must not assume the initial weights: the servers live for a whole module.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist

from bridge.client import ServerClient
from bridge.errors import ServerError
from bridge.process_group import destroy_custom_process_group, find_free_port, init_custom_process_group
from bridge.tensors import dtype_to_str
from inference_adapter import launcher
from inference_adapter.launcher import LaunchedServer, launch_server
from tests.dist_utils import forked_context

__all__ = ["Trainer", "greedy", "local_model", "random_weights"]

_group_ids = itertools.count()
# Short group timeout: a test that goes wrong fails in seconds instead of hanging.
GROUP_TIMEOUT = 20.0


def _launch(**kw) -> LaunchedServer:
    kw.setdefault("preset", "tiny")
    extra = list(kw.pop("extra_args", ()))
    if "--group-timeout" not in extra:
        extra += ["--group-timeout", str(GROUP_TIMEOUT)]
    # A module's server outlives its tests' publishers, whose versions restart at 1: let them go back,
    # unless the test is about refusing exactly that.
    if not kw.pop("strict_versions", False):
        extra += ["--allow-version-rollback"]
    # Tests write snapshots into pytest's temp folders; the server's default roots are narrower
    # (``default_disk_roots=True`` keeps them, for the test of exactly that).
    if not kw.pop("default_disk_roots", False) and "--disk-root" not in extra:
        extra += ["--disk-root", tempfile.gettempdir()]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **kw.pop("env", {})}
    launch = launch_server if kw.get("use_sglang") else launch_forked
    ready_timeout = kw.pop("ready_timeout", 240.0)
    # A free port is found, closed, then bound by the server: another process (the other xdist worker's
    # servers, ranks, routers) may take it in between. A port the test did not choose is chosen again.
    for attempt in range(3):
        try:
            return launch(extra_args=extra, env=env, ready_timeout=ready_timeout, **kw)
        except ServerError as e:
            if kw.get("port") or "address already in use" not in str(e) or attempt == 2:
                raise


class ForkedProcess:
    """What a test reads of a server's ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``returncode``,
    signals), for a server forked from the preloaded forkserver instead of started with ``python -m``."""

    def __init__(self, process) -> None:
        self._process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"reference server pid {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve(argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """The forked server's body: what ``launch_server``'s ``Popen`` gives the child (a session of its own,
    stdout and stderr into the log, the environment, the working directory), then the server's ``main``."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from inference_adapter.server import main

    raise SystemExit(main(argv))


def launch_forked(*, model: str | None = None, preset: str | None = None, port: int | None = None,
                  host: str = "127.0.0.1", dtype: str = "bfloat16", extra_args: Sequence[str] = (),
                  ready_timeout: float = 240.0, api_key: str | None = None, env: dict[str, str] | None = None,
                  disk_roots: Sequence[str] = (), use_sglang: bool | None = False) -> LaunchedServer:
    """``launch_server`` for the reference server, forked from the preloaded forkserver: the same command
    line, environment and log, without importing torch, transformers and the server again (about 2.5 s a
    server). The server's command-line entry point itself is tested by ``wsync serve`` tests."""
    port = port or find_free_port(host)
    argv = launcher.server_command(model, preset or ("tiny" if model is None else None), host, port, dtype,
                             disk_roots)[3:] + [str(a) for a in extra_args]
    fd, log_path = tempfile.mkstemp(prefix=f"wsync-reference-{port}-", suffix=".log")
    os.close(fd)
    child_env = {**os.environ, **(env or {})}
    process = forked_context().Process(target=_serve, args=(argv, child_env, log_path, launcher.CHECKOUT), daemon=True,
                                       name=f"reference-server-{port}")
    process.start()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    server = LaunchedServer(ForkedProcess(process), url, ServerClient(url, api_key=api_key, timeout=60.0), log_path,
                            "reference", None)
    launcher.wait_until_ready(server, ready_timeout)
    return server


class _Factory:
    def __init__(self) -> None:
        self.started: list[LaunchedServer] = []

    def __call__(self, **kw) -> LaunchedServer:
        s = _launch(**kw)
        self.started.append(s)
        return s

    def many(self, specs: Sequence[dict]) -> list[LaunchedServer]:
        """Start several servers concurrently (each spec is launch_server's keyword arguments)."""
        with cf.ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(_launch, **spec) for spec in specs]
        servers, errors = [], []
        for f in futures:
            try:
                servers.append(f.result())
            except Exception as e:  # stop the others, then report
                errors.append(e)
        self.started.extend(servers)
        if errors:
            raise errors[0]
        return servers

    def stop_all(self) -> None:
        if self.started:  # at once: each waits for its server's graceful shutdown
            with cf.ThreadPoolExecutor(len(self.started)) as pool:
                list(pool.map(lambda s: s.stop(), self.started))


@pytest.fixture(scope="module")
def server_factory():
    """Start reference servers (``launch_server`` keywords); all are stopped when the module ends."""
    f = _Factory()
    try:
        yield f
    finally:
        f.stop_all()


@pytest.fixture(scope="module")
def ref_server(server_factory) -> LaunchedServer:
    """The tiny preset (seed 0, bfloat16) speaking SGLang 0.5.23; shared by the tests of one module."""
    return server_factory()


def random_weights(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Fresh weights for every parameter of the tiny preset, scaled so greedy outputs are not degenerate."""
    from bridge.local.presets import build_model

    model = build_model("tiny", seed=0)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            t = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 2.0
        else:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        out[n] = t.to(dtype)
    return out


def local_model(weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16):
    """The oracle: the tiny preset with ``weights`` loaded, in the serving dtype."""
    from bridge.local.presets import build_model

    model = build_model("tiny", seed=0).to(dtype).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def greedy(model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """The new tokens of ``model.generate(do_sample=False)`` (stopping at EOS unless ``ignore_eos``)."""
    ids = torch.tensor([prompt])
    eos = model.generation_config.eos_token_id
    if ignore_eos:
        model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(prompt):].tolist()


class Trainer:
    """Rank 0 of a weight-update group with ``clients``, inside the test process (gloo, loopback)."""

    def __init__(self, clients: Sequence[ServerClient], *, group_name: str | None = None, timeout: float = GROUP_TIMEOUT):
        self.clients = list(clients)
        self.group_name = group_name or f"wsync-test-{os.getpid()}-{next(_group_ids)}"
        self.timeout = timeout
        self.pg = None
        self.broadcast_error: Exception | None = None
        self.pool = cf.ThreadPoolExecutor(max_workers=2 * len(self.clients) + 2)

    def connect(self) -> Trainer:
        port = find_free_port()
        world = 1 + len(self.clients)
        futures = [
            self.pool.submit(c.init_weights_update_group, "127.0.0.1", port, 1 + i, world, self.group_name, "gloo",
                             self.timeout + 10)
            for i, c in enumerate(self.clients)
        ]
        self.pg = init_custom_process_group(master_address="127.0.0.1", master_port=port, world_size=world, rank=0,
                                            group_name=self.group_name, backend="gloo", timeout=self.timeout)
        for f in futures:
            f.result()
        return self

    def send(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        flattened: bool = False,
        weight_version: str | None = None,
        announce: dict | None = None,
        wire: Sequence[torch.Tensor] | None = None,
        broadcast: bool = True,
        group_name: str | None = None,
        clients: Sequence[ServerClient] | None = None,
    ) -> list[dict | Exception]:
        """Announce ``tensors`` to every server and broadcast them; the per-server answers (or exceptions).

        ``announce`` overrides the names/dtypes/shapes sent over HTTP, ``wire`` the tensors (or, with
        ``flattened``, the single uint8 buffer) actually broadcast; ``broadcast=False`` sends nothing.
        """
        fields = dict(
            names=[n for n, _ in tensors], dtypes=[dtype_to_str(t.dtype) for _, t in tensors],
            shapes=[list(t.shape) for _, t in tensors],
        )
        fields.update(announce or {})
        futures = [
            self.pool.submit(
                c.update_weights_from_distributed, **fields, group_name=group_name or self.group_name,
                load_format="flattened_bucket" if flattened else None, weight_version=weight_version,
                timeout=self.timeout + 10,
            )
            for c in (clients or self.clients)
        ]
        if broadcast:
            if wire is None:
                wire = [t.contiguous() for _, t in tensors]
                if flattened:
                    wire = [torch.cat([t.reshape(-1).view(torch.uint8) for t in wire])] if wire else []
            self.broadcast_error = None
            try:
                for t in wire:
                    dist.broadcast(t, src=0, group=self.pg)
            except RuntimeError as e:  # the server dropped the group without receiving
                self.broadcast_error = e
        out: list[dict | Exception] = []
        for f in futures:
            try:
                out.append(f.result(timeout=self.timeout + 20))
            except Exception as e:  # the caller asserts on it
                out.append(e)
        return out

    def close(self) -> None:
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self.group_name)
            except Exception:  # the server may have dropped it already
                pass
        destroy_custom_process_group(self.pg)
        self.pg = None
        self.pool.shutdown(wait=False)

    def __enter__(self) -> Trainer:
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()
