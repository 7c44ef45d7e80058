"""``python -m bench.cuda_ipc_probe``: can two processes on this host share CUDA memory through IPC handles?

The colocated transport hands SGLang CUDA IPC handles of the trainer's bucket buffers; before blaming the
payload, this checks the mechanism alone with plain torch: the parent puts a CUDA tensor on a
``torch.multiprocessing`` queue (torch pickles it as a CUDA IPC handle), a spawned child opens it, checks
its contents, doubles it in place and answers; the parent then sees the doubled values in its own memory
(shared, not copied). Prints one line and exits 0 when all of that held, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import sys
import time


def _child(q, answers) -> None:
    import torch

    try:
        t0 = time.perf_counter()
        t = q.get(timeout=60)  # opens the parent's CUDA IPC handle
        opened = time.perf_counter() - t0
        ok = t.is_cuda and bool((t == 1).all())
        t.mul_(2)  # writes into the parent's allocation
        torch.cuda.synchronize()
        answers.put({"ok": ok, "device": str(t.device), "open_s": round(opened, 3)})
        del t
    except Exception as e:  # the parent reports it
        answers.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("cuda_ipc_probe: no CUDA device here", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    q, answers = ctx.Queue(), ctx.Queue()
    t = torch.ones(1 << 20, dtype=torch.float32, device="cuda")  # 4 MiB
    torch.cuda.synchronize()
    p = ctx.Process(target=_child, args=(q, answers))
    p.start()
    q.put(t)
    try:
        got = answers.get(timeout=120)
    except Exception as e:  # the child died or hung: say so
        got = {"ok": False, "error": f"no answer from the child ({type(e).__name__}), exit {p.exitcode}"}
    p.join(30)
    torch.cuda.synchronize()
    shared = bool((t == 2).all())
    ok = got.get("ok") and shared
    print(f"cuda_ipc_probe: {'ok' if ok else 'FAILED'}: child {got}, parent sees the child's write: {shared} "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
