"""Your own training loop: an HF model sharded with FSDP2, plain AdamW, a publish after every optimizer step,
and a check that each server serves exactly the trainer's weights.

    torchrun --nproc-per-node 2 examples/own_loop.py                   # starts a reference server itself
    torchrun --nproc-per-node 2 examples/own_loop.py --server http://10.0.0.5:30000 --model /path/to/hf-dir

Every rank runs this same script; ``publish()`` is collective, so every rank calls it with the same version.
On GPUs use ``nccl`` (``dist.init_process_group("nccl")`` and ``model.cuda()`` before ``fully_shard``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from bridge import PublisherConfig, WeightPublisher
from bridge.client import ServerClient
from bridge.digest import tensor_checksum


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", help="a running server (real SGLang or `wsync serve`) serving the same model; "
                                    "default: rank 0 starts a reference server of the tiny preset")
    p.add_argument("--model", help="a local HF model directory (default: the tiny preset's config, random weights)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        from bridge.local.presets import build_config

        model = AutoModelForCausalLM.from_config(build_config("tiny"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    server, url = None, [args.server]
    if args.server is None and rank == 0:
        from inference_adapter import launch_server

        server = launch_server(model=args.model, preset=None if args.model else "tiny")
        url = [server.url]
    dist.broadcast_object_list(url, src=0)

    publisher = WeightPublisher(PublisherConfig(transport="broadcast", servers=url, serving_dtype="bfloat16",
                                                progress=False))
    try:
        for step in range(1, args.steps + 1):
            ids = torch.randint(3, model.config.vocab_size, (4, 32))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result = publisher.publish(model, version=step)  # every rank, after the optimizer step
            # The check: every served tensor against the trainer's, cast to the serving dtype (collective gather).
            full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
            if rank == 0:
                want = {n: tensor_checksum(t.detach().to(torch.bfloat16)) for n, t in full.items()}
                served = ServerClient(url[0]).weights_checksum(list(want))["checksums"]
                print(f"step {step}: published v{result.version} in {result.seconds:.2f} s, "
                      f"served bit-equal: {served == want}", flush=True)
    finally:
        publisher.close()
        if server is not None:
            server.stop()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
