"""Start real SGLang on this host: where it comes from, its command line and environment, the wait until it
generates, and the stop by its process group.

On a host with a CUDA device SGLang runs as shipped: ``python -m sglang.launch_server`` from this environment,
with the flags given. On a host without one, SGLang 0.5.23's whole server (HTTP server, tokenizer manager,
scheduler and detokenizer processes) runs on its CPU engine, with:

- ``SGLANG_USE_CPU_ENGINE=1`` and :data:`CPU_FLAGS` (``--device cpu``, the torch-native attention and sampling
  backends, no CUDA graphs, a small KV cache; a flag given in ``extra_args`` wins over its default here);
- the stand-ins of ``inference_adapter/sglang_cpu`` on ``PYTHONPATH`` (its kernel package and torchvision have
  no CPU build on the package index; pinned memory needs an accelerator): test infrastructure, never used
  where there is a GPU;
- SGLang itself from this environment, or else the folder ``scripts/install_sglang.sh`` unpacked it into
  (``$WSYNC_SGLANG_CACHE/sglang-0.5.23``, :func:`find_sglang`).

The checkout is on the server's ``PYTHONPATH`` too, so ``--custom-weight-loader
bridge.serving.sglang_delta_loader.load_delta`` resolves in SGLang's scheduler.

Example (about 20 s to start on 2 CPU cores, 1.9 GB over its three processes)::

    >>> with launch_sglang(preset="tiny-llama") as server:                       # doctest: +SKIP
    ...     server.client.generate(text="hi", sampling_params={"max_new_tokens": 4})["meta_info"]["weight_version"]
    'default'
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from bridge.client import ServerClient
from bridge.errors import BridgeError, ConfigError, ServerError
from bridge.log import get_logger
from bridge.process_group import find_free_port
from inference_adapter.launched import LaunchedServer

__all__ = ["CPU_FLAGS", "CPU_RELEASE", "STANDINS", "check_server_imports", "find_sglang", "launch_sglang", "lora_flags",
           "sglang_command", "sglang_env"]

logger = get_logger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)
STANDINS = os.path.join(HERE, "sglang_cpu")
"""The CPU stand-ins (``sgl_kernel``, ``torchvision``, the pinned-memory shim): see its README.md."""
CPU_RELEASE = "0.5.23"
"""The SGLang release whose server runs on CPU here (``scripts/install_sglang.sh`` unpacks it)."""

CPU_FLAGS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--disable-cuda-graph": None,
    "--disable-radix-cache": None,
    "--skip-server-warmup": None,
    "--sleep-on-idle": None,
    "--mem-fraction-static": None,  # from the model's size: cpu_memory_fraction
    "--max-total-tokens": "4096",
    "--max-running-requests": "8",
    "--chunked-prefill-size": "1024",
    "--tp-size": "1",
}
"""SGLang's flags for its CPU engine on a host without AMX (every layer takes its ``forward_native`` path), and
``--sleep-on-idle`` (else its scheduler spins a core while it has nothing to do); ``None``: a switch (but
``--mem-fraction-static``, :func:`cpu_memory_fraction`). A flag in ``extra_args`` replaces its entry here."""


def cpu_memory_fraction(model: str) -> str:
    """``--mem-fraction-static`` on CPU: SGLang reserves that fraction of the host's available memory for the weights
    and the KV cache (capped at ``--max-total-tokens``), and loading a checkpoint passes through about three times its
    file size; 0.05 at least, 0.9 at most."""
    size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors")) \
        if os.path.isdir(model) else 0
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return f"{min(0.9, max(0.05, (3 * size + (512 << 20)) / available)):.3f}"


def cache_dir() -> str:
    return os.environ.get("WSYNC_SGLANG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "wsync", "sglang")


def find_sglang() -> str | None:
    """Where SGLang comes from: ``""`` when this environment imports it, else the folder
    ``scripts/install_sglang.sh`` unpacked SGLang :data:`CPU_RELEASE` into (it goes on the server's
    ``PYTHONPATH``), else None."""
    if importlib.util.find_spec("sglang") is not None:
        return ""
    unpacked = os.path.join(cache_dir(), f"sglang-{CPU_RELEASE}")
    return unpacked if os.path.exists(os.path.join(unpacked, ".complete")) else None


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sglang_command(model: str, host: str, port: int, dtype: str = "bfloat16", extra_args: Sequence[str] = (),
                   cpu: bool | None = None) -> list[str]:
    """The command line: ``python -m sglang.launch_server`` with the model, address and dtype, then
    :data:`CPU_FLAGS` on a CPU host (``cpu``: default, when this host has no CUDA device) unless ``extra_args``
    sets them, then ``extra_args``."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host,
           "--port", str(port), "--dtype", dtype]
    extra = [str(a) for a in extra_args]
    if not has_cuda() if cpu is None else cpu:
        for flag, value in CPU_FLAGS.items():
            if flag == "--mem-fraction-static" and flag not in extra:
                cmd += [flag, cpu_memory_fraction(str(model))]
            elif flag not in extra:
                cmd += [flag] if value is None else [flag, value]
    return cmd + extra


def sglang_env(base: dict[str, str] | None = None, cpu: bool | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default this process's) with the checkout on ``PYTHONPATH``; on a
    CPU host also SGLang's CPU engine switch, the stand-ins, and the unpacked SGLang (:func:`find_sglang`).

    Raises:
        ConfigError: no SGLang here, named with the command that installs it.
    """
    env = dict(os.environ if base is None else base)
    where = find_sglang()
    if where is None:
        raise ConfigError(
            "real SGLang is not installed here: on a GPU host `pip install sglang` beside wsync; on a CPU host "
            f"`bash scripts/install_sglang.sh` (from the checkout) unpacks SGLang {CPU_RELEASE} and what its server "
            f"needs into {cache_dir()}")
    paths = [CHECKOUT]
    if not has_cuda() if cpu is None else cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        paths = [STANDINS, *([where] if where else []), CHECKOUT]
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def lora_flags(rank: int, cpu: bool | None = None) -> list[str]:
    """SGLang's flags for LoRA adapters of up to ``rank`` on every projection (what the trainer's ``LoraConfig``
    targets), two adapters per batch; on a CPU host (``cpu``: default, when there is no CUDA device) with the
    torch-native backend, the only one that runs there. Adapters that came by tensors are reloaded by the name
    ``__tensor__``: start SGLang with ``HF_HUB_OFFLINE=1`` so that it does not ask the hub for it."""
    flags = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras-per-batch", "2", "--lora-target-modules",
             "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return flags + (["--lora-backend", "torch_native"] if (not has_cuda() if cpu is None else cpu) else [])


SERVER_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                  "sglang.srt.managers.detokenizer_manager", "sglang.srt.models.llama", "sglang.srt.models.qwen2")
"""What SGLang's server processes import before they serve a Llama or a Qwen2 (:func:`check_server_imports`)."""


def check_server_imports(timeout: float = 300.0) -> str:
    """Import :data:`SERVER_MODULES` in a process with the server's environment (:func:`sglang_env`), without
    starting a server: on a CPU host a name a new release needs of a stand-in fails here, naming it. Returns
    SGLang's version.

    Raises:
        ConfigError: SGLang is not installed, or an import failed (with the end of its traceback).
    """
    code = "import importlib, sys, sglang\nfor m in sys.argv[1:]: importlib.import_module(m)\nprint(sglang.__version__)"
    out = subprocess.run([sys.executable, "-c", code, *SERVER_MODULES], env=sglang_env(), capture_output=True,
                         text=True, timeout=timeout, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-12:])
        raise ConfigError(f"SGLang's server does not import on this host:\n{tail}")
    return out.stdout.strip().splitlines()[-1]


def launch_sglang(model: str | None = None, preset: str | None = None, *, port: int | None = None,
                  host: str = "127.0.0.1", dtype: str = "bfloat16", extra_args: Sequence[str] = (),
                  ready_timeout: float = 180.0, api_key: str | None = None, log_path: str | None = None,
                  env: dict[str, str] | None = None):
    """Start real SGLang serving ``model`` (a local HF directory) or a :mod:`bridge.local.presets` ``preset`` (written to a
    temporary directory first), and wait until ``/health_generate`` answers: it generated a token.

    Returns a :class:`inference_adapter.launched.LaunchedServer` (``kind="sglang"``); ``stop()`` sends SIGINT to its
    process group (SGLang's scheduler and detokenizer processes with it; about 2 s), SIGKILL after a bound.

    Raises:
        ConfigError: SGLang is not installed here.
        ServerError: it exited, or did not generate within ``ready_timeout`` seconds; the message ends with the
            last lines of its log.
    """
    if model is None:
        from bridge.local.presets import make_model_dir

        model = make_model_dir(tempfile.mkdtemp(prefix=f"wsync-sglang-{preset or 'tiny'}-"), preset or "tiny")
    port = port or find_free_port(host)
    child_env = sglang_env({**os.environ, **(env or {})})
    cmd = sglang_command(model, host, port, dtype, extra_args)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"wsync-sglang-{port}-", suffix=".log")
        os.close(fd)
    log_file = open(log_path, "ab")
    logger.info("starting real SGLang on %s:%d (log %s): %s", host, port, log_path, " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
                            cwd=tempfile.gettempdir())
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    server = LaunchedServer(proc, url, ServerClient(url, api_key=api_key, timeout=60.0), log_path, "sglang", log_file,
                            stop_signal=signal.SIGINT)
    try:
        wait_generating(server, ready_timeout)
    except BaseException:
        server.stop(timeout=5.0)
        raise
    logger.info("real SGLang ready at %s (pid %d)", url, proc.pid)
    return server


def wait_generating(server, timeout: float) -> None:
    """Poll ``/health_generate`` (SGLang answers 200 once a one-token generation went through) until it does.

    Raises:
        ServerError: the process exited, wants an API key, or did not generate within ``timeout`` seconds; the
            message ends with the last lines of its log.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        if server.process.poll() is not None:
            raise ServerError(server.url, f"real SGLang exited with code {server.process.returncode} before it "
                                          f"generated; log {server.log_path}:\n{server.log_tail()}")
        try:
            server.client.health_generate(timeout=10.0)
            return
        except BridgeError as e:
            if isinstance(e, ServerError) and e.status == 401:
                raise ServerError(server.url, "real SGLang wants an API key; pass api_key=", 401) from e
            last = e
        if time.monotonic() > deadline:
            raise ServerError(server.url, f"real SGLang did not generate within {timeout:g} s (last: {last}); log "
                                          f"{server.log_path}:\n{server.log_tail()}")
        time.sleep(0.5)
