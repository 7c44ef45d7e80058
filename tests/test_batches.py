"""A trainer's batch may be a TensorDict or a plain dict of tensors (trainer.data.as_batch)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from bridge.errors import ConfigError
from trainer.data import pack_micro_batches, validate_batch

IDS = torch.tensor([[5, 6, 7, 0], [0, 0, 8, 9]])
MASK = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])


def test_a_plain_dict_packs_like_a_tensordict():
    plain = {"input_ids": IDS, "attention_mask": MASK, "reward": torch.tensor([1.0, 2.0])}
    wrapped = TensorDict(plain, batch_size=[2])
    validate_batch(plain)
    got = [(mb.data["input_ids"].tolist(), mb.data["reward"].tolist()) for mb in pack_micro_batches(plain, 4)]
    want = [(mb.data["input_ids"].tolist(), mb.data["reward"].tolist()) for mb in pack_micro_batches(wrapped, 4)]
    assert got == want == [([[5, 6, 7]], [1.0]), ([[8, 9]], [2.0])]


def test_a_dict_whose_tensors_disagree_on_the_batch_size_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"2 rows of input_ids first; got .*'attention_mask': \(1, 4\)"):
        validate_batch({"input_ids": IDS, "attention_mask": MASK[:1]})
    with pytest.raises(ConfigError, match="TensorDict or a dict of tensors"):
        validate_batch([IDS, MASK])
