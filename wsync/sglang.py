"""``wsync sglang``: start real SGLang on this host with the right flags, wait until it generates, stop it on
Ctrl-C or SIGTERM (its whole process group).

On a CUDA host SGLang runs as shipped; on a CPU host on its CPU engine, with the project's stand-ins
(:mod:`inference_adapter.real_sglang`). Every flag after ``--`` goes to SGLang's own ``launch_server``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

EPILOG = """\
examples:
  wsync sglang --preset tiny-llama --port 30000
  wsync sglang --model /models/Qwen2.5-0.5B --port 30000 -- --custom-weight-loader bridge.serving.sglang_delta_loader.load_delta
  wsync sglang --print-command --model DIR      (the command and environment, to run SGLang yourself)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bridge.local.presets import PRESETS

    p.epilog = EPILOG
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local HF model directory to serve")
    src.add_argument("--preset", choices=list(PRESETS),
                     help="serve a model built locally from this preset (default: tiny; tiny-llama: a Llama, whose "
                          "SGLang model class answers /get_weights_by_name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="serving dtype")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait until it generates (about 20 s on 2 idle CPU cores)")
    p.add_argument("--log", help="file for SGLang's output (default: a temporary file, named when it starts)")
    p.add_argument("--print-command", action="store_true",
                   help="print the environment and the command line instead of starting it")
    p.add_argument("--check", action="store_true",
                   help="only check that SGLang's server imports here (with the CPU stand-ins on a CPU host), without "
                        "starting it")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER,
                   help="after --: more flags for SGLang's launch_server (they win over the CPU defaults)")


def run(args: argparse.Namespace) -> int:
    from bridge.errors import ConfigError
    from inference_adapter.real_sglang import (
        STANDINS,
        check_server_imports,
        find_sglang,
        has_cuda,
        launch_sglang,
        sglang_command,
        sglang_env,
    )
    from wsync.serve import check_port_free

    extra = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    if args.port is not None and not 0 < args.port < 65536:
        raise ConfigError(f"--port must be a port number (1-65535), got {args.port}")
    if args.check:
        where = find_sglang() or "this environment"
        print(f"SGLang {check_server_imports()}'s server imports on this host (SGLang from {where}"
              f"{'' if has_cuda() else '; CPU stand-ins from ' + STANDINS})")
        return 0
    if args.print_command:
        env = sglang_env({})
        for key in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH"):
            if key in env:
                print(f"export {key}={env[key]}")
        print(" ".join(sglang_command(args.model or "MODEL_DIR", args.host, args.port, args.dtype, extra)))
        return 0
    check_port_free(args.host, args.port)
    server = launch_sglang(args.model, args.preset, port=args.port, host=args.host, dtype=args.dtype,
                           extra_args=extra, ready_timeout=args.ready_timeout, log_path=args.log)
    print(f"real SGLang serves {args.model or args.preset or 'tiny'} at {server.url} (log {server.log_path}); "
          "Ctrl-C stops it", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if not server.alive():
                print(f"wsync sglang: error: real SGLang exited with code {server.process.returncode}; the end of its "
                      f"log ({server.log_path}):\n{server.log_tail(20)}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
