"""``wsync train``: train with the FSDP2 engine on the synthetic reversal task, publishing as it goes.

Run without torchrun, it starts ``--nproc`` local ranks itself (torchrun, standalone rendezvous); under
torchrun it is one of those ranks. Every step prints loss, grad norm and learning rate (rank 0).
"""

from __future__ import annotations

import argparse
import sys

from wsync.launch import torchrun, under_torchrun


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="DIR", help="a local HF causal-LM directory (default: the tiny preset)")
    g.add_argument("--preset", choices=["tiny", "small", "medium"], help="build a preset model from its config (default: tiny)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--nproc", type=int, default=2, help="number of FSDP ranks to start on this machine")
    p.add_argument("--steps", type=int, default=5, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch size (split across ranks)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--schedule", default="constant", choices=["constant", "linear", "cosine"], help="learning-rate schedule after warm-up")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping threshold")
    p.add_argument("--mb-max-tokens", type=int, default=4096, help="token budget of one micro-batch")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"], help="FSDP2 mixed-precision compute dtype")
    p.add_argument("--cpu-offload", action="store_true", help="offload parameters to CPU (FSDP2 CPUOffloadPolicy)")
    p.add_argument("--seed", type=int, default=0, help="seed for model init and data")
    p.add_argument("--save", metavar="DIR", help="save the trained model here at the end")
    p.add_argument("--save-format", default="hf", choices=["hf", "dcp"], help="format of --save")
    p.add_argument("--publish", default="none", choices=["none", "broadcast", "disk"],
                   help="publish the weights after every step by this transport")
    p.add_argument("--server", action="append", default=[], metavar="URL", help="server to publish to (repeat for several)")
    p.add_argument("--name-resolve", metavar="URL", help="disk transport: etcd://host:port, file:///path or memory://")
    p.add_argument("--snapshot-root", metavar="DIR", help="disk transport: where version directories are written")
    p.add_argument("--experiment", default="default", help="experiment name in announcement keys")
    p.add_argument("--trial", default="trial0", help="trial name in announcement keys")
    p.add_argument("--bucket-mb", type=float, help="broadcast bucket size in MiB (default: 32 on CPU, 512 on GPU)")
    p.add_argument("--serving-dtype", default="bfloat16", help="dtype the servers serve; weights are cast on the way")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO; env WSYNC_LOG_LEVEL)")


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1 or args.steps < 1:
        print("wsync train: --nproc and --steps must be >= 1", file=sys.stderr)
        return 2
    if args.publish == "broadcast" and not args.server:
        print("wsync train: --publish broadcast needs at least one --server URL (start one with `wsync serve`)",
              file=sys.stderr)
        return 2
    if not under_torchrun():
        proc = torchrun(args.nproc, ["train", *_argv_of(args)])
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return 130
    return _rank_main(args)


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces ``args`` (what each rank parses again)."""
    out = []
    for k, v in vars(args).items():
        if k.startswith("_") or v in (None, False) or (isinstance(v, list) and not v):
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, list):
            for x in v:
                out += [flag, str(x)]
        else:
            out += [flag, str(v)]
    return out


def build_engine(args: argparse.Namespace):
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    cfg = EngineConfig(
        model_path=args.model, preset=None if args.model else (args.preset or "tiny"),
        param_dtype=args.param_dtype, cpu_offload=args.cpu_offload, mb_max_tokens=args.mb_max_tokens, seed=args.seed,
        optimizer=OptimizerConfig(
            lr=args.lr, weight_decay=args.weight_decay, schedule=args.schedule, warmup_steps=args.warmup_steps,
            total_steps=args.steps, max_grad_norm=args.max_grad_norm,
        ),
    )
    engine = FSDPEngine(cfg)
    engine.initialize()
    return engine


def build_publisher(args: argparse.Namespace, servers: list[str]):
    from bridge import PublisherConfig, WeightPublisher

    kw = dict(
        transport=args.publish, servers=servers, experiment=args.experiment, trial=args.trial,
        name_resolve=args.name_resolve, snapshot_root=args.snapshot_root, serving_dtype=args.serving_dtype,
    )
    if args.bucket_mb:
        kw["bucket_mb"] = args.bucket_mb
    return WeightPublisher(PublisherConfig(**kw))


def _rank_main(args: argparse.Namespace) -> int:
    from wsync.tasks import make_batch

    engine = build_engine(args)
    publisher = build_publisher(args, args.server) if args.publish != "none" else None
    per_rank = max(1, args.batch_size // engine.world_size)
    try:
        for step in range(1, args.steps + 1):
            batch = make_batch(engine.tokenizer, per_rank, seed=args.seed * 100003 + step * 1009 + engine.rank)
            stats = engine.train_batch(batch)
            line = (f"step {step}/{args.steps}  loss {stats['loss']:.4f}  grad_norm {stats['grad_norm']:.3f}  "
                    f"lr {stats['lr']:.2e}{'' if stats['update_successful'] else '  (step skipped: non-finite grad norm)'}")
            if publisher is not None:
                res = publisher.publish(engine, version=step)
                line += f"  | published v{res.version}: {res.bytes / 2**20:.1f} MiB in {res.seconds:.2f} s ({res.gbps:.2f} GB/s)"
            if engine.rank == 0:
                print(line, flush=True)
        if args.save:
            engine.save(args.save, weight_format=args.save_format)
            if engine.rank == 0:
                print(f"saved the model ({args.save_format}) to {args.save}", flush=True)
    finally:
        if publisher is not None:
            publisher.close()
        engine.destroy()
    return 0
