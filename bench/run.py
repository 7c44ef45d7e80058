"""The driver of ``wsync bench``: models, server, etcd, watchers and one trainer job per model size.

Step by step, and which process runs each step:

0. driver: decides which GPU each process sees (:func:`placement`, ``--device``): none on a CPU host;
   on a CUDA host one per trainer rank and one for the server, so every group can use NCCL.
1. driver: builds each preset's HF directory once, cached under ``<workdir>/models/<preset>``;
   starts etcd on free loopback ports when an ``etcd`` binary is on PATH (temp data dir, stopped at
   the end).
2. driver, per model size: starts the server on that directory, serving the serving dtype (the reference
   server, whose ``/wsync/bench/recv_raw`` route times the raw broadcast; with ``engine="sglang"`` real SGLang,
   and a reference server beside it for that floor), and the delta, FP8 and LoRA rows' own servers, all at the
   same time; starts one
   :class:`~inference_adapter.watcher.DiskWatcher` thread per name-resolution backend (directory, and etcd
   when present) that loads each announced snapshot into the server.
3. torchrun job of ``nproc`` ranks (``wsync bench --_worker-spec JSON``): FSDP2 trainer; rank 0 measures
   every method and floor (:mod:`bench.worker`) and writes the size's results JSON.
4. driver: stops the watchers and the servers; after the last size, builds the rows, the table, the
   target checks, the JSON and the plot (:mod:`bench.report`), and removes the run's snapshots.

Example:
    >>> report = run_bench(BenchConfig(sizes=["tiny"], repeats=1, bucket_mb=[128]))   # doctest: +SKIP
    >>> print(report["table"])                                                         # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from bridge.errors import BridgeError, ConfigError
from bridge.log import get_logger

# run_bench is the entry point; the rest is shared with bench.profile, which runs one size its own way.
__all__ = ["BenchConfig", "clean_run", "ensure_dir", "measure_size", "placement", "preset_model_dir", "run_bench"]

logger = get_logger(__name__)


def _default_workdir() -> str:
    return os.path.join(tempfile.gettempdir(), "wsync-bench")


@dataclass(kw_only=True)
class BenchConfig:
    """What to measure and where. Checked in ``__post_init__``."""

    sizes: list[str] = field(default_factory=lambda: ["many", "small", "medium"])
    """Preset names (``bridge.local.presets.PRESETS``) to measure, in this order (``many``: 339 tensors, for the
    per-tensor targets; ``medium``: for the disk target)."""
    models: list[str] = field(default_factory=list)
    """Extra HF model directories to measure after the presets (labelled by their folder name)."""
    bucket_mb: list[float] = field(default_factory=lambda: [32.0, 128.0, 512.0])
    """Bucket sizes (MiB) of the flattened broadcast; the first is also the warm-up's."""
    per_tensor_bucket_mb: float = 1e-6
    """Bucket budget of the per-tensor method: below any tensor, so every tensor is its own request."""
    repeats: int = 5
    """Timed syncs per method and size, after one warm-up round."""
    nproc: int = 2
    """FSDP ranks of the trainer."""
    etcd: bool = True
    """Also measure disk with etcd name resolution when an ``etcd`` binary is on PATH."""
    serving_dtype: str = "bfloat16"
    """dtype the server serves and every method sends."""
    workdir: str = field(default_factory=_default_workdir)
    """Model cache (``models/``) and this run's snapshots, logs and results (``runs/<id>/``)."""
    keep_run: bool = False
    """Keep this run's folder (snapshots, logs) instead of deleting it at the end."""
    timeout: float = 300.0
    """Seconds any single HTTP call, broadcast or disk load may take before the run fails."""
    log_level: str = "WARNING"
    """Log level of the server and trainer processes."""
    device: str = "auto"
    """``cpu`` (gloo), ``cuda`` (NCCL; fails on a host without CUDA) or ``auto`` (cuda where available).
    See :func:`placement` for which GPU each process gets."""
    colocated: bool = True
    """Also measure the colocated transport (/dev/shm), at the first bucket size, against its shm floor."""
    delta_lrs: list[float] = field(default_factory=lambda: [1e-6, 1e-5])
    """The delta rows (:mod:`bench.delta`): one optimizer step at each of these learning rates, then a delta
    sync (broadcast, first bucket size) into a server of its own. Empty: no delta rows."""
    delta_warmup: int = 5
    """Optimizer steps (at the first delta learning rate, each published) before the delta rows are timed."""
    fp8: bool = True
    """The FP8 rows (:mod:`bench.fp8`): the flattened broadcast at the first bucket size with ``encoding="fp8"`` into
    a server serving FP8 of its own, its bucket fills alone, and its floor (the FP8 bytes in one broadcast). With
    ``delta_lrs`` also the FP8 delta rows (``fp8+delta-lr<LR>``, :mod:`bench.delta`) into another server serving FP8."""
    lora_rank: int = 16
    """The LoRA rows (:mod:`bench.lora`): an adapter of this rank on every projection of the same model, published
    alone by tensors and by disk into a server of its own (``--enable-lora``). 0: no LoRA rows."""
    link: str | None = None
    """A tc rate (``200mbit``, ``1gbit``): the servers on a host of their own behind a link shaped to it
    (:mod:`bench.netns`; needs root). None: everything on this host's loopback."""
    link_delay: str | None = None
    """With ``link``: a netem delay on each leg of the link (``1ms``)."""
    link_probe_mb: float = 32.0
    """With ``link``: MB of the plain TCP transfer that measures the link once at the start."""
    engine: str = "reference"
    """The servers every method syncs into: ``reference`` (the reference server) or ``sglang`` (real SGLang, started
    by :func:`inference_adapter.real_sglang.launch_sglang`, on its CPU engine where there is no GPU; the raw
    broadcast floor is then taken against a reference server, and there are no FP8 rows: SGLang's FP8 layers need
    a GPU or AMX)."""

    def __post_init__(self) -> None:
        from bridge.local.presets import PRESETS
        from bridge.tensors import dtype_from_str

        unknown = [s for s in self.sizes if s not in PRESETS]
        if unknown:
            raise ConfigError(f"unknown size(s) {unknown}; choose from {', '.join(PRESETS)} (or pass --model DIR)")
        for m in self.models:
            if not os.path.isfile(os.path.join(m, "config.json")):
                raise ConfigError(f"--model {m}: not a Hugging Face model directory (no config.json)")
        if not self.sizes and not self.models:
            raise ConfigError("nothing to measure: give --sizes and/or --model DIR")
        if not self.bucket_mb or any(not b > 0 for b in self.bucket_mb):
            raise ConfigError(f"bucket sizes must be positive MiB values, got {self.bucket_mb}")
        if not self.per_tensor_bucket_mb > 0:
            raise ConfigError(f"per_tensor_bucket_mb must be positive, got {self.per_tensor_bucket_mb}")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.nproc < 1:
            raise ConfigError(f"nproc must be >= 1, got {self.nproc}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be positive seconds, got {self.timeout}")
        if any(not lr > 0 for lr in self.delta_lrs) or self.delta_warmup < 0:
            raise ConfigError(f"delta learning rates must be positive and delta_warmup >= 0, got {self.delta_lrs}, "
                              f"{self.delta_warmup}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be an integer >= 0 (0: no LoRA rows), got {self.lora_rank!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        dtype_from_str(self.serving_dtype)
        if self.link is not None:
            from bench.netns import parse_delay, parse_rate

            parse_rate(self.link)
            parse_delay(self.link_delay)
            if not self.link_probe_mb > 0:
                raise ConfigError(f"link_probe_mb must be positive, got {self.link_probe_mb}")
        elif self.link_delay:
            raise ConfigError("--link-delay needs --link RATE")
        if self.engine not in ("reference", "sglang"):
            raise ConfigError(f"engine must be reference or sglang, got {self.engine!r}")
        if self.engine == "sglang" and self.link is not None:
            raise ConfigError("--engine sglang runs on this host's loopback: the shaped link (--link) starts reference "
                              "servers in a network namespace only")


def placement(device: str, nproc: int) -> dict:
    """Which devices the trainer ranks and the server see, and the trainer-to-server backend.

    Returns ``{"device", "trainer_env", "server_env", "backend", "note"}``: ``backend`` is None for the
    publisher's default (NCCL on CUDA, gloo on CPU) or ``"gloo"``; the envs set ``CUDA_VISIBLE_DEVICES``.

    - ``cpu`` (or ``auto`` without CUDA): every process sees no GPU; gloo throughout.
    - ``cuda`` with at least ``nproc + 1`` GPUs: trainer rank r on GPU r, the server on the last GPU;
      NCCL for the gathers and for trainer -> server (NCCL cannot join two ranks of one group on the
      same GPU, so the server needs a GPU of its own).
    - ``cuda`` with one GPU and ``nproc == 1``: the trainer on the GPU, the server on the CPU, and
      trainer -> server over gloo (an NCCL broadcast figure needs a second GPU; the note says so).

    Raises:
        ConfigError: ``cuda`` was asked for on a host without CUDA, or the GPUs cannot hold the layout.
    """
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        hide = {"CUDA_VISIBLE_DEVICES": ""}
        return {"device": "cpu", "trainer_env": hide, "server_env": hide, "backend": None, "note": None}
    if not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: this host has no usable CUDA (torch {torch.__version__}, built for CUDA "
                          f"{torch.version.cuda or 'none'}); run on a CUDA host or pass --device cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    ids = ids or [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) >= nproc + 1:
        return {"device": "cuda", "trainer_env": {"CUDA_VISIBLE_DEVICES": ",".join(ids[:nproc])},
                "server_env": {"CUDA_VISIBLE_DEVICES": ids[-1]}, "backend": None, "note": None}
    if len(ids) == 1 and nproc == 1:
        return {"device": "cuda", "trainer_env": {"CUDA_VISIBLE_DEVICES": ids[0]},
                "server_env": {"CUDA_VISIBLE_DEVICES": ""}, "backend": "gloo",
                "note": "one GPU: the trainer runs on it, the server on the CPU, trainer -> server over gloo "
                        "(NCCL cannot join two ranks on one GPU; an NCCL broadcast figure needs 2 GPUs)"}
    raise ConfigError(f"--device cuda with --nproc {nproc} needs {nproc + 1} GPUs (one per trainer rank, one for the "
                      f"server: NCCL cannot join two ranks on one GPU); this host has {len(ids)}: pass "
                      f"--nproc {max(1, len(ids) - 1)}")


def run_bench(cfg: BenchConfig, *, json_path: str | None = None, plot_path: str | None = None,
              link: dict | None = None) -> dict:
    """Measure every size; return the report (``rows``, ``targets``, ``table``, ``sizes``, ``meta``, ``failed``).

    Writes ``json_path`` and ``plot_path`` when given. A size whose trainer job fails is listed in
    ``failed`` and the others are still reported. ``link``: this driver runs in the trainer namespace of a
    shaped link (:func:`bench.netns.run_linked` passes its :class:`bench.netns.LinkSpec` as a dict), and the
    servers are started in the other one; the report gains ``link`` and its table the link's section.
    """
    from bench import report as rep
    from bridge.name_resolve.local_etcd import LocalEtcd

    place = placement(cfg.device, cfg.nproc)  # a layout the GPUs cannot hold fails before anything starts
    if place["note"]:
        print(f"wsync bench: {place['note']}", file=sys.stderr, flush=True)
    os.makedirs(cfg.workdir, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=ensure_dir(cfg.workdir, "runs"))
    print(f"wsync bench: run folder {run_dir}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    sizes, failed = [], {}
    etcd = None
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        models = [(p, preset_model_dir(cfg.workdir, p)) for p in cfg.sizes]
        models += [(os.path.basename(os.path.normpath(m)), os.path.abspath(m)) for m in cfg.models]
        if cfg.etcd:
            etcd = LocalEtcd.start_if_available(run_dir)
            if etcd is None:
                print("wsync bench: no etcd binary on PATH; disk is measured on the directory backend only",
                      file=sys.stderr, flush=True)
        for label, model_dir in models:
            print(f"wsync bench: {label} ({model_dir})", file=sys.stderr, flush=True)
            try:
                sizes.append(measure_size(cfg, label, model_dir, run_dir, etcd, place, link=link))
            except BridgeError as e:
                failed[label] = str(e)
                print(f"wsync bench: {label} FAILED: {e}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
        if etcd is not None:
            etcd.close()
        clean_run(run_dir, keep=cfg.keep_run or bool(failed))
    rows = rep.build_rows(sizes, cfg.link)
    targets = rep.check_targets(rows, cfg.link)
    warmups = rep.build_warmups(sizes)
    meta = _meta(cfg, sizes, time.perf_counter() - t0, etcd is not None, place)
    table = rep.format_table(rows, targets, warmups)
    if not meta["kernels"]:
        table += ("\n\nthe delta's diff and the FP8 quantization ran in torch (no C compiler, or WSYNC_KERNELS=0): "
                  "slower than with the one-pass kernels (docs/benchmark.md)")
    if link is not None:
        meta["link"] = link
        table += "\n\n" + rep.format_link(rows, link)
    result = {"meta": meta, "rows": rows, "targets": targets, "warmups": warmups, "sizes": sizes, "failed": failed,
              "table": table}
    if json_path:
        with open(json_path, "w") as f:
            json.dump({k: v for k, v in result.items() if k != "table"}, f, indent=1)
    if plot_path and rows:
        rep.plot(rows, plot_path, title=_title(meta))
    return result


# ------------------------------------------------------------------------------------------ one size


def measure_size(cfg: BenchConfig, label: str, model_dir: str, run_dir: str, etcd, place: dict,
                 extra: dict | None = None, link: dict | None = None) -> dict:
    """One size's trainer job against its own server and watchers; the worker's result. ``extra`` goes into
    the worker spec (``{"profile": ...}``: :mod:`bench.profile`). ``link``: the servers start in the server
    namespace of that link (:mod:`bench.netns`)."""
    from bench.netns import SERVER_PORTS
    from bridge.local.launch import start_ranks

    def launch_server(port, **kw):
        if link is None:
            from inference_adapter.launcher import launch_server as launch

            return launch(**kw)
        from bench.netns import LinkSpec, launch_server_in

        kw.pop("use_sglang", None)
        return launch_server_in(LinkSpec(**link), port, **kw)

    size_dir = ensure_dir(run_dir, label)
    quiet = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "WSYNC_LOG_LEVEL": cfg.log_level}
    # Trainer ranks: glibc maps every allocation of 1 MiB or more afresh and unmaps it when freed. Its default
    # (a threshold that rises to 32 MiB after the first free) serves later bucket buffers from heap that is
    # already resident, which rank 0's RSS high-water growth (the peak memory figure) cannot see.
    trainer_env = {**quiet, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), **place["trainer_env"]}
    backends = {"dir": f"file://{ensure_dir(run_dir, 'name_resolve')}"}
    if etcd is not None:
        backends["etcd"] = etcd.url
    # Each method's own server, all started at once (one at a time, five reference servers took most of a tiny
    # bench's set-up).
    specs, lora_root = _server_specs(cfg, model_dir, size_dir, {**quiet, **place["server_env"]}, link)
    watchers = trainer = None
    servers = _start_servers(launch_server, {  # in the link's server namespace: each on a port of its own
        role: {**kw, "port": port,
               "log_path": os.path.join(size_dir, "server.log" if role == "server" else f"{role}-server.log")}
        for (role, kw), port in zip(specs.items(), SERVER_PORTS)})
    try:
        server = servers["server"]
        if "delta" in servers:
            extra = {"delta_server": servers["delta"].url, "delta_lrs": cfg.delta_lrs, "delta_warmup": cfg.delta_warmup,
                     **(extra or {})}
        if "fp8" in servers:
            extra = {"fp8_server": servers["fp8"].url, **(extra or {})}
        if "fp8-delta" in servers:
            extra = {"fp8_delta_server": servers["fp8-delta"].url, **(extra or {})}
        if "lora" in servers:
            extra = {"lora_server": servers["lora"].url, "lora_rank": cfg.lora_rank, "lora_root": lora_root,
                     **(extra or {})}
        if "floor" in servers:  # real SGLang has no raw-receive route: the raw broadcast goes to a reference server
            extra = {"floor_server": servers["floor"].url, **(extra or {})}
        disk = [{"backend": b, "trial": f"{label}-{b}", "name_resolve": url,
                 "snapshot_root": os.path.join(size_dir, f"snapshots-{b}")} for b, url in backends.items()]
        if _has_disk_writers() and cfg.nproc > 1:
            # The rank-0 writer next to the default (every rank writes its share), on the directory backend.
            disk.append({"backend": "dir-rank0", "trial": f"{label}-dir-rank0", "name_resolve": backends["dir"],
                         "snapshot_root": os.path.join(size_dir, "snapshots-dir-rank0"), "disk_writers": "rank0"})
        watchers = [_start_watcher(d, server.url, cfg.timeout) for d in disk]
        out = os.path.join(size_dir, "result.json")
        spec = dict(label=label, model_dir=model_dir, server=server.url, serving_dtype=cfg.serving_dtype,
                    buckets_mb=cfg.bucket_mb, per_tensor_bucket_mb=cfg.per_tensor_bucket_mb, repeats=cfg.repeats,
                    disk=disk, floor_dir=os.path.join(size_dir, "floor"), out=out, timeout=cfg.timeout,
                    colocated=cfg.colocated, backend=place["backend"], engine=cfg.engine, **(extra or {}))
        # The trainer's ranks write to this process's stderr (progress, warnings, tracebacks).
        trainer = start_ranks(cfg.nproc, ["bench", "--_worker-spec", json.dumps(spec)], env=trainer_env)
        rc = trainer.wait()
        if rc != 0 or not os.path.exists(out):
            raise BridgeError(f"the trainer job failed: {trainer.failure()}; server log {server.log_path} ends "
                              f"with:\n{server.log_tail(15)}")
        with open(out) as f:
            return json.load(f)
    finally:
        if trainer is not None:
            trainer.terminate()
            trainer.close()
        for w in watchers or ():
            w.stop()
        _stop_all(servers.values())


def _server_specs(cfg: BenchConfig, model_dir: str, size_dir: str, env: dict, link: dict | None):
    """Each role's server (``launch_server`` keywords), and the LoRA rows' adapter root: ``server`` (every method but
    the delta, FP8 and LoRA rows), ``delta``, ``fp8``, ``fp8-delta``, ``lora``, and with real SGLang ``floor`` (a
    reference server for the raw broadcast floor)."""
    from inference_adapter.real_sglang import lora_flags

    sglang = cfg.engine == "sglang"
    common = dict(model=model_dir, dtype=cfg.serving_dtype, use_sglang=sglang, env=env, ready_timeout=300)
    # SGLang takes its log level in lower case and has no --group-timeout (its groups wait 30 minutes).
    flags = ["--log-level", cfg.log_level.lower()] if sglang else ["--log-level", cfg.log_level, "--group-timeout",
                                                                    str(cfg.timeout)]
    specs = {"server": {**common, "extra_args": flags, "disk_roots": [size_dir]}}
    if sglang:
        specs["floor"] = {**common, "use_sglang": False, "preset": None,
                          "extra_args": ["--log-level", cfg.log_level, "--group-timeout", str(cfg.timeout)]}
    if cfg.delta_lrs:  # the delta rows' own server (bench.delta): real SGLang applies deltas with the project's loader
        loader = ["--custom-weight-loader", "bridge.serving.sglang_delta_loader.load_delta"] if sglang else []
        specs["delta"] = {**common, "extra_args": [*flags, *loader]}
    if cfg.fp8 and not sglang:  # the FP8 rows' own server (bench.fp8): it serves the projections as block FP8
        specs["fp8"] = {**common, "extra_args": [*flags, "--quantization", "fp8"]}
        if cfg.delta_lrs:  # the FP8 delta rows' own server (bench.delta, encoding fp8_delta): FP8 too
            specs["fp8-delta"] = {**common, "extra_args": [*flags, "--quantization", "fp8"]}
    lora_root = None
    if cfg.lora_rank and link is None:  # the LoRA rows' own server (bench.lora); tensors go by reference: one host
        lora_root = ensure_dir(size_dir, "adapters")
        lora = lora_flags(cfg.lora_rank) if sglang else ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank)]
        specs["lora"] = {**common, "extra_args": [*flags[:2], *lora], "disk_roots": [lora_root],
                         "env": {**env, "HF_HUB_OFFLINE": "1"}}
    return specs, lora_root


def _start_servers(launch, specs: dict[str, dict]) -> dict:
    """``launch(**spec)`` for every role of ``specs`` at once; the servers by role. If one fails to start, the others
    are stopped and its error raised."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(specs)) as pool:
        futures = {role: pool.submit(launch, **spec) for role, spec in specs.items()}
    started = {role: f.result() for role, f in futures.items() if f.exception() is None}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    if failed:
        _stop_all(started.values())
        raise failed[0]
    return started


def _stop_all(servers) -> None:
    """Stop every server at once (each waits for its graceful shutdown)."""
    import concurrent.futures as cf

    servers = list(servers)
    if servers:
        with cf.ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.stop(), servers))


def _has_disk_writers() -> bool:
    """True when the publisher can choose who writes a disk snapshot (the disk transport's ``disk_writers``)."""
    from bridge.transports import transport_class

    return any(f.name == "disk_writers" for f in dataclasses.fields(transport_class("disk").Options))


def _start_watcher(disk: dict, url: str, timeout: float):
    from bench.worker import EXPERIMENT
    from bridge.client import ServerGroup
    from bridge.name_resolve import make_name_resolve
    from inference_adapter.watcher import DiskWatcher

    watcher = DiskWatcher(make_name_resolve(disk["name_resolve"]), EXPERIMENT, disk["trial"],
                          ServerGroup([url], timeout=timeout), request_timeout=timeout)
    watcher.start()
    return watcher


# ------------------------------------------------------------------------------------------ helpers


def preset_model_dir(workdir: str, preset: str) -> str:
    """The preset's HF directory under ``<workdir>/models``, built once (atomically) and reused."""
    from bridge.local.presets import make_model_dir

    final = os.path.join(ensure_dir(workdir, "models"), preset)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    print(f"wsync bench: building the {preset} model in {final}", file=sys.stderr, flush=True)
    tmp = tempfile.mkdtemp(prefix=f".{preset}-", dir=os.path.dirname(final))
    try:
        make_model_dir(tmp, preset, seed=0)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def ensure_dir(*parts: str) -> str:
    """The folder ``os.path.join(*parts)``, created if missing."""
    path = os.path.join(*parts)
    os.makedirs(path, exist_ok=True)
    return path


def clean_run(run_dir: str, keep: bool) -> None:
    """Delete a run's folder at its end, or say where it was kept (``keep``: asked for, or a size failed)."""
    if keep:
        print(f"wsync bench: kept {run_dir} (logs, snapshots)", file=sys.stderr, flush=True)
        return
    # Snapshots are the big part; logs go with them (the run folder is printed at the start).
    shutil.rmtree(run_dir, ignore_errors=True)


def _raise_interrupt(*_):
    raise KeyboardInterrupt()


def _meta(cfg: BenchConfig, sizes: list[dict], seconds: float, etcd: bool, place: dict) -> dict:
    import torch

    from bridge.codecs import kernels

    return {
        # whether the delta's diff and the FP8 quantization ran in the one-pass C kernels (WSYNC_KERNELS=0: torch)
        "kernels": kernels.available(),
        "config": asdict(cfg), "seconds": seconds, "etcd": etcd, "torch": torch.__version__,
        "python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(), "device": place["device"], "placement_note": place["note"],
        "backend": sizes[0]["backend"] if sizes else None,
        "server_backend": sizes[0].get("server_backend") if sizes else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                if torch.cuda.is_available() else [],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _title(meta: dict) -> str:
    c = meta["config"]
    where = (f"{meta['gpus'][0] if meta.get('gpus') else 'CUDA'}, gathers {meta['backend']}, trainer->server "
             f"{meta.get('server_backend')}" if meta.get("device") == "cuda" else "CPU/gloo")
    return (f"wsync bench: {meta['cpus']} CPUs, {where}, torch {meta['torch']}, "
            f"{c['nproc']} FSDP ranks, {c['repeats']} repeats, serving {c['serving_dtype']}, "
            f"{'C kernels' if meta.get('kernels') else 'no C kernels'}, {meta['date']}")
