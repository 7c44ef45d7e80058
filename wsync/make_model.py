"""``wsync make-model DIR``: a complete HF model directory built locally from a preset."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bridge.local.presets import PRESETS

    p.add_argument("dir", help="directory to write (created if missing)")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="model size: tiny (~0.33M params), small (~48M), medium (~193M)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")


def run(args: argparse.Namespace) -> int:
    from bridge.local.presets import make_model_dir

    path = make_model_dir(args.dir, args.preset, seed=args.seed)
    print(f"wrote a {args.preset} Qwen2-style causal LM with a byte-level tokenizer to {path}")
    return 0
