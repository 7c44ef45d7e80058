"""Where one method's sync time goes: ``python -m bench.profile --size many --method flat-32MiB``.

The bench says how far a method is from its floor; this says why, measured. It runs the same trainer job
as ``wsync bench`` (same server, watchers, FSDP ranks, publishers: :func:`bench.run.measure_size`), but
rank 0 times the pieces of each sync instead of the sync alone:

- ``gather``: ``bridge.publisher.core._gather_into`` (every bucket's gather to rank 0);
- ``begin`` / ``buffer`` / ``send`` / ``settle`` / ``commit``: the transport's own lifecycle methods
  (``settle`` is the wait for a bucket's server answers and broadcast; ``commit`` ends the sessions and
  resumes, or for disk finishes, announces and waits until loaded);
- ``agreement``: ``Agreement.exchange``, the cross-rank vote after every step (it also absorbs the time a
  rank waits for a slower one);
- ``http <route>``: every HTTP call rank 0 makes, by route, and how many per sync (these overlap the
  above: an update request is posted in ``send`` and waited for in ``settle``).

The wrappers only read the clock around the real calls; nothing is replaced. A cProfile of rank 0 over
the timed syncs (top functions by cumulative time) is kept with the figures. One warm-up sync first.

``--kernels`` times the trainer's CPU work instead (:mod:`bench.kernels`): each rank's diff and FP8 quantization
against a plain copy of the same bytes, in bytes per second.

``--link RATE`` puts the servers behind a shaped link, as ``wsync bench --link`` does, so that what the link hides
and what it does not are timed where bytes cost; ``--method fp8-32MiB`` and ``delta-lr<LR>`` time the FP8 bucket
fills and the delta encoding's steps too.

Example:
    python -m bench.profile --size many --method per-tensor --repeats 3
    python -m bench.profile --size medium --method fp8-32MiB --link 1gbit
    python -m bench.profile --size medium --kernels
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

__all__ = ["format_breakdown", "main"]

# The timed syncs themselves run in the trainer ranks: bench.phase_timer.profile_method.


def main(argv: list[str] | None = None) -> int:
    from bench.run import BenchConfig, clean_run, ensure_dir, measure_size, placement, preset_model_dir

    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="many", help="preset (default many)")
    p.add_argument("--method", default="flat-32MiB", help="flat-<N>MiB, per-tensor, colocated-<N>MiB, disk-dir or "
                                                          "delta-lr<LR> (e.g. delta-lr1e-06), fp8+delta-lr<LR>, lora-tensors or lora-disk (rank 16)")
    p.add_argument("--bucket-mb", type=float, default=32.0, help="the flat/colocated bucket size (default 32)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--top", type=int, default=30, help="functions of the cProfile to show (by cumulative time)")
    p.add_argument("--json", help="also write the breakdown here")
    p.add_argument("--link", metavar="RATE", help="the servers behind a link shaped to RATE (as wsync bench --link: root, "
                                                  "iproute2), so that the pieces are timed where bytes cost")
    p.add_argument("--log-level", default="WARNING", help="log level of every process (the servers' INFO lines time "
                                                         "each request); with --keep-run their logs stay")
    p.add_argument("--keep-run", action="store_true", help="keep the run folder (logs)")
    p.add_argument("--kernels", action="store_true", help="time the trainer's CPU kernels instead (the delta's diff, "
                                                            "the FP8 quantization) against a plain copy, per rank "
                                                            "(bench.kernels)")
    p.add_argument("--lr", type=float, default=1e-6, help="with --kernels: the step each element takes (default 1e-6)")
    p.add_argument("--_link-spec", dest="link_spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kernels:
        from bench.kernels import format_kernels, measure_kernels

        ranks = measure_kernels(args.size, args.nproc, args.lr, args.repeats)
        print(format_kernels(ranks, args.size, args.lr))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ranks, f, indent=1)
        return 0
    if args.link and not args.link_spec:
        return _run_linked(args, argv if argv is not None else sys.argv[1:])
    link = json.loads(args.link_spec) if args.link_spec else None
    kw = {"workdir": args.workdir} if args.workdir else {}
    # delta-lr<LR> and fp8+delta-lr<LR>: the delta rows' publishers (bench.delta), one optimizer step at LR before
    # each timed sync.
    lrs = [float(args.method.split("delta-lr")[1])] if "delta-lr" in args.method else []
    cfg = BenchConfig(sizes=[args.size], bucket_mb=[args.bucket_mb], repeats=args.repeats, nproc=args.nproc, etcd=False,
                      delta_lrs=lrs, lora_rank=16 if args.method.startswith("lora-") else 0,
                      colocated=link is None, log_level=args.log_level, keep_run=args.keep_run, **kw)
    place = placement(cfg.device, cfg.nproc)
    run_dir = tempfile.mkdtemp(prefix="profile-", dir=ensure_dir(cfg.workdir, "runs"))
    try:
        out = measure_size(cfg, args.size, preset_model_dir(cfg.workdir, args.size), run_dir, None, place,
                           extra={"profile": {"method": args.method, "repeats": args.repeats, "top": args.top}},
                           link=link)
    finally:
        clean_run(run_dir, keep=args.keep_run)
    print(format_breakdown(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _run_linked(args, argv: list[str]) -> int:
    """Build the link (:class:`bench.netns.Link`), run this profile again inside its trainer namespace, remove it."""
    from dataclasses import asdict

    from bench.netns import Link, LinkSpec, require, run_in_namespace

    require()
    link = Link(args.link)
    try:
        link.up()
        measured = link.measure(32.0)
        spec = asdict(LinkSpec(rate=args.link, delay=None, trainer_ns=link.ns["t"], server_ns=link.ns["s"],
                               trainer_addr=link.addr["t"], server_addr=link.addr["s"], measured=measured))
        return run_in_namespace(link.ns["t"], ["-m", "bench.profile", *argv, "--_link-spec", json.dumps(spec)])
    finally:
        link.down()


def format_breakdown(out: dict) -> str:
    """The per-sync figures as text, then the cProfile."""
    import statistics

    med = statistics.median(out["seconds"])
    lines = [f"{out['label']} {out['method']}: {out['tensors']} tensors, {out['bytes'] / 1e6:.1f} MB; sync median "
             f"{med:.3f} s (min {min(out['seconds']):.3f}, {out['repeats']} syncs); mean seconds per sync by piece "
             "(pieces overlap: http calls happen inside send/settle/commit/begin):"]
    for k, v in out["per_sync"].items():
        lines.append(f"  {k:<44} {v:8.4f} s  {out['calls_per_sync'].get(k, 0):7.1f} calls")
    from bench.phase_timer import fixed_work

    lines.append(f"  {'fixed work (steps begin+settle+commit, agreement)':<44} {fixed_work(out['per_sync']):8.4f} s  "
                 "(pause, sessions, the wait for the last bucket, end, resume, every cross-rank agreement)")
    if out.get("gather_alone_seconds"):
        alone = out["gather_alone_seconds"]
        lines.append(f"  {out['gather_item'] + ' alone, between the syncs':<44} {sum(alone) / len(alone):8.4f} s  "
                     "(mean; the same bucket plan's gather with nothing else running)")
    if out.get("snapshot"):
        sn = out["snapshot"]
        lines.append(f"  snapshot (the last sync's, {sn['bytes'] / 1e6:.0f} MB of tensors): verify_snapshot "
                     f"{sn['verify_seconds']:.4f} s, plain read {sn['read_seconds']:.4f} s, read_snapshot (verifies "
                     f"as it reads) {sn.get('verified_read_seconds', float('nan')):.4f} s")
    lines += ["", out["cprofile"]]
    return "\n".join(lines)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    os._exit(130)
