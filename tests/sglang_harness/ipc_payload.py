"""The colocated transport's SGLang payload checked by SGLang's own code, in a process where SGLang imports.

``python -m tests.sglang_harness.ipc_payload decode --sglang-dir DIR --model MODEL_DIR``: builds flattened and
per-tensor payloads for buckets of several dtypes with the project's :mod:`bridge.transports.cuda_ipc` (CPU
tensors: this machine has no GPU), hands every TP rank's entry to SGLang's own receive code (the harness's
receive side, :meth:`tests.sglang_harness.serve.Harness.receiver`: SGLang's ``TpModelWorker`` deserializes its
rank's entry, SGLang's model runner -- ``WeightUpdater`` from 0.5.2x -- runs ``update_weights_from_tensor``,
unflattening a flattened bucket with ``_update_weights_from_flattened_bucket``) around a model that records
what ``load_weights`` gets, and prints one JSON line: what was sent and what SGLang loaded, per bucket and rank,
for the test to compare.

``python -m tests.sglang_harness.ipc_payload send --sglang-dir DIR --url URL --model MODEL_DIR --load-format F``:
posts the model's weights, each tensor changed, in several buckets of the same payloads to a harness
server (SGLang's own receive code, see :mod:`tests.sglang_harness.serve`) inside one update session, and
prints one JSON line: the sha256 of every tensor sent (as SGLang's Qwen2 stacks them, and under HF names). The
reference server (``wsync serve``) takes the same payload. CPU tensors cross processes here through torch's
``file_system`` sharing strategy (shared-memory files named in the pickle); on a GPU the same payload
carries CUDA IPC handles instead.

``python -m tests.sglang_harness.ipc_payload cuda --sglang-dir DIR --model MODEL_DIR [--imports cuda|cpu]`` (a GPU
host): the same kinds of tensors, and one of a real layer's size, on the GPU; the trainer side builds flattened
and per-tensor payloads of them with :func:`bridge.transports.cuda_ipc.serialize_bucket`, so each entry carries
real CUDA IPC handles (device named by UUID), and keeps the buffers alive while a SEPARATE process
(``cuda-receive``) hands every TP rank's entry to SGLang's own receive code (as ``decode``, with the model
runner on ``cuda``), which opens the handles on the same GPU. Prints one JSON line: what was sent and what
SGLang loaded (names, dtypes, shapes, sha256 of the bytes, devices), per bucket and rank. ``--imports cpu``:
SGLang's modules import with CUDA hidden from their import-time probes (as in the CPU harness; the receive
itself still runs on the GPU), for a host where a CUDA-only import of a release fails; a failed import
prints ``SGLANG_IMPORT_FAILED`` and exits 3, so the caller can try the other way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import traceback

_release = None


IMPORT_FAILED = 3  # exit status of a run whose SGLang imports failed (``cuda`` modes)


def _setup(sglang_dir: str, cuda: bool = False) -> None:
    global _release
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.sglang_harness.bootstrap import setup

    _release = setup(sglang_dir, cuda=cuda)


def _specs():
    """Tensors of every kind a bucket may hold: bf16/fp16/fp32, integer buffers, a scalar, an empty tensor,
    odd sizes (offsets stay aligned by itemsize), and a tied pair (two names, identical bytes)."""
    import torch

    g = torch.Generator().manual_seed(3)
    emb = torch.randn(7, 5, generator=g).to(torch.bfloat16)
    return {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb.clone(),
        "layers.0.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(4, 3, generator=g),
        "layers.0.proj.bias": torch.randn(5, generator=g).to(torch.float16),
        "layers.0.position_ids": torch.arange(9, dtype=torch.int64).view(1, 9),
        "layers.0.counts": torch.tensor([-3, 0, 2**31 - 1], dtype=torch.int32),
        "layers.0.mask": torch.tensor([True, False, True]),
        "layers.0.scale": torch.tensor(0.125),
        "layers.0.empty": torch.empty(0, 4),
    }


def _describe(named) -> list:
    from bridge.digest import tensor_checksum

    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape), tensor_checksum(t)] for n, t in named]


def _recorder():
    """The model SGLang's receive code loads into here: ``load_weights`` keeps what it is given, in order."""
    import torch

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loaded = []

        def load_weights(self, weights):
            self.loaded.extend((name, t.detach().clone()) for name, t in weights)
            return {n for n, _ in self.loaded}

    return Recorder()


def decode(args) -> dict:
    from bridge.buckets import flatten_tensors, plan_buckets
    from bridge.tensors import ParamSpec
    from bridge.transports.cuda_ipc import serialize_bucket
    from tests.sglang_harness import serve

    # SGLang's own receive side (its TP worker deserializes its rank's entry with SGLang's SafeUnpickler; its
    # model runner, or 0.5.2x's WeightUpdater, unflattens a flattened bucket) around a recording model.
    recv = serve.Harness.receiver(serve._parse(["--sglang-dir", args.sglang_dir, "--model", args.model, "--port", "0"]),
                                  _release, _recorder())
    tensors = _specs()
    specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    payloads = []  # all built first: SGLang's receive patches torch's reductions in this process, for good
    for bucket in plan_buckets(specs, bucket_bytes=96):
        buf = flatten_tensors(bucket, tensors)
        sent = _describe((n, tensors[n]) for n in bucket.names)
        for flattened in (True, False):
            payloads.append((flattened, sent, serialize_bucket(bucket, buf, tp_size=args.tp_size, flattened=flattened)))
    out = {"buckets": [], "uuid_patch": _uuid_patch_scope()}
    for flattened, sent, entries in payloads:
        ranks = []
        for rank in range(len(entries)):
            recv.model.loaded.clear()
            ok, message = recv.load_tensor_entries(entries, "flattened_bucket" if flattened else None, rank)
            assert ok, message
            ranks.append(_describe(recv.model.loaded))
        out["buckets"].append({"flattened": flattened, "sent": sent, "ranks": ranks,
                               "entry_types": sorted({type(e).__name__ for e in entries})})
    return out


def _uuid_patch_scope() -> dict:
    """What a CUDA payload does around serializing (on CPU: the scope itself, not the CUDA pickles): SGLang's
    device-UUID patch of torch's reductions is active inside and gone afterwards, so CPU tensors pickle again
    (the patched reduction fails on them); a patch the process applied itself is left in place."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    from bridge.transports.cuda_ipc import _device_uuids

    def cpu_pickles() -> bool:
        try:
            ForkingPickler.dumps(torch.zeros(2))
            return True
        except IndexError:
            return False

    original = reductions.reduce_tensor
    with _device_uuids(monkey_patch_torch_reductions, cuda=True):
        inside = (reductions.rebuild_cuda_tensor.__module__ == "sglang.srt.utils.patch_torch"
                  and ForkingPickler._extra_reducers[torch.Tensor] is not original and not cpu_pickles())
    restored = (reductions.reduce_tensor is original and ForkingPickler._extra_reducers[torch.Tensor] is original
                and not hasattr(reductions, "_reduce_tensor_original") and cpu_pickles())
    monkey_patch_torch_reductions()  # as verl and slime do in the trainer
    with _device_uuids(monkey_patch_torch_reductions, cuda=True):
        pass
    kept = hasattr(reductions, "_reduce_tensor_original") and not cpu_pickles()
    return {"inside": inside, "restored": restored, "kept": kept}


def send(args) -> dict:
    import torch
    import torch.multiprocessing
    from safetensors.torch import load_file

    from bridge.buckets import flatten_tensors, plan_buckets
    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum
    from bridge.tensors import ParamSpec
    from bridge.transports.cuda_ipc import serialize_bucket

    # CPU stand-in for CUDA IPC: shared-memory files another process can open by name.
    torch.multiprocessing.set_sharing_strategy("file_system")
    weights = {}
    for f in sorted(os.listdir(args.model)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(args.model, f)))
    weights = {n: (t.float() * 0.5 + 0.25).to(torch.bfloat16) for n, t in weights.items()}
    if "lm_head.weight" not in weights:  # tied: a trainer sends the head too; SGLang's Qwen2 loader skips it
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in weights.items()]
    buckets = plan_buckets(specs, bucket_bytes=64 * 1024)
    flattened = args.load_format == "flattened_bucket"
    c = ServerClient(args.url)
    # Every bucket serialized before the session opens: the first serialization imports SGLang's serializer, which on
    # a loaded machine took longer than the server waits for a session's first request (--group-timeout).
    bufs = [flatten_tensors(bucket, weights) for bucket in buckets]
    payloads = [serialize_bucket(bucket, buf, tp_size=c.tp_size, flattened=flattened) for bucket, buf in zip(buckets, bufs)]
    c.begin_weight_update()
    for k, entries in enumerate(payloads):
        last = k == len(buckets) - 1
        c.update_weights_from_tensor(entries, load_format="flattened_bucket" if flattened else None, flush_cache=last,
                                     weight_version="ipc1" if last else None, timeout=60)
    c.end_weight_update()
    del bufs  # the server answered every bucket: it copied the bytes out
    from tests.sglang_harness.serve import sglang_layout

    # as SGLang's Qwen2 serves them: q/k/v and gate/up stacked
    return {"buckets": len(buckets), "checksums": {n: tensor_checksum(t) for n, t in sglang_layout(weights).items()},
            "hf_checksums": {n: tensor_checksum(t) for n, t in weights.items()}}


# ---------------------------------------------------------------------------------------------- CUDA IPC


@contextlib.contextmanager
def _sglang_imports(mode: str):
    """SGLang's modules import here. ``cuda``: as on any GPU host (their probes see CUDA). ``cpu``: as in the CPU
    harness -- ``torch.cuda.is_available`` answers False while they import, then the real one is back, so what
    runs afterwards (the receive) uses the GPU. Any failure prints ``SGLANG_IMPORT_FAILED`` and exits."""
    import torch

    real = torch.cuda.is_available
    if mode == "cpu":
        torch.cuda.is_available = lambda: False
    try:
        yield
    except Exception:  # any import-time failure: the caller may try the other mode
        traceback.print_exc()
        print(f"SGLANG_IMPORT_FAILED (imports={mode})", flush=True)
        sys.exit(IMPORT_FAILED)
    finally:
        torch.cuda.is_available = real


def _cuda_tensors() -> dict:
    """:func:`_specs` on the GPU, plus a layer-sized bf16 weight (3 MiB, a bucket of its own) and an fp16 bias."""
    import torch

    g = torch.Generator().manual_seed(5)
    tensors = dict(_specs())
    tensors["layers.1.mlp.down_proj.weight"] = torch.randn(1024, 1536, generator=g).to(torch.bfloat16)
    tensors["layers.1.mlp.down_proj.bias"] = torch.randn(1031, generator=g).to(torch.float16)
    return {n: t.cuda() for n, t in tensors.items()}


def cuda(args) -> dict:
    """The trainer side: CUDA payloads built with the project's serializer, received by ``cuda-receive``."""
    import torch

    from bridge.buckets import flatten_tensors, plan_buckets
    from bridge.tensors import ParamSpec
    from bridge.transports.cuda_ipc import serialize_bucket, sglang_code

    with _sglang_imports(args.imports):
        sglang_code()
    tensors = _cuda_tensors()
    specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    bufs, payloads = [], []  # the buffers stay alive until the receiver is done with their handles
    for bucket in plan_buckets(specs, bucket_bytes=96):
        buf = flatten_tensors(bucket, tensors, out=torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda"))
        bufs.append(buf)
        sent = _describe((n, tensors[n]) for n in bucket.names)
        for flattened in (True, False):
            entries = serialize_bucket(bucket, buf, tp_size=args.tp_size, flattened=flattened)
            payloads.append({"flattened": flattened, "sent": sent, "entries": entries})
    with tempfile.TemporaryDirectory(prefix="wsync-ipc-") as d:
        path = os.path.join(d, "payloads.json")
        with open(path, "w") as f:
            json.dump(payloads, f)
        received, log = _receive_elsewhere(args, path)
    if received is None:
        print(log[-6000:], file=sys.stderr, flush=True)
        if "SGLANG_IMPORT_FAILED" in log:
            print(f"SGLANG_IMPORT_FAILED (receiver, imports={args.imports})", flush=True)
            sys.exit(IMPORT_FAILED)
        raise RuntimeError("the receiving process gave no answer (its output is above)")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    buckets = []
    for p, r in zip(payloads, received["buckets"], strict=True):
        pickles = _disassembled(p["entries"])
        buckets.append({"flattened": p["flattened"], "sent": p["sent"], **r,
                        "entry_types": sorted({type(e).__name__ for e in p["entries"]}),
                        # every entry names torch's CUDA rebuild (an IPC handle, not a shared-memory file; SGLang's
                        # patched one) and this GPU's UUID
                        "cuda_rebuild": all("rebuild_cuda_tensor" in d for d in pickles),
                        "device_uuid": all(uuid in d for d in pickles)})
    del bufs
    return {"imports": args.imports, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "sender_pid": os.getpid(), "receiver_pid": received["pid"], "buckets": buckets}


def _disassembled(entries) -> list[str]:
    """Each entry's pickle as text (``pickletools``): the functions and strings it names."""
    import base64
    import io
    import pickletools

    out = []
    for e in entries:
        buf = io.StringIO()
        pickletools.dis(base64.b64decode(e), out=buf)
        out.append(buf.getvalue())
    return out


def _receive_elsewhere(args, path: str):
    """Run ``cuda-receive`` in a process of its own on ``path``; its JSON answer (or None) and its output."""
    cmd = [sys.executable, "-m", "tests.sglang_harness.ipc_payload", "cuda-receive", "--sglang-dir", args.sglang_dir,
           "--model", args.model, "--payloads", path, "--imports", args.imports]
    with tempfile.TemporaryFile("w+") as out:
        try:
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            pass
        out.seek(0)
        log = out.read()
    lines = [ln for ln in log.splitlines() if ln.startswith("IPC_PAYLOAD ")]
    return (json.loads(lines[-1].removeprefix("IPC_PAYLOAD ")) if lines else None), log


def cuda_receive(args) -> dict:
    """The server side, in its own process: SGLang's receive code (model runner on ``cuda``) opens each entry."""
    from tests.sglang_harness import serve

    with _sglang_imports(args.imports):
        recv = serve.Harness.receiver(serve._parse(["--sglang-dir", args.sglang_dir, "--model", args.model,
                                                    "--port", "0", "--device", "cuda"]), _release, _recorder())
    with open(args.payloads) as f:
        payloads = json.load(f)
    buckets = []
    for p in payloads:
        ranks, devices = [], set()
        for rank in range(len(p["entries"])):
            recv.model.loaded.clear()
            ok, message = recv.load_tensor_entries(p["entries"], "flattened_bucket" if p["flattened"] else None, rank)
            assert ok, message
            devices |= {str(t.device) for _, t in recv.model.loaded}
            ranks.append(_describe(recv.model.loaded))
        buckets.append({"ranks": ranks, "devices": sorted(devices)})
    return {"pid": os.getpid(), "buckets": buckets}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("decode", "send", "cuda", "cuda-receive"))
    p.add_argument("--sglang-dir", required=True)
    p.add_argument("--tp-size", type=int, default=3)
    p.add_argument("--url")
    p.add_argument("--model")
    p.add_argument("--load-format", default="flattened_bucket")
    p.add_argument("--imports", choices=("cuda", "cpu"), default="cuda", help="cuda modes: how SGLang imports")
    p.add_argument("--payloads", help="cuda-receive: the JSON file of payloads the cuda mode wrote")
    p.add_argument("--timeout", type=float, default=300, help="cuda: seconds the receiving process may take")
    args = p.parse_args(argv)
    on_gpu = args.what in ("cuda", "cuda-receive")
    if on_gpu:
        import torch

        if not torch.cuda.is_available():
            print(f"ipc_payload {args.what}: needs a CUDA device (torch {torch.__version__} sees none)", file=sys.stderr)
            return 2
    _setup(args.sglang_dir, cuda=on_gpu)
    modes = {"decode": decode, "send": send, "cuda": cuda, "cuda-receive": cuda_receive}
    out = modes[args.what](args)
    print("IPC_PAYLOAD " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
