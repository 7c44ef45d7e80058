"""``wsync train``: train with the FSDP2 engine on the synthetic reversal task, publishing as it goes.

Run as a command, it checks every flag, picks the first version to publish, then starts ``--nproc``
local ranks (torchrun's environment) and reports their failure as one line; under torchrun it is one of
those ranks. Every step prints loss, grad norm and learning rate (rank 0).
"""

from __future__ import annotations

import argparse
import os

from bridge.errors import ConfigError, ServerError
from bridge.local.launch import run_ranks, under_torchrun
from wsync.flags import add_config_flags, config_keywords, negatable


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", metavar="DIR", help="a local HF causal-LM directory (default: the tiny preset)")
    from bridge.local.presets import PRESETS

    g.add_argument("--preset", choices=list(PRESETS), help="build a preset model from its config (default: tiny)")


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
    g = p.add_argument_group("LoRA", "train a PEFT LoRA adapter on frozen base weights (docs/lora.md)")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R", help="train a LoRA adapter of rank R (default: full training)")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="A", help="LoRA alpha (default: 2 x rank)")
    g.add_argument("--lora-target-modules", default=None, metavar="NAMES",
                   help="comma-separated module names that get an adapter (default: every projection)")
    g.add_argument("--publish-adapter", default=None, metavar="NAME",
                   help="publish the adapter alone under NAME after every step: with --publish disk a PEFT "
                        "directory under --snapshot-root, announced in --name-resolve; with --publish colocated by "
                        "tensors to servers on this host; with --publish broadcast over a weight-update group to "
                        "reference servers (wsync serve) on any host (they serve it as lora_path=NAME)")
    p.add_argument("--save", metavar="DIR", help="save the trained model here at the end")
    p.add_argument("--save-format", default="hf", choices=["hf", "dcp"], help="format of --save")
    p.add_argument("--start-version", type=int, metavar="N",
                   help="version of the first publish (default: one past the newest version already announced "
                        "for --experiment/--trial (disk) or served (broadcast), else 1)")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO; env WSYNC_LOG_LEVEL)")
    add_config_flags(p, rename={"transport": "publish"}, none={"transport": "train without publishing"})


def run(args: argparse.Namespace) -> int:
    if under_torchrun():
        return _rank_main(args)
    check_arguments(args)
    if args.transport != "none" and args.publish_adapter is None:
        args.start_version = _first_version(args, publisher_config(args))
    elif args.publish_adapter is not None and args.transport == "disk" and args.start_version is None:
        args.start_version = _first_adapter_version(args)
    from wsync.cli import main

    run_ranks(args.nproc, ["train", *_argv_of(args)], entry=main)
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad flags before any rank starts (a rank would fail only after loading the model).

    Raises:
        ConfigError: names the flag, what was wrong and what to pass.
    """
    for flag in ("nproc", "steps", "batch_size", "mb_max_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be positive, got {args.lr}")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ConfigError(f"--model {args.model} is not an HF model directory (no config.json); "
                          f"make one with `wsync make-model DIR` or pass --preset")
    if args.start_version is not None and args.start_version < 1:
        raise ConfigError(f"--start-version must be >= 1, got {args.start_version}")
    if args.lora_rank is None and (args.lora_alpha is not None or args.lora_target_modules is not None):
        raise ConfigError("--lora-alpha and --lora-target-modules configure a LoRA adapter; add --lora-rank R")
    _lora_config(args)  # checks the LoRA flags' values
    if args.publish_adapter is not None:
        _adapter_config(args)  # checks the adapter publish's flags
    if args.transport == "none":
        return
    from bridge.transports import transport_class

    if transport_class(args.transport).needs_servers and not args.servers and not args.server_registry:
        raise ConfigError(f"--publish {args.transport} needs at least one --server URL (start one with `wsync serve`) "
                          "or a --server-registry")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be a positive number of MiB, got {args.bucket_mb:g}")
    cfg = publisher_config(args)  # checks --bucket-mb, --serving-dtype, the URLs' form, a foreign option
    if cfg.transport == "disk":
        from bridge.name_resolve import make_name_resolve

        make_name_resolve(_announced_in(cfg)).close()  # checks the URL (and that etcd's client loads)


def _announced_in(cfg) -> str:
    """Where the disk transport of ``cfg`` announces its versions."""
    from bridge.name_resolve import DEFAULT_URL

    return cfg.name_resolve or DEFAULT_URL


def _first_version(args: argparse.Namespace, cfg) -> int:
    """``--start-version``, or one past the newest version of this run's target, else 1.

    A rerun of the same command then continues where the last run stopped, saying so, instead of
    failing on "version 1 is older than version 5 already announced".

    Raises:
        ConfigError: ``--start-version`` is not past the newest version already there.
    """
    newest, where = _newest_version(cfg)
    if newest is None:
        return args.start_version or 1
    if args.start_version is None:
        print(f"wsync train: version {newest} is already {where}; publishing versions {newest + 1}.."
              f"{newest + args.steps} (pass --start-version N to choose, or a new --trial to start at 1)", flush=True)
        return newest + 1
    if args.start_version <= newest:
        restart = ", or --new-run to start over on these servers" if where.startswith("served") else ""
        raise ConfigError(f"--start-version {args.start_version}: version {newest} is already {where} and versions "
                          f"must increase; pass --start-version {newest + 1} (or leave it out to continue there), "
                          f"or a new --trial{restart}")
    return args.start_version


def _first_adapter_version(args: argparse.Namespace) -> int:
    """One past the newest version of ``--publish-adapter`` announced for the trial (a rerun continues), else 1."""
    from bridge import AdapterPublisher

    with AdapterPublisher(_adapter_config(args)) as pub:
        newest = pub.newest_announced_version()
    if newest is None:
        return 1
    print(f"wsync train: adapter {args.publish_adapter} version {newest} is already announced for "
          f"{pub.config.experiment}/{pub.config.trial}; publishing versions {newest + 1}..{newest + args.steps} "
          "(--start-version N chooses)", flush=True)
    return newest + 1


def _newest_version(cfg) -> tuple[int | None, str]:
    """The newest version announced for the run's experiment/trial (disk) or served by --server, and where.

    Disk counts the servers too: a server that serves version 5 refuses to load version 1, unless
    ``--new-run`` (then only the announcements count).
    """
    found: list[tuple[int, str]] = []
    if cfg.transport == "disk":
        from bridge import VersionSubscriber

        sub = VersionSubscriber(_announced_in(cfg), cfg.experiment, cfg.trial)
        try:
            latest = sub.latest()
        finally:
            sub.close()
        if latest is not None:
            found.append((latest.version, f"announced for {cfg.experiment}/{cfg.trial} in {_announced_in(cfg)}"))
    if (cfg.servers or cfg.server_registry) and not cfg.new_run:
        served, where = _served_versions(cfg)
        if served:
            found.append((max(served), "served by " + ", ".join(where)))
    return max(found, default=(None, ""))


def _served_versions(cfg) -> tuple[list[int], list[str]]:
    """The versions the --server URLs serve, and those of the servers the registries list that answer."""
    from bridge import ServerGroup

    served, where = [], list(cfg.servers)
    try:
        if cfg.servers:
            with ServerGroup(cfg.servers, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key) as servers:
                served = [int(v) for v in servers.weight_versions().values() if v.isdigit()]
    except ServerError as e:
        if e.status is not None:
            raise
        raise ConfigError(f"cannot reach --server {e.server}: is a server running there (`wsync serve --port N`) "
                          f"and is the URL right?") from e
    if cfg.server_registry:
        from bridge.fleet import list_servers

        for url, version in list_servers(cfg.server_registry, cfg.experiment, cfg.trial).items():
            if version is not None and version.isdigit():
                served.append(int(version))
                where.append(url)
    return served, where


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces ``args`` (what each rank parses again)."""
    negated = negatable()  # --no-<flag> says False
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    out = []
    for k, v in vars(args).items():
        flag = flags.get(k, "--" + k.replace("_", "-"))
        if v is False and k in negated:
            out.append("--no-" + flag[2:])
            continue
        if k.startswith("_") or v in (None, False) or (isinstance(v, list) and not v):
            continue
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
        lora=_lora_config(args),
    )
    engine = FSDPEngine(cfg)
    engine.initialize()
    return engine


def _lora_config(args: argparse.Namespace):
    """The :class:`trainer.LoraConfig` of the ``--lora-*`` flags, or None without ``--lora-rank``."""
    from trainer.config import LORA_ALL_LINEAR, LoraConfig

    if args.lora_rank is None:
        return None
    try:
        return LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank,
                          target_modules=args.lora_target_modules or LORA_ALL_LINEAR)
    except ConfigError as e:
        raise ConfigError(f"{e} (flags --lora-rank/--lora-alpha/--lora-target-modules)") from None


def _adapter_config(args: argparse.Namespace):
    """The :class:`bridge.AdapterPublisherConfig` of ``--publish-adapter`` and the publish flags."""
    from bridge import AdapterPublisherConfig
    from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL

    if args.lora_rank is None:
        raise ConfigError("--publish-adapter publishes a LoRA adapter; train one with --lora-rank R")
    from bridge.transports import transport_class

    vias = {"disk": "disk", "colocated": "tensors", "broadcast": "broadcast"}
    transport = transport_class(args.transport).name if args.transport != "none" else "none"
    if transport not in vias:
        raise ConfigError(f"--publish-adapter goes by --publish disk, colocated (servers on this host) or broadcast "
                          f"(reference servers); got --publish {args.transport}")
    root = os.path.join(args.snapshot_root, "adapters") if args.snapshot_root else None
    group = {k: getattr(args, k) for k in ("group_timeout", "master_address", "master_port", "backend", "http_timeout",
                                           "probe_timeout")
             if getattr(args, k, None) is not None}  # the full publisher's flags, where given
    return AdapterPublisherConfig(name=args.publish_adapter, via=vias[transport], servers=args.servers or (), **group,
                                  server_registry=args.server_registry or None,
                                  **({"min_servers": args.min_servers} if args.min_servers is not None else {}),
                                  root=root, name_resolve=args.name_resolve,
                                  experiment=args.experiment or DEFAULT_EXPERIMENT, trial=args.trial or DEFAULT_TRIAL,
                                  api_key=args.api_key, admin_api_key=args.admin_api_key)


def publisher_config(args: argparse.Namespace):
    """The :class:`bridge.PublisherConfig` the flags describe (its checks raise ``ConfigError``)."""
    from bridge import PublisherConfig

    return PublisherConfig(**config_keywords(args))


def build_publisher(args: argparse.Namespace):
    """The publisher of ``--publish``: an :class:`bridge.AdapterPublisher` with ``--publish-adapter``."""
    from bridge import AdapterPublisher, WeightPublisher

    if args.publish_adapter is not None:
        return AdapterPublisher(_adapter_config(args))
    return WeightPublisher(publisher_config(args))


def _rank_main(args: argparse.Namespace) -> int:
    from wsync.tasks import make_batch

    engine = build_engine(args)
    publisher = build_publisher(args) if args.transport != "none" else None
    per_rank = max(1, args.batch_size // engine.world_size)
    try:
        for step in range(1, args.steps + 1):
            batch = make_batch(engine.tokenizer, per_rank, seed=args.seed * 100003 + step * 1009 + engine.rank)
            stats = engine.train_batch(batch)
            line = (f"step {step}/{args.steps}  loss {stats['loss']:.4f}  grad_norm {stats['grad_norm']:.3f}  "
                    f"lr {stats['lr']:.2e}{'' if stats['update_successful'] else '  (step skipped: non-finite grad norm)'}")
            if publisher is not None:
                res = publisher.publish(engine, version=(args.start_version or 1) + step - 1)
                if args.publish_adapter is not None:
                    line += f"  | adapter {res.name} v{res.version}: {res.bytes / 2**20:.2f} MiB in {res.seconds:.2f} s"
                else:
                    line += f"  | published v{res.version}: {res.bytes / 2**20:.1f} MiB in {res.seconds:.2f} s ({res.gbps:.2f} GB/s)"
                if args.publish_adapter is None and res.encoding != "full":
                    line += f" {res.encoding}" + (f" ({res.anchor_reason})" if res.anchor_reason else "")
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
