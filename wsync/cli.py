"""``wsync``: the command-line face of the weight-sync bridge.

Each subcommand lives in its own module and is imported only when used, so ``wsync --help`` is fast.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import signal
import sys

# name -> (module, one-line help). Each module has add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "demo": ("wsync.demo", "the whole system on this machine: servers, a 2-rank trainer, a sync after every step"),
    "train": ("wsync.train", "train with the FSDP2 engine (launches its own ranks), optionally publishing weights"),
    "serve": ("wsync.serve", "run the reference server, which speaks SGLang's HTTP protocol on CPU"),
    "watch": ("wsync.watch", "follow disk announcements in name resolution and load each version into servers"),
    "sglang": ("wsync.sglang", "start real SGLang on this host (its CPU engine where there is no GPU) and wait until "
                               "it generates"),
    "register": ("wsync.register", "keep a server's entry in a registry (etcd, a directory) while it answers: the "
                                   "sidecar for real SGLang"),
    "status": ("wsync.status", "one table of the fleet: each server's version, paused or out of rotation, how far "
                               "behind; exit status 0 when every server is on the newest version"),
    "bench": ("wsync.bench", "measure broadcast vs disk vs per-tensor sync against the raw transport"),
    "make-model": ("wsync.make_model",
                   "write a complete HF model directory (config, weights, tokenizer) from a preset"),
}

DESCRIPTION = """\
Move a trainer's weights into SGLang servers, versioned and atomically: by a bucketed broadcast over a
custom process group (NCCL on GPU, gloo on CPU), or by HF snapshots on disk announced through name
resolution (etcd, or a directory). Everything runs on CPU; real SGLang is driven the same way on GPU.

Start with:  wsync demo            (no GPU, no etcd, nothing downloaded)

A failure ends with one line naming the cause and the fix; --debug (or WSYNC_DEBUG=1) prints tracebacks.
"""


# Optional modules -> the extra that installs them (pyproject.toml's optional-dependencies).
EXTRAS = {"fastapi": "server", "uvicorn": "server", "starlette": "server", "matplotlib": "bench", "etcd3": "etcd",
          "grpc": "etcd", "peft": "lora"}


def missing_extra(e: ImportError) -> str:
    """One line for an optional module that is not installed: which extra brings it."""
    module = (e.name or "").split(".")[0]
    extra = EXTRAS.get(module)
    if extra is None:
        return f"{e}; reinstall wsync: pip install -e '.[all]' (from the checkout)"
    return (f"this needs the {module} package, which is not installed; pip install 'wsync[{extra}]' "
            f"(or -e '.[{extra}]' in a checkout)")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings
                or isinstance(action, argparse._StoreFalseAction)):
            return text
        return f"{text} (default: {action.default})"


def _command_parser(name: str, help_: str, parent=None) -> argparse.ArgumentParser:
    kwargs = dict(description=help_, formatter_class=_HelpFormatter)
    if parent is None:
        p = argparse.ArgumentParser(prog=f"wsync {name}", **kwargs)
    else:
        p = parent.add_parser(name, help=help_, **kwargs)
    p.add_argument("--debug", action="store_true",
                   help="print tracebacks with errors, in this process and the ones it starts (or set WSYNC_DEBUG=1)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wsync", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # an extra is not installed: the command is listed, and says which extra
            help_ = f"{help_} [{missing_extra(e)}]"
            mod = None
        p = _command_parser(name, help_, sub)
        p.set_defaults(_module=module)
        if mod is not None:
            mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from bridge.local.launch import ARGV_ENV
    from bridge.log import DEBUG_ENV

    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # `kill -USR1 PID`: every thread's stack on the
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)  # process's stderr; it goes on
    if argv is None:
        # A rank started by bridge.local.launch.start_ranks gets its arguments from the environment.
        rank_process = ARGV_ENV in os.environ
        argv = json.loads(os.environ.pop(ARGV_ENV)) if rank_process else sys.argv[1:]
        if rank_process:
            return _exit_now(main(argv))
    # Library progress bars ("Loading weights", "Writing model shards") drown the project's own output;
    # set before transformers is imported, and inherited by every process the command starts.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"  # inherited by every process the command starts
    if argv and argv[0] in COMMANDS and not {"-h", "--help"} & set(argv):
        # Build only the parser of the command that runs.
        name = argv[0]
        module, help_ = COMMANDS[name]
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            print(f"wsync {name}: error: {missing_extra(e)}", file=sys.stderr)
            return 2
        p = _command_parser(name, help_)
        mod.add_arguments(p)
        args = p.parse_args(argv[1:])
    else:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_module", None):
            parser.print_help()
            return 2
        mod = importlib.import_module(args._module)
    from bridge.log import setup_logging

    setup_logging(getattr(args, "log_level", None))
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        print(f"wsync {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        _report(argv[0], e)
        from bridge.errors import ConfigError

        return 2 if isinstance(e, ConfigError) else 1  # 2: a flag or setting is wrong, as argparse's usage errors


def _report(command: str, e: Exception) -> None:
    """End a failed command with one line naming the cause (and, for the project's errors, the fix).

    In a rank, the line goes to the command that started the ranks, which reports each distinct one once.
    With --debug / WSYNC_DEBUG=1 the traceback is printed as well.
    """
    import traceback

    from bridge.errors import BridgeError
    from bridge.local.launch import report_rank_error
    from bridge.log import debug_enabled

    if isinstance(e, BridgeError):
        message = str(e)
    elif isinstance(e, ImportError):
        message = missing_extra(e)
    else:  # not raised on purpose: its message may not say what to do
        message = f"{type(e).__name__}: {e} (unexpected; rerun with --debug for the traceback)"
    if debug_enabled():
        traceback.print_exc()
    if report_rank_error(message):
        return
    for line in message.splitlines() or [type(e).__name__]:
        print(f"wsync {command}: error: {line}", file=sys.stderr, flush=True)


def _exit_now(code: int) -> int:
    """End a trainer rank without interpreter teardown.

    By the time a rank's command returns it has destroyed its process groups and written its output.
    Under load, gloo's worker threads were seen to race Python's teardown of the rank and abort it
    ("terminate called without an active exception") after a successful run, which torchrun reports
    as a failure; skipping the teardown keeps the exit code the command meant.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
