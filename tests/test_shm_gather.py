"""The gather through shared memory (bridge.sources.shm) that a LoRA adapter's gather takes when every trainer rank
is on one host: the same bytes as the flat gather, on every placement and either destination rank; ranks that
cannot map the buffer keep every rank on the flat gather; a rank failing in it fails the others at once."""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_ranks

# Uneven rows (3 over 2 ranks: the last chunk is short; 1 row: rank 1 holds none), a plain (replicated) tensor, and
# a tensor of another dtype on the wire (bfloat16 beside float32: aligned offsets).
SHAPES = {"a": (3, 5), "b": (1, 4), "c": (6, 2), "plain": (2, 3), "d": (4, 4)}


def _gather_body(dst: int, unmappable_on: int | None = None, fail_on: int | None = None):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import bridge.sources.shm as shm
    from bridge.buckets import Bucket
    from bridge.sources import gather_bucket_into
    from bridge.tensors import ParamSpec

    rank = dist.get_rank()
    if unmappable_on == rank:  # as on a rank of another host (or another /dev/shm)
        def refuse(handle):
            raise RuntimeError("No such file or directory")
        shm._mapped = refuse
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same full tensors on both ranks
    full = {n: torch.randn(*s) for n, s in SHAPES.items()}
    params = {n: t if n == "plain" else distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    specs = [ParamSpec(n, s, torch.float32 if n == "d" else torch.bfloat16) for n, s in SHAPES.items()]
    bucket = Bucket(sorted(specs, key=lambda s: -s.dtype.itemsize))
    items = [(s, params[s.name]) for s in bucket.specs]
    gather = shm.SharedGather()
    usable = gather.usable(dst)
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8) if rank == dst else None
    gather_bucket_into(items, bucket, flat, dst=dst)
    if fail_on is not None:
        os.environ["WSYNC_FAILPOINTS"] = f"gather@{fail_on}=OSError"
    out = {"usable": usable}
    try:
        for round_ in range(2):  # the second time into the same buffer, whose views were kept
            buf = shm.shared_buffer(bucket.nbytes) if rank == dst else None
            if usable:
                gather.gather(items, bucket, buf, dst=dst)
            if rank == dst and usable:
                out[f"equal{round_}"] = torch.equal(buf, flat)
                expected = {s.name: full[s.name].to(s.dtype) for s in bucket.specs}
                out["values"] = all(torch.equal(buf[o : o + s.nbytes].view(s.dtype).view(s.shape), expected[s.name])
                                    for s, o in zip(bucket.specs, bucket.offsets))
    except Exception as e:  # the test reads what each rank raised
        out["error"] = f"{type(e).__name__}: {e}"
    gather.close()
    return out


@pytest.mark.parametrize("dst", [0, 1])
def test_same_bytes_as_the_flat_gather(dst):
    results = run_ranks(_gather_body, 2, args=(dst,), timeout=120)
    assert all(r["usable"] for r in results), results
    assert results[dst] == {"usable": True, "equal0": True, "equal1": True, "values": True}, results[dst]


def test_a_rank_that_cannot_map_keeps_every_rank_on_the_flat_gather():
    results = run_ranks(_gather_body, 2, args=(0, 1), timeout=120)
    assert [r["usable"] for r in results] == [False, False], results


def test_a_rank_failing_in_it_fails_the_others():
    results = run_ranks(_gather_body, 2, args=(0, None, 1), timeout=120)
    assert "OSError" in results[1]["error"], results
    assert "error" in results[0], results  # the barrier: gloo tells the waiting rank its peer left
