"""The flattened-bucket byte layout is a wire format: these tests pin it."""

import pytest
import torch

from bridge.buckets import Bucket, flatten_tensors, plan_buckets, unflatten_bucket
from bridge.errors import ConfigError
from bridge.tensors import ParamSpec, dtype_from_str


def test_layout_is_concatenated_raw_bytes_in_names_order():
    a = torch.tensor([1.0, -2.0], dtype=torch.float32)
    b = torch.tensor([[3.0]], dtype=torch.bfloat16)
    bucket = plan_buckets([ParamSpec("b", (1, 1), torch.bfloat16), ParamSpec("a", (2,), torch.float32)], 1 << 20)[0]
    assert bucket.names == ["a", "b"]  # larger itemsize first keeps every offset aligned
    assert bucket.offsets == [0, 8]
    buf = flatten_tensors(bucket, {"a": a, "b": b})
    expected = torch.cat([a.view(torch.uint8), b.flatten().view(torch.uint8)])
    assert torch.equal(buf, expected)
    assert buf.tolist() == [0, 0, 128, 63, 0, 0, 0, 192, 64, 64]  # pinned bytes (little endian)
    out = dict(unflatten_bucket(buf, bucket.specs))
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)


def test_planner_respects_budget_and_never_splits():
    specs = [ParamSpec(f"p{i}", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 100])]
    buckets = plan_buckets(specs, bucket_bytes=80)
    assert [b.names for b in buckets] == [["p0", "p1"], ["p2"], ["p3"], ["p4"]]
    assert all(b.nbytes <= 80 or len(b.specs) == 1 for b in buckets)
    assert [n for b in buckets for n in b.names] == [s.name for s in specs]


def test_planner_ramps_from_a_small_first_bucket():
    """first_bytes: bucket k holds at most min(bucket_bytes, first_bytes * 2**k); a larger tensor still goes alone."""
    specs = [ParamSpec(f"p{i}", (n,), torch.float32) for i, n in enumerate([5, 5, 5, 5, 5, 5, 5, 5, 60, 20, 20, 20, 20])]
    buckets = plan_buckets(specs, bucket_bytes=160, first_bytes=40)
    assert [b.nbytes for b in buckets] == [40, 80, 40, 240, 160, 160]
    assert [n for b in buckets for n in b.names] == [s.name for s in specs]
    assert [b.names for b in plan_buckets(specs, 160, first_bytes=1000)] == [b.names for b in plan_buckets(specs, 160)]
    with pytest.raises(ConfigError, match="first bucket size must be positive"):
        plan_buckets(specs, 160, first_bytes=0)


def test_cast_on_pack():
    bucket = Bucket([ParamSpec("w", (3,), torch.bfloat16)])
    src = torch.tensor([1.1, 2.2, 3.3])
    out = dict(unflatten_bucket(flatten_tensors(bucket, {"w": src}), bucket.specs))
    assert torch.equal(out["w"], src.to(torch.bfloat16))


def test_bad_inputs_are_named():
    with pytest.raises(ConfigError, match="twice"):
        plan_buckets([ParamSpec("x", (1,), torch.float32)] * 2, 100)
    with pytest.raises(ConfigError, match="unaligned|multiple of its itemsize"):
        Bucket([ParamSpec("x", (1,), torch.bfloat16), ParamSpec("y", (1,), torch.float32)])
    with pytest.raises(ConfigError, match="12 bytes"):
        unflatten_bucket(torch.zeros(5, dtype=torch.uint8), [ParamSpec("x", (3,), torch.float32)])
    with pytest.raises(ConfigError, match="unknown dtype"):
        dtype_from_str("torch.float8")
    assert dtype_from_str("torch.bfloat16") is torch.bfloat16 and dtype_from_str("bf16") is torch.bfloat16
