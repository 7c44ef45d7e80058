"""``wsync watch``: load every version announced in name resolution into a set of servers."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from inference_adapter.watcher import add_arguments as add

    add(p)


def run(args: argparse.Namespace) -> int:
    from inference_adapter.watcher import run as watch

    return watch(args)
