"""``wsync serve``: the reference server (SGLang's HTTP protocol, a transformers model on CPU)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from inference_adapter.server import add_server_arguments

    add_server_arguments(p)


def run(args: argparse.Namespace) -> int:
    from inference_adapter.server import run as serve

    return serve(args)
