"""Where one method's sync time goes: ``python -m bench.profile --size many --method flat-32MiB``.

The bench says how far a method is from its floor; this says why, measured. It runs the same trainer job
as ``wsync bench`` (same server, watchers, FSDP ranks, publishers: :func:`bench.run.measure_size`), but
rank 0 times the pieces of each sync instead of the sync alone:

- ``gather``: ``bridge.publisher._gather_into`` (every bucket's gather to rank 0);
- ``begin`` / ``buffer`` / ``send`` / ``settle`` / ``commit``: the transport's own lifecycle methods
  (``settle`` is the wait for a bucket's server answers and broadcast; ``commit`` ends the sessions and
  resumes, or for disk finishes, announces and waits until loaded);
- ``agreement``: ``Agreement.exchange``, the cross-rank vote after every step (it also absorbs the time a
  rank waits for a slower one);
- ``http <route>``: every HTTP call rank 0 makes, by route, and how many per sync (these overlap the
  above: an update request is posted in ``send`` and waited for in ``settle``).

The wrappers only read the clock around the real calls; nothing is replaced. A cProfile of rank 0 over
the timed syncs (top functions by cumulative time) is kept with the figures. One warm-up sync first.

Example:
    python -m bench.profile --size many --method per-tensor --repeats 3
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
                                                          "delta-lr<LR> (e.g. delta-lr1e-06), lora-tensors or lora-disk (rank 16)")
    p.add_argument("--bucket-mb", type=float, default=32.0, help="the flat/colocated bucket size (default 32)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--top", type=int, default=30, help="functions of the cProfile to show (by cumulative time)")
    p.add_argument("--json", help="also write the breakdown here")
    args = p.parse_args(argv)
    kw = {"workdir": args.workdir} if args.workdir else {}
    # delta-lr<LR>: the delta rows' publisher (bench.delta), one optimizer step at LR before each timed sync.
    lrs = [float(args.method[len("delta-lr"):])] if args.method.startswith("delta-lr") else []
    cfg = BenchConfig(sizes=[args.size], bucket_mb=[args.bucket_mb], repeats=args.repeats, nproc=args.nproc, etcd=False,
                      delta_lrs=lrs, lora_rank=16 if args.method.startswith("lora-") else 0, **kw)
    place = placement(cfg.device, cfg.nproc)
    run_dir = tempfile.mkdtemp(prefix="profile-", dir=ensure_dir(cfg.workdir, "runs"))
    try:
        out = measure_size(cfg, args.size, preset_model_dir(cfg.workdir, args.size), run_dir, None, place,
                           extra={"profile": {"method": args.method, "repeats": args.repeats, "top": args.top}})
    finally:
        clean_run(run_dir, keep=False)
    print(format_breakdown(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


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
