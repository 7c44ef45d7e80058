"""``wsync demo``: the whole system on this machine, for real, in a few minutes on 2 CPU cores.

What runs:
- ``--servers`` server processes: the reference server (SGLang's HTTP protocol, transformers on CPU), or with
  ``--engine sglang`` real SGLang, started by :func:`inference_adapter.real_sglang.launch_sglang` (on its CPU
  engine where there is no GPU);
- for the disk transport, a watcher following announcements in name resolution (a directory under the
  run's folder by default, or ``--name-resolve etcd://host:port``) that loads each version into the servers;
- a 2-rank FSDP2 trainer (local ranks in torchrun's environment, gloo) that trains on a string-reversal
  task and, after every step, publishes its weights (broadcast, disk, or both), asks every server a fixed
  prompt, and compares each server's greedy answer and version with its own greedy answer for the same
  weights.

It prints one table row per sync, writes the same facts to ``--json``, exits non-zero if any server ever
served a version other than the trainer's latest or a different answer, and stops every process it
started, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile

from bridge.errors import BridgeError, ConfigError, SyncError
from bridge.local.launch import start_ranks, under_torchrun
from bridge.name_resolve import DEFAULT_TRIAL
from wsync.flags import add_config_flags, setting_default
from wsync.train import add_model_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=25, help="training steps (one publish per step and transport)")
    from bridge.transports import transport_names

    p.add_argument("--transport", default="both", choices=[*transport_names(), "both", "all"],
                   help="how weights reach the servers: both = broadcast and disk; all = every registered transport "
                        f"({', '.join(transport_names())})")
    p.add_argument("--servers", type=int, default=1, help="number of servers to start")
    p.add_argument("--engine", default="reference", choices=["reference", "sglang"],
                   help="the servers: the reference server, or real SGLang (on its CPU engine where there is no GPU; "
                        "about 20 s to start each; installed by scripts/install_sglang.sh on a CPU host)")
    p.add_argument("--nproc", type=int, default=2, help="FSDP ranks of the trainer")
    p.add_argument("--name-resolve", metavar="URL",
                   help="name resolution for the disk transport: etcd://host:port, file:///path (default: a directory in the work folder)")
    p.add_argument("--workdir", metavar="DIR",
                   help="folder for the model, snapshots, logs, kept afterwards (default: a new temp folder, deleted "
                        "at the end unless the demo failed)")
    p.add_argument("--json", metavar="PATH", help="write every step's facts as JSON here")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="learning rate (at the default the tiny model answers the prompt right within about 20 steps)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch size")
    p.add_argument("--max-new-tokens", type=int, default=12, help="length of the greedy answers compared")
    p.add_argument("--log-level", default="WARNING", help="log level of the demo's processes")
    add_config_flags(p, only=("bucket_mb", "serving_dtype"))
    p.add_argument("--lora", action="store_true",
                   help="train a LoRA adapter (rank 8 on every projection) and publish only the adapter, by disk and by "
                        "tensors (--transport disk, colocated, broadcast, both = disk and tensors, or all); the servers "
                        "serve it as lora_path=policy")
    # Internal: set when the demo re-runs itself as a trainer rank under torchrun.
    p.add_argument("--_trainer-spec", dest="trainer_spec", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.trainer_spec:
        return _trainer_main(json.loads(args.trainer_spec))
    return _driver(args)


# ------------------------------------------------------------------------------------------ driver


def _driver(args: argparse.Namespace) -> int:
    from bridge.local.presets import make_model_dir
    from wsync.serve import require_server_stack

    if args.engine == "reference":
        require_server_stack()
    elif args.lora:
        raise ConfigError("--lora runs on the reference server only (--engine reference); real SGLang takes adapters "
                          "from AdapterPublisher, see docs/lora.md")

    for flag in ("steps", "servers", "nproc", "batch_size", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be a positive number of MiB, got {args.bucket_mb:g}")
    args.serving_dtype = args.serving_dtype or setting_default("serving_dtype")  # the servers start with it
    temporary = args.workdir is None
    workdir = args.workdir or tempfile.mkdtemp(prefix="wsync-demo-")
    os.makedirs(workdir, exist_ok=True)
    model_dir = args.model or make_model_dir(os.path.join(workdir, "model"), args.preset or "tiny")
    name_resolve = args.name_resolve or f"file://{os.path.join(workdir, 'name_resolve')}"
    print(f"wsync demo: work folder {workdir}"
          + (" (deleted at the end unless the demo fails; --workdir DIR keeps it)" if temporary else ""), flush=True)
    print(f"  model {model_dir}\n  transport {args.transport}, {args.servers} {args.engine} server(s), {args.nproc} "
          "trainer ranks"
          + (f", name resolution {name_resolve}" if args.transport in ("disk", "both", "all") else ""), flush=True)

    servers, watcher, trainer, failed = [], None, None, True
    old = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    snapshot_root = os.path.join(workdir, "snapshots")
    os.makedirs(snapshot_root, exist_ok=True)
    try:
        servers.extend(_start_servers(args, model_dir, workdir, snapshot_root))
        urls = [s.url for s in servers]
        print(f"  servers ready: {', '.join(urls)}", flush=True)
        if args.transport in ("disk", "both", "all") and not args.lora:  # the trainer tells the servers of an adapter
            watcher = _start_watcher(name_resolve, urls)
        spec = dict(
            model=model_dir, steps=args.steps, transport=args.transport, servers=urls, name_resolve=name_resolve,
            snapshot_root=snapshot_root, lr=args.lr, batch_size=args.batch_size,
            bucket_mb=args.bucket_mb, serving_dtype=args.serving_dtype, max_new_tokens=args.max_new_tokens,
            json=os.path.abspath(args.json) if args.json else None, log_level=args.log_level, lora=args.lora,
            engine=args.engine,
        )
        from wsync.cli import main

        trainer = start_ranks(args.nproc, ["demo", "--_trainer-spec", json.dumps(spec)],
                              env={"WSYNC_LOG_LEVEL": args.log_level}, entry=main)
        if trainer.wait() != 0:
            raise BridgeError(f"{trainer.failure()} (servers' logs are in {workdir})")
        failed = False
        return 0
    finally:
        signal.signal(signal.SIGTERM, old)
        if trainer is not None:
            trainer.terminate()
            trainer.close()
        if watcher is not None:
            watcher.stop()
        for s in servers:
            s.stop()
        if temporary and not failed:
            shutil.rmtree(workdir, ignore_errors=True)


def _start_servers(args: argparse.Namespace, model_dir: str, workdir: str, snapshot_root: str) -> list:
    """``--servers`` servers of ``--engine``, started at once; if one fails, the others are stopped."""
    import concurrent.futures as cf

    from inference_adapter.launcher import launch_server

    sglang = args.engine == "sglang"
    extra = ["--log-level", args.log_level.lower() if sglang else args.log_level,
             *(["--enable-lora"] if args.lora else [])]

    def one(i: int):
        return launch_server(model=model_dir, dtype=args.serving_dtype, log_path=os.path.join(workdir, f"server{i}.log"),
                             extra_args=extra, disk_roots=[snapshot_root], use_sglang=sglang)

    with cf.ThreadPoolExecutor(args.servers) as pool:
        futures = [pool.submit(one, i) for i in range(args.servers)]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for s in started:
            s.stop()
        raise errors[0]
    return started


def _start_watcher(name_resolve: str, urls: list[str]):
    from bridge.client import ServerGroup
    from bridge.name_resolve import make_name_resolve
    from inference_adapter.watcher import DiskWatcher

    watcher = DiskWatcher(make_name_resolve(name_resolve), "demo", DEFAULT_TRIAL, ServerGroup(urls))
    watcher.start()
    return watcher


# ------------------------------------------------------------------------------------------ trainer


def _trainer_main(spec: dict) -> int:
    from trainer import EngineConfig, FSDPEngine, LoraConfig, OptimizerConfig
    from wsync.tasks import make_batch

    assert under_torchrun()
    engine = FSDPEngine(EngineConfig(
        model_path=spec["model"], optimizer=OptimizerConfig(lr=spec["lr"], schedule="constant", max_grad_norm=1.0),
        lora=LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK) if spec.get("lora") else None,
    ))
    engine.initialize()
    pubs = _adapter_publishers(spec) if spec.get("lora") else _publishers(spec)
    table = _Table(spec["servers"]) if engine.rank == 0 else None
    records, ok, answerer = [], True, {}
    per_rank = max(1, spec["batch_size"] // engine.world_size)
    try:
        for step in range(1, spec["steps"] + 1):
            stats = engine.train_batch(make_batch(engine.tokenizer, per_rank, seed=step * 1009 + engine.rank))
            reference = _trainer_answer(engine, spec, answerer)  # collective gather; rank 0 gets the answer
            for transport, pub in pubs.items():
                res = pub.publish(engine, version=step)
                if engine.rank != 0:
                    continue
                served = _ask_servers(pub.servers, engine.tokenizer, spec["max_new_tokens"]) if not spec.get("lora") else \
                    _ask_for_adapter(answerer, spec, pub.config.name, engine.tokenizer)
                row_ok = all(s["version"] == str(step) and s["answer"] == reference for s in served.values())
                ok &= row_ok
                rec = dict(step=step, loss=stats["loss"], lr=stats["lr"], transport=transport, version=step,
                           sync_seconds=res.seconds, gbps=getattr(res, "gbps", res.bytes / max(res.seconds, 1e-9) / 1e9),
                           bytes=res.bytes, trainer_answer=reference, servers=served, ok=row_ok)
                records.append(rec)
                table.row(rec)
        if engine.rank == 0:
            _summary(spec, records, ok)
    finally:
        for pub in pubs.values():
            pub.close()
    return _finish(engine, ok)


LORA_RANK = 8
ADAPTER = "policy"


def _publishers(spec: dict) -> dict:
    """transport -> WeightPublisher of the full weights."""
    from bridge import PublisherConfig, WeightPublisher
    from bridge.transports import transport_names

    transports = {"both": ["broadcast", "disk"], "all": transport_names()}.get(spec["transport"], [spec["transport"]])
    common = dict(servers=spec["servers"], serving_dtype=spec["serving_dtype"], progress=False, experiment="demo",
                  trial=DEFAULT_TRIAL)
    if spec["bucket_mb"]:
        common["bucket_mb"] = spec["bucket_mb"]
    # Where snapshots go and are announced, for each transport that takes those options (disk).
    disk = dict(name_resolve=spec["name_resolve"], snapshot_root=spec["snapshot_root"])

    def config(transport: str):
        own = PublisherConfig.keywords(transport)
        return PublisherConfig(transport=transport, **common, **{k: v for k, v in disk.items() if k in own})

    return {t: WeightPublisher(config(t)) for t in transports}


def _adapter_publishers(spec: dict) -> dict:
    """via -> AdapterPublisher of the adapter alone: disk (``--transport disk``), tensors (``colocated``), broadcast
    (``broadcast``), disk and tensors (``both``) or all three (``all``)."""
    from bridge import AdapterPublisher, AdapterPublisherConfig

    vias = {"disk": ["disk"], "colocated": ["tensors"], "broadcast": ["broadcast"],
            "all": ["disk", "tensors", "broadcast"]}.get(spec["transport"], ["disk", "tensors"])
    root = os.path.join(spec["snapshot_root"], "adapters")
    return {via: AdapterPublisher(AdapterPublisherConfig(
        name=f"{ADAPTER}-{via}" if len(vias) > 1 else ADAPTER, via=via, servers=spec["servers"], root=root,
        name_resolve=spec["name_resolve"], experiment="demo", trial=DEFAULT_TRIAL)) for via in vias}


def _summary(spec: dict, records: list, ok: bool) -> None:
    from wsync.tasks import ANSWER, PROMPT

    verdict = "every server served the trainer's latest version with identical answers" if ok else "MISMATCH"
    print(f"\nwsync demo: {len(records)} syncs over {spec['steps']} steps; {verdict}", flush=True)
    rights = [r["step"] for r in records if all(s["answer"] == ANSWER for s in r["servers"].values())]
    right = rights[0] if rights else None
    last = bool(rights) and rights[-1] == records[-1]["step"]
    print(f"wsync demo: the servers answered {PROMPT!r} right ({ANSWER!r}) first at step {right}"
          f"{', and at the last step' if last else ' (not at the last step)'}" if right else
          f"wsync demo: the servers do not answer {PROMPT!r} right ({ANSWER!r}) yet: more --steps", flush=True)
    if spec["json"]:
        with open(spec["json"], "w") as f:
            json.dump({"ok": ok, "steps": spec["steps"], "transport": spec["transport"], "lora": bool(spec.get("lora")),
                       "servers": spec["servers"], "engine": spec.get("engine", "reference"), "right_from_step": right,
                       "syncs": records}, f, indent=2)
        print(f"wsync demo: wrote {spec['json']}", flush=True)


def _finish(engine, ok: bool) -> int:
    import torch.distributed as dist

    ok_all = [ok]
    if dist.is_initialized():
        dist.broadcast_object_list(ok_all, src=0)
    engine.destroy()
    if not ok_all[0]:
        raise SyncError("a server served another version or answer than the trainer's (the rows marked NO above); "
                        "the servers' logs are in the work folder")
    return 0


def _trainer_answer(engine, spec: dict, cache: dict) -> str | None:
    """The trainer's own greedy answer for its current weights cast to the serving dtype (rank 0); the
    model that answers is made once, kept in ``cache``."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridge.tensors import dtype_from_str
    from wsync.tasks import pad_id, prompt_ids

    dtype = dtype_from_str(spec["serving_dtype"])
    state = {}
    for s, full in engine.iter_full_tensors():
        if full is not None:
            state[s.name] = full.to(dtype)
    adapter = engine.gather_adapter() if engine.lora else None  # collective
    if engine.rank != 0:
        return None
    model = cache.get("model")
    if model is None:
        model = cache["model"] = AutoModelForCausalLM.from_config(engine.model_config, dtype=dtype)
        model.eval()
    model.load_state_dict(state, strict=False)
    if getattr(engine.model_config, "tie_word_embeddings", False):
        model.tie_weights()
    if adapter is not None:
        model = _with_adapter(cache, model, engine.adapter_config(), adapter)
    ids = torch.tensor([prompt_ids(engine.tokenizer)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=spec["max_new_tokens"], pad_token_id=pad_id(engine.tokenizer))
    return engine.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _with_adapter(cache: dict, model, config: dict, adapter: dict):
    """``model`` wrapped by PEFT (made once) with ``adapter`` loaded by PEFT's own loader: what the servers serve."""
    import peft

    from trainer.lora import peft_model

    pm = cache.get("peft")
    if pm is None:
        known = set(peft.LoraConfig.__dataclass_fields__)
        lora = peft.LoraConfig(**{k: v for k, v in config.items() if k in known and k not in ("peft_type", "inference_mode")})
        pm = cache["peft"] = peft_model(model, lora).eval()
    peft.set_peft_model_state_dict(pm, {n: t.clone() for n, t in adapter.items()})
    return pm


def _ask_for_adapter(cache: dict, spec: dict, name: str, tokenizer) -> dict:
    """Each server's greedy answer with the adapter ``name`` (``lora_path``) and the adapter version it reports."""
    from bridge.client import ServerGroup
    from wsync.tasks import prompt_ids

    servers = cache.get("servers")
    if servers is None:
        servers = cache["servers"] = ServerGroup(spec["servers"])
    body = dict(input_ids=prompt_ids(tokenizer), sampling_params={"temperature": 0, "max_new_tokens": spec["max_new_tokens"]},
                lora_path=name)
    outs = servers.map(lambda c: c.generate(**body))
    return {c.url: {"version": o["meta_info"].get("wsync_lora_version"), "completion_tokens": len(o["output_ids"]),
                    "weight_versions": [{"version": o["meta_info"].get("wsync_lora_version"), "start": 0,
                                         "end": len(o["output_ids"])}],
                    "answer": tokenizer.decode(o["output_ids"], skip_special_tokens=True)}
            for c, o in zip(servers.clients, outs)}


def _ask_servers(servers, tokenizer, max_new_tokens: int) -> dict:
    """Each server's greedy answer, the version it reports, and the versions its tokens ran on (spans)."""
    from bridge.client.results import generation_versions
    from wsync.tasks import prompt_ids

    body = dict(input_ids=prompt_ids(tokenizer), sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
    outs = servers.map(lambda c: c.generate(**body))
    return {
        c.url: {"version": o["meta_info"]["weight_version"], "weight_versions": generation_versions(o),
                "completion_tokens": len(o["output_ids"]),
                "answer": tokenizer.decode(o["output_ids"], skip_special_tokens=True)}
        for c, o in zip(servers.clients, outs)
    }


class _Table:
    def __init__(self, urls: list[str]):
        self.urls = urls
        head = f"{'step':>4} {'loss':>7} {'transport':>9} {'sync s':>7} {'GB/s':>6}  {'versions ran on':<16} {'same':<5} answer"
        print(head + "\n" + "-" * len(head), flush=True)

    def row(self, r: dict) -> None:
        from bridge.client.results import versions_text

        versions = ",".join(versions_text(s["weight_versions"]) for s in r["servers"].values())
        same = "yes" if r["ok"] else "NO"
        answer = next(iter(r["servers"].values()))["answer"] or "<eos>"  # the model stopped at once
        print(f"{r['step']:>4} {r['loss']:>7.4f} {r['transport']:>9} {r['sync_seconds']:>7.3f} {r['gbps']:>6.3f}  "
              f"{versions:<16} {same:<5} {answer}", flush=True)
