"""The fast bucket gather must reproduce DTensor.full_tensor() exactly, whatever the sharding."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_ranks


def _gather_matches_full_tensor():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from bridge.buckets import flatten_tensors, plan_buckets
    from bridge.sources import ModuleSource, gather_bucket_into

    torch.manual_seed(0)
    # Odd first dims (uneven torch.chunk splits, an empty shard at world 3), a 1-D bias, a buffer-like
    # replicated parameter left unsharded, and mixed dtypes on the wire.
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 1), torch.nn.Embedding(2, 3))
    fully_shard(model[0])
    fully_shard(model[1])
    source = ModuleSource(model)
    specs = source.param_specs()
    specs = [s.with_dtype(torch.bfloat16) if i % 2 else s for i, s in enumerate(specs)]
    results = []
    scratch: dict = {}  # the send and receive buffers kept from one gather to the next (an adapter's publishes)
    for piece_bytes in (1, 64, 1 << 20):  # one parameter per piece, a few per piece, all in one
        for bucket in plan_buckets(specs, 1 << 20):
            for keep in (None, scratch, scratch):  # fresh buffers, then the kept ones twice, the weights changed between
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                out = torch.zeros(bucket.nbytes, dtype=torch.uint8) if dist.get_rank() == 0 else None
                gather_bucket_into([(s, source._params[s.name]) for s in bucket.specs], bucket, out,
                                   piece_bytes=piece_bytes, scratch=keep)
                full = {s.name: t for s, t in source.iter_full_tensors(bucket.specs)}
                if out is not None:
                    results.append(torch.equal(out, flatten_tensors(bucket, full)))
    return results + [bool(scratch)]


@pytest.mark.parametrize("world", [2, 3])
def test_flat_bucket_gather_equals_full_tensor(world):
    results = run_ranks(_gather_matches_full_tensor, world, timeout=120)
    assert results[0] and all(results[0])
