"""``wsync bench``: broadcast vs colocated vs disk vs per-tensor sync, side by side, as ratios to the raw transport
(end to end, and transfer only: the sync minus its own gather).

A thin command line over :mod:`bench.run` (the driver) and :mod:`bench.worker` (the trainer ranks,
re-run by torchrun with ``--_worker-spec``). ``--quick``: the small preset, 2 repeats, one bucket size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bridge.errors import BridgeError

_QUICK = {"sizes": ["small"], "repeats": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", nargs="+", metavar="PRESET",
                   help="presets to measure, e.g. `--sizes many small medium` or `--sizes tiny`; `none` for --model "
                        "only (default: many small medium; with --quick: small)")
    p.add_argument("--model", action="append", default=[], metavar="DIR",
                   help="also measure this local HF model directory (repeatable)")
    p.add_argument("--bucket-mb", nargs="+", type=float, metavar="MIB",
                   help="bucket sizes of the flattened broadcast (default: 32 128 512; with --quick: the publisher's default)")
    p.add_argument("--repeats", type=int, help="timed syncs per method after one warm-up (default 5; with --quick: 2)")
    p.add_argument("--quick", action="store_true", help="small preset, 2 repeats, one bucket size: a few minutes on 2 cores")
    p.add_argument("--json", metavar="PATH", help="write rows, targets and raw timings as JSON here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of seconds and ratio against model size here")
    p.add_argument("--workdir", metavar="DIR", help="model cache and run folder (default: <tmp>/wsync-bench)")
    p.add_argument("--no-etcd", dest="etcd", action="store_false",
                   help="skip the etcd disk backend even when an etcd binary is on PATH")
    p.add_argument("--nproc", type=int, default=2, help="FSDP ranks of the trainer")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: NCCL and CUDA tensors, the server on a GPU of its own (needs nproc+1 GPUs; with one "
                        "GPU and --nproc 1 the server runs on the CPU over gloo); cpu: gloo; auto: cuda where "
                        "available (default)")
    p.add_argument("--no-colocated", dest="colocated", action="store_false",
                   help="skip the colocated (/dev/shm) transport")
    p.add_argument("--serving-dtype", default="bfloat16", help="dtype the server serves")
    p.add_argument("--delta-lrs", nargs="*", type=float, default=[1e-6, 1e-5], metavar="LR",
                   help="delta rows: one optimizer step at each learning rate, then a delta sync into a server of "
                        "its own (default: 1e-6 1e-5; none: no delta rows)")
    p.add_argument("--no-fp8", dest="fp8", action="store_false",
                   help="skip the FP8 rows (the flattened broadcast with --encoding fp8 into a server serving FP8)")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R",
                   help="LoRA rows: an adapter of rank R on every projection of the same model, published alone by "
                        "tensors and by disk into a server of its own, from a second engine of the model (default 16; "
                        "0: no LoRA rows, for a model the trainer fits only once; not with --link)")
    p.add_argument("--delta-warmup", type=int, default=5, help="optimizer steps before the delta rows are timed")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one transfer or load may take")
    p.add_argument("--keep-run", action="store_true", help="keep the run folder (snapshots, logs)")
    p.add_argument("--log-level", default="WARNING", help="log level of every process")
    p.add_argument("--link", metavar="RATE",
                   help="the servers on a host of their own behind a link shaped to RATE (tc: 200mbit, 1gbit): two "
                        "network namespaces and a veth pair the bench makes and removes (needs root and iproute2); "
                        "the link is measured once with plain TCP; colocated is not measured")
    p.add_argument("--link-delay", metavar="DELAY", help="with --link: netem delay on each leg (e.g. 1ms)")
    p.add_argument("--engine", choices=["reference", "sglang"], default="reference",
                   help="the servers every method syncs into: the reference server, or real SGLang (on its CPU engine "
                        "where there is no GPU; no FP8 rows there; the raw broadcast floor into a reference server)")
    p.add_argument("--link-probe-mb", type=float, default=32.0, metavar="MB",
                   help="with --link: MB of the TCP transfer that measures the link (default 32)")
    p.add_argument("--servers", nargs="+", type=int, metavar="N",
                   help="growth instead of the methods' table: one sync of the one --sizes preset (default small) into "
                        "N reference servers for each N, by broadcast and by disk, --repeats times (default 3); with "
                        "--link each server on a host of its own behind its own shaped link (bench/growth.py)")
    # Internal: set when the bench re-runs itself inside the trainer namespace of a --link run.
    p.add_argument("--_link-spec", dest="link_spec", help=argparse.SUPPRESS)
    # Internal: set when the bench re-runs itself as a trainer rank under torchrun.
    p.add_argument("--_worker-spec", dest="worker_spec", help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace):
    """The :class:`bench.run.BenchConfig` the flags describe (``--quick`` fills what was not given)."""
    from bench.run import BenchConfig
    from bridge import PublisherConfig

    sizes = args.sizes
    if sizes is not None:
        sizes = [s for item in sizes for s in item.split(",") if s and s != "none"]
    elif args.quick:
        sizes = list(_QUICK["sizes"])
    elif args.model:
        sizes = []
    kw = {}
    if sizes is not None:
        kw["sizes"] = sizes
    if args.bucket_mb:
        kw["bucket_mb"] = list(args.bucket_mb)
    elif args.quick:
        kw["bucket_mb"] = [PublisherConfig(transport="disk").bucket_mb]  # the publisher's default bucket
    if args.repeats is not None:
        kw["repeats"] = args.repeats
    elif args.quick:
        kw["repeats"] = _QUICK["repeats"]
    if args.workdir:
        kw["workdir"] = args.workdir
    return BenchConfig(models=list(args.model), nproc=args.nproc, etcd=args.etcd, serving_dtype=args.serving_dtype,
                       timeout=args.timeout, keep_run=args.keep_run, log_level=args.log_level.upper(),
                       device=args.device, colocated=args.colocated and not args.link, delta_lrs=list(args.delta_lrs), fp8=args.fp8,
                       lora_rank=args.lora_rank,
                       delta_warmup=args.delta_warmup, link=args.link, link_delay=args.link_delay,
                       link_probe_mb=args.link_probe_mb, engine=args.engine, **kw)


def run(args: argparse.Namespace) -> int:
    if args.worker_spec:
        from bench.worker import run_worker

        return run_worker(json.loads(args.worker_spec))
    from bench.run import run_bench
    from wsync.serve import require_server_stack

    require_server_stack()
    if args.link_spec:  # inside the trainer namespace of a --link run (bench.netns.run_linked)
        from bench.run import BenchConfig

        spec = json.loads(args.link_spec)
        args.json, args.plot = spec["json"], spec["plot"]
        report = run_bench(BenchConfig(**spec["config"]), json_path=args.json, plot_path=args.plot, link=spec["link"])
        return _finish(args, report)
    if args.plot:
        import matplotlib  # noqa: F401  (the bench extra: fail now, not after minutes of measuring)
    if args.servers:
        return _growth(args)
    cfg = config_from_args(args)
    if cfg.link is not None:
        from bench.netns import run_linked

        return run_linked(cfg, json_path=args.json and os.path.abspath(args.json),
                          plot_path=args.plot and os.path.abspath(args.plot), probe_mb=cfg.link_probe_mb)
    return _finish(args, run_bench(cfg, json_path=args.json, plot_path=args.plot))


def _growth(args: argparse.Namespace) -> int:
    """``--servers``: :mod:`bench.growth`."""
    import tempfile

    from bench.growth import GrowthConfig, check_counts, run_growth, run_linked_growth
    from bridge.errors import ConfigError

    sizes = [s for item in args.sizes or ["small"] for s in item.split(",") if s]
    if len(sizes) != 1 or args.model:
        raise ConfigError(f"--servers measures one preset: give one --sizes (got {sizes}), no --model")
    cfg = GrowthConfig(counts=check_counts(args.servers), preset=sizes[0], repeats=args.repeats or 3, link=args.link,
                       link_delay=args.link_delay, timeout=args.timeout,
                       workdir=os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="wsync-growth-")))
    json_path, plot_path = (os.path.abspath(p) if p else None for p in (args.json, args.plot))
    if cfg.link:
        return run_linked_growth(cfg, json_path, plot_path)
    return run_growth(cfg, json_path, plot_path)


def _finish(args: argparse.Namespace, report: dict) -> int:
    print(report["table"], flush=True)
    if args.json:
        print(f"wsync bench: wrote {args.json}", file=sys.stderr)
    if args.plot and report["rows"]:
        print(f"wsync bench: wrote {args.plot}", file=sys.stderr)
    if report["failed"]:
        # Each failure's first line is its cause (the trainer ranks' error); the details were printed above.
        raise BridgeError("measuring failed for " + "; ".join(
            f"{label}: {message.splitlines()[0]}" for label, message in report["failed"].items()))
    return 0
